"""RadixTree: matching and inserting whole pages, splits, extra-key isolation, locks, LRU
eviction planning across device, host and disk, the plan/commit protocol, chained page hashes.

Exact ids and orders throughout. With ``PAGE = 4``, ``toks(0, 1, 9)`` is the three pages
0..3, 4..7, 36..39, and ``shape(tree)`` lists each node as (depth, page labels, device ids,
host ids), depth first. A hypothesis state machine runs random operation sequences against a
per-page dict model and checks the invariants of the module docstring after every step.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from longctx.cache.block_pool import BlockPool
from longctx.cache.radix_tree import (EvictionMove, PageLocation, RadixTree, Tier, TreeNode,
                                      page_hashes)

PAGE = 4


def toks(*labels: int) -> list[int]:
    """Whole pages: label ``p`` is the page of tokens ``4p .. 4p + 3``."""
    return [PAGE * label + i for label in labels for i in range(PAGE)]


def labels(tokens) -> tuple[int, ...]:
    return tuple(t // PAGE for t in tokens[::PAGE])


def shape(tree: RadixTree) -> list[tuple]:
    return [(len(tree.path(n)), labels(n.tokens), n.device_ids, n.host_ids) for n in tree.nodes()]


def plan(moves: list[EvictionMove]) -> list[tuple]:
    return [(labels(m.node.tokens), m.source_ids, m.target, m.target_ids, m.drops) for m in moves]


def commit_all(tree: RadixTree, moves: list[EvictionMove]) -> list[list[int]]:
    return [tree.commit(m) for m in moves]


def written_back(tree: RadixTree, tokens: list[int], device_ids: list[int]) -> TreeNode:
    """Insert ``tokens`` and move their node to the host; returns the node."""
    node = tree.insert(tokens, "m", device_ids).node
    assert commit_all(tree, tree.evict_device(len(device_ids))) == [device_ids]
    assert node.device_ids is None and node.host_ids is not None
    return node


# ---------------------------------------------------------------------------- construction


def test_radix_tree_module_does_not_import_torch():
    code = ("import sys, longctx.cache.radix_tree; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("kwargs, message", [
    ({"page_size": 0}, r"page_size must be >= 1, got 0"),
    ({"page_size": 4, "host_capacity_pages": -1}, r"host_capacity_pages must be >= 0, got -1"),
])
def test_constructor_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RadixTree(**kwargs)


def test_empty_tree():
    tree = RadixTree(PAGE, host_capacity_pages=3)
    m = tree.match_prefix(toks(0, 1), "m")
    assert (m.num_tokens, m.last_node, m.nodes, m.pages) == (0, None, (), ())
    assert (tree.num_device_pages, tree.num_host_pages, tree.num_disk_pages) == (0, 0, 0)
    assert tree.num_free_host_pages == 3
    assert list(tree.nodes()) == []
    assert tree.evict_device(5) == [] and tree.evict_host(5) == []


# ---------------------------------------------------------------------------- match and insert


def test_insert_then_match_returns_the_block_ids():
    tree = RadixTree(PAGE)
    res = tree.insert(toks(0, 1, 2), "m", [7, 8, 9])
    assert (res.owned, res.duplicates) == ([7, 8, 9], [])
    assert shape(tree) == [(1, (0, 1, 2), [7, 8, 9], None)]
    m = tree.match_prefix(toks(0, 1, 2), "m")
    assert (m.num_tokens, m.device_ids, m.pages_to_load) == (12, [7, 8, 9], [])
    assert m.pages == tuple(PageLocation(Tier.DEVICE, i) for i in (7, 8, 9))
    assert m.last_node is res.node and m.nodes == (res.node,)
    assert tree.num_device_pages == 3


def test_match_of_a_longer_query_splits_nothing():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [3, 4])
    m = tree.match_prefix(toks(0, 1, 2, 3) + [1, 2], "m")
    assert (m.num_tokens, m.device_ids) == (8, [3, 4])
    assert shape(tree) == [(1, (0, 1), [3, 4], None)]


def test_match_ending_inside_a_node_splits_it_at_the_page_boundary():
    tree = RadixTree(PAGE)
    node = tree.insert(toks(0, 1, 2), "m", [7, 8, 9]).node
    m = tree.match_prefix(toks(0, 1, 5), "m")
    assert (m.num_tokens, m.device_ids) == (8, [7, 8])
    assert shape(tree) == [(1, (0, 1), [7, 8], None), (2, (2,), [9], None)]
    assert m.last_node.tokens == tuple(toks(0, 1))
    assert node.tokens == tuple(toks(2)) and node.parent is m.last_node  # handles keep the tail


def test_match_with_a_different_first_page_finds_nothing():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    m = tree.match_prefix(toks(1, 0), "m")
    assert (m.num_tokens, m.last_node, m.pages) == (0, None, ())


def test_partial_pages_are_never_shared():
    tree = RadixTree(PAGE)
    res = tree.insert(list(range(10)), "m", [0, 1])  # 2 full pages; tokens 8, 9 ignored
    assert res.owned == [0, 1]
    assert tree.match_prefix(list(range(10)), "m").num_tokens == 8
    assert tree.match_prefix(list(range(7)), "m").num_tokens == 4
    assert tree.match_prefix(list(range(3)), "m").num_tokens == 0
    res = tree.insert(list(range(9)) + [99], "m", [5, 6])  # differs only in the partial page
    assert (res.owned, res.duplicates) == ([], [5, 6])
    assert shape(tree) == [(1, (0,), [0], None), (2, (1,), [1], None)]


def test_insert_needs_one_device_id_per_full_page():
    tree = RadixTree(PAGE)
    with pytest.raises(ValueError, match=r"^2 full pages need as many device ids, got 3$"):
        tree.insert(list(range(10)), "m", [0, 1, 2])
    res = tree.insert([1, 2, 3], "m", [])
    assert (res.node, res.owned, res.duplicates) == (None, [], [])
    assert list(tree.nodes()) == []


def test_second_sequence_diverging_mid_node_splits_it():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1, 2), "m", [0, 1, 2])
    res = tree.insert(toks(0, 1, 9), "m", [5, 6, 3])
    assert (res.owned, res.duplicates) == ([3], [5, 6])
    assert shape(tree) == [(1, (0, 1), [0, 1], None), (2, (2,), [2], None),
                           (2, (9,), [3], None)]
    assert res.node.tokens == tuple(toks(9))


def test_divergence_inside_a_page_shares_only_the_pages_before_it():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1, 2), "m", [0, 1, 2])
    res = tree.insert(toks(0) + [4, 5, 99, 99] + toks(3), "m", [10, 11, 12])
    assert (res.owned, res.duplicates) == ([11, 12], [10])
    assert [(len(tree.path(n)), n.tokens, n.device_ids) for n in tree.nodes()] == [
        (1, (0, 1, 2, 3), [0]),
        (2, (4, 5, 6, 7, 8, 9, 10, 11), [1, 2]),
        (2, (4, 5, 99, 99, 12, 13, 14, 15), [11, 12]),
    ]


def test_inserting_a_prefix_of_a_node_splits_it_and_returns_the_head():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1, 2), "m", [0, 1, 2])
    res = tree.insert(toks(0, 1), "m", [4, 5])
    assert (res.owned, res.duplicates) == ([], [4, 5])
    assert res.node.tokens == tuple(toks(0, 1))
    assert shape(tree) == [(1, (0, 1), [0, 1], None), (2, (2,), [2], None)]


def test_insert_of_the_trees_own_ids_counts_them_as_duplicates():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    res = tree.insert(toks(0, 1, 2), "m", [0, 1, 7])  # a block table built from a match
    assert (res.owned, res.duplicates) == ([7], [0, 1])
    assert shape(tree) == [(1, (0, 1), [0, 1], None), (2, (2,), [7], None)]


def test_insert_rejects_ids_the_tree_holds_for_other_pages():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    with pytest.raises(ValueError, match=r"^device block 1 is already held by the prefix tree"):
        tree.insert(toks(5, 6), "m", [1, 9])
    with pytest.raises(ValueError, match=r"^device block 0 is already held"):
        tree.insert(toks(0, 1), "other", [0, 1])
    with pytest.raises(ValueError, match=r"^device ids must be distinct, got \[3, 3\]$"):
        tree.insert(toks(5, 6), "m", [3, 3])
    assert shape(tree) == [(1, (0, 1), [0, 1], None)]
    assert tree.num_device_pages == 2


def test_extra_keys_never_share_nodes():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "model-a", [0, 1])
    m = tree.match_prefix(toks(0, 1), "model-b")
    assert (m.num_tokens, m.last_node) == (0, None)
    assert tree.insert(toks(0, 1), "model-b", [2, 3]).owned == [2, 3]
    assert tree.insert(toks(0, 1), ("model-a", "salt"), [4, 5]).owned == [4, 5]
    assert tree.match_prefix(toks(0, 1), "model-a").device_ids == [0, 1]
    assert tree.match_prefix(toks(0, 1), "model-b").device_ids == [2, 3]
    assert tree.match_prefix(toks(0, 1, 2), ("model-a", "salt")).device_ids == [4, 5]
    assert [(n.extra_key, n.device_ids) for n in tree.nodes()] == [
        ("model-a", [0, 1]), ("model-b", [2, 3]), (("model-a", "salt"), [4, 5])]
    hashes = [n.page_hashes for n in tree.nodes()]
    assert hashes[0] != hashes[1] != hashes[2] != hashes[0]


# ---------------------------------------------------------------------------- locks


def two_branches(tree: RadixTree) -> tuple[TreeNode, TreeNode, TreeNode]:
    """root - P(0, 1)[0, 1] - L1(2)[2], L2(3)[3]; returns (P, L1, L2)."""
    l1 = tree.insert(toks(0, 1, 2), "m", [0, 1, 2]).node
    l2 = tree.insert(toks(0, 1, 3), "m", [0, 1, 3]).node
    return l1.parent, l1, l2


def test_lock_counts_up_the_path_and_unlock_below_zero_raises():
    tree = RadixTree(PAGE)
    parent, child, other = two_branches(tree)
    tree.lock(child)
    tree.lock(child)
    tree.lock(parent)
    assert [(n.lock_count, n.num_own_locks) for n in (parent, child, other)] == [
        (3, 1), (2, 2), (0, 0)]
    tree.unlock(parent)
    with pytest.raises(ValueError, match=r"^unlock of node \d+ without a matching lock$"):
        tree.unlock(parent)  # its count is 2, but those locks are the child's
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(other)
    assert [n.lock_count for n in (parent, child, other)] == [2, 2, 0]
    tree.unlock(child)
    tree.unlock(child)
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(child)
    assert [n.lock_count for n in (parent, child, other)] == [0, 0, 0]


def test_locked_deep_node_protects_its_ancestors():
    tree = RadixTree(PAGE)
    parent, deep, other = two_branches(tree)
    tree.lock(deep)
    moves = tree.evict_device(10)
    assert plan(moves) == [((3,), (3,), None, (), True)]
    assert commit_all(tree, moves) == [[3]]
    assert tree.evict_device(10) == []
    assert shape(tree) == [(1, (0, 1), [0, 1], None), (2, (2,), [2], None)]
    tree.unlock(deep)
    assert plan(tree.evict_device(10)) == [((2,), (2,), None, (), True),
                                           ((0, 1), (0, 1), None, (), True)]


def test_a_split_keeps_the_locks_on_the_tail():
    tree = RadixTree(PAGE)
    node = tree.insert(toks(0, 1, 2), "m", [0, 1, 2]).node
    tree.lock(node)
    head = tree.match_prefix(toks(0, 5), "m").last_node
    assert head.tokens == tuple(toks(0)) and node.parent is head
    assert [(n.lock_count, n.num_own_locks) for n in (head, node)] == [(1, 0), (1, 1)]
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(head)
    tree.unlock(node)
    assert [n.lock_count for n in (head, node)] == [0, 0]


def test_locking_a_node_no_longer_in_the_tree_raises():
    tree = RadixTree(PAGE)
    node = tree.insert(toks(0), "m", [0]).node
    assert commit_all(tree, tree.evict_device(1)) == [[0]]
    with pytest.raises(ValueError, match=rf"^node {node.node_id} is not in this tree"):
        tree.lock(node)
    assert node.lock_count == 0


# ---------------------------------------------------------------------------- LRU eviction


def test_lru_evicts_least_recently_used_first():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])  # A
    tree.insert(toks(2), "m", [2])  # B
    tree.insert(toks(3, 4), "m", [3, 4])  # C
    tree.match_prefix(toks(0, 1), "m")  # A is now the most recent
    moves = tree.evict_device(1)
    assert plan(moves) == [((2,), (2,), None, (), True)]
    assert commit_all(tree, moves) == [[2]]
    moves = tree.evict_device(3)
    assert plan(moves) == [((3, 4), (3, 4), None, (), True), ((0, 1), (0, 1), None, (), True)]
    assert commit_all(tree, moves) == [[3, 4], [0, 1]]
    assert list(tree.nodes()) == [] and tree.num_device_pages == 0
    assert tree.stats.evicted_pages == {Tier.DEVICE: 5, Tier.HOST: 0, Tier.DISK: 0}


def test_leaves_go_before_their_parent_even_when_it_is_older():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    tree.insert(toks(0, 2), "m", [9, 2])  # P(0)[0] - Q(1)[1], R(2)[2]
    assert shape(tree) == [(1, (0,), [0], None), (2, (1,), [1], None), (2, (2,), [2], None)]
    moves = tree.evict_device(3)
    assert plan(moves) == [((1,), (1,), None, (), True), ((2,), (2,), None, (), True),
                           ((0,), (0,), None, (), True)]
    assert commit_all(tree, moves) == [[1], [2], [0]]
    assert list(tree.nodes()) == []


def test_evict_device_stops_once_enough_pages_are_planned():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    tree.insert(toks(0, 2), "m", [0, 2])
    assert plan(tree.evict_device(1)) == [((1,), (1,), None, (), True)]
    assert plan(tree.evict_device(1)) == [((2,), (2,), None, (), True)]
    assert plan(tree.evict_device(1)) == [((0,), (0,), None, (), True)]
    assert tree.evict_device(1) == []  # all in flight


def test_committing_a_parent_before_its_children_keeps_its_pages():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1), "m", [0, 1])
    tree.insert(toks(0, 2), "m", [0, 2])
    q, r, p = tree.evict_device(3)
    assert tree.commit(p) == []
    assert (tree.commit(q), tree.commit(r)) == ([1], [2])
    assert shape(tree) == [(1, (0,), [0], None)]
    assert plan(tree.evict_device(1)) == [((0,), (0,), None, (), True)]


def test_eviction_policy_is_pluggable():
    class MostRecentFirst:
        def key(self, node):
            return -node.last_access

    tree = RadixTree(PAGE, eviction_policy=MostRecentFirst())
    tree.insert(toks(0), "m", [0])
    tree.insert(toks(1), "m", [1])
    tree.insert(toks(2), "m", [2])
    assert [m.source_ids for m in tree.evict_device(2)] == [(2,), (1,)]


# ---------------------------------------------------------------------------- host and disk tiers


def test_write_back_to_host_then_hit_on_host_then_load():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1), "m", [3, 4])
    [move] = tree.evict_device(2)
    assert plan([move]) == [((0, 1), (3, 4), Tier.HOST, (0, 1), False)]
    assert move.write_back and move.source is Tier.DEVICE
    assert tree.num_free_host_pages == 2  # reserved at plan time
    assert tree.match_prefix(toks(0, 1), "m").device_ids == [3, 4]  # still valid until commit
    assert tree.commit(move) == [3, 4]
    assert (tree.num_device_pages, tree.num_host_pages) == (0, 2)
    m = tree.match_prefix(toks(0, 1), "m")
    assert (m.num_tokens, m.device_ids) == (8, [])
    assert m.pages == (PageLocation(Tier.HOST, 0), PageLocation(Tier.HOST, 1))
    assert m.pages_to_load == list(m.pages)
    assert tree.stats.hit_tokens[Tier.HOST] == 8
    tree.lock(m.last_node)
    assert tree.load_to_device(m, [10, 11]) == []
    tree.unlock(m.last_node)
    assert shape(tree) == [(1, (0, 1), [10, 11], [0, 1])]
    assert tree.match_prefix(toks(0, 1), "m").device_ids == [10, 11]
    moves = tree.evict_device(2)  # a host copy exists: nothing to copy
    assert plan(moves) == [((0, 1), (10, 11), None, (), False)]
    assert commit_all(tree, moves) == [[10, 11]]
    assert shape(tree) == [(1, (0, 1), None, [0, 1])]


def test_device_eviction_drops_when_the_host_is_full():
    tree = RadixTree(PAGE, host_capacity_pages=1)
    tree.insert(toks(0, 1), "m", [0, 1])
    moves = tree.evict_device(2)
    assert plan(moves) == [((0, 1), (0, 1), None, (), True)]
    assert commit_all(tree, moves) == [[0, 1]]
    assert list(tree.nodes()) == [] and tree.num_free_host_pages == 1


def test_write_back_fills_host_then_drops_leaves():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    tree.insert(toks(0), "m", [0])
    tree.insert(toks(1, 2), "m", [1, 2])
    tree.insert(toks(3), "m", [3])
    moves = tree.evict_device(4)
    assert plan(moves) == [((0,), (0,), Tier.HOST, (0,), False),
                           ((1, 2), (1, 2), None, (), True),
                           ((3,), (3,), Tier.HOST, (1,), False)]
    assert commit_all(tree, moves) == [[0], [1, 2], [3]]
    assert shape(tree) == [(1, (0,), None, [0]), (1, (3,), None, [1])]


def test_host_eviction_without_disk_drops_leaves_first():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1, 2), "m", [0, 1, 2])
    tree.insert(toks(0, 1, 3), "m", [0, 1, 3])
    moves = tree.evict_device(4)
    assert plan(moves) == [((2,), (2,), Tier.HOST, (0,), False),
                           ((3,), (3,), Tier.HOST, (1,), False),
                           ((0, 1), (0, 1), Tier.HOST, (2, 3), False)]
    commit_all(tree, moves)
    assert shape(tree) == [(1, (0, 1), None, [2, 3]), (2, (2,), None, [0]), (2, (3,), None, [1])]
    moves = tree.evict_host(4)
    assert plan(moves) == [((2,), (0,), None, (), True), ((3,), (1,), None, (), True),
                           ((0, 1), (2, 3), None, (), True)]
    assert commit_all(tree, moves) == [[0], [1], [2, 3]]
    assert list(tree.nodes()) == [] and tree.num_free_host_pages == 4
    assert tree.stats.evicted_pages == {Tier.DEVICE: 4, Tier.HOST: 4, Tier.DISK: 0}


def test_host_eviction_to_disk_uses_the_chained_page_hashes():
    tree = RadixTree(PAGE, host_capacity_pages=4, disk_tier=True)
    tokens = toks(0, 1, 2)
    tail = tree.insert(tokens, "m", [5, 6, 7]).node
    head = tree.match_prefix(toks(0, 9), "m").last_node  # split: head (0), tail (1, 2)
    commit_all(tree, tree.evict_device(3))
    assert shape(tree) == [(1, (0,), None, [2]), (2, (1, 2), None, [0, 1])]
    hashes = page_hashes(tokens, "m", PAGE)
    moves = tree.evict_host(3)
    assert plan(moves) == [((1, 2), (0, 1), Tier.DISK, tuple(hashes[1:]), False),
                           ((0,), (2,), Tier.DISK, tuple(hashes[:1]), False)]
    assert tree.match_prefix(tokens, "m").pages[0] == PageLocation(Tier.HOST, 2)
    assert commit_all(tree, moves) == [[0, 1], [2]]
    assert (head.disk_keys, tail.disk_keys) == (hashes[:1], hashes[1:])
    assert (tree.num_host_pages, tree.num_disk_pages, tree.num_free_host_pages) == (0, 3, 4)
    m = tree.match_prefix(tokens, "m")
    assert m.pages == tuple(PageLocation(Tier.DISK, h) for h in hashes)
    assert tree.stats.hit_tokens[Tier.DISK] == 12
    assert tree.load_to_device(m, [7, 8, 9]) == []
    assert tree.match_prefix(tokens, "m").device_ids == [7, 8, 9]
    assert tree.evict_host(3) == []  # nothing on the host


def test_host_eviction_of_a_device_resident_node_frees_only_the_host_copy():
    tree = RadixTree(PAGE, host_capacity_pages=2, disk_tier=True)
    node = written_back(tree, toks(0, 1), [0, 1])
    m = tree.match_prefix(toks(0, 1), "m")
    tree.lock(node)
    tree.load_to_device(m, [5, 6])
    assert tree.evict_host(2) == []  # locked
    tree.unlock(node)
    moves = tree.evict_host(2)
    assert plan(moves) == [((0, 1), (0, 1), None, (), False)]
    assert commit_all(tree, moves) == [[0, 1]]
    assert shape(tree) == [(1, (0, 1), [5, 6], None)]
    assert (tree.num_free_host_pages, tree.num_disk_pages) == (2, 0)


def test_load_to_device_of_a_mixed_match_loads_only_the_off_device_pages():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    tree.insert(toks(0, 1), "m", [0, 1])
    tree.match_prefix(toks(0), "m")  # split, and the head (0) is now more recent
    commit_all(tree, tree.evict_device(1))
    assert shape(tree) == [(1, (0,), [0], None), (2, (1,), None, [0])]
    m = tree.match_prefix(toks(0, 1), "m")
    assert (m.device_ids, m.pages_to_load) == ([0], [PageLocation(Tier.HOST, 0)])
    with pytest.raises(ValueError, match=r"^the match has 1 pages to load, got 2 device ids$"):
        tree.load_to_device(m, [5, 6])
    with pytest.raises(ValueError, match="distinct and not held by the tree"):
        tree.load_to_device(m, [0])
    assert tree.load_to_device(m, [5]) == []
    assert shape(tree) == [(1, (0,), [0], None), (2, (1,), [5], [0])]


def test_load_returns_ids_for_pages_already_loaded_and_rejects_stale_matches():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    node = written_back(tree, toks(0, 1), [0, 1])
    first, second = tree.match_prefix(toks(0, 1), "m"), tree.match_prefix(toks(0, 1), "m")
    assert tree.load_to_device(first, [4, 5]) == []
    assert tree.load_to_device(second, [6, 7]) == [6, 7]  # another request was faster
    device_match = tree.match_prefix(toks(0, 1), "m")
    commit_all(tree, tree.evict_device(2))  # unlocked: its pages leave the device
    with pytest.raises(ValueError, match=r"^stale match"):
        tree.load_to_device(device_match, [])
    assert node.device_ids is None


def test_insert_adopts_device_ids_for_pages_held_off_device():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    written_back(tree, toks(0, 1), [0, 1])
    res = tree.insert(toks(0, 1, 2), "m", [5, 6, 7])
    assert (res.owned, res.duplicates) == ([5, 6, 7], [])
    assert shape(tree) == [(1, (0, 1), [5, 6], [0, 1]), (2, (2,), [7], None)]


# ---------------------------------------------------------------------------- plan / commit


def test_a_node_locked_between_plan_and_commit_keeps_its_pages():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1), "m", [3, 4])
    [move] = tree.evict_device(2)
    tree.lock(tree.match_prefix(toks(0, 1), "m").last_node)
    assert tree.commit(move) == []  # the copy is recorded, the device pages stay
    assert shape(tree) == [(1, (0, 1), [3, 4], [0, 1])]
    assert (tree.num_device_pages, tree.num_host_pages, tree.num_free_host_pages) == (2, 2, 2)
    assert tree.stats.evicted_pages[Tier.DEVICE] == 0


def test_a_node_that_gained_a_device_child_keeps_its_pages():
    tree = RadixTree(PAGE)
    tree.insert(toks(0), "m", [0])
    [move] = tree.evict_device(1)
    assert move.drops
    tree.insert(toks(0, 1), "m", [0, 1])
    assert tree.commit(move) == []
    assert shape(tree) == [(1, (0,), [0], None), (2, (1,), [1], None)]


def test_abort_gives_back_the_reserved_host_ids():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    tree.insert(toks(0, 1), "m", [3, 4])
    [move] = tree.evict_device(2)
    assert tree.num_free_host_pages == 0
    assert tree.evict_device(2) == []  # frozen while in flight
    tree.abort(move)
    assert tree.num_free_host_pages == 2
    with pytest.raises(ValueError, match=rf"^move {move.move_id} is not in flight"):
        tree.commit(move)
    [again] = tree.evict_device(2)
    assert again.target_ids == (0, 1)
    assert tree.commit(again) == [3, 4]
    with pytest.raises(ValueError, match="not in flight"):
        tree.abort(again)
    assert shape(tree) == [(1, (0, 1), None, [0, 1])]


def test_a_node_split_while_in_flight_commits_both_halves():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1, 2), "m", [5, 6, 7])
    [move] = tree.evict_device(3)
    assert tree.match_prefix(toks(0, 9), "m").device_ids == [5]  # splits the frozen node
    assert tree.evict_device(3) == []  # both halves frozen
    assert tree.commit(move) == [5, 6, 7]
    assert shape(tree) == [(1, (0,), None, [0]), (2, (1, 2), None, [1, 2])]


def test_an_in_flight_node_split_twice_commits_deepest_first():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1, 2), "m", [5, 6, 7])
    [move] = tree.evict_device(3)
    tree.match_prefix(toks(0, 9), "m")  # head (0), tail (1, 2)
    tree.match_prefix(toks(0, 1, 9), "m")  # the tail splits again: (1) between (0) and (2)
    assert tree.commit(move) == [5, 6, 7]
    assert shape(tree) == [(1, (0,), None, [0]), (2, (1,), None, [1]), (3, (2,), None, [2])]


def test_a_split_head_that_gained_a_device_child_keeps_its_pages():
    tree = RadixTree(PAGE, host_capacity_pages=4)
    tree.insert(toks(0, 1, 2), "m", [5, 6, 7])
    [move] = tree.evict_device(3)
    assert tree.insert(toks(0, 9), "m", [5, 8]).owned == [8]
    assert tree.commit(move) == [6, 7]
    assert shape(tree) == [(1, (0,), [5], [0]), (2, (1, 2), None, [1, 2]), (2, (9,), [8], None)]


# ---------------------------------------------------------------------------- hashes, stats, clear


def test_page_hashes_follow_the_documented_chain():
    hashes = page_hashes(list(range(10)), "m", 4)
    assert len(hashes) == 2 and all(len(h) == 64 for h in hashes)
    first = hashlib.sha256(struct.pack("<I4q", 4, 0, 1, 2, 3) + b"'m'").hexdigest()
    second = hashlib.sha256(first.encode() + struct.pack("<I4q", 4, 4, 5, 6, 7) + b"'m'")
    assert hashes == [first, second.hexdigest()]
    assert page_hashes(tuple(range(10)), "m", 4) == hashes
    assert page_hashes(list(range(12)), "m", 4)[:2] == hashes
    with pytest.raises(ValueError, match=r"page_size must be >= 1, got 0"):
        page_hashes([1], "m", 0)


def test_a_changed_token_changes_its_page_hash_and_every_later_one():
    base = page_hashes(list(range(16)), ("llama", 7), 4)
    early = page_hashes([99] + list(range(1, 16)), ("llama", 7), 4)
    middle = page_hashes(list(range(9)) + [99] + list(range(10, 16)), ("llama", 7), 4)
    assert all(a != b for a, b in zip(base, early))
    assert middle[:2] == base[:2] and all(a != b for a, b in zip(base[2:], middle[2:]))
    other_key = page_hashes(list(range(16)), ("llama", 8), 4)
    assert all(a != b for a, b in zip(base, other_key))
    assert len(set(base)) == 4  # equal pages at different depths differ too


def test_page_hashes_are_stable_across_processes():
    code = ("from longctx.cache.radix_tree import page_hashes; "
            "print(page_hashes(list(range(12)), ('llama', 'salt'), 4))")
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout.strip())
    assert outputs == {str(page_hashes(list(range(12)), ("llama", "salt"), 4))}


def test_node_hashes_match_the_chain_of_their_full_prefix():
    tree = RadixTree(PAGE)
    tree.insert(toks(0, 1, 2), "m", [0, 1, 2])
    tree.insert(toks(0, 3), "m", [0, 3])
    expected = {(0,): page_hashes(toks(0), "m", PAGE),
                (1, 2): page_hashes(toks(0, 1, 2), "m", PAGE)[1:],
                (3,): page_hashes(toks(0, 3), "m", PAGE)[1:]}
    assert {labels(n.tokens): n.page_hashes for n in tree.nodes()} == expected


def test_stats_count_queries_hits_per_tier_and_evictions():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    tree.insert(toks(0, 1), "m", [0, 1])
    tree.match_prefix(toks(0, 1, 2), "m")
    commit_all(tree, tree.evict_device(2))
    tree.match_prefix(toks(0, 1) + [1], "m")
    tree.match_prefix(toks(5), "m")
    s = tree.stats
    assert (s.num_matches, s.num_query_tokens) == (3, 12 + 9 + 4)
    assert s.hit_tokens == {Tier.DEVICE: 8, Tier.HOST: 8, Tier.DISK: 0}
    assert s.evicted_pages == {Tier.DEVICE: 2, Tier.HOST: 0, Tier.DISK: 0}


def test_clear_returns_the_held_device_ids_and_refuses_while_in_use():
    tree = RadixTree(PAGE, host_capacity_pages=2)
    tree.insert(toks(0, 1), "m", [4, 1])
    node = tree.insert(toks(2), "n", [0]).node
    tree.lock(node)
    with pytest.raises(RuntimeError, match="while nodes are locked or moves are in flight"):
        tree.clear()
    tree.unlock(node)
    moves = tree.evict_device(1)
    with pytest.raises(RuntimeError, match="while nodes are locked"):
        tree.clear()
    tree.abort(moves[0])
    assert tree.clear() == [0, 1, 4]
    assert list(tree.nodes()) == [] and tree.num_device_pages == 0
    assert tree.num_free_host_pages == 2
    assert tree.match_prefix(toks(0, 1), "m").num_tokens == 0
    with pytest.raises(ValueError, match="is not in this tree"):
        tree.lock(node)
    assert tree.insert(toks(0, 1), "m", [4, 1]).owned == [4, 1]


# ---------------------------------------------------------------------------- random operations

SMALL_PAGE = 2
NUM_BLOCKS = 40
KEYS = ("a", "b")
token_lists = st.lists(st.integers(0, 2), max_size=12)  # few distinct pages: lots of sharing


class RadixTreeMachine(RuleBasedStateMachine):
    """Random insert / match+lock / unlock / evict / commit / abort / load / clear, with the
    caller's ``BlockPool`` and a per-page model {(extra_key, prefix): {tier: id}} that predicts
    every match and insert exactly. Rules that need pages wait for an insert."""

    @initialize(host_capacity=st.integers(0, 6), disk=st.booleans())
    def create(self, host_capacity, disk):
        self.tree = RadixTree(SMALL_PAGE, host_capacity_pages=host_capacity, disk_tier=disk)
        self.pool = BlockPool(NUM_BLOCKS)
        self.model: dict[tuple, dict[Tier, object]] = {}
        self.locked: list[TreeNode] = []
        self.moves: list[EvictionMove] = []  # planned, neither committed nor aborted
        self.seen: list[tuple[str, list[int]]] = []  # inserted sequences, to draw queries from

    def _has_pages(self) -> bool:
        return bool(self.tree.num_device_pages or self.tree.num_host_pages
                    or self.tree.num_disk_pages)

    def _draw_query(self, data, off_device: bool = False) -> tuple[str, list[int]]:
        """A cached node's prefix (an off-device one if asked and there is one) or an earlier
        sequence, cut anywhere and continued at random: shared prefixes, splits mid-node (of
        frozen nodes too) and at node ends. Sometimes fresh tokens."""
        nodes = [n for n in self.tree.nodes() if not off_device or n.device_ids is None]
        source = data.draw(st.integers(0, 3), label="source")
        if nodes and (source < 2 or off_device):
            node = data.draw(st.sampled_from(nodes), label="node")
            key, tokens = node.extra_key, [t for n in self.tree.path(node) for t in n.tokens]
        elif self.seen and source == 2:
            key, tokens = data.draw(st.sampled_from(self.seen), label="sequence")
        else:
            key = data.draw(st.sampled_from(KEYS), label="key")
            return key, data.draw(token_lists, label="tokens")
        cut = data.draw(st.integers(0, len(tokens)), label="cut")
        return key, tokens[:cut] + data.draw(token_lists, label="continuation")

    def _prefixes(self, tokens, key) -> list[tuple]:
        return [(key, tuple(tokens[:end]))
                for end in range(SMALL_PAGE, len(tokens) + 1, SMALL_PAGE)]

    def _expected_match(self, tokens, key) -> list[PageLocation]:
        pages = []
        for prefix in self._prefixes(tokens, key):
            if prefix not in self.model:
                break
            tiers = self.model[prefix]
            tier = next(t for t in Tier if t in tiers)
            pages.append(PageLocation(tier, tiers[tier]))
        return pages

    @rule(data=st.data(), reuse=st.booleans())
    def insert(self, data, reuse):
        key, tokens = self._draw_query(data)
        self.seen.append((key, tokens))
        prefixes = self._prefixes(tokens, key)
        ids = self.tree.match_prefix(tokens, key).device_ids if reuse else []
        if len(prefixes) - len(ids) > self.pool.num_free:
            return
        self.pool.share(ids)  # a request whose block table starts with the matched pages
        ids = ids + self.pool.allocate(len(prefixes) - len(ids))
        adopt = [Tier.DEVICE not in self.model.get(p, {}) for p in prefixes]
        res = self.tree.insert(tokens, key, ids)
        assert res.owned == [i for i, a in zip(ids, adopt) if a]
        assert res.duplicates == [i for i, a in zip(ids, adopt) if not a]
        self.pool.release(res.duplicates)
        for prefix, i, a in zip(prefixes, ids, adopt):
            if a:
                self.model.setdefault(prefix, {})[Tier.DEVICE] = i
        if self.tree.num_device_pages and len(prefixes) > 1:
            self._insert_held_id_fails(tokens)

    def _insert_held_id_fails(self, tokens):
        before = shape(self.tree)
        held = next(n.device_ids[0] for n in self.tree.nodes() if n.device_ids)
        ids = [held] + [NUM_BLOCKS + i for i in range(len(tokens) // SMALL_PAGE - 1)]
        with pytest.raises(ValueError, match=f"device block {held} is already held"):
            self.tree.insert(tokens, "c", ids)  # key "c" holds no pages: every id is foreign
        assert shape(self.tree) == before

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        key, tokens = self._draw_query(data)
        m = self.tree.match_prefix(tokens, key)
        assert list(m.pages) == self._expected_match(tokens, key)
        assert m.num_tokens == len(m.pages) * SMALL_PAGE
        if lock and m.last_node is not None:
            self.tree.lock(m.last_node)
            self.locked.append(m.last_node)

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data())
    def unlock(self, data):
        if self.locked and data.draw(st.booleans(), label="held"):
            i = data.draw(st.integers(0, len(self.locked) - 1), label="lock")
            self.tree.unlock(self.locked.pop(i))
            return
        free = [n for n in self.tree.nodes() if n not in self.locked]
        if free:
            node = data.draw(st.sampled_from(free), label="node")
            before = [n.lock_count for n in self.tree.nodes()]
            with pytest.raises(ValueError, match="without a matching lock"):
                self.tree.unlock(node)
            assert [n.lock_count for n in self.tree.nodes()] == before

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data(), source=st.sampled_from([Tier.DEVICE, Tier.HOST]),
          num_pages=st.integers(1, 8))
    def evict(self, data, source, num_pages):
        evict = self.tree.evict_device if source is Tier.DEVICE else self.tree.evict_host
        moves = evict(num_pages)
        for move in moves:
            assert move.source is source and move.node.lock_count == 0
            assert len(move.target_ids) == (len(move.source_ids) if move.target else 0)
        if sum(len(m.source_ids) for m in moves) < num_pages:
            assert evict(num_pages) == []  # the plan took every candidate there was
        self.moves += moves
        for _ in moves:  # mostly finish at once; some stay in flight across other rules
            if data.draw(st.integers(0, 3), label="finish now") > 0:
                self._finish(data, data.draw(st.integers(0, 4), label="commit") > 0)

    @precondition(lambda self: self.moves)
    @rule(data=st.data(), commit=st.booleans())
    def finish_move(self, data, commit):
        self._finish(data, commit)

    def _finish(self, data, commit):
        move = self.moves.pop(data.draw(st.integers(0, len(self.moves) - 1), label="move"))
        if not commit:
            self.tree.abort(move)
            return
        locked_pages = {p: dict(t) for p, t in self.model.items() if self._is_locked(p)}
        by_id = {tiers[move.source]: p for p, tiers in self.model.items() if move.source in tiers}
        released = self.tree.commit(move)
        assert set(released) <= set(move.source_ids)
        if move.source is Tier.DEVICE:
            self.pool.release(released)
        for k, source_id in enumerate(move.source_ids):
            tiers = self.model[by_id[source_id]]
            if move.target is not None:
                tiers[move.target] = move.target_ids[k]
            if source_id in released:
                del tiers[move.source]
            if not tiers:
                del self.model[by_id[source_id]]
        for prefix, tiers in locked_pages.items():  # locked pages only ever gain tiers
            assert tiers.items() <= self.model[prefix].items()

    def _is_locked(self, prefix) -> bool:
        key, tokens = prefix
        for node in self.locked:
            path = self.tree.path(node)
            full = tuple(t for n in path for t in n.tokens)
            if path[0].extra_key == key and full[:len(tokens)] == tokens:
                return True
        return False

    @precondition(lambda self: self.tree.num_host_pages or self.tree.num_disk_pages)
    @rule(data=st.data())
    def load(self, data):
        key, tokens = self._draw_query(data, off_device=True)
        m = self.tree.match_prefix(tokens, key)
        if not m.pages_to_load or len(m.pages_to_load) > self.pool.num_free:
            return
        self.tree.lock(m.last_node)
        ids = self.pool.allocate(len(m.pages_to_load))
        assert self.tree.load_to_device(m, ids) == []
        self.tree.unlock(m.last_node)
        off_device = [p for p, loc in zip(self._prefixes(tokens, key), m.pages)
                      if loc.tier is not Tier.DEVICE]
        for prefix, i in zip(off_device, ids):
            self.model[prefix][Tier.DEVICE] = i

    @precondition(lambda self: self._has_pages())
    @rule(dice=st.integers(0, 9))
    def clear(self, dice):
        if dice:  # rare: a clear wipes the state the other rules build up
            return
        if self.locked or self.moves:
            with pytest.raises(RuntimeError):
                self.tree.clear()
            return
        held = self.tree.clear()
        assert held == sorted(t[Tier.DEVICE] for t in self.model.values() if Tier.DEVICE in t)
        self.pool.release(held)
        self.model.clear()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_model_and_pool(self):
        seen: dict[tuple, dict[Tier, object]] = {}
        for node in self.tree.nodes():
            full = tuple(t for n in self.tree.path(node) for t in n.tokens)
            start = (len(full) - len(node.tokens)) // SMALL_PAGE
            for k in range(node.num_pages):
                prefix = (node.extra_key, full[:(start + k + 1) * SMALL_PAGE])
                seen[prefix] = {t: node.ids(t)[k] for t in Tier if node.ids(t) is not None}
        assert seen == self.model
        device = [i for n in self.tree.nodes() for i in n.device_ids or []]
        host = [i for n in self.tree.nodes() for i in n.host_ids or []]
        assert len(set(device)) == len(device) == self.tree.num_device_pages
        assert len(set(host)) == len(host) == self.tree.num_host_pages
        assert self.tree.num_disk_pages == sum(len(n.disk_keys or []) for n in self.tree.nodes())
        reserved = sum(len(m.target_ids) for m in self.moves if m.target is Tier.HOST)
        assert self.tree.num_free_host_pages == self.tree.host_capacity_pages - len(host) - reserved
        assert self.pool.num_free == NUM_BLOCKS - len(device)  # the caller holds nothing else
        assert all(self.pool.refcount(i) == 1 for i in device)

    @invariant()
    def structure_holds(self):
        for node in self.tree.nodes():
            parent = node.parent
            assert node.is_present and node.tokens and len(node.tokens) % SMALL_PAGE == 0
            assert len(node.tokens) == node.num_pages * SMALL_PAGE
            assert parent.children[node.tokens[:SMALL_PAGE]] is node
            assert all(node.ids(t) is None or len(node.ids(t)) == node.num_pages for t in Tier)
            if node.device_ids is not None:
                assert parent.is_root or parent.device_ids is not None
            full = tuple(t for n in self.tree.path(node) for t in n.tokens)
            chain = page_hashes(full, node.extra_key, SMALL_PAGE)[-node.num_pages:]
            assert node.page_hashes == chain
            assert node.disk_keys is None or node.disk_keys == chain

    @invariant()
    def locks_hold(self):
        own = Counter(id(n) for n in self.locked)
        for node in self.tree.nodes():
            assert node.num_own_locks == own[id(node)]
            assert node.lock_count == node.num_own_locks + sum(
                c.lock_count for c in node.children.values())
            assert node.lock_count >= 0
            if node.lock_count:
                assert all(a.lock_count > 0 for a in self.tree.path(node))
            if node.parent.is_root:
                assert node.parent.lock_count == sum(
                    c.lock_count for c in node.parent.children.values())

    @invariant()
    def moves_are_frozen_nodes(self):
        pending = {n.pending.move_id for n in self.tree.nodes() if n.pending is not None}
        assert pending == {m.move_id for m in self.moves}


TestRadixTreeMachine = RadixTreeMachine.TestCase
TestRadixTreeMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])

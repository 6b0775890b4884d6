"""DraftTree (validation, depths, branches, tree-mask words against ``causal_visibility``) and
the Drafter: exact drafts on small sequences, ranking, branch limits, the shared pool (LRU,
per-document cap, segment boundaries), incremental ``extend`` equal to building at once, a
brute-force reference drafter under hypothesis, and the cost on a 32K-token prompt."""

from __future__ import annotations

import random
import time
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.kernels.reference import causal_visibility
from longctx.lookahead import drafter as drafter_module
from longctx.lookahead.drafter import SEPARATOR, Drafter, DrafterConfig, SharedDraftPool
from longctx.lookahead.tree import MAX_NODES, ROOT, DraftTree

# ---------------------------------------------------------------------------- DraftTree

#       A ── B(0) ── C(1)          queries: A=0, B=1, C=2, D=3, E=4, F=5
#       ├─── D(2) ── E(3)
#       └─── F(4)
EXAMPLE = DraftTree([11, 12, 13, 14, 15], [ROOT, 0, ROOT, 2, ROOT])


def test_example_tree_shape():
    assert EXAMPLE.depths() == [1, 2, 1, 2, 1]
    assert EXAMPLE.children(ROOT) == [0, 2, 4]
    assert EXAMPLE.children(2) == [3]
    assert EXAMPLE.children(4) == []
    assert EXAMPLE.path(3) == [2, 3]
    assert EXAMPLE.path(ROOT) == []
    assert EXAMPLE.branches() == [[0, 1], [2, 3], [4]]
    assert len(EXAMPLE) == 5


def test_example_tree_masks():
    assert EXAMPLE.ancestor_masks() == [0b000001, 0b000011, 0b000111, 0b001001, 0b011001,
                                        0b100001]


def test_chain_and_empty_trees():
    chain = DraftTree.chain([7, 8, 9])
    assert (chain.token_ids, chain.parents) == ([7, 8, 9], [ROOT, 0, 1])
    assert chain.branches() == [[0, 1, 2]]
    assert chain.ancestor_masks() == [0b1, 0b11, 0b111, 0b1111]
    empty = DraftTree.empty()
    assert (len(empty), empty.ancestor_masks(), empty.branches(), empty.depths()) == (
        0, [1], [], [])


def test_tree_fields_are_lists_and_trees_compare_by_value():
    tree = DraftTree((1, 2), (ROOT, 0))
    assert tree.token_ids == [1, 2] and tree.parents == [ROOT, 0]
    assert tree == DraftTree.chain([1, 2])


@pytest.mark.parametrize("tokens,parents,message", [
    ([1, 2], [ROOT], "one parent per token"),
    ([1, 2], [ROOT, 1], "node 1 has parent 1"),
    ([1, 2], [0, ROOT], "node 0 has parent 0"),
    ([1, 2], [ROOT, -2], "node 1 has parent -2"),
    ([1, -3], [ROOT, 0], "integers >= 0"),
    ([1, 1], [ROOT, ROOT], "two children of node -1 both carry token 1"),
    ([1, 2, 2], [ROOT, 0, 0], "two children of node 0 both carry token 2"),
    (list(range(MAX_NODES + 1)), [ROOT] * (MAX_NODES + 1), "at most 62 nodes"),
])
def test_bad_trees_are_rejected(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_children_of_a_missing_node_is_an_error():
    with pytest.raises(ValueError, match="node must be -1"):
        EXAMPLE.children(5)


def test_chain_mask_is_the_causal_mask():
    chain = DraftTree.chain(list(range(10)))
    masks = torch.tensor(chain.ancestor_masks(), dtype=torch.int64)
    for ctx_len in (11, 30):
        assert torch.equal(causal_visibility(11, ctx_len, masks), causal_visibility(11, ctx_len))


@st.composite
def trees(draw, max_nodes: int = MAX_NODES) -> DraftTree:
    num_nodes = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(ROOT, node - 1)) for node in range(num_nodes)]
    tokens = list(range(num_nodes))  # distinct, so siblings always differ
    return DraftTree(draw(st.permutations(tokens)), parents)


@given(trees())
def test_mask_visibility_is_ancestors_and_self(tree):
    """Through ``causal_visibility``: query i + 1 sees the cached context, the root, its own
    ancestors and itself, and nothing else; the root sees the context and itself."""
    num_queries, num_cached = len(tree) + 1, 5
    masks = torch.tensor(tree.ancestor_masks(), dtype=torch.int64)
    visible = causal_visibility(num_queries, num_cached + num_queries, masks)
    assert visible[:, :num_cached].all()
    expected = [[0]] + [[0] + [n + 1 for n in tree.path(node)] for node in range(len(tree))]
    for query, seen in enumerate(expected):
        assert visible[query, num_cached:].nonzero().flatten().tolist() == seen


@given(trees())
def test_depths_and_branches_agree_with_paths(tree):
    assert tree.depths() == [len(tree.path(node)) for node in range(len(tree))]
    leaves = [path[-1] for path in tree.branches()]
    assert leaves == [n for n in range(len(tree)) if not tree.children(n)]
    assert sorted({n for path in tree.branches() for n in path}) == list(range(len(tree)))


# ---------------------------------------------------------------------------- Drafter: exact

CONFIG = DrafterConfig(max_context=3, min_context=1)


def draft(tokens, max_tokens=8, max_branches=4, config=CONFIG) -> tuple[list[int], list[int]]:
    tree = Drafter(config, tokens).propose(max_tokens, max_branches)
    return tree.token_ids, tree.parents


def test_longest_context_most_recent_first():
    # "1 2 3" ended at 2 (then 4 1 2 3 5 ...) and at 6 (then 5 1 2 3): equal count, the more
    # recent goes first and deep, the older fills the second branch.
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert draft(tokens, max_tokens=4) == ([5, 1, 2, 3], [ROOT, 0, 1, 2])
    assert draft(tokens, max_tokens=6) == ([5, 1, 2, 3, 4, 1], [ROOT, 0, 1, 2, ROOT, 4])
    assert draft(tokens, max_tokens=6, max_branches=1) == ([5, 1, 2, 3], [ROOT, 0, 1, 2])


def test_frequency_beats_recency_within_a_context_length():
    # After "7": 8 three times (then 1, 2, 3), 9 once, most recently. 8 has the count; among
    # single occurrences the most recent goes first: 9, its 0 and 7, then 8's most recent 3.
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 9, 0, 7]
    assert draft(tokens, max_tokens=3, config=DrafterConfig(max_context=1)) == (
        [8, 9, 0], [ROOT, ROOT, 1])
    assert draft(tokens, max_tokens=5, config=DrafterConfig(max_context=1)) == (
        [8, 9, 0, 7, 3], [ROOT, ROOT, 1, 2, 0])


def test_longer_context_beats_frequency():
    # "5 7" once before (then 9 1 7 8 ...); "7" alone three more times (then 8). Every node of
    # the 2-token match outranks the frequent 1-token guess.
    tokens = [5, 7, 9, 1, 7, 8, 2, 7, 8, 3, 7, 8, 5, 7]
    config = DrafterConfig(max_context=2)
    assert draft(tokens, max_tokens=3, config=config) == ([9, 1, 7], [ROOT, 0, 1])
    assert draft(tokens, max_tokens=3, config=DrafterConfig(max_context=1)) == (
        [8, 5, 7], [ROOT, 0, 1])


def test_shorter_context_is_a_fallback_only():
    # "3 4" never occurred before; "4" did (then 6).
    assert draft([4, 6, 3, 4]) == ([6, 3, 4], [ROOT, 0, 1])
    assert draft([4, 6, 3, 4], config=DrafterConfig(max_context=2, min_context=2)) == ([], [])


def test_no_earlier_occurrence_gives_an_empty_draft():
    assert draft([1, 2, 3]) == ([], [])
    assert draft([]) == ([], [])
    assert draft([1, 2, 1], max_tokens=0) == ([], [])


def test_max_occurrences_keeps_the_most_recent():
    tokens = [7, 1, 7, 2, 7, 3, 7]
    config = DrafterConfig(max_context=1, max_occurrences=2)
    assert draft(tokens, max_tokens=4, config=config) == ([3, 7, 2, 7], [ROOT, 0, ROOT, 2])


def test_draft_stops_at_the_end_of_the_text():
    assert draft([9, 5, 9], max_tokens=10) == ([5, 9], [ROOT, 0])


def test_extend_moves_the_context():
    drafter = Drafter(CONFIG, [1, 2, 3, 1, 4, 5])
    assert drafter.propose(4, 2).token_ids == []
    drafter.extend([1, 2])
    assert drafter.propose(4, 2).token_ids == [3, 1, 4, 5]
    assert drafter.tokens == [1, 2, 3, 1, 4, 5, 1, 2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_context=0), "min_context must be"),
    (dict(max_context=1, min_context=2), "max_context must be"),
    (dict(max_occurrences=0), "max_occurrences must be"),
])
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig(**kwargs)


@pytest.mark.parametrize("max_tokens,max_branches,message", [
    (-1, 1, "max_tokens must be"), (MAX_NODES + 1, 1, "max_tokens must be"),
    (2.0, 1, "max_tokens must be"), (4, 0, "max_branches must be"),
])
def test_bad_propose_arguments_are_rejected(max_tokens, max_branches, message):
    with pytest.raises(ValueError, match=message):
        Drafter(CONFIG, [1, 2, 1]).propose(max_tokens, max_branches)


def test_negative_tokens_are_rejected():
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        Drafter(CONFIG, [1, -1])
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        Drafter(CONFIG, [1]).extend([SEPARATOR])


# ---------------------------------------------------------------------------- shared pool


def test_pool_drafts_from_another_requests_output():
    pool = SharedDraftPool(CONFIG)
    first = Drafter(CONFIG, [100, 101], pool, document_key="doc")
    first.extend([5, 6, 7, 8])
    first.publish()
    second = Drafter(CONFIG, [100, 102, 5, 6], pool, document_key="doc")
    assert second.propose(4, 1).token_ids == [7, 8]
    other_doc = Drafter(CONFIG, [100, 102, 5, 6], pool, document_key="other")
    assert other_doc.propose(4, 1).token_ids == []


def test_own_text_comes_before_the_pool_at_equal_context():
    pool = SharedDraftPool(CONFIG)
    pool.add("doc", [5, 6, 9])
    drafter = Drafter(CONFIG, [5, 6, 8, 0, 5, 6], pool, document_key="doc")
    assert drafter.propose(5, 2) == DraftTree([8, 0, 5, 6, 9], [ROOT, 0, 1, 2, ROOT])
    # A longer match in the pool beats a shorter one in the request's own text.
    pool.add("doc", [4, 5, 6, 7])
    drafter = Drafter(CONFIG, [5, 6, 8, 0, 4, 5, 6], pool, document_key="doc")
    assert drafter.propose(1, 1).token_ids == [7]


def test_pool_outputs_do_not_run_into_each_other():
    pool = SharedDraftPool(CONFIG)
    pool.add("doc", [1, 2, 3])
    pool.add("doc", [4, 5])
    drafter = Drafter(CONFIG, [9, 3], pool, document_key="doc")
    assert drafter.propose(4, 4).token_ids == []  # 3 ended the first output
    drafter.extend([1])
    assert drafter.propose(4, 4).token_ids == [2, 3]


def test_pool_evicts_the_least_recently_used_document():
    pool = SharedDraftPool(CONFIG, max_documents=2)
    pool.add("a", [1, 2])
    pool.add("b", [3, 4])
    assert pool.document("a") is not None  # "a" is now the most recently used
    pool.add("c", [5, 6])
    assert (len(pool), pool.document("b")) == (2, None)
    assert pool.document("a").tokens == [1, 2]
    assert pool.document("c").tokens == [5, 6]


def test_pool_keeps_the_newest_outputs_of_a_document():
    pool = SharedDraftPool(CONFIG, max_tokens_per_document=7)
    pool.add("doc", [1, 2, 3])
    pool.add("doc", [4, 5, 6])
    assert pool.document("doc").tokens == [1, 2, 3, SEPARATOR, 4, 5, 6]
    pool.add("doc", [7, 8])
    assert pool.document("doc").tokens == [4, 5, 6, SEPARATOR, 7, 8]
    pool.add("doc", list(range(20, 30)))
    assert pool.document("doc").tokens == list(range(23, 30))
    drafter = Drafter(CONFIG, [25], pool, document_key="doc")
    assert drafter.propose(8, 1).token_ids == [26, 27, 28, 29]


def test_pool_misuse_is_reported():
    pool = SharedDraftPool(CONFIG)
    with pytest.raises(ValueError, match="same DrafterConfig"):
        Drafter(DrafterConfig(), [1], pool, document_key="doc")
    with pytest.raises(ValueError, match="needs the document_key"):
        Drafter(CONFIG, [1], pool)
    with pytest.raises(ValueError, match="no shared pool"):
        Drafter(CONFIG, [1]).publish()
    drafter = Drafter(CONFIG, [1], pool, document_key="doc")
    drafter.publish()
    with pytest.raises(ValueError, match="already published"):
        drafter.publish()
    with pytest.raises(ValueError, match="max_documents"):
        SharedDraftPool(CONFIG, max_documents=0)
    with pytest.raises(ValueError, match="max_tokens_per_document"):
        SharedDraftPool(CONFIG, max_tokens_per_document=0)


# ---------------------------------------------------------------------------- reference


def reference_draft(tokens: list[int], pool_tokens: list[int], config: DrafterConfig,
                    max_tokens: int, max_branches: int) -> DraftTree:
    """The drafter's specification, by brute force: scan every position for occurrences,
    build the whole continuation trie, then pick nodes best first under the parent rule."""
    occurrences = reference_occurrences(tokens, pool_tokens, config)
    stats: dict[tuple[int, ...], list[int]] = {}  # path -> [-context, -count, first seen]
    for order, (source, end, k) in enumerate(occurrences):
        following = source[end + 1:end + 1 + max_tokens]
        following = following[:following.index(SEPARATOR)] if SEPARATOR in following else following
        for depth in range(1, len(following) + 1):
            stats.setdefault(tuple(following[:depth]), [-k, 0, order])[1] -= 1
    chosen: dict[tuple[int, ...], int] = {(): ROOT}
    ids, parents, with_children, num_leaves = [], [], set(), 0
    candidates = {path for path in stats if len(path) == 1}
    while candidates and len(ids) < max_tokens:
        path = min(candidates, key=lambda p: stats[p])
        candidates.remove(path)
        parent = chosen[path[:-1]]
        opens_branch = parent == ROOT or parent in with_children
        if opens_branch and num_leaves == max_branches:
            continue
        num_leaves += opens_branch
        with_children.add(parent)
        chosen[path] = len(ids)
        ids.append(path[-1])
        parents.append(parent)
        candidates |= {p for p in stats if len(p) == len(path) + 1 and p[:-1] == path}
    return DraftTree(ids, parents)


def reference_occurrences(tokens, pool_tokens, config):
    found, seen = [], set()
    for k in range(config.max_context, config.min_context - 1, -1):
        if len(tokens) < k:
            continue
        for source_id, source in enumerate([tokens, pool_tokens]):
            for end in range(len(source) - 2, k - 2, -1):
                if (source[end - k + 1:end + 1] == tokens[-k:] and source[end + 1] != SEPARATOR
                        and (source_id, end) not in seen):
                    seen.add((source_id, end))
                    found.append((source, end, k))
                    if len(found) == config.max_occurrences:
                        return found
    return found


small_texts = st.lists(st.integers(0, 5), max_size=60)
configs = st.builds(lambda lo, extra, occ: DrafterConfig(lo + extra, lo, occ),
                    st.integers(1, 3), st.integers(0, 2), st.integers(1, 12))


@settings(max_examples=150, deadline=None)
@given(small_texts, st.lists(small_texts, max_size=3), configs, st.integers(0, 12),
       st.integers(1, 4))
def test_drafter_matches_the_brute_force_reference(tokens, outputs, config, max_tokens,
                                                   max_branches):
    pool = SharedDraftPool(config)
    for output in outputs:
        pool.add("doc", output)
    drafter = Drafter(config, tokens, pool, document_key="doc")
    pool_tokens = pool.document("doc").tokens if pool.document("doc") else []
    expected = reference_draft(tokens, pool_tokens, config, max_tokens, max_branches)
    assert drafter.propose(max_tokens, max_branches) == expected


@pytest.mark.parametrize("seed", range(5))
def test_hash_collisions_cost_time_never_a_match(seed):
    """With a multiplier of 0 every n-gram hashes to its last token: lookups then see many
    false candidates, which the token comparison must reject."""
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(80)]
    with mock.patch.object(drafter_module, "_HASH_MULTIPLIER", 0):
        proposed = Drafter(CONFIG, tokens).propose(10, 3)
    assert proposed == reference_draft(tokens, [], CONFIG, 10, 3)


@settings(max_examples=100, deadline=None)
@given(small_texts, st.lists(st.integers(0, 8), max_size=8), st.integers(0, 60), configs,
       st.integers(1, 12), st.integers(1, 4))
def test_extending_in_pieces_equals_building_at_once(tokens, cuts, prompt_len, config,
                                                     max_tokens, max_branches):
    prompt_len = min(prompt_len, len(tokens))
    with mock.patch.object(drafter_module, "_MIN_BULK_REINDEX", 4):  # re-index often
        incremental = Drafter(config, tokens[:prompt_len])
        position = prompt_len
        for cut in cuts + [len(tokens)]:
            incremental.extend(tokens[position:position + cut])
            position += cut
            at_once = Drafter(config, tokens[:position])
            assert incremental.propose(max_tokens, max_branches) == at_once.propose(
                max_tokens, max_branches)
    assert incremental.tokens == tokens


@settings(max_examples=100, deadline=None)
@given(small_texts, st.integers(1, 12), st.integers(1, 4))
def test_every_branch_continues_an_earlier_occurrence(tokens, max_tokens, max_branches):
    tree = Drafter(CONFIG, tokens).propose(max_tokens, max_branches)
    assert len(tree) <= max_tokens and len(tree.branches()) <= max_branches
    for node in range(len(tree)):
        guess = [tree.token_ids[n] for n in tree.path(node)]
        assert any(tokens[end + 1:end + 1 + len(guess)] == guess
                   for end in range(len(tokens) - 1) if tokens[end] == tokens[-1])
    has_earlier = len(tokens) > 1 and tokens[-1] in tokens[:-1]
    assert (len(tree) > 0) == has_earlier


# ---------------------------------------------------------------------------- cost


def zipf_text(num_tokens: int, vocab: int = 32000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return rng.choices(range(vocab), weights=[1 / (i + 1) for i in range(vocab)], k=num_tokens)


def test_cost_on_a_32k_prompt():
    """Bounds far above what this machine measures (25-40 ms to index, 0.15-0.4 ms per step; see
    docs/lookahead.md), so that a loaded machine does not fail it but a regression to a
    Python loop per token and context length, or to an unbounded scan, does."""
    prompt = zipf_text(32768)
    start = time.perf_counter()
    drafter = Drafter(DrafterConfig(), prompt)
    assert time.perf_counter() - start < 0.5
    rng, num_steps, position = random.Random(1), 300, 100
    start = time.perf_counter()
    for _ in range(num_steps):
        drafter.propose(16, 4)
        drafter.extend(prompt[position:position + rng.randint(1, 4)])
        position += 4
    assert (time.perf_counter() - start) / num_steps < 0.005

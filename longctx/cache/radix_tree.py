"""The prefix index: which token-id prefixes have cached KV pages, and in which tier each lives.

Owns: a radix tree over token ids at page granularity (only full pages of ``page_size`` tokens
are shared), per-node page ids in three tiers, lock counts, access times, the host page-id
allocator, and the planning of evictions. Never: KV bytes or torch. The tree decides which
pages move; ``longctx.kv`` copies them; the device block ids themselves belong to the
caller's ``BlockPool`` (the tree holds one reference per id it owns).

Tiers. A node is a run of whole pages that shares one state per tier: ``device_ids`` (device
block ids), ``host_ids`` (host page ids, from the tree's own allocator) and ``disk_keys``
(chained page hashes, see ``page_hashes``); each is a list with one entry per page, or None.
A node may sit in several tiers at once (written back to host and still on device). The disk
tier is unbounded: the tree never evicts from it (``clear`` forgets everything).

    root["llama-8b"]                               page_size = 4
     |-- A  [t0 .. t7]    device [3, 4]  host [0, 1]
     |    |-- B  [t8 .. t15]   device [5, 6]
     |    `-- C  [u8 .. u11]   host [2]              (written back, off the device)
     `-- D  [v0 .. v3]    disk [h(v0..v3)]
    root[("llama-8b", "salt")]                     another extra_key: a tree of its own
     `-- ...

Invariants (the tests check them after random operation sequences):
  - every non-root node holds its pages in at least one tier; a node left in none is removed,
    and only a node without children can be;
  - a device-resident node's parent is device-resident or a root, so a match's device pages
    are always a leading run (evict leaves first, load whole paths);
  - ``lock_count`` = locks taken on the node itself + the children's ``lock_count``: every
    ancestor of a locked node is locked, and locked nodes are never evicted from any tier;
  - a device id is held by at most one node; ``num_*_pages`` equal the sums over the nodes.

Moving pages is two-phase (plan, execute, commit) so the tree is consistent at every moment:
  1. plan: ``evict_device(n)`` / ``evict_host(n)`` return ``EvictionMove``s. Each names the
     pages to read (``source_ids``) and, when a copy is needed, where to write them
     (``target_ids``: host ids reserved now, or disk keys). The node is frozen: not planned
     again; it still answers matches from the tiers it has (those bytes stay valid).
  2. execute: ``longctx.kv`` copies the bytes (possibly asynchronously).
  3. commit: ``commit(move)`` records the copy and returns the source ids actually released.
     The caller frees exactly those, never what the plan listed: a node that was locked, or
     gained a device-resident child, in the meantime keeps its pages. ``abort(move)`` undoes
     a plan whose copy failed.
Matches and inserts may split a frozen node; both halves stay under the same move.
Loads go the other way: ``match_prefix``, ``lock(match.last_node)``, copy
``match.pages_to_load`` into fresh device blocks, then ``load_to_device(match, ids)``.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from longctx.cache.block_pool import BlockPool


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


_IDS_ATTR = {Tier.DEVICE: "device_ids", Tier.HOST: "host_ids", Tier.DISK: "disk_keys"}


def page_hashes(tokens: Sequence[int], extra_key: Hashable, page_size: int,
                prev_hash: str = "") -> list[str]:
    """One sha256 hex digest per full page of ``tokens``, chained: page i hashes page i-1's
    digest (``prev_hash`` for the first page), the page's token ids (as a length-prefixed run
    of little-endian int64) and ``repr(extra_key)``. A digest thus names the whole prefix up
    to its page, identically in every process; ``extra_key`` needs a stable repr (str, int,
    tuples of those)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    salt = repr(extra_key).encode()
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start:start + page_size]
        digest = hashlib.sha256(prev_hash.encode())
        digest.update(struct.pack(f"<I{page_size}q", page_size, *page))
        digest.update(salt)
        prev_hash = digest.hexdigest()
        hashes.append(prev_hash)
    return hashes


@dataclass
class _Pending:
    """A node's share of a planned move (a split hands each half its slice)."""

    move_id: int
    source: Tier
    target: Tier | None
    target_ids: list[Any]
    drops: bool  # the node leaves the tree on commit


@dataclass(eq=False)
class TreeNode:
    """A run of whole pages. Roots have no tokens; compare nodes by identity."""

    tokens: tuple[int, ...]
    extra_key: Hashable
    node_id: int
    parent: TreeNode | None = field(default=None, repr=False)
    page_hashes: list[str] = field(default_factory=list, repr=False)
    device_ids: list[int] | None = None
    host_ids: list[int] | None = None
    disk_keys: list[str] | None = field(default=None, repr=False)
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)
    lock_count: int = 0
    num_own_locks: int = 0
    last_access: int = 0
    pending: _Pending | None = field(default=None, repr=False)

    @property
    def is_root(self) -> bool:
        return not self.tokens

    @property
    def num_pages(self) -> int:
        return len(self.page_hashes)

    def ids(self, tier: Tier) -> list[Any] | None:
        return getattr(self, _IDS_ATTR[tier])

    @property
    def is_present(self) -> bool:
        return any(self.ids(tier) is not None for tier in Tier)

    def leaving(self, tier: Tier) -> bool:
        return self.pending is not None and self.pending.source is tier


@dataclass(frozen=True)
class PageLocation:
    tier: Tier
    page_id: int | str  # device or host page id, or disk key


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix, in whole pages. Lock ``last_node`` before using its pages."""

    extra_key: Hashable
    num_tokens: int
    last_node: TreeNode | None  # None when nothing matched
    nodes: tuple[TreeNode, ...]  # root excluded, as matched (``RadixTree.path`` is current)
    pages: tuple[PageLocation, ...]  # per page: device if there, else host, else disk

    @property
    def device_ids(self) -> list[int]:
        """The leading pages already on the device (the whole match if nothing needs loading)."""
        return [p.page_id for p in self.pages if p.tier is Tier.DEVICE]

    @property
    def pages_to_load(self) -> list[PageLocation]:
        return [p for p in self.pages if p.tier is not Tier.DEVICE]


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode | None  # the node ending at the last inserted page; None for no full page
    owned: list[int]  # ids the tree took over: the caller's reference is now the tree's
    duplicates: list[int]  # ids of pages the tree had on device: the caller keeps and frees them


@dataclass(frozen=True)
class EvictionMove:
    move_id: int
    node: TreeNode  # as planned; a later split may move its head into a new parent
    source: Tier  # the tier the pages leave: DEVICE or HOST
    source_ids: tuple[int, ...]  # read the bytes here
    target: Tier | None  # copy to this tier first; None: nothing to copy
    target_ids: tuple[Any, ...]  # host ids reserved for the copy, or disk keys
    drops: bool  # no tier is left: the node leaves the tree on commit

    @property
    def write_back(self) -> bool:
        return self.target is not None


class EvictionPolicy(Protocol):
    def key(self, node: TreeNode) -> Any:
        """Sortable; the smallest key is evicted first."""


class LRUPolicy:
    def key(self, node: TreeNode) -> Any:
        return node.last_access


@dataclass
class TreeStats:
    num_matches: int = 0
    num_query_tokens: int = 0
    hit_tokens: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    evicted_pages: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))


class RadixTree:
    def __init__(self, page_size: int, eviction_policy: EvictionPolicy | None = None,
                 host_capacity_pages: int = 0, disk_tier: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if host_capacity_pages < 0:
            raise ValueError(f"host_capacity_pages must be >= 0, got {host_capacity_pages}")
        self.page_size = page_size
        self.policy = eviction_policy or LRUPolicy()
        self.host_capacity_pages = host_capacity_pages
        self.disk_tier = disk_tier
        self.stats = TreeStats()
        self._clock = itertools.count(1)  # logical time: exact, repeatable LRU orders
        self._node_ids = itertools.count()
        self._move_ids = itertools.count()
        self._reset()

    def _reset(self) -> None:
        self._roots: dict[Hashable, TreeNode] = {}
        self._held_device_ids: set[int] = set()
        self._num_pages = dict.fromkeys(Tier, 0)
        self._in_flight: dict[int, list[TreeNode]] = {}
        self._host_pool = BlockPool(self.host_capacity_pages) if self.host_capacity_pages else None

    # ------------------------------------------------------------------ sizes and nodes

    @property
    def num_device_pages(self) -> int:
        return self._num_pages[Tier.DEVICE]

    @property
    def num_host_pages(self) -> int:
        return self._num_pages[Tier.HOST]

    @property
    def num_disk_pages(self) -> int:
        return self._num_pages[Tier.DISK]

    @property
    def num_free_host_pages(self) -> int:
        return self._host_pool.num_free if self._host_pool else 0

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, depth first, children in insertion order."""
        stack = list(reversed(self._roots.values()))
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(reversed(node.children.values()))

    def path(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors, root excluded, root side first."""
        nodes = []
        while not node.is_root:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def clear(self) -> list[int]:
        """Forget everything; returns the device ids the tree held, for the caller to free.
        Access times and stats carry on."""
        if self._in_flight or any(root.lock_count for root in self._roots.values()):
            raise RuntimeError("cannot clear the prefix tree while nodes are locked or moves "
                               "are in flight: unlock them and commit or abort the moves first")
        held = sorted(self._held_device_ids)
        self._reset()
        return held

    # ------------------------------------------------------------------ match and insert

    def match_prefix(self, tokens: Sequence[int], extra_key: Hashable, *,
                     record: bool = True) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` in whole pages, in any tier. Splits a node
        only when the match ends inside it. With ``record`` (a match that will be used) the
        path is marked as just used and the stats count it; without, it is a mere look."""
        root = self._roots.get(extra_key)
        path = self._descend(root, self._full_pages(tokens)) if root else []
        pages = tuple(loc for node in path for loc in self._locations(node))
        if record:
            self._touch(path)
            self.stats.num_matches += 1
            self.stats.num_query_tokens += len(tokens)
            for loc in pages:
                self.stats.hit_tokens[loc.tier] += self.page_size
        return PrefixMatch(extra_key, len(pages) * self.page_size, path[-1] if path else None,
                           tuple(path), pages)

    def insert(self, tokens: Sequence[int], extra_key: Hashable,
               device_ids: Sequence[int]) -> InsertResult:
        """Index the full pages of ``tokens`` (one device id per full page; a trailing partial
        page is ignored). Pages the tree has only off-device adopt the given ids."""
        tokens = self._full_pages(tokens)
        if len(device_ids) != len(tokens) // self.page_size:
            raise ValueError(f"{len(tokens) // self.page_size} full pages need as many device "
                             f"ids, got {len(device_ids)}")
        if not tokens:
            return InsertResult(None, [], [])
        root = self._roots.get(extra_key)
        path = self._descend(root, tokens) if root else []
        self._check_new_device_ids(path, device_ids)
        owned, duplicates = self._adopt(path, device_ids)
        num_done = sum(node.num_pages for node in path)
        if num_done < len(device_ids):
            parent = path[-1] if path else self._root(extra_key)
            path.append(self._add_leaf(parent, tokens[num_done * self.page_size:],
                                       list(device_ids[num_done:])))
            owned += device_ids[num_done:]
        self._touch(path)
        return InsertResult(path[-1], list(owned), duplicates)

    def _full_pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[:len(tokens) // self.page_size * self.page_size])

    def _root(self, extra_key: Hashable) -> TreeNode:
        if extra_key not in self._roots:
            self._roots[extra_key] = TreeNode((), extra_key, next(self._node_ids))
        return self._roots[extra_key]

    def _descend(self, root: TreeNode, tokens: tuple[int, ...]) -> list[TreeNode]:
        """The nodes along the longest cached prefix of ``tokens``; a node matched only in
        part is split, so the path ends exactly where the match does."""
        path, node, start = [], root, 0
        while start < len(tokens):
            child = node.children.get(tokens[start:start + self.page_size])
            if child is None:
                break
            num_common = self._num_common_pages(child.tokens, tokens, start)
            if num_common < child.num_pages:
                path.append(self._split(child, num_common))
                break
            path.append(child)
            node, start = child, start + len(child.tokens)
        return path

    def _num_common_pages(self, run: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        if run == tokens[start:start + len(run)]:
            return len(run) // self.page_size
        ps, n = self.page_size, 1  # the first page matched: it is the child's key
        while run[n * ps:(n + 1) * ps] == tokens[start + n * ps:start + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``node`` after ``num_pages`` pages. The head is a new parent; ``node`` keeps the
        tail, so handles callers hold (locks, matches) still end where they did."""
        cut = num_pages * self.page_size
        head = TreeNode(node.tokens[:cut], node.extra_key, next(self._node_ids), node.parent,
                        node.page_hashes[:num_pages], lock_count=node.lock_count,
                        last_access=node.last_access)
        for tier in Tier:
            ids = node.ids(tier)
            if ids is not None:
                setattr(head, _IDS_ATTR[tier], ids[:num_pages])
                setattr(node, _IDS_ATTR[tier], ids[num_pages:])
        if node.pending is not None:
            head.pending = _Pending(node.pending.move_id, node.pending.source, node.pending.target,
                                    node.pending.target_ids[:num_pages], node.pending.drops)
            node.pending.target_ids = node.pending.target_ids[num_pages:]
            self._in_flight[node.pending.move_id].append(head)
        node.parent.children[head.tokens[:self.page_size]] = head
        node.tokens, node.page_hashes = node.tokens[cut:], node.page_hashes[num_pages:]
        node.parent = head
        head.children[node.tokens[:self.page_size]] = node
        return head

    def _check_new_device_ids(self, path: list[TreeNode], device_ids: Sequence[int]) -> None:
        """Before any change: an id the tree holds may only come back for its own page."""
        if len(set(device_ids)) != len(device_ids):
            raise ValueError(f"device ids must be distinct, got {list(device_ids)}")
        tree_ids = [i for node in path for i in (node.device_ids or [None] * node.num_pages)]
        for pos, block in enumerate(device_ids):
            if block in self._held_device_ids and (pos >= len(tree_ids) or tree_ids[pos] != block):
                raise ValueError(f"device block {block} is already held by the prefix tree for "
                                 f"another page")

    def _adopt(self, path: list[TreeNode], device_ids: Sequence[int]) -> tuple[list, list]:
        owned, duplicates, start = [], [], 0
        for node in path:
            ids = list(device_ids[start:start + node.num_pages])
            if node.device_ids is None:
                self._set_ids(node, Tier.DEVICE, ids)
                owned += ids
            else:
                duplicates += ids
            start += node.num_pages
        return owned, duplicates

    def _add_leaf(self, parent: TreeNode, run: tuple[int, ...], device_ids: list[int]) -> TreeNode:
        prev = parent.page_hashes[-1] if parent.page_hashes else ""
        leaf = TreeNode(run, parent.extra_key, next(self._node_ids), parent,
                        page_hashes(run, parent.extra_key, self.page_size, prev))
        self._set_ids(leaf, Tier.DEVICE, device_ids)
        parent.children[run[:self.page_size]] = leaf
        return leaf

    def _touch(self, path: list[TreeNode]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_access = now

    def _locations(self, node: TreeNode) -> list[PageLocation]:
        tier = next(t for t in Tier if node.ids(t) is not None)
        return [PageLocation(tier, page_id) for page_id in node.ids(tier)]

    def _set_ids(self, node: TreeNode, tier: Tier, ids: list[Any] | None) -> None:
        old = node.ids(tier)
        if old is not None:
            self._num_pages[tier] -= len(old)
            if tier is Tier.DEVICE:
                self._held_device_ids.difference_update(old)
        setattr(node, _IDS_ATTR[tier], ids)
        if ids is not None:
            self._num_pages[tier] += len(ids)
            if tier is Tier.DEVICE:
                self._held_device_ids.update(ids)

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """One more user of ``node``'s prefix: it and its ancestors cannot be evicted."""
        self._check_attached(node)
        node.num_own_locks += 1
        for n in self._ancestry(node):
            n.lock_count += 1

    def unlock(self, node: TreeNode) -> None:
        if node.num_own_locks == 0:
            raise ValueError(f"unlock of node {node.node_id} without a matching lock")
        node.num_own_locks -= 1
        for n in self._ancestry(node):
            n.lock_count -= 1

    def _ancestry(self, node: TreeNode | None) -> Iterator[TreeNode]:
        while node is not None:
            yield node
            node = node.parent

    def _check_attached(self, node: TreeNode) -> None:
        top = list(self._ancestry(node))[-1]
        if not (top.is_root and self._roots.get(top.extra_key) is top) or node.is_root:
            raise ValueError(f"node {node.node_id} is not in this tree (evicted, or a root)")

    # ------------------------------------------------------------------ plan

    def evict_device(self, num_pages: int) -> list[EvictionMove]:
        """Plan moves freeing at least ``num_pages`` device pages (fewer if not enough are
        evictable): unlocked leaves of the device-resident subtree, in policy order. Each is
        written back to host when the host tier has room, else dropped if it has no children
        (call ``evict_host`` first to make room)."""
        return self._plan(Tier.DEVICE, num_pages)

    def evict_host(self, num_pages: int) -> list[EvictionMove]:
        """Plan moves freeing at least ``num_pages`` host pages: to disk when there is a disk
        tier and the pages are not on device, else dropped (childless nodes only)."""
        return self._plan(Tier.HOST, num_pages)

    def _plan(self, source: Tier, num_pages: int) -> list[EvictionMove]:
        heap = [self._heap_entry(n) for n in self.nodes() if n.ids(source) is not None]
        heapq.heapify(heap)
        moves: list[EvictionMove] = []
        planned = 0
        while heap and planned < num_pages:
            node = heapq.heappop(heap)[-1]
            move = self._plan_move(node, source)
            if move is None:
                continue
            moves.append(move)
            planned += node.num_pages
            if not node.parent.is_root:  # it may be a leaf of the source tier now
                heapq.heappush(heap, self._heap_entry(node.parent))
        return moves

    def _heap_entry(self, node: TreeNode) -> tuple[Any, int, TreeNode]:
        return self.policy.key(node), node.node_id, node  # ties: the older node first

    def _plan_move(self, node: TreeNode, source: Tier) -> EvictionMove | None:
        if not self._evictable(node, source):
            return None
        target = self._target_for(node, source)
        drops = target is None and not self._has_other_tier(node, source)
        if drops and any(not (c.pending and c.pending.drops) for c in node.children.values()):
            return None
        target_ids = self._reserve(node, target)
        move = EvictionMove(next(self._move_ids), node, source, tuple(node.ids(source)), target,
                            tuple(target_ids), drops)
        node.pending = _Pending(move.move_id, source, target, target_ids, drops)
        self._in_flight[move.move_id] = [node]
        return move

    def _evictable(self, node: TreeNode, source: Tier) -> bool:
        if node.ids(source) is None or node.lock_count or node.pending:
            return False
        return source is not Tier.DEVICE or not self._has_device_child(node, count_leaving=False)

    def _has_device_child(self, node: TreeNode, count_leaving: bool) -> bool:
        return any(c.device_ids is not None and (count_leaving or not c.leaving(Tier.DEVICE))
                   for c in node.children.values())

    def _has_other_tier(self, node: TreeNode, tier: Tier) -> bool:
        return any(node.ids(t) is not None for t in Tier if t is not tier)

    def _target_for(self, node: TreeNode, source: Tier) -> Tier | None:
        if self._has_other_tier(node, source):
            return None
        if source is Tier.DEVICE:
            return Tier.HOST if self.num_free_host_pages >= node.num_pages else None
        return Tier.DISK if self.disk_tier else None

    def _reserve(self, node: TreeNode, target: Tier | None) -> list[Any]:
        if target is Tier.HOST:
            return self._host_pool.allocate(node.num_pages)
        return list(node.page_hashes) if target is Tier.DISK else []

    # ------------------------------------------------------------------ commit

    def commit(self, move: EvictionMove) -> list[int]:
        """The copy of ``move`` is done: record it and release the source pages where still
        allowed. Returns the released source ids in page order; device ids are the caller's to
        free, host ids are already back in the tree's allocator."""
        released = []
        for node in sorted(self._take_in_flight(move), key=lambda n: -len(self.path(n))):
            released.append(self._commit_node(node))
        return [i for ids in reversed(released) for i in ids]

    def abort(self, move: EvictionMove) -> None:
        """The copy failed or was cancelled: give back reserved host ids, unfreeze the nodes."""
        for node in self._take_in_flight(move):
            if node.pending.target is Tier.HOST:
                self._host_pool.release(node.pending.target_ids)
            node.pending = None

    def _take_in_flight(self, move: EvictionMove) -> list[TreeNode]:
        if move.move_id not in self._in_flight:
            raise ValueError(f"move {move.move_id} is not in flight (committed or aborted)")
        return self._in_flight.pop(move.move_id)

    def _commit_node(self, node: TreeNode) -> list[int]:
        pending, node.pending = node.pending, None
        if pending.target is not None:
            self._set_ids(node, pending.target, pending.target_ids)
        if not self._can_release(node, pending.source):
            return []
        ids = node.ids(pending.source)
        self._set_ids(node, pending.source, None)
        if pending.source is Tier.HOST:
            self._host_pool.release(ids)
        self.stats.evicted_pages[pending.source] += len(ids)
        if not node.is_present:
            self._remove(node)
        return ids

    def _can_release(self, node: TreeNode, source: Tier) -> bool:
        if node.lock_count:
            return False
        if source is Tier.DEVICE and self._has_device_child(node, count_leaving=True):
            return False
        return self._has_other_tier(node, source) or not node.children

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[node.tokens[:self.page_size]]
        node.parent = None
        if parent.is_root and not parent.children:
            del self._roots[parent.extra_key]

    # ------------------------------------------------------------------ load

    def load_to_device(self, match: PrefixMatch, device_ids: Sequence[int]) -> list[int]:
        """Record that the caller copied ``match.pages_to_load`` into ``device_ids`` (same
        order). Lock ``match.last_node`` between the match and the load. Returns the ids not
        needed (pages another request brought to the device meanwhile): the caller frees them."""
        positions = [i for i, loc in enumerate(match.pages) if loc.tier is not Tier.DEVICE]
        self._check_load(match, len(positions), device_ids)
        if match.last_node is None:
            return []
        path = self.path(match.last_node)
        loads = self._plan_loads(path, dict(zip(positions, device_ids)))
        for node, ids in loads:
            self._set_ids(node, Tier.DEVICE, ids)
        self._touch(path)
        used = {i for _, ids in loads for i in ids}
        return [i for i in device_ids if i not in used]

    def _check_load(self, match: PrefixMatch, num_to_load: int, device_ids: Sequence[int]) -> None:
        if len(device_ids) != num_to_load:
            raise ValueError(f"the match has {num_to_load} pages to load, got "
                             f"{len(device_ids)} device ids")
        if match.last_node is not None:
            self._check_attached(match.last_node)
        held = self._held_device_ids.intersection(device_ids)
        if len(set(device_ids)) != len(device_ids) or held:
            raise ValueError("device ids to load into must be distinct and not held by the tree")

    def _plan_loads(self, path: list[TreeNode], new_ids: dict[int, int]) -> list[tuple]:
        """(node, its new device ids) for each off-device node on ``path``; ``new_ids`` maps
        page positions to ids. Checked in full before anything changes."""
        loads, start = [], 0
        for node in path:
            span = range(start, start + node.num_pages)
            if node.device_ids is None:
                if any(pos not in new_ids for pos in span):
                    raise ValueError("stale match: a page left the device after it was matched; "
                                     "lock the match's last node until the load is recorded")
                loads.append((node, [new_ids[pos] for pos in span]))
            start += node.num_pages
        return loads

"""The prefix store: the radix tree's plans carried out on the device, host and disk pools.

Owns: turning tree decisions into byte copies and block-pool references, in the order that
keeps every page valid: lock a match, load its off-device pages, then hand the request its
own references; write a device page back before its block is freed; write a host page to
disk before it is dropped. Never: choosing which request runs (the scheduler calls in) or
the tree's bookkeeping (``longctx.cache.radix_tree``).

Who holds a device block (``BlockPool`` reference counts): every request using it holds one,
and the tree holds one while it indexes the page. A page leaves the device only when the tree
evicts it and no request holds it; eviction is write-back (the copy to the host tier happens
at eviction, not at insert), because most cached pages are reused or dropped from the device
before they would ever need a host copy, and a copy per insert would cost every prefill.

    request tokens   [ page 0 | page 1 | page 2 | page 3 | partial ]
    tree match        device   device   host              (lock the last node)
    load              ------   ------   -> new block      (host -> device copy)
    disk probe                                   page_hashes(page 3) on disk? -> new block
    request blocks    [ b7     | b8     | b12    | b13    | fresh b14 ... ]

The disk tier sits outside the tree's own tiers: pages dropped from the host tier are written
to files named by their chained prefix hash, and a lookup that runs past the tree's match
probes the folder for the next pages' hashes. A new process with the same folder therefore
hits without any index, and a bad file ends the hit there (a miss, never wrong KV); the read
quarantines the pages chained after it, which this run recomputes and writes anew.

No bytes move here. Every copy is planned as an order (``longctx.kv.mover``) and queued in
``orders``, in the order the tree's bookkeeping assumes; the scheduler hands them to the
runner with the step, which executes them before the step's forward. A disk hit is planned
as a ``DiskLoad`` into blocks reserved for the request (not yet in the tree): the request
waits until the background thread has read them, then ``finish_disk_load`` indexes the
pages that were good and gives back the blocks of the rest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from longctx.cache.block_pool import BlockPool
from longctx.cache.radix_tree import PrefixMatch, RadixTree, TreeNode, page_hashes
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.disk_store import DiskKVStore
from longctx.kv.host_pool import HostKVPool, device_pages
from longctx.kv.mover import DiskLoad, DiskSave, HostLoad, HostSave, KVOrder


@dataclass
class CacheHit:
    """What a request got from the store at admission."""

    node: TreeNode | None  # locked for the request; ``release`` it when done
    block_ids: list[int]  # its prefix's device blocks; the request holds one reference each
    num_tokens: int  # tokens those blocks hold now (the disk load's pages not counted)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # tier name -> tokens from it
    disk_load: DiskLoad | None = None  # pages to read from disk into blocks after block_ids


@dataclass
class PrefixCacheStats:
    prompt_tokens: int = 0  # prompt tokens of every admitted request
    computed_prompt_tokens: int = 0  # of those, prefilled by the model (not served from cache)
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    disk_misses: dict[str, int] = field(default_factory=dict)  # reason -> pages
    disk_quarantined: int = 0  # disk pages taken out of use: bad files and the pages chained after them
    pages_written_to_disk: int = 0

    @classmethod
    def of(cls, cache: "PrefixCache | None", prompt_tokens: int, computed_prompt_tokens: int) -> "PrefixCacheStats":
        stats = cls(prompt_tokens, computed_prompt_tokens)
        if cache is not None:
            stats.hit_tokens = dict(cache.hit_tokens)
            if cache.disk is not None:
                stats.disk_misses = cache.disk.miss_counts()
                stats.disk_quarantined = cache.disk.num_quarantined
                stats.pages_written_to_disk = cache.disk.num_written
        return stats


class PrefixCache:
    def __init__(self, tree: RadixTree, pool: BlockPool, device_kv: DeviceKVPool,
                 host_kv: HostKVPool | None, disk: DiskKVStore | None, extra_key: Hashable) -> None:
        self.tree, self.pool, self.device_kv = tree, pool, device_kv
        self.host_kv, self.disk = host_kv, disk
        self.extra_key = extra_key
        self.page_size = tree.page_size
        self.hit_tokens = {"device": 0, "host": 0, "disk": 0}
        self.orders: list[KVOrder] = []  # planned copies, for the runner to execute in order

    def take_orders(self) -> list[KVOrder]:
        orders, self.orders = self.orders, []
        return orders

    def key(self, salt: str | None) -> Hashable:
        return self.extra_key if salt is None else (self.extra_key, salt)

    # ------------------------------------------------------------------ lookups

    def cached_tokens(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Tokens of ``tokens`` the tree has (any tier), without using them: for ordering."""
        return self.tree.match_prefix(tokens, self.key(salt), record=False).num_tokens

    def acquire(self, tokens: Sequence[int], salt: str | None, max_tokens: int,
                request_id: str = "", use_disk: bool = True) -> CacheHit:
        """The longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens, on the
        device (host pages: with their load orders queued), locked, with one block reference
        per page for the request; pages found on disk past it come as ``disk_load``, into
        blocks the request holds too."""
        key, ps = self.key(salt), self.page_size
        num_pages = min(max_tokens, len(tokens)) // ps
        if num_pages == 0:
            return CacheHit(None, [], 0)
        match = self.tree.match_prefix(tokens[:num_pages * ps], key)
        node = match.last_node
        if node is not None:
            self.tree.lock(node)
        tiers = {"device": len(match.device_ids) * ps}
        ids = self._load(match)
        if len(ids) > len(match.device_ids):
            tiers["host"] = (len(ids) - len(match.device_ids)) * ps
        self.pool.share(ids)
        for tier, count in tiers.items():
            self.hit_tokens[tier] += count
        hit = CacheHit(node, ids, len(ids) * ps, {t: n for t, n in tiers.items() if n})
        if use_disk and self.disk is not None and len(ids) == len(match.pages) < num_pages:
            prev = node.page_hashes[-1] if node is not None else ""
            hit.disk_load = self._plan_disk_read(tokens[len(ids) * ps:num_pages * ps], key, prev,
                                                 request_id)
        return hit

    def _load(self, match: PrefixMatch) -> list[int]:
        """Device ids of the match's pages, loading host pages first; only the leading device
        pages if the device has no room for the rest."""
        sources = [loc.page_id for loc in match.pages_to_load]
        if not sources:
            return match.device_ids
        if not self.ensure_free(len(sources)):
            return match.device_ids
        new_ids = self.pool.allocate(len(sources))
        self.orders.append(HostLoad(tuple(sources), tuple(new_ids)))
        self.pool.release(self.tree.load_to_device(match, new_ids))
        return [i for n in self.tree.path(match.last_node) for i in n.device_ids]

    def _plan_disk_read(self, tokens: Sequence[int], key: Hashable, prev_hash: str,
                        request_id: str) -> DiskLoad | None:
        """The pages continuing a prefix that the disk tier has (by name; their files are read
        and checked later, off the scheduler), each with a fresh device block the request
        holds."""
        keys: list[str] = []
        ids: list[int] = []
        for page_key in page_hashes(tokens, key, self.page_size, prev_hash):
            if not self.disk.contains(page_key) or not self.ensure_free(1):
                break
            keys.append(page_key)
            ids.append(self.pool.allocate(1)[0])  # one by one: ensure_free may evict in between
        if not keys:
            return None
        return DiskLoad(request_id, tuple(keys), tuple(ids))

    def finish_disk_load(self, tokens: Sequence[int], salt: str | None, node: TreeNode | None,
                         block_ids: list[int], load: DiskLoad) -> tuple[TreeNode | None, list[int]]:
        """Index the ``load.num_read`` pages ``load`` read (its blocks follow ``block_ids``, the request's prefix
        so far) and give back the blocks of pages that were missing or bad. Returns the
        request's lock node and its blocks, now ``block_ids`` plus the good pages'."""
        good = load.num_read
        bad = list(load.device_ids[good:])
        if bad:
            self.pool.release(bad)
        if not good:
            return node, list(block_ids)
        ids = list(block_ids) + list(load.device_ids[:good])
        result = self.tree.insert(tokens[:len(ids) * self.page_size], self.key(salt), ids)
        self.pool.share(result.owned)
        self.hit_tokens["disk"] += good * self.page_size
        return self._relock(result.node, node), ids

    # ------------------------------------------------------------------ inserts and locks

    def insert(self, tokens: Sequence[int], salt: str | None, block_ids: Sequence[int],
               node: TreeNode | None) -> TreeNode | None:
        """Index the full pages of ``tokens`` (computed KV in ``block_ids``); the request's lock
        moves from ``node`` to the node ending at its last page, which is returned."""
        result = self.tree.insert(tokens, self.key(salt), block_ids[:len(tokens) // self.page_size])
        self.pool.share(result.owned)
        return self._relock(result.node, node)

    def _relock(self, new: TreeNode | None, old: TreeNode | None) -> TreeNode | None:
        if new is old:
            return old
        if new is not None:
            self.tree.lock(new)
        if old is not None:
            self.tree.unlock(old)
        return new

    def release(self, node: TreeNode | None) -> None:
        if node is not None:
            self.tree.unlock(node)

    # ------------------------------------------------------------------ eviction

    def ensure_free(self, num_blocks: int) -> bool:
        """Evict cached pages until ``num_blocks`` device blocks are free; False if it can't."""
        if self.pool.num_free < num_blocks:
            self.make_room(num_blocks - self.pool.num_free)
        return self.pool.num_free >= num_blocks

    def make_room(self, num_blocks: int) -> None:
        """Evict at least ``num_blocks`` device pages the tree holds (fewer if not enough are
        unlocked), writing them back to the host tier where it has room, else to disk."""
        if self.host_kv is not None:
            short = num_blocks - self.tree.num_free_host_pages
            if short > 0:
                self._evict_host(short)
        for move in self.tree.evict_device(num_blocks):
            if move.write_back:
                self.orders.append(HostSave(tuple(move.source_ids), tuple(move.target_ids)))
            elif move.drops and self.disk is not None:  # no room on the host: straight to disk
                self._plan_disk_write(move.node.page_hashes, move.source_ids, "device")
            self.pool.release(self.tree.commit(move))

    def _evict_host(self, num_pages: int) -> None:
        for move in self.tree.evict_host(num_pages):
            if self.disk is not None:
                self._plan_disk_write(move.node.page_hashes, move.source_ids, "host")
            self.tree.commit(move)

    def _plan_disk_write(self, keys: Sequence[str], page_ids: Sequence[int], tier: str) -> None:
        keys = tuple(keys)[:len(page_ids)]
        self.orders.append(DiskSave(keys, tuple(page_ids), tier))

    # ------------------------------------------------------------------ whole-store operations

    def persist(self) -> int:
        """Write every cached page not yet on disk to the disk tier; returns pages written.
        The queued orders must have been executed (the engine does so first)."""
        if self.disk is None:
            return 0
        if self.orders:
            raise RuntimeError("persist() with KV orders not yet executed")
        self.disk.flush()
        before = self.disk.num_written
        for node in list(self.tree.nodes()):
            todo = [i for i, k in enumerate(node.page_hashes) if not self.disk.contains(k)]
            if not todo:
                continue
            if node.device_ids is not None:
                pages = device_pages(self.device_kv, [node.device_ids[i] for i in todo])
            else:
                pages = self.host_kv.pages([node.host_ids[i] for i in todo])
            for i, page in zip(todo, pages):
                self.disk.put(node.page_hashes[i], page)
            self.disk.flush()  # node by node: a page that cannot be written is a write miss
        return self.disk.num_written - before

    def clear(self) -> None:
        """Forget every cached page (none may be in use); their device blocks are freed."""
        self.pool.release(self.tree.clear())

    def num_pages(self, tier: str) -> int:
        if tier == "disk":
            return self.disk.num_pages if self.disk is not None else 0
        return self.tree.num_device_pages if tier == "device" else self.tree.num_host_pages


def host_tier_pages(host_cache_gb: float, bytes_per_page: int) -> int:
    return int(host_cache_gb * (1 << 30)) // bytes_per_page


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
hits without any index, and a bad file ends the hit there (a miss, never wrong KV).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from longctx.cache.block_pool import BlockPool
from longctx.cache.radix_tree import PrefixMatch, RadixTree, TreeNode, page_hashes
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.disk_store import DiskKVStore
from longctx.kv.host_pool import HostKVPool, device_pages, store_device_page


@dataclass
class CacheHit:
    """What a request got from the store at admission."""

    node: TreeNode | None  # locked for the request; ``release`` it when done
    block_ids: list[int]  # its prefix's device blocks; the request holds one reference each
    num_tokens: int
    tier_tokens: dict[str, int] = field(default_factory=dict)  # tier name -> tokens from it


@dataclass
class PrefixCacheStats:
    prompt_tokens: int = 0  # prompt tokens of every admitted request
    computed_prompt_tokens: int = 0  # of those, prefilled by the model (not served from cache)
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    disk_misses: dict[str, int] = field(default_factory=dict)  # reason -> pages
    pages_written_to_disk: int = 0

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    def __init__(self, tree: RadixTree, pool: BlockPool, device_kv: DeviceKVPool,
                 host_kv: HostKVPool | None, disk: DiskKVStore | None, extra_key: Hashable) -> None:
        self.tree, self.pool, self.device_kv = tree, pool, device_kv
        self.host_kv, self.disk = host_kv, disk
        self.extra_key = extra_key
        self.page_size = tree.page_size
        self.hit_tokens = {"device": 0, "host": 0, "disk": 0}

    def key(self, salt: str | None) -> Hashable:
        return self.extra_key if salt is None else (self.extra_key, salt)

    # ------------------------------------------------------------------ lookups

    def cached_tokens(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Tokens of ``tokens`` the tree has (any tier), without using them: for ordering."""
        return self.tree.match_prefix(tokens, self.key(salt), record=False).num_tokens

    def acquire(self, tokens: Sequence[int], salt: str | None, max_tokens: int) -> CacheHit:
        """The longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens, on the
        device, locked, with one block reference per page for the request."""
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
        if self.disk is not None and len(ids) == len(match.pages) < num_pages:
            prev = node.page_hashes[-1] if node is not None else ""
            disk_ids = self._read_disk(tokens[len(ids) * ps:num_pages * ps], key, prev)
            if disk_ids:
                tiers["disk"] = len(disk_ids) * ps
                ids += disk_ids
                node = self._relock(self.tree.insert(tokens[:len(ids) * ps], key, ids).node, node)
        self.pool.share(ids)
        for tier, count in tiers.items():
            self.hit_tokens[tier] += count
        return CacheHit(node, ids, len(ids) * ps, {t: n for t, n in tiers.items() if n})

    def _load(self, match: PrefixMatch) -> list[int]:
        """Device ids of the match's pages, loading host pages first; only the leading device
        pages if the device has no room for the rest."""
        sources = [loc.page_id for loc in match.pages_to_load]
        if not sources:
            return match.device_ids
        if not self.ensure_free(len(sources)):
            return match.device_ids
        new_ids = self.pool.allocate(len(sources))
        self.host_kv.load(sources, new_ids)
        self.pool.release(self.tree.load_to_device(match, new_ids))
        return [i for n in self.tree.path(match.last_node) for i in n.device_ids]

    def _read_disk(self, tokens: Sequence[int], key: Hashable, prev_hash: str) -> list[int]:
        """Pages continuing a prefix read from disk into fresh device blocks, up to the first
        page that is missing or bad."""
        ids: list[int] = []
        for page_key in page_hashes(tokens, key, self.page_size, prev_hash):
            if not self.disk.contains(page_key) or not self.ensure_free(1):
                break
            page = self.disk.read(page_key)
            if page is None:
                break
            block = self.pool.allocate(1)[0]
            store_device_page(self.device_kv, block, page)
            ids.append(block)
        return ids

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
                self.host_kv.write_back(list(move.source_ids), list(move.target_ids))
            elif move.drops and self.disk is not None:  # no room on the host: straight to disk
                self._write_disk(move.node.page_hashes, device_pages(self.device_kv, list(move.source_ids)))
            self.pool.release(self.tree.commit(move))

    def _evict_host(self, num_pages: int) -> None:
        for move in self.tree.evict_host(num_pages):
            if self.disk is not None:
                self._write_disk(move.node.page_hashes, self.host_kv.pages(list(move.source_ids)))
            self.tree.commit(move)

    def _write_disk(self, keys: Sequence[str], pages) -> None:
        for page_key, page in zip(keys, pages):
            self.disk.write(page_key, page)

    # ------------------------------------------------------------------ whole-store operations

    def persist(self) -> int:
        """Write every cached page not yet on disk to the disk tier; returns pages written."""
        if self.disk is None:
            return 0
        before = self.disk.num_written
        for node in list(self.tree.nodes()):
            todo = [i for i, k in enumerate(node.page_hashes) if not self.disk.contains(k)]
            if not todo:
                continue
            if node.device_ids is not None:
                pages = device_pages(self.device_kv, [node.device_ids[i] for i in todo])
            else:
                pages = self.host_kv.pages([node.host_ids[i] for i in todo])
            self._write_disk([node.page_hashes[i] for i in todo], pages)
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


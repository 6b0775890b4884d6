"""The KV page index: which block ids are free, and how many holders each used block has.

Owns: block ids and reference counts. Never: the KV bytes (``longctx.kv``) or torch.

Free ids are handed out lowest first (a heap). A lone sequence therefore gets consecutive
ids, which lets the CPU attention path read its pages as one view instead of gathering them.
"""

from __future__ import annotations

import heapq


class OutOfBlocksError(RuntimeError):
    """Asked for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a valid heap already
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh block ids (refcount 1), lowest first."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(count)]
        for i in ids:
            self._refcount[i] = 1
        return ids

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.num_blocks)]
        if bad:
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {bad[:5]}")

    def share(self, ids: list[int]) -> None:
        """One more holder for each of ``ids`` (they must be in use). All or nothing."""
        self._check_ids(ids)
        for i in ids:
            if self._refcount[i] <= 0:
                raise ValueError(f"block {i} is free and cannot be shared")
        for i in ids:
            self._refcount[i] += 1

    def release(self, ids: list[int]) -> None:
        """One holder fewer for each of ``ids``; a block with none left is free again.
        All or nothing: on an error the pool is unchanged."""
        self._check_ids(ids)
        counts: dict[int, int] = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
            if counts[i] > self._refcount[i]:
                raise ValueError(f"block {i} released more often than held")
        for i in ids:
            self._refcount[i] -= 1
            if self._refcount[i] == 0:
                heapq.heappush(self._free, i)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

"""How one sequence is split across the ranks of a sequence-parallel group.

Owns: the map from global token positions to (rank, local row), for two layouts:

* ``contiguous``: rank r holds the r-th of N nearly equal runs.
* ``zigzag``: the sequence is cut into 2N nearly equal chunks; rank r holds chunks r and
  2N-1-r. Under a causal mask every rank then has the same attention work in every ring step
  (one early chunk and its mirror late chunk), where contiguous sharding leaves rank 0 idle
  and rank N-1 with N times the work.

Never: communication or tensors beyond index bookkeeping.

Chunk sizes differ by at most one token: the first ``S % parts`` chunks get the extra token,
so odd lengths work (a rank may even hold nothing when S < 2N). Local rows are in increasing
global position, so a rank's shard is its segments concatenated in order.

    S = 10, N = 2, zigzag: chunks [0,3) [3,6) [6,8) [8,10)
    rank 0: positions 0 1 2 | 8 9      rank 1: positions 3 4 5 | 6 7
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

MODES = ("zigzag", "contiguous")


def split_sizes(length: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``length``, differing by at most one (larger first)."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class SequenceSharding:
    """A sequence of ``seq_len`` tokens over ``world_size`` ranks, starting at ``offset``
    (the global position of its first token, for a prefill round that follows others)."""

    seq_len: int
    world_size: int
    mode: str = "zigzag"
    offset: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sharding mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.world_size < 1 or self.seq_len < 0 or self.offset < 0:
            raise ValueError(f"bad sharding: seq_len {self.seq_len}, world_size {self.world_size}, "
                             f"offset {self.offset}")

    @cached_property
    def _segments(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        n = self.world_size
        parts = 2 * n if self.mode == "zigzag" else n
        bounds, start = [], self.offset
        for size in split_sizes(self.seq_len, parts):
            bounds.append((start, start + size))
            start += size
        if self.mode == "contiguous":
            return tuple((bounds[r],) for r in range(n))
        return tuple((bounds[r], bounds[2 * n - 1 - r]) for r in range(n))

    def segments(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Global ``[start, end)`` runs held by ``rank``, in increasing order (some may be empty)."""
        return self._segments[rank]

    def length(self, rank: int) -> int:
        return sum(end - start for start, end in self.segments(rank))

    @cached_property
    def max_length(self) -> int:
        return max(self.length(r) for r in range(self.world_size))

    def positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of ``rank``'s local rows, int64 [L_r]."""
        runs = [torch.arange(s, e, device=device) for s, e in self.segments(rank)]
        return torch.cat(runs) if runs else torch.empty(0, dtype=torch.long, device=device)

    def owner(self, position: int) -> int:
        """The rank holding global ``position``."""
        for rank in range(self.world_size):
            if any(s <= position < e for s, e in self.segments(rank)):
                return rank
        raise ValueError(f"position {position} is outside [{self.offset}, {self.offset + self.seq_len})")

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rows of the whole sequence ``x`` [S, ...] that ``rank`` holds: [L_r, ...]."""
        return torch.cat([x[s - self.offset:e - self.offset] for s, e in self.segments(rank)])

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``shard``: per-rank [L_r, ...] -> the whole sequence [S, ...]."""
        order = torch.cat([self.positions(r) for r in range(self.world_size)]) - self.offset
        stacked = torch.cat(shards)
        out = torch.empty_like(stacked)
        out[order.to(stacked.device)] = stacked
        return out

"""The AMX products' rounded-x layout, read back for the kernel tests."""

from __future__ import annotations

import torch


def tile_order_rows(xb: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``cpu_amx.round_x``'s A-tile order ([Mp / 16][K / 32][16][32] in memory) back to plain
    rows [Mp, K] (the first ``rows`` of them, where given)."""
    mp, k = xb.shape
    plain = xb.reshape(mp // 16, k // 32, 16, 32).permute(0, 2, 1, 3).reshape(mp, k)
    return plain if rows is None else plain[:rows]

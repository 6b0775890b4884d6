"""Ring attention, the sharded-KV decode merge and both prefix exchanges (queries
travel, K/V travel) in real processes (gloo on the CPU, world sizes 2 and 3) against the
single-process reference (``kernels/reference.py``) within fp32 tolerance. One process group
per world size runs every case (start-up costs seconds); each case is then checked as its own
test."""

from __future__ import annotations

import pytest
from sp_cases import kernel_case_names, run_all_kernel_cases

from longctx.parallel import spawn_ranks

TOLERANCE = 2e-5  # fp32: the fused CPU kernel and the merges vs fp32 einsum attention
WORLD_SIZES = (2, 3)
_RESULTS: dict[int, dict[str, tuple[float, float]]] = {}


def _results(world: int) -> dict[str, tuple[float, float]]:
    if world not in _RESULTS:
        per_rank = spawn_ranks(run_all_kernel_cases, world, timeout_s=240, group_timeout_s=60)
        _RESULTS[world] = {name: tuple(max(r[name][i] for r in per_rank) for i in range(2))
                           for name in per_rank[0]}
    return _RESULTS[world]


@pytest.mark.parametrize("world,name", [(w, n) for w in WORLD_SIZES for n in kernel_case_names(w)])
def test_matches_single_process_reference(world, name):
    out_err, lse_err = _results(world)[name]
    assert out_err < TOLERANCE, f"out differs by {out_err:.2e}"
    assert lse_err < TOLERANCE, f"lse differs by {lse_err:.2e}"

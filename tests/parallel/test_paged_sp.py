"""Attention over KV pages spread across ranks (``parallel/paged_sp.py``) in real processes,
over gloo and over the shared-memory board, against ``kernels/reference.py`` on the whole
cache (fp32, within 2e-5): decode batches, a prefill chunk past the tree-mask limit beside a
decode, two chunks split zigzag, a draft tree beside a short causal run with fewer cached
tokens than queries; GQA 1 and 3; pages from a shuffled pool, odd lengths, partial pages.
Also the token assignment rule, exactly."""

from __future__ import annotations

import pytest
from paged_sp_cases import CASES, run_all

from longctx.parallel import spawn_ranks
from longctx.parallel.paged_sp import assign_tokens, exchange_bytes
from longctx.parallel.shm_comm import ShmBoard

TOLERANCE = 2e-5
_RESULTS: dict[tuple[int, str], dict] = {}


def _results(world: int, transport: str) -> dict:
    key = (world, transport)
    if key not in _RESULTS:
        args = (ShmBoard(world, 1 << 20),) if transport == "shm" else ()
        per_rank = spawn_ranks(run_all, world, args, timeout_s=240, group_timeout_s=60)
        _RESULTS[key] = {name: (max(r[name][0] for r in per_rank), max(r[name][1] for r in per_rank),
                                [r[name][2] for r in per_rank]) for name in CASES}
    return _RESULTS[key]


@pytest.mark.parametrize("world,transport,name", [(w, t, n) for w in (2, 3) for t in ("gloo", "shm")
                                                   for n in CASES if (t, w) != ("gloo", 3)])
def test_matches_the_reference_on_the_whole_cache(world, transport, name):
    out_err, cache_err, owned = _results(world, transport)[name]
    assert out_err < TOLERANCE, f"out differs by {out_err:.2e}"
    assert cache_err == 0.0, "the new K/V did not land in the owning rank's pages"
    assert sum(owned) == sum(n for _, n, _ in CASES[name][2])


def test_small_steps_stay_on_rank_zero_and_chunks_split_zigzag():
    assert assign_tokens([1, 1, 1], 2) == [[0, 1, 2], []]
    assert assign_tokens([9, 9], 2) == [list(range(18)), []]  # 18 < 32 tokens
    # 40 tokens, one sequence, 2 ranks: pieces of 10; rank 0 takes 0 and 3, rank 1 takes 1 and 2
    assert assign_tokens([40], 2) == [list(range(0, 10)) + list(range(30, 40)), list(range(10, 30))]
    # a chunk of 36 and two decodes on 3 ranks: 6 pieces of 6 (0+5, 1+4, 2+3), then the
    # decodes go whole to the ranks with the fewest tokens (ties: the lowest rank)
    owned = assign_tokens([36, 1, 1], 3)
    assert owned == [list(range(0, 6)) + list(range(30, 36)) + [36], list(range(6, 12)) + list(range(24, 30)) + [37],
                     list(range(12, 24))]


def test_exchange_bytes_is_the_gather_plus_the_partials():
    # SmolLM2 geometry, fp32, 2 ranks, one token: q+k+v (9+3+3 heads x 64) out, 9 x 65 fp32 partials
    assert exchange_bytes(1, 2, 9, 3, 64, 4, 30) == 30 * (15 * 64 * 4 + 9 * 65 * 4)
    assert exchange_bytes(1, 1, 9, 3, 64, 4, 30) == 0

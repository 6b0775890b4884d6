"""The CPU torch path's forms all match the reference: for few new tokens, block-diagonal (decode
with few KV heads) and grouped matmuls over the whole context; for more, the prefix through the
flash kernel merged with the new tokens' own (causal or tree) part. Each case runs with the
block-diagonal form allowed and forbidden, and with the small-query limit at its default (3)
and at 63 (every tree through the whole-context matmuls)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import TWO_BRANCH_TREE, Case, check_against_reference, make_batch

from longctx.kernels import cpu_flash, reference, torch_paged

CASES = {
    "decode": Case((1, 1), (75, 161), num_kv_heads=2, group=3, seed=31),
    "verify-q5": Case((5, 1), (90, 41), num_kv_heads=2, group=3, seed=32),
    "tree7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=33),
    "decode-batch": Case((1, 1, 1), (33, 64, 5), num_kv_heads=3, group=3, seed=35),
    "many-kv-heads": Case((1, 3), (50, 77), num_kv_heads=8, group=2, seed=34),
    "tree3-and-chain4": Case((3, 4), (40, 9), num_kv_heads=1, group=4, trees=([-1, 0, 0], None), seed=36),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("max_kv_heads", [0, 64])
@pytest.mark.parametrize("small_q", [3, 63])
def test_every_form_matches_reference(monkeypatch, name, max_kv_heads, small_q):
    monkeypatch.setattr(torch_paged, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    monkeypatch.setattr(torch_paged, "SMALL_Q", small_q)
    case = CASES[name]
    check_against_reference(torch_paged, make_batch(case), case.dtype)


def _relayout(batch, tables: list[list[int]], num_blocks: int):
    """The same sequences with their pages moved to the block ids in ``tables``."""
    device = batch.k_cache.device  # the batch's device (CUDA where there is one), not the CPU
    k_cache = torch.full((num_blocks, *batch.k_cache.shape[1:]), float("nan"), dtype=batch.k_cache.dtype,
                         device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32, device=device)
    for b, ids in enumerate(tables):
        old = batch.block_table[b, :len(ids)].long()
        k_cache[ids] = batch.k_cache[old]
        v_cache[ids] = batch.v_cache[old]
        block_table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32, device=device)
    return dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache, block_table=block_table)


# contexts 75 and 161 at block size 16: 5 and 11 pages
LAYOUTS = {
    "one-run-each": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
    "prefix-hit-then-fresh": [[20, 21, 22, 0, 1], [2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 40]],
    "new-tokens-across-runs": [[0, 1, 2, 3, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 25]],
    "every-page-its-own-run": [[0, 2, 4, 6, 8], [30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10]],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("q_lens,trees", [((1, 1), None), ((3, 2), None), ((7, 5), None),
                                          ((7, 1), (TWO_BRANCH_TREE, None))])
@pytest.mark.parametrize("max_runs", [0, 16])
def test_block_runs_layouts_match_reference(monkeypatch, layout, q_lens, trees, max_runs):
    """Tables in one run (views), a few runs (attended run by run and merged) and, with
    ``MAX_RUNS`` 0, the gathered copy; new tokens that straddle two runs included."""
    monkeypatch.setattr(torch_paged, "MAX_RUNS", max_runs)
    monkeypatch.setattr(torch_paged, "MIN_RUN_TOKENS", 1)  # these contexts are short
    monkeypatch.setattr(torch_paged, "RUNS_MAX_Q", 63)  # and chunks and trees take runs too
    case = Case(q_lens, (75, 161), num_kv_heads=3, group=3, trees=trees, seed=41)
    check_against_reference(torch_paged, _relayout(make_batch(case), LAYOUTS[layout], 48), case.dtype)


def test_block_runs():
    assert torch_paged.block_runs([]) == []
    assert torch_paged.block_runs([4, 5, 6, 0, 1, 9]) == [(4, 3), (0, 2), (9, 1)]
    assert torch_paged.block_runs([3, 2]) == [(3, 1), (2, 1)]


@pytest.mark.parametrize("name", ["decode", "verify-q5", "tree7", "many-kv-heads"])
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("max_runs", [0, 16])
def test_float32_queries_over_bfloat16_pages(monkeypatch, name, kernels, max_runs):
    """A bf16 model on the CPU row kernel has fp32 activations over bf16 pages: every form (the
    compiled kernels, and the torch forms with and without runs) takes that mix and matches the
    reference on the pages widened to fp32. The flash kernel at the avx512bf16 level rounds each
    softmax weight to bf16 for its vdpbf16ps P.V (relative error <= 2^-9 per weight), so there
    its output may move by up to 2^-9 of the largest |V|; and it scores with q rounded to bf16,
    which moves a score by at most 2^-8 * scale * sum_x |q_x k_x|, the lse by as much and an
    output by twice that times the largest |V|."""
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", kernels)
    monkeypatch.setattr(torch_paged, "MAX_RUNS", max_runs)
    monkeypatch.setattr(torch_paged, "MIN_RUN_TOKENS", 1)
    case = CASES[name]
    batch = make_batch(case)
    mixed = dataclasses.replace(batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16())
    widened = dataclasses.replace(batch, k_cache=mixed.k_cache.float(), v_cache=mixed.v_cache.float())
    out, lse = torch_paged.paged_attention(*mixed.args(), tree_mask=mixed.tree_mask)
    ref_out, ref_lse = reference.paged_attention(*widened.args(), tree_mask=widened.tree_mask)
    assert out.dtype == torch.float32
    rounds_p = kernels and cpu_flash.rounds_bf16(mixed.k_cache)  # (vdpbf16ps: cpu_tune's choice)
    v = widened.v_cache[widened.v_cache.isfinite()]  # (unused pages hold NaN)
    atol = 1e-4 + (2 ** -9 * float(v.abs().max()) if rounds_p else 0.0)
    lse_atol = 1e-4
    if rounds_p:
        k = widened.k_cache[widened.k_cache.isfinite().all(-1)]  # [N, D] rows that hold keys
        score_move = 2 ** -8 * batch.q.shape[-1] ** -0.5 * float((batch.q.abs().flatten(0, 1) @ k.abs().T).max())
        lse_atol += score_move
        atol += 2 * score_move * float(v.abs().max())
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=atol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=lse_atol)

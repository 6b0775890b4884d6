"""Sliding windows and score caps on the CPU attention path (Mistral/Gemma/Phi-3 layers):
``torch_paged.paged_attention(window=, softcap=)`` through the compiled decode and flash
kernels and through the torch forms, float32, bfloat16 and int8 pages, against
``reference.paged_attention`` with the same arguments (tolerances: paged_cases.py). The
windows are smaller than a page, one page, across pages and past the context; the cases mix
decode, verification (causal and draft trees) and prefill chunks over a cached prefix, with
forced KV splits, so a split wholly outside a window is computed too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, make_batch
from test_int8_cpu import int8_batch

from longctx.kernels import cpu_decode, cpu_flash, reference, torch_paged

needs_kernels = pytest.mark.skipif(not (cpu_decode.available() and cpu_flash.available()),
                                   reason=f"kernels {cpu_decode.status()} / {cpu_flash.status()}")

CASES = {
    "decode": Case((1, 1, 1), (75, 161, 9), num_kv_heads=2, group=3, seed=41),
    "verify-q5": Case((5, 1), (90, 41), num_kv_heads=2, group=3, seed=42),
    "chunk": Case((37, 1), (100, 130), num_kv_heads=2, group=2, seed=43),
    "first-chunk": Case((45,), (45,), num_kv_heads=1, group=4, head_dim=32, seed=44),
    "tree7": Case((7, 1), (150, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=45),
    "wide-rows": Case((1, 2), (75, 161), num_kv_heads=8, group=4, head_dim=128, seed=46),  # 8-token tiles
}
WINDOWS = [1, 5, 16, 23, 70, 1000]  # block size 16: below, at, across pages; past every context


def _check(out, lse, ref_out, ref_lse, dtype):
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[dtype])


def _run(batch, window, softcap, **scales):
    out, lse = torch_paged.paged_attention(*batch.args(), tree_mask=batch.tree_mask, window=window,
                                           softcap=softcap, **scales)
    ref = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask, window=window,
                                    softcap=softcap, **scales)
    return out, lse, *ref


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=needs_kernels), False])
def test_window_matches_reference(monkeypatch, name, window, use_kernel):
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", use_kernel)
    case = CASES[name]
    if case.trees is not None and window < 64:
        pytest.skip("draft trees under windows below 64: covered by test_tree_under_a_small_window")
    batch = make_batch(case)
    _check(*_run(batch, window, None), torch.float32)


@pytest.mark.parametrize("name", ["decode", "verify-q5", "chunk", "tree7"])
@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=needs_kernels), False])
def test_softcap_matches_reference(monkeypatch, name, window, use_kernel):
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", use_kernel)
    case = CASES[name]
    if case.trees is not None and window is not None:
        window = 64
    batch = make_batch(case)
    batch = dataclasses.replace(batch, q=batch.q * 4)  # scores large enough for the cap to bite
    _check(*_run(batch, window, 5.0), torch.float32)


@needs_kernels
@pytest.mark.parametrize("name", ["decode", "chunk", "tree7"])
@pytest.mark.parametrize("dtype", ["bf16-pages", "int8-pages"])
def test_window_and_cap_over_bf16_and_int8_pages(name, dtype):
    case = CASES[name]
    window = 64 if case.trees is not None else 23
    if dtype == "int8-pages":
        data = int8_batch(case)
        _check(*_run(data.batch, window, 5.0, **data.scales), torch.float32)
        return
    _check_bf16_pages(make_batch(case), window, 5.0)


@needs_kernels
@pytest.mark.parametrize("window", [None, 300])
def test_cap_over_bf16_pages_between_the_first_tile_and_the_edge(window):
    """A 70-token chunk after 430 keys over bfloat16 pages: the first key tile, the ones between
    it and the causal edge and the edge's, whose scores take bfloat16 q at avx512bf16 (the AMX
    build's tiles, a strip group of rows at a time), capped; with a window, the tiles it skips
    and masks as well."""
    batch = make_batch(Case((70,), (500,), num_kv_heads=2, group=3, seed=47))
    _check_bf16_pages(dataclasses.replace(batch, q=batch.q * 4), window, 5.0)


def _check_bf16_pages(batch, window, softcap):
    """At avx512bf16 every key tile scores with q rounded to bf16 (within 2^-8 of each |q_x|),
    which moves a score by at most 2^-8 * scale * sum_x |q_x k_x| (the cap's slope is at most 1),
    the lse by as much and a weight by that share of itself."""
    batch = dataclasses.replace(batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16())
    out, lse, _, _ = _run(batch, window, softcap)
    ref_out, ref_lse = reference.paged_attention(batch.q, batch.k_cache.float(), batch.v_cache.float(),
                                                 *batch.args()[3:], tree_mask=batch.tree_mask, window=window,
                                                 softcap=softcap)
    # as test_torch_paged's bf16-pages test: at avx512bf16 the flash kernel rounds each softmax
    # weight to bf16 for its P.V, moving the output by up to 2^-9 of the largest |V|
    v = batch.v_cache.float()[batch.v_cache.isfinite()]
    bf16 = cpu_flash.rounds_bf16(batch.k_cache)  # (vdpbf16ps: cpu_tune's choice)
    atol = 1e-4 + (2 ** -9 * float(v.abs().max()) if bf16 else 0.0)
    lse_atol = 1e-4
    if bf16:
        ctx = int(batch.context_lens[0])
        k = torch_paged.sequence_kv(batch.k_cache, batch.block_table[0].tolist(), ctx).float()  # [ctx, Hkv, D]
        k = k.repeat_interleave(batch.q.shape[1] // k.shape[1], dim=1)
        pairs = torch.einsum("thd,nhd->thn", batch.q.abs(), k.abs())
        shift = 2 ** -8 * batch.q.shape[-1] ** -0.5 * float(pairs.max())
        lse_atol += shift
        atol += 2 * shift * float(v.abs().max())
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=atol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=lse_atol)


@needs_kernels
@pytest.mark.parametrize("window", [16, 300])
def test_splits_outside_the_window(window):
    """Forced KV splits over a long context: the splits start at the window's first key (the
    decode kernel's 32-token splits and the flash kernel's 4 splits)."""
    case = Case((1, 9), (700, 650), num_kv_heads=2, group=2, seed=46)
    batch = make_batch(case)
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens.tolist(), batch.cu_seqlens_q.tolist())
    ref_out, ref_lse = reference.paged_attention(*batch.args(), window=window)
    for kernel in ("decode", "flash"):
        out = torch.zeros_like(batch.q)
        lse = torch.zeros(batch.q.shape[:2])
        seqs = torch.tensor([0, 1], dtype=torch.int32)
        if kernel == "decode":
            cpu_decode.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, seqs, 0.125, out=out, lse=lse,
                                    split_tokens=32, window=window)
        else:
            cpu_flash.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, seqs, 0.125, out=out, lse=lse,
                                   splits=torch.tensor([4, 4], dtype=torch.int32), window=window)
        _check(out, lse, ref_out, ref_lse, torch.float32)


def test_tree_under_a_small_window(monkeypatch):
    """A draft tree under a window of fewer than 64 positions: new keys can fall outside it by
    depth, which the kernels do not model; such steps take the torch form (checked here by
    making the kernels fail if called)."""
    case = CASES["tree7"]
    batch = make_batch(case)

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel took a tree step under a window of < 64")

    monkeypatch.setattr(cpu_decode, "attend_batch", refuse)
    monkeypatch.setattr(cpu_flash, "attend_batch", refuse)
    for window in (1, 2, 3, 30):
        _check(*_run(batch, window, None), torch.float32)


def test_the_window_changes_the_answer():
    """The comparisons above can fail: a window of 23 and none differ on these cases."""
    batch = make_batch(CASES["chunk"])
    windowed, _ = torch_paged.paged_attention(*batch.args(), window=23)
    full, _ = torch_paged.paged_attention(*batch.args())
    capped, _ = torch_paged.paged_attention(*batch.args(), softcap=0.5)
    assert not torch.allclose(windowed, full, **OUT_TOL[torch.float32])
    assert not torch.allclose(capped, full, **OUT_TOL[torch.float32])


@pytest.mark.parametrize("window,softcap", [(0, None), (-3, None), (2.5, None), (True, None), (None, 0.0),
                                            (None, -1.0)])
def test_bad_window_or_cap_is_refused(window, softcap):
    batch = make_batch(CASES["decode"])
    with pytest.raises(ValueError, match="window|softcap"):
        torch_paged.paged_attention(*batch.args(), window=window, softcap=softcap)

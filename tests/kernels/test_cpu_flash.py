"""The compiled CPU flash kernel (kernels/csrc/paged_flash.c) against the reference: GQA ratios
1, 3 and 8, head dims 64, 80, 17 and 8 (its products run over the head dim one element at a
time, so any width takes the vector path), row counts that leave 32-row (AVX-512), 16-row,
8-row and partial strips and span several row blocks (96 rows; 192 in the AMX build), odd block sizes with shuffled tables and NaN in every slot no
sequence owns, causal and tree masks, float32 and bfloat16 caches, and KV splits merged by
log-sum-exp. Then how torch_paged routes to it, and the fallback when it cannot be built."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from amx_layout import tile_order_rows
from paged_cases import TWO_BRANCH_TREE, Case, check_against_reference, make_batch

from longctx.kernels import cpu_amx, cpu_build, cpu_decode, cpu_flash, reference, torch_paged

needs_kernel = pytest.mark.skipif(not cpu_flash.available(), reason=f"kernel {cpu_flash.status()}")


def kernel_impl(splits: int | None):
    """cpu_flash.attend sequence by sequence, shaped like a kernels module."""

    def paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, *,
                        scale=None, tree_mask=None):
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        cu = cu_seqlens_q.tolist()
        for b, ctx_len in enumerate(context_lens.tolist()):
            s, e = cu[b], cu[b + 1]
            words = tree_mask[s:e] if tree_mask is not None else None
            out[s:e], lse[s:e] = cpu_flash.attend(q[s:e], k_cache, v_cache, block_table[b].tolist(),
                                                  ctx_len, scale, words, splits)
        return out, lse

    return SimpleNamespace(paged_attention=paged_attention)


CASES = {
    # 37 tokens x 3 = 111 rows: a full 96-row block and a 15-row one (a 16-row strip, padded)
    "prefill-gqa3": Case((37, 60), (37, 200), num_kv_heads=3, group=3, seed=1),
    "chunk-mha": Case((50, 1), (177, 33), num_kv_heads=2, group=1, seed=2),
    # 13 tokens x 8 = 104 rows: 96 + 8 (an 8-row strip)
    "chunk-gqa8": Case((13,), (130,), num_kv_heads=1, group=8, seed=3),
    "verify-8-gqa3": Case((8, 9), (300, 41), num_kv_heads=3, group=3, seed=4),
    "tree-7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=5),
    "tree-63": Case((63,), (100,), num_kv_heads=1, group=2, trees=(None,), seed=6),
    "block-size-5": Case((30, 3), (123, 64), num_kv_heads=3, group=3, block_size=5, seed=7),
    "block-size-1": Case((9,), (20,), num_kv_heads=1, group=3, block_size=1, seed=8),
    "head-dim-80": Case((20, 2), (150, 77), num_kv_heads=2, group=3, head_dim=80, seed=9),
    "head-dim-17": Case((20, 2), (50, 77), num_kv_heads=2, group=3, head_dim=17, seed=10),
    "head-dim-8": Case((11,), (40,), num_kv_heads=2, group=4, head_dim=8, seed=11),
    "only-new-tokens": Case((200,), (200,), num_kv_heads=1, group=3, block_size=64, seed=12),
    "one-token": Case((1, 1), (1, 95), num_kv_heads=3, group=3, seed=13),
    # keys between the first tile and the causal edge as well as on them (the tiles that took
    # bfloat16 q alone while the edges kept float32 q), 4 x 20 = 80 rows (a 16-row strip past 64) and 15 x 4
    "long-context-gqa4": Case((20, 15), (400, 333), num_kv_heads=2, group=4, seed=24),
    # 70 x 3 = 210 rows after 430 keys: the AMX build's 192-row block (six 32-row strip groups)
    # and an 18-row one (a group of 32, padded), each over interior tiles
    "long-context-two-blocks": Case((70,), (500,), num_kv_heads=2, group=3, seed=25),
    # head dims 128 and 32 on the AMX build's tiles: four and one 32-wide chunks of the scores,
    # eight and two 16-wide groups of O^T
    "long-context-d128": Case((30, 9), (300, 250), num_kv_heads=2, group=4, head_dim=128, seed=26),
    "long-context-d32": Case((50,), (400,), num_kv_heads=2, group=2, head_dim=32, seed=27),
    # pages that follow each other (the AMX build reads a 16-key group of K in place when its rows
    # lie one cache row apart, across a page's end too): block sizes 5, 16 and 64, contexts that
    # end on a 16-key group and mid-group, NaN in the slots past them
    "ordered-block-5": Case((40, 7), (403, 77), num_kv_heads=2, group=3, block_size=5, ordered=True, seed=30),
    "ordered-block-16": Case((70,), (400,), num_kv_heads=2, group=3, block_size=16, ordered=True, seed=31),
    "ordered-block-64": Case((33, 20), (704, 300), num_kv_heads=3, group=3, block_size=64, ordered=True, seed=32),
}


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(name, splits, dtype):
    case = dataclasses.replace(CASES[name], dtype=dtype)
    check_against_reference(kernel_impl(splits), make_batch(case), dtype)


@pytest.mark.parametrize("vendor,flags", [("GenuineIntel", ("-DQK_KEYS=12", "-DPV_COLS=12")),
                                          ("AuthenticAMD", ()), ("", ())])
def test_wider_register_blocks_are_built_for_intel_cpus_only(vendor, flags):
    assert cpu_build.vendor_flags(cpu_flash.VENDOR_FLAGS, vendor) == flags


# head dims whose last pass of 12 or 7 columns is short by every count (64: 4 and 1 left, 80: 8
# and 3, 17: 5 and 3, 8: 8 and 1, 128: 8 and 2; 9-15, 18, 19 and 23 the other counts of both)
WIDE_CASES = {**{name: CASES[name] for name in ("prefill-gqa3", "chunk-gqa8", "block-size-5", "head-dim-80",
                                                "head-dim-17", "head-dim-8", "long-context-two-blocks",
                                                "long-context-d128", "tree-7")},
              **{f"head-dim-{d}": dataclasses.replace(CASES["head-dim-17"], head_dim=d, seed=40 + d)
                 for d in (9, 10, 11, 12, 13, 14, 15, 18, 19, 23)}}


@needs_kernel
@pytest.mark.skipif(not cpu_build.isa().startswith("avx512"), reason="the wider passes are AVX-512 code")
@pytest.mark.parametrize("blocks", [("-DQK_KEYS=12", "-DPV_COLS=12"), ("-DQK_KEYS=8", "-DPV_COLS=7")])
@pytest.mark.parametrize("name", list(WIDE_CASES))
def test_wider_register_blocks_give_the_same_bits(monkeypatch, blocks, name):
    """Builds whose AVX-512 float32 products take more keys (QK_KEYS) and head-dim columns
    (PV_COLS) a pass give the default build's bits (each sum the same, in the same order) and
    the reference's answer (NaN fills every slot no sequence owns): tiles whose keys end inside
    a pass, head dims that leave every count of 1-11 columns after the whole passes, 32-, 16-
    and 8-row strips."""
    batch = make_batch(WIDE_CASES[name])
    answers = []
    for flags in ((), blocks):  # the default build (what AMD CPUs run), then the wider one
        lib = cpu_build.build(cpu_flash.SOURCE, flags)
        cpu_flash._declare(lib)
        monkeypatch.setattr(cpu_flash._LIBRARY, "_lib", lib)
        monkeypatch.setattr(cpu_flash._LIBRARY, "_status", "ok")
        assert cpu_flash._library_for(batch.k_cache) is lib
        answers.append(kernel_impl(5).paged_attention(*batch.args(), tree_mask=batch.tree_mask))
    (default_out, default_lse), (out, lse) = answers
    assert torch.equal(out, default_out) and torch.equal(lse, default_lse)
    check_against_reference(kernel_impl(None), batch, torch.float32)


@pytest.mark.skipif(cpu_flash.amx_status() != "ok", reason=f"AMX build {cpu_flash.amx_status()}")
@pytest.mark.parametrize("name", ["long-context-gqa4", "long-context-two-blocks", "long-context-d128",
                                  "long-context-d32", "prefill-gqa3", "verify-8-gqa3", "tree-7", "block-size-5",
                                  "ordered-block-5", "ordered-block-16", "ordered-block-64"])
@pytest.mark.parametrize("splits", [1, 5])
def test_amx_build_agrees_with_the_vector_build_on_bfloat16_pages(monkeypatch, name, splits):
    """bfloat16 pages go to the AMX build where it loads: the same roundings (q, P to bfloat16)
    and float32 sums in another order, so it agrees with the vdpbf16ps build to float32 rounding,
    up to a weight whose bfloat16 rounding the order flips (2^-8 of it). Both round q in every
    key tile (with QK_EXACT_EDGES, a build-time switch, both keep float32 q in the first and the
    diagonal tiles, picked per 96 rows in both). Two 192-row blocks here. Head dims 64, 128 and 32,
    causal and tree masks, odd block sizes, KV splits; test_matches_reference checks both
    builds against the reference."""
    batch = make_batch(dataclasses.replace(CASES[name], dtype=torch.bfloat16))
    amx = cpu_flash._AMX_LIBRARY.load()
    assert cpu_flash._library_for(batch.k_cache) is amx and cpu_flash.row_block(batch.k_cache) == 192
    amx_out, amx_lse = kernel_impl(splits).paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    monkeypatch.setenv("LONGCTX_FLASH_AMX", "0")
    vec = cpu_flash._LIBRARY.load()
    assert cpu_flash._library_for(batch.k_cache) is vec
    was = vec.longctx_flash_bf16_dot()
    vec.longctx_flash_set_bf16_dot(1)  # its vdpbf16ps way, whatever this process chose (cpu_tune)
    try:
        vec_out, vec_lse = kernel_impl(splits).paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    finally:
        vec.longctx_flash_set_bf16_dot(was)
    torch.testing.assert_close(amx_out.float(), vec_out.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(amx_lse, vec_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(cpu_flash.amx_status() != "ok", reason=f"AMX build {cpu_flash.amx_status()}")
@pytest.mark.parametrize("ordered", [False, True])
def test_amx_v_packed_once_per_call_gives_the_same_bits(ordered):
    """The AMX build packs V^T's pairs of every 192-key tile once per call (prepack_v) for a
    sequence of two row blocks or more, where each work item had packed its own tiles. A window
    wider than every context leaves every key and tile as they were but turns that packing off:
    the same bits. Two long prefills (one call: their packed tiles side by side in one buffer),
    contexts that end mid-tile (zero words past them; NaN in the slots no sequence owns), a
    sequence of one row block in the same call that packs its own (the packing's jobs skip it)
    and a decode-sized one (the decode kernel's)."""
    case = Case((70, 10, 5, 90), (400, 47, 37, 650), num_kv_heads=2, group=3, dtype=torch.bfloat16,
                ordered=ordered, seed=35)
    batch = make_batch(case)
    out, lse = torch_paged.paged_attention(*batch.args())
    ref_out, ref_lse = torch_paged.paged_attention(*batch.args(), window=1 << 20)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    check_against_reference(torch_paged, batch, torch.bfloat16)


@needs_kernel
def test_more_splits_than_keys_and_rows_that_see_nothing():
    """Splits longer than the context leave empty splits (m = -inf), and a tree row that sees
    no key at all (no prefix, its own bit clear) gives out 0 and lse -inf, as the reference."""
    batch = make_batch(Case((3,), (3,), num_kv_heads=1, group=2, trees=([-1, 0, 0],), seed=14))
    batch.tree_mask[0] = 0  # token 0 sees nothing
    for splits in (1, 2, 7):
        out, lse = cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, batch.block_table[0].tolist(),
                                    3, 0.125, batch.tree_mask, splits)
        ref_out, ref_lse = reference.paged_attention(*batch.args(), scale=0.125, tree_mask=batch.tree_mask)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)



@needs_kernel
@pytest.mark.parametrize("scale", [1e-3, 0.125, 2.0, 40.0])
def test_softmax_over_the_exponentials_whole_range(scale):
    """The kernel's exp2 (a polynomial, 2^n built in the exponent bits, 0 below 2^-126) against
    the reference in float64, from nearly flat rows (scale 1e-3) to rows whose scores span
    hundreds of log2 units, so that most weights fall below 2^-126 and must come out 0, not
    garbage. A float32 score s carries an error of about |s| ulps, which moves its weight by as
    much, so the tolerance grows with the largest score: 8 float32 ulps of it, and 1e-6."""
    batch = make_batch(Case((40,), (300,), num_kv_heads=2, group=3, seed=15))
    args64 = [t.double() if t.is_floating_point() else t for t in batch.args()]
    ref_out, ref_lse = reference.paged_attention(*args64, scale=scale)
    k = torch_paged.sequence_kv(batch.k_cache, batch.block_table[0].tolist(), 300)  # [300, 2, 64]
    largest = scale * float(torch.einsum("thd,nkd->thkn", batch.q.double(), k.double()).abs().max())
    tol = 8 * torch.finfo(torch.float32).eps * max(largest, 1.0) + 1e-6
    for splits in (1, 3):
        out, lse = cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, batch.block_table[0].tolist(),
                                    300, scale, None, splits)
        torch.testing.assert_close(out.double(), ref_out.double(), atol=tol, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=tol, rtol=tol)


def test_split_choice_fills_the_threads():
    """Few row blocks (verification) get KV splits so that every thread has the same number of
    work items; a prefill chunk with many row blocks gets none; short contexts are not split
    below SPLIT_MIN_TOKENS."""
    threads = torch.get_num_threads()
    for q_len, ctx in ((1, 8192), (8, 8192), (9, 4000)):
        splits = cpu_flash.num_splits(q_len, 3, 3, ctx)
        items = 3 * -(-q_len * 3 // cpu_flash.ROW_BLOCK) * splits
        assert items >= 4 * threads and items % threads == 0, (q_len, splits)
    assert cpu_flash.num_splits(2048, 3, 3, 8192) == 1
    assert cpu_flash.num_splits(8, 3, 3, 600) == 1


@needs_kernel
def test_torch_paged_sends_long_steps_to_the_flash_kernel(monkeypatch):
    """Past CPU_KERNEL_MAX_ROWS rows a sequence goes to cpu_flash (decode-sized ones to
    cpu_decode); with the kernels switched off neither is called. Answers match the reference."""
    if not cpu_build.vectorized():
        pytest.skip("without the kernels' vector paths the engine keeps the torch forms (cpu_build.vectorized)")
    calls = []
    real = cpu_flash.attend_batch

    def record(q, k_cache, v_cache, tables, seqs, *a, **k):  # one entry per call: the new tokens per sequence
        calls.append([int(tables.cu_q[s + 1] - tables.cu_q[s]) for s in seqs.tolist()])
        return real(q, k_cache, v_cache, tables, seqs, *a, **k)

    monkeypatch.setattr(cpu_flash, "attend_batch", record)
    case = Case((1, 5, 7, 40), (80, 60, 70, 90), num_kv_heads=2, group=3, seed=21)
    check_against_reference(torch_paged, make_batch(case), torch.float32)
    assert calls == [[7, 40]]  # one call; 7 x 3 = 21 rows > 20; 1 and 5 tokens stay with the decode kernel
    calls.clear()
    tree = dataclasses.replace(case, trees=(None, None, TWO_BRANCH_TREE, None))
    check_against_reference(torch_paged, make_batch(tree), torch.float32)
    assert calls == [[7, 40]]
    calls.clear()
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", False)
    check_against_reference(torch_paged, make_batch(case), torch.float32)
    assert calls == []


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_rows_apart_are_read_in_place(monkeypatch, dtype):
    """A q whose token rows lie apart (a view of the [T, (H + 2 Hkv) D] qkv product, as the model
    passes it) reaches the flash kernel as it is, no copy, and gives the bits a contiguous q
    gives; NaN in the columns between its rows shows a read past a row's heads. A q whose heads
    are not packed within a row is refused with what was wrong."""
    if not cpu_build.vectorized():
        pytest.skip("without the kernels' vector paths the engine keeps the torch forms (cpu_build.vectorized)")
    batch = make_batch(Case((40, 25), (90, 60), num_kv_heads=2, group=3, dtype=dtype, seed=33))
    q = batch.q.float()  # the model's q is float32 over bfloat16 pages too
    total, heads, dim = q.shape
    wide = torch.full((total, heads + 4, dim), float("nan"))  # k's and v's heads' place: NaN
    wide[:, :heads] = q
    view = wide[:, :heads]
    assert not view.is_contiguous()
    seen = []
    real = cpu_flash.attend_batch

    def record(q, *a, **k):
        seen.append(q.data_ptr() == view.data_ptr())
        return real(q, *a, **k)

    monkeypatch.setattr(cpu_flash, "attend_batch", record)
    rest = batch.args()[1:]
    want_out, want_lse = torch_paged.paged_attention(q, *rest)
    got_out, got_lse = torch_paged.paged_attention(view, *rest)
    assert seen == [False, True]  # the contiguous q's call, then the view itself
    assert not got_out.isnan().any()
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    if dtype == torch.float32:
        check_against_reference(torch_paged, dataclasses.replace(batch, q=view), dtype)
    # heads apart within a row (a [T, D, H] tensor's transpose): refused, before C reads a byte
    tables = cpu_flash.prepare(batch.block_table[0].tolist(), 90, batch.k_cache)
    loose = q[:40].transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = torch.empty(40, heads, dim), torch.empty(40, heads)
    with pytest.raises(ValueError, match=r"each token's heads packed"):
        real(loose, batch.k_cache, batch.v_cache, *cpu_flash.single(loose, tables, None, all_visible=False)[:2],
             0.125, out=out, lse=lse, splits=torch.ones(1, dtype=torch.int32))


@needs_kernel
def test_one_token_q_with_any_row_stride():
    """A one-token q's row stride is whatever torch gave its view (here D, from a [H, 1, D]
    tensor's transpose, which torch calls contiguous): the flash kernel takes it as H * D, the
    same bits as a fresh q, where a check of the raw stride had refused it."""
    batch = make_batch(Case((1,), (75,), num_kv_heads=3, group=3, seed=36))
    heads, dim = batch.q.shape[1:]
    odd = batch.q.clone().as_strided((1, heads, dim), (dim, dim, 1))  # what [H, 1, D].transpose(0, 1) gives
    assert odd.is_contiguous() and odd.stride(0) == dim and torch.equal(odd, batch.q)
    tables = cpu_flash.prepare(batch.block_table[0].tolist(), 75, batch.k_cache)
    got = []
    for q in (batch.q.contiguous(), odd):
        out, lse = torch.empty(1, heads, dim), torch.empty(1, heads)
        cpu_flash.attend_batch(q, batch.k_cache, batch.v_cache, *cpu_flash.single(q, tables, None, all_visible=False)[:2],
                               0.125, out=out, lse=lse, splits=torch.ones(1, dtype=torch.int32))
        got.append((out, lse))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=0, atol=0)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_rounded_for_the_o_projection(dtype):
    """With ``rounded_out`` (a bf16 o projection on the AMX tiles next) and every row of the step
    on the flash kernel unsplit, the rows come rounded to bfloat16 in the tiles' order instead of
    float32: the bits of ``out`` rounded to nearest even, the padding rows past the step's
    tokens zero (the buffer starts as NaN), lse the same. A step with a row the decode kernel
    takes leaves the buffer alone and gives ``out``; a split sequence or a buffer of the wrong
    shape is refused."""
    batch = make_batch(Case((70, 10, 37), (400, 47, 37), num_kv_heads=3, group=3, dtype=dtype, seed=40))
    q = batch.q.float()
    rest = batch.args()[1:]
    if not cpu_flash.writes_rounded(batch.k_cache, q.shape[1]):
        pytest.skip("this CPU's flash library has no AVX-512 BF16 rounding")
    total, heads, dim = q.shape
    want_out, want_lse = torch_paged.paged_attention(q, *rest)
    buf = torch.full(((total + 15) // 16 * 16, heads * dim), float("nan"), dtype=torch.bfloat16)
    got, lse = torch_paged.paged_attention(q, *rest, rounded_out=buf)
    assert got is buf
    rows = tile_order_rows(buf)
    assert torch.equal(rows[:total].view(torch.int16), want_out.reshape(total, -1).bfloat16().view(torch.int16))
    assert torch.equal(rows[total:], torch.zeros_like(rows[total:]))
    if cpu_amx.available():  # what the o projection would have made of out itself, tile order and all
        assert torch.equal(buf.view(torch.int16), cpu_amx.round_x(want_out.reshape(total, -1)).view(torch.int16))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    # a one-token sequence goes to the decode kernel: the float32 rows as before, the buffer untouched
    mixed = make_batch(Case((70, 1), (400, 47), num_kv_heads=3, group=3, dtype=dtype, seed=41))
    spare = torch.full(((71 + 15) // 16 * 16, heads * dim), float("nan"), dtype=torch.bfloat16)
    out, _ = torch_paged.paged_attention(mixed.q.float(), *mixed.args()[1:], rounded_out=spare)
    assert out is not spare and out.dtype == torch.float32 and spare.isnan().all()
    # straight to attend_batch: a split sequence, a buffer of another shape
    tables = cpu_flash.prepare(batch.block_table[0].tolist(), 400, batch.k_cache)
    one = q[:70]
    seqs, words = cpu_flash.single(one, tables, None, all_visible=False)[:2]
    out, lse = torch.empty(70, heads, dim), torch.empty(70, heads)
    padded = torch.empty(80, heads * dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"code -6"):
        cpu_flash.attend_batch(one, batch.k_cache, batch.v_cache, seqs, words, 0.125, out=out, lse=lse,
                               splits=torch.full((1,), 2, dtype=torch.int32), rounded=padded)
    with pytest.raises(ValueError, match=r"rounded must be a contiguous bfloat16 \[80, 576\]"):
        cpu_flash.attend_batch(one, batch.k_cache, batch.v_cache, seqs, words, 0.125, out=out, lse=lse,
                               splits=torch.ones(1, dtype=torch.int32), rounded=padded[:70])
    # a call that leaves some of the step's rows to another kernel cannot fill the buffer: refused
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    out, lse = torch.empty(total, heads, dim), torch.empty(total, heads)
    with pytest.raises(ValueError, match=r"code -6"):
        cpu_flash.attend_batch(q, batch.k_cache, batch.v_cache, tables, torch.tensor([0, 2], dtype=torch.int32),
                               0.125, out=out, lse=lse, splits=torch.ones(2, dtype=torch.int32), rounded=buf)


@needs_kernel
def test_float16_caches_stay_on_the_torch_path():
    batch = make_batch(Case((40,), (60,), num_kv_heads=2, group=3, dtype=torch.float16, seed=22))
    assert not cpu_flash.supports(batch.q, batch.k_cache)
    check_against_reference(torch_paged, batch, torch.float16)


@needs_kernel
def test_prepared_blocks_output_buffers_and_bad_arguments():
    batch = make_batch(Case((30,), (75,), num_kv_heads=3, group=3, seed=23))
    blocks = batch.block_table[0].tolist()
    want_out, want_lse = cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, blocks, 75, 0.125)
    prepared = cpu_flash.prepare(blocks, 75, batch.k_cache)
    out, lse = torch.full_like(batch.q, float("nan")), torch.full(batch.q.shape[:2], float("nan"))
    got_out, got_lse = cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125,
                                        out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    with pytest.raises(ValueError, match="prepared for 75 tokens"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 70, 0.125)
    with pytest.raises(ValueError, match="block ids must lie in"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, blocks[:4] + [999], 75, 0.125)
    with pytest.raises(ValueError, match="need 5 blocks, got 2"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, blocks[:2], 75, 0.125)
    with pytest.raises(ValueError, match="one shape and dtype"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache.double(), prepared, 75, 0.125)
    with pytest.raises(ValueError, match="tree_words must have shape"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125,
                         torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="lse must be a contiguous float32"):
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125,
                         lse=torch.empty(30, 8))
    with pytest.raises(ValueError, match="rejected its arguments"):  # the C side's own check
        cpu_flash.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125, splits=0)
    long_tree = torch.randn(64, 9, 64)
    assert not cpu_flash.supports(long_tree, batch.k_cache, tree=True)
    assert cpu_flash.supports(long_tree, batch.k_cache)


FALLBACK = textwrap.dedent("""
    import dataclasses
    import torch
    from longctx.kernels import cpu_build, cpu_flash, torch_paged
    import sys; sys.path.insert(0, {tests!r})
    from paged_cases import TWO_BRANCH_TREE, Case, check_against_reference, make_batch
    {setup}
    print(cpu_flash.status())
    print("threads", torch.get_num_threads(), "vectorized", cpu_build.vectorized())
    for case in (Case((40, 7), (70, 33), num_kv_heads=2, group=3),
                 Case((7, 30), (20, 50), num_kv_heads=1, group=4, trees=(TWO_BRANCH_TREE, None))):
        batch = make_batch(case)
        try:
            check_against_reference(torch_paged, batch, torch.float32)
        except AssertionError:  # once under load (226 values off by up to 3.7e-5): what was it?
            from longctx.kernels import reference
            ref, _ = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
            for attempt in range(3):
                out, _ = torch_paged.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
                err = (out - ref).abs().amax(-1)
                bad = (err > 1e-5).nonzero().tolist()
                print("attempt", attempt, "rows (token, head) off:", bad[:20],
                      "max", err.max().item(), file=sys.stderr)
            raise
        check_against_reference(torch_paged, make_batch(dataclasses.replace(case, dtype=torch.bfloat16)),
                                torch.bfloat16)
    print("matched")
""")


@pytest.mark.parametrize("env,setup,expect", [
    ({"LONGCTX_CPU_KERNEL": "0"}, "", "disabled by LONGCTX_CPU_KERNEL=0"),
    ({"CC": "false"}, "", "unavailable: false failed"),
    # the C file's plain loops (no AVX2/FMA): the build for a CPU without them
    ({}, "cpu_build.FLAGS += ['-mno-avx2', '-mno-fma']", "ok"),
])
def test_fallbacks_answer_the_same(tmp_path, env, setup, expect):
    """Switched off or a compiler that fails: the status says why and the torch path answers;
    built without AVX2: the C file's plain loops answer. All match the reference."""
    if setup and not cpu_flash.available():
        pytest.skip(f"kernel {cpu_flash.status()}")
    script = FALLBACK.format(tests=os.path.dirname(__file__), setup=setup)
    full_env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith(expect)
    assert proc.stdout.splitlines()[-1] == "matched"
    if setup:  # the build really left the vector code out
        built = list((tmp_path / "cpu_kernels").glob("paged_flash-*.so"))
        # one, and where the CPU has AMX the AMX variant too (built for the bfloat16 pages, and
        # refused: these flags take its AVX-512 BF16 paths away)
        assert len(built) == 1 + (cpu_flash.amx_status() == "ok")
        for lib in built:
            dump = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True)
            if dump.returncode == 0:
                assert "vfmadd" not in dump.stdout


def test_a_changed_header_rebuilds_the_kernels_that_include_it(tmp_path, monkeypatch):
    """Both attention kernels include csrc/split_merge.h; the build cache key covers the headers
    beside a source, so editing one never loads a library built from the old text."""
    if not cpu_flash.available():
        pytest.skip(f"kernel {cpu_flash.status()}")
    src = tmp_path / "csrc"
    src.mkdir()
    for name in ("paged_flash.c", "split_merge.h"):
        (src / name).write_text((cpu_build.CSRC / name).read_text())
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    cpu_build.build(src / "paged_flash.c")
    (src / "split_merge.h").write_text((src / "split_merge.h").read_text() + "\n/* edited */\n")
    cpu_build.build(src / "paged_flash.c")
    assert len(list((tmp_path / "cache" / "cpu_kernels").glob("paged_flash-*.so"))) == 2


def _sink_and_recent_case(d: int = 64, ctx: int = 700, q_len: int = 24, seed: int = 0):
    """One sequence, one KV head, bf16 pages, float32 q with bits below bf16's: the first four
    keys and the new tokens carry the attention; every key in between scores ~50 below them
    (weights ~e^-60) whatever rounding q gets."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=gen)
    u = u / u.norm()
    q = (4.0 * u + 0.3 * torch.randn(q_len, 1, d, generator=gen)).float()
    k = torch.randn(ctx, 1, d, generator=gen)
    k[4:ctx - q_len] = -100.0 * u + 0.1 * torch.randn(ctx - q_len - 4, 1, d, generator=gen)
    v = torch.randn(ctx, 1, d, generator=gen)
    bs = 16
    blocks = list(range((ctx + bs - 1) // bs))
    pad = len(blocks) * bs - ctx
    k_cache = torch.cat([k, torch.zeros(pad, 1, d)]).view(len(blocks), bs, 1, d).bfloat16()
    v_cache = torch.cat([v, torch.zeros(pad, 1, d)]).view(len(blocks), bs, 1, d).bfloat16()
    return q, k_cache, v_cache, blocks


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3])
def test_bfloat16_pages_round_q_on_the_first_and_the_diagonal_keys_too(splits):
    """Where the scores over bf16 pages run by vdpbf16ps (avx512bf16) q is rounded to bf16 in
    every key tile, the first (the attention sink) and the diagonal ones (the recent keys)
    included (``QK_EXACT_EDGES`` off): with the attention on those keys only, the log-sum-exp
    equals a reference fed the rounded q to float32 error, where float32 q's differs by more
    than 1e-4. Below that level the scores keep float32 q. (The output is also checked, to the bound
    of P.V's rounding of p.)"""
    q, k_cache, v_cache, blocks = _sink_and_recent_case()
    ctx, scale = 700, 0.125
    out, lse = cpu_flash.attend(q, k_cache, v_cache, blocks, ctx, scale, splits=splits)
    table = torch.tensor([blocks], dtype=torch.int32)
    args = (k_cache.float(), v_cache.float(), table, torch.tensor([ctx], dtype=torch.int32),
            torch.tensor([0, q.shape[0]], dtype=torch.int32))
    rounds = cpu_flash.rounds_bf16(k_cache)  # q in the scores and p in P.V rounded to bf16 (vdpbf16ps)
    exact_out, exact_lse = reference.paged_attention(q, *args, scale=scale)
    c = scale * math.log2(math.e)  # (the kernel scores in log2 units: it rounds q * scale * log2 e)
    rounded_out, rounded_lse = reference.paged_attention((q * c).bfloat16().float() / c, *args, scale=scale)
    assert (rounded_lse - exact_lse).abs().max() > 1e-4  # q's rounding shows on these keys
    ref_out, ref_lse = (rounded_out, rounded_lse) if rounds else (exact_out, exact_lse)
    v_max = float(v_cache.float().abs().max())
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4 + (2 ** -9 * v_max if rounds else 0.0))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


MIXED_CASES = {  # long enough that tiles between the first and the diagonal ones exist (with QK_EXACT_EDGES: the ones that round q)
    "d80-gqa3": Case((5,), (700,), num_kv_heads=2, group=3, head_dim=80, seed=21),
    "d72-tree": Case((7,), (500,), num_kv_heads=1, group=3, head_dim=72, trees=(TWO_BRANCH_TREE,), seed=22),
    "d64-block5-two-seqs": Case((40, 3), (600, 300), num_kv_heads=3, group=3, block_size=5, seed=23),
}


@needs_kernel
@pytest.mark.parametrize("name", list(MIXED_CASES))
@pytest.mark.parametrize("splits", [None, 4])
def test_float32_q_over_bfloat16_pages_within_the_rounding_bound(name, splits):
    """float32 q over bf16 pages (what a bf16 model runs), against the reference on the same
    pages widened. At avx512bf16 every key tile scores with q rounded to bf16: each score
    then moves by at most scale * 2^-9 * sum_x |q_x k_x|, which moves an output by at most twice
    that times max|V| (first order), plus 2^-9 max|V| for P.V's rounding of p. Elsewhere the
    bound is float32 error. Head dims 80 and 72, a tree mask, a block size of 5, KV splits."""
    batch = make_batch(MIXED_CASES[name])
    q = batch.q.float()
    mixed = dataclasses.replace(batch, q=q, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16())
    widened = dataclasses.replace(mixed, k_cache=mixed.k_cache.float(), v_cache=mixed.v_cache.float())
    out, lse = kernel_impl(splits).paged_attention(*mixed.args(), tree_mask=mixed.tree_mask)
    ref_out, ref_lse = reference.paged_attention(*widened.args(), tree_mask=widened.tree_mask)
    k = widened.k_cache[widened.k_cache.isfinite().all(-1)]  # [N, D] rows that hold keys
    v_max = float(widened.v_cache[widened.v_cache.isfinite()].abs().max())
    scale = q.shape[-1] ** -0.5
    score_move = scale * 2 ** -9 * float((q.abs().flatten(0, 1) @ k.abs().T).max())
    if cpu_flash.rounds_bf16(mixed.k_cache):
        atol, lse_tol = 1e-4 + 2 * score_move * v_max + 2 ** -9 * v_max, 1e-4 + score_move
    else:
        atol, lse_tol = 1e-4, 1e-4
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=atol)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=lse_tol)

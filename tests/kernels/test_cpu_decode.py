"""The compiled CPU decode kernel (kernels/csrc/paged_decode.c) against the reference: GQA
ratios 1, 3 and 8, head dims that take the vector path (64, 128), its 8-lane tail (72) and the
scalar path (40), odd block sizes with shuffled tables and NaN in every slot no sequence owns,
causal and tree masks, float32 and bfloat16 caches, and splits small enough that every context
is merged from many partial states. Then how torch_paged routes to it, and the fallback when it
cannot be built or is switched off."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from paged_cases import LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, check_against_reference, make_batch

from longctx.kernels import cpu_build, cpu_decode, reference, torch_paged

HAVE_COMPILER = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def test_kernel_builds_where_there_is_a_compiler():
    if not HAVE_COMPILER:
        pytest.skip("no C compiler here; the torch path runs instead")
    assert cpu_decode.available(), cpu_decode.status()
    assert cpu_decode.status() == "ok"


needs_kernel = pytest.mark.skipif(not cpu_decode.available(), reason=f"kernel {cpu_decode.status()}")


def kernel_impl(split_tokens: int):
    """cpu_decode.attend sequence by sequence, shaped like a kernels module."""

    def paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, *,
                        scale=None, tree_mask=None):
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        cu = cu_seqlens_q.tolist()
        for b, ctx_len in enumerate(context_lens.tolist()):
            s, e = cu[b], cu[b + 1]
            words = tree_mask[s:e] if tree_mask is not None else None
            if words is None and e - s > 1:
                words = torch.tensor([(1 << (i + 1)) - 1 for i in range(e - s)])
            out[s:e], lse[s:e] = cpu_decode.attend(q[s:e], k_cache, v_cache, block_table[b].tolist(),
                                                   ctx_len, scale, words, split_tokens=split_tokens)
        return out, lse

    return SimpleNamespace(paged_attention=paged_attention)


CASES = {
    "decode-gqa3": Case((1, 1), (75, 161), num_kv_heads=3, group=3, seed=1),
    "decode-mha": Case((1, 1, 1), (1, 33, 200), num_kv_heads=4, group=1, seed=2),
    "decode-gqa8": Case((1,), (130,), num_kv_heads=2, group=8, seed=3),
    "verify-causal-5": Case((5, 2), (90, 41), num_kv_heads=2, group=3, seed=4),
    "tree-7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=5),
    "tree-3-chain-4": Case((3, 4), (40, 9), num_kv_heads=1, group=4, trees=([-1, 0, 0], None), seed=6),
    "block-size-5": Case((1, 3), (23, 64), num_kv_heads=3, group=3, block_size=5, seed=7),
    "head-dim-128": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=128, seed=8),
    "head-dim-72": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=72, seed=9),
    "head-dim-40-scalar": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=40, seed=10),
    # no multiple of 8: float pages take the copy loops at AVX2 too (and bf16 its widened tiles)
    "head-dim-36-copy-loops": Case((1, 3), (50, 77), num_kv_heads=2, group=4, head_dim=36, seed=16),
    # one vector per row at AVX-512, three, and the largest head dim (the padding key's zero row)
    "head-dim-16": Case((1, 3), (37, 70), num_kv_heads=2, group=3, head_dim=16, seed=13),
    "head-dim-48": Case((2, 1), (61, 18), num_kv_heads=1, group=5, head_dim=48, seed=14),
    "head-dim-256": Case((1, 2), (45, 38), num_kv_heads=1, group=3, head_dim=256, seed=15),
    "only-new-tokens": Case((4,), (4,), num_kv_heads=1, group=3, seed=11),
    "32-rows-per-head": Case((32,), (45,), num_kv_heads=1, group=3, seed=12),
    # rows of >= 4 KB: 8-token tiles at 4 and 8 query rows in AVX2-only builds, 32 at 12 (8 KV heads
    # of 128: 4 KB in float32, 2 KB in bfloat16; 16 KV heads: 8 and 4 KB)
    "wide-rows-8x128": Case((1, 2, 3), (75, 161, 9), num_kv_heads=8, group=4, head_dim=128, seed=17),
    "wide-rows-16x128": Case((1, 2), (75, 161), num_kv_heads=16, group=2, head_dim=128, seed=18),
}


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("split_tokens", [7, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(name, split_tokens, dtype):
    case = dataclasses.replace(CASES[name], dtype=dtype)
    check_against_reference(kernel_impl(split_tokens), make_batch(case), dtype)


@pytest.mark.parametrize("vendor,flags", [("GenuineIntel", ("-DSPREAD_AHEAD=1",)), ("AuthenticAMD", ()), ("", ())])
def test_spread_prefetch_is_built_for_intel_cpus(vendor, flags):
    assert cpu_build.vendor_flags(cpu_decode.VENDOR_FLAGS, vendor) == flags


@needs_kernel
@pytest.mark.parametrize("name", ["decode-gqa3", "verify-causal-5", "head-dim-128", "wide-rows-8x128",
                                  "head-dim-36-copy-loops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_prefetch_forms_give_the_reference_and_the_same_bits(monkeypatch, name, dtype):
    """The next tile's rows asked for per KV head (SPREAD_AHEAD 0, AVX-512 builds on AMD) or spread
    over the tile's work (1: AVX2 builds, Intel CPUs): each build matches the reference, and the
    two give the same bits (asking ahead adds no arithmetic). 512-token splits: each item holds
    the 41-161-token contexts whole, 2 to 6 tiles, so the next tile's rows are asked for."""
    case = dataclasses.replace(CASES[name], dtype=dtype)
    outs = []
    for spread in (0, 1):
        lib = cpu_build.build(cpu_decode.SOURCE, (f"-DSPREAD_AHEAD={spread}",))
        cpu_decode._declare(lib)
        monkeypatch.setattr(cpu_decode._LIBRARY, "_lib", lib)
        monkeypatch.setattr(cpu_decode._LIBRARY, "_status", "ok")
        batch = make_batch(case)
        check_against_reference(kernel_impl(512), batch, dtype)  # items of several tiles: asking ahead runs
        q, k_cache, v_cache, block_table, ctx_lens, _ = batch.args()
        outs.append(cpu_decode.attend(q[:1], k_cache, v_cache, block_table[0].tolist(), int(ctx_lens[0]),
                                      q.shape[-1] ** -0.5, split_tokens=512))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_items_cut_evenly_for_the_threads_keep_the_answer(threads):
    """A sequence's keys are cut into a multiple of the threads where the items stay two tiles
    long, on tile boundaries (1,100 keys at 512 a split: 3 items, or 4 of ~275 for 2 or 4
    threads); short ones keep their count. The answer is the reference's for any thread count."""
    from longctx.kernels import reference

    batch = make_batch(Case((1, 3, 1), (1100, 70, 640), num_kv_heads=3, group=3, seed=26))
    q, k_cache, v_cache, block_table, ctx_lens, cu_q = batch.args()
    tables = cpu_decode.batch_tables(block_table, ctx_lens, cu_q)
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))
    cpu_decode.attend_batch(q, k_cache, v_cache, tables, torch.arange(3, dtype=torch.int32), q.shape[-1] ** -0.5,
                            out=out, lse=lse, num_threads=threads)
    ref_out, ref_lse = reference.paged_attention(q, k_cache, v_cache, block_table, ctx_lens, cu_q)
    torch.testing.assert_close(out, ref_out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[torch.float32])


@needs_kernel
def test_torch_paged_sends_short_steps_to_the_kernel(monkeypatch):
    """Decode and short verification go to the kernel, long chunks to the flash path; both
    answers match the reference (check_against_reference)."""
    if not cpu_build.vectorized():
        pytest.skip("without the kernels' vector paths the engine keeps the torch forms (cpu_build.vectorized)")
    calls = []
    real = cpu_decode.attend_batch

    def record(q, k_cache, v_cache, tables, seqs, *a, **k):  # one entry per call: the new tokens per sequence
        calls.append([int(tables.cu_q[s + 1] - tables.cu_q[s]) for s in seqs.tolist()])
        return real(q, k_cache, v_cache, tables, seqs, *a, **k)

    monkeypatch.setattr(cpu_decode, "attend_batch", record)
    check_against_reference(torch_paged, make_batch(Case((1, 5, 40), (80, 60, 90), num_kv_heads=2,
                                                         group=3, seed=21)), torch.float32)
    assert calls == [[1, 5]]  # one call; 40 new tokens x group 3 = 120 rows > CPU_KERNEL_MAX_ROWS: flash
    calls.clear()
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", False)
    check_against_reference(torch_paged, make_batch(Case((1,), (80,), seed=22)), torch.float32)
    assert calls == []


@needs_kernel
def test_half_precision_caches_stay_on_the_torch_path():
    batch = make_batch(Case((1,), (40,), dtype=torch.float16, seed=23))
    assert not cpu_decode.supports(batch.q, batch.k_cache)
    check_against_reference(torch_paged, batch, torch.float16)


@needs_kernel
def test_bad_arguments_are_refused():
    batch = make_batch(Case((1,), (40,), seed=24))
    with pytest.raises(ValueError, match="block ids must lie in"):
        cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, [0, 1, 999], 40, 0.125)
    with pytest.raises(ValueError, match="need 3 blocks, got 2"):
        cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, [0, 1], 40, 0.125)
    with pytest.raises(ValueError, match="one shape and dtype"):
        cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache.double(), [0, 1, 2], 40, 0.125)


@needs_kernel
def test_prepared_blocks_and_output_buffers():
    """``prepare`` once, ``attend`` per layer writing into given buffers: the same numbers as
    the plain call; a table prepared for another length or cache is refused."""
    batch = make_batch(Case((1,), (75,), num_kv_heads=3, group=3, block_size=16, seed=25))
    blocks = batch.block_table[0].tolist()
    want_out, want_lse = cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, blocks, 75, 0.125)
    prepared = cpu_decode.prepare(blocks, 75, batch.k_cache)
    out, lse = torch.full_like(batch.q, float("nan")), torch.full(batch.q.shape[:2], float("nan"))
    got_out, got_lse = cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125,
                                         out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    with pytest.raises(ValueError, match="prepared for 75 tokens"):
        cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 70, 0.125)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        cpu_decode.attend(batch.q, batch.k_cache, batch.v_cache, prepared, 75, 0.125,
                          out=torch.empty(1, 9, 64, dtype=torch.float64))


@needs_kernel
def test_step_plan_follows_in_place_changes():
    """torch_paged keeps its per-sequence plan only in the step_cache it is handed (one per
    step): calls without one, on the same block table refilled in place (a new step reusing its
    buffers), must not see the old plan."""
    batch = make_batch(Case((1, 1), (75, 40), num_kv_heads=3, group=3, block_size=16, seed=26))
    check_against_reference(torch_paged, batch, torch.float32)
    # the same buffers, refilled: sequence 0 now reads sequence 1's pages and length
    batch.block_table[0].copy_(batch.block_table[1])
    batch.context_lens[0] = batch.context_lens[1]
    check_against_reference(torch_paged, batch, torch.float32)


def test_write_kv_follows_in_place_changes_of_the_slots():
    """write_kv keeps its slot handling only in a step_cache it is handed: a slot mapping
    refilled in place, or negative slots, must still land where they say."""
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([1, 6, -1], dtype=torch.int64)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch_paged.write_kv(k_cache, v_cache, k, v, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[1], k[0]) and torch.equal(flat_v[6], v[1])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # the -1 slot wrote nothing
    slots[2] = 9  # refilled in place: now the third row is kept
    torch_paged.write_kv(k_cache, v_cache, 2 * k, 2 * v, slots)
    assert torch.equal(flat_k[9], 2 * k[2]) and torch.equal(flat_v[1], 2 * v[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,threads", [(3, 1), (70, 1), (70, 2), (131, 2)])
def test_float_pages_written_in_one_pass_are_torch_s_bytes(dtype, rows, threads):
    """``cpu_decode.write_float_kv`` (what ``write_kv`` runs for float pages here): k and v as
    strided views of fused qkv rows, some slots skipped (< 0), rows split over threads from 64
    on: the bytes torch's ``index_copy_`` of ``k.to(cache dtype)`` writes, rounding ties,
    subnormals and infinities included (a NaN stays a NaN); slots outside the cache refused
    before a byte is written."""
    gen = torch.Generator().manual_seed(rows + threads)
    heads, dim, blocks, bs = 3, 40, 12, 16
    qkv = torch.randn(rows, (4 + 2 * heads) * dim, generator=gen) * 3
    qkv[0, 4 * dim:4 * dim + 6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1e-40, float("inf"), -float("inf"), 0.0])
    k = qkv[:, 4 * dim:(4 + heads) * dim].view(rows, heads, dim)
    v = qkv[:, (4 + heads) * dim:].view(rows, heads, dim)
    slots = torch.randperm(blocks * bs, generator=gen)[:rows]
    slots[1::5] = -1  # (row 0, with the special values, is kept)
    want_k, want_v = (torch.randn(blocks, bs, heads, dim, generator=gen).to(dtype) for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    keep = slots >= 0
    want_k.view(-1, heads, dim).index_copy_(0, slots[keep], k[keep].to(dtype))
    want_v.view(-1, heads, dim).index_copy_(0, slots[keep], v[keep].to(dtype))
    assert cpu_decode.takes_float_write(got_k, got_v, k, v)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_decode.write_float_kv(got_k, got_v, k, v, slots)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    qkv[0, 4 * dim] = float("nan")
    cpu_decode.write_float_kv(got_k, got_v, k, v, slots)
    assert got_k.view(-1, heads, dim)[int(slots[0]), 0, 0].isnan()
    bad = slots.clone()
    bad[-1] = blocks * bs
    untouched = got_k.clone()
    with pytest.raises(ValueError, match="a slot outside the cache"):
        cpu_decode.write_float_kv(got_k, got_v, 2 * k, 2 * v, bad)
    assert torch.equal(got_k.view(torch.uint8), untouched.view(torch.uint8))  # (bytes: a NaN is there)
    for kc, kk in ((got_k.to(torch.float16), k), (got_k, k.to(torch.bfloat16)), (got_k, k.transpose(1, 2)),
                   (got_k[:, :, :2], k[:, :2])):
        assert not cpu_decode.takes_float_write(kc, kc if kc.shape == got_v.shape else got_v, kk, kk)


FALLBACK = textwrap.dedent("""
    import torch
    from longctx.kernels import cpu_build, cpu_decode, reference, torch_paged
    import sys; sys.path.insert(0, {tests!r})
    from paged_cases import Case, check_against_reference, make_batch
    print(cpu_decode.status())
    assert not cpu_decode.available()
    check_against_reference(torch_paged, make_batch(Case((1, 3), (70, 33), num_kv_heads=2, group=3)),
                            torch.float32)
    print("matched")
""")


@pytest.mark.parametrize("env,expect", [({"LONGCTX_CPU_KERNEL": "0"}, "disabled by LONGCTX_CPU_KERNEL=0"),
                                        ({"CC": "false"}, "unavailable: false failed")])
def test_without_the_kernel_the_torch_path_answers(tmp_path, env, expect):
    """Switched off, or a compiler that fails (``CC=false``, an empty cache dir): the status
    says why and paged attention still matches the reference."""
    script = FALLBACK.format(tests=os.path.dirname(__file__))
    full_env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith(expect)
    assert proc.stdout.splitlines()[-1] == "matched"

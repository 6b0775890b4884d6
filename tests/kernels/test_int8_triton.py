"""Triton paged attention over int8 KV pages (``kernels/kv_quant.py``) against
``reference.paged_attention`` given the same int8 caches and scales, and ``write_kv`` with
scales against ``kv_quant.write_int8``.

Batches: every page is written by ``kv_quant.write_int8`` from random K/V whose amplitude
changes token by token (so neighbouring pages get very different scales, and a key tile that
straddles pages must use each key's own page scale). A sequence's context arrives in three
writes (two pieces of the cached prefix, cut inside a page, then the new tokens), so pages
that are requantised when a later write raises their scale are read too. Block tables are
shuffled permutations of the pool; contexts end mid-page; the rows of a page nobody wrote
hold random int8 garbage; pages that start out holding an older scale forget it; spare pages
(what unused block-table entries point at) have NaN scales, so reading a page past a
sequence's end poisons the output.

Tolerances: those of the float Triton tests (``paged_cases.py``), against the reference run
on the same inputs: fp32 q 1e-5 (out and lse, atol and rtol); fp16 q out atol/rtol 2e-3,
lse atol 2e-3 rtol 1e-3. The reference dequantises pages to q's dtype and then computes in
fp32; the kernel multiplies exact int8 values in q's dtype and applies the scales in fp32,
so in fp16 the two differ by the reference's rounding of K/V to fp16 on top of the kernel's
usual fp16 rounding of p.

Runs under the Triton interpreter on the CPU (fp32 and fp16 q: the interpreter cannot do
bf16); tests/gpu/test_gpu_int8.py repeats the kernel checks on CUDA in fp16 and bf16.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from paged_cases import DEVICE, LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, ancestor_masks

from longctx.kernels import kv_quant, reference

triton_attention = pytest.importorskip("longctx.kernels.triton_attention")

F32, F16 = torch.float32, torch.float16


@dataclass
class Int8Batch:
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, BS, Hkv, D) int8
    v_cache: torch.Tensor
    k_scale: torch.Tensor  # (NB, Hkv) fp32
    v_scale: torch.Tensor
    block_table: torch.Tensor  # (B, max_blocks) int32
    context_lens: torch.Tensor  # (B,) int32
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    tree_mask: torch.Tensor | None

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.context_lens,
                self.cu_seqlens_q)

    def scales(self):
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)


def random_rows(gen: torch.Generator, n: int, hkv: int, dim: int) -> torch.Tensor:
    """randn rows whose size jumps token by token (0.05x to 3x): pages get different scales."""
    amplitude = 0.05 + 3 * torch.rand(n, 1, 1, generator=gen) ** 2
    return torch.randn(n, hkv, dim, generator=gen) * amplitude


def make_int8_batch(q_lens, ctx_lens, *, group=1, num_kv_heads=2, head_dim=64, block_size=16,
                    dtype=F32, trees=None, seed=0, v_amplitude=1.0) -> Int8Batch:
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, dim = block_size, num_kv_heads, head_dim
    blocks_per_seq = [math.ceil(c / bs) for c in ctx_lens]
    num_spare = 2
    num_blocks = sum(blocks_per_seq) + num_spare
    pool = torch.randperm(num_blocks, generator=gen)
    spare = pool[-num_spare:]
    k_cache = torch.randint(-128, 128, (num_blocks, bs, hkv, dim), generator=gen,
                            dtype=torch.int8)  # garbage wherever nothing is written
    v_cache = torch.randint(-128, 128, (num_blocks, bs, hkv, dim), generator=gen,
                            dtype=torch.int8)
    k_scale = 5 * torch.rand(num_blocks, hkv, generator=gen)  # stale scales of earlier owners
    v_scale = 5 * torch.rand(num_blocks, hkv, generator=gen)
    k_scale[spare] = float("nan")
    v_scale[spare] = float("nan")
    block_table = torch.full((len(ctx_lens), max(blocks_per_seq) + 2), int(spare[0]),
                             dtype=torch.int32)
    taken = 0
    for b, (q_len, ctx_len, n) in enumerate(zip(q_lens, ctx_lens, blocks_per_seq)):
        ids = pool[taken:taken + n]
        taken += n
        block_table[b, :n] = ids.to(torch.int32)
        num_cached = ctx_len - q_len
        cut = min(num_cached, num_cached // 2 + 3)  # inside a page (and page-aligned rarely)
        for lo, hi in ((0, cut), (cut, num_cached), (num_cached, ctx_len)):
            if hi <= lo:
                continue
            pos = torch.arange(lo, hi)
            slots = ids[pos // bs] * bs + pos % bs
            kv_quant.write_int8(k_cache, k_scale, random_rows(gen, hi - lo, hkv, dim), slots)
            kv_quant.write_int8(v_cache, v_scale,
                                v_amplitude * random_rows(gen, hi - lo, hkv, dim), slots)
    q = torch.randn(sum(q_lens), hkv * group, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tree = None
    if trees is not None:
        words = []
        for q_len, parents in zip(q_lens, trees):
            words += ancestor_masks(parents if parents is not None else list(range(-1, q_len - 1)))
        tree = torch.tensor(words, dtype=torch.int64, device=DEVICE)
    return Int8Batch(q.to(dtype).to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                     k_scale.to(DEVICE), v_scale.to(DEVICE), block_table.to(DEVICE),
                     torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), cu.to(DEVICE), tree)


def check_int8(batch: Int8Batch, fn=None) -> tuple[float, float]:
    """The kernel against the reference on the same int8 pages; returns the max errors."""
    fn = fn or triton_attention.paged_attention
    out, lse = fn(*batch.args(), tree_mask=batch.tree_mask, **batch.scales())
    ref_out, ref_lse = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask,
                                                 **batch.scales())
    dtype = batch.q.dtype
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert lse.shape == batch.q.shape[:2] and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out: a page or scale read past the context end?"
    assert not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[dtype])
    return ((out.float() - ref_out.float()).abs().max().item(),
            (lse - ref_lse).abs().max().item())


# (q_lens, ctx_lens, trees): decode of contexts ending mid-page, on a page edge and inside the
# first tile; a prefill chunk after a 40-token prefix beside a whole first prefill; a lookahead
# verify step (two-branch tree) beside a plain decode
KINDS = {
    "decode": ((1, 1, 1), (37, 16, 70), None),
    "prefill-after-prefix": ((19, 5), (59, 5), None),
    "verify-tree": ((7, 1), (37, 23), (TWO_BRANCH_TREE, None)),
}


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("kind", list(KINDS))
def test_int8_pages_match_reference(kind, group, dtype):
    q_lens, ctx_lens, trees = KINDS[kind]
    seed = 100 + 10 * group + list(KINDS).index(kind)
    batch = make_int8_batch(q_lens, ctx_lens, group=group, num_kv_heads=1 if group == 8 else 2,
                            dtype=dtype, trees=trees, seed=seed)
    check_int8(batch)


@pytest.mark.parametrize("block_size", [5, 64])
def test_pages_smaller_and_larger_than_a_key_tile(block_size):
    """Block size 5: every 32-key tile straddles up to 8 pages, each with its own scale.
    64: a page holds several tiles. Head dim 40 is padded to 64 with masks."""
    batch = make_int8_batch((1, 6, 1), (83, 47, 3), group=3, head_dim=40,
                            block_size=block_size, dtype=F16, seed=7 + block_size)
    check_int8(batch)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_split_counts(num_splits):
    batch = make_int8_batch((1, 5, 1), (150, 64, 9), group=3, seed=40 + num_splits,
                            trees=(None, None, None))

    def forced(*args, **kwargs):
        return triton_attention.launch_paged_attention(*args, num_splits=num_splits, **kwargs)

    check_int8(batch, forced)


def test_small_values_keep_fp16_precision():
    """V rows of size ~1e-4 (page scales ~1e-6) over a 700-token context: p x scale would sit
    in fp16 subnormals (below 6e-5) and lose most of its bits (a 1% error); the kernel
    multiplies p by scale / (the tile's largest V scale) instead, and is as close to the fp32
    truth as the reference computed from fp16 pages is."""
    batch = make_int8_batch((1, 1), (700, 300), group=2, dtype=F16, seed=77, v_amplitude=1e-4)
    out, _ = triton_attention.paged_attention(*batch.args(), **batch.scales())
    ref32, _ = reference.paged_attention(batch.q.float(), *batch.args()[1:], **batch.scales())
    ref16, _ = reference.paged_attention(*batch.args(), **batch.scales())
    size = ref32.abs().max()
    err = ((out.float() - ref32).abs().max() / size).item()
    base = ((ref16.float() - ref32).abs().max() / size).item()
    assert err <= 2 * base + 1e-4, (err, base)


def test_matches_float_pages_holding_the_dequantised_values():
    """The same numbers as float pages, through the float kernel: equal to fp32 rounding."""
    batch = make_int8_batch((1, 4), (50, 29), group=3, seed=9)
    out, lse = triton_attention.paged_attention(*batch.args(), **batch.scales())
    k = kv_quant.dequantize(batch.k_cache, batch.k_scale.nan_to_num(0.0))
    v = kv_quant.dequantize(batch.v_cache, batch.v_scale.nan_to_num(0.0))
    f_out, f_lse = triton_attention.paged_attention(batch.q, k, v, *batch.args()[3:])
    torch.testing.assert_close(out, f_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, f_lse, rtol=1e-5, atol=1e-5)


def test_host_extents_skip_the_device_read(monkeypatch):
    batch = make_int8_batch((1, 5, 1), (150, 64, 9), group=3, seed=55)
    expected, _ = triton_attention.paged_attention(*batch.args(), **batch.scales())

    def no_read(*args, **kwargs):
        raise AssertionError("read the extents from the device")

    monkeypatch.setattr(triton_attention, "_sequence_extents", no_read)
    out, _ = triton_attention.paged_attention(*batch.args(), extents=(5, 150), **batch.scales())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# write_kv with scales
# ---------------------------------------------------------------------------------------------


def fresh_pool(num_blocks=9, block_size=8, hkv=3, dim=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randint(-128, 128, (num_blocks, block_size, hkv, dim), generator=gen,
                          dtype=torch.int8)
    scale = torch.rand(num_blocks, hkv, generator=gen)
    return cache.to(DEVICE), scale.to(DEVICE)


def clone_pools(*tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_write_kv_with_scales_equals_write_int8(dtype):
    """Two steps into shuffled pages: a prefill (three sequences, runs entering fresh and
    half-full pages) then a decode step, with starts = each sequence's first row (what the
    runner passes) and without (run_starts); both equal kv_quant.write_int8 bit for bit."""
    gen = torch.Generator().manual_seed(3)
    k_cache, k_scale = fresh_pool(seed=1)
    v_cache, v_scale = fresh_pool(seed=2)
    bs = k_cache.shape[1]
    tables = [[6, 2], [0, 8, 4], [5]]
    # step 1: tokens [0, 11) of seq 0, [0, 19) of seq 1, [0, 3) of seq 2; step 2: one more each
    steps = [[(0, 11), (0, 19), (0, 3)], [(11, 12), (19, 20), (3, 4)]]
    mine = clone_pools(k_cache, k_scale, v_cache, v_scale)
    mine_default = clone_pools(k_cache, k_scale, v_cache, v_scale)
    theirs = clone_pools(k_cache, k_scale, v_cache, v_scale)
    for step in steps:
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs
                              for b, (lo, hi) in enumerate(step) for p in range(lo, hi)])
        cu = torch.tensor([0, *torch.tensor([hi - lo for lo, hi in step]).cumsum(0).tolist()])
        k = (3 * torch.randn(len(slots), 3, 24, generator=gen)).to(dtype).to(DEVICE)
        v = torch.randn(len(slots), 3, 24, generator=gen).to(dtype).to(DEVICE)
        slots, starts = slots.to(DEVICE), cu[:-1].to(DEVICE)
        triton_attention.write_kv(mine[0], mine[2], k, v, slots.int(), k_scale=mine[1],
                                  v_scale=mine[3], starts=starts)
        triton_attention.write_kv(mine_default[0], mine_default[2], k, v, slots,
                                  k_scale=mine_default[1], v_scale=mine_default[3])
        kv_quant.write_int8(theirs[0], theirs[1], k, slots)
        kv_quant.write_int8(theirs[2], theirs[3], v, slots)
    for got in (mine, mine_default):
        for a, b in zip(got, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_int8_write_kernels_requantise_round_and_share_pages_like_write_int8(dtype):
    """The Triton int8 write where its five launches could part from the torch form, bit for
    bit against kv_quant.write_int8:
    * a page holding rows whose |max| is 1 gets rows whose |max| is 4: its values are
      requantised with ratio exactly 1/4, so q * ratio lands on .5 for q = 2 mod 4 (round half
      to even, not half up);
    * new rows whose values are exact half steps (|max| 127 / 8, so the step is 1/8);
    * two runs whose first rows share one page (graph padding into a scratch page): that page
      is requantised once, not once per run;
    * a run that starts a page at offset 0 forgets the page's old scale, even a larger one."""
    bs, hkv, dim = 8, 3, 24
    k_cache, k_scale = fresh_pool(num_blocks=6, block_size=bs, hkv=hkv, dim=dim, seed=9)
    v_cache, v_scale = fresh_pool(num_blocks=6, block_size=bs, hkv=hkv, dim=dim, seed=10)
    gen = torch.Generator().manual_seed(11)

    def rows(n, amax):
        """n rows whose |max| per head is exactly amax (element 0), the rest below it."""
        x = (torch.rand(n, hkv, dim, generator=gen) * 2 - 1) * (0.97 * amax)
        x[..., 0] = amax
        return x.to(dtype)

    ties = torch.arange(dim, dtype=torch.float32) * 0.25 - 2.9375  # (2j + 1) / 16: half steps of 1/8
    ties[0] = 127 / 8
    tie_rows = ties.expand(2, hkv, dim).to(dtype)
    # first write: 5 rows at offsets 0-4 of page 2, 3 rows at offsets 0-2 of page 4
    first = (torch.tensor([16, 17, 18, 19, 20, 32, 33, 34]), torch.tensor([0, 5]),
             torch.cat([rows(5, 1.0), rows(3, 0.5)]), torch.cat([rows(5, 2.0), rows(3, 1.0)]))
    # second: page 2 continues (offset 5) 4x larger; page 4 continues (offset 3) with exact
    # half steps; two padding runs both start inside page 5 (offsets 1 and 3); page 1 restarts
    second = (torch.tensor([21, 22, 35, 36, 41, 43, 8, 9]), torch.tensor([0, 2, 4, 5, 6]),
              torch.cat([rows(2, 4.0), tie_rows, rows(2, 3.0), rows(2, 0.01)]),
              torch.cat([rows(2, 8.0), tie_rows, rows(2, 2.0), rows(2, 0.02)]))
    mine = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    theirs = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    for pool in (mine, theirs):  # page 5 holds values (fresh_pool's) at a small scale
        pool[1][5] = pool[3][5] = 0.005
        pool[1][1] = pool[3][1] = 100.0  # page 1 holds a large scale it must forget
    snapshots = []
    for slots, starts, k, v in (first, second):
        slots, starts, k, v = (t.to(DEVICE) for t in (slots, starts, k, v))
        triton_attention.write_kv(mine[0], mine[2], k, v, slots, k_scale=mine[1], v_scale=mine[3],
                                  starts=starts)
        kv_quant.write_int8(theirs[0], theirs[1], k, slots, starts)
        kv_quant.write_int8(theirs[2], theirs[3], v, slots, starts)
        snapshots.append([t.clone() for t in theirs])
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the cases happened: page 2's scale rose exactly 4x over values with q = 2 mod 4
    before, after = snapshots
    assert torch.equal(after[1][2], 4 * before[1][2])
    assert (before[0][2, :5].remainder(4) == 2).any()
    assert (after[1][5] > 0.005).all() and (after[1][1] < 1).all()


def test_int8_write_with_starts_never_writes_outside_the_pool():
    """With starts nothing is checked on the host (CUDA graphs): rows whose slot is negative or
    past the pool, and starts past the rows, must not write anywhere; the other rows come out
    as write_int8 writes them alone. Without starts a slot past the pool is refused."""
    k_cache, k_scale = fresh_pool(seed=12)
    v_cache, v_scale = fresh_pool(seed=13)
    gen = torch.Generator().manual_seed(14)
    k = torch.randn(5, 3, 24, generator=gen).to(DEVICE)
    v = torch.randn(5, 3, 24, generator=gen).to(DEVICE)
    slots = torch.tensor([17, -1, 18, 9 * 8, -8], device=DEVICE)  # pool: 9 pages of 8
    mine = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    theirs = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    triton_attention.write_kv(mine[0], mine[2], k, v, slots, k_scale=mine[1], v_scale=mine[3],
                              starts=torch.tensor([0, 7, -3], device=DEVICE))
    keep = torch.tensor([0, 2], device=DEVICE)
    kv_quant.write_int8(theirs[0], theirs[1], k[keep], slots[keep], torch.tensor([0], device=DEVICE))
    kv_quant.write_int8(theirs[2], theirs[3], v[keep], slots[keep], torch.tensor([0], device=DEVICE))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the pool"):
        triton_attention.write_kv(mine[0], mine[2], k, v, slots, k_scale=mine[1], v_scale=mine[3])


def test_write_kv_with_scales_skips_negative_slots_without_starts():
    """Without starts, slots < 0 are dropped (as reference.write_kv does)."""
    gen = torch.Generator().manual_seed(4)
    k_cache, k_scale = fresh_pool(seed=5)
    v_cache, v_scale = fresh_pool(seed=6)
    k = torch.randn(6, 3, 24, generator=gen).to(DEVICE)
    v = torch.randn(6, 3, 24, generator=gen).to(DEVICE)
    slots = torch.tensor([16, 17, -1, 18, -1, 40], device=DEVICE)
    mine = clone_pools(k_cache, k_scale, v_cache, v_scale)
    ref = clone_pools(k_cache, k_scale, v_cache, v_scale)
    triton_attention.write_kv(mine[0], mine[2], k, v, slots, k_scale=mine[1], v_scale=mine[3])
    reference.write_kv(ref[0], ref[2], k, v, slots, k_scale=ref[1], v_scale=ref[3])
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_write_kv_with_starts_does_not_look_for_runs(monkeypatch):
    """With starts the write needs nothing from the host (run_starts is where it would read)."""
    k_cache, k_scale = fresh_pool(seed=7)
    v_cache, v_scale = fresh_pool(seed=8)
    k = torch.randn(2, 3, 24).to(DEVICE)

    def no_read(*args, **kwargs):
        raise AssertionError("run_starts called")

    monkeypatch.setattr(kv_quant, "run_starts", no_read)
    triton_attention.write_kv(k_cache, v_cache, k, k, torch.tensor([3, 30], device=DEVICE),
                              k_scale=k_scale, v_scale=v_scale,
                              starts=torch.tensor([0, 1], device=DEVICE))


def test_write_then_attend_equals_reference():
    """A decode step end to end: write_kv with scales into the pages, then attention."""
    batch = make_int8_batch((1, 1), (40, 17), group=3, seed=12)
    caches = clone_pools(batch.k_cache, batch.k_scale, batch.v_cache, batch.v_scale)
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(2, 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 64, generator=gen).to(DEVICE)
    bs = batch.k_cache.shape[1]
    table = batch.block_table.cpu()
    slots = torch.tensor([int(table[b, p // bs]) * bs + p % bs for b, p in ((0, 40), (1, 17))],
                         device=DEVICE)
    ctx = batch.context_lens + 1
    triton_attention.write_kv(caches[0], caches[2], k, v, slots, k_scale=caches[1],
                              v_scale=caches[3], starts=batch.cu_seqlens_q[:-1].long())
    out, lse = triton_attention.paged_attention(
        batch.q, caches[0], caches[2], batch.block_table, ctx, batch.cu_seqlens_q,
        k_scale=caches[1], v_scale=caches[3], extents=(1, 41))
    reference.write_kv(batch.k_cache, batch.v_cache, k, v, slots, k_scale=batch.k_scale,
                       v_scale=batch.v_scale)
    ref_out, ref_lse = reference.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, ctx, batch.cu_seqlens_q,
        k_scale=batch.k_scale, v_scale=batch.v_scale)
    torch.testing.assert_close(out, ref_out, **OUT_TOL[F32])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[F32])


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def test_int8_pages_without_scales_are_refused():
    batch = make_int8_batch((1,), (20,), seed=30)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        triton_attention.paged_attention(*batch.args())
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        triton_attention.paged_attention(*batch.args(), k_scale=batch.k_scale)
    k = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        triton_attention.write_kv(batch.k_cache, batch.v_cache, k, k,
                                  torch.zeros(1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("bad", ["dtype", "shape", "device", "transposed"])
def test_bad_scales_are_refused(bad):
    batch = make_int8_batch((1,), (20,), seed=31)
    k_scale = batch.k_scale
    if bad == "dtype":
        k_scale, match = k_scale.half(), "float32"
    elif bad == "shape":
        k_scale, match = k_scale[:-1], r"float32 \[NB, Hkv\]"
    elif bad == "device":
        k_scale, match = torch.empty(k_scale.shape, device="meta"), "is on meta"
    else:
        k_scale, match = k_scale.t(), r"float32 \[NB, Hkv\]"
    with pytest.raises(ValueError, match=match):
        triton_attention.paged_attention(*batch.args(), k_scale=k_scale, v_scale=batch.v_scale)
    k = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_attention.write_kv(batch.k_cache, batch.v_cache, k, k,
                                  torch.zeros(1, dtype=torch.long, device=DEVICE),
                                  k_scale=k_scale, v_scale=batch.v_scale)


def test_scales_beside_float_pages_and_mixed_caches_are_refused():
    batch = make_int8_batch((1,), (20,), seed=32)
    float_cache = batch.k_cache.float()
    with pytest.raises(ValueError, match="for int8 pages"):
        triton_attention.paged_attention(batch.q, float_cache, float_cache, *batch.args()[3:],
                                         **batch.scales())
    with pytest.raises(ValueError, match="dtypes differ"):
        triton_attention.paged_attention(batch.q, batch.k_cache, float_cache, *batch.args()[3:],
                                         **batch.scales())
    k = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="starts is for int8 pages"):
        triton_attention.write_kv(float_cache, float_cache.clone(), k, k,
                                  torch.zeros(1, dtype=torch.long, device=DEVICE),
                                  starts=torch.zeros(1, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# the int8 kernel compiles for real GPUs (the interpreter does not check what the compiler does)
# ---------------------------------------------------------------------------------------------

COMPILE_INT8 = r'''
import sys, torch, triton
import compile_triton_offline as c
ta = c.ta
for arch in (80, 90):
    for dtype, group, head_dim, max_q_len, tree in (
            (torch.float16, 4, 128, 1, False), (torch.bfloat16, 3, 64, 9, True),
            (torch.bfloat16, 8, 128, 2048, False), (torch.float32, 4, 128, 1, False)):
        plan = ta.plan_launch(num_tokens=max_q_len, num_seqs=1, num_kv_heads=2, group=group,
                              head_dim=head_dim, max_q_len=max_q_len, max_ctx_len=4096,
                              dtype=dtype, device=torch.device("cuda"), num_splits=1)
        elem = c.TL_NAMES[dtype]
        types = {"q_ptr": f"*{elem}", "k_ptr": "*i8", "v_ptr": "*i8", "block_table_ptr": "*i32",
                 "context_lens_ptr": "*i32", "cu_seqlens_ptr": "*i32",
                 "tree_ptr": "*i64" if tree else "*i32", "out_ptr": f"*{elem}",
                 "lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                 "qk_scale": "fp32"}
        dot_dtype, precision = ta._dot_config(dtype)
        constants = dict(GROUP=group, HEAD_DIM=head_dim,
                         BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                         BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
                         PAGE_SIZE=16, HAS_TREE=tree, DOT_DTYPE=dot_dtype,
                         DOT_PRECISION=precision, stride_ksh=1, stride_vsh=1)
        compiled = c.compile_kernel(ta._paged_attention_int8_kernel, types, constants, arch,
                                    plan.num_warps, plan.num_stages)
        regs, spills = c.registers_and_spills(compiled)
        print(f"sm_{arch} int8 {elem} G={group} D={head_dim} q_len={max_q_len} "
              f"registers={regs} local_bytes={spills}: ok")
    # the int8 write's five kernels, as write_kv launches them (no fp fusion: q * ratio is
    # rounded before it is rounded to an integer; IEEE division)
    sizes = dict(PAGE_SIZE=16, BLOCK_H=4)
    for kernel, constants in ((ta._int8_old_scales_kernel, sizes), (ta._int8_forget_kernel, sizes),
                              (ta._int8_raise_kernel, dict(HEAD_DIM=64, BLOCK_D=64, **sizes)),
                              (ta._int8_requant_kernel, dict(HEAD_DIM=64, BLOCK_D=64, **sizes)),
                              (ta._int8_store_kernel, dict(HEAD_DIM=64, BLOCK_D=64, **sizes))):
        types = {name: "*i64" if name in ("slots_ptr", "starts_ptr") else "*i8" if "cache" in name
                 else "*fp32" if "scale" in name or name == "old_ptr" else "*bf16"
                 for name in kernel.arg_names if name.endswith("_ptr")}
        compiled = c.compile_kernel(kernel, types, constants, arch, 4, enable_fp_fusion=False)
        ptx = compiled.asm["ptx"]
        assert "fma.rn.f32" not in ptx, kernel.__name__
        assert kernel in (ta._int8_old_scales_kernel, ta._int8_forget_kernel) or "div.rn.f32" in ptx
        regs, spills = c.registers_and_spills(compiled)
        print(f"sm_{arch} {kernel.__name__} registers={regs} local_bytes={spills}: ok")
'''

PTXAS = Path(triton_attention.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no NVIDIA ptxas")
def test_int8_kernel_compiles_for_ampere_and_hopper():
    """Decode, tree verify and prefill tiles in fp16/bf16, and fp32, for sm_80 and sm_90, in a
    fresh process without TRITON_INTERPRET (as test_triton_compile.py does for float pages);
    and the int8 write's kernels, with no fused multiply-add and IEEE division in their PTX."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE_INT8], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if line.endswith(": ok")]
    assert len(compiled) == 8 + 2 * 5, done.stdout

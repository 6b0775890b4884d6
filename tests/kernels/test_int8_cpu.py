"""int8 KV pages (kernels/kv_quant.py) on the CPU attention path, against the reference reading the
same int8 caches and scales (reference.paged_attention dequantises, then attends):

* the compiled decode kernel (paged_decode.c) and flash kernel (paged_flash.c) called directly:
  decode, short verification with causal and tree masks, prefill chunks, GQA ratios 1, 3 and 8,
  head dims 64 and 128 (the fused AVX-512 / AVX2 products) and 72, 40, 20, 80, 17 (the float
  copies and the plain-C tails), odd block sizes, partial last pages, shuffled (non-consecutive)
  block tables, KV splits merged by log-sum-exp, q in float32 and bfloat16;
* the same kernels built without AVX-512 and without AVX2 (``-mno-avx512f`` / ``-mno-avx2``),
  so the paths other CI machines take are tested here too;
* torch_paged routing to the kernels, and its torch forms with the kernels switched off;
* write_kv for int8 pages, and the ValueErrors for missing or malformed scales.

Every cache slot no sequence owns holds random int8 bytes, and pages no sequence owns random
scales, so a kernel that reads past a context (or the wrong page's scale) gives a different
answer; the context's slots hold values written through ``kv_quant.write_int8`` in two steps
(the cached prefix, then the new tokens, which may enter the prefix's last page).

Tolerances (paged_cases.py): q float32: out and lse atol 1e-5, rtol 1e-5 (the kernels differ from
the reference only in float32 summation order; the errors seen are ~1e-6). q bfloat16: the
bfloat16 bounds (the reference rounds the dequantised K/V to q's dtype, the kernels do not).
"""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
from paged_cases import LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, PagedBatch, make_batch

from longctx.kernels import cpu_build, cpu_decode, cpu_flash, kv_quant, reference, torch_paged

needs_decode = pytest.mark.skipif(not cpu_decode.available(), reason=f"kernel {cpu_decode.status()}")
needs_flash = pytest.mark.skipif(not cpu_flash.available(), reason=f"kernel {cpu_flash.status()}")


@dataclasses.dataclass
class Int8Batch:
    batch: PagedBatch  # int8 k_cache / v_cache, q in the case's q dtype
    k_scale: torch.Tensor  # [NB, Hkv] fp32
    v_scale: torch.Tensor

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def int8_batch(case: Case, q_dtype: torch.dtype = torch.float32) -> Int8Batch:
    """``make_batch``'s sequences (float32 K/V) quantised into int8 pages over garbage."""
    fp = make_batch(dataclasses.replace(case, dtype=torch.float32))
    fp = dataclasses.replace(fp, **{f.name: getattr(fp, f.name).cpu() for f in dataclasses.fields(fp)
                                    if getattr(fp, f.name) is not None})
    gen = torch.Generator().manual_seed(1000 + case.seed)
    num_blocks, bs, hkv, dim = fp.k_cache.shape
    cu = fp.cu_seqlens_q.tolist()
    out = []
    for src in (fp.k_cache, fp.v_cache):
        cache = torch.randint(-127, 128, (num_blocks, bs, hkv, dim), dtype=torch.int8, generator=gen)
        scale = torch.rand(num_blocks, hkv, generator=gen) * 4 + 0.5
        rows = src.view(-1, hkv, dim)
        for b, ctx_len in enumerate(fp.context_lens.tolist()):
            table = fp.block_table[b].tolist()
            slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(ctx_len)], dtype=torch.int64)
            num_cached = ctx_len - (cu[b + 1] - cu[b])
            for lo, hi in ((0, num_cached), (num_cached, ctx_len)):  # the prefix, then the step
                kv_quant.write_int8(cache, scale, rows[slots[lo:hi]], slots[lo:hi])
        out += [cache, scale]
    k_cache, k_scale, v_cache, v_scale = out
    batch = dataclasses.replace(fp, q=fp.q.to(q_dtype), k_cache=k_cache, v_cache=v_cache)
    return Int8Batch(batch, k_scale, v_scale)


def check_int8(paged_attention, data: Int8Batch) -> None:
    """``paged_attention`` (reference.py's signature, taking k_scale/v_scale) against the
    reference on the same int8 caches."""
    batch, dtype = data.batch, data.batch.q.dtype
    out, lse = paged_attention(*batch.args(), tree_mask=batch.tree_mask, **data.scales)
    ref_out, ref_lse = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask, **data.scales)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert lse.shape == batch.q.shape[:2] and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[dtype])


def decode_impl(split_tokens: int):
    """cpu_decode.attend sequence by sequence (causal words for chains), reference-shaped."""

    def paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, *,
                        tree_mask=None, k_scale=None, v_scale=None):
        scale = q.shape[-1] ** -0.5
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        cu = cu_seqlens_q.tolist()
        for b, ctx_len in enumerate(context_lens.tolist()):
            s, e = cu[b], cu[b + 1]
            words = tree_mask[s:e] if tree_mask is not None else None
            if words is None and e - s > 1:
                words = torch.tensor([(1 << (i + 1)) - 1 for i in range(e - s)])
            out[s:e], lse[s:e] = cpu_decode.attend(q[s:e], k_cache, v_cache, block_table[b].tolist(),
                                                   ctx_len, scale, words, split_tokens,
                                                   k_scale=k_scale, v_scale=v_scale)
        return out, lse

    return paged_attention


def flash_impl(splits: int | None):
    """cpu_flash.attend sequence by sequence, reference-shaped."""

    def paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, *,
                        tree_mask=None, k_scale=None, v_scale=None):
        scale = q.shape[-1] ** -0.5
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        cu = cu_seqlens_q.tolist()
        for b, ctx_len in enumerate(context_lens.tolist()):
            s, e = cu[b], cu[b + 1]
            words = tree_mask[s:e] if tree_mask is not None else None
            out[s:e], lse[s:e] = cpu_flash.attend(q[s:e], k_cache, v_cache, block_table[b].tolist(),
                                                  ctx_len, scale, words, splits,
                                                  k_scale=k_scale, v_scale=v_scale)
        return out, lse

    return paged_attention


DECODE_CASES = {
    "decode-gqa3": Case((1, 1), (75, 161), num_kv_heads=3, group=3, seed=1),
    "decode-mha": Case((1, 1, 1), (1, 33, 200), num_kv_heads=4, group=1, seed=2),
    "decode-gqa8": Case((1,), (130,), num_kv_heads=2, group=8, seed=3),
    "decode-d128": Case((1, 1), (50, 97), num_kv_heads=2, group=3, head_dim=128, seed=4),
    "decode-block-64": Case((1,), (1000,), num_kv_heads=3, group=3, block_size=64, seed=5),
    "verify-causal-3-5": Case((3, 5), (90, 41), num_kv_heads=2, group=3, seed=6),
    "verify-9-d128": Case((9,), (100,), num_kv_heads=2, group=3, head_dim=128, seed=7),
    "tree-7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=8),
    "tree-3-gqa8": Case((3, 4), (40, 9), num_kv_heads=1, group=8, trees=([-1, 0, 0], None), seed=9),
    "block-size-5": Case((1, 3), (23, 64), num_kv_heads=3, group=3, block_size=5, seed=10),
    "head-dim-72": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=72, seed=11),
    "head-dim-40": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=40, seed=12),
    "rows-4kb": Case((1, 2), (75, 161), num_kv_heads=32, group=1, head_dim=128, seed=19),  # 8-token tiles
    "head-dim-20": Case((1, 2), (50, 77), num_kv_heads=2, group=3, head_dim=20, seed=13),
    "only-new-tokens": Case((4,), (4,), num_kv_heads=1, group=3, seed=14),
}

FLASH_CASES = {
    "prefill-gqa3": Case((37, 60), (37, 200), num_kv_heads=3, group=3, seed=21),
    "chunk-mha": Case((50, 1), (177, 33), num_kv_heads=2, group=1, seed=22),
    "chunk-gqa8": Case((13,), (130,), num_kv_heads=1, group=8, seed=23),
    "chunk-d128": Case((40,), (301,), num_kv_heads=2, group=3, head_dim=128, seed=24),
    "chunk-block-64": Case((200,), (1000,), num_kv_heads=3, group=3, block_size=64, seed=25),
    "verify-8-9": Case((8, 9), (300, 41), num_kv_heads=3, group=3, seed=26),
    "tree-7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=27),
    "block-size-5": Case((30, 3), (123, 64), num_kv_heads=3, group=3, block_size=5, seed=28),
    "head-dim-80": Case((20, 2), (150, 77), num_kv_heads=2, group=3, head_dim=80, seed=29),
    "head-dim-17": Case((20, 2), (50, 77), num_kv_heads=2, group=3, head_dim=17, seed=30),
}

Q_DTYPES = [torch.float32, torch.bfloat16]


@needs_decode
@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("split_tokens", [7, 512])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_decode_kernel_matches_reference(name, split_tokens, q_dtype):
    check_int8(decode_impl(split_tokens), int8_batch(DECODE_CASES[name], q_dtype))


@needs_flash
@pytest.mark.parametrize("name", list(FLASH_CASES))
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_flash_kernel_matches_reference(name, splits, q_dtype):
    check_int8(flash_impl(splits), int8_batch(FLASH_CASES[name], q_dtype))


@needs_decode
@needs_flash
def test_the_comparisons_can_fail():
    """The comparisons above can fail: the same pages read with every scale doubled, or the
    cache's garbage taken for a context token (one more token), give other answers."""
    data = int8_batch(DECODE_CASES["decode-gqa3"])
    batch = data.batch
    out, _ = decode_impl(512)(*batch.args(), **data.scales)
    doubled, _ = decode_impl(512)(*batch.args(), k_scale=data.k_scale * 2, v_scale=data.v_scale * 2)
    longer = dataclasses.replace(batch, context_lens=batch.context_lens + 1)
    past, _ = flash_impl(1)(*longer.args(), **data.scales)
    assert not torch.allclose(out, doubled, atol=1e-3)
    assert not torch.allclose(out, past, atol=1e-3)


# -- the paths other machines take: the kernels built without AVX-512, and without AVX2 --------

PORTABLE = {"avx2": ["-mno-avx512f"], "plain-c": ["-mno-avx2"]}


@pytest.fixture(scope="module")
def portable_builds(tmp_path_factory):
    """The libraries of each level in PORTABLE, built once for the module (a build takes seconds;
    each test of a level reuses them)."""
    built: dict[str, list] = {}

    def get(level: str) -> list:
        if level not in built:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("LONGCTX_CACHE_DIR", str(tmp_path_factory.mktemp(level)))
                patch.setattr(cpu_build, "FLAGS", [*cpu_build.FLAGS, *PORTABLE[level]])
                built[level] = [cpu_build.build(module.SOURCE) for module in (cpu_decode, cpu_flash)]
        return built[level]

    return get


@pytest.fixture(params=list(PORTABLE))
def portable_kernels(request, monkeypatch, portable_builds):
    """cpu_decode / cpu_flash running builds made with the machine's flags minus AVX-512 (or
    minus AVX2, so the plain C loops), cached in a scratch directory."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the feature flags are x86 ones")
    if not (cpu_decode.available() and cpu_flash.available()):
        pytest.skip(f"kernels {cpu_decode.status()} / {cpu_flash.status()}")
    for module, lib in zip((cpu_decode, cpu_flash), portable_builds(request.param)):
        module._declare(lib)
        monkeypatch.setattr(module, "_load", lambda lib=lib: lib)
    return request.param


@pytest.mark.parametrize("name", ["decode-gqa3", "verify-9-d128", "tree-3-gqa8", "head-dim-72",
                                  "head-dim-20", "block-size-5"])
def test_portable_decode_builds_match_reference(portable_kernels, name):
    for split_tokens in (7, 512):
        check_int8(decode_impl(split_tokens), int8_batch(DECODE_CASES[name]))


@pytest.mark.parametrize("name", ["prefill-gqa3", "chunk-d128", "tree-7", "head-dim-17"])
def test_portable_flash_builds_match_reference(portable_kernels, name):
    for splits in (1, 5):
        check_int8(flash_impl(splits), int8_batch(FLASH_CASES[name]))


# -- torch_paged: routing to the kernels, and its torch forms without them ----------------------

PAGED_CASES = {
    "mixed-steps": Case((1, 5, 40), (80, 60, 90), num_kv_heads=2, group=3, seed=41),
    "decode-batch": Case((1, 1, 1), (33, 64, 5), num_kv_heads=3, group=3, seed=42),
    "trees": Case((7, 3, 4), (70, 40, 9), num_kv_heads=2, group=3,
                  trees=(TWO_BRANCH_TREE, [-1, 0, 0], None), seed=43),
    "gqa8-d128": Case((1, 2, 30), (97, 50, 130), num_kv_heads=1, group=8, head_dim=128, seed=44),
    "mha-block-64": Case((1, 9, 100), (1000, 700, 333), num_kv_heads=4, group=1, block_size=64, seed=45),
    "gqa1-long-runs": Case((1, 2), (4200, 4500), num_kv_heads=2, group=1, block_size=64, seed=46),
}


def paged_impl(**kwargs):
    return lambda *args, **kw: torch_paged.paged_attention(*args, **kw, **kwargs)


@pytest.mark.parametrize("name", list(PAGED_CASES))
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_torch_paged_matches_reference(monkeypatch, name, use_kernel, q_dtype):
    """With the kernels (where they build) and with them switched off: the torch forms
    (block-diagonal / grouped matmuls, the flash-and-merge chunk form) over dequantised pages.
    ``MIN_RUN_TOKENS`` 1: tables in a few runs would take the views-of-runs form on a float
    cache, which int8 pages must not reach."""
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", use_kernel)
    monkeypatch.setattr(torch_paged, "MIN_RUN_TOKENS", 1)
    check_int8(paged_impl(), int8_batch(PAGED_CASES[name], q_dtype))


@pytest.mark.parametrize("max_kv_heads", [0, 64])
@pytest.mark.parametrize("small_q", [3, 63])
def test_torch_forms_match_reference(monkeypatch, max_kv_heads, small_q):
    monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", False)
    monkeypatch.setattr(torch_paged, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    monkeypatch.setattr(torch_paged, "SMALL_Q", small_q)
    for name in ("mixed-steps", "trees", "decode-batch"):
        check_int8(paged_impl(), int8_batch(PAGED_CASES[name]))


@needs_decode
@needs_flash
def test_torch_paged_sends_int8_steps_to_the_kernels(monkeypatch):
    """Decode and short verification to the decode kernel, a long chunk to the flash kernel,
    with the scales; the answers as the reference's; the output buffer filled in place."""
    if not cpu_build.vectorized():
        pytest.skip("without the kernels' vector paths the engine keeps the torch forms (cpu_build.vectorized)")
    calls = []
    for module in (cpu_decode, cpu_flash):
        real = module.attend_batch

        def record(q, k_cache, v_cache, tables, seqs, *a, real=real, module=module, **k):
            calls.append((module.__name__.rsplit(".", 1)[-1],
                          [int(tables.cu_q[s + 1] - tables.cu_q[s]) for s in seqs.tolist()], k["k_scale"] is not None))
            return real(q, k_cache, v_cache, tables, seqs, *a, **k)

        monkeypatch.setattr(module, "attend_batch", record)
    data = int8_batch(PAGED_CASES["mixed-steps"])
    check_int8(paged_impl(), data)
    assert calls == [("cpu_decode", [1, 5], True), ("cpu_flash", [40], True)]
    out = torch.full_like(data.batch.q, float("nan"))
    got, _ = torch_paged.paged_attention(*data.batch.args(), out=out, step_cache={}, **data.scales)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()


def test_torch_dequantized_kv_is_the_reference_dequantisation():
    data = int8_batch(PAGED_CASES["decode-batch"])
    batch = data.batch
    table = batch.block_table[1].tolist()
    got = torch_paged.dequantized_kv(batch.k_cache, data.k_scale, table, 64, torch.float32)
    want = reference.gather_pages(kv_quant.dequantize(batch.k_cache, data.k_scale), batch.block_table[1], 64)
    assert torch.equal(got, want)


# -- write_kv ------------------------------------------------------------------------------------

def _empty_int8(num_blocks=6, block_size=4, hkv=2, dim=16):
    cache = torch.zeros(num_blocks, block_size, hkv, dim, dtype=torch.int8)
    return cache, torch.zeros(num_blocks, hkv)


@pytest.mark.parametrize("with_step_cache", [False, True])
def test_write_kv_int8_is_write_int8(with_step_cache):
    """write_kv with scales: the kept rows through kv_quant.write_int8 (negative slots
    dropped, ``starts`` passed on only while no row was dropped), then read back as written."""
    gen = torch.Generator().manual_seed(51)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([4, 5, 6, 13, 14])  # two sequences: blocks 1 and 3
    starts = torch.tensor([0, 3])
    for slot_mapping, want_slots, want_rows in ((slots, slots, slice(None)),
                                                (torch.tensor([4, 5, -1, 13, -1]), torch.tensor([4, 5, 13]),
                                                 torch.tensor([0, 1, 3]))):
        kc, ks = _empty_int8()
        vc, vs = _empty_int8()
        step_cache = {} if with_step_cache else None
        torch_paged.write_kv(kc, vc, k, v, slot_mapping, step_cache, k_scale=ks, v_scale=vs, starts=starts)
        wk, wks = _empty_int8()
        wv, wvs = _empty_int8()
        kv_quant.write_int8(wk, wks, k[want_rows], want_slots)
        kv_quant.write_int8(wv, wvs, v[want_rows], want_slots)
        assert torch.equal(kc, wk) and torch.equal(ks, wks) and torch.equal(vc, wv) and torch.equal(vs, wvs)
        back = kv_quant.dequantize_rows(kc, ks, want_slots)
        torch.testing.assert_close(back, k[want_rows], atol=float(ks.max()) / 2 + 1e-6, rtol=0)


def test_write_kv_int8_then_step_matches_reference(monkeypatch):
    """A prefix written in one call and a decode token in the next (entering the prefix's last
    page), through torch_paged.write_kv; attention over the result as the reference's."""
    gen = torch.Generator().manual_seed(52)
    kc, ks = _empty_int8(num_blocks=8, block_size=4, hkv=2, dim=64)
    vc, vs = _empty_int8(num_blocks=8, block_size=4, hkv=2, dim=64)
    table = [5, 2, 7, 0]
    slots = torch.tensor([table[t // 4] * 4 + t % 4 for t in range(14)])
    k, v = torch.randn(14, 2, 64, generator=gen), torch.randn(14, 2, 64, generator=gen)
    torch_paged.write_kv(kc, vc, k[:13], v[:13], slots[:13], k_scale=ks, v_scale=vs)
    torch_paged.write_kv(kc, vc, 3 * k[13:], 3 * v[13:], slots[13:], k_scale=ks, v_scale=vs,
                         starts=torch.tensor([0]))
    q = torch.randn(1, 6, 64, generator=gen)
    args = (q, kc, vc, torch.tensor([table], dtype=torch.int32), torch.tensor([14]), torch.tensor([0, 1]))
    want = reference.paged_attention(*args, k_scale=ks, v_scale=vs)
    for use_kernel in (True, False):
        monkeypatch.setattr(torch_paged, "USE_CPU_KERNEL", use_kernel)
        got = torch_paged.paged_attention(*args, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- refused arguments ---------------------------------------------------------------------------

def test_int8_without_scales_is_refused():
    data = int8_batch(DECODE_CASES["decode-gqa3"])
    batch = data.batch
    q, table = batch.q[:1], batch.block_table[0].tolist()
    with pytest.raises(ValueError, match="int8 KV caches need k_scale and v_scale"):
        torch_paged.paged_attention(*batch.args())
    with pytest.raises(ValueError, match="int8 KV caches need k_scale and v_scale"):
        torch_paged.paged_attention(*batch.args(), k_scale=data.k_scale)
    with pytest.raises(ValueError, match="int8 KV caches need k_scale and v_scale"):
        torch_paged.write_kv(batch.k_cache, batch.v_cache, torch.randn(1, 3, 64), torch.randn(1, 3, 64),
                             torch.tensor([0]))
    if cpu_decode.available():
        with pytest.raises(ValueError, match="int8 KV caches need k_scale and v_scale"):
            cpu_decode.attend(q, batch.k_cache, batch.v_cache, table, 75, 0.125)
    if cpu_flash.available():
        with pytest.raises(ValueError, match="int8 KV caches need k_scale and v_scale"):
            cpu_flash.attend(q, batch.k_cache, batch.v_cache, table, 75, 0.125, v_scale=data.v_scale)


@pytest.mark.parametrize("bad", ["float64", "shape", "transposed", "on-float-cache"])
def test_malformed_scales_are_refused(bad):
    data = int8_batch(DECODE_CASES["decode-gqa3"])
    batch = data.batch
    k_cache, v_cache, k_scale = batch.k_cache, batch.v_cache, data.k_scale
    match = "k_scale must be a contiguous float32 tensor of shape"
    if bad == "float64":
        k_scale = k_scale.double()
    elif bad == "shape":
        k_scale = k_scale[:-1]
    elif bad == "transposed":
        k_scale = k_scale.t().contiguous().t()
    else:
        k_cache, v_cache = k_cache.float(), v_cache.float()
        match = "are for int8 caches only"
    with pytest.raises(ValueError, match=match):
        torch_paged.paged_attention(batch.q, k_cache, v_cache, *batch.args()[3:], k_scale=k_scale,
                                    v_scale=data.v_scale)
    for module in (cpu_decode, cpu_flash):
        if module.available():
            with pytest.raises(ValueError, match=match):
                module.attend(batch.q[:1], k_cache, v_cache, batch.block_table[0].tolist(), 75, 0.125,
                              k_scale=k_scale, v_scale=data.v_scale)


def test_kernels_take_int8_caches():
    data = int8_batch(DECODE_CASES["decode-gqa3"])
    q, k_cache = data.batch.q[:1], data.batch.k_cache
    assert cpu_decode.supports(q, k_cache) == cpu_decode.available()
    assert cpu_flash.supports(q, k_cache) == cpu_flash.available()
    assert not cpu_decode.supports(q, k_cache.to(torch.int16))

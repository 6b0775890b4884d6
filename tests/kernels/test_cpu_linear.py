"""The compiled CPU weight-product kernel (kernels/csrc/linear_rows.c) against a float64
reference: float32 and bfloat16 weights, every row-block path of the dot products (1, 2, 3, 4 rows and their mixes up to 16)
and of the panels (17 rows on: six-row blocks and their remainders, partial 16-column panels,
several K blocks, several row blocks), weight row counts that leave every tile remainder, K
that is and is not a multiple of the 8-lane vector, bias, the RMSNorm and SwiGLU prologues and
the residual epilogue (against the model's own torch modules), strided and expanded inputs,
output buffers, refused arguments, the row limit with and without the panel path, and the
status when it cannot be built or is switched off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from longctx.kernels import cpu_build, cpu_linear

HAVE_COMPILER = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"kernel {cpu_linear.status()}")


def test_kernel_builds_where_there_is_a_compiler():
    if not HAVE_COMPILER:
        pytest.skip("no C compiler here; the model keeps oneDNN or BLAS")
    assert cpu_linear.available(), cpu_linear.status()


def _reference(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


def _operands(rows, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 17, 20, 23, 64, 97])
@pytest.mark.parametrize("n,k", [(1, 1), (37, 77), (96, 64), (203, 576), (9, 1543)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows, n, k, bias):
    x, w, b = _operands(rows, n, k, bias, seed=rows * 1000 + n + k)
    torch.testing.assert_close(cpu_linear.linear(x, w, b), _reference(x, w, b), rtol=1e-5, atol=2e-5)


def _use_build(monkeypatch, *flags: str) -> None:
    """The kernel built with ``flags`` (e.g. -DROW_PREFETCH=64) serves ``cpu_linear`` for this test."""
    lib = cpu_build.build(cpu_linear.SOURCE, flags)
    cpu_linear._declare(lib)
    monkeypatch.setattr(cpu_linear._LIBRARY, "_lib", lib)
    monkeypatch.setattr(cpu_linear._LIBRARY, "_status", "ok")


@pytest.mark.parametrize("vendor,flags", [("GenuineIntel", ("-DROW_PREFETCH=8192", "-DPANEL_ROWS_Z=10")),
                                          ("AuthenticAMD", ()), ("", ())])
def test_decode_weight_prefetch_and_wider_panel_passes_are_built_for_intel_cpus_only(vendor, flags):
    assert cpu_build.vendor_flags(cpu_linear.VENDOR_FLAGS, vendor) == flags


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 77), (5, 4100), (70, 2048)])
def test_weight_prefetch_changes_no_bit(monkeypatch, rows, dtype, n, k):
    """Builds that ask the weight rows 8 KB or 64 B ahead (ROW_PREFETCH) and one that does not give
    the same bits, and the float64 product: the prefetch adds no arithmetic (a misplaced brace in
    the pass loop would change the sums). The last passes ask past the matrix's end (a 2 KB or 16
    KB matrix against 8 KB ahead; x86 prefetches never fault); K = 77 leaves a tail after the
    passes. Four rows take the tiles, which ask nothing ahead; without AVX2 the builds are one."""
    x, w, b = _operands(rows, n, k, True, seed=rows * 31 + n + k)
    w = w.to(dtype)
    outs = {}
    for ahead in (0, 64, 8192):
        _use_build(monkeypatch, f"-DROW_PREFETCH={ahead}")
        outs[ahead] = cpu_linear.linear(x, w, b)
    assert torch.equal(outs[64], outs[0]) and torch.equal(outs[8192], outs[0])
    torch.testing.assert_close(outs[8192], _reference(x, w.float(), b), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [17, 23, 31, 100])
@pytest.mark.parametrize("n,k", [(37, 77), (70, 1024), (33, 2100)])
def test_panel_passes_of_any_row_count_give_the_same_bits(monkeypatch, rows, n, k):
    """Builds whose AVX-512 panels take 6, 10 or 15 rows of x per pass (PANEL_ROWS_Z) give the
    same bits and the float64 product, with each prologue (whose copy of x has padded rows), a
    bias and a residual: the rows per pass change no sum's order, only which sums share a pass
    (the last pass of a step takes the rows left: 17 = 15 + 2 = 10 + 7). K = 1,024 puts x's rows
    4 KB apart, K = 2,100 makes two K blocks; float32 weights, and bfloat16 weights where the CPU
    has no AVX-512 BF16 (they widen into the same panels). Without AVX-512 the builds are one."""
    gen = torch.Generator().manual_seed(rows * 13 + n + k)
    x = torch.randn(rows, 2 * k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    norm_w = torch.rand(k, generator=gen) + 0.5
    weights = [w] if cpu_linear.rounds_bf16_rows() else [w, w.bfloat16()]
    outs = {}
    for per_pass in (6, 10, 15):
        _use_build(monkeypatch, f"-DPANEL_ROWS_Z={per_pass}")
        outs[per_pass] = [out for wt in weights for out in (
            cpu_linear.linear(x[:, :k], wt, b, residual=residual),
            cpu_linear.linear(x[:, :k], wt, norm_weight=norm_w, eps=1e-5),
            cpu_linear.linear(x, wt, swiglu=True, residual=residual))]
    for got in (outs[10], outs[15]):
        assert all(torch.equal(a, c) for a, c in zip(got, outs[6]))
    plain = x[:, :k]
    normed = norm_w * (plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-5))
    gated = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    want = [_reference(plain, w, b) + residual, _reference(normed, w), _reference(gated, w) + residual]
    for got, expected in zip(outs[10], want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 23, 64])
@pytest.mark.parametrize("n,k", [(37, 77), (203, 576), (40, 4100)])
def test_bfloat16_weights_give_the_float32_product_of_the_rounded_weights(rows, n, k):
    """bf16 weights are widened in registers: the result matches a float64 product of the
    rounded weights on every row path (dot products, panels, several K blocks) and the float32
    kernel's on the same weights (not bit for bit: with AVX-512 the bf16 dot products always run
    16 lanes wide, float32's only where that measured faster)."""
    x, w, b = _operands(rows, n, k, True, seed=rows * 7 + n + k)
    w16 = w.bfloat16()
    rounds = 0 < cpu_linear.rounds_bf16_rows() <= rows
    taken = (lambda t: t.bfloat16().float()) if rounds else (lambda t: t)  # what the product takes
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
    got = cpu_linear.linear(x, w16, b, residual=residual)
    atol = 5e-5 if k < 1024 else 1e-4  # float32 summation over K (rounded rows: |x| up to ~4)
    torch.testing.assert_close(got, _reference(taken(x), w16.float(), b) + residual, rtol=1e-5, atol=atol)
    norm_w = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5
    pairs = [(got, cpu_linear.linear(taken(x), w16.float(), b, residual=residual))]
    if not rounds:  # (rounded rows after the prologue: the test below)
        pairs.append((cpu_linear.linear(x, w16, norm_weight=norm_w), cpu_linear.linear(x, w16.float(), norm_weight=norm_w)))
    for mine, float32s in pairs:
        torch.testing.assert_close(mine, float32s, rtol=1e-5, atol=atol)
    assert cpu_linear.supports(x, w16)


@needs_kernel
@pytest.mark.parametrize("rows", [17, 18, 23, 64, 1030])
@pytest.mark.parametrize("n,k", [(37, 77), (203, 576), (40, 4101), (33, 3)])
def test_bfloat16_panels_round_the_rows_to_bfloat16_after_the_prologue(rows, n, k):
    """Where the CPU has AVX-512 BF16, bf16 weights from 17 rows on take x rounded to bf16 (round
    to nearest even, torch's .bfloat16()) after the RMSNorm or SwiGLU prologue, with float32
    sums: equal to a float64 product of the rounded operands to float32 summation error, odd K,
    several K blocks and row blocks and a single column included. A float32-x product would
    miss this bound by ~1e-2 (checked)."""
    if not cpu_linear.rounds_bf16_rows():
        pytest.skip(f"no AVX-512 BF16 products here (level {cpu_linear.cpu_build.isa()})")
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, 2 * k, generator=gen)
    w16 = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    norm_w = torch.rand(k, generator=gen) + 0.5
    plain = x[:, :k]
    normed = norm_w * (plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-6))
    gated = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    cases = [(cpu_linear.linear(plain, w16, b, residual=residual), plain, b, residual),
             (cpu_linear.linear(plain, w16, norm_weight=norm_w), normed, None, None),
             (cpu_linear.linear(x, w16, swiglu=True), gated, None, None)]
    for i, (got, taken, bias, res) in enumerate(cases):
        want = _reference(taken.bfloat16().float(), w16.float(), bias) + (0 if res is None else res)
        unrounded = _reference(taken, w16.float(), bias) + (0 if res is None else res)
        if i == 0:  # no prologue: the same rounded operands, float32 summation error only
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
        else:  # the C prologue and torch's may differ in a last bit, which can round an element of
            # the row the other way (one bf16 step): rare, so the mean error tells them apart
            assert (got - want).abs().mean() < 0.05 * (got - unrounded).abs().mean()
        assert (got - unrounded).abs().max() > 1e-4  # the rows were rounded


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 19, 64])
@pytest.mark.parametrize("k", [40, 77])
def test_prologues_and_residual_match_the_model_modules(rows, k):
    from longctx.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen) * 3
    w = torch.randn(29, k, generator=gen) / k ** 0.5
    b = torch.randn(29, generator=gen)
    residual = torch.randn(rows, 29, generator=gen)
    norm = RMSNorm(k, 1e-5)
    norm.weight.data.copy_(torch.rand(k, generator=gen) + 0.5)
    expected = _reference(norm(x), w, b) + residual
    got = cpu_linear.linear(x, w, b, norm_weight=norm.weight, eps=1e-5, residual=residual)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=3e-5)
    gate_up = torch.randn(rows, 2 * k, generator=gen) * 4
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    torch.testing.assert_close(cpu_linear.linear(gate_up, w, swiglu=True), _reference(act, w),
                               rtol=1e-5, atol=3e-5)
    # a residual that is a strided view (every other row of a wider tensor)
    wide = torch.randn(2 * rows, 40, generator=gen)
    res = wide[::2, 3:32]
    torch.testing.assert_close(cpu_linear.linear(x, w, residual=res), _reference(x, w) + res,
                               rtol=1e-5, atol=3e-5)


@needs_kernel
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,heads,d", [(1, 12, 64), (5, 3, 40), (70, 7, 2), (131, 2, 6), (3, 1, 512)])
def test_rope_in_place_is_bit_identical_to_the_torch_form(rows, heads, d, threads, pairs):
    """Rows split over threads from 64 rows on. ``pairs``: each head's halves stored as
    llama.cpp's interleaved pairs (x1[i] at 2i, x2[i] at 2i + 1) come out rotated and in
    rotate-half's order, as reordering them first and rotating gives, bit for bit."""
    from longctx.model.rope import apply_rotary, unpermute_rope_rows

    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2) * d, generator=gen) * 5
    angles = torch.rand(rows, d // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    x = qkv[:, :heads * d].view(rows, heads, d)  # rows strided by the fused row width
    in_order = x.reshape(rows, heads * d)
    if pairs:  # in_order[:, j] = x's stored element order[j]
        order = unpermute_rope_rows(torch.arange(heads * d), heads)
        in_order = in_order[:, order]
        assert torch.equal(order, torch.arange(heads * d)) == (d == 2)  # (one pair a head: nothing moves)
    expected = apply_rotary(in_order.reshape(rows, heads, d).clone(), cos, sin)
    untouched = qkv[:, heads * d:].clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_linear.rope_(x, cos, sin, pairs=pairs) is x
    finally:
        torch.set_num_threads(before)
    assert torch.equal(x, expected)
    assert torch.equal(qkv[:, heads * d:], untouched)
    with pytest.raises(ValueError, match="cos must be"):
        cpu_linear.rope_(x, cos[:, :-1], sin)
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_linear.rope_(x.transpose(1, 2), cos, sin)


@needs_kernel
@pytest.mark.parametrize("rows,f,threads", [(1, 8, 1), (5, 13, 2), (40, 136, 1), (40, 136, 2), (300, 72, 2)])
def test_swiglu_and_rmsnorm_passes_are_the_prologue_s_numbers(rows, f, threads):
    """``cpu_linear.swiglu`` (the halves of a [T, 2F] product: strided rows) and ``rms_norm``
    (strided x): the numbers the row kernel's prologue makes inside its call (a product of
    their output gives its product's bits), within float32 rounding of torch's forms (their
    own exponential and order of sums), the same with one thread and two, into an ``out`` with
    strided rows."""
    gen = torch.Generator().manual_seed(rows * f + threads)
    gate_up = torch.randn(rows, 2 * f, generator=gen) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # (the exponential's range)
    gate, up = gate_up[:, :f], gate_up[:, f:]
    x = (torch.randn(rows, f + 5, generator=gen) * 3)[:, 2:2 + f]
    assert rows == 1 or not x.is_contiguous()
    w = torch.rand(f, generator=gen) + 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.swiglu(gate, up), cpu_linear.rms_norm(x, w, 1e-5)
        torch.set_num_threads(threads)
        wide = torch.full((rows, 2 * f + 3), float("nan"))
        got = (cpu_linear.swiglu(gate, up, out=wide[:, :f]),
               cpu_linear.rms_norm(x, w, 1e-5, out=wide[:, f + 3:]))
    finally:
        torch.set_num_threads(before)
    assert got[0].data_ptr() == wide.data_ptr() and wide[:, f:f + 3].isnan().all()
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
    weight = torch.randn(24, f, generator=gen)
    assert torch.equal(cpu_linear.linear(gate_up, weight, swiglu=True), cpu_linear.linear(got[0], weight))
    assert torch.equal(cpu_linear.linear(x, weight, norm_weight=w, eps=1e-5), cpu_linear.linear(got[1], weight))
    torch.testing.assert_close(got[0], torch.nn.functional.silu(gate) * up, rtol=3e-6, atol=1e-30)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got[1], want, rtol=3e-6, atol=1e-30)
    with pytest.raises(ValueError, match="swiglu_rows needs"):
        cpu_linear.swiglu(gate, up[:, :-1])
    with pytest.raises(ValueError, match="swiglu_rows needs"):
        cpu_linear.swiglu(gate.t(), up.t())
    with pytest.raises(ValueError, match="rms_rows needs"):
        cpu_linear.rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="rms_rows needs"):
        cpu_linear.rms_norm(x, w, -1.0)


@needs_kernel
def test_rope_over_pairs_refuses_heads_past_its_bound():
    d = 2 * cpu_linear.ROPE_PAIRS_MAX_HALF + 2
    x, cs = torch.zeros(2, 1, d), torch.zeros(2, d // 2)
    with pytest.raises(ValueError, match="heads of up to"):
        cpu_linear.rope_(x, cs, cs, pairs=True)
    cpu_linear.rope_(x, cs, cs)  # (without pairs: any head)


@needs_kernel
def test_swiglu_prologue_over_the_exponentials_range():
    """The SwiGLU prologue's silu (vectorized exp with AVX2) within a few float32 ulps of
    float64 silu from -120 to 120, where e^-g overflows and underflows; read out exactly through
    an identity weight (each output is one product with 1, the rest with 0)."""
    k = 203  # 25 vector blocks and a 3-element tail
    g = torch.cat([torch.linspace(-120, 120, 6000), torch.randn(3000, generator=torch.Generator().manual_seed(9)) * 5])
    rows = -(-g.numel() // k)
    g = torch.nn.functional.pad(g, (0, rows * k - g.numel())).view(rows, k)
    u = torch.rand(rows, k, generator=torch.Generator().manual_seed(10)) + 0.5
    got = cpu_linear.linear(torch.cat([g, u], 1), torch.eye(k), swiglu=True).double()
    want = torch.nn.functional.silu(g.double()) * u.double()
    # below ~1e-36 float32 silu underflows to 0 (e^-g overflows), as torch's float32 form does
    torch.testing.assert_close(got, want, rtol=5e-7, atol=1e-35)


@needs_kernel
@pytest.mark.parametrize("rows,n,k", [(17, 40, 4100),     # K in two blocks (2,056 + 2,044): sums added into y
                                      (1030, 45, 24),     # rows in two blocks (1,024 + 6)
                                      (2051, 33, 200)])   # a prefill chunk's worth, a 1-column panel
def test_panels_over_several_blocks_of_k_and_of_rows(rows, n, k):
    """The panel path's blocking: bias and residual added once, after the last K block; every
    row block and every slice written."""
    if cpu_linear.max_rows() < cpu_linear.UNBOUNDED:
        pytest.skip("built without the panel path")
    x, w, b = _operands(rows, n, k, True, seed=rows + n + k)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(7))
    out = torch.full((rows, n), float("nan"))
    cpu_linear.linear(x, w, b, residual=residual, out=out)
    torch.testing.assert_close(out, _reference(x, w, b) + residual, rtol=1e-5, atol=5e-5)


@needs_kernel
def test_strided_and_expanded_inputs():
    x, w, b = _operands(9, 40, 72, True, seed=3)
    wide = torch.randn(9, 100)
    wide[:, 10:82] = x
    torch.testing.assert_close(cpu_linear.linear(wide[:, 10:82], w, b), _reference(x, w, b), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(cpu_linear.linear(x[::2], w, b), _reference(x[::2], w, b), rtol=1e-5, atol=2e-5)
    expanded = x[:1].expand(5, -1)  # row stride 0: every row is the first
    torch.testing.assert_close(cpu_linear.linear(expanded, w), _reference(x[:1], w).expand(5, -1),
                               rtol=1e-5, atol=2e-5)
    columns = x.t().contiguous().t()  # column-major: taken as a copy
    torch.testing.assert_close(cpu_linear.linear(columns, w), _reference(x, w), rtol=1e-5, atol=2e-5)


@needs_kernel
def test_output_buffer_is_written():
    x, w, b = _operands(3, 20, 16, True, seed=4)
    out = torch.full((3, 20), float("nan"))
    assert cpu_linear.linear(x, w, b, out=out) is out
    torch.testing.assert_close(out, _reference(x, w, b), rtol=1e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("rows, n, k", [(1, 64, 64), (15, 64, 64), (3, 37, 29), (64, 128, 72)])
def test_small_product_matches_reference_on_the_calling_thread(rows, n, k):
    """``small_product`` (the few-row products beside attention, one thread): the float64
    reference's product, into a new tensor or the one given."""
    x, w, _ = _operands(rows, n, k, False, seed=rows + n)
    torch.testing.assert_close(cpu_linear.small_product(x, w), _reference(x, w), atol=1e-5, rtol=1e-5)
    out = torch.full((rows, n), float("nan"))
    assert cpu_linear.small_product(x, w, out) is out
    torch.testing.assert_close(out, _reference(x, w), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bad", ["too_many_rows", "strided", "bf16_weight", "k_mismatch", "out_shape"])
def test_small_product_refuses_what_it_does_not_take(bad):
    x, w, _ = _operands(4, 8, 16, False, seed=1)
    out = None
    if bad == "too_many_rows":
        x = torch.randn(cpu_linear.SMALL_ROWS + 1, 16)
    elif bad == "strided":
        x = torch.randn(4, 32)[:, ::2]
    elif bad == "bf16_weight":
        w = w.bfloat16()
    elif bad == "k_mismatch":
        w = torch.randn(8, 15)
    else:
        out = torch.empty(4, 9)
    with pytest.raises(ValueError, match="small_product|out must be"):
        cpu_linear.small_product(x, w, out)


@needs_kernel
def test_bad_arguments_are_refused():
    x, w, b = _operands(2, 8, 16, True, seed=5)
    with pytest.raises(ValueError, match="agree on K"):
        cpu_linear.linear(x[:, :15], w)
    with pytest.raises(ValueError, match="x must be float32 and weight float32 or bfloat16"):
        cpu_linear.linear(x.bfloat16(), w)
    with pytest.raises(ValueError, match="x must be float32 and weight float32 or bfloat16"):
        cpu_linear.linear(x, w.half())
    assert not cpu_linear.supports(x, w.half())
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias must be"):
        cpu_linear.linear(x, w, b[:7])
    with pytest.raises(ValueError, match="out must be"):
        cpu_linear.linear(x, w, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="empty product"):
        cpu_linear.linear(x[:0], w)
    with pytest.raises(ValueError, match="SwiGLU halves"):
        cpu_linear.linear(x, w, swiglu=True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        cpu_linear.linear(x, w, norm_weight=torch.ones(15))
    with pytest.raises(ValueError, match="two different prologues"):
        cpu_linear.linear(torch.randn(2, 32), w, norm_weight=torch.ones(16), swiglu=True)
    with pytest.raises(ValueError, match="residual must be"):
        cpu_linear.linear(x, w, residual=torch.randn(2, 9))
    assert cpu_linear.supports(x, w)
    if cpu_linear.max_rows() < cpu_linear.UNBOUNDED:  # built without the panel path
        assert not cpu_linear.supports(torch.randn(cpu_linear.max_rows() + 1, 16), w)
    else:
        assert cpu_linear.supports(torch.randn(4096, 16), w)


FALLBACK = textwrap.dedent("""
    import torch
    from longctx.kernels import cpu_linear
    from longctx.model.llama import choose_cpu_matmul, onednn_linear_available
    print(cpu_linear.status())
    assert not cpu_linear.available()
    assert not cpu_linear.supports(torch.randn(1, 4), torch.randn(3, 4))
    assert cpu_linear.max_rows() == 0
    choice = choose_cpu_matmul("auto", torch.float32)
    assert choice == ("onednn" if onednn_linear_available() else "blas"), choice
    try:
        choose_cpu_matmul("kernel", torch.float32)
    except ValueError as err:  # a ConfigError, which the CLI and server report as bad input
        assert "linear kernel is" in str(err)
    else:
        raise AssertionError("cpu_matmul='kernel' accepted without the kernel")
    print("fell back")
""")


NO_AVX2 = textwrap.dedent("""
    import torch
    from longctx.kernels import cpu_build, cpu_linear
    cpu_build.FLAGS += ["-mno-avx2", "-mno-fma"]
    assert cpu_linear.available(), cpu_linear.status()
    assert cpu_linear.max_rows() == cpu_linear.DOT_MAX_ROWS
    w = torch.randn(37, 77)
    for rows in (1, 17, 64):
        x = torch.randn(rows, 77)
        torch.testing.assert_close(cpu_linear.linear(x, w), (x.double() @ w.double().T).float(),
                                   rtol=1e-5, atol=2e-5)
    assert not cpu_linear.supports(torch.randn(65, 77), w)
    w16 = w.bfloat16()
    for rows in (1, 3, 9):  # the plain loops widen bf16 weights too
        x = torch.randn(rows, 77)
        torch.testing.assert_close(cpu_linear.linear(x, w16), (x.double() @ w16.double().T).float(),
                                   rtol=1e-5, atol=2e-5)
    print("dot products only")
""")


def test_a_build_without_avx2_keeps_the_dot_products_and_the_row_limit(tmp_path):
    """Without AVX2/FMA the C file has no panel path: the kernel says so (max_rows is
    DOT_MAX_ROWS, so the model keeps BLAS for long steps) and its plain loops answer."""
    if not cpu_linear.available():
        pytest.skip(f"kernel {cpu_linear.status()}")
    full_env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", NO_AVX2], env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "dot products only"


@pytest.mark.parametrize("env,expect", [({"LONGCTX_CPU_KERNEL": "0"}, "disabled by LONGCTX_CPU_KERNEL=0"),
                                        ({"CC": "false"}, "unavailable: false failed")])
def test_without_the_kernel_the_model_keeps_another_path(tmp_path, env, expect):
    full_env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-c", FALLBACK], env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith(expect)
    assert proc.stdout.splitlines()[-1] == "fell back"

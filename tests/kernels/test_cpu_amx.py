"""The AMX kernel for bfloat16 weights (``kernels/cpu_amx.py``, ``csrc/linear_amx.c``): its
products against a float64 reference on the same bfloat16-rounded numbers and against the row
kernel's bfloat16 path (the same numerics), the shapes it refuses, why it is not used on a CPU
without AMX, and the tuner's measurement of it. The products need a CPU with AMX-BF16 (an Intel
Xeon of 2023 on): elsewhere they skip, and the refusals still run."""

from __future__ import annotations

import pytest
import torch
from amx_layout import tile_order_rows

from longctx.kernels import cpu_amx, cpu_build, cpu_linear, cpu_tune

needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason=f"AMX kernel {cpu_amx.status()}")
SHAPES = [(32, 16), (64, 48), (96, 112), (576, 960)]  # (K, N)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double() @ w.double().t()


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 33, 100])
@pytest.mark.parametrize("k,n", SHAPES)
def test_products_match_float64_on_the_rounded_numbers(rows, k, n):
    """x rounded to bfloat16, exact pair products, float32 sums: within float32 rounding of the
    float64 product of the same rounded numbers; x's rows may be strided (a column slice)."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    wide = torch.randn(rows, k + 40, generator=gen)
    x = wide[:, 8:8 + k]  # rows k + 40 apart
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    got = cpu_amx.linear(x, w, num_threads=2)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
    want = _reference(x, w)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 2e-6, err


@needs_amx
@pytest.mark.skipif(not cpu_linear.available() or cpu_linear.rounds_bf16_rows() == 0,
                    reason="the row kernel has no bfloat16 panels here")
def test_the_same_numbers_as_the_row_kernel_s_bfloat16_panels():
    """From ``rounds_bf16_rows()`` rows the row kernel rounds x to bfloat16 too: the two differ
    only in the order of their float32 sums."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=gen)
    w = (torch.randn(960, 576, generator=gen) * 0.04).to(torch.bfloat16)
    torch.testing.assert_close(cpu_amx.linear(x, w), cpu_linear.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("k,n,dtype", [(48, 32, torch.bfloat16), (64, 24, torch.bfloat16),
                                       (64, 32, torch.float16), (64, 32, torch.float32)])
def test_shapes_and_types_it_does_not_take_are_refused(k, n, dtype):
    x, w = torch.randn(20, k), torch.randn(n, k).to(dtype)
    assert not cpu_amx.supports(x, w) and not cpu_amx.takes_weight(w)
    with pytest.raises(ValueError, match="K % 32 == 0 and N % 16 == 0"):
        cpu_amx.linear(x, w)


@needs_amx
def test_an_input_of_another_width_or_type_is_refused():
    w = torch.randn(32, 64).to(torch.bfloat16)
    assert cpu_amx.takes_weight(w)
    for x in (torch.randn(5, 32), torch.randn(5, 64).to(torch.bfloat16), torch.randn(0, 64), torch.randn(64, 5).t()):
        assert not cpu_amx.supports(x, w)


def test_why_it_is_not_used_without_amx(monkeypatch):
    """A CPU without the AMX flags, or a level below avx512bf16 (``LONGCTX_CPU_ISA``), is named
    as the reason, before anything is built."""
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: " fpu avx2 fma avx512f avx512_bf16")
    assert "amx_tile, amx_bf16" in cpu_amx.unsupported()
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: " avx2 amx_tile amx_bf16")
    monkeypatch.setattr(cpu_build, "isa", lambda: "avx2")
    assert cpu_amx.unsupported() == "the instruction-set level is avx2, not avx512bf16"
    monkeypatch.setattr(cpu_build, "isa", lambda: "avx512bf16")
    assert cpu_amx.unsupported() is None


def test_an_unsupported_library_is_not_built(monkeypatch, tmp_path):
    """``KernelLibrary``'s ``unsupported`` answer is its status; the compiler never runs."""
    monkeypatch.setattr(cpu_build, "build", lambda *a, **k: pytest.fail("built"))
    lib = cpu_build.KernelLibrary(cpu_amx.SOURCE, lambda lib: None, unsupported=lambda: "no tiles here")
    assert not lib.available() and lib.status() == "unavailable: no tiles here"


def test_rounding_without_the_kernel_says_why(monkeypatch):
    """Where the kernel is not here, ``round_x`` and the operator say so (nothing reaches C)."""
    monkeypatch.setattr(cpu_amx, "available", lambda: False)
    with pytest.raises(RuntimeError, match="the AMX linear kernel is"):
        cpu_amx.round_x(torch.randn(16, 64))
    with pytest.raises(ValueError, match="amx_round needs the kernel"):
        cpu_amx.amx_round_scaled(torch.randn(16, 64), None, None, torch.empty(16, 64, dtype=torch.bfloat16), 2)


def test_the_tuner_keeps_the_kernel_where_there_is_no_amx(monkeypatch):
    """No AMX, a hidden size the tiles do not take, or the setting off: the kernel, nothing
    measured (and, off, nothing built); a bad setting is refused on every CPU alike."""
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(cpu_amx, "available", lambda: True)
    assert cpu_tune.amx_from_rows([(48, 192), (96, 48)]) == cpu_tune.NEVER
    monkeypatch.setattr(cpu_amx, "available", lambda: pytest.fail("built"))
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "off")
    assert cpu_tune.amx_from_rows([(64, 192), (96, 64)]) == cpu_tune.NEVER
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "fastest")
    with pytest.raises(ValueError, match="LONGCTX_CPU_TUNE"):
        cpu_tune.amx_from_rows([(64, 192), (96, 64)])
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_amx, "available", lambda: False)
    assert cpu_tune.amx_from_rows([(64, 192), (96, 64)]) == cpu_tune.NEVER


@needs_amx
def test_the_operator_refuses_an_output_the_tiles_would_overrun():
    """``longctx::amx_linear`` writes whole 16-row tiles: an out of M rows (M not a multiple of
    16), of the wrong type or with strided columns is refused before the kernel runs."""
    x, w = torch.randn(20, 64), torch.randn(32, 64).to(torch.bfloat16)
    for out in (torch.empty(20, 32), torch.empty(32, 32, dtype=torch.bfloat16), torch.empty(32, 64)[:, ::2],
                torch.empty(32, 16)):
        with pytest.raises(ValueError, match="float32 out of at least \\[32, 32\\]"):
            cpu_amx.amx_linear(x, w, out, 2)
    out = torch.empty(32, 32)
    cpu_amx.amx_linear(x, w, out, 2)
    torch.testing.assert_close(out[:20], cpu_amx.linear(x, w))


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 48, 100])
@pytest.mark.parametrize("k,n,step", [(64, 96, 32), (576, 960, 192), (96, 48, 48)])
def test_x_rounded_once_gives_each_slices_columns_bit_for_bit(rows, k, n, step):
    """``round_x`` once, then ``amx_linear_rounded`` on column slices of the weight, each into
    its columns of one out (strided rows): the same bits as ``amx_linear`` on the whole matrix,
    and within float32 rounding of the float64 reference; the padding rows are written, the
    columns past the slices' are not."""
    gen = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k + 8, generator=gen)[:, 4:4 + k]
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    xb = cpu_amx.round_x(x, num_threads=2)
    padded = (rows + 15) // 16 * 16
    assert xb.shape == (padded, k) and xb.dtype == torch.bfloat16
    out = torch.full((padded, n + 16), float("nan"))
    for a in range(0, n, step):
        cpu_amx.amx_linear_rounded(xb, rows, w[a:a + step], out[:, a:a + step], 2)
    whole = torch.empty(padded, n)
    cpu_amx.amx_linear(x, w, whole, 2)
    assert torch.equal(out[:, :n], whole)
    assert out[:, n:].isnan().all()
    want = _reference(x, w)
    assert float((out[:rows, :n].double() - want).abs().max() / want.abs().max()) < 2e-6


@needs_amx
@pytest.mark.parametrize("rows,k", [(1, 32), (17, 64), (100, 576), (33, 2048)])
def test_an_rmsnorm_folded_into_the_rounding(rows, k):
    """``round_x(x, row_scale=r, col_scale=w)``: the bits of rounding torch's ``w * (x * r)`` (an
    RMSNorm's two products), and of each product alone. ``rms_eps``: r made in the same pass,
    the rounding of the model's RMSNorm output to within one bfloat16 step where r's last bit
    moved; ``linear.rounded_norm`` takes that form, and declines what it cannot fold. Scales
    of the wrong size or type are refused."""
    from longctx.model.linear import rounded_norm
    from longctx.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k + 8, generator=gen)[:, 4:4 + k] * 3  # strided rows, as a residual view
    w = torch.randn(k, generator=gen)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(cpu_amx.round_x(x, row_scale=r.reshape(-1), col_scale=w), cpu_amx.round_x(w * (x * r)))
    assert torch.equal(cpu_amx.round_x(x, row_scale=r.reshape(-1)), cpu_amx.round_x(x * r))
    assert torch.equal(cpu_amx.round_x(x, col_scale=w), cpu_amx.round_x(w * x))
    assert not torch.equal(cpu_amx.round_x(x, col_scale=w), cpu_amx.round_x(x))  # (the scale did something)
    # the RMSNorm whole (rms_eps: its statistics in the same pass, the kernel's order of sums):
    # the scale may move in its last bit, so an element may land one bfloat16 step from torch's
    norm = RMSNorm(k, 1e-5)
    norm.weight.data.copy_(w)
    whole = cpu_amx.round_x(x, col_scale=w, rms_eps=1e-5).float()
    torch_rounded = cpu_amx.round_x(norm(x).contiguous()).float()
    assert float((whole == torch_rounded).double().mean()) > 0.99
    assert torch.all((whole - torch_rounded).abs() <= 2 ** -7 * torch_rounded.abs())
    assert torch.equal(rounded_norm(x, norm), cpu_amx.round_x(x, col_scale=w, rms_eps=1e-5))
    scaled_up = cpu_amx.round_x(x * 8, col_scale=w, rms_eps=0.0).float()  # (the scale cancels x's size)
    assert torch.equal(scaled_up, cpu_amx.round_x(x, col_scale=w, rms_eps=0.0).float())
    with pytest.raises(ValueError, match="row_scale or rms_eps"):
        cpu_amx.round_x(x, row_scale=r.reshape(-1), rms_eps=1e-5)
    with pytest.raises(ValueError, match="amx_round_rms needs"):
        cpu_amx.round_x(x, rms_eps=-1.0)
    assert rounded_norm(x, None) is None and rounded_norm(x.double(), norm) is None
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
    assert rounded_norm(x, norm) is None  # (a bf16 weight: torch would promote it; not folded)
    for row_scale, col_scale in ((torch.ones(rows + 1), None), (None, torch.ones(k, dtype=torch.float64)),
                                 (None, torch.ones(2 * k)[::2])):
        with pytest.raises(ValueError, match="amx_round_scaled needs"):
            cpu_amx.round_x(x, row_scale=row_scale, col_scale=col_scale)


@needs_amx
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,f", [(1, 32), (17, 64), (100, 576), (33, 1536)])
def test_the_gated_product_rounded_for_the_tiles(act, rows, f):
    """``round_gated(gate, up, act)``: act(gate) * up rounded to bfloat16 in ``round_x``'s order,
    within bfloat16's rounding (2^-8 relative, with the kernel's exponential's few ulp) of a
    float64 reference made in a form without cancellation (g / (1 + e^-2z) for GELU's tanh
    form, which torch's 0.5 g (1 + tanh z) loses for negative g); for SiLU it lands on rounding
    torch's own float32 product nearly everywhere. Into columns of a wider buffer it writes only
    those, and its padding rows are zero. ``linear.rounded_swiglu`` takes the halves of a
    [T, 2F] product and declines what it cannot."""
    from longctx.model.linear import activation, rounded_swiglu

    gen = torch.Generator().manual_seed(rows + f)
    gu = torch.randn(rows, 2 * f, generator=gen) * 3
    gate, up = gu[:, :f], gu[:, f:]  # (one row stride: the halves of the product)
    g64, u64 = gate.double(), up.double()
    z = g64 if act == "silu" else (2 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64 ** 3) * 2
    want = g64 / (1 + torch.exp(-z)) * u64
    xb = cpu_amx.round_gated(gate, up, act)
    got = tile_order_rows(xb, rows).double()
    assert torch.all((got - want).abs() <= 2 ** -8 * want.abs() + 1e-30)
    assert torch.all(tile_order_rows(xb, xb.shape[0])[rows:] == 0)  # (the padding rows)
    if act == "silu":
        torch_rounded = tile_order_rows(cpu_amx.round_x(activation(gate.contiguous(), act).mul_(up)), rows).double()
        assert float((got == torch_rounded).double().mean()) > 0.999
        assert torch.equal(rounded_swiglu(gu), xb)
    wide = torch.full(((rows + 15) // 16 * 16, f + 64), 7.0, dtype=torch.bfloat16)
    cpu_amx.round_gated(gate, up, act, xb=wide, col0=32)
    assert torch.equal(tile_order_rows(wide, rows)[:, 32:32 + f], got.to(torch.bfloat16))
    assert torch.all(tile_order_rows(wide, rows)[:, :32] == 7) and torch.all(tile_order_rows(wide, rows)[:, 32 + f:] == 7)
    assert rounded_swiglu(gu.double()) is None and rounded_swiglu(torch.randn(rows, 2 * f + 32)) is None
    with pytest.raises(ValueError, match="amx_round_gated needs"):
        cpu_amx.round_gated(gate, up[:, :16], act)  # (another shape)
    with pytest.raises(ValueError, match="amx_round_gated needs"):
        cpu_amx.round_gated(gate, up, act, xb=wide, col0=64 + 32)  # past the buffer's columns
    with pytest.raises(ValueError, match="act must be"):
        cpu_amx.round_gated(gate, up, "relu")


def _bf16_linear(k: int, n: int, gen: torch.Generator, amx_from_rows: int, bias: bool = False):
    from longctx.model.linear import Linear, RowKernelWeights

    layer = Linear(k, n, bias)
    layer.weight_t.data = (torch.randn(k, n, generator=gen) * 0.1).to(torch.bfloat16)
    if bias:
        layer.bias.data = torch.randn(n, generator=gen)
    layer.hold(RowKernelWeights(amx_from_rows=amx_from_rows))
    return layer


@needs_amx
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,k,f", [(1, 32, 32), (17, 64, 96), (33, 96, 64), (100, 576, 1536), (208, 64, 320)])
def test_the_gated_product_in_one_pass_is_the_two_passes_bit_for_bit(act, rows, k, f):
    """``gated_rounded``: an MLP's gate/up product and ``round_gated`` in one pass (each 16 gate
    columns beside their 16 up columns, through the activation from L1, each block's activation
    run between the next block's k steps) gives the bits of the [rows, 2F] float32 product
    followed by ``round_gated`` on its halves, padding rows zero, at any thread count (slices of
    F of several blocks, a last 16-row block, a slice's last block's activation after its loop);
    what does not fit is refused before the kernel writes a byte."""
    gen = torch.Generator().manual_seed(rows + k + f)
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(2 * f, k, generator=gen) * 0.1).to(torch.bfloat16)
    xb = cpu_amx.round_x(x)
    y = cpu_amx.linear_rounded(xb, rows, w)
    want = cpu_amx.round_gated(y[:, :f], y[:, f:], act)
    got = cpu_amx.gated_rounded(xb, rows, w, act)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == ((rows + 15) // 16 * 16, f)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.all(tile_order_rows(got, got.shape[0])[rows:] == 0)  # (the padding rows)
    for threads in (1, 3):
        assert torch.equal(cpu_amx.gated_rounded(xb, rows, w, act, num_threads=threads).view(torch.int16),
                           want.view(torch.int16))
    out = torch.empty_like(got)
    for bad in (dict(weight=w[:32]),  # F = 16: not a multiple of 32
                dict(weight=w.float()), dict(out=torch.empty(out.shape[0] + 16, f, dtype=torch.bfloat16)),
                dict(out=out.float()), dict(act=2), dict(xb=torch.empty(xb.shape[0], k + 32, dtype=torch.bfloat16))):
        args = dict(xb=xb, weight=w, act=0, out=out) | bad
        with pytest.raises(ValueError, match="amx_gated_rounded needs"):
            cpu_amx.amx_gated_rounded(args["xb"], rows, args["weight"], args["act"], args["out"], 2)
    with pytest.raises(ValueError, match="act must be"):
        cpu_amx.gated_rounded(xb, rows, w, "relu")


@needs_amx
@pytest.mark.parametrize("rows", [17, 100])
def test_a_bf16_mlp_hands_its_swiglu_rounded_to_the_down_projection(rows):
    """A bfloat16 MLP on the tiles (``RowKernelWeights`` from ``amx_from_rows``): ``gated`` makes
    SwiGLU rounded for the down projection in one pass (``cpu_amx.gated_rounded``), and the
    down projection's result is the two calls' (the [T, 2F] product, then the down projection
    with ``swiglu=True``) bit for bit, with an RMSNorm before and a residual after. Below
    ``amx_from_rows``, for GELU, or with a bias: None, the two calls."""
    from longctx.model.linear import RoundedRows
    from longctx.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    k, f = 96, 64
    gate_up, down = _bf16_linear(k, 2 * f, gen, 17), _bf16_linear(f, k, gen, 17)
    norm = RMSNorm(k, 1e-5)
    norm.weight.data.copy_(torch.rand(k, generator=gen) + 0.5)
    x, res = torch.randn(rows, k, generator=gen), torch.randn(rows, k, generator=gen)
    assert down.method.takes_rounded(down, rows) and not down.method.takes_rounded(down, 16)
    handed = gate_up.method.gated(gate_up, x, norm, "silu", rounded=True)
    assert isinstance(handed, RoundedRows) and handed.rows == rows
    want = down(gate_up(x, norm=norm), swiglu=True, residual=res)
    assert torch.equal(down(handed, residual=res), want)
    handed = gate_up.method.gated(gate_up, x, None, "silu", rounded=True)  # (no norm: x rounded as it is)
    assert torch.equal(down(handed, residual=res), down(gate_up(x), swiglu=True, residual=res))
    assert gate_up.method.gated(gate_up, x, norm, "silu", rounded=False) is None
    assert gate_up.method.gated(gate_up, x, norm, "gelu_tanh", rounded=True) is None
    assert gate_up.method.gated(gate_up, x[:16], norm, "silu", rounded=True) is None
    biased = _bf16_linear(k, 2 * f, gen, 17, bias=True)
    assert biased.method.gated(biased, x, norm, "silu", rounded=True) is None
    with pytest.raises(ValueError, match="rounded rows are for"):
        down(handed, norm=norm)


@needs_amx
def test_the_rounded_operators_refuse_what_does_not_fit():
    """A buffer of the wrong shape or type for x, an out too short for the padded rows, a weight
    of another width: refused before the kernel writes a byte."""
    x, w = torch.randn(20, 64), torch.randn(32, 64).to(torch.bfloat16)
    for xb in (torch.empty(20, 64, dtype=torch.bfloat16), torch.empty(32, 64), torch.empty(32, 96, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="amx_round needs"):
            cpu_amx.amx_round_scaled(x, None, None, xb, 2)
    for bad_x, xb, threads in ((torch.randn(20, 48), torch.empty(32, 48, dtype=torch.bfloat16), 2),  # K % 32
                               (torch.randn(64, 20).t(), torch.empty(32, 64, dtype=torch.bfloat16), 2),  # strided
                               (x, torch.empty(64, 32, dtype=torch.bfloat16).t(), 2),  # xb not contiguous
                               (x, torch.empty(32, 64, dtype=torch.bfloat16), 0)):
        with pytest.raises(ValueError, match="amx_round needs"):
            cpu_amx.amx_round_scaled(bad_x, None, None, xb, threads)
    with pytest.raises(ValueError, match="round_x takes x"):
        cpu_amx.round_x(torch.randn(64))
    xb = cpu_amx.round_x(x)
    with pytest.raises(ValueError, match="amx_linear_rounded needs"):
        cpu_amx.amx_linear_rounded(xb, 20, w, torch.empty(32, 32), 0)
    for rows, weight, out in ((20, w, torch.empty(20, 32)), (20, torch.randn(32, 96).to(torch.bfloat16),
                                                            torch.empty(32, 32)), (33, w, torch.empty(48, 32))):
        with pytest.raises(ValueError, match="amx_linear_rounded needs"):
            cpu_amx.amx_linear_rounded(xb, rows, weight, out, 2)


@needs_amx
@pytest.mark.skipif(not cpu_linear.available() or cpu_linear.max_rows() < cpu_linear.UNBOUNDED,
                    reason="row kernel without its panel path")
def test_a_real_amx_measurement(tmp_path, monkeypatch):
    """The tuner times the kernel's bfloat16 calls against the AMX kernel's on this machine
    (shapes cut to the tiles' multiples), caches the answer under a key of its own, and a forced
    row count skips it."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_MEMO", {})
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    shapes = [(64, 200), (100, 64)]  # an intermediate of 100: measured as 96
    assert cpu_tune._measured_mlp(64, 100, cpu_amx.K_MULTIPLE) == (64, 96)
    record = cpu_tune.measure(shapes, threads=1, way="amx")
    assert sorted(record["rows"]) == sorted(cpu_tune.ROWS)
    assert all(t["kernel_ms"] > 0 and t["blas_ms"] > 0 for t in record["rows"].values())
    rows = cpu_tune.amx_from_rows(shapes, threads=1)
    assert rows in (cpu_tune.NEVER, *(max(r, cpu_tune.MIN_ROWS) for r in cpu_tune.ROWS))
    assert cpu_tune.key(shapes, 1, "amx") != cpu_tune.key(shapes, 1, "blas")
    cached = cpu_tune._read(cpu_tune.cache_file())
    assert cpu_tune.key(shapes, 1, "amx") in cached and cpu_tune.key(shapes, 1, "blas") not in cached
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "300")
    assert cpu_tune.amx_from_rows(shapes, threads=1) == 300

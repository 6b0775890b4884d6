"""The block-format weight kernel (kernels/csrc/linear_blocks.c) against the gguf package's
dequantize (bit for bit) and a float64 dequantize-then-multiply reference, every format, odd
shapes; at the machine's instruction set, at AVX2 in a subprocess, and at the portable level in
CI's second pass (.ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from longctx.kernels import cpu_blocks, cpu_build

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_blocks.available(), reason=f"block kernel: {cpu_blocks.status()}")

BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "F16": (1, 2), "BF16": (1, 2), "F32": (1, 4)}
# where each block keeps its fp16 scales (offsets in the block)
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row_bytes] uint8: random quants with random finite fp16 scales (both signs)."""
    rng = np.random.default_rng(seed)
    elems, size = BLOCK[fmt]
    if fmt in ("F16", "BF16", "F32"):
        values = rng.standard_normal((n, k)).astype(np.float32)
        if fmt == "F32":
            return values.view(np.uint8).reshape(n, 4 * k)
        if fmt == "F16":
            return values.astype(np.float16).view(np.uint8).reshape(n, 2 * k)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2 * k)
    nb = k // elems
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for off in SCALES[fmt]:
        scale = (rng.uniform(1e-3, 0.1, size=(n, nb)) * rng.choice([-1, 1], size=(n, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * size)


def reference_dequant(fmt: str, raw: np.ndarray, k: int) -> np.ndarray:
    return gguf_dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(raw.shape[0], k).astype(np.float32)


# (M, N, K); K a multiple of 256. The long rows cross the decode paths' groups of super-blocks whose
# scales are worked out first (linear_blocks.c's SCALES_AHEAD, 8), with a part group at the end.
SHAPES = [(1, 37, 256), (3, 8, 512), (5, 67, 768), (9, 3, 256), (1, 19, 17 * 256), (2, 5, 11 * 256),
          (16, 5, 768), (13, 4, 5 * 256)]  # (verification's sizes: passes of 8 + 8; of 4 at k > 1024)


@pytest.mark.parametrize("fmt", list(BLOCK))
def test_dequantize_bit_identical_to_gguf(fmt):
    for n, k in ((7, 256), (33, 768)):
        raw = random_blocks(fmt, n, k, seed=n)
        expect = reference_dequant(fmt, raw, k)
        got = cpu_blocks.dequantize(torch.from_numpy(raw), fmt, k)
        assert np.array_equal(got.numpy().view(np.uint32), expect.view(np.uint32)), fmt
        rows = torch.tensor([n - 1, 0, 2, 2])
        picked = cpu_blocks.dequantize(torch.from_numpy(raw), fmt, k, rows)
        assert np.array_equal(picked.numpy(), expect[rows.numpy()])
        part = cpu_blocks.dequantize(torch.from_numpy(raw), fmt, k, first_row=2, num_rows=3)
        assert np.array_equal(part.numpy(), expect[2:5])


@pytest.mark.parametrize("fmt", list(BLOCK))
def test_dequantize_to_bfloat16_bit_identical_to_torchs_rounding(fmt):
    """A range of rows as bfloat16 (a bfloat16 model's prefill slices for the AMX tiles): the
    float32 dequantization rounded as torch rounds it (to nearest even), bit for bit, on one
    thread and three (300 rows of 256: past the kernel's 65,536 values for going parallel), over a
    width with a tail past the 16-value vector steps where the format has one."""
    widths = (40, 256) if BLOCK[fmt][0] == 1 else (256, 768)
    for n, k in ((7, widths[0]), (33, widths[1]), (300, 256)):
        raw = torch.from_numpy(random_blocks(fmt, n, k, seed=n + 1))
        expect = torch.from_numpy(reference_dequant(fmt, raw.numpy(), k)).to(torch.bfloat16)
        for threads in (1, 3):
            out = torch.full((n - 3, k), float("nan"), dtype=torch.bfloat16)
            cpu_blocks.dequantize(raw, fmt, k, first_row=2, num_rows=n - 3, out=out, num_threads=threads)
            assert torch.equal(out.view(torch.int16), expect[2:n - 1].view(torch.int16)), (fmt, n, k, threads)


@pytest.mark.parametrize("fmt", list(BLOCK))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_matches_float64_reference(fmt, m, n, k):
    raw = random_blocks(fmt, n, k, seed=m * 31 + n)
    w = reference_dequant(fmt, raw, k).astype(np.float64)
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g)
    expect = x.double().numpy() @ w.T
    scale = np.abs(x.double().numpy()) @ np.abs(w).T  # the sum of |terms|: float32's error bound scales with it
    got = cpu_blocks.linear(x, torch.from_numpy(raw), fmt, k)
    assert np.all(np.abs(got.numpy() - expect) <= 1e-5 * scale + 1e-6), fmt
    full = cpu_blocks.linear(x, torch.from_numpy(raw), fmt, k, bias, residual=residual)
    expect_full = expect + bias.double().numpy() + residual.double().numpy()
    assert np.all(np.abs(full.numpy() - expect_full) <= 1e-5 * (scale + 2 * np.abs(expect_full)) + 1e-6)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q5_1", "F16"])
@pytest.mark.parametrize("k", [512, 2048])
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(fmt, k):
    """Steps of 9 to 16 rows (lookahead's verification) take each dequantized weight row in passes
    of x's rows, as even as they go (AVX-512: up to 8 rows where k <= 1024, else 4; 4 at AVX2):
    each row's sums take the same steps in any pass, so a row's outputs are the same bits
    whichever rows share its step (16: 8 + 8 or 4 x 4; its first 9: 5 + 4 or 3 x 3; 11; 13)."""
    raw = torch.from_numpy(random_blocks(fmt, 7, k, seed=k))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(k))
    full = cpu_blocks.linear(x, raw, fmt, k)
    for m in (9, 11, 13):
        assert torch.equal(cpu_blocks.linear(x[:m], raw, fmt, k), full[:m]), m
        assert torch.equal(cpu_blocks.linear(x[16 - m:], raw, fmt, k), full[16 - m:]), m


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,k", [(1, 32), (1, 96), (1, 288), (2, 288), (5, 288)])
def test_linear_at_odd_block_counts_matches_float64(fmt, m, k):
    """The 32-element formats with 1, 3 and 9 blocks a row (the one-row kernels keep four
    accumulators, one per block in turn), one row of x and the one-row tail of five."""
    raw = random_blocks(fmt, 11, k, seed=k + m)
    w = reference_dequant(fmt, raw, k).astype(np.float64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k * m))
    expect = x.double().numpy() @ w.T
    scale = np.abs(x.double().numpy()) @ np.abs(w).T
    got = cpu_blocks.linear(x, torch.from_numpy(raw), fmt, k)
    assert np.all(np.abs(got.numpy() - expect) <= 1e-5 * scale + 1e-6), fmt


def test_linear_writes_a_column_slice_and_strided_rows():
    fmt, m, n, k = "Q4_K", 6, 20, 512
    raw = torch.from_numpy(random_blocks(fmt, n, k, seed=5))
    x_wide = torch.randn(m, k + 7)
    x = x_wide[:, 3:3 + k]  # rows strided
    out = torch.full((m, n + 10), 7.0)
    cpu_blocks.linear(x, raw, fmt, k, out=out[:, 4:4 + n])
    expect = cpu_blocks.linear(x.contiguous(), raw, fmt, k)
    assert torch.equal(out[:, 4:4 + n], expect)
    assert torch.all(out[:, :4] == 7.0) and torch.all(out[:, 4 + n:] == 7.0)  # nothing outside the slice


def test_one_thread_and_many_give_the_same_product():
    raw = torch.from_numpy(random_blocks("Q6_K", 45, 768, seed=2))
    x = torch.randn(7, 768)
    assert torch.equal(cpu_blocks.linear(x, raw, "Q6_K", 768, num_threads=1),
                       cpu_blocks.linear(x, raw, "Q6_K", 768, num_threads=3))


def test_bad_arguments_are_refused_by_name():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="not a whole number of Q8_0 blocks"):
        cpu_blocks.linear(torch.randn(1, 60), raw[:, :60], "Q8_0", 60)
    with pytest.raises(ValueError, match="not one the block kernel reads"):
        cpu_blocks.linear(torch.randn(1, 64), raw, "IQ2_XXS", 64)
    with pytest.raises(ValueError, match="x must be a float32"):
        cpu_blocks.linear(torch.randn(1, 32), raw, "Q8_0", 64)
    with pytest.raises(IndexError, match="outside the matrix"):
        cpu_blocks.dequantize(raw, "Q8_0", 64, torch.tensor([4]))
    with pytest.raises(ValueError, match="first_row"):
        cpu_blocks.dequantize(raw, "Q8_0", 64, first_row=3, num_rows=2)
    with pytest.raises(ValueError, match="or bfloat16, for a range of rows"):  # chosen rows stay float32
        cpu_blocks.dequantize(raw, "Q8_0", 64, torch.tensor([1]), out=torch.empty(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="first_row"):
        cpu_blocks.dequantize(raw, "Q8_0", 64, first_row=3, num_rows=2, out=torch.empty(2, 64, dtype=torch.bfloat16))


def _lower_vector_levels() -> list[str]:
    """The intrinsic levels below this run's that this CPU can run (on an AVX-512 BF16 machine:
    avx512, whose integer products lack VNNI, and avx2); none when a level is forced."""
    if os.environ.get("LONGCTX_CPU_ISA") is not None or cpu_build.isa() not in cpu_build.VECTOR_LEVELS:
        return []
    have = set(cpu_build._cpu_flags().split())
    below = cpu_build.VECTOR_LEVELS[cpu_build.VECTOR_LEVELS.index(cpu_build.isa()) + 1:]
    return [level for level in below if cpu_build.X86_LEVELS[level][1] <= have]


@pytest.mark.parametrize("level", _lower_vector_levels() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no lower intrinsic level here (or one is forced): the machine's default run checks it"))])
def test_lower_level_builds_in_a_subprocess(level):
    """The lower levels' dot products (this run took the best level's)."""
    env = dict(os.environ, LONGCTX_CPU_ISA=level)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "bit_identical or float64_reference or fast_products or odd_block_counts or "
                           "prologues or parts_in_one_call or rows_products"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


FAST = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _rounded_x(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """x as the fast path takes it: int8 in blocks of 32, scale d = amax / 127, each value times
    the float32 reciprocal 1 / d in float32, rounded to nearest even and clamped to +-127 (the
    kernel's steps: dividing by d instead parted from it by one int8 step on a value next to a
    half, 1 case in ~10^5); terms=2: plus what that rounding left (in float32, as the kernel
    computes it), rounded the same way on the scale d / 256."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)

    def rounded(values: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))  # float32, as the kernel's id
        return torch.round(values * inv).clamp(-127, 127)

    d = (xb.abs().amax(-1, keepdim=True) / 127).float()  # the kernel's float32 scale
    q = rounded(xb, d)
    taken = q.double() * d.double()
    if terms == 2:
        rest = xb - d * q  # xb - d * q in float32, as the kernel's rest
        d2 = d / 256
        taken = taken + rounded(rest, d2).double() * d2.double()
    return taken.view(m, k)


# the 32-element formats at an odd block count too (k = 288: nine blocks), which the AVX-512
# form (two blocks a step) leaves to the AVX2 one
FAST_CASES = [(fmt, *shape) for fmt in FAST for shape in SHAPES] + \
    [(fmt, m, 11, 288) for fmt in ("Q8_0", "Q4_0", "Q4_1") for m in (1, 6)]


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("fmt,m,n,k", FAST_CASES)
def test_fast_products_are_integer_products_on_rounded_x(fmt, m, n, k, terms):
    """fast=1 (True): the float64 product of the int8-rounded x with the dequantized weights,
    to float32's accuracy, and apart from the exact product by about x's rounding. fast=2: the
    same with x's two int8 terms, ~250x closer to the exact product."""
    if not cpu_blocks.fast_supported(fmt):
        pytest.skip(f"no integer products at {cpu_build.isa()}")
    raw = random_blocks(fmt, n, k, seed=m + 7 * n)
    w = torch.from_numpy(reference_dequant(fmt, raw, k)).double()
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=g)
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    scale = x.double().abs() @ w.abs().T
    got = cpu_blocks.linear(x, torch.from_numpy(raw), fmt, k, bias, residual=residual,
                            fast=True if terms == 1 else terms).double()
    expect = _rounded_x(x, terms) @ w.T + bias.double() + residual.double()
    assert torch.all((got - expect).abs() <= 1e-5 * (scale + expect.abs()) + 1e-6), fmt
    exact = x.double() @ w.T + bias.double() + residual.double()
    apart = float(((got - exact).abs() / scale).max())
    if terms == 1:  # x's rounding: at most half a step of 1/127 of each block's largest
        assert 1e-4 < apart < 1e-2, apart
    else:  # half a step of 1/127 of half a step of 1/127, plus float32's sums
        assert 0 < apart < 1e-4, apart
        one = cpu_blocks.linear(x, torch.from_numpy(raw), fmt, k, bias, residual=residual, fast=1).double()
        assert apart * 20 < float(((one - exact).abs() / scale).max())


@pytest.mark.parametrize("k", [192, 2048])
def test_fast_q8_0_few_rows_equal_the_same_rows_of_a_long_step(k):
    """Q8_0's fast products for up to 8 rows of x start their integer sums from x's sums
    times -128 and take the weights' bytes with the top bit flipped (unsigned, AVX-512 VNNI
    builds); longer steps move the weights' signs onto x. The same int32 sums either way: every
    row of a short call equals that row of a 12-row call bit for bit, weights of -128 included.
    k = 192: an odd count of two-block steps (the last taken alone)."""
    if not cpu_blocks.fast_supported("Q8_0"):
        pytest.skip(f"no integer products at {cpu_build.isa()}")
    raw = random_blocks("Q8_0", 37, k, seed=k)
    quants = raw.reshape(37, k // 32, 34)[:, :, 2:]
    quants[::3, :, 5] = 0x80  # -128, the weight whose magnitude only the unsigned byte holds
    quants[1::4, :, 17] = 0x7F
    blocks = torch.from_numpy(raw)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(k))
    x[:, 7] = 0.0
    long_step = cpu_blocks.linear(x, blocks, "Q8_0", k, fast=True)
    for m in (1, 2, 5, 8):
        assert torch.equal(cpu_blocks.linear(x[:m], blocks, "Q8_0", k, fast=True), long_step[:m]), m
    w = torch.from_numpy(reference_dequant("Q8_0", raw, k)).double()
    expect = _rounded_x(x) @ w.T
    assert torch.all((long_step.double() - expect).abs() <= 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6)


def test_fast_is_refused_for_a_format_without_integer_products():
    raw = torch.from_numpy(random_blocks("Q5_K", 4, 256))
    with pytest.raises(ValueError, match="no integer products for Q5_K"):
        cpu_blocks.linear(torch.randn(1, 256), raw, "Q5_K", 256, fast=True)
    for bad in (3, -1, 1.5):
        with pytest.raises(ValueError, match="fast must be"):
            cpu_blocks.linear(torch.randn(1, 256), torch.from_numpy(random_blocks("Q8_0", 4, 256)), "Q8_0", 256,
                              fast=bad)


@pytest.mark.parametrize("fast", [False, True, 2])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_parts_in_one_call_equal_each_part_alone(fast, m):
    """A matrix stored as parts of different formats (a Q4_K_M fused q/k/v): one call equals
    each part's product in its columns, bias and residual included. fast: the parts with
    integer products take them (Q5_K has none and stays exact), as each part alone does. m = 1:
    x's block sums, made once a call, serve the Q4_K, Q4_1 and Q4_0 parts (AVX2 builds)."""
    k = 512
    parts = [("Q4_K", 40), ("Q5_K", 9), ("Q6_K", 17), ("Q8_0", 5), ("Q4_1", 3), ("Q4_0", 7)]
    raws = [torch.from_numpy(random_blocks(fmt, n, k, seed=i)) for i, (fmt, n) in enumerate(parts)]
    codes = [cpu_blocks.FORMATS[fmt] for fmt, _ in parts]
    total = sum(n for _, n in parts)
    x, bias, residual = torch.randn(m, k), torch.randn(total), torch.randn(m, total)
    got = cpu_blocks.linear_parts(x, raws, codes, k, bias, residual=residual, fast=fast)
    lo = 0
    for raw, (fmt, n) in zip(raws, parts):
        alone = cpu_blocks.linear(x, raw, fmt, k, bias[lo:lo + n], residual=residual[:, lo:lo + n],
                                  fast=fast if cpu_blocks.fast_supported(fmt) else False)
        assert torch.equal(got[:, lo:lo + n], alone), fmt
        if fast and cpu_blocks.fast_supported(fmt):  # the integer products, not the exact ones
            assert not torch.equal(alone, cpu_blocks.linear(x, raw, fmt, k, bias[lo:lo + n],
                                                            residual=residual[:, lo:lo + n])), fmt
        lo += n
    with pytest.raises(ValueError, match="rejected"):
        cpu_blocks.linear_parts(x[:, :256], raws, codes, 256)


@pytest.mark.parametrize("prologue", ["rmsnorm", "swiglu"])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_prologues_inside_the_call_match_float64(prologue, m):
    """RMSNorm (weight, eps) or SwiGLU (x [M, 2K]: silu of the first half times the second)
    computed in the call, then the product: within float32's error of float64's, on parts of
    the 4-bit formats whose kernels take x reordered (the prologue's rows must be the ones
    reordered)."""
    k = 512
    parts = [("Q4_K", 11), ("Q4_1", 6), ("Q6_K", 5)]
    raws = [torch.from_numpy(random_blocks(fmt, n, k, seed=3 + i)) for i, (fmt, n) in enumerate(parts)]
    codes = [cpu_blocks.FORMATS[fmt] for fmt, _ in parts]
    w = np.concatenate([reference_dequant(fmt, raw.numpy(), k) for raw, (fmt, _) in zip(raws, parts)]).astype(np.float64)
    g = torch.Generator().manual_seed(m)
    if prologue == "rmsnorm":
        x, weight, eps = torch.randn(m, k, generator=g) * 3, torch.randn(k, generator=g), 1e-5
        xd = x.double().numpy()
        taken = weight.double().numpy() * xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + eps)
        got = cpu_blocks.linear_parts(x, raws, codes, k, norm_weight=weight, eps=eps)
    else:
        x = torch.randn(m, 2 * k, generator=g) * 2
        xd = x.double().numpy()
        gate, up = xd[:, :k], xd[:, k:]
        taken = gate / (1 + np.exp(-gate)) * up
        got = cpu_blocks.linear_parts(x, raws, codes, k, swiglu=True)
    expect = taken @ w.T
    scale = np.abs(taken) @ np.abs(w).T
    assert np.all(np.abs(got.numpy() - expect) <= 2e-5 * scale + 1e-6), prologue
    if cpu_blocks.fast_supported("Q4_K"):  # fast: the same prologue, then x rounded to int8 in blocks of 32
        fast = cpu_blocks.linear_parts(x, raws, codes, k, fast=True,
                                       **({"norm_weight": weight, "eps": eps} if prologue == "rmsnorm" else {"swiglu": True}))
        rounded = _rounded_x(torch.from_numpy(taken)).numpy()
        assert np.all(np.abs(fast.numpy() - rounded @ w.T) <= 2e-5 * scale + 1e-5), prologue
        assert not np.allclose(fast.numpy(), got.numpy(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="two different prologues"):
        cpu_blocks.linear_parts(torch.randn(m, 2 * k), raws, codes, k, norm_weight=torch.ones(k), swiglu=True)

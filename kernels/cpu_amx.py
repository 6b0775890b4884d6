"""bfloat16 weight products on AMX tiles (``csrc/linear_amx.c``): built on first use where the CPU
has AMX-BF16, called through ctypes, registered as the torch operator ``longctx::amx_linear``.

Owns: ``linear(x, weight)`` = ``x @ weight.T`` for float32 ``x`` [M, K] and a bfloat16 ``weight``
[N, K] (the row kernel's layout: no second copy of the weights), float32 out, with x rounded to
bfloat16 once and float32 sums: the row kernel's bfloat16 numerics from 17 rows
(``cpu_linear.rounds_bf16_rows``), on the tile unit, for a bfloat16 model's long steps; the
same in two halves (``round_x`` once, then ``amx_linear_rounded`` per slice) for a matrix that
is never whole in bfloat16 (GGUF blocks dequantized a slice at a time); an MLP's SwiGLU (or
GELU) product rounded straight into the down projection's input (``round_gated`` from a float32
gate/up product, ``gated_rounded`` with that product made in the same pass); and
saying whether it runs here (``available``/``status``/``supports``). Never: choosing when it
is used (``cpu_tune`` measures that, the model's ``Linear`` follows), or failing a run: on a CPU
without AMX, below the ``avx512bf16`` level (``LONGCTX_CPU_ISA``), where the kernel refuses the
process the tile state, or with ``LONGCTX_CPU_KERNEL=0`` it reports itself unavailable.

Why: the row kernel's bfloat16 product (vdpbf16ps, 512-bit) ran at 85 GFLOP/s on the Intel Xeon
(AVX-512 BF16, AMX), below its float32 product's 126, so a bfloat16 model's prefill was slower
than float32's there (issue 42); torch's own bfloat16 product (oneDNN on AMX) ran at 757 but
rounds its result to bfloat16 as well, which changed the real model's greedy tokens against
float32's. This keeps the result float32 (figures in docs/kernels.md).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from . import cpu_build

__all__ = ["available", "status", "supports", "takes_weight", "linear", "linear_rounded", "round_x",
           "round_gated", "gated_rounded", "unsupported"]

SOURCE = cpu_build.CSRC / "linear_amx.c"
NEEDS = ("amx_tile", "amx_bf16")  # /proc/cpuinfo flags
K_MULTIPLE, N_MULTIPLE = 32, 16  # a tile's bfloat16 pairs along K; a tile's columns


def unsupported() -> str | None:
    """Why this machine cannot run the AMX-BF16 kernels (None: it can): the flash kernel's AMX build
    asks the same."""
    have = set(cpu_build._cpu_flags().split())
    missing = [f for f in NEEDS if f not in have]
    if missing:
        return f"this CPU has no {', '.join(missing)}"
    if cpu_build.isa() != "avx512bf16":
        return f"the instruction-set level is {cpu_build.isa()}, not avx512bf16"
    return None


def _declare(lib: ctypes.CDLL) -> None:
    lib.longctx_amx_enable.restype = ctypes.c_int
    lib.longctx_amx_enable.argtypes = []
    fn = lib.longctx_amx_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn = lib.longctx_amx_round_scaled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    fn = lib.longctx_amx_round_rms
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    fn = lib.longctx_amx_round_gated
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn = lib.longctx_amx_linear_rounded
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int]
    fn = lib.longctx_amx_gated_rounded
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int]
    if lib.longctx_amx_enable() != 0:  # the process may not use the tiles: a fault at the first one
        raise RuntimeError("the OS refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")


class RoundedRows(NamedTuple):
    """A product's input already rounded for the AMX tiles (``round_x``'s order): what an MLP's
    gated product hands the down projection, or the flash kernel the o projection, where that
    one takes it (``longctx.model.linear``'s ``takes_rounded``)."""

    xb: torch.Tensor  # [rows rounded up to 16, K] bfloat16
    rows: int


def padded_rows(m: int) -> int:
    """Rows of x rounded for the tiles, and of a product's output, for ``m`` rows: whole 16-row tiles."""
    return (m + 15) // 16 * 16


def empty_rounded(rows: int, k: int) -> torch.Tensor:
    """A buffer for ``rows`` rows of x rounded for the tiles: bfloat16 [padded_rows(rows), k]."""
    return torch.empty(padded_rows(rows), k, dtype=torch.bfloat16)


def is_rounded_buffer(xb: torch.Tensor, rows: int, k: int) -> bool:
    """Whether ``xb`` is what ``empty_rounded(rows, k)`` gives: a contiguous CPU bfloat16 of that shape."""
    return (xb.dim() == 2 and xb.dtype == torch.bfloat16 and xb.device.type == "cpu" and xb.is_contiguous()
            and tuple(xb.shape) == (padded_rows(rows), k))


_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare, extra_flags=("-mamx-tile", "-mamx-bf16"),
                                   unsupported=unsupported)
available = _LIBRARY.available
status = _LIBRARY.status


def takes_weight(weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes this weight (with a float32 x of its width): a contiguous bfloat16
    [N, K] on the CPU with K a multiple of 32 and N of 16, where the kernel runs."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % K_MULTIPLE == 0 and weight.shape[0] % N_MULTIPLE == 0
            and available())


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes this input for this weight: ``takes_weight`` and a float32 x
    [M, K] (M > 0) with contiguous rows, on the CPU."""
    return (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] > 0
            and x.stride(1) == 1 and x.shape[1] == weight.shape[-1] and takes_weight(weight))


def _amx_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """The operator: ``out`` [M rounded up to 16, N] float32 with contiguous rows (the kernel
    writes whole 16-row tiles); anything else is refused before the C code writes a byte."""
    rows = x.shape[0] if x.dim() == 2 else 0
    padded = padded_rows(rows)
    if not (supports(x, weight) and out.dtype == torch.float32 and out.dim() == 2 and out.stride(1) == 1
            and out.shape[0] >= padded and out.shape[1] >= weight.shape[0] and threads >= 1 and rows > 0):
        raise ValueError(f"amx_linear needs what cpu_amx.supports takes and a float32 out of at least "
                         f"[{padded}, {weight.shape[0]}] with contiguous rows, got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, out {tuple(out.shape)} {out.dtype}, "
                         f"threads {threads}")
    rc = _LIBRARY.load().longctx_amx_linear(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(),
                                            weight.shape[0], out.data_ptr(), out.stride(0), threads)
    if rc != 0:
        raise RuntimeError(f"amx_linear refused x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                           "(K % 32, N % 16, or out of memory)")


amx_linear = cpu_build.define_op("amx_linear(Tensor x, Tensor weight, Tensor(a!) out, int threads) -> ()",
                                 _amx_linear)


def _check_round(x: torch.Tensor, xb: torch.Tensor, threads: int) -> None:
    """What the rounding operators take: the kernel, a float32 x [M, K] (K % 32, contiguous rows)
    and a contiguous bfloat16 xb [M rounded up to 16, K]; ValueError otherwise."""
    rows = x.shape[0] if x.dim() == 2 else 0
    padded = padded_rows(rows)
    if not (available() and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] > 0
            and x.stride(1) == 1 and x.shape[1] % K_MULTIPLE == 0 and is_rounded_buffer(xb, rows, x.shape[1])
            and threads >= 1):
        raise ValueError(f"amx_round needs the kernel ({status()}), a float32 x [M, K] (K % {K_MULTIPLE} == 0, "
                         f"contiguous rows) and a contiguous bfloat16 xb [{padded}, K], got x {tuple(x.shape)} {x.dtype}, "
                         f"xb {tuple(xb.shape)} {xb.dtype}, threads {threads}")


def _scale_ok(t: torch.Tensor | None, n: int) -> bool:
    """A rounding operator's row or column scale: None, or float32 [n] contiguous on the CPU."""
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                         and t.numel() == n)


def _amx_round_scaled(x: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None,
                      xb: torch.Tensor, threads: int) -> None:
    """The operator: x [M, K] float32, times ``row_scale[:, None]`` and then ``col_scale`` (float32
    [M] and [K], contiguous, either None; both None: x as it is), each product rounded to float32
    as torch's would be, rounded into ``xb``: a contiguous bfloat16 [M rounded up to 16, K] in the
    tiles' order (not rows: only ``amx_linear_rounded`` reads it)."""
    m, k = (x.shape[0], x.shape[1]) if x.dim() == 2 else (0, 0)
    if not (_scale_ok(row_scale, m) and _scale_ok(col_scale, k)):
        raise ValueError(f"amx_round_scaled needs float32 contiguous scales of {m} rows and {k} columns (or None), "
                         f"got {None if row_scale is None else (tuple(row_scale.shape), row_scale.dtype)} and "
                         f"{None if col_scale is None else (tuple(col_scale.shape), col_scale.dtype)}")
    _check_round(x, xb, threads)
    ptr = (lambda t: None if t is None else t.data_ptr())
    if _LIBRARY.load().longctx_amx_round_scaled(x.data_ptr(), x.stride(0), m, k, ptr(row_scale), ptr(col_scale),
                                                xb.data_ptr(), threads) != 0:
        raise RuntimeError(f"amx_round_scaled refused x {tuple(x.shape)}")


def _amx_round_rms(x: torch.Tensor, eps: float, col_scale: torch.Tensor | None, xb: torch.Tensor,
                   threads: int) -> None:
    """The operator: ``amx_round_scaled`` with the row scale an RMSNorm's 1 / sqrt(mean(x^2) + eps),
    made in the same pass (eps >= 0)."""
    k = x.shape[1] if x.dim() == 2 else 0
    if not (eps >= 0 and _scale_ok(col_scale, k)):
        raise ValueError(f"amx_round_rms needs eps >= 0 and a float32 contiguous col_scale of {k} (or None), got "
                         f"eps {eps}, col_scale "
                         f"{None if col_scale is None else (tuple(col_scale.shape), col_scale.dtype)}")
    _check_round(x, xb, threads)
    if _LIBRARY.load().longctx_amx_round_rms(x.data_ptr(), x.stride(0), x.shape[0], k, eps,
                                             None if col_scale is None else col_scale.data_ptr(), xb.data_ptr(),
                                             threads) != 0:
        raise RuntimeError(f"amx_round_rms refused x {tuple(x.shape)}")


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # round_gated's act, as the C code numbers them


def _amx_round_gated(gate: torch.Tensor, up: torch.Tensor, act: int, col0: int, xb: torch.Tensor,
                     threads: int) -> None:
    """The operator: columns [col0, col0 + w) of ``xb`` (``amx_round_scaled``'s [M rounded up to 16, K]) <-
    act(gate) * up rounded, for float32 gate and up [M, w] with contiguous rows and one row
    stride (two halves of one [M, 2F] product, or two slices of a pair buffer); act 0: SiLU,
    1: GELU's tanh form. w and col0 multiples of 32."""
    m, w = (gate.shape[0], gate.shape[1]) if gate.dim() == 2 else (0, 0)
    padded, k = padded_rows(m), xb.shape[1] if xb.dim() == 2 else 0
    if not (available() and m > 0 and gate.dtype == up.dtype == torch.float32 and gate.device.type == "cpu"
            and up.device.type == "cpu" and up.shape == gate.shape and gate.stride(1) == up.stride(1) == 1
            and gate.stride(0) == up.stride(0) and w % K_MULTIPLE == 0 and col0 % K_MULTIPLE == 0 and col0 >= 0
            and k % K_MULTIPLE == 0 and col0 + w <= k and is_rounded_buffer(xb, m, k) and act in (0, 1)
            and threads >= 1):
        raise ValueError(f"amx_round_gated needs the kernel ({status()}), float32 gate and up of one shape [M, w] "
                         f"with contiguous rows and one row stride, w and col0 multiples of {K_MULTIPLE}, a "
                         f"contiguous bfloat16 xb [{padded}, K] with col0 + w <= K, act 0 or 1, got gate "
                         f"{tuple(gate.shape)} {gate.dtype} {gate.stride()}, up {tuple(up.shape)} {up.dtype} "
                         f"{up.stride()}, col0 {col0}, xb {tuple(xb.shape)} {xb.dtype}, act {act}")
    if _LIBRARY.load().longctx_amx_round_gated(gate.data_ptr(), up.data_ptr(), gate.stride(0), m, k, col0, w, act,
                                               xb.data_ptr(), threads) != 0:
        raise RuntimeError(f"amx_round_gated refused gate {tuple(gate.shape)}")


def _amx_linear_rounded(xb: torch.Tensor, rows: int, weight: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """The operator: ``amx_linear`` on x rounded by ``amx_round_scaled`` (``rows`` of it), the same
    numbers; ``out`` as there."""
    padded = padded_rows(rows)
    if not (rows > 0 and takes_weight(weight) and is_rounded_buffer(xb, rows, weight.shape[1])
            and out.dtype == torch.float32 and out.dim() == 2 and out.stride(1) == 1 and out.shape[0] >= padded
            and out.shape[1] >= weight.shape[0] and threads >= 1):
        raise ValueError(f"amx_linear_rounded needs amx_round's xb [{padded}, K] for {rows} rows, a weight "
                         f"takes_weight takes of width K and a float32 out of at least [{padded}, N] with "
                         f"contiguous rows, got xb {tuple(xb.shape)} {xb.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, out {tuple(out.shape)} {out.dtype}, threads {threads}")
    rc = _LIBRARY.load().longctx_amx_linear_rounded(xb.data_ptr(), rows, weight.shape[1], weight.data_ptr(),
                                                    weight.shape[0], out.data_ptr(), out.stride(0), threads)
    if rc != 0:
        raise RuntimeError(f"amx_linear_rounded refused {rows} rows, weight {tuple(weight.shape)} "
                           "(K % 32, N % 16, or out of memory)")


def _amx_gated_rounded(xb: torch.Tensor, rows: int, weight: torch.Tensor, act: int, out: torch.Tensor,
                       threads: int) -> None:
    """The operator: ``out`` [M rounded up to 16, F] bfloat16 (contiguous, ``round_x``'s order) <-
    act(gate) * up rounded, gate and up the two halves of ``amx_linear_rounded(xb, rows, weight)``
    for a gate/up ``weight`` [2F, K] (gate's rows first, F a multiple of 32); act as
    ``amx_round_gated``'s. The same bits as that product followed by ``amx_round_gated``."""
    padded = padded_rows(rows)
    f = weight.shape[0] // 2 if weight.dim() == 2 else 0
    if not (rows > 0 and takes_weight(weight) and f % K_MULTIPLE == 0 and weight.shape[0] == 2 * f
            and is_rounded_buffer(xb, rows, weight.shape[1]) and is_rounded_buffer(out, rows, f) and act in (0, 1)
            and threads >= 1):
        raise ValueError(f"amx_gated_rounded needs amx_round's xb [{padded}, K] for {rows} rows, a gate/up weight "
                         f"[2F, K] takes_weight takes with F a multiple of {K_MULTIPLE}, a contiguous bfloat16 out "
                         f"[{padded}, F] and act 0 or 1, got xb {tuple(xb.shape)} {xb.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, out {tuple(out.shape)} {out.dtype}, act {act}, "
                         f"threads {threads}")
    rc = _LIBRARY.load().longctx_amx_gated_rounded(xb.data_ptr(), rows, weight.shape[1], weight.data_ptr(), f, act,
                                                   out.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"amx_gated_rounded refused {rows} rows, weight {tuple(weight.shape)} (out of memory?)")


amx_round_scaled = cpu_build.define_op(
    "amx_round_scaled(Tensor x, Tensor? row_scale, Tensor? col_scale, Tensor(a!) xb, int threads) -> ()",
    _amx_round_scaled)
amx_round_rms = cpu_build.define_op(
    "amx_round_rms(Tensor x, float eps, Tensor? col_scale, Tensor(a!) xb, int threads) -> ()", _amx_round_rms)
amx_round_gated = cpu_build.define_op(
    "amx_round_gated(Tensor gate, Tensor up, int act, int col0, Tensor(a!) xb, int threads) -> ()", _amx_round_gated)
amx_linear_rounded = cpu_build.define_op(
    "amx_linear_rounded(Tensor xb, int rows, Tensor weight, Tensor(a!) out, int threads) -> ()", _amx_linear_rounded)
amx_gated_rounded = cpu_build.define_op(
    "amx_gated_rounded(Tensor xb, int rows, Tensor weight, int act, Tensor(a!) out, int threads) -> ()",
    _amx_gated_rounded)


def round_x(x: torch.Tensor, num_threads: int | None = None, row_scale: torch.Tensor | None = None,
            col_scale: torch.Tensor | None = None, rms_eps: float | None = None) -> torch.Tensor:
    """x [M, K] float32 rounded to bfloat16 once, for several ``amx_linear_rounded`` products
    over it (slices of one matrix): a [M rounded up to 16, K] buffer in the tiles' order. With
    ``row_scale`` [M] and/or ``col_scale`` [K] (float32): ``col_scale * (x * row_scale[:, None])``
    rounded, each product as torch rounds it (an RMSNorm's ``weight * (x * rsqrt(...))`` in the
    rounding pass). ``rms_eps`` (instead of ``row_scale``): the row scale is the RMSNorm's
    1 / sqrt(mean(x^2) + eps), its statistics made in the same pass (float32, in the kernel's
    order of sums: the scale may differ from torch's in its last bit). RuntimeError where the
    kernel is not here; ValueError for an x it does not take."""
    if not available():
        raise RuntimeError(f"the AMX linear kernel is {status()}")
    if x.dim() != 2:
        raise ValueError(f"round_x takes x [M, K], got shape {tuple(x.shape)}")
    xb = empty_rounded(x.shape[0], x.shape[1])
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if rms_eps is None:
        amx_round_scaled(x, row_scale, col_scale, xb, threads)
    elif row_scale is not None:
        raise ValueError("round_x takes row_scale or rms_eps, not both")
    else:
        amx_round_rms(x, float(rms_eps), col_scale, xb, threads)
    return xb


def round_gated(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", xb: torch.Tensor | None = None,
                col0: int = 0, num_threads: int | None = None) -> torch.Tensor:
    """``act(gate) * up`` rounded as ``round_x`` rounds x, for float32 gate and up [M, w] (with
    one row stride: the halves of a gate/up product), into columns [col0, col0 + w) of ``xb``
    (a new [M rounded up to 16, w] when None); ``act``: "silu" or "gelu_tanh". The activation is
    the kernel's own (``exp_vec16``, within a few ulp of torch's), so a bfloat16 element may
    land one step from where rounding torch's float32 product puts it."""
    if not available():
        raise RuntimeError(f"the AMX linear kernel is {status()}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if xb is None:
        if gate.dim() != 2:
            raise ValueError(f"round_gated takes gate [M, w], got shape {tuple(gate.shape)}")
        xb = empty_rounded(gate.shape[0], gate.shape[1])
    amx_round_gated(gate, up, ACTIVATIONS[act], col0, xb, torch.get_num_threads() if num_threads is None else num_threads)
    return xb


def linear_rounded(xb: torch.Tensor, rows: int, weight: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``linear`` on x already rounded by ``round_x`` (``rows`` of it): [rows, N] float32."""
    out = torch.empty(xb.shape[0], weight.shape[0], dtype=torch.float32)  # (whole 16-row tiles)
    amx_linear_rounded(xb, rows, weight, out, torch.get_num_threads() if num_threads is None else num_threads)
    return out[:rows]


def gated_rounded(xb: torch.Tensor, rows: int, weight: torch.Tensor, act: str = "silu",
                  num_threads: int | None = None) -> torch.Tensor:
    """An MLP's ``act(gate) * up`` for x already rounded by ``round_x`` (``rows`` of it) and its
    gate/up matrix ``weight`` [2F, K] (bfloat16, gate's rows first, F a multiple of 32), rounded
    for the down projection's tiles: [rows rounded up to 16, F] bfloat16 in ``round_x``'s order,
    the same bits as ``round_gated`` on the two halves of ``linear_rounded(xb, rows, weight)``,
    without that [rows, 2F] float32 product (each 16 gate columns are multiplied beside their
    16 up columns, and go through the activation from a buffer in L1)."""
    if not available():
        raise RuntimeError(f"the AMX linear kernel is {status()}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    out = torch.empty(xb.shape[0] if xb.dim() == 2 else 0, weight.shape[0] // 2 if weight.dim() == 2 else 0,
                      dtype=torch.bfloat16)
    amx_gated_rounded(xb, rows, weight, ACTIVATIONS[act], out,
                      torch.get_num_threads() if num_threads is None else num_threads)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] bfloat16 ^T -> [M, N] float32 (x rounded to bfloat16, sums
    float32). The caller checks ``supports`` first; RuntimeError where the kernel is not here."""
    if not available():
        raise RuntimeError(f"the AMX linear kernel is {status()}")
    if not supports(x, weight):
        raise ValueError(f"amx linear takes float32 x [M, K] and a contiguous bfloat16 weight [N, K] with "
                         f"K % {K_MULTIPLE} == 0 and N % {N_MULTIPLE} == 0, got x {x.dtype} {tuple(x.shape)}, "
                         f"weight {weight.dtype} {tuple(weight.shape)}")
    rows = x.shape[0]
    padded = padded_rows(rows)  # the kernel writes whole 16-row tiles
    out = torch.empty(padded, weight.shape[0], dtype=torch.float32)
    amx_linear(x, weight, out, torch.get_num_threads() if num_threads is None else num_threads)
    return out[:rows]

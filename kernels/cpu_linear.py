"""The CPU weight-product kernel (``csrc/linear_rows.c``): built on first use, called through
ctypes, registered as the torch operators ``longctx::linear_rows``, ``longctx::rope_``,
``longctx::swiglu_rows`` and ``longctx::rms_rows``.

Owns: ``linear(x, weight, bias)`` = ``x @ weight.T + bias`` for float32 ``x`` and a float32 or bfloat16
``[out, in]`` weight (the checkpoint's layout), optionally with the decoder layer's RMSNorm or
SwiGLU applied to ``x`` first and a residual added after (one call per product instead of
several torch ops), and saying whether and up to how many rows it runs
(``available``/``status``/``supports``/``max_rows``). Never: choosing when to use it (the
model's ``Linear`` does), or failing a run: with no compiler, a failed build or
``LONGCTX_CPU_KERNEL=0`` it reports itself unavailable and the model keeps another path.

Why: decode, batched decode and lookahead verification multiply one to a few dozen rows by
every weight matrix, which is a stream over the weights. BLAS re-packs the weights on each such
call, and oneDNN's pre-packed copy is read at ~15 GB/s here; this kernel reads the plain matrix
once per block of rows near the machine's read bandwidth. From 17 rows on it packs each slice
of the weights into panels and runs a register-blocked product, which measured faster than
torch's BLAS on the same matrix up to 2,048 rows (``benchmarks/bench_linear.py``), so prefill
chunks take it too and a model holds one plain copy of its weights.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_build

__all__ = ["available", "status", "supports", "linear", "rope_", "swiglu", "rms_norm", "max_rows", "rounds_bf16_rows",
           "DOT_MAX_ROWS"]

SOURCE = cpu_build.CSRC / "linear_rows.c"
# Rows up to which the model's Linear takes this kernel when it was built without AVX2/FMA (dot
# products only); above it BLAS on the same weights. Built with them, the kernel has its panel
# path from 17 rows and takes every step (``max_rows``). bench_linear.py (linear/amd-epyc-2c/legacy.json, AMD
# EPYC, 2 threads, all 121 matrices, ms), before the panels: 1 row 30.2 vs 48.3 for F.linear
# and 35.5 oneDNN-packed; 8 rows 43.9 vs 90.4 / 48.2; 64 rows 179.6 vs 215.5 / 160.5; at 128
# rows (4 layers) 44.8 vs 38.5 / 38.8, where BLAS's blocked GEMM won over the dot products.
DOT_MAX_ROWS = 64
BF16_PANEL_ROWS = 17  # csrc's PANEL_MIN_ROWS: the panel path, where bf16 weights may round x
UNBOUNDED = 1 << 62
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc's WT_F32 / WT_BF16


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.longctx_linear_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn = lib.longctx_swiglu_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int]
    fn = lib.longctx_rms_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    rope = lib.longctx_rope_inplace
    rope.restype = ctypes.c_int
    rope.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.longctx_linear_has_panels.restype = ctypes.c_int
    lib.longctx_linear_has_panels.argtypes = []
    lib.longctx_linear_bf16_panels.restype = ctypes.c_int
    lib.longctx_linear_bf16_panels.argtypes = []
    lib.longctx_linear_set_bf16_dot.restype = ctypes.c_int
    lib.longctx_linear_set_bf16_dot.argtypes = [ctypes.c_int]


# By CPU vendor: the bytes ahead that the one-to-three-row products (decode) ask their weight rows
# into L2 (ROW_PREFETCH). On an Intel Xeon it took one row's stream from 13-17 to 20-26 GB/s; on
# an AMD EPYC (Zen 4) 512 B to 4 KB ahead measured slower than the hardware prefetcher alone (the
# C file's row_dot has the figures). CPUs of other vendors keep none. And the rows of x per pass
# of the AVX-512 panels (PANEL_ROWS_Z): 10 on an Intel Xeon (the 1B-shaped model's fp32 4K prefill
# 36.0 -> 33.3 s), 6 elsewhere (on the Zen 4 more rows measured the same; panel_rows_z).
VENDOR_FLAGS = {"GenuineIntel": ("-DROW_PREFETCH=8192", "-DPANEL_ROWS_Z=10")}

def _settle(lib: ctypes.CDLL) -> None:
    from . import cpu_tune  # (it imports this module)

    cpu_tune.settle_bf16_dot("linear", lib)


# _settle: whether a bfloat16 matrix's panels take vdpbf16ps (x rounded to bfloat16) or widen it to
# float32, measured on this machine at first use (rounds_bf16_rows says which)
_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare, extra_flags=cpu_build.vendor_flags(VENDOR_FLAGS),
                                   settle=_settle)
_load = _LIBRARY.load
available = _LIBRARY.available  # whether the kernel runs here
status = _LIBRARY.status  # 'ok', or why the kernel is not used


def max_rows() -> int:
    """Rows up to which ``supports`` takes a step: every step when the build has the panel
    path (AVX2 + FMA), else ``DOT_MAX_ROWS``; 0 when the kernel does not run here."""
    lib = _load()
    if lib is None:
        return 0
    if not hasattr(lib, "longctx_max_rows"):  # asked once per loaded library
        lib.longctx_max_rows = UNBOUNDED if lib.longctx_linear_has_panels() else DOT_MAX_ROWS
    return lib.longctx_max_rows


def rounds_bf16_rows() -> int:
    """Rows from which a bfloat16 weight's product takes x rounded to bfloat16 (vdpbf16ps, on
    CPUs with AVX-512 BF16 where ``cpu_tune`` measured it faster than widening: twice float32's
    multiply-adds per instruction on some, as many on others; sums stay float32); 0 where it never
    does (the weights are then widened and x stays float32)."""
    lib = _load()
    return BF16_PANEL_ROWS if lib is not None and lib.longctx_linear_bf16_panels() else 0


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes this input for this weight (the caller then uses it)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= max_rows() and x.dtype == torch.float32
            and x.device.type == "cpu" and weight.dtype in WEIGHT_TYPES and available())


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if (t.dtype != torch.float32 or t.dim() != 2 or tuple(t.shape) != (rows, width)
            or t.stride(1) != 1 or (rows > 1 and t.stride(0) < width)):
        raise ValueError(f"{name} must be a float32 [{rows}, {width}] tensor with contiguous rows, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 norm_weight: torch.Tensor | None, eps: float, swiglu: bool, residual: torch.Tensor | None,
                 num_threads: int, out: torch.Tensor) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU linear kernel is {status()}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be matrices, got {tuple(x.shape)} and {tuple(weight.shape)}")
    in_width = 2 * weight.shape[1] if swiglu else weight.shape[1]
    if x.shape[1] != in_width:
        what = "2K (SwiGLU halves)" if swiglu else "K"
        raise ValueError(f"x [M, {what}] and weight [N, K] must agree on K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.float32 or weight.dtype not in WEIGHT_TYPES:
        raise ValueError(f"x must be float32 and weight float32 or bfloat16, got {x.dtype} and {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("x and weight must be on the CPU")
    rows, (num_out, k) = x.shape[0], weight.shape
    if rows < 1 or k < 1 or num_out < 1:
        raise ValueError(f"empty product: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if norm_weight is not None and swiglu:
        raise ValueError("norm_weight and swiglu are two different prologues; give one")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (the [out, in] matrix)")
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < x.shape[1]):
        raise ValueError(f"x needs contiguous rows, got strides {x.stride()}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (num_out,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{num_out}], got {bias.dtype} {tuple(bias.shape)}")
    if norm_weight is not None and (norm_weight.dtype != torch.float32 or tuple(norm_weight.shape) != (k,)
                                    or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be a contiguous float32 [{k}], got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if residual is not None:
        _check_rows("residual", residual, rows, num_out)
    if (out.dtype != torch.float32 or tuple(out.shape) != (rows, num_out) or out.stride(1) != 1
            or (rows > 1 and out.stride(0) < num_out)):
        raise ValueError(f"out must be a float32 tensor of shape {(rows, num_out)} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    prologue = 1 if norm_weight is not None else 2 if swiglu else 0
    rc = lib.longctx_linear_rows(
        x.data_ptr(), max(x.stride(0), x.shape[1]), rows, weight.data_ptr(), WEIGHT_TYPES[weight.dtype], num_out, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), num_out), prologue,
        None if norm_weight is None else norm_weight.data_ptr(), eps,
        None if residual is None else residual.data_ptr(),
        max(residual.stride(0), num_out) if residual is not None else 0, num_threads)
    if rc != 0:
        raise ValueError(f"linear_rows rejected its arguments (code {rc}): x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")


linear_rows = cpu_build.define_op(
    "linear_rows(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float eps, bool swiglu, "
    "Tensor? residual, int num_threads, Tensor(a!) out) -> ()", _linear_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided), weight [N, K] float32 or bfloat16 contiguous,
    bias [N] float32 -> x @ weight.T + bias, [M, N] float32 (a bfloat16 weight is widened to
    float32 as it is read: the product is float32's on the rounded weights; from
    ``rounds_bf16_rows()`` rows, where that is not 0, x is rounded to bfloat16 too, after any
    prologue, and the sums stay float32).

    ``norm_weight`` [K]: x is RMS-normalised first (``norm_weight * x / sqrt(mean(x^2) + eps)``
    per row, as the model's RMSNorm). ``swiglu``: x is [M, 2K] and the product takes
    ``silu(x[:, :K]) * x[:, K:]``. ``residual`` [M, N]: added to the result. ``out``: an
    [M, N] float32 tensor with contiguous rows to write into (e.g. a column slice of a wider one). ``num_threads``: OpenMP threads (default
    torch's count). Runs the operator ``torch.ops.longctx.linear_rows``."""
    if not available():
        raise RuntimeError(f"the CPU linear kernel is {status()}")
    if x.dim() == 2 and (x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1])):
        x = x.contiguous()  # e.g. an expanded row
    if out is None:
        out = torch.empty(x.shape[0] if x.dim() == 2 else 0, weight.shape[0] if weight.dim() == 2 else 0,
                          dtype=torch.float32)
    linear_rows(x, weight, bias, norm_weight, eps, swiglu, residual,
                torch.get_num_threads() if num_threads is None else num_threads, out)
    return out


SMALL_ROWS = 64  # rows up to which ``small_product`` runs on the calling thread


def small_product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T for a few rows (M <= ``SMALL_ROWS``; float32, contiguous, CPU; weight
    [N, K] float32 contiguous) on the calling thread, with the few checks such a call needs:
    the products beside attention (int8 pages' rotation), four a layer in a decode step. There
    a parallel region cost more than the product: measured in 32K-token decode steps on the
    2-core EPYC (2026-11-27), ~0.11 ms a call through ``linear`` or torch's matmul against ~7 us
    on one thread, the workers having gone idle during the attention kernel."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU linear kernel is {status()}")
    rows, k = x.shape if x.dim() == 2 else (0, 0)
    if (x.dim() != 2 or not 1 <= rows <= SMALL_ROWS or x.dtype != torch.float32 or not x.is_contiguous()
            or x.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != torch.float32
            or not weight.is_contiguous() or weight.device.type != "cpu"):
        raise ValueError(f"small_product takes x [1..{SMALL_ROWS}, K] and weight [N, K], float32, contiguous, "
                         f"on the CPU; got x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n = weight.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{rows}, {n}], got {out.dtype} {tuple(out.shape)}")
    rc = lib.longctx_linear_rows(x.data_ptr(), k, rows, weight.data_ptr(), 0, n, k, None, out.data_ptr(), n, 0,
                                 None, 0.0, None, 0, 1)
    if rc != 0:
        raise ValueError(f"linear_rows rejected its arguments (code {rc}): x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU linear kernel is {status()}")
    if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 [T, heads, D] CPU tensor, got {x.dtype} {tuple(x.shape)}")
    rows, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or (rows > 1 and x.stride(0) < heads * d):
        raise ValueError(f"x needs contiguous heads within each row, got strides {x.stride()}")
    if pairs and d > 2 * ROPE_PAIRS_MAX_HALF:
        raise ValueError(f"rope over pairs takes heads of up to {2 * ROPE_PAIRS_MAX_HALF} dims, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or tuple(t.shape) != (rows, d // 2) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [{rows}, {d // 2}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if rows == 0:
        return
    rc = lib.longctx_rope_inplace(x.data_ptr(), rows, max(x.stride(0), heads * d), heads, d,
                                  cos.data_ptr(), sin.data_ptr(), int(pairs), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rope rejected its arguments (code {rc}): x {tuple(x.shape)}")


ROPE_PAIRS_MAX_HALF = 256  # the C kernel's bound on a head's half with pairs (head dims up to 512)
rope_op = cpu_build.define_op("rope_(Tensor(a!) x, Tensor cos, Tensor sin, bool pairs=False) -> ()", _rope)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Rotate-half RoPE in place: x [T, heads, D] float32 (heads and D contiguous, rows may be
    strided, e.g. the q and k heads of a fused qkv row), cos/sin [T, D/2] float32. The same
    arithmetic as ``longctx.model.rope.apply_rotary``, bit for bit. ``pairs``: each head's
    elements come as llama.cpp stores a Llama's q/k rows, (x1[i], x2[i]) at 2i and 2i + 1; they
    are rotated and written back as the halves (rotate-half's order), the same numbers as
    reordering them first. Returns x. Runs the operator ``torch.ops.longctx.rope_``."""
    if not available():
        raise RuntimeError(f"the CPU linear kernel is {status()}")
    rope_op(x, cos, sin, pairs)
    return x


def whole_rows(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> bool:
    """A float32 CPU matrix (of ``shape``, where given) whose rows are contiguous and do not
    overlap (any row stride): what the SwiGLU and RMSNorm passes take."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and tuple(t.shape) == shape
            and t.stride(1) == 1 and (shape[0] <= 1 or t.stride(0) >= shape[1]))


def _swiglu_rows(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    shape = tuple(gate.shape)
    if not (available() and len(shape) == 2 and shape[1] > 0 and whole_rows(gate, shape) and whole_rows(up, shape)
            and (shape[0] <= 1 or gate.stride(0) == up.stride(0)) and whole_rows(out, shape) and threads >= 1):
        raise ValueError(f"swiglu_rows needs the kernel ({status()}) and float32 gate, up and out of one shape "
                         f"[M, F] with contiguous rows (gate and up one row stride), got gate {gate.dtype} "
                         f"{tuple(gate.shape)} {gate.stride()}, up {up.dtype} {tuple(up.shape)} {up.stride()}, "
                         f"out {out.dtype} {tuple(out.shape)} {out.stride()}")
    if _load().longctx_swiglu_rows(gate.data_ptr(), up.data_ptr(), gate.stride(0), shape[0], shape[1],
                                   out.data_ptr(), out.stride(0), threads) != 0:
        raise ValueError(f"swiglu_rows refused gate {shape}")


def _rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, threads: int) -> None:
    shape = tuple(x.shape)
    if not (available() and len(shape) == 2 and shape[1] > 0 and whole_rows(x, shape) and whole_rows(out, shape)
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and tuple(weight.shape) == (shape[1],) and eps >= 0 and threads >= 1):
        raise ValueError(f"rms_rows needs the kernel ({status()}), float32 x and out [M, K] with contiguous rows, "
                         f"a contiguous float32 weight [K] and eps >= 0, got x {x.dtype} {tuple(x.shape)} "
                         f"{x.stride()}, weight {weight.dtype} {tuple(weight.shape)}, out {out.dtype} "
                         f"{tuple(out.shape)} {out.stride()}, eps {eps}")
    if _load().longctx_rms_rows(x.data_ptr(), x.stride(0), shape[0], shape[1], weight.data_ptr(), eps, out.data_ptr(),
                                out.stride(0), threads) != 0:
        raise ValueError(f"rms_rows refused x {shape}")


swiglu_rows = cpu_build.define_op("swiglu_rows(Tensor gate, Tensor up, Tensor(a!) out, int threads) -> ()",
                                  _swiglu_rows)
rms_rows = cpu_build.define_op("rms_rows(Tensor x, Tensor weight, float eps, Tensor(a!) out, int threads) -> ()",
                               _rms_rows)


def swiglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for float32 gate and up [M, F] (contiguous rows, one row stride: the
    halves of a gate/up product) in one pass, rows over the threads: the row kernel's SwiGLU
    prologue's numbers (its exponential: within ~1 ulp of torch's silu, not its bits). Into
    ``out`` ([M, F], contiguous rows) where given. The operator ``torch.ops.longctx.swiglu_rows``."""
    out = torch.empty(gate.shape, dtype=torch.float32) if out is None else out
    swiglu_rows(gate, up, out, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` for a float32 x [M, K] (contiguous rows) in one
    pass, rows over the threads: the row kernel's norm prologue's numbers (float32 statistics in
    its order of sums: the scale may differ from torch's in its last bit). The operator
    ``torch.ops.longctx.rms_rows``."""
    out = torch.empty(x.shape, dtype=torch.float32) if out is None else out
    rms_rows(x, weight, float(eps), out, torch.get_num_threads())
    return out

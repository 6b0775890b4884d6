"""Weight products over GGUF block formats kept as stored (``csrc/linear_blocks.c``): built on
first use, called through ctypes, registered as the torch operators
``longctx::blocks_linear`` and ``longctx::blocks_dequant``.

Owns: ``linear(x, blocks, fmt, k)`` = ``x @ dequantize(blocks).T (+ bias) (+ residual)`` for a
``[N, row_bytes]`` uint8 matrix in one of ``FORMATS`` (GGML's type ids), and
``dequantize(blocks, fmt, k, rows=...)`` (chosen rows or a range of rows as float32: the
embedding's lookups, a prefill step's slices; a range as bfloat16 for the AMX tiles). Never: choosing when to use it (the model's
``BlockWeights`` does), or failing a run: with no compiler, a failed build or
``LONGCTX_CPU_KERNEL=0`` it reports itself unavailable and the loader expands the file to
float32 as before.

Numerics: the dequantized values are bit-identical to ggml's reference and to the ``gguf``
package's ``dequantize`` (tests/kernels/test_blocks.py checks every format), and the products
are float32 sums over them.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_build

__all__ = ["FORMATS", "available", "status", "row_bytes", "linear", "linear_parts", "dequantize", "fast_supported"]

SOURCE = cpu_build.CSRC / "linear_blocks.c"
# name -> GGML type id (the ids GGUF files carry), for the formats the kernel reads
FORMATS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
           "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
NAMES = {v: k for k, v in FORMATS.items()}


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.longctx_blocks_row_bytes.restype = i32
    lib.longctx_blocks_row_bytes.argtypes = [i32, i64, ctypes.POINTER(i64)]
    lib.longctx_blocks_linear.restype = i32
    lib.longctx_blocks_linear.argtypes = [ptr, i64, i32, ptr, i64, i32, i32, i64, ptr, ptr, i64, ptr, i64, i32]
    lib.longctx_blocks_linear_fast.restype = i32
    lib.longctx_blocks_linear_fast.argtypes = lib.longctx_blocks_linear.argtypes + [i32]
    lib.longctx_blocks_fast_supported.restype = i32
    lib.longctx_blocks_fast_supported.argtypes = [i32]
    lib.longctx_blocks_linear_parts.restype = i32
    lib.longctx_blocks_linear_parts.argtypes = [ptr, i64, i32, i32, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64,
                                                i32, i32, ptr, ctypes.c_float, i32]
    lib.longctx_blocks_dequant.restype = i32
    lib.longctx_blocks_dequant.argtypes = [ptr, i64, i32, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.longctx_blocks_dequant_bf16.restype = i32
    lib.longctx_blocks_dequant_bf16.argtypes = [ptr, i64, i32, i64, i64, i64, i64, ptr, i64, i32]


_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare)
_load = _LIBRARY.load
available = _LIBRARY.available  # whether the kernel runs here
status = _LIBRARY.status  # 'ok', or why the kernel is not used


def _format_id(fmt: int | str) -> int:
    code = FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if code not in NAMES:
        raise ValueError(f"weight format {fmt!r} is not one the block kernel reads ({', '.join(FORMATS)})")
    return code


def row_bytes(fmt: int | str, k: int) -> int:
    """Bytes of one row of ``k`` weights in ``fmt``; ValueError when ``k`` is not a whole
    number of the format's blocks."""
    code = _format_id(fmt)
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU block kernel is {status()}")
    out = ctypes.c_int64(0)
    if lib.longctx_blocks_row_bytes(code, k, ctypes.byref(out)) != 0:
        raise ValueError(f"a row of {k} weights is not a whole number of {NAMES[code]} blocks")
    return out.value


def _check_blocks(blocks: torch.Tensor, code: int, k: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device.type != "cpu":
        raise ValueError(f"blocks must be a uint8 [N, row_bytes] CPU tensor, got {blocks.dtype} "
                         f"{tuple(blocks.shape)} on {blocks.device}")
    if blocks.shape[1] != row_bytes(code, k) or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous rows of {row_bytes(code, k)} bytes ({k} {NAMES[code]} "
                         f"weights), got {tuple(blocks.shape)} strides {blocks.stride()}")


def fast_supported(fmt: int | str) -> bool:
    """Whether ``linear(..., fast=1 or 2)`` has integer products for ``fmt`` here (AVX2 builds:
    Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)."""
    lib = _load()
    return lib is not None and bool(lib.longctx_blocks_fast_supported(_format_id(fmt)))


def _terms(fast: bool | int) -> int:
    """``fast`` as the number of x's int8 terms: 0 (exact), 1 or 2."""
    terms = int(fast)
    if terms not in (0, 1, 2) or isinstance(fast, float):
        raise ValueError(f"fast must be False/0 (exact), True/1 or 2 (x's int8 terms), got {fast!r}")
    return terms


def _blocks_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: int, k: int, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, num_threads: int, out: torch.Tensor, fast: int = 0) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU block kernel is {status()}")
    _check_blocks(blocks, fmt, k)
    n = blocks.shape[0]
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"x must be a float32 [M, {k}] CPU tensor with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    m = x.shape[0]
    if m < 1:
        raise ValueError("x has no rows")
    for name, t, shape in (("bias", bias, (n,)), ("residual", residual, (m, n))):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(-1) != 1):
            raise ValueError(f"{name} must be float32 {shape} with contiguous rows, got {t.dtype} {tuple(t.shape)}")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    if out.dtype != torch.float32 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be float32 ({m}, {n}) with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    terms = _terms(fast)
    if terms and not lib.longctx_blocks_fast_supported(fmt):
        raise ValueError(f"no integer products for {NAMES[fmt]} here (fast_supported)")
    args = (x.data_ptr(), max(x.stride(0), k), m, blocks.data_ptr(), blocks.shape[1], fmt, n, k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), n),
            None if residual is None else residual.data_ptr(), 0 if residual is None else max(residual.stride(0), n),
            num_threads)
    rc = lib.longctx_blocks_linear_fast(*args, terms) if terms else lib.longctx_blocks_linear(*args)
    if rc != 0:
        raise ValueError(f"blocks_linear rejected its arguments (code {rc}): x {tuple(x.shape)}, "
                         f"blocks {tuple(blocks.shape)} {NAMES[fmt]}")


blocks_linear = cpu_build.define_op(
    "blocks_linear(Tensor x, Tensor blocks, int fmt, int k, Tensor? bias, Tensor? residual, int num_threads, "
    "Tensor(a!) out, int fast=0) -> ()", _blocks_linear)


def linear(x: torch.Tensor, blocks: torch.Tensor, fmt: int | str, k: int, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           num_threads: int | None = None, fast: bool | int = False) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(blocks).T (+ bias [N]) (+ residual [M, N]) -> [M, N] float32.
    ``blocks``: [N, row_bytes] uint8, N rows of K weights in ``fmt`` (a name of ``FORMATS`` or
    its GGML id). ``out``: an [M, N] float32 tensor with contiguous rows to write into (it may
    be a column slice of a wider one). ``fast`` (True or 1): x rounded to int8 in blocks of 32
    and integer products, as llama.cpp computes (``fast_supported``); 2: x as two int8 terms (x
    rounded, then what the rounding left, rounded again), the integer products of both summed;
    False or 0: float32 products on the exactly dequantized weights (AVX2 builds with one row of x:
    the blocks' scales and offsets applied to sums of x * q, the same value rounded differently). Runs
    ``torch.ops.longctx.blocks_linear``."""
    code = _format_id(fmt)
    if x.dim() == 2 and x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0] if x.dim() == 2 else 0, blocks.shape[0] if blocks.dim() == 2 else 0,
                          dtype=torch.float32)
    blocks_linear(x, blocks, code, k, bias, residual, torch.get_num_threads() if num_threads is None else num_threads,
                  out, _terms(fast))
    return out


class PreparedParts:
    """A matrix stored as parts (uint8 [rows, row_bytes] CPU tensors, stacked along the output
    rows, each in its format) as the C entry takes it, checked and built once: a product then
    costs ~4 us of Python around the kernel instead of ~20 (a decode step of a 30-layer model
    makes ~120 of them). Holds the tensors, so their memory stays valid."""

    def __init__(self, parts: list[torch.Tensor], fmts: list[int], k: int) -> None:
        n = len(parts)
        if n != len(fmts) or not 1 <= n <= 8:
            raise ValueError(f"1 to 8 parts, each with its format; got {n} parts and {len(fmts)} formats")
        for t in parts:  # (their row widths are checked by the kernel)
            if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"parts must be contiguous uint8 [rows, row_bytes] CPU tensors, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        self.parts, self.fmts, self.k, self.n = list(parts), [_format_id(f) for f in fmts], k, n
        self.total = sum(t.shape[0] for t in parts)
        self.arrays = ((ctypes.c_void_p * n)(*[t.data_ptr() for t in parts]),
                       (ctypes.c_int64 * n)(*[t.shape[1] for t in parts]), (ctypes.c_int * n)(*self.fmts),
                       (ctypes.c_int64 * n)(*[t.shape[0] for t in parts]))

    def __call__(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, num_threads: int = 1, fast: bool | int = False) -> torch.Tensor:
        """out [M, total] = prologue(x) @ W^T (+ bias) (+ residual); the prologue is RMSNorm with
        ``norm_weight`` and ``eps``, or (``swiglu``, x [M, 2K]) silu(x[:, :K]) * x[:, K:].
        ``fast`` (1 or 2 terms): the parts whose format has integer products (``fast_supported``)
        take x (after the prologue) rounded to int8 in blocks of 32, as ``linear(..., fast)``;
        the others stay exact."""
        lib = _load()
        if lib is None:
            raise RuntimeError(f"the CPU block kernel is {status()}")
        k, total = self.k, self.total
        width = 2 * k if swiglu else k
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or x.shape[0] < 1:
            raise ValueError(f"x must be a float32 [M >= 1, {width}] tensor with contiguous rows, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if swiglu and norm_weight is not None:
            raise ValueError("norm_weight and swiglu are two different prologues; give one")
        m = x.shape[0]
        for name, t, shape in (("bias", bias, (total,)), ("residual", residual, (m, total)), ("out", out, (m, total)),
                               ("norm_weight", norm_weight, (k,))):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(-1) != 1):
                raise ValueError(f"{name} must be float32 {shape} with contiguous rows, got {t.dtype} {tuple(t.shape)}")
        prologue = 1 if norm_weight is not None else 2 if swiglu else 0
        rc = lib.longctx_blocks_linear_parts(
            x.data_ptr(), max(x.stride(0), width), m, self.n, *self.arrays, k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), total),
            None if residual is None else residual.data_ptr(), 0 if residual is None else max(residual.stride(0), total),
            num_threads, prologue, None if norm_weight is None else norm_weight.data_ptr(), float(eps), _terms(fast))
        if rc != 0:
            raise ValueError(f"blocks_linear_parts rejected its arguments (code {rc}): x {tuple(x.shape)}, parts "
                             f"{[tuple(t.shape) for t in self.parts]} {[NAMES.get(f, f) for f in self.fmts]}")
        return out


def _blocks_linear_parts(x: torch.Tensor, parts: list[torch.Tensor], fmts: list[int], k: int,
                         bias: torch.Tensor | None, residual: torch.Tensor | None, num_threads: int,
                         out: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                         swiglu: bool = False, fast: int = 0) -> None:
    PreparedParts(parts, fmts, k)(x, out, bias, residual, norm_weight, eps, swiglu, num_threads, fast)


blocks_linear_parts = cpu_build.define_op(
    "blocks_linear_parts(Tensor x, Tensor[] parts, int[] fmts, int k, Tensor? bias, Tensor? residual, "
    "int num_threads, Tensor(a!) out, Tensor? norm_weight=None, float eps=0.0, bool swiglu=False, "
    "int fast=0) -> ()",
    _blocks_linear_parts)


def linear_parts(x: torch.Tensor, parts: list[torch.Tensor], fmts: list[int], k: int,
                 bias: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, num_threads: int | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
                 fast: bool | int = False) -> torch.Tensor:
    """``linear`` over a matrix stored as ``parts`` stacked along the output rows, each in its
    format (GGML ids), in one call: [M, sum of the parts' rows] float32. ``norm_weight``/``eps``
    (RMSNorm) or ``swiglu`` (x is [M, 2K]: silu of its first half times its second): the
    prologue the product takes x through, computed in the call. ``fast``: integer products on
    int8-rounded x for the parts whose format has them (``PreparedParts``)."""
    if x.dim() == 2 and x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0] if x.dim() == 2 else 0, sum(t.shape[0] for t in parts), dtype=torch.float32)
    blocks_linear_parts(x, parts, list(fmts), k, bias, residual,
                        torch.get_num_threads() if num_threads is None else num_threads, out,
                        norm_weight, eps, swiglu, _terms(fast))
    return out


def _blocks_dequant(blocks: torch.Tensor, fmt: int, k: int, rows: torch.Tensor | None, first_row: int,
                    num_threads: int, out: torch.Tensor) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU block kernel is {status()}")
    _check_blocks(blocks, fmt, k)
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous()):
        raise ValueError(f"rows must be a contiguous int64 vector, got {rows.dtype} {tuple(rows.shape)}")
    nrows = out.shape[0] if out.dim() == 2 else -1
    bf16 = out.dtype == torch.bfloat16 and rows is None  # a range of rows rounded to bfloat16
    if (out.dtype != torch.float32 and not bf16) or out.dim() != 2 or out.shape[1] != k or out.stride(1) != 1 or (
            rows is not None and rows.shape[0] != nrows):
        raise ValueError(f"out must be float32 [{nrows}, {k}] (or bfloat16, for a range of rows) with contiguous "
                         f"rows, got {out.dtype} {tuple(out.shape)}")
    if bf16:
        rc = lib.longctx_blocks_dequant_bf16(blocks.data_ptr(), blocks.shape[1], fmt, blocks.shape[0], k, first_row,
                                             nrows, out.data_ptr(), max(out.stride(0), k), num_threads)
    else:
        rc = lib.longctx_blocks_dequant(blocks.data_ptr(), blocks.shape[1], fmt, blocks.shape[0], k,
                                        None if rows is None else rows.data_ptr(), first_row, nrows,
                                        out.data_ptr(), max(out.stride(0), k), num_threads)
    if rc == 4:
        raise IndexError(f"a row index is outside the matrix's {blocks.shape[0]} rows")
    if rc == 5:
        raise MemoryError("blocks_dequant could not allocate a thread's row buffer")
    if rc != 0:
        raise ValueError(f"blocks_dequant rejected its arguments (code {rc}): blocks {tuple(blocks.shape)} "
                         f"{NAMES[fmt]}, first_row {first_row}, {nrows} rows")


blocks_dequant = cpu_build.define_op(
    "blocks_dequant(Tensor blocks, int fmt, int k, Tensor? rows, int first_row, int num_threads, "
    "Tensor(a!) out) -> ()", _blocks_dequant)


def dequantize(blocks: torch.Tensor, fmt: int | str, k: int, rows: torch.Tensor | None = None, *,
               first_row: int = 0, num_rows: int | None = None, out: torch.Tensor | None = None,
               num_threads: int | None = None) -> torch.Tensor:
    """float32 [R, K] of ``blocks``' rows: those indexed by ``rows`` (int64), else ``num_rows``
    (default all) from ``first_row``. ``out``: [R, K] float32 with contiguous rows to fill, or,
    for a range of rows, bfloat16 (each value rounded to nearest even, as ``.to(torch.bfloat16)``
    rounds the float32 result)."""
    code = _format_id(fmt)
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        count = rows.shape[0]
    else:
        count = blocks.shape[0] - first_row if num_rows is None else num_rows
    if out is None:
        out = torch.empty(count, k, dtype=torch.float32)
    blocks_dequant(blocks, code, k, rows, first_row, torch.get_num_threads() if num_threads is None else num_threads,
                   out)
    return out

"""The CPU decode-attention kernel (``csrc/paged_decode.c``): built on first use, called
through ctypes, registered as the torch operator ``longctx::paged_decode``; the same library's
page writers as ``longctx::int8_write_kv`` and ``longctx::write_kv`` (float pages).

Owns: loading the C source's library (``cpu_build.py`` compiles and caches it), the operator
(a step's whole varlen batch per call, the thread count passed in; a fake implementation for
``torch.compile``), ``attend_batch`` (its checked Python entry) and ``attend`` (one sequence):
a few new tokens per sequence against its pages, ``(out, lse)`` with the conventions of
``reference.py``. Never: choosing when to use it (``torch_paged`` does), or failing a run: with
no compiler, a failed build or ``LONGCTX_CPU_KERNEL=0`` it reports itself unavailable
(``status()`` says why) and the torch path runs instead.

Why a compiled kernel: decode attention streams the whole KV of a sequence against a handful of
query rows. BLAS reads it at 4-8 GB/s in that shape here (``benchmarks/bench_kernels.py``)
against ~27 GB/s for a plain reduction over the same bytes; this kernel reads each row once
per KV head with the queries in L1 (see the C file's header).

The library is built and cached by ``cpu_build.py`` (see there).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from . import cpu_amx, cpu_build

__all__ = ["available", "status", "attend", "attend_batch", "prepare", "checked_arguments", "check_scales",
           "check_batch", "batch_tables", "Blocks", "Tables", "MAX_ROWS", "SPLIT_TOKENS"]

SOURCE = cpu_build.CSRC / "paged_decode.c"
MAX_ROWS = 128  # query rows per KV head (q_len * group); the C file's MAX_ROWS
MAX_HEAD_DIM = 256
MAX_Q = 63  # tree-mask words hold 63 new tokens
SPLIT_TOKENS = 512  # tokens per work item: enough items for the threads, few merges
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # int8: pages of kv_quant.py


# The C batch signature both attention kernels share (paged_decode.c, paged_flash.c; ``call_batch``): q,
# k_cache, v_cache, k_scale, v_scale (int8 caches; NULL otherwise), dtype, block_table,
# table_rows, table_stride, num_blocks, ctx_lens, cu_q, total_q, seqs, [splits: flash only],
# num_seqs, block_size, num_heads, num_kv, d, scale, words, window, softcap (0: none),
# [split_tokens: decode only], threads, out, lse.
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
BATCH_HEAD = [_P, _P, _P, _P, _P, _I, _P, _I, _I64, _I, _P, _P, _I, _P]
BATCH_SHAPE = [_I, _I, _I, _I, _I, ctypes.c_float, _P, _I, ctypes.c_float]
BATCH_TAIL = [_I, _P, _P]
ERRORS = {-1: "unknown cache dtype or missing int8 scales",
          -2: "bad head layout (num_heads, num_kv, head_dim) or q's row stride below num_heads * head_dim",
          -3: "a sequence's query or context length is out of range", -4: "out of memory",
          -5: "a sequence outside the block table, q or the cache (block ids, query rows)",
          -6: "a rounded output where this build or head layout cannot write it, or a split sequence"}


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.longctx_paged_decode_batch
    fn.restype = ctypes.c_int
    fn.argtypes = [*BATCH_HEAD, *BATCH_SHAPE, _I, *BATCH_TAIL]
    tail = lib.longctx_tail_exchange
    tail.restype = ctypes.c_int
    tail.argtypes = ([_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I, _I, _I, _I, _P, _P, _I64, _P, _P]
                     + [_P] * 8 + [_I64, _I64, _I, _I, _I, _P, ctypes.c_float, _I])
    fn = lib.longctx_write_kv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
    write = lib.longctx_int8_write_kv
    write.restype = ctypes.c_int
    write.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


def _int8_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is {status()}")
    if k_cache.dtype != torch.int8 or k_cache.dim() != 4:
        raise ValueError(f"int8 writes need int8 [NB, BS, Hkv, D] caches, got {k_cache.dtype} {tuple(k_cache.shape)}")
    check_scales(k_cache, k_scale, v_scale)
    if v_cache.dtype != torch.int8 or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous()
                                                                              and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous int8 caches of one shape")
    _, block_size, heads, dim = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.dim() != 3 or tuple(t.shape[1:]) != (heads, dim) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [T, {heads}, {dim}], got {t.dtype} {tuple(t.shape)}")
    _meta("slots", slots, 1, torch.int64)
    _meta("starts", starts, 1, torch.int64)
    if k.shape[0] != slots.shape[0] or v.shape[0] != slots.shape[0]:
        raise ValueError(f"k, v and slots disagree on rows: {k.shape[0]}, {v.shape[0]}, {slots.shape[0]}")
    old = torch.empty(max(starts.numel(), 1) * heads, dtype=torch.float32)
    rc = lib.longctx_int8_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                                   k.data_ptr(), v.data_ptr(), slots.data_ptr(), slots.numel(), starts.data_ptr(),
                                   starts.numel(), k_cache.shape[0], block_size, heads, dim, old.data_ptr())
    if rc != 0:
        raise ValueError(f"int8 write rejected its arguments (code {rc}"
                         f"{': a slot outside the cache or a start outside the rows' if rc == -2 else ''})")


FLOAT_PAGES = {torch.float32: 0, torch.bfloat16: 1}  # write_kv's cache dtypes, as the C code numbers them


def takes_float_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``write_float_kv`` takes these: the library here, contiguous float32 or bfloat16
    caches [NB, BS, Hkv, D] of one shape and dtype, float32 k and v [T, Hkv, D] on the CPU whose
    heads are contiguous within each row (rows may be strided: views of a fused qkv row)."""
    if not (available() and k_cache.dtype in FLOAT_PAGES and v_cache.dtype == k_cache.dtype
            and k_cache.device.type == "cpu" and v_cache.device.type == "cpu" and k_cache.dim() == 4
            and v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3
               and tuple(t.shape[1:]) == (heads, dim) and t.stride(2) == 1 and t.stride(1) == dim
               and (t.shape[0] <= 1 or t.stride(0) >= heads * dim) for t in (k, v)) and k.shape[0] == v.shape[0]


def _write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              threads: int) -> None:
    if not takes_float_write(k_cache, v_cache, k, v):
        raise ValueError(f"write_kv needs the decode library ({status()}), contiguous float32 or bfloat16 caches "
                         f"[NB, BS, Hkv, D] of one shape and float32 k, v [T, Hkv, D] with contiguous heads, got "
                         f"caches {k_cache.dtype} {tuple(k_cache.shape)} / {v_cache.dtype} {tuple(v_cache.shape)}, "
                         f"k {k.dtype} {tuple(k.shape)} {k.stride()}, v {v.dtype} {tuple(v.shape)} {v.stride()}")
    _meta("slots", slots, 1, torch.int64)
    if slots.shape[0] != k.shape[0] or threads < 1:
        raise ValueError(f"write_kv needs a slot per row ({k.shape[0]}, got {slots.shape[0]}) and threads >= 1")
    rc = _load().longctx_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), FLOAT_PAGES[k_cache.dtype], k.data_ptr(),
                                  k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), slots.numel(),
                                  k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3], threads)
    if rc != 0:
        raise ValueError(f"write_kv rejected its arguments (code {rc}"
                         f"{': a slot outside the cache' if rc == -2 else ''})")


write_kv = cpu_build.define_op(
    "write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots, int threads) -> ()",
    _write_kv)


def write_float_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] float32 into float32 or bfloat16 pages at ``slots`` (int64 [T], < 0
    skipped), in one C pass (the operator ``torch.ops.longctx.write_kv``): the bytes
    ``index_copy_`` of ``k.to(cache dtype)`` writes (a NaN becomes torch's scalar form's
    0x7FC0). The caller checks ``takes_float_write``."""
    write_kv(k_cache, v_cache, k, v, slots.contiguous(), torch.get_num_threads())


def write_int8_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> bool:
    """``kv_quant.write_int8`` for K and V in one C call (same bytes), through the operator
    ``torch.ops.longctx.int8_write_kv``; False when the library is not available here (the
    caller then runs the torch form). slots/starts int64 [T]/[R]."""
    if not available():
        return False
    int8_write_kv(k_cache, v_cache, k_scale, v_scale, k.to(torch.float32).contiguous(),
                  v.to(torch.float32).contiguous(), slots.contiguous(), starts.contiguous())
    return True


# By CPU vendor: Intel CPUs ask for the next tile's rows spread over the tile's work (the C file's
# SPREAD_AHEAD) at every level, where the AVX-512 build otherwise asks per KV head. On an Intel
# Xeon (family 6 model 207) that took 30 layers of the 135M model's caches at 4K from 18.3 to
# 15.8 ms (float32) and 15.9 to 13.8 (bfloat16), the 1B model's 16 layers 22.9 -> 19.6 and 18.7
# -> 15.6 (the C file has the method); AMD's AVX-512 CPUs (Zen 4) were measured with the
# per-head form only.
VENDOR_FLAGS = {"GenuineIntel": ("-DSPREAD_AHEAD=1",)}

_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare, extra_flags=cpu_build.vendor_flags(VENDOR_FLAGS))
_load = _LIBRARY.load
available = _LIBRARY.available  # whether the kernel runs here
status = _LIBRARY.status  # 'ok', or why the kernel is not used


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``attend`` takes these shapes and dtypes (the caller then uses it): float32,
    bfloat16 and int8 caches (int8 with their scales, see ``attend``)."""
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.is_contiguous()
            and 1 <= q_len <= MAX_Q and head_dim <= MAX_HEAD_DIM and num_heads % num_kv == 0
            and q_len * (num_heads // num_kv) <= MAX_ROWS and available())


class Blocks(NamedTuple):
    """A sequence's block table checked against one cache geometry (``prepare``), so a step's
    layers can share it: ``attend`` then skips the per-call checks and conversion."""

    table: torch.Tensor  # [needed] int32
    ctx_len: int
    num_blocks: int
    block_size: int


def prepare(blocks: list[int], ctx_len: int, k_cache: torch.Tensor) -> Blocks:
    """Check ``blocks`` for a ``ctx_len``-token sequence in ``k_cache``'s pages; keep what
    ``attend`` needs."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    needed = (ctx_len + block_size - 1) // block_size
    if len(blocks) < needed:
        raise ValueError(f"{ctx_len} tokens need {needed} blocks, got {len(blocks)}")
    used = blocks[:needed]
    if used and not (0 <= min(used) and max(used) < num_blocks):
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {min(used)}..{max(used)}")
    return Blocks(torch.tensor(used, dtype=torch.int32), ctx_len, num_blocks, block_size)


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
    """int8 caches need both scales, contiguous float32 [NB, Hkv] tensors on the cache's device
    (``kv_quant.py``); float caches take none. Raises ValueError otherwise."""
    if k_cache.dtype != torch.int8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for int8 caches only, not {k_cache.dtype}")
        return
    if k_scale is None or v_scale is None:
        raise ValueError("int8 KV caches need k_scale and v_scale (float32 [num_blocks, num_kv_heads])")
    shape = (k_cache.shape[0], k_cache.shape[2])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() \
                or t.device != k_cache.device:
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape} "
                             f"([num_blocks, num_kv_heads]), got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def checked_arguments(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      blocks: list[int] | Blocks, ctx_len: int, out: torch.Tensor | None,
                      lse: torch.Tensor | None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> tuple[Blocks, torch.Tensor, torch.Tensor]:
    """The checks a compiled attention kernel's caller makes before handing it pointers (shared
    with ``cpu_flash``): one cache geometry for K and V, the scales of an int8 cache
    (``check_scales``), ``blocks`` prepared (or checked against this cache and length),
    ``out`` [L, H, D] / ``lse`` [L, H] contiguous float32 or made here."""
    q_len, num_heads, head_dim = q.shape
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous with one shape and dtype")
    check_scales(k_cache, k_scale, v_scale)
    if not isinstance(blocks, Blocks):
        blocks = prepare(blocks, ctx_len, k_cache)
    elif (blocks.ctx_len, blocks.num_blocks, blocks.block_size) != (ctx_len, *k_cache.shape[:2]):
        raise ValueError(f"blocks were prepared for {blocks.ctx_len} tokens in a cache of "
                         f"{blocks.num_blocks} x {blocks.block_size}, not {ctx_len} in "
                         f"{k_cache.shape[0]} x {k_cache.shape[1]}")
    for name, t, shape in (("out", out, (q_len, num_heads, head_dim)), ("lse", lse, (q_len, num_heads))):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    out = torch.empty(q_len, num_heads, head_dim, dtype=torch.float32) if out is None else out
    lse = torch.empty(q_len, num_heads, dtype=torch.float32) if lse is None else lse
    return blocks, out, lse


class Tables(NamedTuple):
    """A step's sequences as the batch kernels take them (``batch_tables``): the block table
    int32 [B, W], context lengths int32 [B] and query offsets ``cu_q`` int32 [B + 1], all
    contiguous on the CPU. The kernels check each sequence they read against them and the cache
    (block ids inside the cache, query rows inside q)."""

    block_table: torch.Tensor
    ctx_lens: torch.Tensor
    cu_q: torch.Tensor


def batch_tables(block_table: torch.Tensor | list[list[int]], ctx_lens: torch.Tensor | list[int],
                 cu_q: torch.Tensor | list[int]) -> Tables:
    """``Tables`` from a step's metadata (tensors or lists; ragged table rows are padded)."""
    if isinstance(block_table, list):
        width = max((len(r) for r in block_table), default=0)
        block_table = torch.tensor([r + [0] * (width - len(r)) for r in block_table], dtype=torch.int32)
    t = Tables(*(torch.as_tensor(x).to(device="cpu", dtype=torch.int32).contiguous()
                 for x in (block_table, ctx_lens, cu_q)))
    rows = t.ctx_lens.shape[0]
    if t.block_table.dim() != 2 or t.block_table.shape[0] != rows or tuple(t.cu_q.shape) != (rows + 1,):
        raise ValueError(f"block_table [B, W], ctx_lens [B] and cu_q [B + 1] disagree: "
                         f"{tuple(t.block_table.shape)}, {tuple(t.ctx_lens.shape)}, {tuple(t.cu_q.shape)}")
    return t


def _meta(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype = torch.int32) -> None:
    if t.dtype != dtype or t.dim() != dim or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor with {dim} dims, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _layout_ok(t: torch.Tensor, dtype: torch.dtype, dim: int) -> bool:
    return t.dtype == dtype and t.dim() == dim and t.is_cpu and t.is_contiguous()


def q_rows_ok(q: torch.Tensor) -> bool:
    """Whether q is a float32 [T, H, D] CPU tensor whose token rows may lie apart (a view of a
    wider projection's rows: the flash kernel takes their stride, ``q_row_stride``) but whose
    heads and values are packed within a row. The stride of a dimension of size 1 does not
    matter (as for ``is_contiguous``)."""
    if not (q.dtype == torch.float32 and q.dim() == 3 and q.is_cpu):
        return False
    total, heads, dim = q.shape
    return ((dim <= 1 or q.stride(2) == 1) and (heads <= 1 or q.stride(1) == dim)
            and (total <= 1 or q.stride(0) >= heads * dim))


def q_row_stride(q: torch.Tensor) -> int:
    """The floats from one token's row of q to the next's as the flash kernel takes it (H * D
    where q has one row, whatever torch says its stride is)."""
    return q.stride(0) if q.shape[0] > 1 else q.shape[1] * q.shape[2]


def check_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_table: torch.Tensor,
                ctx_lens: torch.Tensor, cu_q: torch.Tensor, seqs: torch.Tensor,
                words: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, strided_q: bool = False) -> None:
    """The checks a batch kernel's operator makes before handing pointers to C (shared with
    ``cpu_flash``): every tensor's dtype, shape and layout. What depends on the values (block
    ids, query offsets, lengths) the C side checks per sequence it reads. A first pass tests
    everything at once (it runs once per layer); only a failure spells out what was wrong.
    ``strided_q``: q's token rows may lie apart (``q_rows_ok``; the flash kernel)."""
    f32, i32 = torch.float32, torch.int32
    shape, kshape = q.shape, k_cache.shape
    q_ok = q_rows_ok(q) if strided_q else _layout_ok(q, f32, 3)
    if (q_ok and k_cache.dtype in DTYPES and k_cache.dim() == 4 and k_cache.is_cpu and k_cache.is_contiguous()
            and v_cache.dtype == k_cache.dtype and v_cache.shape == kshape and v_cache.is_cpu and v_cache.is_contiguous() and kshape[3] == shape[2] and shape[1] % kshape[2] == 0
            and (k_cache.dtype == torch.int8) == (k_scale is not None) and (k_scale is None) == (v_scale is None)
            and _layout_ok(block_table, i32, 2) and _layout_ok(ctx_lens, i32, 1) and _layout_ok(cu_q, i32, 1)
            and _layout_ok(seqs, i32, 1) and block_table.shape[0] == ctx_lens.shape[0] == cu_q.shape[0] - 1
            and (words is None or (_layout_ok(words, torch.int64, 1) and words.shape[0] == shape[0]))
            and out.dtype == f32 and out.shape == shape and out.is_contiguous()
            and lse.dtype == f32 and lse.shape == shape[:2] and lse.is_contiguous()):
        if k_scale is not None:
            check_scales(k_cache, k_scale, v_scale)
        return
    _explain_batch(q, k_cache, v_cache, k_scale, v_scale, block_table, ctx_lens, cu_q, seqs, words, out, lse,
                   strided_q)
    raise ValueError("the batch kernel's arguments are not as it takes them (see cpu_decode.check_batch)")


def _explain_batch(q, k_cache, v_cache, k_scale, v_scale, block_table, ctx_lens, cu_q, seqs, words, out,
                   lse, strided_q: bool = False) -> None:
    """check_batch's failure: raise ValueError saying which argument is wrong."""
    if not (q_rows_ok(q) if strided_q else _layout_ok(q, torch.float32, 3)):
        raise ValueError(f"q must be a float32 [T, H, D] CPU tensor with each token's heads packed (strides "
                         f"(>= H * D, D, 1)), got {q.dtype} {tuple(q.shape)} strides {q.stride()}" if strided_q else
                         f"q must be a contiguous float32 [T, H, D] CPU tensor, got {q.dtype} {tuple(q.shape)}")
    total, num_heads, head_dim = q.shape
    if (k_cache.dim() != 4 or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype
            or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"):
        raise ValueError(f"k_cache and v_cache must be contiguous CPU [NB, BS, Hkv, D] caches of one shape and a "
                         f"dtype in {list(DTYPES)}, got {k_cache.dtype} {tuple(k_cache.shape)} and "
                         f"{v_cache.dtype} {tuple(v_cache.shape)}")
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"q [T, H, D] {tuple(q.shape)} does not fit the cache's [NB, BS, Hkv, D] "
                         f"{tuple(k_cache.shape)} (same D, H a multiple of Hkv)")
    check_scales(k_cache, k_scale, v_scale)
    _meta("block_table", block_table, 2)
    _meta("ctx_lens", ctx_lens, 1)
    _meta("cu_q", cu_q, 1)
    _meta("seqs", seqs, 1)
    if block_table.shape[0] != ctx_lens.shape[0] or cu_q.shape[0] != ctx_lens.shape[0] + 1:
        raise ValueError(f"block_table [B, W], ctx_lens [B] and cu_q [B + 1] disagree: "
                         f"{tuple(block_table.shape)}, {tuple(ctx_lens.shape)}, {tuple(cu_q.shape)}")
    if words is not None:
        _meta("words", words, 1, torch.int64)
        if words.shape[0] != total:
            raise ValueError(f"words must hold one int64 per query row ({total}), got {tuple(words.shape)}")
    for name, t, shape in (("out", out, (total, num_heads, head_dim)), ("lse", lse, (total, num_heads))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")


def call_batch(kernel: str, fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_table: torch.Tensor,
               ctx_lens: torch.Tensor, cu_q: torch.Tensor, seqs: torch.Tensor, words: torch.Tensor | None,
               scale: float, num_threads: int, out: torch.Tensor, lse: torch.Tensor, *,
               splits: torch.Tensor | None = None, split_tokens: int | None = None,
               window: int = 0, softcap: float = 0.0, rounded: torch.Tensor | None = None) -> None:
    """Check a batch kernel's arguments (``check_batch``) and call its C entry ``fn`` with the
    signature both share (see ``BATCH_HEAD``): ``splits`` for the flash kernel, ``split_tokens``
    for the decode kernel; ``window``/``softcap``: a sliding window and a score cap (0: none;
    see the C files); ``rounded``: the flash kernel's rows rounded for the AMX products instead
    of ``out`` (``cpu_flash.attend_batch``). A code the C side returns becomes a ValueError
    naming ``kernel``."""
    check_batch(q, k_cache, v_cache, k_scale, v_scale, block_table, ctx_lens, cu_q, seqs, words, out, lse,
                strided_q=splits is not None)
    if rounded is not None and not (splits is not None
                                    and cpu_amx.is_rounded_buffer(rounded, q.shape[0], q.shape[1] * q.shape[2])):
        raise ValueError(f"{kernel}: rounded must be a contiguous bfloat16 [{cpu_amx.padded_rows(q.shape[0])}, "
                         f"{q.shape[1] * q.shape[2]}] (the step's rows to a multiple of 16, H * D) for the flash "
                         f"kernel, got {rounded.dtype} {tuple(rounded.shape)}")
    head = [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
            DTYPES[k_cache.dtype], block_table.data_ptr(), block_table.shape[0], block_table.shape[1],
            k_cache.shape[0], ctx_lens.data_ptr(), cu_q.data_ptr(), q.shape[0], seqs.data_ptr()]
    if splits is not None:  # the flash kernel: its splits, and q's row stride (its rows may lie apart)
        head += [splits.data_ptr(), q_row_stride(q)]
    shape = [seqs.shape[0], k_cache.shape[1], q.shape[1], k_cache.shape[2], q.shape[2], scale,
             None if words is None else words.data_ptr(), window, softcap]
    tail = [num_threads, out.data_ptr(), lse.data_ptr()]
    if splits is not None:
        tail.append(None if rounded is None else rounded.data_ptr())
    rc = fn(*head, *shape, *([] if split_tokens is None else [split_tokens]), *tail)
    if rc != 0:
        raise ValueError(f"{kernel} rejected its arguments (code {rc}: {ERRORS.get(rc, 'unknown')}): "
                         f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)} {k_cache.dtype}")


def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                  cu_q: torch.Tensor, seqs: torch.Tensor, words: torch.Tensor | None, scale: float,
                  split_tokens: int, num_threads: int, out: torch.Tensor, lse: torch.Tensor,
                  window: int = 0, softcap: float = 0.0) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is {status()}")
    call_batch("paged_decode", lib.longctx_paged_decode_batch, q, k_cache, v_cache, k_scale, v_scale, block_table,
               ctx_lens, cu_q, seqs, words, scale, num_threads, out, lse, split_tokens=split_tokens,
               window=window, softcap=softcap)


paged_decode = cpu_build.define_op(
    "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
    "Tensor block_table, Tensor ctx_lens, Tensor cu_q, Tensor seqs, Tensor? words, float scale, "
    "int split_tokens, int num_threads, Tensor(a!) out, Tensor(b!) lse, int window=0, float softcap=0.0) -> ()",
    _paged_decode)
int8_write_kv = cpu_build.define_op(
    "int8_write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor k, "
    "Tensor v, Tensor slots, Tensor starts) -> ()", _int8_write_kv)


def _tail_exchange(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, old_k: torch.Tensor | None,
                   old_v: torch.Tensor | None, store_k: torch.Tensor,
                   store_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool_slots: torch.Tensor,
                   store_rows: torch.Tensor, new_rows: torch.Tensor, cached: torch.Tensor, q_rows: torch.Tensor,
                   visible: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, write_rows: torch.Tensor,
                   groups: int, qw: int, kw: int, scale: float, num_threads: int) -> None:
    step = tail_step_args(pool_slots, store_rows, new_rows, cached, q_rows, visible, src, dst, write_rows,
                          groups, qw, kw, q.shape[0])
    tail_exchange_layer(step, q, out, lse, k_cache, v_cache, k_scale, v_scale, old_k, old_v, store_k, store_v,
                        k, v, scale, num_threads)


class TailStepArgs(NamedTuple):
    """A step's part of ``tail_exchange``'s arguments, checked (``tail_step_args``)."""

    pointers: tuple[int, ...]  # pool_slots, store_rows, new_rows, cached, q_rows, visible, src, dst
    n_out: int  # result rows (src's length)
    groups: int
    qw: int
    kw: int
    write_rows: int  # its pointer
    total_q: int  # the step's query rows
    tensors: tuple  # what the pointers point into, kept alive with them


def tail_step_args(pool_slots: torch.Tensor, store_rows: torch.Tensor, new_rows: torch.Tensor, cached: torch.Tensor,
                   q_rows: torch.Tensor, visible: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   write_rows: torch.Tensor, groups: int, qw: int, kw: int, total_q: int) -> TailStepArgs:
    """A step's part of ``tail_exchange``'s arguments (the same in every layer), checked once:
    what ``tail_exchange_layer`` takes. The C side checks every index it reads."""
    keys, i64 = groups * kw, torch.int64
    for name, t, dtype, n in (("pool_slots", pool_slots, i64, keys), ("store_rows", store_rows, i64, keys),
                              ("new_rows", new_rows, i64, keys), ("q_rows", q_rows, i64, groups * qw),
                              ("write_rows", write_rows, i64, total_q), ("dst", dst, i64, src.numel()),
                              ("src", src, i64, 0), ("cached", cached, torch.bool, keys),
                              ("visible", visible, torch.bool, keys * qw)):
        if t.dtype != dtype or not t.is_contiguous() or t.numel() < n or t.device.type != "cpu":
            raise ValueError(f"tail_exchange: {name} must be a contiguous {dtype} CPU tensor of at least {n} "
                             f"values, got {t.dtype} {tuple(t.shape)}")
    tensors = (pool_slots, store_rows, new_rows, cached, q_rows, visible, src, dst)
    return TailStepArgs(tuple(t.data_ptr() for t in tensors), src.numel(), groups, qw, kw, write_rows.data_ptr(),
                        total_q, (*tensors, write_rows))


def tail_exchange_layer(step: TailStepArgs, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                        old_k: torch.Tensor | None, old_v: torch.Tensor | None, store_k: torch.Tensor,
                        store_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        num_threads: int) -> None:
    """One layer's ``tail_exchange`` with the step's arguments ``tail_step_args`` made: this
    layer's tensors checked (each dtype and layout in one pass; only a failure spells out
    which), then the C call."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is {status()}")
    groups, kw, total_q = step.groups, step.kw, step.total_q
    num_blocks, bs, num_kv, d = k_cache.shape
    f32 = torch.float32
    layer = (q, out, lse, store_k, store_v, k, v)
    if not (all(t.dtype == f32 and t.is_contiguous() for t in layer) and k_cache.dtype == v_cache.dtype == torch.int8
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.shape[0] == total_q == k.shape[0]
            and v_cache.shape == k_cache.shape and store_k.shape == store_v.shape
            and tuple(store_k.shape[1:]) == (num_kv, d) and k.shape == v.shape and tuple(k.shape[1:]) == (num_kv, d)
            and q.shape[1:] == out.shape[1:] and tuple(lse.shape) == tuple(out.shape[:2])):
        _explain_tail_layer(q, out, lse, k_cache, v_cache, store_k, store_v, k, v, total_q)
    check_scales(k_cache, k_scale, v_scale)
    if (old_k is None) != (old_v is None):
        raise ValueError("tail_exchange: give both old_k and old_v, or neither")
    for name, t in (("old_k", old_k), ("old_v", old_v)):
        if t is not None and (t.dtype != f32 or not t.is_contiguous() or t.numel() < groups * kw * num_kv * d):
            raise ValueError(f"tail_exchange: {name} must be a contiguous float32 [G * Kw, Hkv, D], got "
                             f"{t.dtype} {tuple(t.shape)}")
    rc = lib.longctx_tail_exchange(
        q.data_ptr(), total_q, out.data_ptr(), lse.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr(), v_scale.data_ptr(), None if old_k is None else old_k.data_ptr(),
        None if old_v is None else old_v.data_ptr(), num_blocks, bs, q.shape[1], num_kv, d, store_k.data_ptr(),
        store_v.data_ptr(), store_k.shape[0], k.data_ptr(), v.data_ptr(), *step.pointers, step.n_out, out.shape[0],
        groups, step.qw, kw, step.write_rows, scale, num_threads)
    if rc != 0:
        raise ValueError(f"tail_exchange rejected its arguments (code {rc}: "
                         f"{ {-1: 'a shape out of range', -2: 'an index outside its tensor', -4: 'out of memory'}.get(rc)})")


def _explain_tail_layer(q, out, lse, k_cache, v_cache, store_k, store_v, k, v, total_q) -> None:
    """tail_exchange_layer's failure: raise ValueError saying what is wrong."""
    for name, t in (("q", q), ("out", out), ("lse", lse), ("store_k", store_k), ("store_v", store_v), ("k", k),
                    ("v", v)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"tail_exchange: {name} must be a contiguous float32 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.int8 or not t.is_contiguous():
            raise ValueError(f"tail_exchange: {name} must be a contiguous int8 cache, got {t.dtype} {tuple(t.shape)}")
    if q.shape[0] != total_q or k.shape[0] != total_q:
        raise ValueError(f"tail_exchange: q and k must have the step's {total_q} rows, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    raise ValueError("tail_exchange: q, out, lse, k, v and the store do not fit the caches' [Hkv, D]")


tail_exchange = cpu_build.define_op(
    "tail_exchange(Tensor q, Tensor(a!) out, Tensor(b!) lse, Tensor k_cache, Tensor v_cache, Tensor k_scale, "
    "Tensor v_scale, Tensor? old_k, Tensor? old_v, Tensor(c!) store_k, Tensor(d!) store_v, Tensor k, Tensor v, Tensor pool_slots, "
    "Tensor store_rows, Tensor new_rows, Tensor cached, Tensor q_rows, Tensor visible, Tensor src, Tensor dst, "
    "Tensor write_rows, int groups, int qw, int kw, float scale, int num_threads) -> ()", _tail_exchange)
tail_exchange.__doc__ = """``torch.ops.longctx.tail_exchange``: ``exact_tail.TailStep.exchange`` and
``keep`` in one call on the CPU (int8 caches, float32 everything else): the int8 rows of each
result row's visible tail keys swapped for their exact rows in ``out``/``lse``, then the step's
exact rows written into the store. ``old_k``/``old_v``: the int8 rows already read (float32
[G * Kw, Hkv, D]: a sequence-parallel rank's, gathered from the ranks holding them), else the
caches are read."""
paged_decode.__doc__ = """``torch.ops.longctx.paged_decode``: a step's varlen batch through the decode kernel,
written into ``out``/``lse`` (the rows of the sequences ``seqs``). See ``attend_batch``."""


def attend_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: Tables,
                 seqs: torch.Tensor, scale: float, words: torch.Tensor | None = None, *,
                 out: torch.Tensor, lse: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, split_tokens: int = SPLIT_TOKENS,
                 num_threads: int | None = None, window: int | None = None,
                 softcap: float | None = None) -> None:
    """The sequences ``seqs`` (int32 indices into ``tables``) of a step in one call: q [T, H, D]
    float32 holds every sequence's new tokens (``tables.cu_q``), the last ``q_len`` of its
    ``ctx_len``; their rows of ``out`` [T, H, D] / ``lse`` [T, H] (contiguous float32) are
    written. ``words`` [T] int64: bit j of a row's word lets it see new token j of its
    sequence (None: causal among the new tokens). int8 caches need ``k_scale``/``v_scale``.
    ``num_threads``: OpenMP threads (default torch's count). At most ``MAX_Q`` new tokens and
    ``MAX_ROWS`` rows per KV head per sequence. ``window``/``softcap``: a sliding window and
    a score cap (``reference.py``'s conventions; with ``words`` the window must be >= 64)."""
    paged_decode(q, k_cache, v_cache, k_scale, v_scale, tables.block_table, tables.ctx_lens, tables.cu_q,
                 seqs, words, scale, split_tokens, torch.get_num_threads() if num_threads is None else num_threads,
                 out, lse, window or 0, softcap or 0.0)


def single(q: torch.Tensor, blocks: Blocks, words: torch.Tensor | None,
           all_visible: bool) -> tuple[Tables, torch.Tensor, torch.Tensor | None]:
    """One sequence as a batch of one (``attend``): its tables, ``seqs`` and words (with
    ``all_visible``, None becomes words that let every new token see every other)."""
    q_len = q.shape[0]
    tables = Tables(blocks.table.view(1, -1), torch.tensor([blocks.ctx_len], dtype=torch.int32),
                    torch.tensor([0, q_len], dtype=torch.int32))
    if words is None and all_visible and q_len > 1:
        words = torch.full((q_len,), (1 << q_len) - 1, dtype=torch.int64)
    elif words is not None:
        words = words.to(torch.int64).contiguous()
    return tables, torch.zeros(1, dtype=torch.int32), words


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           blocks: list[int] | Blocks, ctx_len: int, scale: float,
           tail_words: torch.Tensor | None = None, split_tokens: int = SPLIT_TOKENS, *,
           out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
           k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, H, D] (the last L tokens of a ``ctx_len``-token sequence whose pages are
    ``blocks``, a list of ids or ``prepare``'s result) -> (out [L, H, D] in q's dtype, lse
    [L, H] fp32). ``tail_words`` [L] int64: bit j of word i lets query i see new token j
    (None: all of them). ``out``/``lse``: contiguous float32 tensors of those shapes to write
    into. int8 caches (``kv_quant.py``): ``k_scale``/``v_scale`` contiguous float32
    [NB, Hkv], required (ValueError without them). Check ``supports`` first."""
    if not available():
        raise RuntimeError(f"the CPU decode kernel is {status()}")
    blocks, out, lse = checked_arguments(q, k_cache, v_cache, blocks, ctx_len, out, lse,
                                         k_scale, v_scale)
    tables, seqs, words = single(q, blocks, tail_words, all_visible=True)
    attend_batch(q.float().contiguous(), k_cache, v_cache, tables, seqs, scale, words, out=out, lse=lse,
                 k_scale=k_scale, v_scale=v_scale, split_tokens=split_tokens)
    return out.to(q.dtype), lse

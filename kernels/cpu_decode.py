"""The CPU decode-attention kernel (``csrc/paged_decode.c``): built on first use, called
through ctypes.

Owns: loading the C source's library (``cpu_build.py`` compiles and caches it) and
``attend``: a few new tokens of one sequence against its pages, ``(out, lse)`` with the
conventions of ``reference.py``. Never: choosing when to use it (``torch_paged`` does), or
failing a run: with no compiler, a failed build or ``LONGCTX_CPU_KERNEL=0`` it reports itself
unavailable (``status()`` says why) and the torch path runs instead.

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

from . import cpu_build

__all__ = ["available", "status", "attend", "prepare", "checked_arguments", "check_scales", "Blocks",
           "MAX_ROWS", "SPLIT_TOKENS"]

SOURCE = cpu_build.CSRC / "paged_decode.c"
MAX_ROWS = 128  # query rows per KV head (q_len * group); the C file's MAX_ROWS
MAX_HEAD_DIM = 256
MAX_Q = 63  # tree-mask words hold 63 new tokens
SPLIT_TOKENS = 512  # tokens per work item: enough items for the threads, few merges
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # int8: pages of kv_quant.py


# The C signature both attention kernels share (paged_decode.c, paged_flash.c): q, k_cache,
# v_cache, k_scale, v_scale (int8 caches; NULL otherwise), dtype, blocks, block_size, ctx_len,
# q_len, num_heads, num_kv, d, scale, tail_words, split_tokens / num_splits, work, out, lse.
ATTENTION_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                      ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.longctx_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ATTENTION_ARGTYPES
    write = lib.longctx_int8_write_kv
    write.restype = ctypes.c_int
    write.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


def write_int8_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> bool:
    """``kv_quant.write_int8`` for K and V in one C call (same bytes); False when the library
    is not available here (the caller then runs the torch form). slots/starts int64 [T]/[R]."""
    lib = _load()
    if lib is None:
        return False
    k = k.to(torch.float32).contiguous()
    v = v.to(torch.float32).contiguous()
    slots, starts = slots.contiguous(), starts.contiguous()
    _, block_size, heads, dim = k_cache.shape
    old = torch.empty(max(starts.numel(), 1) * heads, dtype=torch.float32)
    rc = lib.longctx_int8_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                                   k.data_ptr(), v.data_ptr(), slots.data_ptr(), slots.numel(), starts.data_ptr(),
                                   starts.numel(), block_size, heads, dim, old.data_ptr())
    if rc != 0:
        raise ValueError(f"int8 write rejected its arguments (code {rc})")
    return True


_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare)
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
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU decode kernel is {status()}")
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    blocks, out, lse = checked_arguments(q, k_cache, v_cache, blocks, ctx_len, out, lse,
                                         k_scale, v_scale)
    qf = q.float().contiguous()
    words = None if tail_words is None else tail_words.to(torch.int64).contiguous()
    rows = q_len * (num_heads // num_kv)
    num_splits = (ctx_len + split_tokens - 1) // split_tokens
    all_rows = num_kv * rows
    work = torch.empty(all_rows * head_dim + num_splits * all_rows * (head_dim + 2), dtype=torch.float32)
    rc = lib.longctx_paged_decode(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(), DTYPES[k_cache.dtype],
        blocks.table.data_ptr(), blocks.block_size, ctx_len, q_len, num_heads, num_kv, head_dim,
        scale, None if words is None else words.data_ptr(), split_tokens, work.data_ptr(),
        out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise ValueError(f"paged_decode rejected its arguments (code {rc}): q {tuple(q.shape)}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}, ctx_len {ctx_len}")
    return out.to(q.dtype), lse

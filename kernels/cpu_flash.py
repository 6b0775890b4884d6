"""The CPU flash-attention kernel for many query rows (``csrc/paged_flash.c``): prefill chunks
and lookahead verification over the pages, built on first use, called through ctypes.

Owns: loading the C source's library (``cpu_build.py`` compiles and caches it), choosing how
many KV splits a step gets, and ``attend``: the new tokens of one sequence against its pages,
``(out, lse)`` with the conventions of ``reference.py``. Never: choosing when to use it
(``torch_paged`` does), or failing a run: with no compiler, a failed build or
``LONGCTX_CPU_KERNEL=0`` it reports itself unavailable (``status()`` says why) and the torch
path runs instead.

Why a compiled kernel: PyTorch's fused CPU flash kernel runs SmolLM2's prefill attention
(head dim 64) at ~100 GFLOP/s here, two thirds of the machine's GEMM rate, and the decode kernel
(``cpu_decode.py``) scores one query row at a time, which is compute-bound once a verification
step has tens of rows. This one scores a block of rows as a small GEMM with vectors along the
rows (see the C file's header).
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_build
from .cpu_decode import ATTENTION_ARGTYPES, DTYPES, Blocks, checked_arguments, prepare

__all__ = ["available", "status", "supports", "attend", "num_splits", "Blocks", "prepare"]

SOURCE = cpu_build.CSRC / "paged_flash.c"
ROW_BLOCK = 96  # query rows per work item (the C file's RB)
MAX_HEAD_DIM = 256
MAX_TREE_Q = 63  # tree-mask words hold 63 new tokens (reference.py)
SPLIT_MIN_TOKENS = 512  # a KV split is never shorter than this


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.longctx_paged_flash
    fn.restype = ctypes.c_int
    fn.argtypes = ATTENTION_ARGTYPES


_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare)
_load = _LIBRARY.load
available = _LIBRARY.available  # whether the kernel runs here
status = _LIBRARY.status  # 'ok', or why the kernel is not used


def supports(q: torch.Tensor, k_cache: torch.Tensor, tree: bool = False) -> bool:
    """Whether ``attend`` takes these shapes and dtypes (the caller then uses it): float32,
    bfloat16 and int8 caches (int8 with their scales, see ``attend``)."""
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.is_contiguous()
            and q_len >= 1 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv == 0
            and (not tree or q_len <= MAX_TREE_Q) and available())


def num_splits(q_len: int, group: int, num_kv: int, ctx_len: int) -> int:
    """KV splits for a step: enough work items to keep torch's threads busy when the rows alone
    give few (verification), none when they give plenty (a prefill chunk)."""
    items = num_kv * -(-q_len * group // ROW_BLOCK)
    threads = torch.get_num_threads()
    if items >= 4 * threads:
        return 1
    splits = -(-4 * threads // items)
    while (items * splits) % threads:  # every thread gets the same number of items
        splits += 1
    return max(1, min(splits, ctx_len // SPLIT_MIN_TOKENS))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           blocks: list[int] | Blocks, ctx_len: int, scale: float,
           tree_words: torch.Tensor | None = None, splits: int | None = None, *,
           out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
           k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, H, D] (the last L tokens of a ``ctx_len``-token sequence whose pages are
    ``blocks``, a list of ids or ``prepare``'s result) -> (out [L, H, D] in q's dtype, lse
    [L, H] fp32). The new tokens see each other causally, or with ``tree_words`` [L] int64 bit j
    of word i lets query i see new token j. ``splits``: KV splits (default ``num_splits``).
    ``out``/``lse``: contiguous float32 tensors of those shapes to write into. int8 caches
    (``kv_quant.py``): ``k_scale``/``v_scale`` contiguous float32 [NB, Hkv], required
    (ValueError without them). Check ``supports`` first."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU flash kernel is {status()}")
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    if tree_words is not None and tuple(tree_words.shape) != (q_len,):
        raise ValueError(f"tree_words must have shape ({q_len},), got {tuple(tree_words.shape)}")
    blocks, out, lse = checked_arguments(q, k_cache, v_cache, blocks, ctx_len, out, lse,
                                         k_scale, v_scale)
    group = num_heads // num_kv
    splits = num_splits(q_len, group, num_kv, ctx_len) if splits is None else splits
    qf = q.float().contiguous()
    words = None if tree_words is None else tree_words.to(torch.int64).contiguous()
    work = torch.empty(splits * num_kv * q_len * group * (head_dim + 2) if splits > 1 else 0,
                       dtype=torch.float32)
    rc = lib.longctx_paged_flash(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(), DTYPES[k_cache.dtype],
        blocks.table.data_ptr(), blocks.block_size, ctx_len, q_len, num_heads, num_kv, head_dim,
        scale, None if words is None else words.data_ptr(), splits, work.data_ptr(),
        out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise ValueError(f"paged_flash rejected its arguments (code {rc}): q {tuple(q.shape)}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}, ctx_len {ctx_len}, "
                         f"splits {splits}")
    return out.to(q.dtype), lse

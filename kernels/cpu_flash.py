"""The CPU flash-attention kernel for many query rows (``csrc/paged_flash.c``): prefill chunks
and lookahead verification over the pages, built on first use, called through ctypes,
registered as the torch operator ``longctx::paged_flash``.

Owns: loading the C source's library (``cpu_build.py`` compiles and caches it), choosing how
many KV splits a sequence gets, the operator (a step's whole varlen batch per call, the thread
count passed in; a fake implementation for ``torch.compile``), ``attend_batch`` and ``attend``
(one sequence): the new tokens against their pages, ``(out, lse)`` with the conventions of
``reference.py``. Never: choosing when to use it
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
import os

import torch

from . import cpu_amx, cpu_build
from .cpu_decode import (BATCH_HEAD, BATCH_SHAPE, BATCH_TAIL, DTYPES, Blocks, Tables, call_batch, checked_arguments,
                         prepare, single)

__all__ = ["available", "status", "amx_status", "supports", "attend", "attend_batch", "num_splits", "Blocks",
           "prepare", "writes_rounded", "rounds_bf16"]

SOURCE = cpu_build.CSRC / "paged_flash.c"
ROW_BLOCK = 96  # query rows per work item (the C file's RB; the AMX build's: row_block)
MAX_HEAD_DIM = 256
MAX_TREE_Q = 63  # tree-mask words hold 63 new tokens (reference.py)
SPLIT_MIN_TOKENS = 512  # a KV split is never shorter than this


def _declare(lib: ctypes.CDLL) -> None:
    lib.longctx_flash_row_block.restype = ctypes.c_int
    lib.longctx_flash_row_block.argtypes = []
    fn = lib.longctx_paged_flash_batch
    fn.restype = ctypes.c_int
    fn.argtypes = [*BATCH_HEAD, ctypes.c_void_p, ctypes.c_int64, *BATCH_SHAPE, *BATCH_TAIL,  # splits, q's row stride
                   ctypes.c_void_p]  # out_rounded
    lib.longctx_flash_rounds_out.restype = ctypes.c_int
    lib.longctx_flash_rounds_out.argtypes = []
    lib.longctx_flash_set_bf16_dot.restype = ctypes.c_int
    lib.longctx_flash_set_bf16_dot.argtypes = [ctypes.c_int]
    lib.longctx_flash_bf16_dot.restype = ctypes.c_int
    lib.longctx_flash_bf16_dot.argtypes = []


def _declare_amx(lib: ctypes.CDLL) -> None:
    _declare(lib)
    lib.longctx_flash_amx_enable.restype = ctypes.c_int
    lib.longctx_flash_amx_enable.argtypes = []
    rc = lib.longctx_flash_amx_enable()
    if rc == -2:
        raise RuntimeError("this build has no AVX-512 BF16 paths (its flags took them away)")
    if rc != 0:  # the process may not use the tiles: a fault at the first one
        raise RuntimeError("the OS refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")


# By CPU vendor: Intel builds score 12 keys and accumulate 12 head-dim columns a pass of their
# AVX-512 float32 products (the C file's QK_KEYS / PV_COLS, default 6 / 6; the same bits), where
# two 512-bit FMA ports leave the loads binding first: ~3% off the float32 flash kernel on an
# Intel Xeon (family 6 model 167; the C file has the figures). AMD's Zen 4 keeps 6 / 6, the
# blocks it was tuned with.
VENDOR_FLAGS = {"GenuineIntel": ("-DQK_KEYS=12", "-DPV_COLS=12")}

def _settle(lib: ctypes.CDLL) -> None:
    from . import cpu_tune  # (it imports cpu_linear, which this module's imports reach)

    cpu_tune.settle_bf16_dot("flash", lib)


# _settle: whether bfloat16 pages take vdpbf16ps (q and p rounded to bfloat16) or are widened to
# float32 for the float32 products, measured on this machine at first use (rounds_bf16 says which)
_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare, extra_flags=cpu_build.vendor_flags(VENDOR_FLAGS),
                                   settle=_settle)
_load = _LIBRARY.load
available = _LIBRARY.available  # whether the kernel runs here
status = _LIBRARY.status  # 'ok', or why the kernel is not used
# The same source built for the AMX tiles (where the CPU has AMX-BF16 and the level is avx512bf16):
# bfloat16 pages' products as tile products, the same numerics (the C file's "AMX" section). Used
# for bfloat16 pages wherever it loads, unless LONGCTX_FLASH_AMX=0 (docs/kernels.md has the figures).
_AMX_LIBRARY = cpu_build.KernelLibrary(SOURCE, _declare_amx, unsupported=cpu_amx.unsupported,
                                       extra_flags=("-mamx-tile", "-mamx-bf16", "-DLONGCTX_AMX"))


def rounds_bf16(k_cache: torch.Tensor) -> bool:
    """Whether bfloat16 pages like ``k_cache`` run by vdpbf16ps here (q and the softmax weights
    rounded to bfloat16, sums float32: the AMX build, or the vector build where ``cpu_tune``
    measured it faster than widening the pages to float32), rather than widened (float32
    products). False for other pages and where the kernel does not run."""
    if k_cache.dtype != torch.bfloat16:
        return False
    lib = _library_for(k_cache)
    if lib is None:
        return False
    return bool(lib.longctx_flash_bf16_dot())


def _amx_switched_off() -> bool:
    return os.environ.get("LONGCTX_FLASH_AMX", "1") == "0"


def amx_status() -> str:
    """'ok' where bfloat16 pages run on the AMX build, or why they do not."""
    return "disabled by LONGCTX_FLASH_AMX=0" if _amx_switched_off() else _AMX_LIBRARY.status()


def _library_for(k_cache: torch.Tensor) -> ctypes.CDLL | None:
    # the AMX build's tiles take head dims that are multiples of 32; it would run others on the
    # vector build's loops, over its larger row blocks
    if k_cache.dtype == torch.bfloat16 and k_cache.shape[-1] % 32 == 0 and not _amx_switched_off():
        lib = _AMX_LIBRARY.load()
        if lib is not None:
            return lib
    return _load()


def supports(q: torch.Tensor, k_cache: torch.Tensor, tree: bool = False) -> bool:
    """Whether ``attend`` takes these shapes and dtypes (the caller then uses it): float32,
    bfloat16 and int8 caches (int8 with their scales, see ``attend``)."""
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.is_contiguous()
            and q_len >= 1 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv == 0
            and (not tree or q_len <= MAX_TREE_Q) and available())


def row_block(k_cache: torch.Tensor) -> int:
    """Query rows per work item of the library that takes this cache (the C file's RB)."""
    lib = _library_for(k_cache)
    return ROW_BLOCK if lib is None else lib.longctx_flash_row_block()


def writes_rounded(k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether ``attend_batch`` can write its rows rounded for the AMX products (``rounded``): the
    library that takes this cache built with AVX-512 BF16, a head dim that is a multiple of 16
    and heads * head dim of 32."""
    lib = _library_for(k_cache)
    d = k_cache.shape[-1]
    return lib is not None and d % 16 == 0 and (num_heads * d) % 32 == 0 and lib.longctx_flash_rounds_out() == 1


def num_splits(q_len: int, group: int, num_kv: int, ctx_len: int, threads: int | None = None,
               rows_per_item: int = ROW_BLOCK) -> int:
    """KV splits for a sequence: enough work items to keep the threads (default torch's) busy
    when the rows alone give few (verification), none when they give plenty (a prefill chunk).
    ``rows_per_item``: the library's ``row_block``."""
    items = num_kv * -(-q_len * group // rows_per_item)
    threads = torch.get_num_threads() if threads is None else threads
    if items >= 4 * threads:
        return 1
    splits = -(-4 * threads // items)
    while (items * splits) % threads:  # every thread gets the same number of items
        splits += 1
    return max(1, min(splits, ctx_len // SPLIT_MIN_TOKENS))


def _paged_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                 cu_q: torch.Tensor, seqs: torch.Tensor, splits: torch.Tensor, words: torch.Tensor | None,
                 scale: float, num_threads: int, out: torch.Tensor, lse: torch.Tensor,
                 window: int = 0, softcap: float = 0.0, rounded: torch.Tensor | None = None) -> None:
    lib = _library_for(k_cache)
    if lib is None:
        raise RuntimeError(f"the CPU flash kernel is {status()}")
    if splits.dtype != torch.int32 or tuple(splits.shape) != tuple(seqs.shape) or not splits.is_contiguous():
        raise ValueError(f"splits must be a contiguous int32 tensor like seqs {tuple(seqs.shape)}, got "
                         f"{splits.dtype} {tuple(splits.shape)}")
    call_batch("paged_flash", lib.longctx_paged_flash_batch, q, k_cache, v_cache, k_scale, v_scale, block_table,
               ctx_lens, cu_q, seqs, words, scale, num_threads, out, lse, splits=splits, window=window,
               softcap=softcap, rounded=rounded)


paged_flash = cpu_build.define_op(
    "paged_flash(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
    "Tensor block_table, Tensor ctx_lens, Tensor cu_q, Tensor seqs, Tensor splits, Tensor? words, "
    "float scale, int num_threads, Tensor(a!) out, Tensor(b!) lse, int window=0, float softcap=0.0, "
    "Tensor(c!)? rounded=None) -> ()", _paged_flash)
paged_flash.__doc__ = """``torch.ops.longctx.paged_flash``: a step's varlen batch through the flash kernel,
written into ``out``/``lse`` (the rows of the sequences ``seqs``). See ``attend_batch``."""


def attend_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: Tables,
                 seqs: torch.Tensor, scale: float, words: torch.Tensor | None = None, *,
                 out: torch.Tensor, lse: torch.Tensor, splits: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 num_threads: int | None = None, window: int | None = None,
                 softcap: float | None = None, rounded: torch.Tensor | None = None) -> None:
    """The sequences ``seqs`` (int32 indices into ``tables``) of a step in one call, as
    ``cpu_decode.attend_batch`` (same out, lse, words, scales; q the same or with its token rows
    apart, ``cpu_decode.q_rows_ok``: a view of the qkv product), any number of new tokens each
    (at most 63 with ``words``). ``splits`` int32, one per entry of ``seqs``: its KV
    splits (``num_splits``). ``num_threads``: OpenMP threads (default torch's count).
    ``window``/``softcap``: as for ``cpu_decode.attend_batch``. ``rounded`` (where
    ``writes_rounded``; every row of the step in ``seqs``, none split): a contiguous bfloat16
    [T rounded up to 16, H * D] that takes the rows instead of ``out``, rounded as
    ``cpu_amx.round_x`` rounds them for the AMX products (the padding rows zero): the o
    projection's input, the same bits, without ``out`` written and read back."""
    paged_flash(q, k_cache, v_cache, k_scale, v_scale, tables.block_table, tables.ctx_lens, tables.cu_q,
                seqs, splits, words, scale, torch.get_num_threads() if num_threads is None else num_threads,
                out, lse, window or 0, softcap or 0.0, rounded)


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
    if not available():
        raise RuntimeError(f"the CPU flash kernel is {status()}")
    q_len, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    if tree_words is not None and tuple(tree_words.shape) != (q_len,):
        raise ValueError(f"tree_words must have shape ({q_len},), got {tuple(tree_words.shape)}")
    blocks, out, lse = checked_arguments(q, k_cache, v_cache, blocks, ctx_len, out, lse,
                                         k_scale, v_scale)
    if splits is None:
        splits = num_splits(q_len, num_heads // num_kv, num_kv, ctx_len, rows_per_item=row_block(k_cache))
    tables, seqs, words = single(q, blocks, tree_words, all_visible=False)
    attend_batch(q.float().contiguous(), k_cache, v_cache, tables, seqs, scale, words, out=out, lse=lse,
                 splits=torch.tensor([splits], dtype=torch.int32), k_scale=k_scale, v_scale=v_scale)
    return out.to(q.dtype), lse

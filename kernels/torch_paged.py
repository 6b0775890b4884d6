"""The CPU attention path: paged attention from torch ops, fast where the CPU is fast.

Owns: ``paged_attention`` / ``write_kv`` / ``merge_attn_states`` with the signatures and
conventions of ``reference.py`` (read its docstring first), built on PyTorch's fused CPU
flash-attention kernel.
Never: Python loops over tokens, or a copy of KV where a view will do.

How it is fast:

* Decode and short verification steps (``CPU_KERNEL_MAX_ROWS``) go to the compiled kernel of
  ``cpu_decode.py``, which walks the block table itself (no gather, no view runs) and reads
  each K/V row once; longer steps (prefill chunks, long verification) to the compiled flash
  kernel of ``cpu_flash.py``, which walks the table too. The torch forms below serve every
  step when the kernels cannot be built (no C compiler) or are switched off
  (``LONGCTX_CPU_KERNEL=0``), and float16 caches, which the kernels do not take.
* Blocks are views when they can be. The block pool hands out the lowest free ids, so a
  sequence's blocks are usually consecutive; for such a run the sequence's K/V is a plain view
  of the cache (no gather). A table made of a few runs (a prefix-cache hit followed by fresh
  pages is two) is attended run by run over views and merged by log-sum-exp when its runs are
  long (``MIN_RUN_TOKENS``) and the step is a decode (``RUNS_MAX_Q``); otherwise, or with
  more than ``MAX_RUNS`` runs, the table pays an ``index_select`` copy, which is then cheaper
  than the extra calls or small next to the step.
* Decode (and up to ``SMALL_Q`` new tokens): two matmuls over views of the pages, no mask
  kernel. With few KV heads, K/V are read as [S, Hkv * D] matrices against a block-diagonal
  query operand; otherwise the query heads of a GQA group are stacked per KV head (measured at
  8K context, 9/3 heads, D=64: ~1.1-1.3 ms per layer block-diagonal, ~1.2-1.8 ms grouped,
  ~2.4 ms for SDPA with ``enable_gqa``; the machine is noisy).
* More new tokens (prefill chunks, lookahead verification): the cached prefix through
  PyTorch's fused CPU flash kernel without a mask, the new tokens among themselves with their
  mask (causal: the flash kernel again; a draft tree: the grouped matmuls over L x L), merged
  by log-sum-exp, so no fully-masked block is ever computed and the softmax over the long
  prefix is fused. At 8K context, per layer: 9 tokens 2.0 ms this way vs 4.3 ms grouped
  matmuls over the whole context, 71 tokens 11 vs 20 ms.

* int8 pages (``kv_quant.py``: int8 caches with fp32 ``k_scale``/``v_scale`` [NB, Hkv]): the
  compiled kernels read them as they are (a quarter of float32's bytes; the page scales fold
  into the scores and probabilities). The torch forms dequantise the sequence's pages into a
  gathered copy (``dequantized_kv``, the values ``reference.py`` attends over) and run as for
  a float cache; the views-of-runs form is not used for them.

Shape legend: T new tokens (flattened), S context of one sequence, H query heads, Hkv kv
heads, D head dim, NB blocks, BS block size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import cpu_build, cpu_decode, cpu_flash, kv_quant
from .reference import causal_visibility, check_window
from .reference import merge_attn_states as merge_attn_states  # same math; exported here

__all__ = ["paged_attention", "write_kv", "merge_attn_states", "sequence_kv", "dequantized_kv"]


def sequence_kv(cache: torch.Tensor, block_row: list[int], length: int) -> torch.Tensor:
    """The first ``length`` tokens of a sequence, [length, Hkv, D]: a view when its blocks are
    consecutive ids, else a gathered copy."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_row[:num_blocks]
    first = blocks[0] if blocks else 0
    flat = cache.view(-1, *cache.shape[2:])  # (NB * BS, Hkv, D)
    if blocks == list(range(first, first + num_blocks)):
        return flat[first * block_size: first * block_size + length]
    index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    return cache.index_select(0, index).view(-1, *cache.shape[2:])[:length]


def dequantized_kv(cache: torch.Tensor, scale: torch.Tensor, block_row: list[int], length: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` tokens of a sequence from int8 pages, ``int8 * scale[block, head]``
    as ``dtype`` (``kv_quant.dequantize``'s arithmetic: fp32, then ``dtype``): [length, Hkv, D],
    a gathered copy of only the sequence's pages."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    index = torch.tensor(block_row[:num_blocks], dtype=torch.long, device=cache.device)
    pages = cache.index_select(0, index).to(torch.float32)  # (blocks, BS, Hkv, D)
    pages.mul_(scale.index_select(0, index)[:, None, :, None])
    return pages.view(-1, *cache.shape[2:])[:length].to(dtype)


# Decode and short verification steps go to the compiled decode kernel (cpu_decode.py) when it
# is available, for a sequence whose new tokens times its GQA group (the query rows per KV
# head) are at most this many: it reads K/V straight from the pages at near memory bandwidth.
# bench_kernels.py, one SmolLM2 layer at 8K (3 KV heads, group 3): 1 new token 0.8-0.9 ms vs
# 2.2-2.5 ms with the torch forms below. Its cost grows with the rows (one dot product per row
# and key), so more rows go to the compiled flash kernel (cpu_flash.py), which scores a block
# of rows as a small GEMM: at 8K, 6 / 8 / 16 new tokens (18 / 24 / 48 rows) 2.1-2.3 / 2.7-2.9 /
# 5.0 ms with the decode kernel vs 2.3-2.6 / 2.6-2.7 / 3.7-4.0 ms with the flash kernel; a
# 2,048-token prefill chunk over 0-6K cached tokens 0.60-0.67 s per layer vs 0.69-0.77 s with
# PyTorch's flash kernel (the torch forms below, which remain for no compiler, a 16-bit cache
# without a kernel, LONGCTX_CPU_KERNEL=0, or a build without the kernels' intrinsic paths:
# bench_cpu_isa.py, cpu-isa/amd-epyc-2c/legacy.json, 30 layers' decode at 8K with float32 pages: the portable
# build 90.5-95.3 ms vs 65.9-70.0 ms for these forms).
USE_CPU_KERNEL = True
CPU_KERNEL_MAX_ROWS = 20
SMALL_Q = 3  # up to this many new tokens per sequence: matmuls over the whole context
MAX_RUNS = 16  # a block table in more runs of consecutive ids than this is gathered instead
# ... and so is one whose runs average fewer tokens than this: per-run calls and merges then
# cost more than the copy (bench_kernels.py: one sequence at 8K in two runs 2.8-3.7 ms vs 3.6-10.5 ms
# gathered; 8 sequences at 2K, runs of 1K, 9.9-14.2 ms vs 7.8-9.4 ms gathered)
MIN_RUN_TOKENS = 2048
# ... and for steps of at most this many new tokens per sequence: a prefill chunk's compute
# dwarfs the copy (2048 tokens at 8K in two runs: 288-476 ms run by run vs 297-325 gathered)
RUNS_MAX_Q = SMALL_Q


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive block ids: [(first id, number of blocks)]."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


BLOCK_DIAGONAL_MAX_KV_HEADS = 4  # decode (one query) with up to this many KV heads: block-diagonal


def _attend_small(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode / verification: few queries (L) over the whole context. q [L, H, D], k/v [S, Hkv, D]."""
    if q.shape[0] == 1 and k.shape[1] <= BLOCK_DIAGONAL_MAX_KV_HEADS:
        return _attend_block_diagonal(q, k, v, visible, scale)
    return _attend_grouped(q, k, v, visible, scale)


def _softmax_stats(scores: torch.Tensor, tail_visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., R, S] fp32, owned by the caller and overwritten -> (probabilities, lse
    [..., R]). ``tail_visible`` [..., R, L] masks the last L columns only: every query sees
    the whole cached prefix, so masking the full width would touch S / L times more memory."""
    if tail_visible is not None:
        tail = scores[..., scores.shape[-1] - tail_visible.shape[-1]:]
        tail.masked_fill_(~tail_visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # rows seeing nothing
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    probs.div_(torch.where(total > 0, total, torch.ones_like(total)))
    return probs, (peak + torch.log(total)).squeeze(-1)


def _attend_block_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           visible: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads K and V as plain [S, Hkv * D] matrices (a contiguous view of the pages) in one
    matmul each. Each query row is spread over all Hkv * D columns with zeros outside its own
    KV head (a block-diagonal operand), so scores [L * H, S] = q_b @ K^T and the output is the
    diagonal block of P @ V. Costs Hkv times the flops of the grouped form but streams the KV
    bytes once in large GEMMs; measured ~25% faster at 8K context for 3 KV heads."""
    q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    own = torch.arange(num_heads, device=q.device) // group  # (H,) each head's KV head
    select = own[:, None] == torch.arange(num_kv, device=q.device)[None, :]  # (H, Hkv)
    q_b = (q[:, :, None, :] * select[None, :, :, None]).view(q_len * num_heads, num_kv * head_dim)
    scores = torch.mm(q_b, k.reshape(-1, num_kv * head_dim).t()).float() * scale  # (L*H, S)
    rows = None
    if visible is not None:  # (L, S) -> its last L columns, (L*H, L)
        tail = visible[:, visible.shape[1] - q_len:]
        rows = tail[:, None, :].expand(q_len, num_heads, -1).reshape(q_len * num_heads, -1)
    probs, lse = _softmax_stats(scores, rows)
    out = torch.mm(probs.to(v.dtype), v.reshape(-1, num_kv * head_dim))  # (L*H, Hkv*D)
    out = out.view(q_len, num_heads, num_kv, head_dim)[:, torch.arange(num_heads), own]  # (L, H, D)
    return out, lse.view(q_len, num_heads)


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The query heads that share a KV head are stacked into one matrix, so each KV head's keys
    are read once per step: scores [Hkv, G * L, S] = q_g @ K^T over strided views (no copy)."""
    q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qg = q.view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, group * q_len, head_dim)
    scores = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale  # (Hkv, G * L, S)
    rows = None
    if visible is not None:  # (L, S) -> its last L columns, (Hkv, G * L, L)
        tail = visible[:, visible.shape[1] - q_len:]
        rows = tail[None, None].expand(num_kv, group, q_len, -1).reshape(num_kv, group * q_len, -1)
    probs, lse = _softmax_stats(scores, rows)
    out = torch.matmul(probs.to(v.dtype), v.permute(1, 0, 2))  # (Hkv, G * L, D)
    out = out.view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
    return out, lse.view(num_kv, group, q_len).permute(2, 0, 1).reshape(q_len, num_heads)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused CPU flash kernel with its lse. q [L, H, D], k/v [S, Hkv, D]. The
    kernel takes grouped K/V heads as they are (checked equal to repeating them, torch
    2.13), so K/V are strided views, never copies: repeating them cost ~30% of a 72-token
    chunk's step at 8K context."""
    qh = q.transpose(0, 1)[None]  # (1, H, L, D)
    kh = k.transpose(0, 1)[None]  # (1, Hkv, S, D)
    vh = v.transpose(0, 1)[None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()  # (L, H, D), (L, H)


def _attend_new_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens among themselves (k/v hold exactly their L rows): causal through the
    flash kernel, or a draft tree's mask through the grouped matmuls over L x L."""
    if tree_mask is None:
        return _flash(q, k, v, True, scale)
    visible = causal_visibility(q.shape[0], q.shape[0], tree_mask, device=q.device)
    return _attend_grouped(q, k, v, visible, scale)


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens (the last L of S): the cached prefix without a mask plus the new tokens
    themselves with a causal (or ``tree_mask``) mask, merged by log-sum-exp. A single masked
    call would run the fully masked upper-right blocks too (measured ~1.5x slower at L=2048,
    S=8192)."""
    num_cached = k.shape[0] - q.shape[0]
    out_self, lse_self = _attend_new_tokens(q, k[num_cached:], v[num_cached:], scale, tree_mask)
    if num_cached == 0:
        return out_self, lse_self
    out_prefix, lse_prefix = _flash(q, k[:num_cached], v[:num_cached], False, scale)
    return merge_attn_states(out_prefix, lse_prefix, out_self, lse_self)


def _attend_unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query sees every key (a part of the cached prefix)."""
    if q.shape[0] <= SMALL_Q:
        return _attend_small(q, k, v, None, scale)
    return _flash(q, k, v, False, scale)


def _attend_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 blocks: list[int], runs: list[tuple[int, int]], ctx_len: int, scale: float,
                 tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence whose pages lie in a few runs of consecutive ids: the cached prefix run by
    run over views of the cache (no mask), the new tokens (gathered: L rows) among themselves
    with their causal or tree mask, all merged by log-sum-exp."""
    q_len, block_size = q.shape[0], k_cache.shape[1]
    num_cached = ctx_len - q_len
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # (NB * BS, Hkv, D)
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    parts = []
    pos = 0
    for first, count in runs:
        if pos >= num_cached:
            break
        n = min(count * block_size, num_cached - pos)
        lo = first * block_size
        parts.append(_attend_unmasked(q, flat_k[lo:lo + n], flat_v[lo:lo + n], scale))
        pos += count * block_size
    slots = [blocks[t // block_size] * block_size + t % block_size for t in range(num_cached, ctx_len)]
    index = torch.tensor(slots, dtype=torch.long, device=q.device)
    k_new, v_new = flat_k.index_select(0, index), flat_v.index_select(0, index)  # (L, Hkv, D)
    parts.append(_attend_new_tokens(q, k_new, v_new, scale, tree_mask))
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = merge_attn_states(out, lse, o, l)
    return out, lse


class _StepPlan:
    """What ``paged_attention`` derives from a step's metadata that is the same in every layer:
    the host lists, the kernels' tables, and which sequences go to which compiled kernel. Kept
    in the step's ``step_cache`` (``AttentionPlan.kernel_cache``), so the model's layers
    derive it once per step instead of once each."""

    def __init__(self, block_table: torch.Tensor, context_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, host: tuple | None = None) -> None:
        if host is not None:  # the runner's own lists: (block table rows, context lens, query lens)
            tables, ctx_lens, q_lens = host
            self.tables, self.ctx_lens = tables, list(ctx_lens)
            self.cu = [0]
            for n in q_lens:
                self.cu.append(self.cu[-1] + n)
        else:
            self.tables, self.ctx_lens = block_table.tolist(), context_lens.tolist()
            self.cu = cu_seqlens_q.tolist()
        self.block_table = block_table
        self.kernel_tables: cpu_decode.Tables | None = None
        self.routes: dict[tuple, tuple] = {}
        self.all_flash: dict[tuple, bool] = {}  # by route key: every row to the flash kernel, unsplit

    @staticmethod
    def _key(q: torch.Tensor, k_cache: torch.Tensor, tree: bool, window: int | None) -> tuple:
        return (q.shape[1] // k_cache.shape[2], q.shape[2], k_cache.dtype, tuple(k_cache.shape[:3]), tree, window)

    def rounds(self, q: torch.Tensor, k_cache: torch.Tensor, tree: bool, window: int | None = None) -> bool:
        """Whether this layout's rows can come out rounded for the AMX products
        (``cpu_flash.attend_batch``'s ``rounded``): all of them to the flash kernel, none split,
        its library writing them. After ``route`` with the same arguments."""
        return self.all_flash.get(self._key(q, k_cache, tree, window), False)

    def route(self, q: torch.Tensor, k_cache: torch.Tensor, tree: bool, window: int | None = None) -> tuple:
        """(decode seqs, flash seqs with their splits, torch seqs) for this layout: the decode
        kernel up to CPU_KERNEL_MAX_ROWS query rows per KV head (it takes causal masks as
        ancestor words), the flash kernel above, the torch forms for the rest (and a draft
        tree under a window of fewer than 64 positions, which the kernels do not take). A tree
        step with more than 63 new tokens in a sequence is refused (ValueError) here, once per
        step."""
        group = q.shape[1] // k_cache.shape[2]
        key = self._key(q, k_cache, tree, window)
        found = self.routes.get(key)
        if found is not None:
            return found
        q_lens = [self.cu[b + 1] - self.cu[b] for b in range(len(self.ctx_lens))]
        if tree and max(q_lens, default=0) > 63:
            raise ValueError(f"tree masks support at most 63 new tokens per sequence, got {max(q_lens)}")
        decode, flash, splits, rest = [], [], [], []
        compiled = (USE_CPU_KERNEL and cpu_build.vectorized()  # plain C loops lose to torch here
                    and not (tree and window is not None and window < 64))
        threads = torch.get_num_threads()
        for b, (ctx_len, q_len) in enumerate(zip(self.ctx_lens, q_lens)):
            if q_len == 0:
                continue
            view = q[self.cu[b]:self.cu[b + 1]]
            if compiled and q_len * group > CPU_KERNEL_MAX_ROWS:
                if cpu_flash.supports(view, k_cache, tree=tree):
                    flash.append(b)
                    splits.append(cpu_flash.num_splits(q_len, group, k_cache.shape[2], ctx_len, threads,
                                                       cpu_flash.row_block(k_cache)))
                    continue
            elif compiled and cpu_decode.supports(view, k_cache):
                decode.append(b)
                continue
            rest.append(b)
        as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        found = self.routes[key] = (as_int32(decode) if decode else None,
                                    (as_int32(flash), as_int32(splits)) if flash else None, rest)
        # every row to the flash kernel, none split, its library writing them: the rows can come
        # rounded for the o projection (found once a step, as the route is)
        self.all_flash[key] = (bool(flash) and not decode and not rest and max(splits) == 1
                               and cpu_flash.writes_rounded(k_cache, q.shape[1]))
        if (decode or flash) and self.kernel_tables is None:
            self.kernel_tables = cpu_decode.batch_tables(
                self.block_table if self.block_table.numel() else self.tables, self.ctx_lens, self.cu)
        return found


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    tree_mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    step_cache: dict | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    extents: tuple[int, int] | None = None, window: int | None = None,
                    softcap: float | None = None,
                    rounded_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.paged_attention`` (``out`` may be given to fill; ``window``
    and ``softcap`` as there). ``rounded_out``: a contiguous bfloat16 [T rounded up to 16, H * D]
    that, where every row of the step goes to the flash kernel unsplit and its library writes
    them (``_StepPlan.rounds``), takes the rows rounded for the AMX products instead
    (``cpu_flash.attend_batch``'s ``rounded``); the result is then ``(rounded_out, lse)``, else
    ``rounded_out`` is left alone.
    ``step_cache``: a dict that lives for one step (the same metadata in every call), where
    the per-step plan is kept between layers; ``extents`` unused (the host lists in the
    step cache give the same). int8 caches need ``k_scale``/``v_scale``
    (contiguous fp32 [NB, Hkv]; ValueError otherwise).

    The sequences the compiled kernels take go to them in one call per kernel (the operators
    ``torch.ops.longctx.paged_decode`` / ``paged_flash``, a varlen batch each); the torch forms
    below take the rest one sequence at a time."""
    cpu_decode.check_scales(k_cache, k_scale, v_scale)
    if window is not None:
        check_window(window)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap!r}")
    quantized = k_cache.dtype == torch.int8
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    plan = step_cache.get("torch_paged.plan") if step_cache is not None else None
    if plan is None:
        plan = _StepPlan(block_table, context_lens, cu_seqlens_q,
                         step_cache.get("host") if step_cache is not None else None)
        if step_cache is not None:
            step_cache["torch_paged.plan"] = plan
    tables, ctx_lens, cu = plan.tables, plan.ctx_lens, plan.cu
    decode, flash, rest = plan.route(q, k_cache, tree_mask is not None, window)
    if rounded_out is not None and not plan.rounds(q, k_cache, tree_mask is not None, window):
        rounded_out = None
    if decode is not None or flash is not None:
        direct = out.dtype == torch.float32 and out.is_contiguous()  # the kernels write into it
        target = out if direct else torch.empty(q.shape, dtype=torch.float32)
        qf = q.float()
        words = None if tree_mask is None else tree_mask.to(torch.int64).contiguous()
        scales = {"k_scale": k_scale, "v_scale": v_scale} if quantized else {}
        scales.update(window=window, softcap=softcap)
        if decode is not None:
            cpu_decode.attend_batch(qf.contiguous(), k_cache, v_cache, plan.kernel_tables, decode, scale, words,
                                    out=target, lse=lse, **scales)
        if flash is not None:  # q as it is where its heads are packed: a view of the qkv product, no copy
            cpu_flash.attend_batch(qf if cpu_decode.q_rows_ok(qf) else qf.contiguous(), k_cache, v_cache,
                                   plan.kernel_tables, flash[0], scale, words, out=target, lse=lse,
                                   splits=flash[1], rounded=rounded_out, **scales)
            if rounded_out is not None:  # (every row of the step, rounded for the o projection)
                return rounded_out, lse
        if not direct:
            for idx in (decode, None if flash is None else flash[0]):
                if idx is not None:
                    for b in idx.tolist():
                        out[cu[b]:cu[b + 1]] = target[cu[b]:cu[b + 1]]
    for b in rest:
        ctx_len = ctx_lens[b]
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        seq_tree = tree_mask[start:end] if tree_mask is not None else None
        blocks = tables[b][:(ctx_len + k_cache.shape[1] - 1) // k_cache.shape[1]]
        if window is not None or softcap is not None:  # masked matmuls over the window's keys
            out[start:end], lse[start:end] = _attend_masked(
                q[start:end], k_cache, v_cache, blocks, ctx_len, seq_tree, scale, window, softcap,
                (k_scale, v_scale) if quantized else None)
            continue
        if quantized:  # the sequence's pages, dequantised (a gathered copy, so no runs)
            k = dequantized_kv(k_cache, k_scale, blocks, ctx_len, q.dtype)  # (S, Hkv, D)
            v = dequantized_kv(v_cache, v_scale, blocks, ctx_len, q.dtype)
        else:
            runs = block_runs(blocks)
            if (1 < len(runs) <= MAX_RUNS and ctx_len >= MIN_RUN_TOKENS * len(runs)
                    and q_len <= RUNS_MAX_Q and k_cache.dtype == q.dtype):
                o, l = _attend_runs(q[start:end], k_cache, v_cache, blocks, runs, ctx_len, scale,
                                    seq_tree)
                out[start:end] = o
                lse[start:end] = l
                continue
            k = sequence_kv(k_cache, tables[b], ctx_len)  # (S, Hkv, D)
            v = sequence_kv(v_cache, tables[b], ctx_len)
            if k.dtype != q.dtype:  # bf16 pages under fp32 activations (a bf16 model on the CPU)
                k, v = k.to(q.dtype), v.to(q.dtype)
        if q_len <= SMALL_Q:
            visible = None
            if seq_tree is not None or q_len > 1:
                visible = causal_visibility(q_len, ctx_len, seq_tree, device=q.device)
            o, l = _attend_small(q[start:end], k, v, visible, scale)
        else:
            o, l = _attend_chunk(q[start:end], k, v, scale, seq_tree)
        out[start:end] = o
        lse[start:end] = l
    return out, lse


def _attend_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int],
                   ctx_len: int, tree: torch.Tensor | None, scale: float, window: int | None,
                   softcap: float | None, scales: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence with a sliding window or a score cap, when the compiled kernels do not take
    it: the keys from the first one its window lets any query see (a gathered copy), grouped
    matmuls, the cap and the full mask of ``causal_visibility``."""
    q_len = q.shape[0]
    lo = 0 if window is None else max(0, ctx_len - q_len - window + 1)
    if scales is not None:
        k = dequantized_kv(k_cache, scales[0], blocks, ctx_len, torch.float32)[lo:]
        v = dequantized_kv(v_cache, scales[1], blocks, ctx_len, torch.float32)[lo:]
    else:
        k = sequence_kv(k_cache, blocks, ctx_len)[lo:].float()
        v = sequence_kv(v_cache, blocks, ctx_len)[lo:].float()
    visible = causal_visibility(q_len, ctx_len, tree, device=q.device, window=window)[:, lo:]  # (L, S')
    num_kv = k.shape[1]
    group = q.shape[1] // num_kv
    qg = q.float().view(q_len, num_kv, group, -1).permute(1, 2, 0, 3)  # (Hkv, G, L, D)
    scores = torch.matmul(qg, k.permute(1, 2, 0)[:, None]) * scale  # (Hkv, G, L, S')
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (Hkv, G, L)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.matmul(probs, v.permute(1, 0, 2)[:, None])  # (Hkv, G, L, D)
    return (out.permute(2, 0, 1, 3).reshape(q.shape).to(q.dtype),
            lse.permute(2, 0, 1).reshape(q_len, -1))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, step_cache: dict | None = None, *,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             starts: torch.Tensor | None = None) -> None:
    """Store k/v [T, Hkv, D] at ``slot_mapping`` [T] (``block * BS + offset``; < 0 skipped).
    ``step_cache``: as for ``paged_attention``; the checked slots are kept there.
    int8 pages (int8 caches with ``k_scale``/``v_scale`` fp32 [NB, Hkv], required): the kept
    rows are quantised by ``kv_quant.write_int8``. ``starts``: its indices of the rows that may
    enter a page already holding values (each sequence's first row), passed on when no slot
    was skipped (the indices then still fit the rows); else ``write_int8`` finds them.
    Float pages on the CPU: one C pass (``cpu_decode.write_float_kv``, the same bytes but a
    NaN's) where it takes them, else torch's conversion and ``index_copy_``."""
    quantized = k_cache.dtype == torch.int8
    cpu_decode.check_scales(k_cache, k_scale, v_scale)
    if starts is not None and not quantized:
        raise ValueError("starts is for int8 pages (with k_scale/v_scale) only")
    if not quantized and cpu_decode.takes_float_write(k_cache, v_cache, k, v):  # convert and copy in one C pass
        slots = step_cache.get("torch_paged.slots64") if step_cache is not None else None
        if slots is None:
            slots = slot_mapping.long()
            if step_cache is not None:
                step_cache["torch_paged.slots64"] = slots
        cpu_decode.write_float_kv(k_cache, v_cache, k, v, slots)
        return
    found = step_cache.get("torch_paged.slots") if step_cache is not None else None
    if found is None:
        slots = slot_mapping.long()
        keep = slots >= 0
        keep = None if bool(keep.all()) else keep
        found = (slots if keep is None else slots[keep], keep)
        if step_cache is not None:
            step_cache["torch_paged.slots"] = found
    slots, keep = found
    if keep is not None:
        k, v = k[keep], v[keep]
    if quantized:  # one plan for K and V, in every layer of the step
        plan = step_cache.get("torch_paged.int8_plan") if step_cache is not None else None
        if plan is None:
            plan = kv_quant.plan_write(slots, k_cache.shape[1], starts if keep is None else None)
            if step_cache is not None:
                step_cache["torch_paged.int8_plan"] = plan
        kv_quant.write_int8_kv(k_cache, v_cache, k_scale, v_scale, k, v, plan)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

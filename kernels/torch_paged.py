"""The CPU attention path: paged attention from torch ops, fast where the CPU is fast.

Owns: ``paged_attention`` / ``write_kv`` / ``merge_attn_states`` with the signatures and
conventions of ``reference.py`` (read its docstring first), built on PyTorch's fused CPU
flash-attention kernel.
Never: Python loops over tokens, or a copy of KV where a view will do.

How it is fast:

* Blocks are views when they can be. The block pool hands out the lowest free ids, so a
  sequence's blocks are usually consecutive; for such a run the sequence's K/V is a plain view
  of the cache (no gather). Only a shuffled table pays an ``index_select`` copy.
* Each sequence's queries go through ``scaled_dot_product_attention`` (PyTorch's fused CPU
  flash kernel) with ``enable_gqa``: causal chunks with no cached prefix use ``is_causal``; a
  chunk after cached keys uses a bottom-right bool mask; decode (one query) needs no mask.
* When a caller needs the log-sum-exp (ring attention, split merges), the per-sequence call
  goes through ``_scaled_dot_product_flash_attention_for_cpu``, which returns it.

Shape legend: T new tokens (flattened), S context of one sequence, H query heads, Hkv kv
heads, D head dim, NB blocks, BS block size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .reference import causal_visibility
from .reference import merge_attn_states as merge_attn_states  # same math; exported here

__all__ = ["paged_attention", "write_kv", "merge_attn_states", "sequence_kv"]


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


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                is_causal: bool, scale: float, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [L, H, D], k/v [S, Hkv, D] -> out [L, H, D] (and lse fp32 [L, H])."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if not need_lse:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, is_causal=is_causal,
                                             scale=scale, enable_gqa=group > 1)
        return out[0].transpose(0, 1), None
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, is_causal, attn_mask=mask, scale=scale)
    out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1).float()  # (L, H, D), (L, H)
    if visible is not None:  # a row that sees nothing: lse -inf, output 0
        empty = ~visible.any(dim=-1)
        if bool(empty.any()):
            out = out.masked_fill(empty[:, None, None], 0.0)
            lse = lse.masked_fill(empty[:, None], float("-inf"))
    return out, lse


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    tree_mask: torch.Tensor | None = None, need_lse: bool = True,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``reference.paged_attention``; ``need_lse=False`` skips the lse."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if need_lse else None
    tables, ctx_lens, cu = block_table.tolist(), context_lens.tolist(), cu_seqlens_q.tolist()
    for b, ctx_len in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = sequence_kv(k_cache, tables[b], ctx_len)  # (S, Hkv, D)
        v = sequence_kv(v_cache, tables[b], ctx_len)
        seq_tree = tree_mask[start:end] if tree_mask is not None else None
        visible, is_causal = None, False
        if seq_tree is not None or (1 < q_len < ctx_len):
            visible = causal_visibility(q_len, ctx_len, seq_tree, device=q.device)
        elif q_len > 1:  # q_len == ctx_len: plain causal, top-left == bottom-right
            is_causal = True
        o, l = _attend_one(q[start:end], k, v, visible, is_causal, scale, need_lse)
        out[start:end] = o
        if lse is not None:
            lse[start:end] = l
    return out, lse


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at ``slot_mapping`` [T] (``block * BS + offset``; < 0 skipped)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

"""Attention backends and the per-step metadata the model's attention layers receive.

Owns: choosing the attention implementation for a device (torch on the CPU; Triton or
flash-attn on CUDA when available) and calling it with the step's metadata.
Never: scheduling, KV allocation, or any state that outlives one ``forward`` call except the
KV tensors it is handed.

The model calls ``backend.forward(layer_idx, q, k, v, meta)`` with the step's new tokens,
flattened over the batch (q [T, H, D], k/v [T, Hkv, D]). With ``meta.kv_caches`` set, the new
K/V rows are first written to their slots and attention runs over each sequence's pages (the
prefix plus the new tokens); without it (a plain full-sequence forward, as in the HF parity
tests) each sequence attends causally to its own new tokens only.
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import os

from longctx.kernels import kv_quant, torch_paged

# int8 pages hold K and V rotated by kv_quant.rotation (queries rotated alike, outputs back):
# half the quantisation error for the same bytes. LONGCTX_INT8_ROTATE=0 stores them unrotated
# (pages of one setting never serve the other: the prefix cache key names it).
ROTATE_INT8 = os.environ.get("LONGCTX_INT8_ROTATE", "1") != "0"


def int8_rotation(head_dim: int, device: torch.device | str) -> torch.Tensor | None:
    """What int8 pages' K/V are turned by (``ROTATE_INT8``), or None."""
    return kv_quant.rotation(head_dim, device) if ROTATE_INT8 else None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step. Lists are the same numbers as the tensors,
    kept on the host so the CPU path never syncs to read them."""

    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # cached + new tokens per sequence
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens_t: torch.Tensor  # [B] int32
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    slot_mapping: torch.Tensor | None = None  # [T] int64
    tree_mask: torch.Tensor | None = None  # [T] int64 ancestor bits, or None (causal)
    kv_caches: list[tuple[torch.Tensor, ...]] | None = None  # per layer (K, V) or int8 (K, V, K scale, V scale)
    # host numbers the runner already has, so no layer reads them back from the device
    max_query_len: int | None = None
    max_context_len: int | None = None
    max_position: int | None = None  # 1 + the largest position in the step (RoPE tables)
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32: context offsets (flash-attn varlen)
    host_block_table: list[list[int]] | None = None
    tail: Any = None  # int8 pages: ``exact_tail.TailStep`` (each query's own page exact), or None
    # what a kernels module derives from this metadata once and reuses in every layer
    step_cache: dict = field(default_factory=dict)

    @classmethod
    def dense(cls, query_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for a cache-free forward: each sequence is exactly its new tokens."""
        cu = torch.tensor(list(accumulate(query_lens, initial=0)), dtype=torch.int32, device=device)
        return cls(query_lens=list(query_lens), context_lens=list(query_lens), cu_seqlens_q=cu,
                   context_lens_t=torch.tensor(query_lens, dtype=torch.int32, device=device))


class PagedAttentionBackend:
    """Write the step's K/V into the pages, then paged attention, with one kernel module:
    ``longctx.kernels.torch_paged`` (CPU) or ``longctx.kernels.triton_attention`` (CUDA).
    Both have the signatures of ``kernels/reference.py``."""

    def __init__(self, head_dim: int, kernels: Any, name: str) -> None:
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kernels, self.name = kernels, name

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.kv_caches is None:
            return dense_causal(q, k, v, meta.query_lens, self.scale)
        k_cache, v_cache, *scales = meta.kv_caches[layer_idx]
        extra = {"step_cache": meta.step_cache} if getattr(self.kernels, "TAKES_STEP_CACHE", False) else {}
        if not meta.step_cache and meta.host_block_table is not None:
            meta.step_cache["host"] = (meta.host_block_table, meta.context_lens, meta.query_lens)
        quant, rot = {}, None
        if scales:  # int8 pages: each sequence's first new row starts the only page that may hold values
            quant = {"k_scale": scales[0], "v_scale": scales[1]}
            if ROTATE_INT8:  # the same matrix in every layer of the step
                rot = meta.step_cache.get("int8.rotation")
                if rot is None:
                    rot = meta.step_cache["int8.rotation"] = kv_quant.rotation(q.shape[-1], q.device)
                q, k, v = kv_quant.turn_qkv(q, k, v, rot)
            starts = meta.step_cache.get("int8.starts")
            if starts is None:
                starts = meta.step_cache["int8.starts"] = (
                    meta.cu_seqlens_q[:-1].long().clamp(max=max(q.shape[0] - 1, 0)))
            self.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, starts=starts, **quant, **extra)
        else:
            self.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, **extra)
        if getattr(self.kernels, "TAKES_EXTENTS", False) and meta.max_query_len is not None:
            extra["extents"] = (meta.max_query_len, meta.max_context_len)
        out, lse = self.kernels.paged_attention(
            q, k_cache, v_cache, meta.block_table, meta.context_lens_t, meta.cu_seqlens_q,
            scale=self.scale, tree_mask=meta.tree_mask, **quant, **extra)
        if scales and meta.tail is not None:  # each query's first and own page exact
            out = meta.tail.apply(layer_idx, out, lse, q, k, v, meta.kv_caches[layer_idx], self.scale)
        if rot is not None:
            out = kv_quant.turn(out, rot, back=True)
        return out


class FlashAttnBackend(PagedAttentionBackend):
    """flash-attn over the paged KV (pages of a multiple of 256 tokens, as its paged API
    requires; the engine picks 256 when this backend runs): after the step's K/V are written to
    their slots, decode steps (one new token per sequence) use ``flash_attn_with_kvcache`` and
    prefill chunks ``flash_attn_varlen_func`` with the block table (causal, aligned to the
    bottom right: a chunk sees the cached prefix). Steps with a tree mask (lookahead verify),
    float32, int8 pages and pages of other sizes go to the Triton kernels."""

    def __init__(self, head_dim: int, triton_kernels: Any, flash_attn: Any) -> None:
        super().__init__(head_dim, triton_kernels, "flash-attn+triton")
        self.flash_attn = flash_attn

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        usable = (meta.kv_caches is not None and meta.tree_mask is None and q.dtype != torch.float32
                  and len(meta.kv_caches[layer_idx]) == 2  # int8 pages: the Triton kernels
                  and meta.kv_caches[layer_idx][0].shape[1] % 256 == 0)
        if not usable:
            return super().forward(layer_idx, q, k, v, meta)
        k_cache, v_cache = meta.kv_caches[layer_idx]
        self.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if meta.max_query_len == 1:
            out = self.flash_attn.flash_attn_with_kvcache(
                q[:, None], k_cache, v_cache, cache_seqlens=meta.context_lens_t,
                block_table=meta.block_table, softmax_scale=self.scale, causal=True)
            return out[:, 0]
        return self.flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_query_len,
            meta.max_context_len, softmax_scale=self.scale, causal=True, block_table=meta.block_table)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int],
                 scale: float) -> torch.Tensor:
    """Cache-free attention: each sequence attends causally to its own tokens only."""
    out = torch.empty_like(q)
    start = 0
    for q_len in query_lens:
        end = start + q_len
        qh, kh, vh = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # (1, H, L, D)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_len > 1, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def flash_attn_available() -> bool:
    """flash-attn is installed (it only ever is beside CUDA)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def select_backend(device: torch.device | str, head_dim: int, prefer: str = "auto",
                   dtype: torch.dtype = torch.float32) -> PagedAttentionBackend:
    """The attention implementation for ``device``: on CUDA flash-attn (prefill and decode) +
    Triton (lookahead verify steps, and what flash-attn cannot take) when flash-attn is
    installed and the dtype is 16-bit, else Triton; on the CPU the torch path. ``prefer``
    forces one of ``torch``, ``triton``, ``flash-attn``."""
    device = torch.device(device)
    if prefer == "torch" or (prefer == "auto" and device.type != "cuda"):
        return PagedAttentionBackend(head_dim, torch_paged, "torch")
    from longctx.kernels import triton_attention

    if prefer == "flash-attn" and dtype == torch.float32:
        raise ValueError("flash-attn computes in float16/bfloat16 only: use dtype='bfloat16' "
                         "(or attention_backend='triton' for float32)")
    if prefer == "flash-attn" or (prefer == "auto" and dtype != torch.float32 and flash_attn_available()):
        import flash_attn

        return FlashAttnBackend(head_dim, triton_attention, flash_attn)
    return PagedAttentionBackend(head_dim, triton_attention, "triton")

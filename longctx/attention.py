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

from longctx.kernels import torch_paged


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
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (K, V)
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
        k_cache, v_cache = meta.kv_caches[layer_idx]
        extra = {"step_cache": meta.step_cache} if getattr(self.kernels, "TAKES_STEP_CACHE", False) else {}
        self.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, **extra)
        out, _ = self.kernels.paged_attention(
            q, k_cache, v_cache, meta.block_table, meta.context_lens_t, meta.cu_seqlens_q,
            scale=self.scale, tree_mask=meta.tree_mask, **extra)
        return out


class FlashAttnBackend(PagedAttentionBackend):
    """flash-attn's ``flash_attn_with_kvcache`` for pure decode steps (one new token per
    sequence, no tree mask, block size a multiple of 256, as flash-attn's paged KV requires);
    every other step goes to the Triton kernels."""

    def __init__(self, head_dim: int, triton_kernels: Any, flash_attn: Any) -> None:
        super().__init__(head_dim, triton_kernels, "flash-attn+triton")
        self.flash_attn = flash_attn

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        decode_only = (meta.kv_caches is not None and meta.tree_mask is None
                       and all(n == 1 for n in meta.query_lens)
                       and meta.kv_caches[layer_idx][0].shape[1] % 256 == 0)
        if not decode_only:
            return super().forward(layer_idx, q, k, v, meta)
        k_cache, v_cache = meta.kv_caches[layer_idx]
        cached = meta.context_lens_t - 1  # the new token is appended by flash-attn itself
        out = self.flash_attn.flash_attn_with_kvcache(
            q[:, None], k_cache, v_cache, k=k[:, None], v=v[:, None], cache_seqlens=cached,
            block_table=meta.block_table, softmax_scale=self.scale, causal=True)
        return out[:, 0]


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


def select_backend(device: torch.device | str, head_dim: int, prefer: str = "auto") -> PagedAttentionBackend:
    """The attention implementation for ``device``: on CUDA flash-attn (decode) + Triton when
    flash-attn is installed, else Triton; on the CPU the torch path. ``prefer`` forces one of
    ``torch``, ``triton``, ``flash-attn``."""
    device = torch.device(device)
    if prefer == "torch" or (prefer == "auto" and device.type != "cuda"):
        return PagedAttentionBackend(head_dim, torch_paged, "torch")
    from longctx.kernels import triton_attention

    if prefer in ("auto", "flash-attn"):
        try:
            import flash_attn
        except ImportError:
            if prefer == "flash-attn":
                raise
        else:
            return FlashAttnBackend(head_dim, triton_attention, flash_attn)
    return PagedAttentionBackend(head_dim, triton_attention, "triton")

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
from dataclasses import dataclass

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

    @classmethod
    def dense(cls, query_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for a cache-free forward: each sequence is exactly its new tokens."""
        cu = torch.tensor([0] + list(_cumsum(query_lens)), dtype=torch.int32, device=device)
        return cls(query_lens=list(query_lens), context_lens=list(query_lens), cu_seqlens_q=cu,
                   context_lens_t=torch.tensor(query_lens, dtype=torch.int32, device=device))


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


class TorchAttentionBackend:
    """The CPU path (also correct on CUDA): ``longctx.kernels.torch_paged``."""

    name = "torch"

    def __init__(self, head_dim: int) -> None:
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.kv_caches is None:
            return self._dense(q, k, v, meta)
        k_cache, v_cache = meta.kv_caches[layer_idx]
        torch_paged.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out, _ = torch_paged.paged_attention(
            q, k_cache, v_cache, meta.block_table, meta.context_lens_t, meta.cu_seqlens_q,
            scale=self.scale, tree_mask=meta.tree_mask)
        return out

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for q_len in meta.query_lens:
            end = start + q_len
            qh, kh, vh = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # (1, H, L, D)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_len > 1, scale=self.scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out


def select_backend(device: torch.device | str, head_dim: int) -> TorchAttentionBackend:
    """The attention implementation for ``device``."""
    return TorchAttentionBackend(head_dim)

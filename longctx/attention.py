"""Attention backends and the per-step metadata the model's attention layers receive.

Owns: choosing the attention implementation for a device (torch on the CPU; Triton or
flash-attn on CUDA when available) and calling it with the step's metadata.
Never: scheduling, KV allocation, or any state that outlives one ``forward`` call except the
KV tensors it is handed.

A backend is used in two calls (FlashInfer's plan/run shape): ``plan(meta)`` once per step
builds a typed ``AttentionPlan`` (what every layer shares: the KV format's step plan, the
kernels' per-step memo, the host extents), and the model calls ``run(layer_idx, q, k, v,
plan, **layer.options)`` per layer with the step's new tokens, flattened over the batch (q
[T, H, D], k/v [T, Hkv, D]) and the layer's own attention (``LayerAttention``: its scale, its
sliding window, its score cap; none of them for a plain Llama layer). With ``meta.kv_caches`` set, the new K/V rows are first written to their slots
and attention runs over each sequence's pages (the prefix plus the new tokens); without it (a
plain full-sequence forward, as in the HF parity tests) each sequence attends causally to its
own new tokens only. The KV format (``longctx.kv.formats``) prepares q/k/v and the kernels'
page arguments and finishes their output; the backend never asks which format it is.
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from longctx.kernels import cpu_amx, reference, torch_paged
from longctx.kv.formats import FloatPages, KVStepPlan


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention is besides q, k, v: the score scale (None: 1 / sqrt(head
    dim)), a sliding window (None: every earlier token) and a score cap (None: none), with
    ``kernels/reference.py``'s conventions."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None

    @property
    def options(self) -> dict:
        """The keywords ``backend.run`` takes for this layer (none for a plain layer)."""
        return {k: v for k, v in (("scale", self.scale), ("window", self.window), ("softcap", self.softcap))
                if v is not None}


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
    kv_caches: list[tuple[torch.Tensor, ...]] | None = None  # per layer, as kv_format lays them out
    kv_format: FloatPages | None = None  # with kv_caches: the pages' format (``longctx.kv.formats``)
    # host numbers the runner already has, so no layer reads them back from the device
    max_query_len: int | None = None
    max_context_len: int | None = None
    max_position: int | None = None  # 1 + the largest position in the step (RoPE tables)
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32: context offsets (flash-attn varlen)
    host_block_table: list[list[int]] | None = None
    tail: Any = None  # a format with an exact tail: ``exact_tail.TailStep``, or None
    rope_long: torch.Tensor | None = None  # [T] bool: LongRoPE's tokens on its long table (Phi-3)
    # windowed layers that keep only their windows (``longctx.kv.window_ring``): their block
    # table [B, max_blocks] int32, slots [T] and host table, in place of the pool's
    ring: tuple[torch.Tensor, torch.Tensor, list[list[int]]] | None = None

    @classmethod
    def dense(cls, query_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for a cache-free forward: each sequence is exactly its new tokens."""
        cu = torch.tensor(list(accumulate(query_lens, initial=0)), dtype=torch.int32, device=device)
        return cls(query_lens=list(query_lens), context_lens=list(query_lens), cu_seqlens_q=cu,
                   context_lens_t=torch.tensor(query_lens, dtype=torch.int32, device=device))


@dataclass
class AttentionPlan:
    """What every layer of one step shares (``backend.plan(meta)``): the metadata, the KV
    format's step plan, and the kernels module's per-step memo (``kernel_cache``: what it
    derives from the metadata at its first call and reuses in every later layer; a new dict
    per plan, so nothing outlives the step)."""

    meta: AttentionMetadata
    kv: KVStepPlan | None = None
    kernel_cache: dict = field(default_factory=dict)
    split_linear: Any = None  # the model's products as they are (sequence parallelism brings its own)
    extents: tuple[int, int] | None = None  # (max query length, max context length), when the host knows them
    ring_cache: dict = field(default_factory=dict)  # the kernels' memo for the windowed layers' ring table

    def tables(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(block table, slot mapping, kernels' memo) a layer reads and writes: the pool's, or
        for a windowed layer whose pages are a ring the ring's."""
        meta = self.meta
        if window is not None and meta.ring is not None:
            return meta.ring[0], meta.ring[1], self.ring_cache
        return meta.block_table, meta.slot_mapping, self.kernel_cache


class PagedAttentionBackend:
    """Write the step's K/V into the pages, then paged attention, with one kernel module:
    ``longctx.kernels.torch_paged`` (CPU) or ``longctx.kernels.triton_attention`` (CUDA).
    Both have the signatures of ``kernels/reference.py``, which every kernels module shares:
    each takes the step's ``step_cache`` and ``extents`` and uses what it needs of them."""

    # ``run`` takes ``rounded`` (a backend without this attribute is never asked for it)
    hands_rounded_rows = True

    def __init__(self, head_dim: int, kernels: Any, name: str) -> None:
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kernels, self.name = kernels, name

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        if meta.kv_caches is None:
            return AttentionPlan(meta)
        extents = None if meta.max_query_len is None else (meta.max_query_len, meta.max_context_len)
        plan = AttentionPlan(meta, meta.kv_format.plan(meta, meta.cu_seqlens_q.device), extents=extents)
        if meta.host_block_table is not None:
            plan.kernel_cache["host"] = (meta.host_block_table, meta.context_lens, meta.query_lens)
        if meta.ring is not None:
            plan.ring_cache["host"] = (meta.ring[2], meta.context_lens, meta.query_lens)
        return plan

    def run(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            plan: AttentionPlan, scale: float | None = None, window: int | None = None,
            softcap: float | None = None, rounded: bool = False) -> torch.Tensor | cpu_amx.RoundedRows:
        """One layer's attention; ``scale``/``window``/``softcap``: the layer's own
        (``LayerAttention``). int8 pages' exact tail is not applied under a window or a cap
        (its exchange assumes every first-page key is visible and uncapped scores).
        ``rounded``: the o projection takes its input rounded for the AMX tiles; where the CPU
        kernels can write the result that way (float pages, every row to the flash kernel,
        ``torch_paged.paged_attention``'s ``rounded_out``) it comes as ``cpu_amx.RoundedRows``
        (``xb`` [T rounded up to 16, H * D] bfloat16 in the tiles' order, ``rows`` T), else as
        the tensor. (The buffer is made before the kernels know whether the step's routing
        lets them fill it: an unwritten allocation where it does not.)"""
        meta = plan.meta
        scale = self.scale if scale is None else scale
        masked = {} if window is None and softcap is None else {"window": window, "softcap": softcap}
        if meta.kv_caches is None:
            return dense_causal(q, k, v, meta.query_lens, scale, **masked)
        layer = meta.kv_caches[layer_idx]
        table, slots, memo = plan.tables(window)
        q, k, v, pages, writing = meta.kv_format.enter(q, k, v, layer, plan.kv)
        self.kernels.write_kv(layer[0], layer[1], k, v, slots, step_cache=memo, **pages, **writing)
        extra = {}  # (float pages leave the kernels' output as it is: the rows may come rounded; int8's do not)
        if rounded and self.kernels is torch_paged and type(meta.kv_format).leave is FloatPages.leave:
            extra["rounded_out"] = cpu_amx.empty_rounded(q.shape[0], q.shape[1] * q.shape[2])
        out, lse = self.kernels.paged_attention(
            q, layer[0], layer[1], table, meta.context_lens_t, meta.cu_seqlens_q,
            scale=scale, tree_mask=meta.tree_mask, step_cache=memo, extents=plan.extents,
            **pages, **masked, **extra)
        if extra and out is extra["rounded_out"]:
            return cpu_amx.RoundedRows(out, q.shape[0])
        tail = None if masked else meta.tail
        return meta.kv_format.leave(layer_idx, out, lse, q, k, v, layer, scale, tail, plan.kv)


class FlashAttnBackend(PagedAttentionBackend):
    """flash-attn over the paged KV (pages of a multiple of 256 tokens, as its paged API
    requires; the engine picks 256 when this backend runs): after the step's K/V are written to
    their slots, decode steps (one new token per sequence) use ``flash_attn_with_kvcache`` and
    prefill chunks ``flash_attn_varlen_func`` with the block table (causal, aligned to the
    bottom right: a chunk sees the cached prefix). Steps with a tree mask (lookahead verify),
    float32, quantized pages and pages of other sizes go to the Triton kernels."""

    def __init__(self, head_dim: int, triton_kernels: Any, flash_attn: Any) -> None:
        super().__init__(head_dim, triton_kernels, "flash-attn+triton")
        self.flash_attn = flash_attn

    def run(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            plan: AttentionPlan, scale: float | None = None, window: int | None = None,
            softcap: float | None = None, rounded: bool = False) -> torch.Tensor | cpu_amx.RoundedRows:
        meta = plan.meta
        usable = (meta.kv_caches is not None and meta.tree_mask is None and q.dtype != torch.float32
                  and meta.kv_format.storage_dtype == q.dtype  # other page formats: the Triton kernels
                  and meta.kv_caches[layer_idx][0].shape[1] % 256 == 0)
        if not usable:
            return super().run(layer_idx, q, k, v, plan, scale=scale, window=window, softcap=softcap,
                               rounded=rounded)
        k_cache, v_cache = meta.kv_caches[layer_idx]
        table, slots, _ = plan.tables(window)
        self.kernels.write_kv(k_cache, v_cache, k, v, slots)
        # flash-attn's window counts the keys left of the query's own: (W - 1, 0), as HF passes it
        options = {"softmax_scale": self.scale if scale is None else scale, "causal": True,
                   "window_size": (-1, -1) if window is None else (window - 1, 0), "softcap": softcap or 0.0}
        if meta.max_query_len == 1:
            out = self.flash_attn.flash_attn_with_kvcache(
                q[:, None], k_cache, v_cache, cache_seqlens=meta.context_lens_t,
                block_table=table, **options)
            return out[:, 0]
        return self.flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_query_len,
            meta.max_context_len, block_table=table, **options)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int],
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Cache-free attention: each sequence attends causally to its own tokens only (within
    ``window``, scores capped by ``softcap``: then through ``kernels/reference.py``)."""
    out = torch.empty_like(q)
    start = 0
    for q_len in query_lens:
        end = start + q_len
        if window is not None or softcap is not None:
            out[start:end] = reference.attention(q[start:end], k[start:end], v[start:end], scale=scale,
                                                 window=window, softcap=softcap)[0]
            start = end
            continue
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

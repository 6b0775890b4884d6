"""The device KV pool: the bytes behind the block ids the scheduler hands out.

Owns: one tensor per layer for K and one for V, each ``[NB, BS, Hkv, D]`` (the layout
flash-attn's paged API and vLLM use), sized from the cache budget; whole pages read out and
written in (``read_pages``/``write_pages``, ``[P, L, 2, BS, Hkv, D]``), the one interface the
host and disk tiers use, so a pool whose pages are spread over ranks
(``longctx.sp.ShardedKVPool``) serves them the same way.
Never: deciding which block is whose (``longctx.cache``) or what runs when (the scheduler).

Allocated with ``torch.empty``: on the CPU, pages nobody has written are never touched, so
resident memory grows with the KV actually used, not with the budget.
"""

from __future__ import annotations

import os

import torch

from longctx.config import CacheConfig
from longctx.kv.exact_tail import TailStore

# int8 pages: each query sees its own page exact (``exact_tail``); LONGCTX_INT8_EXACT_TAIL=0
# reads every key as stored (for comparisons: the error study, benchmarks)
EXACT_TAIL = os.environ.get("LONGCTX_INT8_EXACT_TAIL", "1") != "0"
from longctx.model.config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one page across all layers (int8 pages: with their fp32 scales)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = model.num_key_value_heads
    scales = 2 * model.num_hidden_layers * heads * 4 if dtype == torch.int8 else 0
    return 2 * model.num_hidden_layers * block_size * heads * model.head_dim * itemsize + scales


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the KV pages hold: the model's dtype (``auto``) or int8 (``int8``)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {kv_cache_dtype!r}")


def num_blocks_for(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks:
        return cache.num_blocks
    return max(1, int(cache.kv_cache_gb * (1 << 30)) // bytes_per_block(model, cache.block_size, dtype))


def kv_budget_bytes(total: int, free: int, allocated: int, peak_allocated: int,
                    utilization: float) -> int:
    """The KV pool's share of a GPU, as vLLM sizes it: ``utilization`` of the device's memory,
    less what is in use now (weights, the allocator's cache, other processes: ``total -
    free``) and less the activation peak a full step adds on top of what is allocated now."""
    in_use = total - free
    activation_peak = max(0, peak_allocated - allocated)
    return int(total * utilization) - in_use - activation_peak


def profile_kv_cache_gb(model, backend, device: torch.device, max_tokens: int,
                        utilization: float) -> float:
    """Run one step of ``max_tokens`` tokens (no KV) to see the activation peak, then size the
    KV pool from what is left of the device (``kv_budget_bytes``), in GiB."""
    from longctx.attention import AttentionMetadata

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    allocated = torch.cuda.memory_allocated(device)
    ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
    positions = torch.arange(max_tokens, device=device)
    hidden = model(ids, positions, backend, AttentionMetadata.dense([max_tokens], device))
    model.compute_logits(hidden[-min(max_tokens, 256):])
    del hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # the step's blocks back to the device, so "in use" holds no activations
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, allocated, peak, utilization)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} of "
                         f"{total / 2**30:.1f} GiB free after loading the model, activations peak at "
                         f"{(peak - allocated) / 2**30:.2f} GiB; raise gpu_memory_utilization "
                         f"({utilization}) or give kv_cache_gb")
    return budget / (1 << 30)


class DeviceKVPool:
    """One K and one V tensor per layer, ``[NB, BS, Hkv, D]``, in the model's dtype or, with
    ``kv_dtype=torch.int8``, int8 with a scale per (page, KV head) for each (``scales``, fp32
    ``[NB, Hkv]``; ``longctx.kernels.kv_quant``). A page as the host and disk tiers see it
    (``read_pages``/``write_pages``): ``[L, 2, BS, Hkv, D]`` of the model's dtype, or for int8
    ``[L, 2, BS * Hkv * D + 4 * Hkv]`` bytes, each row a page's int8 values then its scales.
    int8 pools also keep the exact rows of each sequence's newest pages (``tail``, a
    ``exact_tail.TailStore`` of ``tail_slots`` sequences to start with)."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_dtype: torch.dtype | None = None, tail_slots: int = 8) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.kv_dtype = kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        heads, dim = model.num_key_value_heads, model.head_dim
        shape = (num_blocks, block_size, heads, dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=self.kv_dtype, device=device),
             torch.empty(shape, dtype=self.kv_dtype, device=device))
            for _ in range(model.num_hidden_layers)
        ]
        self.scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.tail: TailStore | None = None  # int8: each query's own page exact (``exact_tail``)
        if self.quantized and EXACT_TAIL:
            # float32 on the CPU (a bf16 model computes in float32 there, and the C exchange reads float32)
            tail_dtype = torch.float32 if self.device.type == "cpu" else dtype
            self.tail = TailStore(model.num_hidden_layers, tail_slots, block_size, heads, dim, tail_dtype, device)
        if self.quantized:
            self.scales = [(torch.zeros(num_blocks, heads, device=device), torch.zeros(num_blocks, heads, device=device))
                           for _ in range(model.num_hidden_layers)]
            self._data_bytes = block_size * heads * dim
            self.page_shape: tuple[int, ...] = (model.num_hidden_layers, 2, self._data_bytes + 4 * heads)
            self.page_dtype = torch.uint8
        else:
            self.page_shape = (model.num_hidden_layers, 2, *shape[1:])  # (L, 2, BS, Hkv, D)
            self.page_dtype = dtype

    @property
    def caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer what attention reads: ``(K, V)``, or ``(K, V, K scale, V scale)``."""
        if self.scales is None:
            return self.layers
        return [(k, v, ks, vs) for (k, v), (ks, vs) in zip(self.layers, self.scales)]

    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of pages ``block_ids`` on the CPU, ``[P, *page_shape]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.quantized:
            n = len(block_ids)
            rows = [torch.stack([torch.cat([c.index_select(0, idx).view(n, -1).view(torch.uint8),
                                            s.index_select(0, idx).view(torch.uint8)], 1)
                                 for c, s in zip(layer, scales)], 1)
                    for layer, scales in zip(self.layers, self.scales)]
            return torch.stack(rows, 1).to("cpu")
        return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1)
                            for k, v in self.layers], 1).to("cpu")

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write ``pages`` ``[P, *page_shape]`` into blocks ``block_ids`` (same order)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        pages = pages.to(self.device, non_blocking=True)
        if self.quantized:
            n, cut = len(block_ids), self._data_bytes
            for layer, (caches, scales) in enumerate(zip(self.layers, self.scales)):
                for kv, (c, s) in enumerate(zip(caches, scales)):
                    record = pages[:, layer, kv]
                    c.index_copy_(0, idx, record[:, :cut].contiguous().view(torch.int8).view(n, *c.shape[1:]))
                    s.index_copy_(0, idx, record[:, cut:].contiguous().view(torch.float32))
            return
        for layer, (k, v) in enumerate(self.layers):
            k.index_copy_(0, idx, pages[:, layer, 0])
            v.index_copy_(0, idx, pages[:, layer, 1])

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of token slots ``src`` to slots ``dst`` in every layer (slot = block *
        BS + offset); all sources are read before any destination is written. int8 pages:
        the rows are dequantised and written again under the destination pages' scales."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        if self.quantized:
            from longctx.kernels import kv_quant

            starts = kv_quant.run_starts(torch.tensor(dst, dtype=torch.long), self.block_size).to(self.device)
            for caches, scales in zip(self.layers, self.scales):
                for cache, scale in zip(caches, scales):
                    rows = kv_quant.dequantize_rows(cache, scale, s)
                    kv_quant.write_int8(cache, scale, rows, d, starts)
            return
        for k_cache, v_cache in self.layers:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])  # (NB * BS, Hkv, D)
                flat[d] = flat[s]

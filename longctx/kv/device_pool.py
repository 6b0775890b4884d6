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

import torch

from longctx.config import CacheConfig
from longctx.model.config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one page across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * itemsize


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
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, model.num_key_value_heads, model.head_dim)
        self.page_shape = (model.num_hidden_layers, 2, *shape[1:])  # (L, 2, BS, Hkv, D)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(model.num_hidden_layers)
        ]

    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of pages ``block_ids`` on the CPU, ``[P, L, 2, BS, Hkv, D]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1)
                            for k, v in self.layers], 1).to("cpu")

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write ``pages`` ``[P, L, 2, BS, Hkv, D]`` into blocks ``block_ids`` (same order)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        pages = pages.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(self.layers):
            k.index_copy_(0, idx, pages[:, layer, 0])
            v.index_copy_(0, idx, pages[:, layer, 1])

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of token slots ``src`` to slots ``dst`` in every layer (slot = block *
        BS + offset); all sources are read before any destination is written."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.layers:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])  # (NB * BS, Hkv, D)
                flat[d] = flat[s]

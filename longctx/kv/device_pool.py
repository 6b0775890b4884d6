"""The device KV pool: the bytes behind the block ids the scheduler hands out.

Owns: one tensor per layer for K and one for V, each ``[NB, BS, Hkv, D]`` (the layout
flash-attn's paged API and vLLM use), sized from the cache budget.
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


class DeviceKVPool:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, model.num_key_value_heads, model.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(model.num_hidden_layers)
        ]

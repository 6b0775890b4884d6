"""The engine's KV memory sized and built: how many pages the pool gets, how far the context
window goes with them, and the prefix store over them.

Owns: ``size_kv_pool`` (``num_blocks``, ``kv_cache_gb``, or "auto": on CUDA what
``gpu_memory_utilization`` leaves after a profiled step, on the CPU ``cpu_kv_budget_gb``),
``fit_window`` (the start-up line with the pool's token capacity; a ``max_model_len`` the pool
cannot hold is refused, the model's own window cut to it) and ``build_prefix_cache``.
Never: running steps or choosing what runs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from longctx.cache.radix_tree import RadixTree
from longctx.config import CacheConfig, ConfigError, SchedulerConfig
from longctx.kv.device_pool import (available_memory_bytes, cpu_kv_budget_gb, pool_page_bytes, profile_kv_cache_gb,
                                    ring_bytes)
from longctx.model.linear import BlockMatrix
from longctx.kv.disk_store import DiskKVStore
from longctx.kv.formats import FloatPages
from longctx.kv.host_pool import HostKVPool
from longctx.kv.mover import KVMover
from longctx.kv.prefix_cache import PrefixCache, host_tier_pages
from longctx.kv.window_ring import WindowRing

log = logging.getLogger(__name__)


def size_kv_pool(cache: CacheConfig, sched: SchedulerConfig, max_len: int, fmt: FloatPages, model: Any,
                 backend: Any, device: torch.device, ring: WindowRing | None = None) -> tuple[CacheConfig, str]:
    """The cache config with its pool's size settled, and how it was chosen (for the log).
    ``ring``: the windowed layers' rings (``longctx.kv.window_ring``), which the budget holds
    beside the pool's pages of the other layers."""
    if cache.num_blocks:
        return cache, f"num_blocks={cache.num_blocks}"
    if cache.kv_cache_gb is not None:
        return cache, f"kv_cache_gb={cache.kv_cache_gb:g}"
    if device.type == "cuda":  # what the model leaves free of gpu_memory_utilization
        budget = profile_kv_cache_gb(model, backend, device, sched.max_num_batched_tokens,
                                     cache.gpu_memory_utilization)
        # less the exact tail's rows (outside the pages), if the format keeps any
        budget -= fmt.tail_bytes(sched.max_num_seqs, cache.block_size) / (1 << 30)
        note = f"auto: {budget:.2f} GiB of gpu_memory_utilization {cache.gpu_memory_utilization:g}"
    else:  # the CPU: a share of what the weights leave, at most what the requests can use
        # whole pages: a window that ends inside a page still takes that page
        need = -(-max_len // cache.block_size) * sched.max_num_seqs * pool_page_bytes(fmt, cache.block_size, ring)
        # weights kept as a mapped file's pages count as available (page cache) but must stay
        # resident: take them off, so the pool never pushes them out
        held = {id(b): b for m in model.modules() for b in (getattr(m, "weight", None), getattr(m, "blocks", None))
                if isinstance(b, BlockMatrix)}  # (a tied head is the embedding's matrix)
        mapped = sum(b.nbytes() for b in held.values())
        budget, note = cpu_kv_budget_gb((need + ring_bytes(fmt, ring)) / (1 << 30),
                                        max(0, available_memory_bytes() - mapped))
    return dataclasses.replace(cache, kv_cache_gb=budget), note


def fit_window(max_len: int, num_pages: int, block_size: int, explicit: bool, note: str) -> int:
    """Log one start-up line with the pool's token capacity; return the window served.
    A window the pool cannot hold is refused when ``max_model_len`` was given (``explicit``),
    and served only as far as the pool goes when it came from the model (so ``summarize`` and
    ``ask`` plan with what fits)."""
    capacity = num_pages * block_size
    log.info("KV pool: %d tokens (%d pages of %d; %s); context window %d tokens", capacity,
             num_pages, block_size, note, min(max_len, capacity))
    if max_len <= capacity:
        return max_len
    if explicit:
        raise ConfigError(f"max_model_len {max_len} is more than the KV pool holds: {capacity} tokens "
                          f"({note}); raise kv_cache_gb or give max_model_len <= {capacity}")
    log.warning("the model's window (%d tokens) is more than the KV pool holds: serving up to %d "
                "tokens per request (raise kv_cache_gb to serve the whole window)", max_len, capacity)
    return capacity


def build_prefix_cache(cache: CacheConfig, kv: Any, pool: Any, fmt: FloatPages,
                       fingerprint: str) -> tuple[PrefixCache, KVMover]:
    """The prefix store over ``kv``'s pages (host and disk tiers as ``cache`` asks) and the
    mover that runs its copy orders. Its pages are keyed by the model's ``fingerprint`` (which
    holds the whole ModelConfig, RoPE included: pages cached under another rope_scaling never
    match, on any tier), the pages' dtype and the KV format."""
    host_pages = host_tier_pages(cache.host_tier_gb(torch.device(kv.device).type), fmt.page_bytes(cache.block_size))
    host = HostKVPool(kv, host_pages) if host_pages else None
    disk = None
    if cache.disk_cache_dir:
        disk = DiskKVStore(cache.disk_cache_dir, int(cache.disk_cache_gb * (1 << 30)), kv.page_shape,
                           kv.page_dtype, cache.disk_timeout_s, cache.disk_cache_key_file)
    tree = RadixTree(cache.block_size, host_capacity_pages=host_pages)
    key = ("longctx-kv-1", fingerprint, str(fmt.dtype), fmt.cache_key)
    return PrefixCache(tree, pool, kv, host, disk, key), KVMover(kv, host, disk)

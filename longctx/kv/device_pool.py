"""The device KV pool: the bytes behind the block ids the scheduler hands out.

Owns: per layer the caches of its KV format (``longctx.kv.formats``: float pages are one
tensor for K and one for V, each ``[NB, BS, Hkv, D]``, the layout flash-attn's paged API and
vLLM use), sized from the cache budget; whole pages read out and written in
(``read_pages``/``write_pages``, ``[P, *page_shape]``), the one interface the host and disk
tiers use, so a pool whose pages are spread over ranks (``longctx.engine.sp.ShardedKVPool``) serves
them the same way.
Never: deciding which block is whose (``longctx.cache``) or what runs when (the scheduler).

Allocated with ``torch.empty``: on the CPU, pages nobody has written are never touched, so
resident memory grows with the KV actually used, not with the budget.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from longctx.config import CPU_KV_SHARE, CacheConfig
from longctx.kv.formats import FloatPages
from longctx.kv.window_ring import WindowRing


class KVPages(Protocol):
    """What the runner, the tiers and the prefix store use of a pool: ``DeviceKVPool`` (one
    process) and ``longctx.engine.sp.ShardedKVPool`` (pages spread over ranks) both are one."""

    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    format: FloatPages
    page_shape: tuple[int, ...]
    page_dtype: torch.dtype
    spans_ranks: bool

    def read_pages(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None: ...

    def release(self) -> None: ...


def num_blocks_for(cache: CacheConfig, kv_format: FloatPages, ring: WindowRing | None = None) -> int:
    """Pages in the pool: ``num_blocks``, else as many as ``kv_cache_gb`` holds (with a window
    ring, after the ring's pages, each pool page then holding the global layers only)."""
    if cache.num_blocks:
        return cache.num_blocks
    budget = int(cache.kv_cache_gb * (1 << 30)) - ring_bytes(kv_format, ring)
    if budget <= 0:
        raise ValueError(f"kv_cache_gb {cache.kv_cache_gb:g} does not hold the windowed layers' rings "
                         f"({ring_bytes(kv_format, ring) / (1 << 30):.3f} GiB); raise it")
    return max(1, budget // pool_page_bytes(kv_format, cache.block_size, ring))


def pool_page_bytes(kv_format: FloatPages, block_size: int, ring: WindowRing | None = None) -> int:
    """One pool page's bytes: every layer's, or with a window ring the global layers' only (a
    model whose every layer slides still counts one: its pool's pages, which then hold no
    bytes, keep the scheduler's account of each request's context)."""
    layers = kv_format.model.num_hidden_layers
    held = max(1, layers - (len(ring.layers) if ring is not None else 0))
    return kv_format.page_bytes(block_size) * held // layers


def ring_bytes(kv_format: FloatPages, ring: WindowRing | None) -> int:
    """What a window ring's pages take (0 without one)."""
    if ring is None:
        return 0
    layers = kv_format.model.num_hidden_layers
    return kv_format.page_bytes(ring.block_size) * len(ring.layers) // layers * ring.num_pages


def available_memory_bytes() -> int:
    """Memory the kernel could give this process now (``MemAvailable``), or free pages where
    /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_budget_gb(need_gb: float, available: int | None = None) -> tuple[float, str]:
    """``kv_cache_gb="auto"`` on the CPU, measured after the weights are loaded: ``CPU_KV_SHARE``
    of the available memory, at most ``need_gb`` (what the most requests at the longest context
    can use). Returns the size and a note saying how it was chosen."""
    available = available_memory_bytes() if available is None else available
    share = CPU_KV_SHARE * available / (1 << 30)
    if need_gb <= share:
        return max(need_gb, 1e-3), f"auto: what max_num_seqs x max_model_len need, {need_gb:.2f} GiB"
    return share, f"auto: {CPU_KV_SHARE:.0%} of {available / (1 << 30):.1f} GiB available after the weights"


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
    """Per layer the caches of ``kv_format`` (``longctx.kv.formats``): for float pages
    ``(K, V)``, each ``[NB, BS, Hkv, D]``; a page as the host and disk tiers see it
    (``read_pages``/``write_pages``) has the format's ``page_layout``. A format with an exact
    tail also keeps its store (``tail``, ``tail_slots`` sequences to start with)."""

    spans_ranks = False  # its pages are tensors of this process (``ShardedKVPool``'s are not)

    def __init__(self, kv_format: FloatPages, num_blocks: int, block_size: int, device: torch.device | str,
                 tail_slots: int = 8, ring: WindowRing | None = None) -> None:
        """``ring``: the windowed layers keep only their windows (``longctx.kv.window_ring``):
        their caches hold ``ring.num_pages`` pages, the rest ``num_blocks``; the tiers (which
        copy whole pages of every layer) are not served then."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.format, self.ring = kv_format, ring
        self.dtype, self.device = kv_format.dtype, torch.device(device)
        if ring is None:
            self.caches: list[tuple[torch.Tensor, ...]] = kv_format.allocate(num_blocks, block_size, self.device)
        else:
            n = kv_format.model.num_hidden_layers
            pooled = iter(kv_format.allocate(num_blocks, block_size, self.device, n - len(ring.layers)))
            ringed = iter(kv_format.allocate(ring.num_pages, block_size, self.device, len(ring.layers)))
            self.caches = [next(ringed) if i in ring.layers else next(pooled) for i in range(n)]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [c[:2] for c in self.caches]
        self.tail = kv_format.tail_store(tail_slots, block_size, self.device)
        self.page_shape, self.page_dtype = kv_format.page_layout(block_size)

    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of pages ``block_ids`` on the CPU, ``[P, *page_shape]``."""
        if self.ring is not None:
            raise RuntimeError("a pool whose windowed layers keep only their windows has no whole pages to copy")
        return self.format.read_pages(self.caches, torch.tensor(block_ids, dtype=torch.long, device=self.device))

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write ``pages`` ``[P, *page_shape]`` into blocks ``block_ids`` (same order)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.format.write_pages(self.caches, idx, pages.to(self.device, non_blocking=True))

    def move_slots(self, src: list[int], dst: list[int],
                   ring_moves: tuple[list[int], list[int]] | None = None) -> None:
        """Copy the K/V of token slots ``src`` to slots ``dst`` in every layer (slot = block *
        BS + offset); all sources are read before any destination is written. With a window
        ring, ``src``/``dst`` are the pool layers' slots and ``ring_moves`` the ring's."""
        if not src:
            return
        if self.ring is None:
            self.format.move_slots(self.caches, src, dst)
            return
        ringed = set(self.ring.layers)
        self.format.move_slots([c for i, c in enumerate(self.caches) if i not in ringed], src, dst)
        self.format.move_slots([self.caches[i] for i in self.ring.layers], *ring_moves)

    def release(self) -> None:
        """Drop the tensors (a closed engine hands CUDA memory back)."""
        self.caches, self.layers, self.tail = [], [], None

"""The host KV tier: a CPU pool of pages that device pages are written back to on eviction.

Owns: one K and one V tensor per layer, ``[num_pages, BS, Hkv, D]`` like the device pool, in
pinned memory when the device is CUDA (so copies can run asynchronously), and the copies
between the two pools. Never: deciding which page goes where (``longctx.cache.radix_tree``
plans the moves and owns the host page ids).

On a CPU-only machine this is still a separate pool with its own budget: the write-back,
load and eviction logic runs exactly as it would beside a GPU.
"""

from __future__ import annotations

import torch

from longctx.kv.device_pool import DeviceKVPool


class HostKVPool:
    def __init__(self, device_pool: DeviceKVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        k0 = device_pool.layers[0][0]
        shape = (num_pages, *k0.shape[1:])  # (NH, BS, Hkv, D)
        pin = k0.device.type == "cuda"
        self.layers = [(torch.empty(shape, dtype=k0.dtype, pin_memory=pin),
                        torch.empty(shape, dtype=k0.dtype, pin_memory=pin))
                       for _ in device_pool.layers]
        self.device_pool = device_pool

    def write_back(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pages into host pages (same order)."""
        src = torch.tensor(device_ids, dtype=torch.long, device=self.device_pool.layers[0][0].device)
        dst = torch.tensor(host_ids, dtype=torch.long)
        for (dk, dv), (hk, hv) in zip(self.device_pool.layers, self.layers):
            hk.index_copy_(0, dst, dk.index_select(0, src).to("cpu"))
            hv.index_copy_(0, dst, dv.index_select(0, src).to("cpu"))

    def load(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Copy host pages into device pages (same order)."""
        device = self.device_pool.layers[0][0].device
        src = torch.tensor(host_ids, dtype=torch.long)
        dst = torch.tensor(device_ids, dtype=torch.long, device=device)
        for (dk, dv), (hk, hv) in zip(self.device_pool.layers, self.layers):
            dk.index_copy_(0, dst, hk.index_select(0, src).to(device, non_blocking=True))
            dv.index_copy_(0, dst, hv.index_select(0, src).to(device, non_blocking=True))

    def pages(self, host_ids: list[int]) -> torch.Tensor:
        """The bytes of host pages as one tensor ``[P, L, 2, BS, Hkv, D]`` (for the disk tier)."""
        idx = torch.tensor(host_ids, dtype=torch.long)
        return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1)
                            for k, v in self.layers], 1)


def device_pages(pool: DeviceKVPool, device_ids: list[int]) -> torch.Tensor:
    """The bytes of device pages on the CPU, ``[P, L, 2, BS, Hkv, D]`` (for the disk tier)."""
    idx = torch.tensor(device_ids, dtype=torch.long, device=pool.layers[0][0].device)
    return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1)
                        for k, v in pool.layers], 1).to("cpu")


def store_device_page(pool: DeviceKVPool, device_id: int, page: torch.Tensor) -> None:
    """Write one page ``[L, 2, BS, Hkv, D]`` into device block ``device_id``."""
    page = page.to(pool.layers[0][0].device, non_blocking=True)
    for layer, (k, v) in enumerate(pool.layers):
        k[device_id].copy_(page[layer, 0])
        v[device_id].copy_(page[layer, 1])

"""The host KV tier: a CPU pool of pages that device pages are written back to on eviction.

Owns: one K and one V tensor per layer, ``[num_pages, *page]`` of the device pool's page layout
(float pages ``[num_pages, BS, Hkv, D]``; a quantized format's records of bytes), in
pinned memory when the device is CUDA (so copies can run asynchronously), and the copies
between the two pools, through the device pool's ``read_pages``/``write_pages`` (so the same
code serves a pool whose pages are spread over sequence-parallel ranks). Never: deciding
which page goes where (``longctx.cache.radix_tree`` plans the moves and owns the host page ids).

On a CPU-only machine this is still a separate pool with its own budget: the write-back,
load and eviction logic runs exactly as it would beside a GPU.
"""

from __future__ import annotations

import torch


class HostKVPool:
    def __init__(self, device_pool, num_pages: int) -> None:
        """``device_pool``: a ``DeviceKVPool`` or anything with its ``page_shape``, ``dtype``,
        ``device``, ``read_pages`` and ``write_pages``."""
        if num_pages < 1:
            raise ValueError(f"a host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        num_layers, _, *page = device_pool.page_shape
        shape = (num_pages, *page)  # (NH, BS, Hkv, D), or (NH, record bytes)
        pin = device_pool.device.type == "cuda"
        self.layers = [(torch.empty(shape, dtype=device_pool.page_dtype, pin_memory=pin),
                        torch.empty(shape, dtype=device_pool.page_dtype, pin_memory=pin))
                       for _ in range(num_layers)]
        self.device_pool = device_pool

    def _direct(self) -> bool:
        """The device pool is one set of CPU tensors: copy layer by layer between the pools,
        without gathering whole pages (``[P, L, 2, ...]``) on the way."""
        pool = self.device_pool
        return not pool.spans_ranks and pool.device.type == "cpu" and pool.format.copies_by_layer

    def write_back(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device pages into host pages (same order)."""
        dst = torch.tensor(host_ids, dtype=torch.long)
        if self._direct():
            src = torch.tensor(device_ids, dtype=torch.long)
            for (hk, hv), (k, v) in zip(self.layers, self.device_pool.layers):
                hk.index_copy_(0, dst, k.index_select(0, src))
                hv.index_copy_(0, dst, v.index_select(0, src))
            return
        pages = self.device_pool.read_pages(device_ids)  # (P, L, 2, BS, Hkv, D)
        for layer, (hk, hv) in enumerate(self.layers):
            hk.index_copy_(0, dst, pages[:, layer, 0])
            hv.index_copy_(0, dst, pages[:, layer, 1])

    def load(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Copy host pages into device pages (same order)."""
        if self._direct():
            src = torch.tensor(host_ids, dtype=torch.long)
            dst = torch.tensor(device_ids, dtype=torch.long)
            for (hk, hv), (k, v) in zip(self.layers, self.device_pool.layers):
                k.index_copy_(0, dst, hk.index_select(0, src))
                v.index_copy_(0, dst, hv.index_select(0, src))
            return
        self.device_pool.write_pages(device_ids, self.pages(host_ids))

    def pages(self, host_ids: list[int]) -> torch.Tensor:
        """The bytes of host pages as one tensor ``[P, L, 2, BS, Hkv, D]`` (for the disk tier)."""
        idx = torch.tensor(host_ids, dtype=torch.long)
        return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1)
                            for k, v in self.layers], 1)


def device_pages(pool, device_ids: list[int]) -> torch.Tensor:
    """The bytes of device pages on the CPU, ``[P, L, 2, BS, Hkv, D]`` (for the disk tier)."""
    return pool.read_pages(device_ids)

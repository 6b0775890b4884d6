"""KV storage formats: what a KV page holds, and everything in the engine that depends on it.

Owns: one class per format, chosen once from ``CacheConfig.kv_cache_dtype`` by ``kv_format``:

- ``FloatPages`` (``auto``): K and V in the model's dtype, per layer ``(K, V)``, each
  ``[NB, BS, Hkv, D]``.
- ``Bf16Pages`` (``bfloat16``): K and V stored as bfloat16 under a float32 model (half the
  bytes of its float32 pages, read back in float32 by the kernels, as a bf16 model's pages
  are on the CPU); with a bf16 model, the same pages as ``auto``.
- ``Int8Pages`` (``int8``): symmetric int8 values with an fp32 scale per (page, KV head), per
  layer ``(K, V, K scale, V scale)`` (``longctx.kernels.kv_quant``), rows turned by an
  orthogonal rotation (``kv_quant_rotation``; queries alike, outputs back) and each query's
  first and own page read exact (``kv_quant_exact_tail``: ``longctx.kv.exact_tail``).

A format allocates a layer's caches; gives a page's bytes (the KV budget) and its layout for
the host and disk tiers, reads and writes whole pages and single rows (draft compaction, the
ranks' row exchange); plans a step's attention (``plan``) and, per layer, prepares q/k/v and
the kernels' arguments (``enter``) and finishes their output (``leave``); names itself in the
prefix store's key; builds and sizes the exact tail's store. Nothing else in the engine
branches on a format: ``tests/test_kv_formats.py`` holds the engine to that.
Never: which page is whose (``longctx.cache``) or when anything runs (the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from longctx.config import ConfigError
from longctx.kernels import cpu_build, kv_quant
from longctx.kv.exact_tail import TailStore, tail_store_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class KVStepPlan:
    """What a step's layers share for a format: the rotation (None: rows stored as computed)
    and the tokens whose int8 page may already hold values (None: float pages)."""

    rotation: torch.Tensor | None = None
    write_starts: torch.Tensor | None = None


class FloatPages:
    """Pages in the model's dtype."""

    name = "auto"
    copies_by_layer = True  # a page is its layers' rows: the host tier may copy layer by layer

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        """``model``: a ``ModelConfig``; ``dtype``: the model's compute dtype."""
        self.model, self.dtype = model, dtype
        self.storage_dtype = dtype

    @property
    def cache_key(self) -> str:
        """The format's part of the prefix store's key: pages of another format never match."""
        return str(self.storage_dtype)

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype ``read_rows`` returns."""
        return self.storage_dtype

    def page_bytes(self, block_size: int) -> int:
        """K and V of one page across all layers."""
        m = self.model
        return 2 * m.num_hidden_layers * block_size * m.num_key_value_heads * m.head_dim * _itemsize(self.storage_dtype)

    def page_layout(self, block_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """A page as the host and disk tiers see it: ``(shape, dtype)``."""
        m = self.model
        return (m.num_hidden_layers, 2, block_size, m.num_key_value_heads, m.head_dim), self.storage_dtype

    def allocate(self, num_blocks: int, block_size: int, device: torch.device,
                 num_layers: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (every layer, or ``num_layers``) the caches attention reads
        (``torch.empty``: untouched pages stay unmapped; on the CPU on 4 KiB pages,
        ``cpu_build.small_pages``: the first prefill touches them)."""
        m = self.model
        shape = (num_blocks, block_size, m.num_key_value_heads, m.head_dim)
        caches = [tuple(torch.empty(shape, dtype=self.storage_dtype, device=device) for _ in range(2))
                  for _ in range(m.num_hidden_layers if num_layers is None else num_layers)]
        for cache in caches:
            for pages in cache:
                cpu_build.small_pages(pages)
        return caches

    def read_pages(self, caches: list[tuple[torch.Tensor, ...]], idx: torch.Tensor) -> torch.Tensor:
        """Pages ``idx`` of every layer, ``[P, *page shape]``, on the CPU."""
        return torch.stack([torch.stack([c[0].index_select(0, idx), c[1].index_select(0, idx)], 1)
                            for c in caches], 1).to("cpu")

    def write_pages(self, caches: list[tuple[torch.Tensor, ...]], idx: torch.Tensor, pages: torch.Tensor) -> None:
        for layer, c in enumerate(caches):
            c[0].index_copy_(0, idx, pages[:, layer, 0])
            c[1].index_copy_(0, idx, pages[:, layer, 1])

    def read_rows(self, layer: tuple[torch.Tensor, ...], kv: int, slots: torch.Tensor) -> torch.Tensor:
        """K (``kv`` 0) or V (1) rows at ``slots`` (block * BS + offset): ``[N, Hkv, D]``."""
        cache = layer[kv]
        return cache.view(-1, *cache.shape[2:])[slots]

    def write_rows(self, layer: tuple[torch.Tensor, ...], kv: int, rows: torch.Tensor, slots: torch.Tensor,
                   host_slots: list[int]) -> None:
        """Write ``rows`` at ``slots`` (``host_slots``: the same slots as a host list)."""
        cache = layer[kv]
        cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)

    def move_slots(self, caches: list[tuple[torch.Tensor, ...]], src: list[int], dst: list[int]) -> None:
        """Copy token slots ``src`` to ``dst`` in every layer, all sources read first."""
        s = torch.tensor(src, dtype=torch.long, device=caches[0][0].device)
        d = torch.tensor(dst, dtype=torch.long, device=caches[0][0].device)
        for layer in caches:
            for kv in range(2):
                self.write_rows(layer, kv, self.read_rows(layer, kv, s), d, dst)

    def tail_store(self, num_slots: int, block_size: int, device: torch.device) -> TailStore | None:
        """The exact tail's store of ``num_slots`` sequences, or None (this format needs none)."""
        return None

    def tail_bytes(self, num_slots: int, block_size: int) -> int:
        return 0

    def rotation(self, device: torch.device | str) -> torch.Tensor | None:
        """What stored rows are turned by, or None."""
        return None

    # ------------------------------------------------------------------ attention

    def plan(self, meta: Any, device: torch.device | str) -> KVStepPlan:
        return KVStepPlan()

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: tuple[torch.Tensor, ...],
              plan: KVStepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, dict]:
        """q, k, v as the pages hold them, the kernels' page arguments (both calls), and
        ``write_kv``'s own."""
        return q, k, v, {}, {}

    def leave(self, layer_idx: int, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, layer: tuple[torch.Tensor, ...], scale: float, tail: Any,
              plan: KVStepPlan) -> torch.Tensor:
        """The kernels' output as the model expects it."""
        return out


class Bf16Pages(FloatPages):
    """bfloat16 pages whatever the model's dtype: K and V are rounded to bfloat16 as they are
    written (``write_kv``'s cast, round to nearest even) and the kernels read them back as
    float32, so a float32 model's attention streams half its pages' bytes."""

    name = "bfloat16"

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        super().__init__(model, dtype)
        self.storage_dtype = torch.bfloat16


class Int8Pages(FloatPages):
    """int8 pages with a scale per (page, KV head); see the module docstring."""

    name = "int8"
    copies_by_layer = False  # a page's record holds its values then its scales

    def __init__(self, model: Any, dtype: torch.dtype, rotate: bool = True, exact_tail: bool = True) -> None:
        super().__init__(model, dtype)
        self.storage_dtype = torch.int8
        self.rotate, self.exact_tail = rotate, exact_tail

    @property
    def cache_key(self) -> str:
        return str(self.storage_dtype) + ("+rotated" if self.rotate else "")

    @property
    def row_dtype(self) -> torch.dtype:
        return torch.float32

    def _data_bytes(self, block_size: int) -> int:
        return block_size * self.model.num_key_value_heads * self.model.head_dim

    def page_bytes(self, block_size: int) -> int:
        """K and V of one page across all layers, with their fp32 scales."""
        m = self.model
        return 2 * m.num_hidden_layers * (self._data_bytes(block_size) + 4 * m.num_key_value_heads)

    def page_layout(self, block_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Per layer and K/V a record of bytes: the page's int8 values, then its scales."""
        m = self.model
        return (m.num_hidden_layers, 2, self._data_bytes(block_size) + 4 * m.num_key_value_heads), torch.uint8

    def allocate(self, num_blocks: int, block_size: int, device: torch.device,
                 num_layers: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        heads = self.model.num_key_value_heads
        return [(*values, torch.zeros(num_blocks, heads, device=device), torch.zeros(num_blocks, heads, device=device))
                for values in super().allocate(num_blocks, block_size, device, num_layers)]

    def read_pages(self, caches: list[tuple[torch.Tensor, ...]], idx: torch.Tensor) -> torch.Tensor:
        n = len(idx)
        rows = [torch.stack([torch.cat([c[kv].index_select(0, idx).view(n, -1).view(torch.uint8),
                                        c[2 + kv].index_select(0, idx).view(torch.uint8)], 1)
                             for kv in range(2)], 1)
                for c in caches]
        return torch.stack(rows, 1).to("cpu")

    def write_pages(self, caches: list[tuple[torch.Tensor, ...]], idx: torch.Tensor, pages: torch.Tensor) -> None:
        n, cut = len(idx), self._data_bytes(caches[0][0].shape[1])
        for layer, c in enumerate(caches):
            for kv in range(2):
                record = pages[:, layer, kv]
                c[kv].index_copy_(0, idx, record[:, :cut].contiguous().view(torch.int8).view(n, *c[kv].shape[1:]))
                c[2 + kv].index_copy_(0, idx, record[:, cut:].contiguous().view(torch.float32))

    def read_rows(self, layer: tuple[torch.Tensor, ...], kv: int, slots: torch.Tensor) -> torch.Tensor:
        """Dequantised (float32)."""
        return kv_quant.dequantize_rows(layer[kv], layer[2 + kv], slots)

    def write_rows(self, layer: tuple[torch.Tensor, ...], kv: int, rows: torch.Tensor, slots: torch.Tensor,
                   host_slots: list[int], starts: torch.Tensor | None = None) -> None:
        """Written again under the destination pages' scales (raising them as needed).
        ``starts``: ``kv_quant.run_starts`` of the slots, when the caller has it already."""
        if starts is None:
            starts = kv_quant.run_starts(torch.tensor(host_slots, dtype=torch.long), layer[0].shape[1])
        kv_quant.write_int8(layer[kv], layer[2 + kv], rows, slots, starts.to(slots.device))

    def move_slots(self, caches: list[tuple[torch.Tensor, ...]], src: list[int], dst: list[int]) -> None:
        """As float pages, the destination runs found once for every layer."""
        device = caches[0][0].device
        s, d = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
        starts = kv_quant.run_starts(torch.tensor(dst, dtype=torch.long), caches[0][0].shape[1]).to(device)
        for layer in caches:
            for kv in range(2):
                self.write_rows(layer, kv, self.read_rows(layer, kv, s), d, dst, starts)

    def tail_store(self, num_slots: int, block_size: int, device: torch.device) -> TailStore | None:
        if not self.exact_tail:
            return None
        m = self.model
        return TailStore(m.num_hidden_layers, num_slots, block_size, m.num_key_value_heads, m.head_dim,
                         self._tail_dtype(device), device)

    def _tail_dtype(self, device: torch.device | str) -> torch.dtype:
        # float32 on the CPU (a bf16 model computes in float32 there, and the C exchange reads float32)
        return torch.float32 if torch.device(device).type == "cpu" else self.dtype

    def tail_bytes(self, num_slots: int, block_size: int) -> int:
        if not self.exact_tail:
            return 0
        return tail_store_bytes(self.model, num_slots, block_size, self.dtype)

    def rotation(self, device: torch.device | str) -> torch.Tensor | None:
        return kv_quant.rotation(self.model.head_dim, device) if self.rotate else None

    def plan(self, meta: Any, device: torch.device | str) -> KVStepPlan:
        """The rotation (the same matrix in every layer) and each sequence's first new row:
        the only rows that may enter a page already holding values."""
        num_tokens = sum(meta.query_lens)
        starts = meta.cu_seqlens_q[:-1].long().clamp(max=max(num_tokens - 1, 0))
        return KVStepPlan(self.rotation(device), starts)

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: tuple[torch.Tensor, ...],
              plan: KVStepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, dict]:
        if plan.rotation is not None:
            q, k, v = kv_quant.turn_qkv(q, k, v, plan.rotation)
        return q, k, v, {"k_scale": layer[2], "v_scale": layer[3]}, {"starts": plan.write_starts}

    def leave(self, layer_idx: int, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, layer: tuple[torch.Tensor, ...], scale: float, tail: Any,
              plan: KVStepPlan) -> torch.Tensor:
        if tail is not None:  # each query's first and own page exact
            out = tail.apply(layer_idx, out, lse, q, k, v, layer, scale)
        if plan.rotation is not None:
            out = kv_quant.turn(out, plan.rotation, back=True)
        return out


KV_FORMATS = {FloatPages.name: FloatPages, Bf16Pages.name: Bf16Pages, Int8Pages.name: Int8Pages}


def check_kv_format(cache: Any, dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse, before the model loads, a format the device's kernels do not take: bfloat16
    pages under float32 compute are read by the CPU kernels only (the Triton kernels take K
    and V in q's dtype; on CUDA, dtype='bfloat16' gives bfloat16 pages)."""
    if (cache.kv_cache_dtype == Bf16Pages.name and torch.device(device).type != "cpu"
            and dtype != torch.bfloat16):
        raise ConfigError(f"kv_cache_dtype='bfloat16' under {str(dtype).removeprefix('torch.')} compute is for "
                          f"the CPU; on {torch.device(device).type} give dtype='bfloat16' (its pages are bfloat16)")


def kv_format(cache: Any, model: Any, dtype: torch.dtype) -> FloatPages:
    """The format ``cache`` (a ``CacheConfig``) asks for, for ``model`` computing in ``dtype``."""
    if cache.kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_FORMATS)}, got {cache.kv_cache_dtype!r}")
    if cache.kv_cache_dtype == Int8Pages.name:
        return Int8Pages(model, dtype, cache.kv_quant_rotation, cache.kv_quant_exact_tail)
    if cache.kv_cache_dtype == Bf16Pages.name:
        return Bf16Pages(model, dtype)
    return FloatPages(model, dtype)

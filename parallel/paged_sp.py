"""Attention for one engine step whose KV pages are spread over ranks ("queries travel").

Owns: ``assign_tokens`` (which rank computes which of a step's tokens), ``ShardedStep`` (what
one rank derives from the step's plain data: its tokens, the KV slots it writes, its pages
per sequence, the gather/scatter orders) and ``PagedSPAttention.forward(layer, q, k, v,
step)``, the attention backend the unchanged model calls on every rank.
Never: scheduling, sampling, processes, or page placement (the caller maps a global block
id ``b`` to rank ``b % N``, local id ``b // N``).

Why queries travel and pages stay: a step's new tokens are few next to a long document's
cached KV (a 2K chunk against 30K cached tokens), so sending every rank the step's q/k/v and
sending each token's partial result home moves O(step) bytes per layer, where moving pages
around a ring would move O(context). Each layer, on every rank::

    all-gather q, k, v of the step's tokens            (each rank computed its own tokens')
    write the K/V rows whose slots are on this rank's pages
    (a) every query of the step over this rank's pages below the step's first position
        (all visible: no mask; paged kernel with an all-ones tree mask for up to 63
        queries, else the pages gathered and the fused dense kernel)
    all-to-all: each query's partial (out, lse) goes to the rank that owns the query
    (b) own queries over the step's own new tokens of their sequence (causal, or the
        draft tree), from the gathered K/V
    merge (b) with the N partials of (a) by log-sum-exp

Pages of a lone sequence alternate over the ranks (the block pool hands out lowest ids
first), so (a) is balanced at every context length; ``assign_tokens`` splits a prefill
chunk zigzag (rank r takes pieces r and 2N-1-r), which balances (b)'s causal work, and keeps
small steps (decode, verification: weight reads, not arithmetic) whole on rank 0, so the
linear layers of one token run once, not N times.

Shape legend: T tokens in the step, T_r of them owned by rank r, N ranks, H query heads,
Hkv kv heads, D head dim, BS page size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from longctx.kernels import kv_quant
from longctx.kernels.cpu_build import set_cpu_threads

from .comm import RingComm
from .local_attention import attend, attend_masked, attend_masked_blocks, empty_state, merge_into
from .sharded_kv import pack_state, unpack_state

MAX_TREE_QUERIES = 63  # the kernels' tree masks cover this many new tokens per sequence
MIN_SPLIT_TOKENS = 32  # a step with fewer tokens runs whole on rank 0 (see ``assign_tokens``)


def slot_owner(slot: int, block_size: int, world: int) -> int:
    """The rank holding a global KV slot (block id * BS + offset): block ``b`` is on ``b % N``."""
    return (slot // block_size) % world


def local_slot(slot: int, block_size: int, world: int) -> int:
    """A global slot's place in its owner's pool (block ``b`` is local block ``b // N``)."""
    return (slot // block_size // world) * block_size + slot % block_size


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def assign_tokens(query_lens: list[int], world: int, min_split: int = MIN_SPLIT_TOKENS) -> list[list[int]]:
    """The step's token indices (flattened over sequences) each rank computes, ascending.

    Fewer than ``min_split`` tokens in all: every one on rank 0 (their linear layers read
    the weights once, near the read bandwidth; splitting them would read them N times).
    Otherwise a sequence with at least ``2 N`` new tokens is cut into ``2 N`` near-equal
    pieces and rank r takes pieces r and 2N-1-r (equal causal work); a shorter one goes
    whole to the rank with the fewest tokens so far."""
    owned: list[list[int]] = [[] for _ in range(world)]
    total = sum(query_lens)
    if world == 1 or total < min_split:
        owned[0] = list(range(total))
        return owned
    start = 0
    for n in query_lens:
        if n >= 2 * world:
            cuts = [start + n * i // (2 * world) for i in range(2 * world + 1)]
            for r in range(world):
                for piece in (r, 2 * world - 1 - r):
                    owned[r].extend(range(cuts[piece], cuts[piece + 1]))
        else:
            least = min(range(world), key=lambda r: len(owned[r]))
            owned[least].extend(range(start, start + n))
        start += n
    return [sorted(o) for o in owned]


def exchange_bytes(max_owned: int, world: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   itemsize: int, num_layers: int) -> int:
    """The cost model: bytes one rank sends in one step's attention exchanges (as
    ``RingComm`` counts them: what a direct exchange puts on the wire from this rank), when
    the rank owning the most tokens owns ``max_owned``. Per layer: the all-gather of q, k, v
    (every row padded to ``max_owned``) to N-1 peers, and the all-to-all of fp32 partials
    (out and lse) for the other ranks' tokens. The hidden states brought to rank 0 for
    sampling (one row per sampling token, when not already there) come on top."""
    gather = (world - 1) * max_owned * (num_heads + 2 * num_kv_heads) * head_dim * itemsize
    partials = (world - 1) * max_owned * num_heads * (head_dim + 1) * 4
    return num_layers * (gather + partials)


def column_exchange_bytes(num_tokens: int, world: int, out_features: list[int], num_heads: int,
                          head_dim: int, itemsize: int, num_layers: int, num_sampled: int = 0,
                          vocab: int = 0) -> int:
    """The cost model of a ``ColumnSplit`` step (every rank holds all ``num_tokens``): bytes
    one rank sends. Per layer, each product's slice (``out_features`` of each of the layer's
    products, split N ways) and the fp32 partials of attention go to N-1 peers; then the
    LM head's slice for the ``num_sampled`` rows."""
    per_layer = sum(-(-n // world) for n in out_features) * itemsize + num_heads * (head_dim + 1) * 4
    return (world - 1) * num_tokens * (num_layers * per_layer) + (world - 1) * num_sampled * -(-vocab // world) * 4


@dataclass(frozen=True)
class StepSeq:
    """One sequence of the step, as plain data every rank has."""

    start: int  # flat index of its first new token
    num_new: int  # new tokens (T_s)
    start_pos: int  # tokens cached before the step
    block_ids: tuple[int, ...]  # global block ids of its pages
    tree_words: tuple[int, ...] = ()  # per new token: ancestor bits (lookahead); () = causal


class ShardedStep:
    """What rank ``rank`` of ``world`` derives from one step: built once, used by every layer."""

    def __init__(self, seqs: list[StepSeq], owned: list[list[int]] | None, slots: list[int], rank: int,
                 world: int, block_size: int, device: torch.device,
                 threads: tuple[int, int] | None = None, split_linear: Any = None) -> None:
        """``owned``: each rank's tokens (``assign_tokens``), or None when every rank holds
        every token (``ColumnSplit`` steps: ``split_linear`` is then the model's product).
        ``threads``: (outside attention, inside it) CPU threads, when they differ (a rank
        that computes every token's linear layers alone may use the idle ranks' cores)."""
        self.seqs, self.rank, self.world = seqs, rank, world
        self.threads = threads if threads is not None and threads[0] != threads[1] else None
        self.replicated = owned is None
        self.split_linear = split_linear
        self.max_position: int | None = None  # (RoPE tables: the model reads it from any step)
        self.tail: Any = None  # int8 pages: the step's exact tail (``longctx.kv.exact_tail.TailStep``)
        all_tokens = list(range(sum(s.num_new for s in seqs)))
        self.num_tokens = len(all_tokens)
        self.kernel_cache: dict = {}  # the kernels' per-step plans (same metadata every layer)
        if owned is not None:  # tokens split: where each token's row goes in the exchanges
            self._plan_exchanges(owned, device)
        self._owners = [slot_owner(s, block_size, world) for s in slots]
        self._device = device
        mine = [(t, s) for t, s in enumerate(slots) if self._owners[t] == rank]
        self.write_rows = _long([t for t, _ in mine], device)
        self.write_slots = _long([local_slot(s, block_size, world) for _, s in mine], device)
        self.has_own_part = any(seq.num_new > 1 for seq in seqs)  # the same on every rank
        self._plan_cached_part(block_size, device)
        self._plan_own_part(all_tokens if owned is None else owned[rank], device)

    def _plan_exchanges(self, owned: list[list[int]], device: torch.device) -> None:
        """Rows of the all-gather (token t -> its row in [N * max_owned]) and of the all-to-all
        (row r * max_owned + i -> rank r's i-th token)."""
        self.num_owned = [len(o) for o in owned]
        self.max_owned = max(1, max(self.num_owned))
        rows = [0] * self.num_tokens
        for r, own in enumerate(owned):
            for i, t in enumerate(own):
                rows[t] = r * self.max_owned + i
        self.gather_rows = _long(rows, device)
        self.scatter_rows = _long([own[i] if i < len(own) else 0
                                   for own in owned for i in range(self.max_owned)], device)

    @functools.cached_property
    def written(self) -> tuple[int, torch.Tensor]:
        """int8 pages (part (b) reads the step's new K/V as stored, as one process does): the
        most rows any rank wrote, and token t's row ``r * most + i`` among every rank's written
        rows (rank r's i-th). Derived on first use, by int8 steps only."""
        rows: list[list[int]] = [[] for _ in range(self.world)]
        for t, owner in enumerate(self._owners):
            rows[owner].append(t)
        most = max(1, max(len(r) for r in rows))
        at = [0] * len(self._owners)
        for r, own in enumerate(rows):
            for i, t in enumerate(own):
                at[t] = r * most + i
        return most, _long(at, self._device)

    def _local_prefix(self, seq: StepSeq, block_size: int) -> tuple[list[int], int]:
        """This rank's local block ids holding the sequence's tokens that every new token sees
        in full, in order, and how many such tokens they hold (every page full but possibly the
        last): those before the step, and a lone new token itself (its K/V is written before
        attention runs, so it needs no part (b))."""
        end = seq.start_pos + (seq.num_new == 1)
        num_pages = -(-end // block_size)
        pages = [b // self.world for b in seq.block_ids[:num_pages] if b % self.world == self.rank]
        tokens = len(pages) * block_size
        last = num_pages - 1
        if pages and seq.block_ids[last] % self.world == self.rank:
            tokens -= num_pages * block_size - end
        return pages, tokens

    def local_window_pages(self, seq: StepSeq, block_size: int, window: int | None) -> tuple[list[int], list[int]]:
        """This rank's local pages of the sequence's keys before the step (and a lone new
        token) that a query of the step may see under ``window`` (None: all of them), in order,
        with each held token's position: a window keeps the pages from the one holding its
        first new token's first visible key. Derived once per step and window."""
        key = ("window_pages", seq.start, window)
        found = self.kernel_cache.get(key)
        if found is None:
            end = seq.start_pos + (seq.num_new == 1)
            first = 0 if window is None else max(0, seq.start_pos - window + 1)
            pages, positions = [], []
            for i, b in enumerate(seq.block_ids[:-(-end // block_size)]):
                if b % self.world != self.rank or (i + 1) * block_size <= first:
                    continue
                pages.append(b // self.world)
                positions.extend(range(i * block_size, min((i + 1) * block_size, end)))
            found = self.kernel_cache[key] = (pages, positions)
        return found

    def _plan_cached_part(self, block_size: int, device: torch.device) -> None:
        """(a): small sequences go to one paged-kernel call, the rest to dense calls."""
        paged: list[tuple[StepSeq, list[int], int]] = []
        self.dense: list[tuple[slice, torch.Tensor, int]] = []  # (query rows, local pages, tokens)
        for seq in self.seqs:
            pages, tokens = self._local_prefix(seq, block_size)
            if tokens == 0:
                continue
            if seq.num_new <= MAX_TREE_QUERIES and tokens >= seq.num_new:
                paged.append((seq, pages, tokens))
            else:
                idx = torch.tensor(pages, dtype=torch.long, device=device)
                self.dense.append((slice(seq.start, seq.start + seq.num_new), idx, tokens))
        self.paged_rows = None
        if not paged:
            return
        width = max(len(p) for _, p, _ in paged)
        self.paged_rows = torch.tensor([t for s, _, _ in paged for t in range(s.start, s.start + s.num_new)],
                                       dtype=torch.long, device=device)
        self.paged_table = torch.tensor([p + [0] * (width - len(p)) for _, p, _ in paged],
                                        dtype=torch.int32, device=device)
        self.paged_lens = torch.tensor([n for _, _, n in paged], dtype=torch.int32, device=device)
        cu = [0]
        for s, _, _ in paged:
            cu.append(cu[-1] + s.num_new)
        self.paged_cu = torch.tensor(cu, dtype=torch.int32, device=device)
        all_visible = [(1 << s.num_new) - 1 for s, _, _ in paged for _ in range(s.num_new)]
        self.paged_words = (None if all(s.num_new == 1 for s, _, _ in paged)
                            else torch.tensor(all_visible, dtype=torch.int64, device=device))
        self.paged_is_all = not self.dense and len(self.paged_rows) == self.num_tokens  # rows 0..T-1

    def _plan_own_part(self, own: list[int], device: torch.device) -> None:
        """(b): own tokens as runs inside their sequences (a lone new token, as in decode, has
        none: part (a) covers it)."""
        self.runs: list[tuple[StepSeq, int, int, int]] = []  # (seq, i0, i1, row of i0 among own)
        at = {t: i for i, t in enumerate(own)}
        for seq in self.seqs:
            i = 0
            while i < seq.num_new:
                if seq.start + i not in at:
                    i += 1
                    continue
                j = i
                while j < seq.num_new and seq.start + j in at:
                    j += 1
                if seq.num_new > 1:
                    self.runs.append((seq, i, j, at[seq.start + i]))
                i = j


def _query_positions(seq: StepSeq, i0: int, i1: int, device: torch.device) -> torch.Tensor:
    """Positions of the sequence's new tokens i0..i1-1: after the cached ones in order, or
    under a draft tree at their depth (``reference.token_positions``)."""
    if seq.tree_words:
        depth = [bin(w).count("1") - 1 for w in seq.tree_words[i0:i1]]
        return torch.tensor([seq.start_pos + d for d in depth], dtype=torch.long, device=device)
    return torch.arange(seq.start_pos + i0, seq.start_pos + i1, device=device)


def _visible(seq: StepSeq, i0: int, i1: int, device: torch.device) -> torch.Tensor:
    """Bool [i1 - i0, i1]: which of the sequence's first i1 new tokens queries i0..i1-1 see."""
    cols = torch.arange(i1, device=device)
    if seq.tree_words:
        words = torch.tensor(seq.tree_words[i0:i1], dtype=torch.int64, device=device)
        return (words[:, None] >> cols[None, :]) & 1 == 1
    return cols[None, :] <= torch.arange(i0, i1, device=device)[:, None]


class ColumnSplit:
    """A weight product shared by the ranks by output features: rank r computes its slice of
    ``weight``'s rows (a contiguous view of the ``[out, in]`` matrix, so nothing is copied) with
    ``linear`` (``cpu_linear.linear``'s signature: norm or SwiGLU prologue, bias, residual),
    and the slices are all-gathered. Every rank reads 1/N of every weight: the form for steps
    of a few tokens, whose products stream the weights (decode, verification)."""

    def __init__(self, comm: RingComm, linear: Any) -> None:
        self.comm, self.linear = comm, linear
        self._cuts: dict[int, tuple[list[int], int]] = {}

    def bounds(self, num_out: int) -> tuple[list[int], int]:
        """Where each rank's slice of ``num_out`` features starts (and the last ends), and the
        widest slice."""
        if num_out not in self._cuts:
            world = self.comm.world_size
            cuts = [num_out * r // world for r in range(world + 1)]
            self._cuts[num_out] = cuts, max(b - a for a, b in zip(cuts, cuts[1:]))
        return self._cuts[num_out]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 residual: torch.Tensor | None = None, **prologue: Any) -> torch.Tensor:
        cuts, widest = self.bounds(weight.shape[0])
        lo, hi = cuts[self.comm.rank], cuts[self.comm.rank + 1]
        part = x.new_empty((x.shape[0], widest))  # (T, widest): this rank's slice, padded
        sliced = dict(prologue, residual=None if residual is None else residual[:, lo:hi])
        own_bias = None if bias is None else bias[lo:hi]
        if hi - lo == widest:
            self.linear(x, weight[lo:hi], own_bias, out=part, **sliced)
        else:
            part[:, :hi - lo] = self.linear(x, weight[lo:hi], own_bias, **sliced)
        every = self.comm.all_gather(part)  # (N, T, widest)
        if all(b - a == widest for a, b in zip(cuts, cuts[1:])):
            return every.permute(1, 0, 2).reshape(x.shape[0], -1)  # (T, out)
        return torch.cat([every[r, :, :b - a] for r, (a, b) in enumerate(zip(cuts, cuts[1:]))], dim=1)


class PagedSPAttention:
    """The attention backend of a model whose KV pages are spread over ``comm``'s ranks.
    ``kv_layers``: this rank's pages per layer, (K, V) ``[NB_r, BS, Hkv, D]``, or for int8
    pages (K, V, K scale, V scale) with the scales fp32 ``[NB_r, Hkv]`` (``kv_quant.py``);
    ``kernels``: ``longctx.kernels.torch_paged`` (CPU) or ``triton_attention`` (CUDA).
    ``rotate_int8``: int8 pages hold K/V turned by ``kv_quant.rotation`` (as the one-process
    backend writes them, ``CacheConfig.kv_quant_rotation``): q, k and v are turned on the way in and
    the output turned back, so every rank reads and writes pages as one process would."""

    def __init__(self, kv_layers: list[tuple[torch.Tensor, ...]], comm: RingComm,
                 kernels: Any, head_dim: int, rotate_int8: bool = True) -> None:
        self.kv_layers, self.comm, self.kernels = kv_layers, comm, kernels
        self.scale = 1.0 / math.sqrt(head_dim)
        self.name = f"sequence-parallel[{comm.world_size}]"
        quantized = len(kv_layers[0]) == 4 if kv_layers else False
        self.rotation = (kv_quant.rotation(head_dim, kv_layers[0][0].device)
                         if quantized and rotate_int8 else None)

    def _extra(self, step: ShardedStep) -> dict:
        return {"step_cache": step.kernel_cache}

    def plan(self, step: ShardedStep) -> ShardedStep:
        """A ``ShardedStep`` is this backend's plan already (built once per step by its rank)."""
        return step

    def run(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            step: ShardedStep, scale: float | None = None, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        """The backend's ``run`` (``longctx.attention``); a layer's own ``scale`` scales q
        (the same scores). A sliding window or a score cap (``masked``) takes masked products
        over the keys each query can see, found by their positions in the sequence: a rank's
        pages hold every ``N``-th page, so the window is not a run of its local keys."""
        if scale is not None and scale != self.scale:
            q = q * (scale / self.scale)
        masked = None if window is None and softcap is None else (window, softcap)
        return self.forward(layer_idx, q, k, v, step, masked)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                step: ShardedStep, masked: tuple | None = None) -> torch.Tensor:
        """q [T_r, H, D], k/v [T_r, Hkv, D]: this rank's tokens -> out [T_r, H, D].
        ``masked``: the layer's (window, softcap), or None."""
        if step.threads is None:
            return self._forward(layer_idx, q, k, v, step, masked)
        set_cpu_threads(step.threads[1])
        try:
            return self._forward(layer_idx, q, k, v, step, masked)
        finally:
            set_cpu_threads(step.threads[0])

    def _forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 step: ShardedStep, masked: tuple | None = None) -> torch.Tensor:
        num_heads, num_kv = q.shape[1], k.shape[1]
        k_cache, v_cache, *scales = self.kv_layers[layer_idx]
        quant = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
        rot = self.rotation
        if rot is not None:  # int8 pages hold turned K/V (see the class)
            q, k, v = kv_quant.turn_qkv(q, k, v, rot)
        if step.replicated:  # every rank computed every token's q, k, v
            q_all, k_all, v_all = q, k, v
        else:
            mine = torch.cat([q, k, v], dim=1)  # (T_r, H + 2 Hkv, D)
            mine = F.pad(mine, (0, 0, 0, 0, 0, step.max_owned - mine.shape[0]))
            every = self.comm.all_gather(mine).flatten(0, 1).index_select(0, step.gather_rows)  # (T, ., D)
            q_all, k_all, v_all = every.split([num_heads, num_kv, num_kv], dim=1)
        exact_k, exact_v = k_all, v_all
        if step.write_rows.numel():  # int8: write_kv finds the rows that enter a page holding values
            self.kernels.write_kv(k_cache, v_cache, k_all[step.write_rows], v_all[step.write_rows],
                                  step.write_slots, **quant, **self._extra(step))
        if masked is None:
            cached_out, cached_lse = self._cached_part(q_all, k_cache, v_cache, step, quant)
        else:
            cached_out, cached_lse = self._cached_part_masked(q_all, k_cache, v_cache, step, quant, *masked)
        if quant and step.has_own_part:  # (b) reads the new K/V as the pages hold them now
            k_all, v_all = self._stored_rows(k_cache, v_cache, quant, step, q_all.dtype)
        if step.replicated:  # every rank needs every token's result
            received = self.comm.all_gather(pack_state(cached_out, cached_lse))  # (N, T, H, D + 1)
        else:
            sent = pack_state(cached_out, cached_lse).index_select(0, step.scatter_rows)
            received = self.comm.all_to_all(sent.view(self.comm.world_size, step.max_owned, num_heads, -1))
        parts_out, parts_lse = unpack_state(received[:, :q.shape[0]])  # (N, T_r, H, D), (N, T_r, H)
        if step.runs:
            out, lse = self._own_part(q_all, k_all, v_all, q.shape[0], step, masked)
            first = 0
        else:  # nothing of (b) here (decode): start from rank 0's partial
            out, lse, first = parts_out[0].clone(), parts_lse[0].clone(), 1
        for r in range(first, self.comm.world_size):
            merge_into(out, lse, parts_out[r], parts_lse[r])
        tail = step.tail if masked is None else None  # (windows and caps: every key as stored, as in one process)
        if quant and tail is not None:  # each query's first and own page exact, as in one process
            old = self._tail_stored_rows(k_cache, v_cache, quant, step, tail)
            out = tail.apply(layer_idx, out.contiguous(), lse.contiguous(), q_all.contiguous(), exact_k.contiguous(),
                             exact_v.contiguous(), self.kv_layers[layer_idx], self.scale, old=old)
        if rot is not None:
            out = kv_quant.turn(out.float(), rot, back=True)
        return out.to(q.dtype)

    def _stored_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, quant: dict, step: ShardedStep,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K/V of the step as its int8 page holds it after the step's writes
        (a later row may have rescaled its page), dequantised: one all-gather of the rows each
        rank wrote. -> k, v [T, Hkv, D] in ``dtype``."""
        num_kv, d = k_cache.shape[2], k_cache.shape[3]
        most, written_at = step.written
        mine = torch.zeros((most, 2, num_kv, d), dtype=torch.float32, device=k_cache.device)
        n = step.write_slots.numel()
        if n:
            mine[:n, 0] = kv_quant.dequantize_rows(k_cache, quant["k_scale"], step.write_slots)
            mine[:n, 1] = kv_quant.dequantize_rows(v_cache, quant["v_scale"], step.write_slots)
        every = self.comm.all_gather(mine).flatten(0, 1).index_select(0, written_at)  # (T, 2, Hkv, D)
        return every[:, 0].to(dtype), every[:, 1].to(dtype)

    def _tail_stored_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, quant: dict, step: ShardedStep,
                          tail: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exact tail's keys as their int8 pages hold them (``TailStep.stored_rows`` over
        ranks): each rank reads the rows on its pages, one all-gather brings every rank all."""
        if not tail.num_groups:
            return None
        tail.ready()
        plan = step.kernel_cache.get("tail.rows")
        if plan is None:
            bs, world = k_cache.shape[1], self.comm.world_size
            slots = tail.pool_slots
            owner = (slots // bs) % world
            mine = (owner == self.comm.rank)[:, None, None]
            local = torch.where(mine[:, 0, 0], (slots // bs // world) * bs + slots % bs, 0)
            pick = owner * slots.numel() + torch.arange(slots.numel(), device=slots.device)
            plan = step.kernel_cache["tail.rows"] = (local, mine, pick)
        local, mine, pick = plan
        rows = torch.stack([kv_quant.dequantize_rows(k_cache, quant["k_scale"], local),
                            kv_quant.dequantize_rows(v_cache, quant["v_scale"], local)], 1)
        rows = torch.where(mine[:, None], rows, 0)  # (G * Kw, 2, Hkv, D)
        every = self.comm.all_gather(rows).flatten(0, 1).index_select(0, pick)
        return every[:, 0], every[:, 1]

    def _cached_part(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     step: ShardedStep, quant: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(a): every query of the step over this rank's pages before the step's tokens
        (``quant``: an int8 cache's scales)."""
        if step.paged_rows is not None and step.paged_is_all:  # e.g. decode: one call, every query
            o, l = self.kernels.paged_attention(q, k_cache, v_cache, step.paged_table, step.paged_lens,
                                                step.paged_cu, scale=self.scale, tree_mask=step.paged_words,
                                                **quant, **self._extra(step))
            return o.float(), l
        out, lse = empty_state(q)  # (T, H, D) fp32, (T, H)
        if step.paged_rows is not None:
            o, l = self.kernels.paged_attention(q[step.paged_rows], k_cache, v_cache, step.paged_table,
                                                step.paged_lens, step.paged_cu, scale=self.scale,
                                                tree_mask=step.paged_words, **quant, **self._extra(step))
            out[step.paged_rows], lse[step.paged_rows] = o.float(), l
        for rows, pages, tokens in step.dense:
            keys, values = k_cache.index_select(0, pages), v_cache.index_select(0, pages)
            if quant:  # int8 pages, dequantised into the queries' dtype
                keys = kv_quant.dequantize(keys, quant["k_scale"].index_select(0, pages), q.dtype)
                values = kv_quant.dequantize(values, quant["v_scale"].index_select(0, pages), q.dtype)
            keys = keys.flatten(0, 1)[:tokens]  # (tokens, Hkv, D)
            values = values.flatten(0, 1)[:tokens]
            o, l = attend(q[rows], keys, values, causal=False, scale=self.scale)
            out[rows], lse[rows] = o.float(), l
        return out, lse

    def _cached_part_masked(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            step: ShardedStep, quant: dict, window: int | None,
                            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(a) for a windowed or capped layer: per sequence, this rank's pages that hold keys
        some query of the step sees (a window's pages only), gathered, against a mask built
        from the keys' and queries' positions (``reference.py``'s window convention)."""
        out, lse = empty_state(q)
        bs = k_cache.shape[1]
        for seq in step.seqs:
            pages, positions = step.local_window_pages(seq, bs, window)
            if not pages:
                continue
            idx = torch.tensor(pages, dtype=torch.long, device=q.device)
            keys, values = k_cache.index_select(0, idx), v_cache.index_select(0, idx)
            if quant:
                keys = kv_quant.dequantize(keys, quant["k_scale"].index_select(0, idx), q.dtype)
                values = kv_quant.dequantize(values, quant["v_scale"].index_select(0, idx), q.dtype)
            n = len(positions)
            keys, values = keys.flatten(0, 1)[:n], values.flatten(0, 1)[:n]
            pos_k = torch.tensor(positions, dtype=torch.long, device=q.device)
            pos_q = _query_positions(seq, 0, seq.num_new, q.device)
            visible = pos_k[None, :] <= pos_q[:, None]
            if window is not None:
                visible &= pos_q[:, None] - pos_k[None, :] < window
            rows = slice(seq.start, seq.start + seq.num_new)
            o, l = attend_masked_blocks(q[rows], keys, values, visible, self.scale, softcap)
            out[rows], lse[rows] = o, l
        return out, lse

    def _own_part(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_own: int,
                  step: ShardedStep, masked: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(b): this rank's queries over the new tokens of their own sequence (``masked``:
        the layer's window and cap, through masked products)."""
        out = torch.zeros((num_own, *q.shape[1:]), dtype=torch.float32, device=q.device)
        lse = torch.full((num_own, q.shape[1]), float("-inf"), device=q.device)
        for seq, i0, i1, at in step.runs:
            base = seq.start
            qs, ks, vs = q[base + i0:base + i1], k[base:base + i1], v[base:base + i1]
            if masked is not None:
                window, softcap = masked
                visible = _visible(seq, i0, i1, q.device)
                if window is not None:
                    pos = _query_positions(seq, 0, i1, q.device)
                    visible &= pos[i0:, None] - pos[None, :] < window
                o, l = attend_masked_blocks(qs, ks, vs, visible, self.scale, softcap)
            elif seq.tree_words or i1 - i0 <= MAX_TREE_QUERIES:
                o, l = attend_masked(qs, ks, vs, _visible(seq, i0, i1, q.device), self.scale)
            else:  # earlier new tokens all visible, then the causal diagonal block
                o, l = attend(qs, ks[i0:], vs[i0:], causal=True, scale=self.scale)
                o, l = o.float(), l.clone()
                if i0:
                    before_o, before_l = attend(qs, ks[:i0], vs[:i0], causal=False, scale=self.scale)
                    merge_into(o, l, before_o, before_l)
            out[at:at + i1 - i0], lse[at:at + i1 - i0] = o.float(), l
        return out, lse

    def idle(self, num_layers: int, step: ShardedStep, like: torch.Tensor, num_heads: int,
             num_kv_heads: int, dtype: torch.dtype) -> None:
        """A rank that owns no token of the step still serves every layer's exchange. ``like``:
        a KV page (head dim, device); ``dtype``: the activations' (a bf16 model on the CPU
        row kernel has fp32 activations over bf16 pages)."""
        head_dim = like.shape[-1]
        empty_q = like.new_empty((0, num_heads, head_dim), dtype=dtype)
        empty_kv = like.new_empty((0, num_kv_heads, head_dim), dtype=dtype)
        for layer in range(num_layers):
            self.forward(layer, empty_q, empty_kv, empty_kv, step)

"""One rank's half of sequence-parallel inference: its KV shard and the attention backend
that makes the unchanged model attend across ranks.

Owns: ``SequenceParallelConfig``; ``ShardKV`` (this rank's pages, [NB, BS, Hkv, D] per layer,
and how many tokens it holds); ``SPStep`` (what one forward is: a prefill round or a decode
step); ``SequenceParallelBackend.forward(layer_idx, q, k, v, step)``, the attention backend the
model calls in place of the paged one.
Never: sampling or the generation loop (``sp_generate``), process start-up (``launch``).

This module sits above ``longctx.model`` (it reads the model's config and the KV pool
layout), unlike the rest of ``longctx.parallel``, which needs only torch and the kernels.

Where KV lives. A rank's shard is a bag of tokens in arrival order: every token it computed in
prefill rounds, plus every decode token whose position p has p % N == rank (round robin, so
KV and decode attention stay balanced). Order inside a shard does not matter, because a shard
is only ever attended without a mask: earlier rounds precede every query of a later round, and
the whole context precedes a decode query. No rank ever holds another rank's KV.

One layer of a prefill round (this rank holds L_r of the round's tokens, zigzag):

    write K/V of the L_r tokens to this rank's pages
    ring attention over the round (causal)           (K/V of the round travel the ring)
    attention over the earlier rounds, all visible,  whichever moves fewer bytes
    (``prefix_exchange_bytes``):
      K/V travel: the earlier-round shards go around the ring too, or
      queries travel: all-gather the round's queries (started before the ring, so it overlaps
      it), attend them all over this rank's shard, all-to-all the partials back
    merge by log-sum-exp

One layer of a decode step (every rank runs the model on the same token):

    the rank that owns the position writes the token's K/V
    every rank attends the query over its shard; all-gather (out, lse); merge in rank order

Shape legend: T tokens in the step on this rank, H query heads, Hkv kv heads, D head dim,
NB pages, BS page size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from longctx.kv.device_pool import DeviceKVPool
from longctx.model.config import ModelConfig

from .comm import RingComm
from .local_attention import attend, empty_state, merge_into
from .ring_attention import ring_attention
from .sharded_kv import gather_queries, merge_decode_partials, prefix_attention, ring_prefix_attention
from .sharding import MODES, SequenceSharding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SequenceParallelConfig:
    """How one request is split: ``world_size`` ranks, each taking ``chunk_size`` prompt
    tokens per prefill round (a round covers world_size * chunk_size tokens)."""

    world_size: int
    chunk_size: int = 2048
    block_size: int = 64
    sharding: str = "zigzag"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        checks = [
            (self.world_size >= 1, f"sequence_parallel_size must be >= 1, got {self.world_size}"),
            (self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}"),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.sharding in MODES, f"sharding must be one of {', '.join(MODES)}, got {self.sharding!r}"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def round_size(self) -> int:
        return self.world_size * self.chunk_size

    def rounds(self, num_tokens: int) -> list[SequenceSharding]:
        """The prefill rounds of a prompt, each sharded over the ranks."""
        return [SequenceSharding(min(self.round_size, num_tokens - start), self.world_size,
                                 self.sharding, offset=start)
                for start in range(0, num_tokens, self.round_size)]

    def decode_owner(self, position: int) -> int:
        """The rank that keeps the KV of the decode token at ``position`` (round robin)."""
        return position % self.world_size

    def tokens_held(self, rank: int, num_prompt: int, max_new: int) -> int:
        """The most tokens ``rank`` stores for a prompt and ``max_new`` sampled tokens (the
        last sampled token's KV is never computed)."""
        prefill = sum(r.length(rank) for r in self.rounds(num_prompt))
        decode = sum(1 for p in range(num_prompt, num_prompt + max_new - 1) if self.decode_owner(p) == rank)
        return prefill + decode


class ShardKV:
    """This rank's KV pages, filled in arrival order. Pages are ids 0..NB-1 in order, so
    a shard is read as one view of the pool (no gather)."""

    def __init__(self, config: ModelConfig, capacity: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        num_blocks = max(1, -(-capacity // block_size))
        self.pool = DeviceKVPool(config, num_blocks, block_size, dtype, device)
        self.capacity = num_blocks * block_size
        self.num_tokens = 0
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]  # (1, NB)

    def next_slots(self, count: int) -> torch.Tensor:
        """Slots for the next ``count`` tokens, int64 [count] (``commit`` makes them held)."""
        if self.num_tokens + count > self.capacity:
            raise RuntimeError(f"KV shard full: {self.num_tokens} + {count} tokens > capacity {self.capacity}")
        return torch.arange(self.num_tokens, self.num_tokens + count, device=self.block_table.device)

    def commit(self, count: int) -> None:
        self.num_tokens += count

    def view(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of the shard for one layer: k, v [length, Hkv, D]."""
        k_cache, v_cache = self.pool.layers[layer_idx]
        return (k_cache.view(-1, *k_cache.shape[2:])[:length],
                v_cache.view(-1, *v_cache.shape[2:])[:length])


@dataclass
class SPStep:
    """One forward on this rank. ``round`` is set for a prefill round, None for decode."""

    num_cached: int  # tokens this rank held before the step
    slot_mapping: torch.Tensor  # [T_stored] where the step's stored K/V go on this rank
    round: SequenceSharding | None = None
    prefix_lengths: tuple[int, ...] = ()  # prefill: every rank's earlier-round tokens (none: ())
    prefix_by_ring: bool = False  # prefill: the earlier rounds' K/V travel (else the queries do)


class SequenceParallelBackend:
    """The attention backend for a model whose tokens are spread over a ring of ranks.
    ``kernels``: ``longctx.kernels.torch_paged`` on the CPU, ``triton_attention`` on CUDA
    (``write_kv`` and the one-query ``paged_attention`` of decode)."""

    def __init__(self, kv: ShardKV, comm: RingComm, kernels, head_dim: int) -> None:
        self.kv, self.comm, self.kernels = kv, comm, kernels
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                step: SPStep) -> torch.Tensor:
        if step.round is not None:
            return self._prefill(layer_idx, q, k, v, step)
        return self._decode(layer_idx, q, k, v, step)

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if slots.numel():
            k_cache, v_cache = self.kv.pool.layers[layer_idx]
            self.kernels.write_kv(k_cache, v_cache, k, v, slots)

    def _attend_prefix(self, layer_idx: int, length: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv.view(layer_idx, length)  # (length, Hkv, D): earlier rounds on this rank
        return attend(q, k, v, causal=False, scale=self.scale)

    def _prefill(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 step: SPStep) -> torch.Tensor:
        """q [L_r, H, D], k/v [L_r, Hkv, D]: this rank's share of the round."""
        self._write(layer_idx, k, v, step.slot_mapping)
        has_prefix = any(step.prefix_lengths)
        queries_travel = has_prefix and not step.prefix_by_ring
        gathered = gather_queries(q, step.round.max_length, self.comm) if queries_travel else None
        out, lse = ring_attention(q, k, v, self.comm, causal=True, sharding=step.round, scale=self.scale)
        if not has_prefix:
            return out
        if queries_travel:
            attend_local = partial(self._attend_prefix, layer_idx, step.num_cached)
            prefix_out, prefix_lse = prefix_attention(gathered, q.shape[0], attend_local, self.comm)
        else:
            k_prefix, v_prefix = self.kv.view(layer_idx, step.num_cached)
            prefix_out, prefix_lse = ring_prefix_attention(q, k_prefix, v_prefix, step.prefix_lengths,
                                                           self.comm, self.scale)
        merge_into(prefix_out, prefix_lse, out, lse)
        return prefix_out.to(q.dtype)

    def _decode(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                step: SPStep) -> torch.Tensor:
        """q [1, H, D], k/v [1, Hkv, D]: the new token, the same on every rank."""
        self._write(layer_idx, k, v, step.slot_mapping)
        held = int(step.num_cached + step.slot_mapping.numel())
        if held == 0:
            out, lse = empty_state(q)
        else:
            k_cache, v_cache = self.kv.pool.layers[layer_idx]
            context_lens = torch.tensor([held], dtype=torch.int32, device=q.device)
            cu_seqlens = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
            out, lse = self.kernels.paged_attention(q, k_cache, v_cache, self.kv.block_table,
                                                    context_lens, cu_seqlens, scale=self.scale)
        out, _ = merge_decode_partials(out, lse, self.comm)
        return out.to(q.dtype)

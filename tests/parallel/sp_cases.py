"""Workloads the multi-process tests run on every rank (module level, so spawn can pickle them).

Each rank builds the same whole-sequence tensors from a seed, takes its shard, runs the
parallel path, and compares its shard of the result with ``longctx.kernels.reference`` run
on the whole sequence in the same process. Only error sizes travel back to the test (floats:
a rank exits after reporting, so results must hold no tensors).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from longctx.kernels import reference, torch_paged
from longctx.parallel import (RingComm, SequenceSharding, merge_decode_partials, ring_attention,
                              sharded_prefix_attention)
from longctx.parallel.sharded_kv import ring_prefix_attention
from longctx.parallel.local_attention import attend, empty_state


@dataclass(frozen=True)
class AttnCase:
    name: str
    seq_len: int
    num_heads: int
    num_kv_heads: int
    mode: str = "zigzag"
    causal: bool = True
    batched: bool = True
    by_name: bool = False  # pass the mode string (ranks derive the sharding) instead of the object
    head_dim: int = 16
    seed: int = 0


def attention_cases(world: int) -> list[AttnCase]:
    lengths = [1, 2 * world - 1, 37, 64] if world == 2 else [2, 5, 37, 61]
    cases = []
    for seq_len in lengths:
        for mode in ("zigzag", "contiguous"):
            for causal in (True, False):
                for heads, kv in ((4, 4), (6, 2)):
                    cases.append(AttnCase(f"ring-{mode}-{'causal' if causal else 'full'}-S{seq_len}-H{heads}/{kv}",
                                          seq_len, heads, kv, mode, causal, seed=seq_len * 7 + heads))
    cases += [
        AttnCase("ring-plain-isend-irecv", 45, 6, 2, batched=False, seed=3),
        AttnCase("ring-mode-by-name", 2 * world * 5, 6, 3, by_name=True, seed=4),
        AttnCase("ring-d64-long", 257, 9, 3, head_dim=64, seed=5),
    ]
    return cases


def _qkv(case: AttnCase):
    gen = torch.Generator().manual_seed(case.seed)
    q = torch.randn(case.seq_len, case.num_heads, case.head_dim, generator=gen)
    k = torch.randn(case.seq_len, case.num_kv_heads, case.head_dim, generator=gen)
    v = torch.randn(case.seq_len, case.num_kv_heads, case.head_dim, generator=gen)
    return q, k, v


def _errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    if out.numel() == 0:
        return 0.0, 0.0
    return float((out.float() - ref_out).abs().max()), float((lse - ref_lse).abs().max())


def run_attention_case(comm: RingComm, case: AttnCase) -> tuple[float, float]:
    q, k, v = _qkv(case)
    ref_out, ref_lse = reference.attention(q, k, v, causal=case.causal)
    layout = SequenceSharding(case.seq_len, comm.world_size, case.mode)
    rank = comm.rank
    ring = RingComm(batched=case.batched)
    fn = ring_attention
    out, lse = fn(layout.shard(q, rank), layout.shard(k, rank), layout.shard(v, rank), ring,
                  case.causal, sharding=case.mode if case.by_name else layout)
    return _errors(out, lse, layout.shard(ref_out, rank), layout.shard(ref_lse, rank))


def _paged_shard(k: torch.Tensor, v: torch.Tensor, block_size: int):
    """k/v [n, Hkv, D] -> pages [NB, BS, Hkv, D] (consecutive blocks 0..NB-1)."""
    num_blocks = max(1, -(-k.shape[0] // block_size))
    k_cache = torch.full((num_blocks, block_size, *k.shape[1:]), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))  # past-the-end slots must never be read
    slots = torch.arange(k.shape[0])
    torch_paged.write_kv(k_cache, v_cache, k, v, slots)
    return k_cache, v_cache, torch.arange(num_blocks, dtype=torch.int32)[None]


def run_decode_merge_case(comm: RingComm, context: int, num_heads: int, num_kv: int,
                          seed: int) -> tuple[float, float]:
    """One new query; the context's KV round robin over the ranks (as the generator stores
    decode tokens); each rank attends over its pages; partials merged = whole-context decode."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_heads, 32, generator=gen)
    k = torch.randn(context, num_kv, 32, generator=gen)
    v = torch.randn(context, num_kv, 32, generator=gen)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True)  # the query sees everything
    mine = torch.arange(context)[comm.rank::comm.world_size]
    scale = 1.0 / math.sqrt(32)
    if mine.numel():
        k_cache, v_cache, table = _paged_shard(k[mine], v[mine], block_size=8)
        out, lse = torch_paged.paged_attention(q, k_cache, v_cache, table,
                                               torch.tensor([mine.numel()], dtype=torch.int32),
                                               torch.tensor([0, 1], dtype=torch.int32), scale=scale)
    else:
        out, lse = empty_state(q)
    out, lse = merge_decode_partials(out, lse, RingComm())
    return _errors(out, lse, ref_out, ref_lse)


def run_prefix_case(comm: RingComm, prefix: int, queries: int, seed: int, by_ring: bool) -> tuple[float, float]:
    """Different queries per rank (a zigzag round) over a prefix held in contiguous pieces by
    the ranks, queries or K/V travelling: equals every query attending the whole prefix."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, 6, 16, generator=gen)
    k = torch.randn(prefix, 2, 16, generator=gen)
    v = torch.randn(prefix, 2, 16, generator=gen)
    ref_out, ref_lse = reference.attention(q, k, v, causal=False)
    round_layout = SequenceSharding(queries, comm.world_size, "zigzag")
    prefix_layout = SequenceSharding(prefix, comm.world_size, "contiguous")
    k_mine, v_mine = prefix_layout.shard(k, comm.rank), prefix_layout.shard(v, comm.rank)
    scale = 1.0 / math.sqrt(16)
    q_mine = round_layout.shard(q, comm.rank)
    if by_ring:
        lengths = tuple(prefix_layout.length(r) for r in range(comm.world_size))
        out, lse = ring_prefix_attention(q_mine, k_mine, v_mine, lengths, RingComm(), scale)
    else:
        out, lse = sharded_prefix_attention(q_mine, round_layout.max_length,
                                            lambda qs: attend(qs, k_mine, v_mine, causal=False, scale=scale),
                                            RingComm())
    return _errors(out, lse, round_layout.shard(ref_out, comm.rank), round_layout.shard(ref_lse, comm.rank))


DECODE_CONTEXTS = (1, 2, 50, 333)
PREFIX_CASES = ((1, 7), (40, 1), (100, 37))


def kernel_case_names(world: int) -> list[str]:
    names = [c.name for c in attention_cases(world)]
    names += [f"decode-merge-S{s}" for s in DECODE_CONTEXTS]
    return names + [f"prefix-{how}-travel-P{p}-Q{q}" for p, q in PREFIX_CASES for how in ("queries", "kv")]


def run_all_kernel_cases(comm: RingComm, device: torch.device) -> dict[str, tuple[float, float]]:
    """Every attention, decode-merge and prefix case for this world size, in one process group."""
    results = {case.name: run_attention_case(comm, case) for case in attention_cases(comm.world_size)}
    for context in DECODE_CONTEXTS:
        results[f"decode-merge-S{context}"] = run_decode_merge_case(comm, context, 9, 3, seed=context)
    for prefix, queries in PREFIX_CASES:
        for by_ring in (False, True):
            name = f"prefix-{'kv' if by_ring else 'queries'}-travel-P{prefix}-Q{queries}"
            results[name] = run_prefix_case(comm, prefix, queries, prefix, by_ring)
    return results


# ---------------------------------------------------------------------- failures

def die_during_ring(comm: RingComm, device: torch.device, victim: int) -> str:
    """Ring steps forever; ``victim`` exits abruptly after a few. The others must fail fast."""
    q = torch.randn(64, 4, 16)
    for step in range(1000):
        if comm.rank == victim and step == 3:
            os._exit(7)
        ring_attention(q, q, q, comm, causal=True)
    return "finished (should not happen)"


def hang_during_ring(comm: RingComm, device: torch.device, victim: int) -> str:
    """``victim`` stops communicating (alive, asleep); the others' group timeout must fire."""
    q = torch.randn(64, 4, 16)
    for step in range(1000):
        if comm.rank == victim and step == 2:
            time.sleep(600)
        ring_attention(q, q, q, comm, causal=True)
    return "finished (should not happen)"


def raise_on_rank(comm: RingComm, device: torch.device, victim: int) -> str:
    if comm.rank == victim:
        raise ValueError("a deliberate failure")
    comm.all_gather(torch.zeros(1))
    return "ok"


# ---------------------------------------------------------------------- the generator


def fail_while_loading(*args) -> None:
    """In place of an engine worker (``longctx.engine.sp._worker_main``, whatever its arguments):
    fail as building the model or the pages can, before the rendezvous."""
    print("rank 1: building the KV pages", file=sys.stderr, flush=True)
    raise MemoryError("cannot allocate the KV pages (a deliberate failure)")

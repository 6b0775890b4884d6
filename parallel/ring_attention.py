"""Ring attention for inference (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Owns: ``ring_attention(q, k, v, group, causal)``: each of N ranks holds a shard of one
sequence's queries and keys/values; the K/V shards travel once around the ring and every rank
attends its queries to each shard as it passes, merging the partial results by log-sum-exp.
``ring_pass`` is that loop alone, shared with other attention over blocks that travel.
Never: model code, KV pages, or a transport of its own (``RingComm`` over torch.distributed).

    step s on rank r: holds the K/V shard of rank (r - s) mod N
        start:   send that shard to rank r+1, receive rank (r - s - 1)'s from rank r-1
        compute: attention of the local queries over the held shard (masked by position)
        wait, merge (out, lse) into the running result, next step

The transfer of step s+1's shard runs while step s computes, so with compute per step above
the transfer time the ring costs no waiting (see docs/parallel.md for when that holds).

Masks come from global positions (``SequenceSharding``): a key run entirely before a query
run is visible in full, the identical run is the causal diagonal, a later run is skipped.
Zigzag sharding makes that work equal on every rank in every step.

Shape legend: L_r tokens on this rank, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from .comm import RingComm
from .local_attention import attend, empty_state, merge_into
from .sharding import SequenceSharding

Runs = tuple[tuple[int, int], ...]


def block_plan(q_runs: Runs, kv_runs: Runs, causal: bool) -> list[tuple[slice, slice, bool]]:
    """(local query rows, local key rows, diagonal?) for every visible pair of runs. Fully
    visible key runs that sit next to each other are joined into one block."""
    plan: list[tuple[slice, slice, bool]] = []
    q_row = 0
    for qs, qe in q_runs:
        rows = slice(q_row, q_row + qe - qs)
        q_row = rows.stop
        full: list[slice] = []
        k_row = 0
        for ks, ke in kv_runs:
            keys = slice(k_row, k_row + ke - ks)
            k_row = keys.stop
            if qe == qs or ke == ks or (causal and ks >= qe):
                continue
            if not causal or ke <= qs:
                if full and full[-1].stop == keys.start:
                    full[-1] = slice(full[-1].start, keys.stop)
                else:
                    full.append(keys)
            elif (ks, ke) == (qs, qe):
                plan.append((rows, keys, True))
            else:
                raise ValueError(f"key run [{ks}, {ke}) partly overlaps query run [{qs}, {qe})")
        plan.extend((rows, keys, False) for keys in full)
    return plan


def accumulate_block(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, q_runs: Runs, kv_runs: Runs, causal: bool, scale: float) -> None:
    """Merge the attention of q [L, H, D] over one K/V block [S, Hkv, D] into the running
    (out fp32 [L, H, D], lse [L, H]), in place."""
    for rows, keys, diagonal in block_plan(q_runs, kv_runs, causal):
        o, l = attend(q[rows], k[keys], v[keys], causal=diagonal, scale=scale)
        merge_into(out[rows], lse[rows], o, l)


def ring_pass(k: torch.Tensor, v: torch.Tensor, length_of: Callable[[int], int], comm: RingComm,
              visit: Callable[[torch.Tensor, torch.Tensor, int], None]) -> None:
    """Send this rank's K/V block (k/v [L_r, Hkv, D]) once around the ring and call
    ``visit(k, v, source_rank)`` on every block, this rank's first; each block's transfer to
    the next rank runs while ``visit`` computes on it. ``length_of(rank)``: rank's block length."""
    rank, world = comm.rank, comm.world_size
    kv = torch.stack([k, v])  # (2, L_r, Hkv, D): one message per step
    for step in range(world):
        source = (rank - step) % world
        last = step == world - 1
        if not last:
            recv = kv.new_empty((2, length_of((source - 1) % world), *kv.shape[2:]))
            comm.send_recv(kv, recv)
        visit(kv[0], kv[1], source)
        if not last:
            comm.wait()
            kv = recv


def resolve_sharding(sharding: SequenceSharding | str, q: torch.Tensor, comm: RingComm) -> SequenceSharding:
    """The sharding as given, or for a mode name the one its ranks' lengths imply (checked)."""
    if isinstance(sharding, SequenceSharding):
        layout = sharding
    else:
        lengths = comm.all_gather(torch.tensor([q.shape[0]], device=q.device)).flatten().tolist()
        layout = SequenceSharding(sum(lengths), comm.world_size, sharding)
        expected = [layout.length(r) for r in range(comm.world_size)]
        if lengths != expected:
            raise ValueError(f"shard lengths {lengths} are not a {sharding} sharding of {sum(lengths)} "
                             f"tokens (that needs {expected})")
    if layout.world_size != comm.world_size:
        raise ValueError(f"sharding is for {layout.world_size} ranks, the group has {comm.world_size}")
    if layout.length(comm.rank) != q.shape[0]:
        raise ValueError(f"rank {comm.rank} holds {q.shape[0]} tokens, its sharding says "
                         f"{layout.length(comm.rank)}")
    return layout


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: RingComm | dist.ProcessGroup | None = None, causal: bool = True, *,
                   sharding: SequenceSharding | str = "zigzag",
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sharded sequence.

    q [L_r, H, D], k/v [L_r, Hkv, D]: this rank's shard under ``sharding`` (a
    ``SequenceSharding``, or "zigzag"/"contiguous" to derive one from the ranks' lengths).
    ``group``: a ``RingComm`` (its counters accumulate) or a process group (None: default).
    Returns out [L_r, H, D] (q's dtype) and lse fp32 [L_r, H], as ``kernels/reference.py``.
    """
    comm = group if isinstance(group, RingComm) else RingComm(group)
    if k.shape[0] != q.shape[0] or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: one shard needs "
                         f"as many keys as queries")
    layout = resolve_sharding(sharding, q, comm)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = empty_state(q)  # (L_r, H, D) fp32, (L_r, H)

    def visit(k_block: torch.Tensor, v_block: torch.Tensor, source: int) -> None:
        accumulate_block(out, lse, q, k_block, v_block, layout.segments(comm.rank), layout.segments(source),
                         causal, scale)

    ring_pass(k, v, layout.length, comm, visit)
    return out.to(q.dtype), lse

"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): heads sharded
during attention.

Owns: ``ulysses_attention(q, k, v, group, causal)``, the alternative to ring attention when
the heads divide by N: one all-to-all turns "my tokens, all heads" into "all tokens, my
heads", each rank runs ordinary attention over the whole sequence for H/N query heads (and
Hkv/N kv heads), and a second all-to-all turns the result back.
Never: KV caching (a prefill round's attention only), a transport of its own.

    rank r before:  tokens of shard r, heads 0..H-1        [L_r, H, D]
    all-to-all:     tokens of every shard, heads of group r [S, H/N, D]  (then position order)
    attention:      causal over the whole sequence, GQA kept (kv group r matches q group r)
    all-to-all:     back to [L_r, H, D], with each row's lse

Bytes per rank: (N-1)/N * L_r * (H + 2 Hkv) * D out and the same back (the result in fp32
with its lse), independent of N beyond that factor, while the ring sends (N-1) * L_r * 2 Hkv
* D. Ulysses needs H and Hkv divisible by N; the ring has no such limit.

Shape legend: S tokens, L_r tokens of rank r, N ranks, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import RingComm
from .local_attention import attend
from .ring_attention import resolve_sharding
from .sharded_kv import pack_state, unpack_state
from .sharding import SequenceSharding


def _pad_rows(x: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """Zero-pad dimension ``dim`` of ``x`` to ``rows``."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, rows - x.shape[dim]]
    return F.pad(x, pad)


def _heads_to_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int,
                    max_len: int) -> torch.Tensor:
    """[L_r, H|Hkv, D] x3 -> [N, max_len, (H + 2 Hkv) / N, D]: row j holds head group j."""
    groups = [x.unflatten(1, (world, -1)) for x in (q, k, v)]  # (L_r, N, heads/N, D)
    packed = torch.cat(groups, dim=2).transpose(0, 1)  # (N, L_r, (H + 2 Hkv)/N, D)
    return _pad_rows(packed, max_len, 1)


def _in_position_order(received: torch.Tensor, layout: SequenceSharding) -> torch.Tensor:
    """[N, max_len, ...] rows from each rank's shard -> [S, ...] in global position order."""
    rows = torch.cat([received[src, :layout.length(src)] for src in range(layout.world_size)])
    order = torch.cat([layout.positions(src) for src in range(layout.world_size)]) - layout.offset
    out = torch.empty_like(rows)
    out[order.to(rows.device)] = rows
    return out


def _back_to_ranks(state: torch.Tensor, layout: SequenceSharding) -> torch.Tensor:
    """[S, ...] -> [N, max_len, ...]: row j holds rank j's positions, padded."""
    parts = [state[(layout.positions(r) - layout.offset).to(state.device)] for r in range(layout.world_size)]
    return torch.stack([_pad_rows(p, layout.max_length, 0) for p in parts])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: RingComm | dist.ProcessGroup | None = None, causal: bool = True, *,
                      sharding: SequenceSharding | str = "contiguous",
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``ring_attention``: q [L_r, H, D], k/v [L_r, Hkv, D] -> out [L_r, H, D]
    (q's dtype), lse fp32 [L_r, H]. Needs H and Hkv divisible by the group size."""
    comm = group if isinstance(group, RingComm) else RingComm(group)
    world = comm.world_size
    num_heads, num_kv = q.shape[1], k.shape[1]
    if num_heads % world or num_kv % world:
        raise ValueError(f"Ulysses needs the heads to divide by {world} ranks: {num_heads} query heads, "
                         f"{num_kv} kv heads (use ring_attention instead)")
    layout = resolve_sharding(sharding, q, comm)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    received = comm.all_to_all(_heads_to_ranks(q, k, v, world, layout.max_length))
    seq = _in_position_order(received, layout)  # (S, (H + 2 Hkv)/N, D)
    q_g, k_g, v_g = seq.split([num_heads // world, num_kv // world, num_kv // world], dim=1)
    out, lse = attend(q_g, k_g, v_g, causal=causal, scale=scale)  # (S, H/N, D), (S, H/N)
    back = comm.all_to_all(_back_to_ranks(pack_state(out, lse), layout))  # (N, max_len, H/N, D+1)
    mine = back[:, :q.shape[0]].transpose(0, 1).flatten(1, 2)  # (L_r, H, D + 1)
    out, lse = unpack_state(mine)
    return out.to(q.dtype), lse.contiguous()

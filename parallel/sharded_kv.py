"""Attention over KV that stays sharded: no rank ever gathers the whole context.

Owns: the exchanges that let ranks attend to KV held elsewhere.

* Decode (``merge_decode_partials``): every rank holds the same new queries (each computed
  them itself), attends them over its own KV shard, and the N partial (out, lse) are
  all-gathered and merged in rank order, so every rank ends with the same exact result.
* Prefix of a prefill round: each rank holds different queries and a shard of the earlier
  rounds, which every query sees in full (the prefix precedes every query: no mask). Two ways:
  - queries travel (``sharded_prefix_attention``): queries are all-gathered, each rank attends
    all of them over its own shard, and the partials go home by all-to-all and merge there.
    O(round) bytes whatever the prefix length; the all-to-all is not overlapped.
  - K/V travel (``ring_prefix_attention``): the prefix shards go around the ring like a
    round's K/V, transfers overlapped with compute. O(prefix) bytes.
  ``prefix_exchange_bytes`` says which moves fewer bytes: K/V for the first rounds (about G
  of them in fp32, 1.5 G in 16-bit, G = H / Hkv), queries once the prefix is longer.
Never: model code, KV pages (the caller hands in views or an ``attend_local``).

Shape legend: T queries, L_r queries of rank r, N ranks, H query heads, D head dim.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .comm import Pending, RingComm
from .local_attention import attend, empty_state, merge_into
from .ring_attention import ring_pass

AttendLocal = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # q -> (out, lse)


def pack_state(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(out [..., H, D], lse [..., H]) -> one fp32 tensor [..., H, D + 1] (one message)."""
    return torch.cat([out.float(), lse.float()[..., None]], dim=-1)


def unpack_state(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[..., :-1], packed[..., -1]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold N partials over disjoint key sets, in order: outs [N, T, H, D], lses [N, T, H]
    -> out fp32 [T, H, D], lse [T, H]."""
    out, lse = outs[0].float().clone(), lses[0].float().clone()
    for i in range(1, outs.shape[0]):
        merge_into(out, lse, outs[i], lses[i])
    return out, lse


def merge_decode_partials(out: torch.Tensor, lse: torch.Tensor,
                          comm: RingComm) -> tuple[torch.Tensor, torch.Tensor]:
    """Same queries on every rank, each with a partial over its own KV: out [T, H, D], lse
    [T, H] -> the merged result (fp32 out), identical on every rank."""
    gathered = comm.all_gather(pack_state(out, lse))  # (N, T, H, D + 1)
    return merge_partials(*unpack_state(gathered))


def gather_queries(q: torch.Tensor, max_len: int, comm: RingComm) -> Pending:
    """Start the all-gather of every rank's queries, each padded to ``max_len`` rows:
    the result is [N, max_len, H, D]."""
    padded = F.pad(q, (0, 0, 0, 0, 0, max_len - q.shape[0]))
    return comm.all_gather(padded, async_op=True)


def prefix_attention(gathered: Pending, local_len: int, attend_local: AttendLocal,
                     comm: RingComm) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish what ``gather_queries`` started: attend every rank's queries over this rank's
    prefix shard, send each rank its partials, merge the ones for this rank's queries.
    Returns out fp32 [L_r, H, D], lse [L_r, H]."""
    all_q = gathered.wait()  # (N, Lmax, H, D)
    world, max_len = all_q.shape[:2]
    out, lse = attend_local(all_q.flatten(0, 1))  # (N * Lmax, H, D), (N * Lmax, H)
    packed = pack_state(out, lse).view(world, max_len, *out.shape[1:-1], -1)  # (N, Lmax, H, D + 1)
    mine = comm.all_to_all(packed)[:, :local_len]  # row j: rank j's partial for my queries
    return merge_partials(*unpack_state(mine))


def sharded_prefix_attention(q: torch.Tensor, max_len: int, attend_local: AttendLocal,
                             comm: RingComm) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L_r, H, D] (at most ``max_len`` rows on any rank) over a prefix sharded across ranks
    that every query sees in full; ``attend_local(q) -> (out, lse)`` covers this rank's shard."""
    return prefix_attention(gather_queries(q, max_len, comm), q.shape[0], attend_local, comm)


def ring_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          prefix_lengths: tuple[int, ...], comm: RingComm,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L_r, H, D] over every rank's prefix shard, all keys visible; this rank's shard is
    k/v [P_r, Hkv, D] and ``prefix_lengths[j]`` is rank j's P_j. The shards travel the ring.
    Returns out fp32 [L_r, H, D], lse [L_r, H]."""
    out, lse = empty_state(q)

    def visit(k_block: torch.Tensor, v_block: torch.Tensor, source: int) -> None:
        merge_into(out, lse, *attend(q, k_block, v_block, causal=False, scale=scale))

    ring_pass(k, v, prefix_lengths.__getitem__, comm, visit)
    return out, lse


def prefix_exchange_bytes(prefix_lengths: tuple[int, ...], max_queries: int, num_heads: int,
                          num_kv_heads: int, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    """Bytes all ranks send together for one round's prefix attention: (K/V around the ring,
    queries out plus fp32 partials back)."""
    world = len(prefix_lengths)
    kv_ring = (world - 1) * sum(prefix_lengths) * 2 * num_kv_heads * head_dim * elem_bytes
    queries = world * (world - 1) * max_queries * num_heads * (head_dim * elem_bytes + (head_dim + 1) * 4)
    return kv_ring, queries

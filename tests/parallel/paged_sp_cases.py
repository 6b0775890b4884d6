"""Workloads for ``test_paged_sp.py`` that run on every rank (module level, so spawn can pickle
them): one attention step over KV pages spread across the ranks, checked on each rank against
``kernels/reference.py`` run over the whole (unsharded) cache in the same process."""

from __future__ import annotations

import torch

from longctx.kernels import reference, torch_paged
from longctx.parallel import RingComm
from longctx.parallel.paged_sp import PagedSPAttention, ShardedStep, StepSeq, assign_tokens
from longctx.parallel.shm_comm import ShmComm
from longctx.lookahead.tree import tree_ancestor_words

BS, D = 4, 16

# name -> (heads, kv heads, sequences as (tokens cached before the step, new tokens, draft parents))
CASES = {
    "decode-batch-gqa3": (6, 2, [(37, 1, None), (8, 1, None), (0, 1, None), (13, 1, None)]),
    "prefill-chunk-and-decode-mha": (3, 3, [(45, 70, None), (22, 1, None)]),
    "two-chunks-gqa3": (6, 2, [(0, 41, None), (17, 39, None)]),
    "verify-tree-and-short-causal": (6, 2, [(21, 6, (-1, 0, 0, 1, 2)), (3, 5, None), (30, 1, None)]),
}


def build(name: str, world: int, seed: int = 0):
    """The whole step on one host, the same on every rank: returns the sequences (global block
    ids from a shuffled pool), q/k/v of the new tokens, the full cache with everything written
    (what the reference reads), and the slots of the new tokens."""
    heads, kv_heads, spec = CASES[name]
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(start + new) // BS) for start, new, _ in spec]
    num_blocks = world * (sum(pages) // world + 2)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, BS, kv_heads, D, generator=g)
    v_cache = torch.randn(num_blocks, BS, kv_heads, D, generator=g)
    total = sum(new for _, new, _ in spec)
    q = torch.randn(total, heads, D, generator=g)
    k = torch.randn(total, kv_heads, D, generator=g)
    v = torch.randn(total, kv_heads, D, generator=g)
    seqs, slots, words, at = [], [], [], 0
    for (start, new, parents), n_pages in zip(spec, pages):
        blocks = tuple(pool[:n_pages])
        pool = pool[n_pages:]
        tree = tree_ancestor_words(parents) if parents else [(1 << (i + 1)) - 1 for i in range(new)]
        words.extend(tree)
        seqs.append(StepSeq(at, new, start, blocks, tuple(tree) if parents else ()))
        slots.extend(blocks[p // BS] * BS + p % BS for p in range(start, start + new))
        at += new
    full_k, full_v = k_cache.clone(), v_cache.clone()
    flat = torch.tensor(slots)
    full_k.view(-1, kv_heads, D)[flat], full_v.view(-1, kv_heads, D)[flat] = k, v
    return seqs, q, k, v, k_cache, v_cache, full_k, full_v, slots, words


def run_case(comm, name: str, world: int) -> tuple[float, float, float]:
    """(max |out - ref|, max |k cache - ref| over this rank's pages after the step, ...)."""
    seqs, q, k, v, k_cache, v_cache, full_k, full_v, slots, words = build(name, world)
    rank = comm.rank
    local = list(range(rank, k_cache.shape[0], world))  # global ids of this rank's pages
    lk, lv = k_cache[local].clone(), v_cache[local].clone()  # local id i = global local[i]
    owned = assign_tokens([s.num_new for s in seqs], world, min_split=8)
    step = ShardedStep(seqs, owned, slots, rank, world, BS, torch.device("cpu"))
    attention = PagedSPAttention([(lk, lv)], comm, torch_paged, D)
    mine = owned[rank]
    out = attention.forward(0, q[mine], k[mine], v[mine], step)
    table = torch.tensor([list(s.block_ids) for s in seqs for _ in [0]] if len({len(s.block_ids) for s in seqs}) == 1
                         else [list(s.block_ids) + [0] * (max(len(t.block_ids) for t in seqs) - len(s.block_ids))
                               for s in seqs], dtype=torch.int32)
    ctx = torch.tensor([s.start_pos + s.num_new for s in seqs], dtype=torch.int32)
    cu = torch.tensor([0] + [s.start + s.num_new for s in seqs], dtype=torch.int32)
    tree = torch.tensor(words, dtype=torch.int64) if any(s.tree_words for s in seqs) else None
    ref_out, _ = reference.paged_attention(q, full_k, full_v, table, ctx, cu, tree_mask=tree)
    out_err = (out - ref_out[mine]).abs().max().item() if mine else 0.0
    cache_err = max((lk - full_k[local]).abs().max().item(), (lv - full_v[local]).abs().max().item())
    return out_err, cache_err, float(len(mine))


def run_all(comm: RingComm, device: torch.device, board=None) -> dict[str, tuple[float, float, float]]:
    torch.set_num_threads(1)
    if board is not None:
        comm = ShmComm(board, comm.rank, comm, 60.0, lambda: True)
    return {name: run_case(comm, name, comm.world_size) for name in CASES}

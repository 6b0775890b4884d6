"""Sharding, the ring's block plan and the in-place merge, in one process: exact layouts,
every rank's ring (simulated by visiting the K/V shards in ring order) against the reference
attention, and ``merge_into`` against the reference merge, empty parts included."""

from __future__ import annotations

import math

import pytest
import torch

from longctx.kernels import reference
from longctx.parallel import SequenceSharding
from longctx.parallel.local_attention import empty_state, merge_into
from longctx.parallel.ring_attention import accumulate_block, block_plan
from longctx.parallel.sharded_kv import prefix_exchange_bytes


def test_zigzag_layout_with_odd_length():
    layout = SequenceSharding(10, 2, "zigzag")
    assert layout.segments(0) == ((0, 3), (8, 10))
    assert layout.segments(1) == ((3, 6), (6, 8))
    assert layout.positions(0).tolist() == [0, 1, 2, 8, 9]
    assert [layout.owner(p) for p in range(10)] == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]


def test_contiguous_layout_with_offset():
    layout = SequenceSharding(7, 3, "contiguous", offset=100)
    assert [layout.segments(r) for r in range(3)] == [((100, 103),), ((103, 105),), ((105, 107),)]
    assert layout.max_length == 3
    with pytest.raises(ValueError, match="outside"):
        layout.owner(99)


def test_short_sequence_leaves_a_rank_empty():
    layout = SequenceSharding(2, 3, "zigzag")
    assert [layout.length(r) for r in range(3)] == [1, 1, 0]
    assert layout.positions(2).numel() == 0


@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
@pytest.mark.parametrize("seq_len,world", [(1, 2), (5, 3), (37, 2), (64, 4)])
def test_shard_then_unshard_is_identity(mode, seq_len, world):
    layout = SequenceSharding(seq_len, world, mode, offset=11)
    x = torch.arange(seq_len * 2).view(seq_len, 2)
    shards = [layout.shard(x, r) for r in range(world)]
    assert sum(s.shape[0] for s in shards) == seq_len
    assert torch.equal(layout.unshard(shards), x)


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="zigzag, contiguous"):
        SequenceSharding(8, 2, "striped")


def test_zigzag_gives_every_rank_the_same_causal_work():
    layout = SequenceSharding(64, 4, "zigzag")
    for step in range(4):
        work = []
        for rank in range(4):
            plan = block_plan(layout.segments(rank), layout.segments((rank - step) % 4), causal=True)
            work.append(sum((q.stop - q.start) * (k.stop - k.start) / (2 if diag else 1) for q, k, diag in plan))
        assert len(set(work)) == 1, f"step {step}: unequal work {work}"


def test_plan_refuses_runs_that_partly_overlap():
    with pytest.raises(ValueError, match="partly overlaps"):
        block_plan(((0, 10),), ((5, 15),), causal=True)


@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len,world,heads,kv", [(1, 2, 4, 4), (5, 3, 6, 2), (33, 4, 6, 2), (100, 3, 4, 1)])
def test_simulated_ring_matches_reference(mode, causal, seq_len, world, heads, kv):
    gen = torch.Generator().manual_seed(seq_len)
    q = torch.randn(seq_len, heads, 16, generator=gen)
    k = torch.randn(seq_len, kv, 16, generator=gen)
    v = torch.randn(seq_len, kv, 16, generator=gen)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
    layout = SequenceSharding(seq_len, world, mode)
    outs, lses = [], []
    for rank in range(world):
        q_r = layout.shard(q, rank)
        out, lse = empty_state(q_r)
        for step in range(world):
            src = (rank - step) % world
            accumulate_block(out, lse, q_r, layout.shard(k, src), layout.shard(v, src),
                             layout.segments(rank), layout.segments(src), causal, 1 / math.sqrt(16))
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(layout.unshard(outs), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(layout.unshard(lses), ref_lse, atol=2e-5, rtol=1e-5)


def test_merge_into_equals_the_reference_merge_with_empty_parts():
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(2, 50, 4, 8, generator=gen).unbind(0)
    lse_a, lse_b = (10 * torch.randn(2, 50, 4, generator=gen)).unbind(0)
    lse_a[:5], lse_b[3:8] = float("-inf"), float("-inf")  # rows 3, 4: both parts empty
    out_a[:5] = 0.0  # an empty state holds zeros (empty_state)
    ref_out, ref_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    out, lse = out_a.clone(), lse_a.clone()
    merge_into(out, lse, out_b, lse_b)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[:3], out_b[:3])  # into an empty state: an exact copy
    assert not out.isnan().any()


def test_prefix_exchange_moves_kv_while_the_prefix_is_short_then_queries():
    # SmolLM geometry (H 9, Hkv 3, D 64), fp32, 2 ranks, 1024 queries per rank per round
    def kv_is_cheaper(prefix_per_rank: int) -> bool:
        kv_ring, queries = prefix_exchange_bytes((prefix_per_rank,) * 2, 1024, 9, 3, 64, 4)
        return kv_ring <= queries

    assert kv_is_cheaper(1024) and kv_is_cheaper(2048)  # after one or two rounds
    assert not kv_is_cheaper(4096)  # after four rounds: the queries travel

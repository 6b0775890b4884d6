"""Triton-only behaviour: how the KV split is planned, and that every split count is exact.

The shared numerics live in test_paged_attention.py; here the split-KV path (stage 1 partials
plus the stage 2 log-sum-exp merge) is forced to several split counts on one batch.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import DEVICE, TWO_BRANCH_TREE, Case, check_against_reference, make_batch

triton_attention = pytest.importorskip("longctx.kernels.triton_attention")


def test_decode_of_one_long_sequence_is_split():
    plan = triton_attention.plan_launch(
        num_tokens=1, num_seqs=1, num_kv_heads=1, group=8, head_dim=128, max_q_len=1,
        max_ctx_len=32768, dtype=torch.float16, device=DEVICE)
    assert plan.num_splits > 1
    assert plan.split_size % plan.block_n == 0
    assert (plan.num_splits - 1) * plan.split_size < 32768 <= plan.num_splits * plan.split_size


def test_long_prefill_chunk_is_not_split():
    plan = triton_attention.plan_launch(
        num_tokens=4096, num_seqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=4096,
        max_ctx_len=8192, dtype=torch.float16, device=DEVICE)
    assert plan.num_splits == 1
    assert plan.block_q * 4 <= plan.block_m


def test_default_plan_of_decode_cases_exercises_stage_two_when_interpreted():
    """Interpreted (the CPU), the shared decode test shapes run through the split path, since
    splits there keep only one key tile. On a GPU a split keeps at least 256 keys, so these
    200-token contexts run unsplit and ``test_forced_split_counts_match_reference`` is what
    covers stage 2."""
    plan = triton_attention.plan_launch(
        num_tokens=3, num_seqs=3, num_kv_heads=2, group=1, head_dim=64, max_q_len=1,
        max_ctx_len=200, dtype=torch.float32, device=DEVICE)
    if triton_attention._interpreting():
        assert plan.num_splits > 1
    else:
        assert plan.num_splits == 1


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_forced_split_counts_match_reference(num_splits):
    case = Case((1, 5, 7, 1), (150, 64, 40, 9), num_kv_heads=2, group=3,
                trees=(None, None, TWO_BRANCH_TREE, None), seed=20 + num_splits)
    batch = make_batch(case)

    class Forced:
        @staticmethod
        def paged_attention(*args, **kwargs):
            return triton_attention.launch_paged_attention(*args, num_splits=num_splits,
                                                           **kwargs)

    check_against_reference(Forced, batch, case.dtype)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("checks the CPU refusal")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch(Case((1,), (20,), seed=30))
    with pytest.raises(ValueError, match="CUDA"):
        triton_attention.paged_attention(*batch.args())


def test_host_extents_skip_the_device_read_and_give_the_same_result(monkeypatch):
    """The engine passes (max q len, max context) from the host: the launch must not read them
    from the device (a sync per layer on a GPU), and the result is the same."""
    case = Case((1, 5, 1), (150, 64, 9), num_kv_heads=2, group=3, seed=55)
    batch = make_batch(case)
    expected, _ = triton_attention.paged_attention(*batch.args())

    def no_read(*args, **kwargs):
        raise AssertionError("read the extents from the device")

    monkeypatch.setattr(triton_attention, "_sequence_extents", no_read)
    out, _ = triton_attention.paged_attention(*batch.args(), extents=(5, 150))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="read the extents"):
        triton_attention.paged_attention(*batch.args())

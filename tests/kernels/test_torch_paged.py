"""The CPU torch path's forms all match the reference: for few new tokens, block-diagonal (decode
with few KV heads) and grouped matmuls over the whole context; for more, the prefix through the
flash kernel merged with the new tokens' own (causal or tree) part. Each case runs with the
block-diagonal form allowed and forbidden, and with the small-query limit at its default (3)
and at 63 (every tree through the whole-context matmuls)."""

from __future__ import annotations

import pytest
from paged_cases import TWO_BRANCH_TREE, Case, check_against_reference, make_batch

from longctx.kernels import torch_paged

CASES = {
    "decode": Case((1, 1), (75, 161), num_kv_heads=2, group=3, seed=31),
    "verify-q5": Case((5, 1), (90, 41), num_kv_heads=2, group=3, seed=32),
    "tree7": Case((7, 1), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=33),
    "decode-batch": Case((1, 1, 1), (33, 64, 5), num_kv_heads=3, group=3, seed=35),
    "many-kv-heads": Case((1, 3), (50, 77), num_kv_heads=8, group=2, seed=34),
    "tree3-and-chain4": Case((3, 4), (40, 9), num_kv_heads=1, group=4, trees=([-1, 0, 0], None), seed=36),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("max_kv_heads", [0, 64])
@pytest.mark.parametrize("small_q", [3, 63])
def test_every_form_matches_reference(monkeypatch, name, max_kv_heads, small_q):
    monkeypatch.setattr(torch_paged, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    monkeypatch.setattr(torch_paged, "SMALL_Q", small_q)
    case = CASES[name]
    check_against_reference(torch_paged, make_batch(case), case.dtype)

"""The CPU torch path's two small-query forms (block-diagonal, used for decode with few KV
heads, and grouped) both match the reference: each case runs with the block-diagonal form
allowed and forbidden."""

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
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("max_kv_heads", [0, 64])
def test_both_small_query_forms_match_reference(monkeypatch, name, max_kv_heads):
    monkeypatch.setattr(torch_paged, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    case = CASES[name]
    check_against_reference(torch_paged, make_batch(case), case.dtype)

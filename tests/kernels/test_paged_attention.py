"""Paged attention paths against kernels/reference.py on random paged batches.

Every implementation module exposes ``paged_attention``, ``write_kv`` and ``merge_attn_states``
with the reference's signatures; ``IMPLS`` lists them and a module that does not exist yet is
skipped (any other import error fails). Each case draws fresh inputs from its own seed; batches
and tolerances are described in ``paged_cases.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from paged_cases import (DEVICE, LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, ancestor_masks,
                         check_against_reference, make_batch)

from longctx.kernels import reference

IMPLS = {
    "triton": "longctx.kernels.triton_attention",
    "torch_paged": "longctx.kernels.torch_paged",
}


def load_impl(name: str):
    """Import an implementation by its IMPLS key; skip only if that very module is missing."""
    module_name = IMPLS[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        pytest.skip(f"{module_name} does not exist yet")


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return load_impl(request.param)


def test_ancestor_masks_of_two_branch_tree():
    assert ancestor_masks(TWO_BRANCH_TREE) == [0b1, 0b11, 0b111, 0b1111,
                                               0b10001, 0b110001, 0b1110001]


F16 = torch.float16
CASES = {
    # decode: GQA 1, 3, 8; contexts ending mid-page; one sequence shorter than a tile
    "decode-mha": Case((1, 1, 1), (37, 200, 129), num_kv_heads=2, group=1),
    "decode-gqa3": Case((1, 1), (75, 161), num_kv_heads=2, group=3, seed=1),
    "decode-gqa8-bs64": Case((1, 1), (300, 5), num_kv_heads=1, group=8, block_size=64, seed=2),
    "decode-gqa8-fp16": Case((1, 1), (170, 33), num_kv_heads=1, group=8, dtype=F16, seed=3),
    "decode-d128-bs256": Case((1,), (290,), num_kv_heads=1, group=4, head_dim=128,
                              block_size=256, seed=4),
    "decode-d96-padded": Case((1, 1), (50, 81), num_kv_heads=1, group=2, head_dim=96, seed=5),
    "decode-beside-idle-seq": Case((1, 0, 1), (44, 20, 17), num_kv_heads=2, group=2, seed=22),
    # lookahead verification, causal, mixed with plain decode
    "verify-q5": Case((5, 1, 5), (90, 41, 5), num_kv_heads=2, group=3, seed=6),
    "verify-q5-fp16": Case((5, 5), (64, 130), num_kv_heads=2, group=4, dtype=F16, seed=7),
    # lookahead verification with a two-branch 7-node tree; a decode and a chain beside it
    "tree7": Case((7, 1, 5), (70, 20, 33), num_kv_heads=2, group=3,
                  trees=(TWO_BRANCH_TREE, None, None), seed=8),
    "tree7-gqa8-fp16-bs64": Case((7, 7), (7, 150), num_kv_heads=1, group=8, block_size=64,
                                 dtype=F16, trees=(TWO_BRANCH_TREE, TWO_BRANCH_TREE), seed=9),
    # prefill chunks starting mid-page, alone and batched with decode / verify
    "prefill-chunk": Case((120,), (157,), num_kv_heads=2, group=1, seed=10),
    "prefill-gqa3-mixed": Case((1, 70, 5), (200, 93, 12), num_kv_heads=2, group=3, seed=11),
    "prefill-from-zero-fp16": Case((48,), (48,), num_kv_heads=2, group=2, dtype=F16, seed=12),
    "prefill-d128-bs64": Case((40, 1), (105, 66), num_kv_heads=1, group=2, head_dim=128,
                              block_size=64, seed=13),
    "prefill-300-gqa2": Case((300,), (345,), num_kv_heads=1, group=2, seed=21),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(impl, name):
    case = CASES[name]
    check_against_reference(impl, make_batch(case), case.dtype)


@pytest.mark.parametrize("num_cached", [30, 31, 33, 62, 63])
def test_prefill_diagonal_near_tile_edges(impl, num_cached):
    """A chunk's causal diagonal starting just before/after a 32- or 64-key tile boundary."""
    case = Case((37,), (num_cached + 37,), num_kv_heads=1, group=2, seed=100 + num_cached)
    check_against_reference(impl, make_batch(case), case.dtype)


def test_paged_attention_bf16(impl):
    case = Case((1, 4), (45, 60), num_kv_heads=2, group=2, dtype=torch.bfloat16, seed=14)
    check_against_reference(impl, make_batch(case), case.dtype)


def test_tree_row_without_keys_gives_zero_and_minus_inf(impl):
    """No cached context and a tree word of 0: the query sees nothing."""
    case = Case((3, 1), (3, 30), num_kv_heads=1, group=2, trees=([-1, 0, 1], None), seed=15)
    batch = make_batch(case)
    batch.tree_mask[1] = 0  # token 1 of sequence 0 sees no key at all
    check_against_reference(impl, batch, case.dtype)
    out, lse = impl.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[[0, 2, 3]]).all()


def test_query_as_strided_view(impl):
    """q sliced out of a fused projection output: not contiguous over heads."""
    batch = make_batch(Case((3, 1), (50, 23), num_kv_heads=2, group=2, seed=23))
    fused = torch.randn(batch.q.shape[0], batch.q.shape[1], 3 * batch.q.shape[2], device=DEVICE)
    fused[:, :, :batch.q.shape[2]] = batch.q
    batch.q = fused[:, :, :batch.q.shape[2]]  # (T, H, D) with stride 3 * D per head
    assert not batch.q.is_contiguous()
    check_against_reference(impl, batch, torch.float32)


def test_scale_argument(impl):
    batch = make_batch(Case((2, 1), (19, 40), num_kv_heads=2, group=2, seed=16))
    out, lse = impl.paged_attention(*batch.args(), scale=0.3)
    ref_out, ref_lse = reference.paged_attention(*batch.args(), scale=0.3)
    torch.testing.assert_close(out, ref_out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[torch.float32])


def test_tree_mask_longer_than_63_is_refused(impl):
    batch = make_batch(Case((64,), (64,), num_kv_heads=1, group=1, seed=17))
    with pytest.raises(ValueError):
        impl.paged_attention(*batch.args(), tree_mask=torch.ones(64, dtype=torch.int64,
                                                                device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_write_kv_into_shuffled_slots(impl, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, hkv, dim, num_tokens = 4, 2, 64, 12
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(num_tokens, hkv, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, hkv, dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens: skipped
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_ref, v_ref, k, v, slots)
    impl.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0]
    flat_k = k_cache.reshape(-1, hkv, dim)
    assert torch.equal(flat_k[written], k[slots >= 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_attn_states(impl, dtype):
    gen = torch.Generator().manual_seed(18)
    shape = (6, 4, 64)  # (T, H, D)
    out_a, out_b = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(shape[:2], generator=gen).to(DEVICE) for _ in range(2))
    lse_a[0] = float("-inf")  # a empty
    lse_b[1] = float("-inf")  # b empty
    lse_a[2, :2] = lse_b[2, :2] = float("-inf")  # both empty
    out, lse = impl.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[torch.float32])
    torch.testing.assert_close(out[0], out_b[0], **OUT_TOL[dtype])
    torch.testing.assert_close(out[1], out_a[1], **OUT_TOL[dtype])
    assert torch.equal(out[2, :2], torch.zeros_like(out[2, :2]))
    assert torch.isneginf(lse[2, :2]).all() and torch.isfinite(lse[2, 2:]).all()


def test_merge_of_two_halves_equals_whole(impl):
    """Attention over keys [0, s) merged with [s, S) equals attention over [0, S)."""
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    k = torch.randn(50, 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(50, 2, 64, generator=gen).to(DEVICE)
    whole = reference.attention(q, k, v, causal=False)
    first = reference.attention(q, k[:21], v[:21], causal=False)
    second = reference.attention(q, k[21:], v[21:], causal=False)
    out, lse = impl.merge_attn_states(*first, *second)
    torch.testing.assert_close(out, whole[0], **OUT_TOL[torch.float32])
    torch.testing.assert_close(lse, whole[1], **LSE_TOL[torch.float32])

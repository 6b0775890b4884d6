"""kv_quant.exchange_keys: attention over int8 pages with some keys' exact rows put back from the
kernel's out and log-sum-exp, against the reference attending over pages that hold those exact
rows (and the dequantised int8 rows elsewhere). The exchanged keys are each sequence's first
page and last page, as in the int8 error study; decode, prefill chunks and a tree-masked verify
step; GQA ratios 1, 3 and 8; partial last pages and a sequence within one page.

Tolerance: out and lse atol 2e-5 (float32; the exchange subtracts the int8 rows' share of the
softmax sum, which costs ~1e-7 of that share; seen: up to ~8e-6 on lse, 4e-6 on out)."""

from __future__ import annotations

import pytest
import torch

from longctx.kernels import kv_quant, reference, torch_paged

TOL = 2e-5
BS = 8


def exchanged_keys(length: int) -> torch.Tensor:
    return torch.tensor(sorted(set(range(min(BS, length))) | set(range((length - 1) // BS * BS, length))))


@pytest.mark.parametrize("hq, hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("kernels", [reference, torch_paged])
@pytest.mark.parametrize("with_tree", [False, True])
def test_exchanged_int8_attention_equals_attention_over_the_exact_rows(hq, hkv, kernels, with_tree):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    d = 16
    # (context length, new tokens, tree mask or None): decode, a chunk, a tree verify, one page
    seqs = [(37, 1, None), (29, 11, None), (45, 4, [0b0001, 0b0011, 0b0101, 0b1001]), (5, 5, None)]
    if not with_tree:  # no tree mask in the step: the kernels' plain causal path
        seqs.pop(2)
    nb = sum((length + BS - 1) // BS for length, _, _ in seqs) + 3
    perm = torch.randperm(nb, generator=gen)  # non-consecutive block tables
    tables, used = torch.zeros(len(seqs), 8, dtype=torch.int32), 0
    exact_k = torch.zeros(nb, BS, hkv, d)
    exact_v = torch.zeros(nb, BS, hkv, d)
    k8, v8 = torch.zeros(nb, BS, hkv, d, dtype=torch.int8), torch.zeros(nb, BS, hkv, d, dtype=torch.int8)
    ks, vs = torch.zeros(nb, hkv), torch.zeros(nb, hkv)
    for s, (length, _, _) in enumerate(seqs):
        n = (length + BS - 1) // BS
        tables[s, :n] = perm[used:used + n]
        used += n
        k = torch.randn(length, hkv, d, generator=gen) * 2
        k[0] *= 6  # a sink-like first key that sets its page's scale
        v = torch.randn(length, hkv, d, generator=gen)
        slots = (tables[s, torch.arange(length) // BS].long() * BS + torch.arange(length) % BS)
        exact_k.view(-1, hkv, d)[slots], exact_v.view(-1, hkv, d)[slots] = k, v
        kv_quant.write_int8(k8, ks, k, slots)
        kv_quant.write_int8(v8, vs, v, slots)
    lens = torch.tensor([length for length, _, _ in seqs], dtype=torch.int32)
    cu = torch.tensor([0] + [sum(n for _, n, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    tree = torch.cat([torch.tensor(t) if t else torch.tensor([2 ** (i + 1) - 1 for i in range(n)])
                      for _, n, t in seqs]).long() if with_tree else None  # causal rows where no tree
    q = torch.randn(int(cu[-1]), hq, d, generator=gen)
    # the expected pages: int8 everywhere, the exchanged keys' rows exact
    mixed_k, mixed_v = kv_quant.dequantize(k8, ks), kv_quant.dequantize(v8, vs)
    for s, (length, _, _) in enumerate(seqs):
        idx = exchanged_keys(length)
        blocks, offs = tables[s, idx // BS].long(), idx % BS
        mixed_k[blocks, offs], mixed_v[blocks, offs] = exact_k[blocks, offs], exact_v[blocks, offs]
    want, want_lse = reference.paged_attention(q, mixed_k, mixed_v, tables, lens, cu, tree_mask=tree)
    out, lse = kernels.paged_attention(q, k8, v8, tables, lens, cu, tree_mask=tree, k_scale=ks, v_scale=vs)
    out, lse = out.clone(), lse.clone()
    scale = d ** -0.5
    for s, (length, _, _) in enumerate(seqs):
        lo, hi = int(cu[s]), int(cu[s + 1])
        idx = exchanged_keys(length)
        blocks, offs = tables[s, idx // BS].long(), idx % BS
        visible = reference.causal_visibility(hi - lo, length, None if tree is None else tree[lo:hi])[:, idx]
        out[lo:hi], lse[lo:hi] = kv_quant.exchange_keys(
            out[lo:hi], lse[lo:hi], q[lo:hi], kv_quant.dequantize(k8, ks)[blocks, offs],
            kv_quant.dequantize(v8, vs)[blocks, offs], exact_k[blocks, offs], exact_v[blocks, offs],
            visible, scale)
    assert torch.allclose(out, want, atol=TOL, rtol=0)
    assert torch.allclose(lse, want_lse, atol=TOL, rtol=0)
    # the exchange matters here: the int8 pages alone are further off than the tolerance
    plain, _ = reference.paged_attention(q, k8, v8, tables, lens, cu, tree_mask=tree, k_scale=ks, v_scale=vs)
    assert (plain - want).abs().max() > 100 * TOL


def test_a_query_that_sees_no_key_stays_empty():
    """A tree word of 0 with no cached context: the kernels give out 0 and lse -inf; the exchange
    keeps that (no NaN), and a visible row next to it is exchanged as usual."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, generator=gen)
    k_old, v_old = torch.randn(2, 1, 4, generator=gen), torch.randn(2, 1, 4, generator=gen)
    k_new, v_new = k_old + 0.01, v_old + 0.01
    visible = torch.tensor([[False, False], [True, True]])
    out, lse = reference.attention(q[1:], k_old, v_old, causal=False, scale=0.5)
    out = torch.cat([torch.zeros(1, 2, 4), out])
    lse = torch.cat([torch.full((1, 2), float("-inf")), lse])
    got, got_lse = kv_quant.exchange_keys(out, lse, q, k_old, v_old, k_new, v_new, visible, 0.5)
    want, want_lse = reference.attention(q[1:], k_new, v_new, causal=False, scale=0.5)
    assert torch.equal(got[0], torch.zeros(2, 4)) and torch.isinf(got_lse[0]).all() and (got_lse[0] < 0).all()
    assert torch.allclose(got[1:], want, atol=TOL) and torch.allclose(got_lse[1:], want_lse, atol=TOL)

"""On a GPU: the Triton kernels over int8 KV pages (``kernels/kv_quant.py``) in fp16 and bf16
against kernels/reference.py; a decode step's int8 write plus attention never synchronising
with the host (``torch.cuda.set_sync_debug_mode("error")``); and the same step captured in a
CUDA graph and replayed, equal to running it eagerly.

Tolerance (the rule of test_gpu.py's ``check_kernel``): the error against the reference in
fp32 (pages dequantised to fp32, fp32 q) at most twice that of the reference computed in the
kernel's dtype (pages dequantised to q's dtype, q as is), plus 1e-3. Pages are written by
``kv_quant.write_int8`` on the GPU from random K/V whose size changes token by token, so
neighbouring pages have very different scales.
"""

from __future__ import annotations

import pytest
import torch

from longctx.kernels import kv_quant, reference

DEV = torch.device("cuda") if torch.cuda.is_available() else None


def int8_case(dtype, q_lens, ctx_lens, group, head_dim, block_size=16, seed=0, v_amplitude=1.0):
    """Random int8 pages written in three pieces per sequence (two of the cached prefix, cut
    inside a page, then the new tokens), shuffled block tables, stale scales in fresh pages."""
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    blocks = [-(-c // block_size) for c in ctx_lens]
    nb = sum(blocks) + 2
    k = torch.randint(-128, 128, (nb, block_size, hkv, head_dim), generator=gen,
                      dtype=torch.int8).to(DEV)
    v = torch.randint(-128, 128, (nb, block_size, hkv, head_dim), generator=gen,
                      dtype=torch.int8).to(DEV)
    k_scale = (5 * torch.rand(nb, hkv, generator=gen)).to(DEV)
    v_scale = (5 * torch.rand(nb, hkv, generator=gen)).to(DEV)
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    taken = 0
    for b, (q_len, ctx_len, n) in enumerate(zip(q_lens, ctx_lens, blocks)):
        ids = perm[taken:taken + n]
        table[b, :n] = ids.to(torch.int32)
        taken += n
        cached = ctx_len - q_len
        cut = min(cached, cached // 2 + 3)
        for lo, hi in ((0, cut), (cut, cached), (cached, ctx_len)):
            if hi <= lo:
                continue
            pos = torch.arange(lo, hi)
            slots = (ids[pos // block_size] * block_size + pos % block_size).to(DEV)
            for cache, scale, amp in ((k, k_scale, 1.0), (v, v_scale, v_amplitude)):
                size = 0.05 + 3 * torch.rand(hi - lo, 1, 1, generator=gen) ** 2
                rows = amp * size * torch.randn(hi - lo, hkv, head_dim, generator=gen)
                kv_quant.write_int8(cache, scale, rows.to(DEV), slots)
    q = torch.randn(sum(q_lens), hkv * group, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    args = [q.to(dtype).to(DEV), k, v, table.to(DEV), ctx.to(DEV), cu.to(DEV)]
    return args, dict(k_scale=k_scale, v_scale=v_scale)


def check_kernel(fn, args, scales, tree_mask=None):
    q, k, v, table, ctx, cu = args
    out, _ = fn(q, k, v, table, ctx, cu, tree_mask=tree_mask, **scales)
    assert out.dtype == q.dtype and not out.isnan().any()
    ref32, _ = reference.paged_attention(q.float(), k, v, table, ctx, cu, tree_mask=tree_mask,
                                         **scales)
    ref_lo, _ = reference.paged_attention(q, k, v, table, ctx, cu, tree_mask=tree_mask, **scales)
    err = (out.float() - ref32).abs().max().item()
    base = (ref_lo.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-3, (err, base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (128, 8), (256, 1)])
@pytest.mark.parametrize("q_lens,ctx_lens", [((1, 1, 1), (37, 1000, 4099)),  # decode
                                             ((5, 300), (5, 811))])  # prefill chunks, one after a prefix
def test_triton_int8_paged_attention_against_reference(dtype, head_dim, group, q_lens, ctx_lens):
    from longctx.kernels import triton_attention

    args, scales = int8_case(dtype, q_lens, ctx_lens, group, head_dim)
    check_kernel(triton_attention.paged_attention, args, scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_int8_verify_with_a_tree_mask(dtype):
    from longctx.kernels import triton_attention
    from longctx.lookahead.tree import tree_ancestor_words

    parents = [-1, 0, 1, -1, 3]  # two branches
    words = tree_ancestor_words(parents)
    args, scales = int8_case(dtype, (6, 1), (506, 77), 4, 128, seed=1)
    mask = torch.tensor(words + [1], dtype=torch.int64, device=DEV)
    check_kernel(triton_attention.paged_attention, args, scales, tree_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [5, 256])
def test_triton_int8_page_sizes(dtype, block_size):
    """Pages of 5 tokens (a key tile straddles up to 13 pages, each with its own scale) and
    of 256 (a page holds several tiles)."""
    from longctx.kernels import triton_attention

    args, scales = int8_case(dtype, (1, 9, 1), (613, 97, 3), 4, 128, block_size=block_size,
                             seed=2)
    check_kernel(triton_attention.paged_attention, args, scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_int8_small_values(dtype):
    """V rows of size ~1e-4 (page scales ~1e-6) over 4,099 keys: p x scale would sit in fp16
    subnormals without the kernel's normalisation by the tile's largest V scale."""
    from longctx.kernels import triton_attention

    args, scales = int8_case(dtype, (1, 1), (4099, 1000), 4, 128, seed=3, v_amplitude=1e-4)
    q, k, v, table, ctx, cu = args
    out, _ = triton_attention.paged_attention(*args, **scales)
    ref32, _ = reference.paged_attention(q.float(), k, v, table, ctx, cu, **scales)
    ref_lo, _ = reference.paged_attention(*args, **scales)
    size = ref32.abs().max()
    err = ((out.float() - ref32).abs().max() / size).item()
    base = ((ref_lo.float() - ref32).abs().max() / size).item()
    assert err <= 2 * base + 1e-3, (err, base)


def decode_step(dtype=torch.float16, ctx_lens=(37, 1000, 4099), seed=4):
    """A decode step over int8 pages: the new token of each sequence is the last of its
    context; its slot, the new K/V and q are ready on the GPU."""
    args, scales = int8_case(dtype, (1,) * len(ctx_lens), ctx_lens, 4, 128, seed=seed)
    q, k, v, table, ctx, cu = args
    host_table = table.cpu()
    slots = torch.tensor([int(host_table[b, (c - 1) // 16]) * 16 + (c - 1) % 16
                          for b, c in enumerate(ctx_lens)], device=DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    new_k = torch.randn(len(ctx_lens), 2, 128, generator=gen).to(dtype).to(DEV)
    new_v = torch.randn(len(ctx_lens), 2, 128, generator=gen).to(dtype).to(DEV)
    return args, scales, slots, new_k, new_v


def run_step(triton_attention, args, scales, slots, new_k, new_v, extents):
    q, k, v, table, ctx, cu = args
    triton_attention.write_kv(k, v, new_k, new_v, slots, starts=cu[:-1].long(), **scales)
    return triton_attention.paged_attention(q, k, v, table, ctx, cu, extents=extents, **scales)


def test_int8_decode_step_never_syncs():
    from longctx.kernels import triton_attention

    args, scales, slots, new_k, new_v = decode_step()
    ref_args = [t.clone() for t in args]
    ref_scales = {name: s.clone() for name, s in scales.items()}
    warm = ([t.clone() for t in args], {name: s.clone() for name, s in scales.items()})
    run_step(triton_attention, *warm, slots, new_k, new_v, (1, 4099))  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = run_step(triton_attention, args, scales, slots, new_k, new_v, (1, 4099))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    q, k, v, table, ctx, cu = ref_args
    reference.write_kv(k, v, new_k, new_v, slots, **ref_scales)
    for got, expected in zip((args[1], args[2], *scales.values()), (k, v, *ref_scales.values())):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    check_kernel(triton_attention.paged_attention, args, scales)


def test_int8_decode_step_in_a_cuda_graph_equals_eager():
    """write_kv(..., starts=...) + paged_attention(..., extents=...) captured once and replayed
    for two steps (new q, K/V, slots and context lengths copied into the static inputs) gives
    the eager results exactly, pages and scales included."""
    from longctx.kernels import triton_attention

    args, scales, slots, new_k, new_v = decode_step(seed=5)
    eager = ([t.clone() for t in args], {name: s.clone() for name, s in scales.items()})
    static = [t.clone() for t in args], {name: s.clone() for name, s in scales.items()}
    s_slots, s_k, s_v = slots.clone(), new_k.clone(), new_v.clone()
    extents = (1, 4099 + 1)  # the capture is planned for contexts up to this length
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles): the same write again changes nothing
        run_step(triton_attention, *static, s_slots, s_k, s_v, extents)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = run_step(triton_attention, *static, s_slots, s_k, s_v, extents)
    gen = torch.Generator().manual_seed(6)
    for step in range(2):
        if step == 1:  # the next token of every sequence, a fresh q
            q, _, _, table, ctx, _ = eager[0]
            ctx += 1
            host_table, host_ctx = table.cpu(), ctx.cpu().tolist()
            slots = torch.tensor([int(host_table[b, (c - 1) // 16]) * 16 + (c - 1) % 16
                                  for b, c in enumerate(host_ctx)], device=DEV)
            new_k = torch.randn(new_k.shape, generator=gen).to(new_k.dtype).to(DEV)
            new_v = torch.randn(new_v.shape, generator=gen).to(new_v.dtype).to(DEV)
            q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
            static[0][0].copy_(q)
            static[0][4].copy_(ctx)
        s_slots.copy_(slots)
        s_k.copy_(new_k)
        s_v.copy_(new_v)
        graph.replay()
        out, lse = run_step(triton_attention, *eager, slots, new_k, new_v, extents)
        torch.cuda.synchronize()
        torch.testing.assert_close(g_out, out, rtol=0, atol=0)
        torch.testing.assert_close(g_lse, lse, rtol=0, atol=0)
        for got, expected in zip((static[0][1], static[0][2], *static[1].values()),
                                 (eager[0][1], eager[0][2], *eager[1].values())):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    check_kernel(triton_attention.paged_attention, static[0], static[1])

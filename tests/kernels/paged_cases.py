"""Random paged batches for the kernel tests, and the tolerances they are judged by.

A batch is built to catch paging bugs: its block table is a shuffled permutation of the pool,
contexts end mid-page, and every pool slot no sequence owns (the tail of a last page, spare
blocks, unused block-table entries) holds NaN, so an unmasked K/V load poisons the output.

Tolerances, against the reference run on the same-dtype inputs:
          out                          lse (always fp32)
  fp32    atol 1e-5, rtol 1e-5         atol 1e-5, rtol 1e-5
  fp16    atol 2e-3, rtol 2e-3         atol 2e-3, rtol 1e-3
  bf16    atol 1e-2, rtol 1.6e-2       atol 1.6e-2, rtol 8e-3
16-bit paths may round scores to the input dtype (e.g. PyTorch's CPU SDPA), which moves an lse by
about one input-dtype ulp of its size. An lse error d rescales a part's weight in a merge by
about 1 + d, so the lse bound matches the out bound rather than being tighter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longctx.kernels import reference

OUT_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
LSE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3),
}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TWO_BRANCH_TREE = [-1, 0, 1, 2, 0, 4, 5]  # root, then branches 1-2-3 and 4-5-6


def ancestor_masks(parents: list[int]) -> list[int]:
    """Bit j of word i set iff node j is node i or one of its ancestors (parents precede)."""
    words: list[int] = []
    for node, parent in enumerate(parents):
        assert parent < node
        words.append((1 << node) | (words[parent] if parent >= 0 else 0))
    return words


@dataclass(frozen=True)
class Case:
    """One random paged batch. ``trees[b]``: parents of sequence b's new tokens, or None."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    trees: tuple | None = None
    seed: int = 0
    ordered: bool = False  # the block table in pool order (pages that follow each other), not shuffled


@dataclass
class PagedBatch:
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (NB, BS, Hkv, D)
    v_cache: torch.Tensor  # (NB, BS, Hkv, D)
    block_table: torch.Tensor  # (B, max_blocks) int32
    context_lens: torch.Tensor  # (B,) int32
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32
    tree_mask: torch.Tensor | None  # (T,) int64

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.context_lens,
                self.cu_seqlens_q)


def tree_words(case: Case) -> torch.Tensor | None:
    """Tree masks for a batch; sequences without a tree get the causal chain."""
    if case.trees is None:
        return None
    words: list[int] = []
    for q_len, parents in zip(case.q_lens, case.trees):
        words += ancestor_masks(parents if parents is not None else list(range(-1, q_len - 1)))
    return torch.tensor(words, dtype=torch.int64)


def make_batch(case: Case) -> PagedBatch:
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    blocks_per_seq = [math.ceil(c / bs) for c in case.ctx_lens]
    num_spare = 3
    num_blocks = sum(blocks_per_seq) + num_spare
    k_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"))
    v_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"))
    pool = torch.arange(num_blocks) if case.ordered else torch.randperm(num_blocks, generator=gen)
    spare = pool[-1].item()
    block_table = torch.full((len(case.ctx_lens), max(blocks_per_seq) + 2), spare,
                             dtype=torch.int32)  # unused entries point at a NaN block
    taken = 0
    for b, (ctx_len, n) in enumerate(zip(case.ctx_lens, blocks_per_seq)):
        ids = pool[taken:taken + n]
        taken += n
        block_table[b, :n] = ids.to(torch.int32)
        for pos in range(0, ctx_len, bs):  # only the slots below ctx_len get finite values
            rows = min(bs, ctx_len - pos)
            k_cache[ids[pos // bs], :rows] = torch.randn(rows, hkv, dim, generator=gen)
            v_cache[ids[pos // bs], :rows] = torch.randn(rows, hkv, dim, generator=gen)
    num_tokens = sum(case.q_lens)
    q = torch.randn(num_tokens, hkv * case.group, dim, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()],
                              dtype=torch.int32)
    tree = tree_words(case)
    return PagedBatch(
        q.to(case.dtype).to(DEVICE), k_cache.to(case.dtype).to(DEVICE),
        v_cache.to(case.dtype).to(DEVICE), block_table.to(DEVICE),
        torch.tensor(case.ctx_lens, dtype=torch.int32, device=DEVICE), cu_seqlens.to(DEVICE),
        tree.to(DEVICE) if tree is not None else None)


def check_against_reference(impl, batch: PagedBatch, dtype: torch.dtype) -> None:
    out, lse = impl.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    ref_out, ref_lse = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert lse.shape == batch.q.shape[:2] and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out: a K/V load past the context end?"
    assert not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[dtype])

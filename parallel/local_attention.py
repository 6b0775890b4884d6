"""One rank's attention of a block of queries over a block of keys, with its log-sum-exp.

Owns: ``attend(q, k, v, causal, scale) -> (out, lse)`` on contiguous K/V, the building block
of ring attention, sharded-KV and paged sequence-parallel attention, on the device's fused kernel:
PyTorch's CPU flash kernel, or its CUDA memory-efficient kernel (both return the lse); and
the running (out, lse) state those paths fold partial results into (``empty_state``,
``merge_into``).
``attend_masked`` takes any bool mask, in plain fp32 math, for the small blocks of a step's
own new tokens (at most a few dozen queries: lookahead trees, short causal runs).
Never: communication, paged KV.

Two forms, because blocks in sequence parallelism come in two kinds:

* all keys visible (an earlier block, or a non-causal call): the query heads that share a KV
  head are stacked along the query axis, [Hkv, G * L, D] against [Hkv, S, D], so GQA needs no
  copy of K/V (visibility does not depend on the row, so stacking is exact);
* the diagonal block (queries and keys are the same L positions): causal, K/V heads repeated
  G times, since a stacked row would lose its position.

Shape legend: L queries, S keys, H query heads, Hkv kv heads, G = H / Hkv, D head dim.
Conventions as ``longctx.kernels.reference``: ``out`` in q's dtype, ``lse`` fp32 [L, H],
``-inf`` (and out 0) for a query with no key.
"""

from __future__ import annotations

import torch


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's fused kernel on [1, heads, len, D] operands -> out, lse [1, heads, len].
    K/V in another dtype than q (bf16 pages under a bf16 model's fp32 activations on the CPU)
    are converted to q's."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if q.device.type == "cuda":
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]  # the CUDA kernel pads the lse rows to 32
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qs = q.view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv, group * q_len, head_dim)
    out, lse = _fused(qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None], False, scale)  # (1, Hkv, G*L, D)
    out = out[0].view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
    lse = lse[0].view(num_kv, group, q_len).permute(2, 0, 1).reshape(q_len, num_heads)
    return out, lse.float()


def _attend_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]  # (1, H, L, D)
    kh = k.transpose(0, 1)[None].repeat_interleave(group, dim=1)  # (1, H, L, D)
    vh = v.transpose(0, 1)[None].repeat_interleave(group, dim=1)
    out, lse = _fused(qh, kh, vh, True, scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()  # (L, H, D), (L, H)


def empty_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries that see no key: zeros fp32 [L, H, D] and -inf [L, H]."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:2], float("-inf"), device=q.device)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result over other keys into the running state, in place: out fp32
    [..., H, D], lse [..., H]. The math of ``kernels.reference.merge_attn_states`` (and equal
    to it within fp32 rounding, see tests), as one fused pass over ``out``:

        w = exp(part_lse) / (exp(lse) + exp(part_lse)) = sigmoid(part_lse - lse)
        out = out + w * (part_out - out),   lse = logaddexp(lse, part_lse)

    An empty part (part_lse = -inf) gets w = 0; an empty state (lse = -inf) gets w = 1, which
    ``lerp`` turns into an exact copy. The broadcasting form of the reference costs ~14x more
    on the CPU (measured 15.6 vs 1.1 ms for [2048, 9, 64], one thread).
    """
    weight = torch.sigmoid(part_lse - lse)
    weight = torch.where(torch.isneginf(part_lse), torch.zeros_like(weight), weight)  # also -inf - -inf
    out.lerp_(part_out.to(out.dtype), weight[..., None])
    lse.copy_(torch.logaddexp(lse, part_lse))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, H, D], k/v [S, Hkv, D]. ``causal`` only for a diagonal block (L == S, same
    positions); otherwise every query sees every key."""
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"a causal block must be diagonal: {q.shape[0]} queries, {k.shape[0]} keys")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} kv heads")
    if q.shape[0] == 0 or k.shape[0] == 0:
        out, lse = empty_state(q)
        return out.to(q.dtype), lse
    if causal:
        return _attend_diagonal(q, k, v, scale)
    return _attend_all(q, k, v, scale)


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                  scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, H, D], k/v [S, Hkv, D], visible bool [L, S] -> out fp32 [L, H, D], lse [L, H];
    ``softcap``: scores capped to c * tanh(s / c) first. Plain fp32 math: meant for small L
    and S (``attend_masked_blocks`` cuts a large L)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # (S, H, D)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), kf) * scale  # (H, L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, L)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hls,shd->lhd", probs, vf), lse.transpose(0, 1).contiguous()


def attend_masked_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                         scale: float, softcap: float | None = None,
                         rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_masked`` over blocks of ``rows`` queries, so the scores stay [H, rows, S]."""
    if q.shape[0] <= rows:
        return attend_masked(q, k, v, visible, scale, softcap)
    parts = [attend_masked(q[i:i + rows], k, v, visible[i:i + rows], scale, softcap) for i in range(0, q.shape[0], rows)]
    return torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])

"""Plain-torch attention: the numerical truth every other attention path is tested against.

Owns: readable, obviously-correct implementations (fp32 math, explicit masks, no tiling).
Never: optimisations, in-place tricks, or anything a reader has to trust rather than read.

Shape legend: B batch (sequences), T query tokens in this step (all sequences, flattened),
S context length of one sequence, H query heads, Hkv kv heads, D head dim, NB number of KV
blocks, BS block size.

Conventions shared by every attention path in longctx:

* Queries are flattened over the batch: ``q`` is ``[T, H, D]`` and ``cu_seqlens_q`` ``[B + 1]``
  gives each sequence's slice. A sequence's new tokens are the *last* ``q_len`` tokens of its
  context, so query ``i`` of a sequence with context length ``S`` sits at absolute position
  ``S - q_len + i`` (causal masks are bottom-right aligned).
* Paged KV: per layer, ``k_cache`` and ``v_cache`` are ``[NB, BS, Hkv, D]``; row ``b`` of
  ``block_table`` (``[B, max_blocks]``, int32) lists sequence ``b``'s blocks in order; token
  ``p`` of the sequence lives in block ``block_table[b, p // BS]`` at offset ``p % BS``.
* Tree masks (lookahead verification): ``tree_mask`` is int64 ``[T]``; bit ``j`` of query
  ``i``'s word says query ``i`` may see new token ``j`` of the same sequence (its ancestors and
  itself). ``None`` means the causal mask. Only sequences with ``q_len <= 63`` may use it. Every
  query always sees the whole cached context (positions ``< S - q_len``).
* Every function returns ``(out, lse)``: ``out`` in the dtype of ``q``; ``lse`` fp32
  ``[T, H]``, the natural-log log-sum-exp of the scaled scores (``-inf`` for a query with no
  visible key).
* Sliding windows (``window=W``, Mistral/Gemma/Phi-3 layers): a query at position p also sees
  only keys at positions > p - W (W keys counting itself; HF's ``sliding_window`` and
  flash-attn's ``window_size=(W - 1, 0)``). Positions: cached token c is at c; new token i is
  at ``S - q_len + i``, or under a tree mask at ``S - q_len + depth(i)`` with ``depth(i) =
  popcount(word_i) - 1`` (its ancestors), as the runner places draft tokens. ``None``: no window.
* Soft-capping (``softcap=c``, Gemma 2): each scaled score s becomes ``c * tanh(s / c)`` before
  the mask and the softmax; ``lse`` is over the capped scores. ``None``: no cap.
"""

from __future__ import annotations

import math

import torch

from . import kv_quant


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in fp32. q [L, H, D], k/v [S, Hkv, D], visible bool [L, S]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # (S, H, D)
    v = v.float().repeat_interleave(group, dim=1)  # (S, H, D)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale  # (H, L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, L)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key -> 0
    out = torch.einsum("hls,shd->lhd", probs, v)  # (L, H, D)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def causal_visibility(q_len: int, ctx_len: int, tree_mask: torch.Tensor | None = None,
                      device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
    """Bool [q_len, ctx_len]: which keys each new token sees (bottom-right causal or tree,
    within ``window`` positions when one is given; see the module's conventions)."""
    if q_len > ctx_len:
        raise ValueError(f"q_len {q_len} exceeds context length {ctx_len}")
    num_cached = ctx_len - q_len
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(ctx_len, device=device)[None, :]
    visible = cols <= rows + num_cached  # (q_len, ctx_len)
    if tree_mask is not None:
        if q_len > 63:
            raise ValueError(f"tree masks support at most 63 new tokens per sequence, got {q_len}")
        bits = (tree_mask.to(device).long()[:, None] >> torch.arange(q_len, device=device)) & 1
        visible = visible.clone()
        visible[:, num_cached:] = bits.bool()
    if window is not None:
        check_window(window)
        positions = token_positions(q_len, ctx_len, tree_mask, device)
        visible = visible & (positions[num_cached:, None] - positions[None, :] < window)
    return visible


def check_window(window: int) -> None:
    """A sliding window is a positive number of positions (ValueError otherwise)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"a sliding window is a positive number of tokens, got {window!r}")


def token_positions(q_len: int, ctx_len: int, tree_mask: torch.Tensor | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Int64 [ctx_len]: each token's position: cached tokens in order, new token i at
    ``num_cached + i``, or its depth in the draft tree past ``num_cached`` under a tree mask."""
    num_cached = ctx_len - q_len
    positions = torch.arange(ctx_len, device=device)
    if tree_mask is not None:
        words = tree_mask.to(device).long()
        bits = (words[:, None] >> torch.arange(q_len, device=device)) & 1
        positions[num_cached:] = num_cached + bits.sum(dim=1) - 1
    return positions


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, window: int | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, contiguous K/V. q [L, H, D], k/v [S, Hkv, D] with L <= S when causal.

    Causal is bottom-right aligned: query i sees keys 0 .. S - L + i (and with ``window``
    only the last ``window`` of them).
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if causal:
        visible = causal_visibility(q.shape[0], k.shape[0], device=q.device, window=window)
    else:
        if window is not None:
            raise ValueError("a sliding window needs causal attention")
        visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    return _attend(q, k, v, visible, scale, softcap)


def gather_pages(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from paged storage: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    pages = cache[block_row[:num_blocks].long()]  # (num_blocks, BS, Hkv, D)
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    tree_mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, step_cache: dict | None = None,
                    extents: tuple[int, int] | None = None, window: int | None = None,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a flattened batch of new tokens over paged KV (which already holds them).
    ``window`` / ``softcap``: a sliding window and a score cap (the module's conventions).
    ``step_cache`` and ``extents``: what a kernels module may reuse within a step (a memo,
    the host's max query and context lengths); every module takes them, this one needs neither.

    q [T, H, D]; k_cache/v_cache [NB, BS, Hkv, D]; block_table [B, max_blocks];
    context_lens [B] (cached + new tokens); cu_seqlens_q [B + 1]; tree_mask int64 [T] or None.
    int8 pages (``kv_quant.py``): k_cache/v_cache int8 with ``k_scale``/``v_scale`` fp32
    [NB, Hkv]; a row's value is ``int8 * scale[block, head]``.
    Returns out [T, H, D] and lse fp32 [T, H].
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if k_scale is not None:
        k_cache = kv_quant.dequantize(k_cache, k_scale, q.dtype)
        v_cache = kv_quant.dequantize(v_cache, v_scale, q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for b in range(block_table.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        ctx_len = int(context_lens[b])
        k = gather_pages(k_cache, block_table[b], ctx_len)  # (S, Hkv, D)
        v = gather_pages(v_cache, block_table[b], ctx_len)  # (S, Hkv, D)
        seq_tree = tree_mask[start:end] if tree_mask is not None else None
        visible = causal_visibility(end - start, ctx_len, seq_tree, device=q.device, window=window)
        out[start:end], lse[start:end] = _attend(q[start:end], k, v, visible, scale, softcap)
    return out, lse


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, starts: torch.Tensor | None = None,
             step_cache: dict | None = None) -> None:
    """Store new rows: k/v [T, Hkv, D] go to slots ``block * BS + offset`` (slot < 0: skip).
    ``step_cache``: as for ``paged_attention`` (unused here). int8 pages (scales given):
    quantised by ``kv_quant.write_int8`` (``starts``: its argument,
    used when no slot is skipped)."""
    block_size = k_cache.shape[1]
    if k_scale is not None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        starts = starts if bool(keep.all()) else None
        kv_quant.write_int8(k_cache, k_scale, k[keep], slots, starts)
        kv_quant.write_int8(v_cache, v_scale, v[keep], slots, starts)
        return
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets. out [..., H, D], lse [..., H] (fp32).

    A part with lse = -inf (no keys) contributes nothing; both empty gives out 0, lse -inf.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)  # exp(-inf) = 0 for an empty part
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (w_a[..., None] * out_a.float() + w_b[..., None] * out_b.float()) / denom[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(denom), torch.full_like(m, float("-inf")))
    return out.to(out_a.dtype), lse

"""Triton paged attention: split-KV flash decoding, lookahead verification and prefill chunks.

Owns: the GPU attention kernels over paged KV (``paged_attention``), the KV write
(``write_kv``) and the log-sum-exp merge of partial attention (``merge_attn_states``), with the
same signatures and ``(out, lse)`` conventions as ``kernels/reference.py``.
Never: scheduling, allocation of KV pages, or any import beyond torch, triton and
``kv_quant`` (whose ``write_int8`` defines the int8 page write; ``write_kv`` writes the same
bytes with Triton kernels).

Algorithm (FlashAttention-2, Dao 2023; flash decoding, Dao et al. 2023)
-----------------------------------------------------------------------
One kernel family serves decode (q_len 1), lookahead verification (q_len <= 63, causal or tree
mask) and prefill chunks (q_len in the thousands). A program owns

    (query block of one sequence, kv head, KV split)

where a query block is ``BLOCK_Q`` consecutive new tokens times the ``GROUP = H // Hkv`` query
heads that share the kv head, packed as ``BLOCK_M >= BLOCK_Q * GROUP`` rows of one ``tl.dot``
operand (row r = token r // GROUP, head r % GROUP). Decode therefore reads each K/V tile once
for the whole GQA group, and a prefill chunk is tiled over query blocks like flash attention.

Each program walks its key range in ``BLOCK_N`` tiles, gathering every key's page through the
block table (so any block size works, and a tile may straddle pages), and keeps the online
softmax state (running max m, sum l, accumulator acc) in fp32. Keys every row of the block may
see (the cached prefix and, causally, the block's own diagonal start) are walked without a
visibility mask; the remaining tiles apply the bottom-right causal mask or the tree mask.

Sliding windows (``window=W``) and score caps (``softcap=c``) compile a third entry point,
``_paged_attention_window_kernel``, from the same body (HAS_WINDOW / HAS_SOFTCAP); the two
kernels without them are unchanged. With a window, a query block's keys start at the tile
holding the lowest position any of its rows sees (the splits are laid from there, so keys out
of every window are never loaded); the tiles from there up to the highest such position (the
window's edge) are walked with the window mask as well as the causal or tree mask, the rest
as before. The cap maps each score (kept in log2 units) to ``c' tanh(score / c')`` with
``c' = c log2 e``, which is ``c tanh(s / c)`` in natural units, before the mask.

Split-KV: when query blocks x kv heads cannot fill the GPU (decode of few long sequences), the
key range is cut into ``num_splits`` equal, tile-aligned ranges; stage 1 writes one partial
(out, lse) per split and stage 2 merges them with the same log-sum-exp helper that
``merge_attn_states`` uses:

    m = max(lse_a, lse_b),  w_x = exp(lse_x - m),
    out = (w_a out_a + w_b out_b) / (w_a + w_b),  lse = m + log(w_a + w_b)

An empty part (lse = -inf) weighs 0; a row with no visible key ends with out 0, lse -inf.

Limits
------
* q, k_cache, v_cache share one dtype: fp16, bf16 or fp32. Dots run in that dtype with fp32
  accumulation (fp32 uses IEEE products, not TF32, on small tiles); softmax statistics are fp32.
* Or int8 pages (``kv_quant.py``: int8 K/V with one fp32 scale per page and kv head) under a
  fp16, bf16 or fp32 q: a separate compilation of the same body (``INT8_KV``) loads int8
  tiles, converts them to q's dtype in registers (exact: |int8| <= 127) and runs the dots in
  that dtype; each key's page scale multiplies its score column after QK^T and its column of
  p before PV. Float pages compile exactly as before (their kernel passes INT8_KV=False).
  Speed (H100, decode, D 128, GQA 4, pages of 16, planner's tiles): about the float kernel's
  time, not half of it (32 x 4K keys: 232 vs 218 us in fp16), since these decode launches
  are bound by per-tile latency, not bandwidth; int8-specific tiles/splits are not tuned yet.
* Head dim: any size up to 256; non-powers of two are padded with masks.
* Tree masks: q_len <= 63 per sequence (bit j of an int64 word). Every query sees all cached keys
  (within its window, if any).
* Sliding windows: an int >= 1 (``reference.py``'s positions: a draft token sits at its depth).
  Under a tree mask the window must be >= 64 (ValueError below): then every new key a draft
  token sees is inside its window and only cached keys are tested, with the query's position
  from the popcount of its tree word. A window of at least the longest context is dropped
  (the plain kernel is exact). Score caps: a finite float > 0; tanh is computed from exp2
  (no tl.tanh), stable for any score.
* The launcher reads the largest context and q_len back to the host (one sync) to size tiles
  and splits; CUDA-graph capture would need those passed in.
* Launch configs are fixed heuristics (``plan_launch``), not autotuned. They compile for
  sm_80/sm_90 (tests/kernels/compile_triton_offline.py; no register spills for D <= 128 when
  checked with cuobjdump), but their speed has not been measured on a GPU yet. Under
  ``TRITON_INTERPRET=1`` (CPU tests) they are small and fixed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import kv_quant

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: globals there must be constexpr
LOG2E_K = tl.constexpr(LOG2E)  # LOG2E inside kernels
MAX_TREE_TOKENS = 63

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ---------------------------------------------------------------------------------------------
# @triton.jit helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _merge_pair(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint keys. out [R, D] fp32, lse [R] fp32 (ln)."""
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)  # exp(-inf) = 0 for an empty part
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    denom = tl.where(total > 0, total, 1.0)
    # an empty part adds exactly nothing, even if its out holds garbage
    part_a = tl.where(w_a[:, None] > 0, w_a[:, None] * out_a, 0.0)
    part_b = tl.where(w_b[:, None] > 0, w_b[:, None] * out_b, 0.0)
    out = (part_a + part_b) / denom[:, None]
    lse = tl.where(total > 0, m_safe + tl.log(denom), float("-inf"))
    return out, lse


@triton.jit
def _find_sequence(cu_seqlens_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest b with first_block(b) = cu_seqlens[b] // BLOCK_Q + b <= pid (binary search).

    first_block is strictly increasing and leaves each sequence at least ceil(q_len / BLOCK_Q)
    program ids, so the grid needs only T // BLOCK_Q + B programs and no host-side map.
    """
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(cu_seqlens_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = first_block <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _popcount(x):
    """Set bits of each non-negative int64 (SWAR; tree words never set bit 63)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def _soft_cap(scores, cap):
    """cap * tanh(scores / cap), scores and cap in log2 units (the same map as in natural
    units: c tanh(s / c) log2 e = (c log2 e) tanh(s log2 e / (c log2 e))). tanh|x| is
    (1 - t) / (1 + t) with t = exp(-2|x|) in (0, 1]: no overflow for any |x|, and its absolute
    error (about one fp32 ulp of 1, times cap) is that of rounding a score of size cap."""
    t = tl.exp2(tl.abs(scores) * (-2.0 * LOG2E_K / cap))
    capped = cap * ((1.0 - t) / (1.0 + t))
    return tl.where(scores < 0, -capped, capped)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr,
                  key_lo, key_hi, ctx_len, num_cached, tok, tree_words, first_key, softcap,
                  stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                  qk_scale, k_scale_head_ptr, v_scale_head_ptr, stride_ksb, stride_vsb,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_TREE: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
                  WINDOWED: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Online-softmax update of (acc, m, l) over keys [key_lo, key_hi) of one sequence.

    Scores are in log2 units (qk_scale = scale * log2 e). K/V loads are masked to keys below
    ctx_len, so uninitialised pages (possibly NaN) are never read. MASKED adds the causal or
    tree visibility mask; without it every key in range must be visible to every row.
    WINDOWED (with MASKED) also hides keys below ``first_key`` [BLOCK_M], each row's sliding
    window start (a key's index is its position: under a tree only cached keys can fall
    outside a window of >= 64, see ``launch_paged_attention``). HAS_SOFTCAP caps each score at
    ``softcap`` (log2 units) by ``_soft_cap`` before the mask.

    INT8_KV: K/V tiles are int8 (exact in the dot dtype) and every key carries the scale of
    its page and kv head (a tile may straddle pages, so scales are per key, not per tile).
    The K scale multiplies the key's score column after the dot; the V scale multiplies the
    key's column of p before the PV dot, normalised by the tile's largest V scale (which then
    multiplies the dot's result) so that p * scale does not sink into fp16 subnormals.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start in range(key_lo, key_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) absolute key positions
        key_ok = pos < ctx_len
        page = tl.load(table_row_ptr + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        k_ptrs = (k_head_ptr + page[None, :] * stride_kb + slot[None, :] * stride_ks
                  + offs_d[:, None] * stride_kd)  # (BLOCK_D, BLOCK_N)
        k_t = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        if INT8_KV:
            k_sc = tl.load(k_scale_head_ptr + page * stride_ksb, mask=key_ok, other=0.0)
            scores = (tl.dot(q, k_t.to(DOT_DTYPE), input_precision=DOT_PRECISION)
                      * (k_sc * qk_scale)[None, :])
        else:
            scores = tl.dot(q, k_t.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            scores = _soft_cap(scores, softcap)
        if MASKED:
            if HAS_TREE:
                bit = (pos - num_cached).to(tl.int64)
                bit = tl.minimum(tl.maximum(bit, 0), 63)
                in_tree = ((tree_words[:, None] >> bit[None, :]) & 1) != 0
                visible = (pos[None, :] < num_cached) | (in_tree & key_ok[None, :])
            else:
                visible = pos[None, :] <= num_cached + tok[:, None]
            if WINDOWED:
                visible = visible & (pos[None, :] >= first_key[:, None])
            scores = tl.where(visible & key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (v_head_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                  + offs_d[None, :] * stride_vd)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if INT8_KV:
            v_sc = tl.load(v_scale_head_ptr + page * stride_vsb, mask=key_ok, other=0.0)
            v_top = tl.max(v_sc, 0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            p_v = (p * (v_sc / v_top)[None, :]).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p_v, v.to(DOT_DTYPE),
                                                input_precision=DOT_PRECISION) * v_top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                                input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_program(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, split_size, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Stage 1: one (query block, kv head, split) -> partial out [rows, D] and lse [rows].
    The body of every stage-1 kernel (float pages, int8 pages with per-page scales, and either
    with a sliding window (``window`` positions) and/or a score cap (``softcap``, log2 units)).

    Without a window, split s covers keys [s * split_size, (s + 1) * split_size). With one,
    the splits start at the block's window base instead (the tile holding the lowest position
    any row of the block sees), so keys out of every row's window are never loaded and the
    splits share only the keys in reach; a split past the block's last visible key is empty
    (m = -inf, l = 0: stage 2 gives it no weight).
    """
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(cu_seqlens_ptr, num_seqs, pid_q, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_start
    first_tok = (pid_q - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_cached = ctx_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # (BLOCK_M,) token index within the sequence
    head = kv_head * GROUP + rows % GROUP  # (BLOCK_M,) query head
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = (q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    if HAS_TREE:
        tree_words = tl.load(tree_ptr + q_start + tok, mask=row_ok, other=0)
    else:
        tree_words = tok

    # Keys [0, full_end) are visible to every row of this block; [full_end, causal_end) need
    # the mask; nothing at or past causal_end is visible to any row. A window also hides keys
    # below each row's first_key (see HAS_WINDOW below).
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    if HAS_TREE:
        full_end = num_cached
        causal_end = ctx_len
    else:
        full_end = num_cached + first_tok + 1
        causal_end = num_cached + last_tok + 1
    key_lo = split * split_size
    if HAS_WINDOW:
        # Row r sees keys at positions >= first_key[r] (its position - window + 1; under a
        # tree a new token sits at its depth, and only cached keys can leave a window of
        # >= 64). Keys [win_lo, win_full) are seen by some rows, not all: the window's edge,
        # walked with the mask; the splits start at the tile holding win_lo.
        if HAS_TREE:
            q_pos = num_cached + (_popcount(tree_words) - 1).to(tl.int32)
        else:
            q_pos = num_cached + tok
        first_key = q_pos - window + 1  # (BLOCK_M,)
        win_lo = tl.maximum(tl.min(tl.where(row_ok, first_key, ctx_len), 0), 0)
        win_full = tl.max(tl.where(row_ok, first_key, 0), 0)
        key_lo += win_lo // BLOCK_N * BLOCK_N
    else:
        first_key = tok  # placeholder: only WINDOWED passes read it
    key_hi = tl.minimum(key_lo + split_size, causal_end)
    if HAS_WINDOW:
        edge_lo = key_lo
        key_lo = tl.maximum(key_lo, tl.minimum(key_hi, tl.cdiv(win_full, BLOCK_N) * BLOCK_N))
    key_mid = tl.maximum(key_lo, tl.minimum(key_hi, full_end // BLOCK_N * BLOCK_N))

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_scale_head_ptr = k_scale_ptr + kv_head * stride_ksh
    v_scale_head_ptr = v_scale_ptr + kv_head * stride_vsh
    if HAS_WINDOW:  # [edge_lo, key_lo): the window's edge; every key after it is in every window
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, edge_lo, key_lo, ctx_len,
            num_cached, tok, tree_words, first_key, softcap, stride_kb, stride_ks, stride_kd,
            stride_vb, stride_vs, stride_vd, qk_scale, k_scale_head_ptr, v_scale_head_ptr,
            stride_ksb, stride_vsb, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, HAS_TREE,
            DOT_DTYPE, DOT_PRECISION, INT8_KV, True, HAS_SOFTCAP)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, key_lo, key_mid, ctx_len,
        num_cached, tok, tree_words, first_key, softcap, stride_kb, stride_ks, stride_kd,
        stride_vb, stride_vs, stride_vd, qk_scale, k_scale_head_ptr, v_scale_head_ptr,
        stride_ksb, stride_vsb, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, HAS_TREE,
        DOT_DTYPE, DOT_PRECISION, INT8_KV, False, HAS_SOFTCAP)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_row_ptr, key_mid, key_hi, ctx_len,
        num_cached, tok, tree_words, first_key, softcap, stride_kb, stride_ks, stride_kd,
        stride_vb, stride_vs, stride_vd, qk_scale, k_scale_head_ptr, v_scale_head_ptr,
        stride_ksb, stride_vsb, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, HAS_TREE,
        DOT_DTYPE, DOT_PRECISION, INT8_KV, False, HAS_SOFTCAP)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that saw no key: acc = 0 -> out 0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    out_ptrs = (out_ptr + split * stride_os + (q_start + tok)[:, None] * stride_ot
                + head[:, None] * stride_oh + offs_d[None, :] * stride_od)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse_ptrs = lse_ptr + split * stride_ls + (q_start + tok) * stride_lt + head * stride_lh
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr,
        qk_scale, num_seqs, split_size,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stage 1 over float pages (q, K and V of one dtype). The scale arguments of the shared
    body are placeholders its INT8_KV=False branches never read."""
    _paged_attention_program(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_ptr, v_ptr,
        qk_scale, num_seqs, split_size, 0, 1.0,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        0, 0, 0, 0,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, HAS_TREE,
        DOT_DTYPE, DOT_PRECISION, False, False, False)


@triton.jit
def _paged_attention_int8_kernel(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, split_size,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stage 1 over int8 pages: K/V int8 [NB, BS, Hkv, D] whose row (block, s, h) is worth
    ``int8 * scale[block, h]`` (k_scale/v_scale fp32 [NB, Hkv]); q and the dots in DOT_DTYPE."""
    _paged_attention_program(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, split_size, 0, 1.0,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, HAS_TREE,
        DOT_DTYPE, DOT_PRECISION, True, False, False)


@triton.jit
def _paged_attention_window_kernel(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, split_size, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Stage 1 with a sliding window (HAS_WINDOW: ``window`` positions) and/or a score cap
    (HAS_SOFTCAP: ``softcap`` = c log2 e), over float pages (INT8_KV=False: the scale
    arguments are placeholders) or int8 pages. The two kernels above stay as they were, so
    layers without either compile and run exactly as before."""
    _paged_attention_program(
        q_ptr, k_ptr, v_ptr, block_table_ptr, context_lens_ptr, cu_seqlens_ptr, tree_ptr,
        out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, split_size, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, HAS_TREE,
        DOT_DTYPE, DOT_PRECISION, INT8_KV, HAS_WINDOW, HAS_SOFTCAP)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_rows, num_splits,
                         stride_ps, stride_pr, stride_ls, stride_or,
                         HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Stage 2: fold num_splits partials [S, R, D] / [S, R] into out [R, D], lse [R]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    out = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lse = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        part_ptrs = part_out_ptr + split * stride_ps + rows[:, None] * stride_pr + offs_d[None, :]
        part = tl.load(part_ptrs, mask=mask, other=0.0)
        part_lse = tl.load(part_lse_ptr + split * stride_ls + rows, mask=row_ok,
                           other=float("-inf"))
        out, lse = _merge_pair(out, lse, part, part_lse)
    tl.store(out_ptr + rows[:, None] * stride_or + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _merge_states_kernel(out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_rows,
                         stride_ar, stride_br, stride_or,
                         HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge two partial attentions row by row: rows [R, D], lse [R]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    out_a = tl.load(out_a_ptr + rows[:, None] * stride_ar + offs_d[None, :], mask=mask, other=0.0)
    out_b = tl.load(out_b_ptr + rows[:, None] * stride_br + offs_d[None, :], mask=mask, other=0.0)
    lse_a = tl.load(lse_a_ptr + rows, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows, mask=row_ok, other=float("-inf"))
    out, lse = _merge_pair(out_a.to(tl.float32), lse_a.to(tl.float32),
                           out_b.to(tl.float32), lse_b.to(tl.float32))
    tl.store(out_ptr + rows[:, None] * stride_or + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cb, stride_cs, stride_ch, stride_cd,
                     stride_wb, stride_ws, stride_wh, stride_wd,
                     HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One new token: copy its [Hkv, D] K and V rows into slot_mapping[t] (slot < 0: skip)."""
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + t + heads * 0).to(tl.int64)  # (BLOCK_H,) one slot, per row
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & (slot[:, None] >= 0)
    page = slot[:, None] // PAGE_SIZE
    offset = slot[:, None] % PAGE_SIZE
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    k_dst = (k_cache_ptr + page * stride_cb + offset * stride_cs + heads[:, None] * stride_ch
             + offs_d[None, :] * stride_cd)
    v_dst = (v_cache_ptr + page * stride_wb + offset * stride_ws + heads[:, None] * stride_wh
             + offs_d[None, :] * stride_wd)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# int8 page write (kv_quant.write_int8's semantics and bytes, K and V together)
# ---------------------------------------------------------------------------------------------
# Five launches per call instead of ~15 torch kernels per tensor: (1) each run's first page's
# scales before the call, (2) pages a row starts at offset 0 forget their scale, (3) every row
# raises its page's scale to its |max| / 127 (atomic max), (4) each run's first page is
# requantised to its new scale where that rose, (5) every row is quantised into its slot.
# Each step needs the one before it complete, hence separate launches. Rounding is torch's:
# IEEE division (div_rn) and round-half-to-even, and launches pass enable_fp_fusion=False so
# that q * ratio is rounded before it is rounded to an integer (as torch does). Where the forms
# part: NaN/inf (a page restarted at offset 0 gets scale 0 here, where the torch and C forms'
# scale * 0 keeps a NaN; NaN rows), and rows whose slot is outside the pool (not written here;
# torch raises).


@triton.jit
def _round_half_even(x):
    """Round to the nearest integer, ties to even, for |x| < 2**22 (fp32): the IEEE addition of
    1.5 * 2**23 rounds away the fraction. Needs the launch's enable_fp_fusion=False."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _int8_slot(slots_ptr, row, heads, num_slots):
    """Row ``row``'s slot, once per head (masks then keep one shape), or -1 where it lies
    outside the pool's ``num_slots`` (such rows are not written: nothing is checked on the host)."""
    slot = tl.load(slots_ptr + row + heads * 0).to(tl.int64)
    return tl.where((slot >= 0) & (slot < num_slots), slot, -1)


@triton.jit
def _int8_run_slot(slots_ptr, starts_ptr, r, heads, num_rows, num_slots):
    """The slot of run r's first row; a start outside the rows is brought inside them (an extra
    start only costs time)."""
    row = tl.minimum(tl.maximum(tl.load(starts_ptr + r), 0), num_rows - 1)
    return _int8_slot(slots_ptr, row, heads, num_slots)


@triton.jit
def _int8_old_scales_kernel(slots_ptr, starts_ptr, k_scale_ptr, v_scale_ptr, old_ptr, num_kv_heads,
                            num_rows, num_slots, stride_ksb, stride_vsb, PAGE_SIZE: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """Run r: the K and V scales of its first page before this call -> old [R, 2, Hkv]."""
    r = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    ok = heads < num_kv_heads
    slot = _int8_run_slot(slots_ptr, starts_ptr, r, heads, num_rows, num_slots)
    ok = ok & (slot >= 0)
    page = slot // PAGE_SIZE
    k_old = tl.load(k_scale_ptr + page * stride_ksb + heads, mask=ok)
    v_old = tl.load(v_scale_ptr + page * stride_vsb + heads, mask=ok)
    tl.store(old_ptr + r * 2 * num_kv_heads + heads, k_old, mask=ok)
    tl.store(old_ptr + (r * 2 + 1) * num_kv_heads + heads, v_old, mask=ok)


@triton.jit
def _int8_forget_kernel(slots_ptr, k_scale_ptr, v_scale_ptr, num_kv_heads, num_slots, stride_ksb,
                        stride_vsb, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row t at offset 0 of its page: that page's scales become 0 (the page starts over)."""
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    slot = _int8_slot(slots_ptr, t, heads, num_slots)
    ok = (heads < num_kv_heads) & (slot >= 0) & (slot % PAGE_SIZE == 0)
    page = slot // PAGE_SIZE
    zero = tl.zeros([BLOCK_H], dtype=tl.float32)
    tl.store(k_scale_ptr + page * stride_ksb + heads, zero, mask=ok)
    tl.store(v_scale_ptr + page * stride_vsb + heads, zero, mask=ok)


@triton.jit
def _int8_raise_one(x_ptr, scale_ptr, t, slot, heads, offs_d, num_kv_heads, stride_xt, stride_xh,
                    stride_xd, stride_sb, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    ok = (heads < num_kv_heads) & (slot >= 0)
    page = slot // PAGE_SIZE
    mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs_d[None, :] * stride_xd,
                mask=mask, other=0.0).to(tl.float32)
    amax = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    tl.atomic_max(scale_ptr + page * stride_sb + heads, amax, mask=ok)


@triton.jit
def _int8_raise_kernel(slots_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, num_kv_heads, num_slots,
                       stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                       stride_ksb, stride_vsb, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row t: its page's scale per head becomes at least max |x| / 127 (K and V)."""
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = _int8_slot(slots_ptr, t, heads, num_slots)
    _int8_raise_one(k_ptr, k_scale_ptr, t, slot, heads, offs_d, num_kv_heads, stride_kt, stride_kh,
                    stride_kd, stride_ksb, HEAD_DIM, PAGE_SIZE)
    _int8_raise_one(v_ptr, v_scale_ptr, t, slot, heads, offs_d, num_kv_heads, stride_vt, stride_vh,
                    stride_vd, stride_vsb, HEAD_DIM, PAGE_SIZE)


@triton.jit
def _int8_requant_one(cache_ptr, scale_ptr, old, slot, heads, offs_d, num_kv_heads,
                      stride_cb, stride_cs, stride_ch, stride_cd, stride_sb,
                      HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    ok = (heads < num_kv_heads) & (slot >= 0)
    page = slot // PAGE_SIZE
    started = slot % PAGE_SIZE == 0
    new = tl.load(scale_ptr + page * stride_sb + heads, mask=ok, other=1.0)
    ratio = tl.minimum(tl.math.div_rn(old, tl.maximum(new, 1e-30)), 1.0)
    ratio = tl.where(started | (new <= 0.0), 1.0, ratio)
    lower = ok & (ratio < 1.0)  # ratio 1 leaves every value as it is: skip
    mask = lower[:, None] & (offs_d[None, :] < HEAD_DIM)
    for s in range(PAGE_SIZE):
        ptrs = (cache_ptr + page[:, None] * stride_cb + s * stride_cs + heads[:, None] * stride_ch
                + offs_d[None, :] * stride_cd)
        q = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
        tl.store(ptrs, _round_half_even(q * ratio[:, None]).to(tl.int8), mask=mask)


@triton.jit
def _int8_requant_kernel(slots_ptr, starts_ptr, old_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                         v_scale_ptr, num_kv_heads, num_rows, num_slots, stride_kb, stride_ks, stride_kh, stride_kd,
                         stride_vb, stride_vs, stride_vh, stride_vd, stride_ksb, stride_vsb,
                         HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Run r: if its first page held values and its scale rose, requantise the page's values to
    the new scale (round(q * old / new)); a page named by an earlier run is that run's."""
    r = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = _int8_run_slot(slots_ptr, starts_ptr, r, heads, num_rows, num_slots)
    page = slot // PAGE_SIZE
    earlier = tl.zeros([BLOCK_H], dtype=tl.int32)
    for e in range(0, r):  # runs that share a page (padding) must requantise it once
        other = _int8_run_slot(slots_ptr, starts_ptr, e, heads, num_rows, num_slots)
        earlier += ((other >= 0) & (other // PAGE_SIZE == page)).to(tl.int32)
    if tl.max(earlier, axis=0) == 0:
        ok = heads < num_kv_heads
        k_old = tl.load(old_ptr + r * 2 * num_kv_heads + heads, mask=ok, other=1.0)
        v_old = tl.load(old_ptr + (r * 2 + 1) * num_kv_heads + heads, mask=ok, other=1.0)
        _int8_requant_one(k_cache_ptr, k_scale_ptr, k_old, slot, heads, offs_d, num_kv_heads,
                          stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb, HEAD_DIM, PAGE_SIZE)
        _int8_requant_one(v_cache_ptr, v_scale_ptr, v_old, slot, heads, offs_d, num_kv_heads,
                          stride_vb, stride_vs, stride_vh, stride_vd, stride_vsb, HEAD_DIM, PAGE_SIZE)


@triton.jit
def _int8_store_one(x_ptr, cache_ptr, scale_ptr, t, slot, heads, offs_d, num_kv_heads,
                    stride_xt, stride_xh, stride_xd, stride_cb, stride_cs, stride_ch, stride_cd,
                    stride_sb, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    ok = (heads < num_kv_heads) & (slot >= 0)
    mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    page = slot // PAGE_SIZE
    step = tl.maximum(tl.load(scale_ptr + page * stride_sb + heads, mask=ok, other=1.0), 1e-30)
    x = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs_d[None, :] * stride_xd,
                mask=mask, other=0.0).to(tl.float32)
    q = _round_half_even(tl.math.div_rn(x, step[:, None]))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(cache_ptr + page[:, None] * stride_cb + (slot % PAGE_SIZE)[:, None] * stride_cs + heads[:, None] * stride_ch
             + offs_d[None, :] * stride_cd, q.to(tl.int8), mask=mask)


@triton.jit
def _int8_store_kernel(slots_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                       num_kv_heads, num_slots, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                       stride_kb, stride_ks, stride_kch, stride_kcd, stride_vb, stride_vs, stride_vch,
                       stride_vcd, stride_ksb, stride_vsb, HEAD_DIM: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row t: round(x / scale) clamped to +-127 into its slot (K and V)."""
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = _int8_slot(slots_ptr, t, heads, num_slots)
    _int8_store_one(k_ptr, k_cache_ptr, k_scale_ptr, t, slot, heads, offs_d, num_kv_heads,
                    stride_kt, stride_kh, stride_kd, stride_kb, stride_ks, stride_kch, stride_kcd,
                    stride_ksb, HEAD_DIM, PAGE_SIZE)
    _int8_store_one(v_ptr, v_cache_ptr, v_scale_ptr, t, slot, heads, offs_d, num_kv_heads,
                    stride_vt, stride_vh, stride_vd, stride_vb, stride_vs, stride_vch, stride_vcd,
                    stride_vsb, HEAD_DIM, PAGE_SIZE)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not _interpreting() and next(iter(devices)).type != "cuda":
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests); "
                         "use longctx.kernels.torch_paged on the CPU")


def _dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The tl.dot operand dtype and precision for inputs of ``dtype``."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}: use float16, bfloat16 or float32")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting()):
        return tl.float32, "ieee"  # the interpreter cannot compute in bf16
    return _TL_DTYPES[dtype], "tf32"  # precision is ignored for 16-bit operands


@dataclass(frozen=True)
class PagedLaunch:
    """Tile sizes and the KV split of one paged_attention call."""

    block_m: int  # query rows per program (tokens x heads of one GQA group)
    block_q: int  # tokens per query block
    block_n: int  # keys per tile
    num_splits: int  # KV splits per query block
    split_size: int  # keys per split, a multiple of block_n
    num_warps: int
    num_stages: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a pretend GPU small enough that test shapes exercise splits


def plan_launch(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                max_q_len: int, max_ctx_len: int, dtype: torch.dtype, device: torch.device,
                num_splits: int | None = None, window: int | None = None) -> PagedLaunch:
    """Choose tiles and the KV split.

    Tiles: 16-bit inputs take up to 128 query rows and 64-key tiles (32 for D > 128); fp32
    inputs multiply without tensor cores and keep 16 rows and 32 keys on 8 warps, the largest
    tiles that compiled without register spills for D = 128 (checked offline for sm_80/sm_90).
    Splits grow until (query programs x kv heads x splits) is about two waves of the GPU, but
    each split keeps at least ``min_keys`` keys: one long sequence then fills every SM, while a
    large batch or a prefill chunk (many query blocks) runs unsplit and needs no stage 2.
    With a sliding ``window`` the splits cut only the keys a query block can reach (from the
    tile of its lowest visible position to its last key: at most window + max_q_len - 1 keys
    plus the alignment of the first tile, see ``_paged_attention_program``), not the context.
    """
    interpreting = _interpreting()
    wide = dtype != torch.float32 and not interpreting
    max_rows = 128 if wide else (64 if interpreting else 16)
    block_m = max(16, min(max_rows, triton.next_power_of_2(max_q_len * group)),
                  triton.next_power_of_2(group))
    block_q = block_m // group
    block_n = 64 if wide and head_dim <= 128 else 32
    span = max_ctx_len  # keys one query block may have to walk
    if window is not None:
        span = min(max_ctx_len, window + max_q_len - 1 + block_n - 1)
    if num_splits is None:
        num_programs = (num_tokens // block_q + num_seqs) * num_kv_heads
        min_keys = block_n if interpreting else 256
        wanted = triton.cdiv(2 * _num_sms(device), num_programs)
        num_splits = max(1, min(wanted, triton.cdiv(span, min_keys), 128))
    split_size = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(span, split_size))
    num_warps = 8 if block_m >= 128 or dtype == torch.float32 else 4
    return PagedLaunch(block_m, block_q, block_n, num_splits, split_size, num_warps,
                       num_stages=1 if interpreting else 2)


def _check_paged_inputs(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q,
                        tree_mask) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, H, D] and k_cache [NB, BS, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "differ")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit KV heads/dim "
                         f"{num_kv_heads}/{k_cache.shape[3]} (need H % Hkv == 0, same D)")
    if head_dim > 256:
        raise ValueError(f"head dim {head_dim} > 256 is not supported")
    if k_cache.dtype == torch.int8 or v_cache.dtype == torch.int8:
        if k_cache.dtype != v_cache.dtype:
            raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, "
                             f"{v_cache.dtype}")
        if q.dtype not in _TL_DTYPES:
            raise ValueError(f"unsupported q dtype {q.dtype} over int8 pages: use float16, "
                             "bfloat16 or float32")
    elif not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    num_seqs = block_table.shape[0]
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError("block_table must be int32 [B, max_blocks]")
    if context_lens.shape != (num_seqs,) or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"need context_lens [{num_seqs}] and cu_seqlens_q [{num_seqs + 1}], got "
                         f"{tuple(context_lens.shape)} and {tuple(cu_seqlens_q.shape)}")
    if tree_mask is not None and (tree_mask.shape != (q.shape[0],)
                                  or tree_mask.dtype != torch.int64):
        raise ValueError(f"tree_mask must be int64 [{q.shape[0]}], got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")
    _check_device(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q,
                  *([tree_mask] if tree_mask is not None else []))


def _check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> bool:
    """Whether the pages are int8 (then both scales are fp32 [NB, Hkv] on the caches' device);
    raises ValueError for int8 pages without scales, scales beside float pages, or bad scales."""
    int8 = k_cache.dtype == torch.int8
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (int8 pages) or neither")
    if not int8:
        if k_scale is not None:
            raise ValueError(f"k_scale/v_scale are for int8 pages; the caches are "
                             f"{k_cache.dtype}")
        return False
    if k_scale is None:
        raise ValueError("int8 k_cache/v_cache need k_scale and v_scale (fp32 [NB, Hkv]): "
                         "a page's value is int8 * scale[block, kv head]")
    expected = (k_cache.shape[0], k_cache.shape[2])
    for name, cache, sc in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
        if sc.dtype != torch.float32 or tuple(sc.shape) != expected:
            raise ValueError(f"{name} must be float32 [NB, Hkv] = {list(expected)}, got "
                             f"{sc.dtype} {list(sc.shape)}")
        if sc.device != cache.device:
            raise ValueError(f"{name} is on {sc.device} but the caches on {cache.device}")
    return True


def _sequence_extents(context_lens, cu_seqlens_q) -> tuple[int, int]:
    """(max q_len, max context length), validating q_len <= context length: one host sync."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    stats = torch.stack([q_lens.max(), context_lens.max(), (context_lens - q_lens).min(),
                         q_lens.min()]).tolist()
    max_q_len, max_ctx_len, min_cached, min_q_len = stats
    if min_cached < 0 or min_q_len < 0:
        raise ValueError("every sequence needs 0 <= q_len <= context length "
                         "(context_lens counts cached + new tokens)")
    return max_q_len, max_ctx_len


MIN_TREE_WINDOW = 64  # a tree's new keys are all within a window of this many positions


def _check_window_and_cap(window, softcap, tree_mask) -> tuple[int | None, float | None]:
    """Validate ``window`` (an int >= 1 or None) and ``softcap`` (a finite float > 0 or None);
    ValueError for a tree mask under a window below ``MIN_TREE_WINDOW``."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"a sliding window is a positive number of tokens, got {window!r}")
        if tree_mask is not None and window < MIN_TREE_WINDOW:
            raise ValueError(f"tree masks need a sliding window of at least {MIN_TREE_WINDOW} "
                             f"positions in the Triton kernel, got {window} (a draft token's "
                             "window would depend on its depth; use the torch form)")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
                or not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
        softcap = float(softcap)
    return window, softcap


def launch_paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, *,
                           scale: float | None = None, tree_mask: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           extents: tuple[int, int] | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int | None = None,
                           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention with an optional forced split count (tests and benchmarks).
    ``extents``: (max query length, max context length) when the caller knows them on the
    host (the engine's runner does); else they are read from the device (one sync).
    ``k_scale``/``v_scale``: fp32 [NB, Hkv] for int8 caches (``kv_quant.py``), else None.
    ``window``/``softcap``: as in ``paged_attention``."""
    _check_paged_inputs(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q, tree_mask)
    int8 = _check_scales(k_cache, v_cache, k_scale, v_scale)
    window, softcap = _check_window_and_cap(window, softcap, tree_mask)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32,
                     device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out, lse
    max_q_len, max_ctx_len = extents if extents is not None else _sequence_extents(context_lens, cu_seqlens_q)
    if tree_mask is not None and max_q_len > MAX_TREE_TOKENS:
        raise ValueError(f"tree masks support at most {MAX_TREE_TOKENS} new tokens per "
                         f"sequence, got {max_q_len}")
    if window is not None and window >= max_ctx_len:
        window = None  # every query sees its whole context: the plain kernel is exact
    plan = plan_launch(num_tokens, num_seqs, num_kv_heads, group, head_dim, max_q_len,
                       max_ctx_len, q.dtype, q.device, num_splits, window)
    if plan.num_splits == 1:
        part_out, part_lse = out[None], lse[None]  # stage 1 writes the result directly
    else:
        part_out = torch.empty((plan.num_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty((plan.num_splits, num_tokens, num_heads), dtype=torch.float32,
                               device=q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    dot_dtype, dot_precision = _dot_config(q.dtype)
    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads, plan.num_splits)
    features, feature_flags = (), {}
    if window is not None or softcap is not None:
        # one kernel for both page kinds; float pages pass placeholder scales (never read)
        kernel = _paged_attention_window_kernel
        scale_args = (k_scale, v_scale) if int8 else (k_cache, v_cache)
        scale_strides = (*k_scale.stride(), *v_scale.stride()) if int8 else (0, 0, 0, 0)
        features = (window if window is not None else 0,
                    softcap * LOG2E if softcap is not None else 1.0)
        feature_flags = dict(INT8_KV=int8, HAS_WINDOW=window is not None,
                             HAS_SOFTCAP=softcap is not None)
    elif int8:  # the same body with int8 tiles and per-page scales (INT8_KV=True)
        kernel = _paged_attention_int8_kernel
        scale_args = (k_scale, v_scale)
        scale_strides = (*k_scale.stride(), *v_scale.stride())
    else:
        kernel, scale_args, scale_strides = _paged_attention_kernel, (), ()
    kernel[grid](
        q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q,
        tree_mask if tree_mask is not None else cu_seqlens_q,
        part_out, part_lse, *scale_args,
        scale * LOG2E, num_seqs, plan.split_size, *features,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *part_out.stride(), *part_lse.stride(), *scale_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
        PAGE_SIZE=k_cache.shape[1], HAS_TREE=tree_mask is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, **feature_flags,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.num_splits > 1:
        _launch_merge_splits(part_out, part_lse, out, lse)
    return out, lse


def _launch_merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    """Stage 2 over contiguous partials [S, T, H, D] / [S, T, H] into out [T, H, D]."""
    num_splits, num_tokens, num_heads, head_dim = part_out.shape
    assert part_out.is_contiguous() and part_lse.is_contiguous() and out.is_contiguous()
    num_rows = num_tokens * num_heads
    block_r = 16
    _merge_splits_kernel[(triton.cdiv(num_rows, block_r),)](
        part_out, part_lse, out, lse, num_rows, num_splits,
        part_out.stride(0), head_dim, part_lse.stride(0), head_dim,
        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim))


# ---------------------------------------------------------------------------------------------
# public functions (signatures as in kernels/reference.py)
# ---------------------------------------------------------------------------------------------




def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    tree_mask: torch.Tensor | None = None,
                    extents: tuple[int, int] | None = None,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    step_cache: dict | None = None, window: int | None = None,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a flattened batch of new tokens over paged KV (which already holds them).

    q [T, H, D]; k_cache/v_cache [NB, BS, Hkv, D]; block_table int32 [B, max_blocks];
    context_lens [B] (cached + new tokens); cu_seqlens_q [B + 1]; tree_mask int64 [T] or None.
    ``extents``: (max query length, max context length) from the host, so the launch never
    reads the device (the engine passes them; without them one sync reads them).
    int8 pages (``kv_quant.py``): k_cache/v_cache int8 with ``k_scale``/``v_scale`` fp32
    [NB, Hkv]; a row's value is ``int8 * scale[block, kv head]``. The kernel loads int8 tiles,
    converts them to q's dtype in registers (exact) and applies each key's page scale (see
    ``_attend_tiles``); q may be fp16, bf16 or fp32.
    ``window``: a sliding window of that many positions (int >= 1; reference.py's
    conventions); with a ``tree_mask`` it must be >= 64 (ValueError otherwise: then every new
    key a draft token sees lies inside its window, and only cached keys are tested).
    ``softcap``: each scaled score s becomes ``softcap * tanh(s / softcap)`` before the mask
    (float > 0). Either one runs ``_paged_attention_window_kernel``; without both the kernels
    are those of before.
    Returns out [T, H, D] (dtype of q) and lse fp32 [T, H].
    """
    return launch_paged_attention(q, k_cache, v_cache, block_table, context_lens, cu_seqlens_q,
                                  scale=scale, tree_mask=tree_mask, extents=extents,
                                  k_scale=k_scale, v_scale=v_scale, window=window,
                                  softcap=softcap)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, starts: torch.Tensor | None = None,
             step_cache: dict | None = None) -> None:
    """Store new rows: k/v [T, Hkv, D] go to slots ``block * BS + offset`` (slot < 0: skip).
    ``step_cache``: the step's memo every kernels module takes (unused: nothing here is
    derived on the host).

    int8 pages (k_cache/v_cache int8, ``k_scale``/``v_scale`` fp32 [NB, Hkv]): the rows are
    quantised as ``kv_quant.write_int8`` does, bit for bit, by five Triton launches for K and V
    together (``_launch_int8_write``). ``starts``: indices of
    the rows that may enter a page already holding values (each sequence's first row, e.g.
    ``cu_seqlens_q[:-1].long()``); with it the write never reads the device from the host (CUDA
    graphs) and every slot must be >= 0 (pad to a scratch page instead; a row whose slot is
    outside the pool is not written, since nothing can be checked on the host). Without it
    ``kv_quant.run_starts`` finds them (a host read), slots < 0 are dropped first and a slot
    past the pool is a ValueError.
    """
    if k.dim() != 3 or k.shape != v.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"need k/v [T, Hkv, D] of one shape and caches of one shape, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"k {tuple(k.shape)} does not fit k_cache {tuple(k_cache.shape)} or "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    _check_device(k_cache, v_cache, k, v, slot_mapping)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}")
    if _check_scales(k_cache, v_cache, k_scale, v_scale):
        _write_kv_int8(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, starts)
        return
    if starts is not None:
        raise ValueError("starts is for int8 pages (with k_scale/v_scale) only")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def _write_kv_int8(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, starts) -> None:
    if starts is None:  # run_starts reads the slots anyway: dropping skipped rows costs nothing
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        if slots.numel() and int(slots.max()) >= k_cache.shape[0] * k_cache.shape[1]:
            raise ValueError(f"slot {int(slots.max())} is outside the pool of {k_cache.shape[0]} pages "
                             f"of {k_cache.shape[1]}")
        k, v = k[keep], v[keep]
        starts = kv_quant.run_starts(slots, k_cache.shape[1])
    else:
        if starts.dim() != 1 or starts.dtype != torch.int64 or starts.device != k.device:
            raise ValueError(f"starts must be int64 [R] on {k.device}, got {starts.dtype} "
                             f"{list(starts.shape)} on {starts.device}")
        slots = slot_mapping.long()
    if slots.numel():
        _launch_int8_write(k_cache, v_cache, k, v, slots, k_scale, v_scale, starts)


def _launch_int8_write(k_cache, v_cache, k, v, slots, k_scale, v_scale, starts) -> None:
    """The five int8 write kernels (above) for T rows at ``slots`` int64 [T] and the runs'
    first rows ``starts`` int64 [R]; bytes equal to ``kv_quant.write_int8``. No host reads (CUDA
    graphs): the kernels skip rows whose slot is outside the pool and keep starts inside the rows."""
    num_rows, num_kv_heads, head_dim = k.shape
    if k_scale.stride(1) != 1 or v_scale.stride(1) != 1:
        raise ValueError("k_scale/v_scale must have contiguous rows")
    page_size = k_cache.shape[1]
    sizes = dict(BLOCK_H=triton.next_power_of_2(num_kv_heads))
    shape = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_D=triton.next_power_of_2(head_dim), **sizes)
    exact = dict(enable_fp_fusion=False)
    scale_strides = (k_scale.stride(0), v_scale.stride(0))
    num_slots = k_cache.shape[0] * page_size
    num_runs = starts.numel()
    old = torch.empty(num_runs, 2, num_kv_heads, dtype=torch.float32, device=k.device)
    if num_runs:
        _int8_old_scales_kernel[(num_runs,)](slots, starts, k_scale, v_scale, old, num_kv_heads,
                                             num_rows, num_slots, *scale_strides, PAGE_SIZE=page_size,
                                             **sizes)
    _int8_forget_kernel[(num_rows,)](slots, k_scale, v_scale, num_kv_heads, num_slots, *scale_strides,
                                     PAGE_SIZE=page_size, **sizes)
    _int8_raise_kernel[(num_rows,)](slots, k, v, k_scale, v_scale, num_kv_heads, num_slots, *k.stride(),
                                    *v.stride(), *scale_strides, **shape, **exact)
    if num_runs:
        _int8_requant_kernel[(num_runs,)](slots, starts, old, k_cache, v_cache, k_scale, v_scale,
                                          num_kv_heads, num_rows, num_slots, *k_cache.stride(), *v_cache.stride(),
                                          *scale_strides, **shape, **exact)
    _int8_store_kernel[(num_rows,)](slots, k, v, k_cache, v_cache, k_scale, v_scale, num_kv_heads,
                                    num_slots, *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
                                    *scale_strides, **shape, **exact)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets. out [..., H, D], lse [..., H] (fp32).

    A part with lse = -inf (no keys) contributes nothing; both empty gives out 0, lse -inf.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape \
            or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"need out [..., H, D] and lse [..., H] of matching shapes, got "
                         f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, "
                         f"{tuple(lse_b.shape)}")
    _check_device(out_a, lse_a, out_b, lse_b)
    head_dim = out_a.shape[-1]
    rows_a, rows_b = out_a.reshape(-1, head_dim), out_b.reshape(-1, head_dim)  # (R, D)
    if rows_a.stride(1) != 1 or rows_b.stride(1) != 1:
        rows_a, rows_b = rows_a.contiguous(), rows_b.contiguous()
    flat_lse_a = lse_a.reshape(-1).contiguous()  # (R,)
    flat_lse_b = lse_b.reshape(-1).contiguous()
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    num_rows = rows_a.shape[0]
    if num_rows == 0:
        return out, lse
    block_r = 16
    _merge_states_kernel[(triton.cdiv(num_rows, block_r),)](
        rows_a, flat_lse_a, rows_b, flat_lse_b, out, lse, num_rows,
        rows_a.stride(0), rows_b.stride(0), head_dim,
        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim))
    return out, lse

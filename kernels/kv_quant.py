"""int8 KV pages: symmetric int8 values with one fp32 scale per (page, KV head), per layer and
per K/V, written by ``write_int8`` and read back as ``value * scale``.

Owns: the definition of the int8 page write (torch ops only, so it runs on the CPU, on CUDA
and inside a captured CUDA graph: no host read-back; the C kernel on the CPU and the Triton
kernels on CUDA write the same bytes faster), and the dequantisation the reference and the
torch fallbacks read through.
The attention backend stores rows rotated by ``rotation(D)`` (an orthogonal matrix; queries are
rotated alike and outputs back), which evens out the channels one scale covers.
Never: attention. The compiled CPU kernels and the Triton kernels read int8 pages themselves
(the scale multiplies the dot product of a page's rows, so the inner loops stay int8 -> fp32).

The scale of a page is the largest |value| written to it since it was last started (its
offset 0 written), over 127. Pages fill in slot order, so a step's new tokens of one sequence
start either at offset 0 of a fresh page or inside the sequence's last page; every later page
they reach is entered at offset 0. When new tokens raise the scale of a page that already
holds tokens (only ever the first page a sequence's run writes to), the page's stored values
are requantised to the new scale first (``round(q * old / new)``: at most half a step of the
new scale more error per raise). Unwritten rows of a page hold garbage and are never read.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from . import cpu_decode, cpu_linear

# index_reduce_ ("prod", "amax") is what keeps the scale update free of host reads
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")

QMAX = 127.0


def dequantize(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every page as ``dtype``: cache int8 [NB, BS, Hkv, D], scale fp32 [NB, Hkv]."""
    return (cache.to(torch.float32) * scale[:, None, :, None]).to(dtype)


def dequantize_rows(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows at ``slots`` [N] (``block * BS + offset``) as ``dtype`` [N, Hkv, D]."""
    block_size = cache.shape[1]
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots).to(torch.float32)
    return (rows * scale.index_select(0, slots // block_size)[:, :, None]).to(dtype)


def run_starts(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Indices of the tokens that start a run of one page ([0] and every page change): the
    only tokens whose page can already hold values. Reads the slots (host work on the CPU)."""
    blocks = slots // block_size
    change = torch.ones_like(blocks, dtype=torch.bool)
    change[1:] = blocks[1:] != blocks[:-1]
    return change.nonzero().flatten()


def write_int8_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, plan: "WritePlan") -> None:
    """``write_int8`` of K and V; on the CPU one call of the compiled kernel (the same bytes,
    without ~15 small torch ops per tensor per layer), where it is available."""
    if not k_cache.is_cuda:
        if cpu_decode.available() and cpu_decode.write_int8_kv(k_cache, v_cache, k_scale, v_scale, k, v,
                                                                  plan.slots, plan.starts):
            return
    write_int8(k_cache, k_scale, k, plan)
    write_int8(v_cache, v_scale, v, plan)


_ROTATIONS: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}


def rotation(head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An orthogonal [D, D] matrix R that int8 pages store K and V through (``k @ R``, ``v @ R``;
    queries go through it too, and outputs back through ``R.T``, so attention is unchanged in
    exact arithmetic): the normalised Hadamard matrix when D is a power of two, else a fixed
    seeded random rotation. It spreads a few large channels (keys have them) over every
    channel, so one scale per (page, head) no longer leaves the small channels a few levels."""
    key = (head_dim, str(device), dtype)
    found = _ROTATIONS.get(key)
    if found is None:
        if head_dim & (head_dim - 1) == 0:
            r = torch.ones(1, 1, dtype=torch.float64)
            while r.shape[0] < head_dim:
                r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
            r = r / math.sqrt(head_dim)
        else:
            gen = torch.Generator().manual_seed(head_dim)
            r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
        found = _ROTATIONS[key] = r.to(device=device, dtype=dtype)
    return found


def _turn_weight(rot: torch.Tensor, back: bool) -> torch.Tensor | None:
    """The row kernel's [out, in] weight for x @ rot (``back``: x @ rot.T), or None where that
    kernel does not take the product (not float32 on the CPU, or not built here)."""
    if rot.device.type != "cpu" or rot.dtype != torch.float32 or not cpu_linear.available():
        return None
    key = (rot.shape[0], back)
    found = _TURN_WEIGHTS.get(key)
    if found is None or found[0] is not rot:
        found = _TURN_WEIGHTS[key] = (rot, (rot if back else rot.T).contiguous())
    return found[1]


_TURN_WEIGHTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def turn(x: torch.Tensor, rot: torch.Tensor, back: bool = False) -> torch.Tensor:
    """x [..., D] @ ``rot`` (``back``: @ ``rot.T``) in float32, returned contiguous in x's
    dtype. On the CPU, float32 rows go to the compiled row kernel (``cpu_linear``): a few rows
    (a decode step's) on the calling thread (``small_product``, see there why), more with the
    kernel's threads."""
    w = _turn_weight(rot, back) if x.dtype == torch.float32 and x.device.type == "cpu" else None
    if w is None or not x.numel():
        return (x.float() @ (rot.T if back else rot)).to(x.dtype).contiguous()
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= cpu_linear.SMALL_ROWS:
        return cpu_linear.small_product(rows.contiguous(), w).view(x.shape)
    return cpu_linear.linear(rows, w).view(x.shape)


def turn_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``turn`` of a step's q [T, H, D], k and v [T, Hkv, D], contiguous. A decoded token's
    three, when they are one buffer's consecutive heads (the model's qkv projection), go
    through one product."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if (t == 1 and q.dtype == torch.float32 and k.data_ptr() == q.data_ptr() + 4 * h * d
            and v.data_ptr() == k.data_ptr() + 4 * hkv * d and q.is_contiguous() and k.is_contiguous()
            and v.is_contiguous() and q.device.type == "cpu"):
        w = _turn_weight(rot, False)
        if w is not None:  # as_strided checks the rows against q's storage, which then holds k and v
            out = cpu_linear.small_product(q.as_strided((h + 2 * hkv, d), (d, 1)), w)
            return out[:h].view(1, h, d), out[h:h + hkv].view(1, hkv, d), out[h + hkv:].view(1, hkv, d)
    return turn(q, rot), turn(k, rot), turn(v, rot)


class WritePlan(NamedTuple):
    """What ``write_int8`` derives from a step's slots alone: the same for K and V and in every
    layer, so a step computes it once (``plan_write``)."""

    slots: torch.Tensor  # [T] int64
    blocks: torch.Tensor  # [T] the page of each row
    keep: torch.Tensor  # [T, 1] fp32: 0 where a row starts its page (the page forgets its scale)
    first_blocks: torch.Tensor  # [R] the pages that may already hold values
    started: torch.Tensor  # [R, 1] bool: that page is started in this call after all
    starts: torch.Tensor  # [R] the row indices behind first_blocks


def plan_write(slots: torch.Tensor, block_size: int, starts: torch.Tensor | None = None) -> WritePlan:
    """``slots`` [T] (int64, all >= 0); ``starts``: as for ``write_int8``."""
    if starts is None:
        starts = run_starts(slots, block_size)
    blocks = slots // block_size
    fresh = (slots % block_size) == 0
    return WritePlan(slots, blocks, (~fresh).to(torch.float32)[:, None], blocks.index_select(0, starts),
                     fresh.index_select(0, starts)[:, None], starts)


def write_int8(cache: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, slots: torch.Tensor | WritePlan,
               starts: torch.Tensor | None = None) -> None:
    """Quantise rows ``x`` [T, Hkv, D] into ``cache`` int8 [NB, BS, Hkv, D] at ``slots`` [T]
    (int64, all >= 0; or a ``plan_write`` of them), updating ``scale`` fp32 [NB, Hkv].
    ``starts``: indices into the T rows that cover the first row each page gets in this call
    when the page already holds values (each sequence's first row does; extra indices only
    cost time); default ``run_starts``. Duplicated pages are allowed (they get identical
    values)."""
    plan = slots if isinstance(slots, WritePlan) else plan_write(slots, cache.shape[1], starts)
    if plan.slots.numel() == 0:
        return
    old = scale.index_select(0, plan.first_blocks)  # [R, Hkv] before this call
    scale.index_reduce_(0, plan.blocks, plan.keep.expand(-1, scale.shape[1]), "prod")
    amax = x.detach().abs().amax(-1).to(torch.float32)  # [T, Hkv]
    # divided by a tensor, not the number: CUDA divides by a number through its reciprocal (one
    # bit off at times), and every write (torch, C, Triton) must round amax / 127 alike
    amax = amax / amax.new_full((1,), QMAX)
    scale.index_reduce_(0, plan.blocks, amax, "amax")
    new = scale.index_select(0, plan.first_blocks)
    # requantise pages that held values under a smaller scale (ratio 1: unchanged; a page
    # started in this call: its rows are garbage until written, ratio 1 as well)
    ratio = torch.where(plan.started | (new <= 0), torch.ones_like(new), old / new.clamp_min(1e-30)).clamp_(max=1.0)
    if cache.is_cuda or bool((ratio < 1).any()):  # on the CPU reading it back is free: skip the no-op
        pages = cache.index_select(0, plan.first_blocks).to(torch.float32)
        cache.index_copy_(0, plan.first_blocks, torch.round(pages * ratio[:, None, :, None]).to(torch.int8))
    step = scale.index_select(0, plan.blocks)[:, :, None].clamp_min(1e-30)  # [T, Hkv, 1]
    q = torch.round(x.to(torch.float32) / step).clamp_(-QMAX, QMAX).to(torch.int8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, plan.slots, q)


def exchange_keys(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_old: torch.Tensor,
                  v_old: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  visible: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's queries with some keys' rows replaced, from the attention
    over the old rows: out / lse (fp32 [n, H, D] / [n, H], as the paged kernels return them)
    over all keys, of which m keys had rows k_old / v_old [m, Hkv, D]; returns out / lse with
    those m keys' rows k_new / v_new instead. visible [n, m]: which of the m keys each query
    sees (the kernel's causal or tree mask, sliced to them). Leading batch dimensions are
    allowed (groups of queries, each with its own keys: q [..., n, H, D], k [..., m, Hkv, D],
    visible [..., n, m]).

    Each key adds exp(score) to the softmax's sum and exp(score) * v to its numerator, so
    removing the old rows' terms and adding the new ones' is exact in real arithmetic. In
    float32 the subtraction cancels: the error is ~1e-7 times exp(lse_old - lse_new), so the
    old and new rows must score alike (int8 rows against their exact rows do: a few percent);
    rows whose old and new scores part by nats lose digits, and where nothing is left (no
    visible key at all) out is 0 and lse -inf, as ``reference.merge_attn_states`` gives.

    For int8 pages this puts exact rows back for a few keys without a second page dtype in
    the kernels: the engine's exact tail (``longctx.kv.exact_tail``: each query's own page)
    and benchmarks/int8_error_study.py's variants."""
    group = q.shape[-2] // k_old.shape[-2]
    qf, lse = q.float(), lse.float()
    hidden = ~visible[..., :, None, :]  # [..., n, 1, m]

    def terms(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = k.float().repeat_interleave(group, dim=-2)  # [..., m, H, D]
        s = torch.einsum("...nhd,...mhd->...nhm", qf, k) * scale
        return s.masked_fill(hidden, float("-inf")), v.float().repeat_interleave(group, dim=-2)

    s_old, v_old = terms(k_old, v_old)
    s_new, v_new = terms(k_new, v_new)
    top = torch.maximum(lse, torch.maximum(s_old.amax(-1), s_new.amax(-1)))
    base = torch.exp(lse - top)
    p_old, p_new = torch.exp(s_old - top[..., None]), torch.exp(s_new - top[..., None])
    den = base - p_old.sum(-1) + p_new.sum(-1)
    num = (base[..., None] * out.float() - torch.einsum("...nhm,...mhd->...nhd", p_old, v_old)
           + torch.einsum("...nhm,...mhd->...nhd", p_new, v_new))
    some = den > 0  # False where nothing is left, NaN included (no visible key: lse - top is -inf + inf)
    safe = torch.where(some, den, torch.ones_like(den))
    res = torch.where(some[..., None], num / safe[..., None], torch.zeros_like(num))
    return res.to(out.dtype), torch.where(some, top + torch.log(safe), torch.full_like(top, float("-inf")))

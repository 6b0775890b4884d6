"""Float matrices quantized at load into the block layouts the CPU block kernel reads
(``quantization="int8"`` / ``"int4"`` on an HF folder).

Owns: ``quantize_blocks`` (a float [N, K] matrix -> uint8 rows of GGUF Q8_0 or Q4_1 blocks).
Never: which tensors a model quantizes (the loader), the products (``longctx.kernels.cpu_blocks``).

The schemes, and why they take these layouts:
- ``int8``: Q8_0, one fp16 scale for every 32 inputs of an output row (8.5 bits a weight). A
  scale per output channel would cost the same bytes in these blocks and round more coarsely,
  so the finer grain is taken. The bytes equal llama.cpp's Q8_0 quantizer's (round half away
  from zero with the unrounded scale's inverse, the scale stored as fp16).
- ``int4``, ``group_size=32``: Q4_1 (asymmetric: an fp16 scale and minimum per 32 inputs, 4-bit
  codes, 5.0 bits a weight), equal to llama.cpp's Q4_1 quantizer's bytes.
- ``int4``, ``group_size=128``: one scale and minimum over 128 inputs, written into four Q4_1
  blocks that repeat them. It has group 128's rounding, not its size: the blocks still cost
  5.0 bits a weight (a dedicated layout would be 4.25).
Matrices are quantized a slab of rows at a time, so the load holds one float matrix and the
temporaries of ``SLAB_ROWS`` rows, never a float copy of the model.
"""

from __future__ import annotations

import torch

from longctx.kernels import cpu_blocks

SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 128)  # int4's
SLAB_ROWS = 1024  # rows quantized at a time (temporaries ~ 16 bytes a weight of the slab)
BLOCK = 32  # inputs per Q8_0 / Q4_1 block


def scheme_format(scheme: str) -> str:
    """The GGUF block format a scheme's matrices are stored in."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    return "Q8_0" if scheme == "int8" else "Q4_1"


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round takes halves to even)."""
    return torch.copysign(torch.floor(v.abs() + 0.5), v)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] -> the fp16 value's two little-endian bytes [..., 2]."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, nb, 32] -> uint8 [n, nb, 34]: fp16 d, then 32 int8 codes."""
    d = x.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = _round_away(x * inv).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=-1)


def _q4_1(x: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [n, nb, 32] -> uint8 [n, nb, 20]: fp16 d and m, then 16 bytes holding codes j
    (low nibble) and j + 16 (high nibble); d and m over ``group`` inputs (32 or 128)."""
    n, nb, _ = x.shape
    g = x.reshape(n, nb * BLOCK // group, group)
    lo = g.amin(dim=-1, keepdim=True)
    d = (g.amax(dim=-1, keepdim=True) - lo) / 15.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    # ggml: MIN(15, (int8_t)((x - min) * id + 0.5f)); the product is >= 0, so the cast floors
    q = torch.clamp(torch.floor((g - lo) * inv + 0.5), max=15).to(torch.uint8).reshape(n, nb, BLOCK)
    per_block = group // BLOCK
    d = d.repeat_interleave(per_block, dim=1)
    lo = lo.repeat_interleave(per_block, dim=1)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), packed], dim=-1)


def quantize_blocks(weight: torch.Tensor, scheme: str, group_size: int = 32) -> torch.Tensor:
    """uint8 [N, row_bytes]: ``weight`` [N, K] (any float dtype, computed in float32) as Q8_0
    (``int8``) or Q4_1 (``int4``, scale and minimum per ``group_size`` inputs) rows."""
    fmt = scheme_format(scheme)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_blocks takes a float matrix, got {weight.dtype} {tuple(weight.shape)}")
    group = BLOCK if scheme == "int8" else group_size
    if scheme == "int4" and group not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    n, k = weight.shape
    if k % group:
        raise ValueError(f"a {scheme} matrix's inputs must be a multiple of {group}, got {k}")
    if not torch.isfinite(weight).all():
        raise ValueError(f"the matrix [{n}, {k}] holds non-finite values: it cannot be quantized")
    out = torch.empty(n, cpu_blocks.row_bytes(fmt, k), dtype=torch.uint8)
    for r0 in range(0, n, SLAB_ROWS):
        x = weight[r0:r0 + SLAB_ROWS].to(torch.float32).reshape(-1, k // BLOCK, BLOCK)
        rows = _q8_0(x) if scheme == "int8" else _q4_1(x, group)
        out[r0:r0 + SLAB_ROWS] = rows.reshape(x.shape[0], -1)
    return out

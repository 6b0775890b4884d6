"""Rotary position embeddings: default, linear, dynamic-NTK, llama3, YaRN and LongRoPE
frequencies, over the whole head or its first ``rotary_dim`` dims (partial rotary).

Owns: inverse frequencies per RoPE variant (the formulas real checkpoints were trained with, as
HF transformers defines them) and applying the rotation to q/k.
Never: attention, caching of K/V.

Dynamic NTK follows HF: the base is stretched by the longest position in the current forward
once it passes ``max_position_embeddings``. (Keys cached by earlier, shorter forwards keep
their old rotation; HF behaves the same way.)

LongRoPE (Phi-3) has two tables, short and long factors; HF's ``generate`` turns every token of a
sequence longer than ``original_max_position_embeddings`` by the long one (a prompt past it from
the start; a sequence that grows past it is recomputed, as HF drops its cache there: the
scheduler does both, ``Scheduler.long_rope_after``). The runner marks each sequence's tokens
(``AttentionMetadata.rope_long``; ``long_rope_tokens``), so chunked prefill and batching give
HF's rotations.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves): a Llama
    GGUF's q or k matrix [heads * D, ...] (or its row indices) in HF's order."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, rs: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = rs.factor
    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rs.mscale) / _yarn_mscale(factor, rs.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rs.beta_fast or 32, rs.beta_slow or 1
    orig = rs.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high-frequency dims keep their original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope_inv_freq(base: float, dim: int, rs: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    factor = rs.factor
    attention_factor = rs.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(rs.original_max_position_embeddings)))
    factors = torch.tensor(rs.long_factor if long else rs.short_factor, dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"longrope factors have {factors.numel()} entries; the rotary dims need {dim // 2}")
    return 1.0 / (factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attention_factor)


def long_rope_tokens(config: ModelConfig, seq_long: list[bool], query_lens: list[int]) -> list[bool] | None:
    """Per token, whether LongRoPE's long table rotates it (its sequence's flag, set by the
    scheduler), or None for a model without LongRoPE."""
    if getattr(config, "long_rope_after", None) is None:
        return None
    return [flag for flag, q_len in zip(seq_long, query_lens) for _ in range(q_len)]


def inv_freq_for(config: ModelConfig, seq_len: int | None = None, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary dims / 2] and the cos/sin scale for ``config`` (and, for
    dynamic NTK, the current sequence length; for LongRoPE, ``long``: the long factors)."""
    rs, dim, base = config.rope_scaling, config.rotary_dim or config.head_dim, config.rope_theta
    if rs.freq_factors is not None:  # a GGUF's rope_freqs tensor: one divisor per frequency
        return _base_inv_freq(base, dim) / torch.tensor(rs.freq_factors, dtype=torch.float32), 1.0
    if rs.rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rs.rope_type == "linear":
        return _base_inv_freq(base, dim) / rs.factor, 1.0
    if rs.rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(base, dim), rs), 1.0
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(base, dim, rs)
    if rs.rope_type == "longrope":
        return _longrope_inv_freq(base, dim, rs, long)
    # dynamic NTK
    max_pos = config.max_position_embeddings
    seq_len = max(seq_len or max_pos, max_pos)
    base = base * ((rs.factor * seq_len / max_pos) - (rs.factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


TABLE_START = 4096  # positions in the first tables; they double when a step needs more


class RotaryEmbedding:
    """cos/sin tables for positions, built once per device for ``TABLE_START`` positions (or
    the trained window, if shorter) and doubled when a step reaches past them: a table for a
    128K-position window that serves 4K prompts would be 32-64 MB of resident memory that
    nothing reads (a CUDA graph's capture asks for its whole window first). Dynamic NTK
    recomputes past the trained window."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dynamic = config.rope_scaling.rope_type == "dynamic"
        inv_freq, self.scale = inv_freq_for(config)
        self.table_len = min(config.max_position_embeddings, TABLE_START)
        self.cos, self.sin = self._tables(inv_freq, torch.arange(self.table_len), self.scale, device)
        self.long = None  # LongRoPE's long table: (cos, sin)
        if config.rope_scaling.rope_type == "longrope":
            long_freq, _ = inv_freq_for(config, long=True)
            self.long = self._tables(long_freq, torch.arange(self.table_len), self.scale, device)

    @staticmethod
    def _tables(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]  # (P, D/2), fp32 as in HF
        return (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)

    def cos_sin(self, positions: torch.Tensor, max_pos: int | None = None,
                long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2] (fp32) for positions [T]. ``max_pos`` (1 + the largest position),
        when the caller knows it on the host, saves reading it from the device. ``long`` [T]
        bool: LongRoPE's tokens on the long table (``long_rope_tokens``); None: short."""
        if max_pos is None:
            max_pos = int(positions.max()) + 1 if positions.numel() else 0
        if self.long is not None:
            if max_pos > self.table_len:
                self.table_len = max(max_pos, 2 * self.table_len)
                short_freq, _ = inv_freq_for(self.config)
                long_freq, _ = inv_freq_for(self.config, long=True)
                self.cos, self.sin = self._tables(short_freq, torch.arange(self.table_len), self.scale, self.cos.device)
                self.long = self._tables(long_freq, torch.arange(self.table_len), self.scale, self.cos.device)
            cos, sin = self.cos[positions], self.sin[positions]
            if long is None:
                return cos, sin
            pick = long[:, None]
            return torch.where(pick, self.long[0][positions], cos), torch.where(pick, self.long[1][positions], sin)
        if self.dynamic and max_pos > self.config.max_position_embeddings:
            inv_freq, scale = inv_freq_for(self.config, max_pos)
            return self._tables(inv_freq, positions.cpu(), scale, positions.device)
        if max_pos > self.table_len:
            inv_freq, scale = inv_freq_for(self.config)
            self.table_len = max(max_pos, 2 * self.table_len)
            self.cos, self.sin = self._tables(inv_freq, torch.arange(self.table_len), scale,
                                              self.cos.device)
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, heads, D]; cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    cos = cos[:, None, :].to(x.dtype)  # (T, 1, D/2)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

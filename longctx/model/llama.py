"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch.

Owns: the layer math (RMSNorm, fused QKV + RoPE, attention call, SwiGLU MLP, LM head).
Never: KV bytes, scheduling or serving. Attention goes through an ``AttentionBackend``
(``longctx.attention``) with per-step metadata passed in as an argument, so the same model
runs contiguous, paged, Triton or ring attention.

Tokens are flattened over the batch: ``input_ids`` and ``positions`` are ``[T]``; the
metadata says which tokens belong to which sequence.

Shape legend: T tokens in this step, E hidden size, H query heads, Hkv kv heads, D head dim,
F MLP intermediate size, V vocabulary.

Weights are held ``[out, in]`` as in HF, q/k/v and gate/up fused into one matrix each, and a
tied LM head is the embedding tensor itself. On the CPU a product with few rows (decode, a
lookahead verify step, a small batch) is taken column-major, ``(W @ x.T).T``, with a single
row padded to two: MKL streams the weights through that call fastest (measured on AVX2,
``benchmarks/bench_linear.py``: 1-4 rows ~31-33 ms per step for this model's weights, vs
34 ms for one row and 49-100 ms for 2-4 rows through ``x @ W_t`` with transposed weights).
Many rows (prefill chunks) go through ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary


FEW_ROWS = 32  # up to this many rows on the CPU: the column-major product (see above)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), with weight [out, in] contiguous."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if x.device.type != "cpu" or num_rows > FEW_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        cols = x.t() if num_rows > 1 else torch.cat([x, x]).t()  # (in, max(T, 2))
        y = (self.weight @ cols)[:, :num_rows].t().contiguous()  # (T, out)
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, as HF does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: Any, attn_meta: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # (T, H, D)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        out = backend.forward(self.layer_idx, q, k, v, attn_meta)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, F) each
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
                attn_meta: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, attn_meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """forward(ids, positions, backend, attn_meta) -> hidden; compute_logits(hidden) -> logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # LM head [V, E]; for tied embeddings the loader makes it the embedding tensor itself
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def rotary_for(self, device: torch.device) -> RotaryEmbedding:
        if self.rotary is None or self.rotary.cos.device != device:
            self.rotary = RotaryEmbedding(self.config, device)
        return self.rotary

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any,
                attn_meta: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, E] (after the last norm)."""
        cos, sin = self.rotary_for(input_ids.device).cos_sin(positions)  # (T, D/2) each
        x = self.embed_tokens(input_ids)  # (T, E)
        for layer in self.layers:
            x = layer(x, cos, sin, backend, attn_meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] in fp32."""
        return self.lm_head(hidden).float()

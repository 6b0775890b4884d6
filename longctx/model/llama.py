"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch.

Owns: the layer math (RMSNorm, fused QKV + RoPE, attention call, SwiGLU MLP, LM head).
Never: KV bytes, scheduling or serving. Attention goes through an ``AttentionBackend``
(``longctx.attention``) with per-step metadata passed in as an argument, so the same model
runs contiguous, paged, Triton or ring attention.

Tokens are flattened over the batch: ``input_ids`` and ``positions`` are ``[T]``; the
metadata says which tokens belong to which sequence.

Shape legend: T tokens in this step, E hidden size, H query heads, Hkv kv heads, D head dim,
F MLP intermediate size, V vocabulary.

Weights are held transposed (``[in, out]``, contiguous): on the CPU ``x @ W_t`` runs the
one-token matrix-vector products of decode markedly faster than ``F.linear`` (see
docs/architecture.md). q/k/v and gate/up are fused into one matrix each. On the CPU in fp32
the engine then hands every matrix to oneDNN pre-packed (``pack_linears_onednn``): BLAS
re-packs the weights on every call with a few rows (lookahead verification, small batches),
which made a 4-row step cost ~3x a 1-row step; pre-packed, it costs about the same
(benchmarks/bench_linear.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary


PACK_ROWS_HINT = 16  # oneDNN packs for this many rows: measured as fast as 4, faster than 1 at 2-2048 rows


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's pre-packed linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def choose_cpu_matmul(requested: str, dtype: torch.dtype) -> str:
    """'onednn' or 'blas' for a CPU model: 'auto' takes oneDNN for float32 when available
    (bf16/fp16 stay on BLAS: oneDNN's packed path was only measured in fp32)."""
    if requested == "blas":
        return "blas"
    if requested == "onednn":
        if not onednn_linear_available():
            raise RuntimeError("cpu_matmul='onednn' but this torch build has no oneDNN linear ops")
        return "onednn"
    return "onednn" if dtype == torch.float32 and onednn_linear_available() else "blas"


class Linear(nn.Module):
    """y = x @ weight_t (+ bias), with weight_t [in, out] contiguous; or, once ``pack_onednn``
    has run, through oneDNN with the weight pre-packed in its blocked layout (weight_t is then
    dropped, so memory stays one copy)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def pack_onednn(self, rows_hint: int) -> None:
        if self.weight_t.device.type != "cpu" or self.weight_t.dtype != torch.float32:
            raise ValueError("oneDNN packing is for float32 weights on the CPU, got "
                             f"{self.weight_t.dtype} on {self.weight_t.device}")
        weight = self.weight_t.detach().t().contiguous()  # (out, in)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.weight_t = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, as HF does
        if x.dtype == torch.float32:  # the same ops without the two no-op conversions
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
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
        # q and k rotated together: one set of elementwise ops per layer instead of two
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                      self.head_dim)
        qk = apply_rotary(qk, cos, sin)  # (T, H + Hkv, D)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # (T, H, D), (T, Hkv, D)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
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
        # LM head, transposed [E, V]; for tied embeddings the loader fills it from the embedding
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def pack_linears_onednn(self, rows_hint: int = PACK_ROWS_HINT) -> None:
        """Hold every matrix pre-packed for oneDNN (see ``Linear``). CPU, fp32 only."""
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is None:
                module.pack_onednn(rows_hint)
        # The loaded weights are views of one storage (the memory-mapped weight cache), which
        # lives on while any of them does: give the remaining tensors (embedding, norms, biases)
        # their own memory so the mapping, and the dropped matrices with it, are released.
        # (benchmarks/bench_load.py reports the memory after a load, packed and not).
        for module in self.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)

    def has_packed_linears(self) -> bool:
        return any(isinstance(m, Linear) and m.packed is not None for m in self.modules())

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

"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, SmolLM) in plain torch:
one Transformer with switches (gpt-fast's shape), read from ``ModelConfig``.

Owns: the layer math (RMSNorm, fused QKV + RoPE, attention call, SwiGLU MLP, LM head) and the
switches other families need: per-head q/k norms (Qwen3, Gemma 3), sliding-window layers
(Mistral, Gemma), GELU-tanh MLPs, norms after attention and MLP too, scaled embeddings,
a score scale and caps and a capped LM head (Gemma; ``LayerAttention``).
Never: KV bytes, scheduling or serving. Attention goes through an ``AttentionBackend``
(``longctx.attention``) with per-step metadata passed in as an argument, so the same model
runs contiguous, paged, Triton or ring attention.

Tokens are flattened over the batch: ``input_ids`` and ``positions`` are ``[T]``; the
metadata says which tokens belong to which sequence.

Shape legend: T tokens in this step, E hidden size, H query heads, Hkv kv heads, D head dim,
F MLP intermediate size, V vocabulary.

Weights: q/k/v and gate/up are fused into one matrix each, each a ``Linear`` whose weight
format is a ``LinearMethod`` (``longctx.model.linear``). How a CPU model in fp32 or bf16
holds them is ``cpu_matmul`` (``choose_cpu_matmul``): by default ("kernel") in the checkpoint's
``[out, in]`` layout, multiplied by the C kernel of ``longctx.kernels.cpu_linear`` for every step it takes
(``cpu_linear.max_rows()``: all of them where it has its panel path; decode, batched decode
and lookahead verification stream the weights near the read bandwidth, prefill chunks run
register-blocked panels) and by BLAS on the same copy above that, with a tied LM head sharing
the embedding's memory. "onednn" holds them pre-packed for oneDNN,
"blas" transposed (``[in, out]``; ``x @ W_t`` is BLAS's fastest one-row form here); every
other model uses "blas". See benchmarks/bench_linear.py and docs/architecture.md.
A bf16 model on the row kernel keeps its matrices and embedding in bf16 and computes in fp32
(``act_dtype``): the kernel widens the weights as it reads them, at every step. (BLAS's bf16
product on bf16-rounded activations is twice as fast at 64 rows, bench_cpu_isa.py, but its
prefill changed the real model's greedy tokens against fp32's; tests/test_real_model.py.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longctx.attention import LayerAttention
from longctx.kernels import cpu_linear

from .config import ModelConfig
from .decode_layers import MAX_ROWS as DECODE_LAYERS_MAX_ROWS, DecodeLayers
from .linear import (BLAS, BLOCK_ROWS, BLOCKS, PACK_ROWS_HINT, ROW_KERNEL, ROW_KERNEL_DTYPES, BlockMatrix, Linear,  # noqa: F401
                     OneDNNWeights, RoundedRows, activation, choose_cpu_matmul, onednn_linear_available)  # (the last two: re-exported)
from .rope import RotaryEmbedding, apply_rotary, unpermute_rope_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def row_scale(self, x: torch.Tensor) -> torch.Tensor:
        """rsqrt(mean(x^2) + eps) [T, 1] of a float32 x: its output is ``weight * (x * row_scale(x))``
        (``linear.rounded_norm`` makes the whole norm, this scale included, in the AMX products'
        rounding pass, for a module that has this method)."""
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, as HF does
        if x.dtype == torch.float32:  # the same ops without the two no-op conversions
            return self.weight * (x * self.row_scale(x))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype == torch.float32:  # Gemma's norm: the product in fp32 too, then x's dtype
            return (self.weight * xf).to(x.dtype)
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
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: an RMSNorm over each head's q and k before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # the layer's scale, window and cap (none of them: a plain Llama layer)
        self.spec = LayerAttention(config.attention_scale, config.layer_window(layer_idx),
                                   config.attn_logit_softcapping)
        self.options = self.spec.options
        self.rotary_dim = config.rotary_dim  # partial rotary (Phi-4-mini): the first dims only; None: all
        self.rope_pairs = False  # q and k come as llama.cpp's pairs: rotate_stored_pairs

    def rotate_stored_pairs(self) -> bool:
        """Where ``qkv_proj`` holds a Llama GGUF's blocks as stored (q and k rows in llama.cpp's
        interleaved pairs, put in order after each product) and nothing comes between the product
        and RoPE: take its outputs as stored and let the C RoPE read the pairs, putting them in
        order in the pass that rotates them (``cpu_linear.rope_(pairs=True)``: the same numbers,
        without the reorder's pass over [T, (H + 2 Hkv) D]). Returns whether it does."""
        weight, d = self.qkv_proj.weight, self.head_dim
        if (not isinstance(weight, BlockMatrix) or weight.order is None or self.qkv_proj.bias is not None
                or self.q_norm is not None or (self.rotary_dim is not None and self.rotary_dim < d)
                or d > 2 * cpu_linear.ROPE_PAIRS_MAX_HALF or not cpu_linear.available()):
            return False
        q, kv = self.q_size, self.kv_size
        pairs = torch.cat([unpermute_rope_rows(torch.arange(q), self.num_heads),
                           q + unpermute_rope_rows(torch.arange(kv), self.num_kv_heads),
                           torch.arange(q + kv, q + 2 * kv)])
        if not torch.equal(weight.order, pairs):
            return False
        self.qkv_proj.rows_as_stored = self.rope_pairs = True
        return True

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
               plan: Any, rounded: bool = False) -> torch.Tensor | RoundedRows:
        """qkv [T, (H + 2 Hkv) D] -> RoPE, KV write and attention -> [T, H D]. With the row
        kernel (fp32 on the CPU) or GGUF blocks q and k are rotated in place in ``qkv``, which
        is the fresh float32 output of ``qkv_proj``. ``rounded``: ``o_proj`` takes its input
        rounded for the AMX tiles (``takes_rounded``) and the backend can be asked for it
        (``hands_rounded_rows``); it may then hand it so (``RoundedRows``)."""
        num_tokens = qkv.shape[0]
        # q and k rotated together: one set of elementwise ops per layer instead of two
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                      self.head_dim)
        if self.q_norm is not None:  # a fresh contiguous tensor: still rotated in place below
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        if self.rope_pairs:  # llama.cpp's pairs, as stored: put in order as they are rotated (in place)
            qk = cpu_linear.rope_(qk, cos, sin, pairs=True)
        elif self.rotary_dim is not None and self.rotary_dim < self.head_dim:  # partial: the rest pass through
            qk = torch.cat([apply_rotary(qk[..., :self.rotary_dim], cos, sin), qk[..., self.rotary_dim:]], dim=-1)
        elif self.qkv_proj.method.name in (ROW_KERNEL.name, BLOCKS.name):  # its fresh fp32 output: rotated in
            qk = cpu_linear.rope_(qk, cos, sin)  # place (int8 pages' rotation then takes q, k, v in one product)
        else:
            qk = apply_rotary(qk, cos, sin)  # (T, H + Hkv, D)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # (T, H, D), (T, Hkv, D)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if rounded:
            out = backend.run(self.layer_idx, q, k, v, plan, rounded=True, **self.options)
            if isinstance(out, RoundedRows):  # [T rounded up to 16, H D] bfloat16, for o_proj's tiles
                return out
        else:
            out = backend.run(self.layer_idx, q, k, v, plan, **self.options)  # (T, H, D)
        return out.reshape(num_tokens, self.q_size)


def _takes_rounded_rows(layer: Linear, rows: int, product: Any) -> bool:
    """Whether the product before ``layer`` may hand it its input rounded for the AMX tiles
    (``RoundedRows``): a long step (not a decode step), no split product (sequence parallelism's
    column split keeps its own), and ``layer``'s method taking such rows (``takes_rounded``)."""
    return product is None and rows > BLOCK_ROWS and layer.method.takes_rounded(layer, rows)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # else SwiGLU (fused into down_proj)

    def forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, product: Any) -> torch.Tensor:
        """down(act(gate(norm(x))) * up(norm(x))) (+ residual). A method that can make act(gate) * up
        without the whole [T, 2F] product (``gated``: GGUF blocks on prefill chunks, bf16 matrices on
        the AMX tiles) does."""
        down = self.down_proj
        h = self.gate_up_proj.method.gated(self.gate_up_proj, x, norm, "gelu_tanh" if self.gelu else "silu",
                                           rounded=_takes_rounded_rows(down, x.shape[0], product))
        if h is not None:
            return self.down_proj(h, residual=residual, product=product)
        gate_up = self.gate_up_proj(x, norm=norm, product=product)  # (T, 2F)
        if not self.gelu:
            return self.down_proj(gate_up, swiglu=True, residual=residual, product=product)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(activation(gate, "gelu_tanh").mul_(up), residual=residual, product=product)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms  # Gemma: a norm after attention and after the MLP too
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
                plan: Any) -> torch.Tensor:
        """Each norm goes with the product after it, SwiGLU with the down projection and each
        residual add with the product before it: the weights' method fuses them where it can
        (the row kernel: four kernel calls around attention) and runs them as torch ops where
        not. The plan may bring its own ``split_linear`` (the row kernel's signature):
        sequence parallelism has each rank compute a slice of every product's output features."""
        attn, mlp, product = self.self_attn, self.mlp, plan.split_linear
        qkv = attn.qkv_proj(x, norm=self.input_layernorm, product=product)  # (T, (H + 2 Hkv) D)
        o_proj = attn.o_proj  # (its input rounded for its tiles straight from attention, where it can be)
        rounded = getattr(backend, "hands_rounded_rows", False) and _takes_rounded_rows(o_proj, x.shape[0], product)
        out = attn.attend(qkv, cos, sin, backend, plan, rounded)  # (T, H D)
        if self.sandwich:  # x + norm(attention), x + norm(MLP), each MLP input normed before
            x = x + self.post_attention_layernorm(attn.o_proj(out, product=product))
            return x + self.post_feedforward_layernorm(mlp(x, self.pre_feedforward_layernorm, None, product))
        x = attn.o_proj(out, residual=x, product=product)
        return mlp(x, self.post_attention_layernorm, x, product)


class LlamaForCausalLM(nn.Module):
    """forward(ids, positions, backend, attn_meta) -> hidden; compute_logits(hidden) -> logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # the loaders fill it: no random init (on the meta device its first normal_ costs seconds)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # LM head, transposed [E, V]; for tied embeddings the loader fills it from the embedding
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.rotary_local: RotaryEmbedding | None = None  # Gemma 3's sliding layers: their own base
        self.act_dtype: torch.dtype | None = None  # set by use_row_kernel: activations' dtype

    def pack_linears_onednn(self, rows_hint: int = PACK_ROWS_HINT) -> None:
        """Hold every matrix pre-packed for oneDNN (see ``Linear``). CPU, fp32 only."""
        for module in self.modules():
            if isinstance(module, Linear) and module.method.name == BLAS.name:
                module.pack_onednn(rows_hint)
        self._own_remaining_parameters()

    def use_row_kernel(self) -> None:
        """Hold every matrix [out, in] for the C row kernel (see ``Linear``); a tied LM head
        shares the embedding's memory instead of holding a copy. CPU, fp32 or bf16 weights; the
        activations are fp32 either way (norm weights and biases become fp32)."""
        embed = self.embed_tokens.weight
        tied = (self.config.tie_word_embeddings and embed.dtype in ROW_KERNEL_DTYPES
                and tuple(embed.shape) == (self.config.vocab_size, self.config.hidden_size))
        for module in self.modules():
            if isinstance(module, Linear) and module.method.name == BLAS.name and not (tied and module is self.lm_head):
                module.use_row_kernel()
        if tied:
            self.lm_head.weight_t = None
        self._own_remaining_parameters(keep_dtype=(self.embed_tokens,))
        if tied:  # the embedding's own (just cloned) memory
            self.lm_head.weight, self.lm_head.method = self.embed_tokens.weight.detach(), ROW_KERNEL
        self.act_dtype = torch.float32

    def row_kernel_state(self) -> tuple[dict[str, torch.Tensor], bool]:
        """After ``use_row_kernel``: every tensor the model holds, by name (each matrix as
        ``<linear>.weight`` [out, in]), and whether the LM head is the embedding's memory (then
        it is not in the dict). What the loader's row-layout cache stores."""
        if not self.uses_row_kernel():
            raise ValueError("row_kernel_state needs a model held for the row kernel (use_row_kernel)")
        state: dict[str, torch.Tensor] = {}
        for prefix, module in self.named_modules():
            at = f"{prefix}." if prefix else ""
            state.update({at + n: p.detach() for n, p in module._parameters.items() if p is not None})
            if isinstance(module, Linear) and module.weight is not None:
                state[at + "weight"] = module.weight
        tied = self.lm_head.weight is not None and self.lm_head.weight.data_ptr() == self.embed_tokens.weight.data_ptr()
        if tied:
            del state["lm_head.weight"]
        return state, tied

    @classmethod
    def from_row_kernel_state(cls, config: ModelConfig, state: dict[str, torch.Tensor],
                              tied: bool) -> "LlamaForCausalLM":
        """The model ``use_row_kernel`` leaves, holding ``state``'s tensors themselves (no
        copies: views of a memory-mapped file stay views). Raises ValueError when ``state``
        does not fit the model (a name missing or left over, a shape that differs)."""
        with torch.device("meta"):
            model = cls(config)
        state = dict(state)

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"row-kernel state lacks {name}")
            t = state.pop(name)
            if tuple(t.shape) != shape:
                raise ValueError(f"row-kernel state: {name} is {tuple(t.shape)}, the model needs {shape}")
            return t

        for prefix, module in model.named_modules():
            at = f"{prefix}." if prefix else ""
            if isinstance(module, Linear):
                in_features, out_features = module.weight_t.shape
                module.weight_t, module.method = None, ROW_KERNEL
                if not (tied and module is model.lm_head):
                    module.weight = take(at + "weight", (out_features, in_features))
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = nn.Parameter(take(at + name, tuple(param.shape)), requires_grad=False)
        if state:
            raise ValueError(f"row-kernel state has tensors the model does not: {sorted(state)[:5]}")
        if tied:  # the embedding's shape, [vocab, hidden], was checked as it was taken
            model.lm_head.weight = model.embed_tokens.weight.detach()
        model.act_dtype = torch.float32
        return model.eval()

    def _own_remaining_parameters(self, keep_dtype: tuple[nn.Module, ...] | None = None) -> None:
        # The loaded weights are views of one storage (the memory-mapped weight cache), which
        # lives on while any of them does: give the parameters left (embedding, norms, biases)
        # their own memory so the mapping, and the converted matrices' old copies with it, are
        # released (benchmarks/bench_load.py reports the memory after a load).
        # With ``keep_dtype`` (the row kernel) the rest become fp32, the activations' dtype,
        # except in the modules named there (the embedding keeps the weights' dtype).
        for module in self.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    data = param.detach()
                    if keep_dtype is not None and module not in keep_dtype:
                        data = data.float()
                    module._parameters[name] = nn.Parameter(data.clone(), requires_grad=False)

    def mlp_shapes(self) -> list[tuple[int, int]]:
        """The (in, out) shapes of a decoder layer's MLP products: what dominates a step."""
        hidden, inter = self.config.hidden_size, self.config.intermediate_size
        return [(hidden, 2 * inter), (inter, hidden)]

    def uses_row_kernel(self) -> bool:
        return any(isinstance(m, Linear) and m.method.name == ROW_KERNEL.name for m in self.modules())

    def has_packed_linears(self) -> bool:
        return any(isinstance(m, Linear) and m.method.name == OneDNNWeights.name for m in self.modules())

    def rotary_for(self, device: torch.device) -> RotaryEmbedding:
        if self.rotary is None or self.rotary.cos.device != device:
            self.rotary = RotaryEmbedding(self.config, device)
        return self.rotary

    def _local_rotary_for(self, device: torch.device) -> RotaryEmbedding:
        if self.rotary_local is None or self.rotary_local.cos.device != device:
            first = next(i for i in range(self.config.num_hidden_layers) if self.config.layer_window(i) is not None)
            self.rotary_local = RotaryEmbedding(self.config.rope_for_layer(first), device)
        return self.rotary_local

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any,
                attn_meta: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, E] (after the last norm).
        ``backend.plan(attn_meta)`` once, then every layer runs attention with that plan."""
        long = getattr(attn_meta, "rope_long", None)  # LongRoPE: the tokens on its long table
        cos, sin = self.rotary_for(input_ids.device).cos_sin(positions, attn_meta.max_position, long)  # (T, D/2) each
        local = None
        if self.config.local_rope_theta is not None:
            local = self._local_rotary_for(input_ids.device).cos_sin(positions, attn_meta.max_position)
        plan = backend.plan(attn_meta)
        x = self.embed_tokens(input_ids)  # (T, E)
        if self.config.embed_scale is not None:  # Gemma: times sqrt(hidden), in the embedding's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.act_dtype is not None and x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)  # bf16 weights on the row kernel: fp32 activations
        fast = DecodeLayers.of(self) if local is None and x.shape[0] <= DECODE_LAYERS_MAX_ROWS else None
        if fast is not None:  # a decode step's layers as one loop of C calls, where the step qualifies
            x = x.contiguous().clone()  # (the loop updates it in place)
            if fast.step(x, cos, sin, backend, plan):
                return self.norm(x)
        for layer in self.layers:
            if local is not None and layer.self_attn.spec.window is not None:
                x = layer(x, *local, backend, plan)
            else:
                x = layer(x, cos, sin, backend, plan)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] in fp32 (Gemma 2: capped, ``cap_logits``)."""
        return self.cap_logits(self.lm_head(hidden).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the model ends: Gemma 2's cap * tanh(logits / cap), else as is."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

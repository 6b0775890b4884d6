"""Model configuration: one frozen dataclass read from an HF ``config.json`` or GGUF metadata.

Owns: the architecture numbers the model and the KV cache need, validated once.
Never: weights, devices, or serving knobs (those live in ``longctx.config``).
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # llama.cpp's architecture -> HF's model_type, where they differ
# Gemma sizes whose query_pre_attn_scalar is hidden / heads rather than the head dim: llama.cpp
# knows them by their layer count (Gemma 2 27B: 46, Gemma 3 27B: 62) and writes no key for it
GEMMA_HIDDEN_PER_HEAD_SCALE = {"gemma2": 46, "gemma3": 62}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's (5 sliding layers, then a global one), absent a key
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # the sliding layers' base, which llama.cpp does not store
# the ``{arch}.*`` GGUF keys the loader reads (or knows to change nothing); any other is refused
# by name, since it may change the math (a sliding window, soft-capping, experts, ...)
GGUF_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "tensor_data_layout", "expert_count", "expert_used_count"})
GGUF_ARCH_KEYS = {  # and those only these architectures' models use (a window on a llama GGUF is refused)
    "gemma2": frozenset({"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"}),
    "gemma3": frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping"}),
    "phi3": frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _gguf_windows(arch: str, get: Any) -> dict[str, Any]:
    """sliding_window and layer_types from a GGUF's keys, as llama.cpp reads them: Gemma 2
    slides on every other layer from the first, Gemma 3 on 5 of 6 (or its pattern key), Phi-3
    on every layer (a window of 0: none, Phi-4)."""
    window = int(get("attention.sliding_window", 0) or 0)
    layers = int(get("block_count"))
    if not window or window >= int(get("context_length", 2048)):
        return {}
    if arch == "gemma2":
        every: Any = 2
    elif arch == "gemma3":
        every = get("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    else:
        return {"sliding_window": window}
    if isinstance(every, (list, tuple)):  # one flag per layer
        types = tuple("sliding_attention" if flag else "full_attention" for flag in every)
    else:
        types = tuple("sliding_attention" if (i + 1) % int(every) else "full_attention" for i in range(layers))
    return {"sliding_window": window, "layer_types": types}


def _gguf_gemma(arch: str, get: Any, hidden: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma's switches from a GGUF (llama.cpp's defaults where it writes no key)."""
    wide = int(get("block_count")) == GEMMA_HIDDEN_PER_HEAD_SCALE[arch]
    return {"hidden_act": "gelu_pytorch_tanh", "sandwich_norms": True, "embed_scale": hidden ** 0.5,
            "query_pre_attn_scalar": hidden / num_heads if wide else head_dim,
            "attn_logit_softcapping": get("attn_logit_softcapping"),
            "final_logit_softcapping": get("final_logit_softcapping"),
            "local_rope_theta": GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None}


def _windows(cfg: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding window, per-layer types) as HF reads a config.json: ``layer_types`` when given;
    else Qwen2/3's ``use_sliding_window`` from ``max_window_layers`` on, Gemma 2's every other
    layer and Gemma 3's ``sliding_window_pattern``, Mistral's every layer. A window that
    ``use_sliding_window: false`` turns off, or one as long as the context, is none."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True) or window >= cfg.get("max_position_embeddings", 2048):
        return None, None  # (a window over the whole context is none)
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        return int(window), tuple(types)
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", layers)
        return int(window), tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if model_type == "gemma2":
        return int(window), tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if model_type == "gemma3_text":
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return int(window), tuple("sliding_attention" if (i + 1) % every else "full_attention"
                                  for i in range(layers))
    return int(window), None  # Mistral: every layer


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or RoPE variant is not one longctx implements."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE variant and its parameters (HF ``rope_scaling`` / ``rope_parameters`` fields)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    # longrope (Phi-3): frequencies divided by the short factors, or by the long ones for a
    # sequence past original_max_position_embeddings (the choice is per request, as HF makes it)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # llama.cpp's ``rope_freqs.weight`` (a GGUF's Llama 3.1 scaling): each base frequency is
    # divided by its factor; only with rope_type "default" (the GGUF has no scaling keys then)
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.freq_factors is not None and self.rope_type != "default":
            raise UnsupportedModelError(f"a rope_freqs tensor together with RoPE type {self.rope_type!r} "
                                        "is not supported (llama.cpp writes one or the other)")
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None
                                             or self.original_max_position_embeddings is None):
            raise ValueError("longrope needs short_factor, long_factor and original_max_position_embeddings")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None
                                           or self.original_max_position_embeddings is None):
            raise ValueError("llama3 RoPE needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, max_position_embeddings: int,
                original_max_position_embeddings: int | None = None) -> "RopeScaling":
        if not params:
            return cls()
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "su":  # Phi-3's early name for longrope
            rope_type = "longrope"
        fields = {k: params[k] for k in (
            "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
            "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
            if params.get(k) is not None}
        for name in ("short_factor", "long_factor"):
            if params.get(name) is not None:
                fields[name] = tuple(float(x) for x in params[name])
        if rope_type in ("yarn", "longrope"):
            fields.setdefault("original_max_position_embeddings",
                              original_max_position_embeddings or max_position_embeddings)
        if rope_type == "longrope" and "factor" not in fields:  # HF: the window's ratio, for the attention factor
            fields["factor"] = max_position_embeddings / fields["original_max_position_embeddings"]
        return cls(rope_type=rope_type, **fields)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Field names follow HF ``config.json`` where one exists."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False  # and on o_proj (HF Llama's attention_bias: all four)
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding windows: ``sliding_window`` tokens (HF's meaning: a query sees the last W
    # positions, itself included) on the layers ``layer_types`` marks "sliding_attention"
    # (None: every layer, as Mistral's config means it)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma 2/3: GELU-tanh gate, norms before and after attention and MLP, embeddings times
    # sqrt(hidden), scores scaled by query_pre_attn_scalar ** -0.5 and capped, logits capped;
    # RMSNorm's (1 + w) is folded into the weights by the loader. Gemma 3's sliding layers use
    # their own RoPE base without scaling (``local_rope_theta``).
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    rotary_dim: int | None = None  # partial rotary embeddings (Phi-4-mini): the first dims only

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; longctx runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise UnsupportedModelError(f"layer type(s) {', '.join(unknown)} are not supported "
                                            f"({', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers but no sliding_window is given")

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None when it sees every earlier token."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's original window (past it a sequence turns by the long table), or None."""
        rs = self.rope_scaling
        return rs.original_max_position_embeddings if rs.rope_type == "longrope" else None

    @property
    def attention_scale(self) -> float | None:
        """The score scale when it is not 1 / sqrt(head_dim) (Gemma's query_pre_attn_scalar)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @property
    def context_cost_tokens(self) -> float:
        """The context length at which one token's attention costs as many flops as its linear
        layers: (q, k, v, o and MLP weights of a layer) / (2 * heads * head_dim)."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        linear = (self.hidden_size * (2 * q_size + 2 * kv_size)
                  + 3 * self.hidden_size * self.intermediate_size)
        return linear / (2.0 * q_size)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; longctx runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_theta = None
        if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (Gemma 3)
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"RoPE type {local.get('rope_type')!r} on sliding layers is not supported")
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            rope = rope.get("full_attention") or {}
        elif model_type == "gemma3_text" and cfg.get("rope_local_base_freq") is not None:
            local_theta = float(cfg["rope_local_base_freq"])
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        window, layer_types = _windows(cfg, model_type)
        if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
            local_theta = None  # no sliding layer: no local RoPE either
        gemma = model_type in GEMMA_TYPES
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        rotary_dim = int(head_dim * partial) if partial != 1.0 else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope, cfg.get("max_position_embeddings", 2048),
                                             cfg.get("original_max_position_embeddings")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            sandwich_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta,
            rotary_dim=rotary_dim,
        )

    def rope_for_layer(self, layer: int) -> "ModelConfig":
        """The config whose RoPE layer ``layer`` uses: itself, or for Gemma 3's sliding
        layers one with their base and no scaling."""
        if self.local_rope_theta is None or self.layer_window(layer) is None:
            return self
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=RopeScaling())

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder}: not an HF checkpoint folder")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any], has_output_weight: bool) -> "ModelConfig":
        """Build from GGUF key/values (``general.architecture``, ``llama.*``, ``tokenizer.ggml.*``)."""
        arch = meta.get("general.architecture", "")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported "
                                        f"({', '.join(GGUF_ARCHITECTURES)})")
        known = GGUF_KEYS | GGUF_ARCH_KEYS.get(arch, frozenset())
        unknown = sorted(k for k in meta if k.startswith(f"{arch}.") and k[len(arch) + 1:] not in known)
        if unknown:
            raise UnsupportedModelError(f"GGUF key(s) {', '.join(unknown)} ({arch}) are not ones longctx "
                                        "understands; refusing rather than running without them")
        if meta.get(f"{arch}.expert_count", 0):
            raise UnsupportedModelError(f"GGUF {arch}.expert_count is {meta[f'{arch}.expert_count']}: "
                                        "mixture-of-experts models are not supported")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden // num_heads if arch == "phi3" else
                           get("rope.dimension_count", hidden // num_heads)))
        rotary = int(get("rope.dimension_count", head_dim))
        if rotary > head_dim or (rotary < head_dim and arch != "phi3"):
            raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count {rotary} with head dim {head_dim}: "
                                        "partial rotary embeddings are only read for phi3")
        rope: dict[str, Any] = {}
        if get("rope.scaling.type") not in (None, "none"):
            rope = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0),
                    "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        return cls(
            model_type=GGUF_MODEL_TYPES.get(arch, arch),
            vocab_size=int(get("vocab_size", 0)),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=RopeScaling.from_hf(rope, int(get("context_length", 2048))),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(x for x in (meta.get("tokenizer.ggml.eos_token_id"),) if x is not None),
            rotary_dim=rotary if rotary < head_dim else None,
            **_gguf_windows(arch, get),
            **(_gguf_gemma(arch, get, hidden, num_heads, head_dim) if arch in GEMMA_HIDDEN_PER_HEAD_SCALE else {}),
        )

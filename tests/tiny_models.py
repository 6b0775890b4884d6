"""Tiny random-weight checkpoints built with transformers, for parity tests that run anywhere.

``make_checkpoint(tmp_path, kind)`` saves an HF folder (safetensors) and returns it with the
HF model (fp32, eval). ``write_gguf`` writes the same weights as a GGUF file, permuting q/k
rows the way llama.cpp's converter does, so the GGUF loader's un-permutation is exercised.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}

KINDS = [f"llama-{r}" for r in ROPE] + ["llama-tied", "mistral", "qwen2", "llama-mha", "llama-bias",
                                        "qwen3", "qwen3-tied", "mistral-window", "qwen2-window", "gemma2",
                                        "gemma3", "phi3", "phi3-longrope"]
WINDOW = 40  # the sliding window of the windowed kinds: shorter than the parity prompts
ORIGINAL = 160  # phi3-longrope's original window: prompts longer than it use the long factors
EAGER = ("gemma2", "gemma3")  # HF's eager attention: the one that caps scores (Gemma 2)


# For the tests' child scripts (prepended to their source): the VmFlags of the mapping that holds
# address ``at`` in /proc/self/smaps (``hg``: advised for huge pages, ``nh``: advised against them).
VM_FLAGS_SOURCE = """
def vm_flags(at):
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= at < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError("the address is in no mapping")
"""


def hf_config(kind: str, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    kwargs = {**BASE, **overrides}

    def make(cls, **defaults):  # the kind's settings, then the caller's overrides
        return cls(**{**BASE, **defaults, **overrides})

    if kind == "phi3":  # fused qkv and gate_up weights, a sliding window (Phi-3-mini-4k's shape)
        return make(Phi3Config, sliding_window=WINDOW, rope_theta=10000.0)
    if kind == "phi3-longrope":  # Phi-4-mini's shape: partial rotary (3/4 of 16 dims), LongRoPE, tied
        dims = int(16 * 0.75) // 2
        short = [1.0 + 0.05 * i for i in range(dims)]
        long = [1.5 + 0.5 * i for i in range(dims)]
        return Phi3Config(**{**kwargs, "max_position_embeddings": 4 * ORIGINAL}, original_max_position_embeddings=ORIGINAL,
                          partial_rotary_factor=0.75, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                           "long_factor": long, "partial_rotary_factor": 0.75,
                                           "original_max_position_embeddings": ORIGINAL})
    if kind == "mistral-window":
        return MistralConfig(**kwargs, sliding_window=WINDOW, rope_theta=10000.0)
    if kind == "qwen2-window":  # layers from max_window_layers on slide (HF's Qwen2 reading)
        return Qwen2Config(**kwargs, rope_theta=10000.0, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)
    if kind == "gemma2":  # every other layer slides; scores and logits capped low enough to bite
        return make(Gemma2Config, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    if kind == "gemma3":  # sliding, global, sliding; local and global RoPE bases, linear scaling
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        return make(Gemma3TextConfig, num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=20,
                    sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters=rope)
    if kind.startswith("qwen3"):  # head_dim 24 != hidden / heads, as Qwen3's own sizes differ
        return Qwen3Config(**kwargs, head_dim=24, rope_theta=10000.0, tie_word_embeddings=kind == "qwen3-tied")
    if kind == "mistral":
        return MistralConfig(**kwargs, sliding_window=None, rope_theta=10000.0)
    if kind == "qwen2":
        return Qwen2Config(**kwargs, rope_theta=10000.0)
    if kind == "llama-tied":
        return LlamaConfig(**kwargs, tie_word_embeddings=True, rope_theta=10000.0)
    if kind == "llama-bias":  # q/k/v/o biases and MLP biases
        return LlamaConfig(**kwargs, attention_bias=True, mlp_bias=True, rope_theta=10000.0)
    if kind == "llama-mha":
        kwargs.update(num_key_value_heads=4, hidden_size=128, num_attention_heads=4)
        return LlamaConfig(**kwargs, rope_theta=10000.0)
    rope = ROPE[kind.split("-", 1)[1]]
    params = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    return LlamaConfig(**kwargs, rope_parameters=params)


def make_checkpoint(folder: Path, kind: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """``overrides`` change the config (``max_position_embeddings=1024`` for engine tests)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"attn_implementation": "eager"} if kind in EAGER else {}
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32, **extra)
    # give norms and biases non-trivial values: every norm multiplies by about 1 +- 0.1 (Gemma's
    # norms multiply by 1 + w, so their w is about 0 +- 0.1, as in real Gemma checkpoints)
    norm_base = 0.0 if kind in EAGER else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(norm_base + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert permutation: rotate-half halves -> interleaved pairs."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_freqs(rope: dict, theta: float, dim: int) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor llama.cpp's converter writes for a ``llama3`` RoPE
    (convert_hf_to_gguf, LlamaModel): one divisor per frequency, no scaling type in the keys."""
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in base:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def _gguf_arch_keys(writer, cfg, arch: str, head_dim: int) -> None:
    """The keys llama.cpp's converter writes for Gemma 2/3 and Phi-3 (convert_hf_to_gguf)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        full = rope.get("full_attention", rope)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf_scaling("linear"))
            writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", cfg.max_position_embeddings))
        writer.add_sliding_window(cfg.sliding_window or 0)


def gguf_scaling(name: str):
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR, "yarn": gguf.RopeScalingType.YARN}[name]


def _gemma_checks(cfg, arch: str, head_dim: int) -> None:
    """llama.cpp stores no query_pre_attn_scalar (it takes the head dim) nor Gemma 3's layer
    pattern (5 sliding, 1 global): a model it cannot describe is refused, not written wrong."""
    if arch in ("gemma2", "gemma3") and cfg.query_pre_attn_scalar != head_dim:
        raise ValueError("write_gguf: llama.cpp takes query_pre_attn_scalar = head_dim for this size")
    if arch == "gemma3":
        want = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(cfg.num_hidden_layers)]
        if list(cfg.layer_types) != want:
            raise ValueError("write_gguf: llama.cpp's Gemma 3 slides on 5 layers of 6")


def write_gguf(path: Path, model, extra: dict | None = None, quant=None) -> None:
    """Write an HF model's weights (fp32) and config as a GGUF file as llama.cpp's converter
    does: Llama (q/k rows permuted; a ``llama3`` RoPE as a ``rope_freqs.weight`` tensor),
    Qwen2/3, Gemma 2/3 (norm weights stored as 1 + w, Gemma's post-norms), Phi-3 (fused qkv and
    gate_up, LongRoPE factors as tensors). ``extra``: more keys (int or float values),
    replacing written ones of the same name. ``quant(name, data)``: None to write a tensor as
    fp32, or (bytes, GGMLQuantizationType) to write it in that block format."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH.get(cfg.model_type, "llama")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))
    _gemma_checks(cfg, arch, head_dim)
    _gguf_arch_keys(writer, cfg, arch, head_dim)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for key, value in (extra or {}).items():
        writer.kv_data[0].pop(key, None)
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    if rope.get("rope_type") == "llama3":
        dim = cfg.hidden_size // cfg.num_attention_heads
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, rope["rope_theta"], dim))
    elif rope.get("rope_type") == "longrope":  # Phi-3: the factors as tensors, the attention factor a key
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    elif rope.get("rope_type", "default") != "default" and arch != "gemma3":
        raise ValueError(f"write_gguf: no GGUF form for rope_type {rope['rope_type']!r} here")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    if arch in ("gemma2", "gemma3"):
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy().copy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores what Gemma's norm multiplies by
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch != "llama":  # llama.cpp permutes q/k rows of llama only (NeoX RoPE elsewhere)
                pass
            elif module == "self_attn.q_proj":
                data = _permute_for_gguf(data, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                data = _permute_for_gguf(data, cfg.num_key_value_heads)
            out = f"blk.{layer}.{names[module]}.{kind}"
        stored = quant(out, data) if quant is not None else None
        if stored is None:
            writer.add_tensor(out, data)
        else:
            writer.add_tensor(out, stored[0], raw_dtype=stored[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_char_tokenizer(folder: Path, vocab_size: int = BASE["vocab_size"]) -> None:
    """A character-level fast tokenizer over ``vocab_size`` ids (0-2 special), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in chars:
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    fast.save_pretrained(folder)


def make_engine_checkpoint(folder: Path, seed: int = 0, **overrides):
    """A tiny Llama with a 1K window and a tokenizer: enough for engine tests. ``overrides``
    change its config (a bigger, slower model for tests that need a request to take a while)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**BASE, "max_position_embeddings": 1024, **overrides}, rope_theta=10000.0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    return model


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy continuation: a full forward per token, argmax of the last logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def random_tokens(n: int, seed: int, low: int = 3, high: int = 150) -> list[int]:
    """``n`` token ids in [low, high) from a seeded generator (prompts for the tiny models)."""
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_logits_and_tokens(llm, ids: list[int], params) -> tuple[torch.Tensor, list[int]]:
    """Generate from ``ids`` through ``llm`` and return the first sampling step's logits row
    (the prompt's last position) and the generated token ids."""
    runner, seen, original = llm.engine.runner, [], llm.engine.runner.forward

    def capture(batch):
        logits = original(batch)
        if len(logits) and not seen:
            seen.append(logits[0].clone())
        return logits

    runner.forward = capture
    try:
        tokens = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    finally:
        runner.forward = original
    return seen[0], tokens


TIMING_FIELDS = {"time_to_first_token", "latency_s", "elapsed_s"}


def strip_timings(value):
    """A batch result (dict/list tree) without its timing fields, which differ run to run."""
    if isinstance(value, dict):
        return {k: strip_timings(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [strip_timings(v) for v in value]
    return value


def results_by_key(out) -> dict[str, dict]:
    """A batch job's result lines by record key, timings stripped; no key may repeat."""
    from longctx.entrypoints import batch

    results = batch.read_results(out)
    keys = [batch.result_key(r) for r in results]
    assert len(keys) == len(set(keys)), f"duplicated ids in {out}: {sorted(keys)}"
    return {k: strip_timings(r) for k, r in zip(keys, results)}

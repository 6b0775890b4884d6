"""Engine configs (validation messages, keyword routing) and ModelConfig from HF config.json dicts
(llama, mistral, qwen2; RoPE variants; defaults) and GGUF metadata."""

from __future__ import annotations

import dataclasses
import json

import pytest

from longctx.config import (CacheConfig, ConfigError, LookaheadConfig, ModelLoadConfig, ParallelConfig,
                            SchedulerConfig, resolve_auto, split_engine_kwargs)
from longctx.kv.device_pool import kv_budget_bytes
from longctx.model.config import ModelConfig, RopeScaling, UnsupportedModelError

# ---------------------------------------------------------------------------- engine configs


def test_engine_config_defaults():
    assert ModelLoadConfig() == ModelLoadConfig(model="smollm2-135m", dtype="auto",
                                                device="cpu", num_threads=0,
                                                attention_backend="auto", enforce_eager=False)
    assert CacheConfig() == CacheConfig(block_size=None, kv_cache_gb=None, num_blocks=0,
                                        host_cache_gb=None, gpu_memory_utilization=0.9)
    assert SchedulerConfig() == SchedulerConfig(max_num_batched_tokens=None, max_num_seqs=64,
                                                max_model_len=0)


@pytest.mark.parametrize("device,flash,dtype,block,kv", [
    ("cpu", False, "float32", 64, None),  # "auto": the engine sizes the pool after the weights
    ("cpu", True, "float32", 64, None),  # flash-attn never runs on the CPU
    ("cuda", False, "bfloat16", 64, None),  # Triton; the KV pool sized from free GPU memory
    ("cuda", True, "bfloat16", 256, None),  # flash-attn's paged KV wants pages of 256
])
def test_auto_choices_per_device(device, flash, dtype, block, kv):
    load, cache = resolve_auto(ModelLoadConfig(), CacheConfig(), device, flash)
    assert (load.dtype, cache.block_size, cache.kv_cache_gb) == (dtype, block, kv)


def test_kv_cache_gb_auto_is_the_default():
    assert CacheConfig(kv_cache_gb="auto") == CacheConfig()
    with pytest.raises(ConfigError, match='kv_cache_gb must be positive or "auto", got \'lots\''):
        CacheConfig(kv_cache_gb="lots")


@pytest.mark.parametrize("intermediate,device,chunk", [
    (1536, "cpu", 4096),   # SmolLM2-135M: 18 KiB of activations a token
    (3072, "cpu", 2048),   # Qwen3-0.6B
    (8192, "cpu", 512),    # Llama-3.2-1B: 96 KiB a token
    (14336, "cpu", 256),   # Llama-3.1-8B
    (200000, "cpu", 256),  # never below 256
    (8192, "cuda", 2048),
])
def test_auto_batched_tokens_bound_a_cpu_chunks_activations(intermediate, device, chunk):
    from longctx.config import CPU_ACTIVATION_BYTES, batched_tokens_for

    got = batched_tokens_for(SchedulerConfig(max_num_batched_tokens="auto"), intermediate, device)
    assert got.max_num_batched_tokens == chunk
    if device == "cpu" and chunk < 4096:
        assert 2 * chunk * intermediate * 12 > CPU_ACTIVATION_BYTES  # the next power of two would not fit
    if device == "cpu" and chunk > 256:
        assert chunk * intermediate * 12 <= CPU_ACTIVATION_BYTES  # and this one does
    # a given budget is kept as given
    assert batched_tokens_for(SchedulerConfig(max_num_batched_tokens=4096), intermediate, device) \
        .max_num_batched_tokens == 4096


def test_the_engine_resolves_auto_batched_tokens(tiny_engine_folder):
    from longctx import LLM
    from longctx.config import batched_tokens_for

    with LLM(tiny_engine_folder, device="cpu") as llm:
        mc = llm.engine.model_config
        want = batched_tokens_for(SchedulerConfig(), mc.intermediate_size, "cpu").max_num_batched_tokens
        assert llm.engine.sched_config.max_num_batched_tokens == want == llm.engine.scheduler.config.max_num_batched_tokens
    from longctx.entrypoints import cli

    parse = cli.build_parser().parse_args
    assert parse(["generate", "hi", "--max-num-batched-tokens", "auto"]).max_num_batched_tokens == "auto"
    assert parse(["generate", "hi", "--max-num-batched-tokens", "512"]).max_num_batched_tokens == 512


def test_kv_cache_gb_flag_takes_a_number_or_auto(capsys):
    from longctx.entrypoints import cli

    parse = cli.build_parser().parse_args
    assert parse(["generate", "hi", "--kv-cache-gb", "auto"]).kv_cache_gb == "auto"
    assert parse(["generate", "hi", "--kv-cache-gb", "1.5"]).kv_cache_gb == 1.5
    with pytest.raises(SystemExit):
        parse(["generate", "hi", "--kv-cache-gb", "lots"])
    assert "invalid GiB (a number, or auto) value: 'lots'" in capsys.readouterr().err


def test_cpu_kv_budget_is_a_share_of_what_is_left_capped_at_what_requests_need():
    from longctx.kv.device_pool import cpu_kv_budget_gb

    gb, note = cpu_kv_budget_gb(100.0, available=8 << 30)
    assert gb == pytest.approx(4.0) and "50% of 8.0 GiB available after the weights" in note
    gb, note = cpu_kv_budget_gb(0.25, available=8 << 30)
    assert gb == pytest.approx(0.25) and "need" in note


def test_explicit_choices_win_over_auto():
    load, cache = resolve_auto(ModelLoadConfig(dtype="float32"), CacheConfig(block_size=16, kv_cache_gb=3.0),
                               "cuda", True)
    assert (load.dtype, cache.block_size, cache.kv_cache_gb) == ("float32", 16, 3.0)
    # float32 on CUDA: no flash-attn, so the default page size stays 64
    assert resolve_auto(ModelLoadConfig(dtype="float32"), CacheConfig(), "cuda", True)[1].block_size == 64
    assert CacheConfig().host_tier_gb("cpu") == 0.0 and CacheConfig().host_tier_gb("cuda") == 2.0
    assert CacheConfig(host_cache_gb=0.5).host_tier_gb("cpu") == 0.5


def test_kv_budget_on_a_gpu_follows_vllms_rule():
    gib = 1 << 30
    # 80 GiB card, 75 free after loading 5 GiB; a full step peaks 2 GiB above what is allocated
    assert kv_budget_bytes(80 * gib, 75 * gib, 5 * gib, 7 * gib, 0.9) == 72 * gib - 5 * gib - 2 * gib
    # another process holds 10 GiB: less for us
    assert kv_budget_bytes(80 * gib, 65 * gib, 5 * gib, 7 * gib, 0.9) == 72 * gib - 15 * gib - 2 * gib
    assert kv_budget_bytes(80 * gib, 5 * gib, 5 * gib, 7 * gib, 0.5) < 0  # nothing left: the engine says so


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("cls", [ModelLoadConfig, CacheConfig, SchedulerConfig])
def test_engine_configs_are_frozen_and_every_field_has_help(cls):
    obj = cls()
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, None)
    assert all(f.metadata.get("help") for f in dataclasses.fields(cls))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_model_load_config_accepts_known_dtypes(dtype):
    assert ModelLoadConfig(dtype=dtype).dtype == dtype


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "flash-attn"])
def test_model_load_config_accepts_known_attention_backends(backend):
    assert ModelLoadConfig(attention_backend=backend).attention_backend == backend


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention_backend="flash_attn"), "attention_backend must be one of auto, torch, "
                                           "triton, flash-attn, got 'flash_attn'"),
    (dict(dtype="int8"), "dtype must be one of auto, float32, bfloat16, float16, got 'int8'"),
    (dict(dtype="fp16"), "dtype must be one of auto, float32, bfloat16, float16, got 'fp16'"),
    (dict(num_threads=-1), "num_threads must be >= 0, got -1"),
    (dict(weight_cache_gb=-1), "weight_cache_gb must be a finite number >= 0, got -1"),
    (dict(weight_cache_gb=float("nan")), "weight_cache_gb must be a finite number >= 0, got nan"),
    (dict(weight_cache_gb="lots"), "weight_cache_gb must be a finite number >= 0, got 'lots'"),
])
def test_model_load_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ModelLoadConfig(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 1024])
def test_cache_config_accepts_power_of_two_block_sizes(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=0), "block_size must be a power of two in [1, 1024], got 0"),
    (dict(block_size=3), "block_size must be a power of two in [1, 1024], got 3"),
    (dict(block_size=48), "block_size must be a power of two in [1, 1024], got 48"),
    (dict(block_size=2048), "block_size must be a power of two in [1, 1024], got 2048"),
    (dict(block_size=-4), "block_size must be a power of two in [1, 1024], got -4"),
    (dict(kv_cache_gb=0), "kv_cache_gb must be positive or \"auto\", got 0"),
    (dict(kv_cache_gb=-0.5), "kv_cache_gb must be positive or \"auto\", got -0.5"),
    (dict(num_blocks=-1), "num_blocks must be >= 0, got -1"),
])
def test_cache_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        CacheConfig(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_batched_tokens=0), 'max_num_batched_tokens must be >= 1 or "auto", got 0'),
    (dict(max_num_batched_tokens=-8), 'max_num_batched_tokens must be >= 1 or "auto", got -8'),
    (dict(max_num_batched_tokens="lots"), 'max_num_batched_tokens must be >= 1 or "auto", got \'lots\''),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_model_len=-1), "max_model_len must be >= 0, got -1"),
])
def test_scheduler_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**kwargs)
    assert str(info.value) == message


def test_scheduler_config_smallest_valid_values():
    cfg = SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1, max_model_len=0)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len) == (1, 1, 0)


def test_split_engine_kwargs_empty_gives_defaults():
    assert split_engine_kwargs({}) == (ModelLoadConfig(), CacheConfig(), SchedulerConfig(), LookaheadConfig(),
                                      ParallelConfig())


def test_split_engine_kwargs_routes_each_key_to_its_owner():
    load, cache, sched, *_ = split_engine_kwargs(dict(
        model="/models/x", dtype="bfloat16", device="cuda:1", num_threads=4,
        attention_backend="triton", block_size=16,
        kv_cache_gb=2.5, num_blocks=100, max_num_batched_tokens=512, max_num_seqs=8,
        max_model_len=4096))
    assert load == ModelLoadConfig(model="/models/x", dtype="bfloat16", device="cuda:1",
                                   num_threads=4, attention_backend="triton")
    assert cache == CacheConfig(block_size=16, kv_cache_gb=2.5, num_blocks=100)
    assert sched == SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                    max_model_len=4096)


def test_split_engine_kwargs_partial():
    load, cache, sched, *_ = split_engine_kwargs({"max_num_seqs": 2, "block_size": 8})
    assert load == ModelLoadConfig()
    assert cache == CacheConfig(block_size=8)
    assert sched == SchedulerConfig(max_num_seqs=2)


def test_split_engine_kwargs_unknown_keys_are_listed_sorted_with_the_known_ones():
    known = sorted(f.name for cls in (ModelLoadConfig, CacheConfig, SchedulerConfig, LookaheadConfig,
                                                  ParallelConfig)
                   for f in dataclasses.fields(cls))
    assert known[:4] == ["allow_long_context", "attention_backend", "block_numerics", "block_size"]
    with pytest.raises(ConfigError) as info:
        split_engine_kwargs({"zeta": 1, "blok_size": 16, "dtype": "float32", "gamma": 0,
                             "temperature": 0.5, "alpha": 2, "max_tokens": 9, "beta": 1})
    assert str(info.value) == ("unknown engine option(s): alpha, beta, blok_size, gamma, "
                               "max_tokens, temperature, zeta; "
                               f"known: {', '.join(known)}")


def test_split_engine_kwargs_validates_values():
    with pytest.raises(ConfigError, match=r"^block_size must be a power of two in \[1, 1024\], "
                                          r"got 12$"):
        split_engine_kwargs({"block_size": 12})


def test_engine_config_field_names_are_unique():
    names = [f.name for cls in (ModelLoadConfig, CacheConfig, SchedulerConfig)
             for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))


# ---------------------------------------------------------------------------- ModelConfig


LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}

SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000,
    "rope_scaling": None, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
}

MISTRAL_NEMO = {
    "model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120,
    "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 1024000,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

QWEN25_7B = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 131072,
    "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_llama31_config():
    cfg = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert cfg == ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009))
    assert cfg.num_queries_per_kv == 4


def test_smollm2_config_defaults_head_dim_and_ties_embeddings():
    cfg = ModelConfig.from_hf_dict(SMOLLM2_135M)
    assert cfg == ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-05, rope_theta=100000.0,
        rope_scaling=RopeScaling(), tie_word_embeddings=True, bos_token_id=0,
        eos_token_ids=(0,))
    assert type(cfg.rope_theta) is float
    assert cfg.num_queries_per_kv == 3


def test_mistral_config_keeps_explicit_head_dim():
    cfg = ModelConfig.from_hf_dict(MISTRAL_NEMO)
    assert cfg.model_type == "mistral"
    assert cfg.head_dim == 128  # not 5120 // 32 = 160
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 8)
    assert (cfg.max_position_embeddings, cfg.rope_theta) == (1024000, 1000000.0)
    assert cfg.rope_scaling == RopeScaling()
    assert (cfg.attention_bias, cfg.eos_token_ids, cfg.bos_token_id) == (False, (2,), 1)


def test_qwen2_config_has_qkv_bias():
    cfg = ModelConfig.from_hf_dict(QWEN25_7B)
    assert cfg == ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-06, rope_theta=1000000.0,
        rope_scaling=RopeScaling(), tie_word_embeddings=False, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151645,))
    assert cfg.num_queries_per_kv == 7


@pytest.mark.parametrize("head_dim", [None, 0])
def test_missing_head_dim_is_hidden_over_heads(head_dim):
    cfg = ModelConfig.from_hf_dict({**MISTRAL_NEMO, "head_dim": head_dim})
    assert cfg.head_dim == 160


def test_minimal_dict_takes_documented_defaults():
    cfg = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4})
    assert cfg == ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling(), tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, bos_token_id=None, eos_token_ids=())


def test_null_kv_heads_means_multi_head_attention():
    cfg = ModelConfig.from_hf_dict({**SMOLLM2_135M, "num_key_value_heads": None})
    assert (cfg.num_key_value_heads, cfg.num_queries_per_kv) == (9, 1)


def test_llama_biases_follow_the_dict():
    cfg = ModelConfig.from_hf_dict({**SMOLLM2_135M, "attention_bias": True, "mlp_bias": True})
    assert (cfg.attention_bias, cfg.mlp_bias) == (True, True)


@pytest.mark.parametrize("rope,expected", [
    (None, RopeScaling()),
    ({}, RopeScaling()),
    ({"type": "linear", "factor": 2.0}, RopeScaling(rope_type="linear", factor=2.0)),
    ({"rope_type": "dynamic", "factor": 4.0}, RopeScaling(rope_type="dynamic", factor=4.0)),
    ({"type": "linear", "rope_type": "dynamic", "factor": 3.0},
     RopeScaling(rope_type="dynamic", factor=3.0)),
    ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192},
     RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=8192)),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    # yarn without the original length takes max_position_embeddings (8192 here)
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": None},
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=8192,
                 beta_fast=32, beta_slow=1)),
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.5, "mscale": 1.0,
      "mscale_all_dim": 0.0, "truncate": False},
     RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=8192,
                 attention_factor=0.5, mscale=1.0, mscale_all_dim=0.0, truncate=False)),
])
def test_rope_scaling_variants(rope, expected):
    cfg = ModelConfig.from_hf_dict({**SMOLLM2_135M, "rope_scaling": rope})
    assert cfg.rope_scaling == expected
    assert cfg.rope_theta == 100000.0


def test_rope_parameters_carry_theta_and_win_over_rope_scaling():
    cfg = ModelConfig.from_hf_dict({
        **SMOLLM2_135M, "rope_theta": 1.0,
        "rope_scaling": {"rope_type": "linear", "factor": 9.0},
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)


def test_rope_parameters_default_type():
    cfg = ModelConfig.from_hf_dict({**SMOLLM2_135M, "rope_theta": None,
                                    "rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 250000.0}})
    assert (cfg.rope_theta, cfg.rope_scaling) == (250000.0, RopeScaling())


def test_unknown_rope_type_is_unsupported():
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_dict({**SMOLLM2_135M,
                                  "rope_scaling": {"rope_type": "ntk-by-parts", "factor": 4.0}})
    assert str(info.value) == ("RoPE type 'ntk-by-parts' is not supported; supported: default, "
                               "linear, dynamic, llama3, yarn, longrope")


def test_longrope_needs_its_factors():
    with pytest.raises(ValueError, match="^longrope needs short_factor, long_factor"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_llama3_rope_without_its_parameters_raises():
    with pytest.raises(ValueError, match="^llama3 RoPE needs low_freq_factor, high_freq_factor "
                                         "and original_max_position_embeddings$"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192}})


@pytest.mark.parametrize("factor", [0.0, -2.0])
def test_rope_factor_must_be_positive(factor):
    with pytest.raises(ValueError, match=f"^RoPE scaling factor must be positive, got {factor}$"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M,
                                  "rope_scaling": {"type": "linear", "factor": factor}})


def test_partial_rotary_rotates_the_first_dims():
    assert ModelConfig.from_hf_dict({**SMOLLM2_135M, "partial_rotary_factor": 0.5}).rotary_dim == 32
    assert ModelConfig.from_hf_dict(SMOLLM2_135M).rotary_dim is None
    with pytest.raises(ValueError, match="^rotary_dim must be even"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "partial_rotary_factor": 0.3})  # 19.2 -> 19 dims


@pytest.mark.parametrize("model_type", ["gpt2", "gemma", "phimoe", ""])
def test_unsupported_model_type_names_it(model_type):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "model_type": model_type})
    assert str(info.value) == (f"model_type {model_type!r} is not supported; longctx runs "
                               "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3 (Llama-family decoders)")


def test_missing_model_type_is_unsupported():
    cfg = dict(SMOLLM2_135M)
    del cfg["model_type"]
    with pytest.raises(UnsupportedModelError, match=r"^model_type '' is not supported"):
        ModelConfig.from_hf_dict(cfg)


def test_direct_construction_checks_model_type():
    fields = {f.name: getattr(ModelConfig.from_hf_dict(SMOLLM2_135M), f.name)
              for f in dataclasses.fields(ModelConfig)}
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'falcon' is not supported"):
        ModelConfig(**{**fields, "model_type": "falcon"})


def test_unsupported_model_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError)


def test_heads_not_divisible_by_kv_heads_raises():
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "num_attention_heads": 9,
                                  "num_key_value_heads": 2})
    assert str(info.value) == ("num_attention_heads (9) must be a multiple of "
                               "num_key_value_heads (2)")
    assert not isinstance(info.value, UnsupportedModelError)


def test_odd_head_dim_raises():
    with pytest.raises(ValueError, match=r"^head_dim must be even for RoPE, got 33$"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M, "hidden_size": 99, "num_attention_heads": 3,
                                  "num_key_value_heads": 3})


@pytest.mark.parametrize("name", ["vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "max_position_embeddings"])
def test_non_positive_sizes_raise(name):
    with pytest.raises(ValueError, match=rf"^{name} must be positive, got 0$"):
        ModelConfig.from_hf_dict({**SMOLLM2_135M, name: 0})


def test_eos_token_id_forms():
    base = dict(SMOLLM2_135M)
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": [5, 6]}).eos_token_ids == (5, 6)
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": 7}).eos_token_ids == (7,)
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": None}).eos_token_ids == ()


def test_sliding_window_shorter_than_context_applies_to_every_layer():
    mistral_v01 = {**MISTRAL_NEMO, "head_dim": None, "hidden_size": 4096,
                   "max_position_embeddings": 32768, "sliding_window": 4096}
    cfg = ModelConfig.from_hf_dict(mistral_v01)
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == [4096] * cfg.num_hidden_layers


@pytest.mark.parametrize("extra", [
    {"sliding_window": 32768, "use_sliding_window": True},  # covers the whole context
    {"sliding_window": 4096, "use_sliding_window": False},
    {"sliding_window": None},
])
def test_sliding_window_that_never_applies_is_accepted(extra):
    cfg = ModelConfig.from_hf_dict({**QWEN25_7B, **extra})
    assert cfg.max_position_embeddings == 32768
    assert not cfg.has_windows  # (one that covers the whole context is none)


def test_from_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    assert ModelConfig.from_hf_folder(tmp_path) == ModelConfig.from_hf_dict(QWEN25_7B)
    assert ModelConfig.from_hf_folder(str(tmp_path)) == ModelConfig.from_hf_dict(QWEN25_7B)


def test_from_hf_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*: not an HF checkpoint"):
        ModelConfig.from_hf_folder(tmp_path)


# ---------------------------------------------------------------------------- GGUF metadata


GGUF_LLAMA = {
    "general.architecture": "llama", "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8, "llama.embedding_length": 4096,
    "llama.feed_forward_length": 14336, "llama.block_count": 32, "llama.context_length": 8192,
    "llama.rope.freq_base": 500000.0, "llama.attention.layer_norm_rms_epsilon": 1e-05,
    "llama.vocab_size": 128256, "llama.rope.dimension_count": 128,
    "tokenizer.ggml.bos_token_id": 128000, "tokenizer.ggml.eos_token_id": 128009,
}


def test_gguf_llama_fields():
    cfg = ModelConfig.from_gguf_fields(GGUF_LLAMA, has_output_weight=False)
    assert cfg == ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling=RopeScaling(), tie_word_embeddings=True, attention_bias=False,
        bos_token_id=128000, eos_token_ids=(128009,))
    assert ModelConfig.from_gguf_fields(GGUF_LLAMA, has_output_weight=True).tie_word_embeddings \
        is False


def test_gguf_linear_rope_scaling():
    meta = {**GGUF_LLAMA, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 2048}
    cfg = ModelConfig.from_gguf_fields(meta, has_output_weight=True)
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=4.0,
                                           original_max_position_embeddings=2048)


def test_gguf_unsupported_architecture_names_it():
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_gguf_fields({**GGUF_LLAMA, "general.architecture": "gemma3n"}, True)
    assert str(info.value) == ("GGUF architecture 'gemma3n' is not supported "
                               "(llama, qwen2, qwen3, gemma2, gemma3, phi3)")


def test_lookahead_takes_a_bool_or_a_config_object():
    _, _, _, look, _ = split_engine_kwargs({"lookahead": False})
    assert look == LookaheadConfig(lookahead=False)
    _, _, _, look, _ = split_engine_kwargs({"lookahead": LookaheadConfig(lookahead_max_tokens=4)})
    assert look.lookahead_max_tokens == 4 and look.lookahead
    with pytest.raises(ConfigError, match="not both"):
        split_engine_kwargs({"lookahead": LookaheadConfig(), "lookahead_max_tokens": 3})
    with pytest.raises(ConfigError, match="lookahead_max_tokens must be in"):
        split_engine_kwargs({"lookahead_max_tokens": 0})
    with pytest.raises(ConfigError, match="lookahead must be True or False"):
        split_engine_kwargs({"lookahead": "yes"})


@pytest.mark.parametrize("max_len,seqs", [(4100, 1), (129, 2), (128, 2)])
def test_auto_pool_on_the_cpu_holds_a_window_that_ends_inside_a_page(max_len, seqs):
    """The "auto" pool counts whole pages per request: a max_model_len one token past a page
    (4,100 with the default model's pages of 64 was refused as more than the pool held) is
    served, with no page more than the requests can use."""
    from longctx import LLM

    llm = LLM(device="cpu", block_size=64, max_model_len=max_len, max_num_seqs=seqs,
              enable_prefix_caching=False, lookahead=False)
    try:
        assert llm.engine.max_model_len == max_len
        assert llm.engine.kv.num_blocks == -(-max_len // 64) * seqs
    finally:
        llm.close()

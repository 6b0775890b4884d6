"""Our model vs transformers on tiny random checkpoints of every supported architecture and
RoPE variant, at sequence lengths past the RoPE scaling threshold (fp32, 1e-4 relative)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.attention import AttentionMetadata, select_backend
from longctx.model.config import ModelConfig, UnsupportedModelError
from longctx.model.loader import load_model
from tiny_models import KINDS, make_checkpoint, write_gguf

SEQ_LEN = 100  # past max_position_embeddings (64) and every original_max_position_embeddings (32)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    backend = select_backend("cpu", model.config.head_dim)
    hidden = model(ids, torch.arange(len(ids)), backend, AttentionMetadata.dense([len(ids)]))
    return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tmp_path, kind):
    hf = make_checkpoint(tmp_path, kind)
    ids = torch.randint(0, hf.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    ours = _our_logits(load_model(str(tmp_path)), ids)
    assert _relative_error(ours, expected) < 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = torch.arange(40) % hf.config.vocab_size
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert _relative_error(_our_logits(load_model(str(tmp_path)), ids), expected) < 1e-4


@pytest.mark.parametrize("kind", ["llama-default", "llama-bias", "qwen2", "qwen3", "qwen3-tied"])
def test_gguf_file_matches_hf_folder(tmp_path, monkeypatch, kind):
    """A GGUF written as llama.cpp writes the architecture (llama: q/k rows permuted; qwen2 and
    qwen3 not; qwen3's q/k norms as attn_q_norm/attn_k_norm) loads to the same logits."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", kind)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, hf)
    ids = torch.arange(50) % hf.config.vocab_size
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(str(gguf_path))
    assert model.config.num_key_value_heads == 2
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.model_type == hf.config.model_type
    assert _relative_error(_our_logits(model, ids), expected) < 1e-5


GGUF_FAMILIES = {  # kind -> overrides that keep it inside what llama.cpp's GGUF describes
    "gemma2": {"query_pre_attn_scalar": 16},  # (llama.cpp takes the head dim for it)
    "gemma3": {"num_hidden_layers": 6, "query_pre_attn_scalar": 24,  # llama.cpp's 5 sliding : 1 global
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "phi3": {},
    "phi3-longrope": {},
}


@pytest.mark.parametrize("kind", list(GGUF_FAMILIES))
def test_gguf_families_match_hf_folder(tmp_path, monkeypatch, kind):
    """Gemma 2/3 and Phi-3 GGUFs as llama.cpp's converter writes them (norms stored as 1 + w,
    Gemma's post-norms, no query_pre_attn_scalar or Gemma 3 layer pattern keys, Phi-3's fused
    attn_qkv / ffn_up, partial rope.dimension_count, LongRoPE factors as tensors) load to the HF
    folder's config and logits over 120 tokens, past every sliding window (40)."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", kind, max_position_embeddings=1024, **GGUF_FAMILIES[kind])
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, hf)
    ids = torch.randint(0, hf.config.vocab_size, (120,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(str(gguf_path))
    folder = load_model(str(tmp_path / "hf")).config
    for name in ("model_type", "sliding_window", "layer_types", "rotary_dim", "rope_scaling", "local_rope_theta",
                 "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings"):
        got, want = getattr(model.config, name), getattr(folder, name)
        if name == "rope_scaling" and want.rope_type == "longrope":
            # the GGUF states the attention factor the folder implies, and holds the factors as
            # float32 (as llama.cpp writes them; the tables are computed in float32 either way)
            f32 = lambda xs: tuple(float(torch.tensor(x, dtype=torch.float32)) for x in xs)  # noqa: E731
            want = dataclasses.replace(want, short_factor=f32(want.short_factor), long_factor=f32(want.long_factor))
            if want.attention_factor is None:
                got = dataclasses.replace(got, attention_factor=None)
        assert got == want, name
    assert _relative_error(_our_logits(model, ids), expected) < 1e-5


def test_llama3_gguf_applies_rope_freqs(tmp_path, monkeypatch):
    """llama.cpp writes a Llama 3.1 GGUF's RoPE scaling as the ``rope_freqs.weight`` tensor (no
    scaling keys): loaded, it gives the HF folder's logits past the scaling threshold (plain
    RoPE, the tensor skipped, is wrong from the first positions past it)."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "llama-llama3")
    gguf_path = tmp_path / "llama3.gguf"
    write_gguf(gguf_path, hf)
    ids = torch.randint(0, hf.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(str(gguf_path))
    assert _relative_error(_our_logits(model, ids), expected) < 1e-4
    again = load_model(str(gguf_path))  # from the converted-weights cache: the factors kept
    assert again.config.rope_scaling == model.config.rope_scaling
    assert _relative_error(_our_logits(again, ids), expected) < 1e-4


def test_gguf_tensor_the_loader_does_not_know_is_refused_by_name(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "llama-default")
    path = tmp_path / "extra.gguf"
    write_gguf(path, hf)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "extra2.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0]) if len(field.types) == 1 else None
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_q_norm.weight"):
        load_model(str(tmp_path / "extra2.gguf"))


@pytest.mark.parametrize("key, value, words", [
    ("llama.attention.sliding_window", 32, "GGUF key\\(s\\) llama.attention.sliding_window \\(llama\\) are not"),
    ("llama.attn_logit_softcapping", 50.0, "llama.attn_logit_softcapping"),
    ("llama.expert_count", 8, "mixture-of-experts"),
    ("llama.rope.dimension_count", 8, "partial rotary embeddings"),  # (no key_length: seen in attn_q)
])
def test_gguf_key_the_loader_does_not_understand_is_refused_by_name(tmp_path, monkeypatch, key, value, words):
    import gguf

    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "llama-default")
    path = tmp_path / "extra.gguf"
    write_gguf(path, hf, extra={key: value})
    with pytest.raises(UnsupportedModelError, match=words):
        load_model(str(path))
    assert gguf  # (the writer's package)


def test_unsupported_architecture_names_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path))


def test_windows_are_read_as_hf_reads_them():
    """sliding_window / use_sliding_window / max_window_layers / layer_types / Gemma's patterns
    give each layer the window HF gives it (and the parity tests in test_families.py run them)."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50, max_position_embeddings=128)

    def windows(cfg):
        config = ModelConfig.from_hf_dict(cfg.to_dict())
        return [config.layer_window(i) for i in range(config.num_hidden_layers)]

    assert windows(MistralConfig(**small, sliding_window=32)) == [32] * 4
    assert windows(MistralConfig(**small, sliding_window=None)) == [None] * 4
    assert windows(Qwen2Config(**small, sliding_window=32, use_sliding_window=False)) == [None] * 4
    assert windows(Qwen2Config(**small, sliding_window=32, use_sliding_window=True, max_window_layers=2)) == [
        None, None, 32, 32]
    assert windows(Gemma2Config(**small, sliding_window=32)) == [32, None, 32, None]
    assert windows(Gemma3TextConfig(**{**small, "num_hidden_layers": 7}, sliding_window=32)) == [32] * 5 + [None, 32]
    with pytest.raises(UnsupportedModelError, match="layer type\\(s\\) chunked_attention"):
        ModelConfig.from_hf_dict({**MistralConfig(**small, sliding_window=32).to_dict(),
                                  "layer_types": ["chunked_attention"] * 4})


def test_gemma3_with_every_layer_global_has_no_local_rope(tmp_path):
    """transformers writes Gemma 3's per-layer-type RoPE even when no layer slides: that model
    runs (it crashed looking for a sliding layer's RoPE) and matches HF."""
    hf = make_checkpoint(tmp_path, "gemma3", layer_types=["full_attention"] * 3)
    ids = torch.randint(0, hf.config.vocab_size, (60,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(str(tmp_path))
    assert model.config.local_rope_theta is None and not model.config.has_windows
    assert _relative_error(_our_logits(model, ids), expected) < 1e-4

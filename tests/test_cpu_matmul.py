"""The CPU weight products: the C row kernel (the fp32 default where it builds) and oneDNN's
pre-packed path against BLAS, in a layer and through the engine, and what sequence-parallel
ranks can share."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import ConfigError
from longctx.kernels import cpu_amx, cpu_linear
from longctx.model.llama import Linear, choose_cpu_matmul, onednn_linear_available
from tiny_models import first_logits_and_tokens, hf_greedy, make_engine_checkpoint

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")
needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"row kernel {cpu_linear.status()}")


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


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, cpu_linear.DOT_MAX_ROWS, cpu_linear.DOT_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("limit", [None, cpu_linear.DOT_MAX_ROWS])
def test_row_kernel_linear_matches_blas(rows, bias, limit, monkeypatch):
    """Up to max_rows() rows through the kernel (every step where it has its panel path; the
    limit of a build without it is simulated), more through BLAS on the same [out, in] copy."""
    if limit is not None:
        monkeypatch.setattr(cpu_linear, "max_rows", lambda: limit)
    layer = _linear(72, 200, bias)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows))
    expected = layer(x)
    layer.use_row_kernel()
    assert layer.weight_t is None and tuple(layer.weight.shape) == (200, 72)
    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (rows <= cpu_linear.max_rows())
    torch.testing.assert_close(layer(x[::2]), expected[::2], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("prologue", ["norm", "swiglu"])
@pytest.mark.parametrize("rows", [1, 99, 100, 300])
def test_row_kernel_hands_steps_from_its_tuned_rows_to_blas(rows, prologue, monkeypatch):
    """``blas_from_rows`` (what kernels/cpu_tune.py measured faster here): steps of that many
    rows and more go to BLAS on the same [out, in] matrix, fewer stay on the kernel, with the
    norm or SwiGLU and the residual applied either way."""
    from longctx.model.linear import RowKernelWeights
    from longctx.model.llama import RMSNorm

    layer = _linear(72, 200, True)
    gen = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 200, generator=gen)
    if prologue == "norm":
        x, norm = torch.randn(rows, 72, generator=gen), RMSNorm(72, 1e-5)
        norm.weight.data.copy_(torch.rand(72, generator=gen) + 0.5)
        expected = layer(norm(x)) + residual
    else:
        x, norm = torch.randn(rows, 144, generator=gen), None
        gate, up = x.chunk(2, dim=-1)
        expected = layer(torch.nn.functional.silu(gate) * up) + residual
    layer.hold(RowKernelWeights(blas_from_rows=100))
    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = layer(x, norm=norm, swiglu=norm is None, residual=residual)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (rows < 100)


@needs_kernel
def test_row_kernel_linear_takes_no_rows():
    layer = _linear(16, 8, True)
    layer.use_row_kernel()
    assert layer(torch.empty(0, 16)).shape == (0, 8)


@needs_kernel
def test_row_kernel_takes_bfloat16_and_refuses_float16():
    layer = _linear(16, 8, True).to(torch.bfloat16)
    layer.bias.data = layer.bias.data.float()  # the model makes biases fp32 (use_row_kernel)
    expected = torch.nn.functional.linear(torch.ones(3, 16), layer.weight_t.float().t(), layer.bias)
    layer.use_row_kernel()
    assert layer.weight.dtype == torch.bfloat16 and tuple(layer.weight.shape) == (8, 16)
    torch.testing.assert_close(layer(torch.ones(3, 16)), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _linear(16, 8, False).to(torch.float16).use_row_kernel()


@needs_onednn
def test_packing_refuses_half_precision():
    layer = _linear(16, 8, False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        layer.pack_onednn(16)


def test_choice_rules():
    assert choose_cpu_matmul("blas", torch.float32) == "blas"
    panels = cpu_linear.available() and cpu_linear.max_rows() == cpu_linear.UNBOUNDED
    assert choose_cpu_matmul("auto", torch.bfloat16) == ("kernel" if panels else "blas")
    assert choose_cpu_matmul("auto", torch.float16) == "blas"
    fallback = "onednn" if onednn_linear_available() else "blas"
    assert choose_cpu_matmul("auto", torch.float32) == ("kernel" if panels else fallback)
    with pytest.raises(ConfigError, match="float32 and bfloat16 models"):
        choose_cpu_matmul("kernel", torch.float16)
    # refused before any loading
    with pytest.raises(ConfigError, match="cpu_matmul='onednn' is for float32 models"):
        LLM("unused", cpu_matmul="onednn", dtype="bfloat16")
    with pytest.raises(ConfigError, match="cpu_matmul='kernel' is for float32 and bfloat16 models"):
        LLM("unused", cpu_matmul="kernel", dtype="float16")
    with pytest.raises(ConfigError, match="cpu_matmul must be one of"):
        LLM("unused", cpu_matmul="mkl")


@needs_onednn
@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_engine_tokens_same_with_every_path(tmp_path, tied):
    hf = make_engine_checkpoint(tmp_path, tie_word_embeddings=tied)
    prompt = torch.randint(3, 160, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = hf_greedy(hf, prompt, params.max_tokens)
    for choice, held in (("kernel", "weight"), ("onednn", "packed"), ("blas", "weight_t"), ("auto", "weight")):
        llm = LLM(str(tmp_path), cpu_matmul=choice, max_num_batched_tokens=64, block_size=16)
        model = llm.engine.model
        assert llm.engine.cpu_matmul == ("kernel" if choice == "auto" else choice)
        assert all(getattr(layer, held) is not None for layer in (model.lm_head, model.layers[0].mlp.down_proj))
        if choice == "kernel":  # a tied head is the embedding itself, not a copy
            shares = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
            assert shares is tied
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected


@needs_onednn
def test_sequence_parallel_keeps_shared_weights_unpacked(tmp_path):
    """SP ranks share the engine's weights through shared memory; packed (opaque) tensors
    cannot be shared, so SP never packs by default, and asking for packing is refused by name."""
    make_engine_checkpoint(tmp_path)
    with LLM(str(tmp_path), sequence_parallel_size=2) as llm:
        assert not llm.engine.model.has_packed_linears()
    with pytest.raises(ConfigError, match="opaque tensors that the ranks cannot share"):
        LLM(str(tmp_path), cpu_matmul="onednn", sequence_parallel_size=2)


@needs_kernel
def test_sequence_parallel_shares_row_kernel_weights(tmp_path):
    """A model holding [out, in] matrices for the row kernel goes to the ranks as it is, and
    they produce HF's tokens."""
    hf = make_engine_checkpoint(tmp_path, tie_word_embeddings=True)
    prompt = torch.randint(3, 160, (90,), generator=torch.Generator().manual_seed(8)).tolist()
    with LLM(str(tmp_path), cpu_matmul="kernel", sequence_parallel_size=2, block_size=16,
             max_num_batched_tokens=32) as llm:
        assert llm.engine.model.uses_row_kernel() and not llm.engine.model.has_packed_linears()
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, prompt, 6)


@needs_kernel
def test_engine_with_prefill_chunks_on_blas(tmp_path, monkeypatch):
    """LONGCTX_CPU_TUNE as a row count (what a measurement on an Intel Xeon may choose): a
    float32 model's prefill chunks run on BLAS, decode on the kernel; HF's greedy tokens, in
    one process and across two sequence-parallel ranks (the ranks get the engine's choice with
    the model), and again from the prefix cache. A bfloat16 model keeps the kernel."""
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "65")
    hf = make_engine_checkpoint(tmp_path, tie_word_embeddings=True)
    prompt = torch.randint(3, 160, (200,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = hf_greedy(hf, prompt, params.max_tokens)
    for sp in (1, 2):
        with LLM(str(tmp_path), sequence_parallel_size=sp, max_num_batched_tokens=128, block_size=16) as llm:
            model = llm.engine.model
            assert llm.engine.cpu_matmul == "kernel"
            assert model.layers[0].mlp.down_proj.method.blas_from_rows == 65
            assert model.layers[-1].self_attn.qkv_proj.method.blas_from_rows == 65
            for _ in range(2):  # the second run's prefill comes from the prefix cache
                assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected
    with LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=128, block_size=16) as llm:
        assert llm.engine.model.layers[0].mlp.down_proj.method.blas_from_rows == cpu_linear.UNBOUNDED


@needs_kernel
def test_the_tune_measures_in_the_heap_regime_the_steps_run_in(tiny_engine_folder, monkeypatch):
    """A first load's measurement (BLAS against the kernel) runs after glibc is told to keep
    large blocks in its heap, as the steps will run: measured before, BLAS's fresh temporaries
    were faulted in on every call (on huge pages, 2x its time at 2,048 rows)."""
    from longctx.kernels import cpu_tune
    from longctx.model import prepare

    events = []
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_MEMO", {})
    monkeypatch.setattr(cpu_tune, "_read", lambda path: {})  # nothing cached,
    monkeypatch.setattr(cpu_tune, "_write", lambda path, data: None)  # nothing kept
    monkeypatch.setattr(cpu_tune, "measure", lambda shapes, threads, way="blas": events.append(("measure", way)) or
                        {"rows": {}, "blas_from_rows": None})
    monkeypatch.setattr(prepare.cpu_build, "keep_large_blocks", lambda: events.append(("heap",)) or True)
    with LLM(tiny_engine_folder, max_num_batched_tokens=64, block_size=16) as llm:
        assert llm.engine.cpu_matmul == "kernel"
    assert events[0] == ("heap",) and ("measure", "blas") in events, events


@needs_kernel
def test_a_bad_tune_setting_is_a_config_error_naming_it(tiny_engine_folder, monkeypatch):
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "fastest")
    with pytest.raises(ConfigError, match="LONGCTX_CPU_TUNE must be 'auto', 'off' or a row count"):
        LLM(tiny_engine_folder)


def _bf16_rounded_reference(folder, num_prompt: int):
    """A tiny checkpoint in ``folder`` whose weights are bfloat16-rounded, a prompt, greedy
    params, and HF float32's greedy tokens and last-position logits on it."""
    hf = make_engine_checkpoint(folder, tie_word_embeddings=True)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(param.bfloat16().float())
    prompt = torch.randint(3, 160, (num_prompt,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    return prompt, params, hf_greedy(hf, prompt, params.max_tokens), hf_logits


@needs_kernel
def test_bfloat16_model_on_the_row_kernel(tmp_path):
    """dtype='bfloat16' on the CPU: bf16 matrices and embedding (a tied head shares it), bf16 KV
    pages, fp32 activations. Its first logits equal HF float32's on the bf16-rounded weights
    within 2e-2 (the KV pages round K and V to bf16 too), its greedy tokens equal theirs, and
    lookahead, a prefix hit and sequence parallelism give the same tokens."""
    prompt, params, expected, hf_logits = _bf16_rounded_reference(tmp_path, 150)
    with LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=64, block_size=16, lookahead=False) as llm:
        engine, model = llm.engine, llm.engine.model
        assert engine.cpu_matmul == "kernel" and model.act_dtype == torch.float32
        assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        assert model.layers[0].input_layernorm.weight.dtype == torch.float32
        assert engine.kv_dtype == torch.bfloat16
        logits, tokens = first_logits_and_tokens(llm, prompt, params)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-2)
        assert tokens == expected
        again = llm.generate({"prompt_token_ids": prompt}, params)[0]  # the prefix store's pages
        assert llm.cache_stats().hit_tokens["device"] > 0 and again.outputs[0].token_ids == expected
    with LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=64, block_size=16,
             lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected
    with LLM(str(tmp_path), dtype="bfloat16", sequence_parallel_size=2, block_size=16,
             max_num_batched_tokens=32) as llm:
        assert llm.engine.model.act_dtype == torch.float32
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected


@needs_kernel
@pytest.mark.skipif(not cpu_amx.available(), reason=f"AMX kernel {cpu_amx.status()}")
def test_bfloat16_prefill_chunks_on_amx(tmp_path, monkeypatch):
    """LONGCTX_CPU_TUNE as a row count on a CPU with AMX-BF16: a bfloat16 model's steps of 65
    rows and more (its prefill chunks) run on the AMX tiles, decode on the row kernel, and the
    model still gives HF float32's first logits on the bf16-rounded weights within 2e-2 and its
    greedy tokens: in one process (the AMX kernel called), from the prefix cache, with lookahead
    and across two sequence-parallel ranks (which get the choice with the model)."""
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "65")
    prompt, params, expected, hf_logits = _bf16_rounded_reference(tmp_path, 200)
    calls = []  # the rows of each AMX product: x rounded by the product (linear) or before it (linear_rounded)
    real, real_rounded = cpu_amx.linear, cpu_amx.linear_rounded
    monkeypatch.setattr(cpu_amx, "linear", lambda x, w, **kw: calls.append(x.shape[0]) or real(x, w, **kw))
    monkeypatch.setattr(cpu_amx, "linear_rounded",
                        lambda xb, rows, w, **kw: calls.append(rows) or real_rounded(xb, rows, w, **kw))
    with LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=128, block_size=16, lookahead=False) as llm:
        model = llm.engine.model
        assert model.layers[0].mlp.down_proj.method.amx_from_rows == 65
        assert model.layers[-1].self_attn.qkv_proj.method.amx_from_rows == 65
        logits, tokens = first_logits_and_tokens(llm, prompt, params)
        assert sorted(set(calls)) == [72, 128]  # the prompt's two chunks; decode stayed on the kernel
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=2e-2)
        assert tokens == expected
        again = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert llm.cache_stats().hit_tokens["device"] > 0 and again.outputs[0].token_ids == expected
    calls.clear()
    with LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=128, block_size=16, lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected
    assert sorted(set(calls)) == [72, 128]  # verification steps (a few rows each) stayed on the kernel
    calls.clear()
    with LLM(str(tmp_path), dtype="bfloat16", sequence_parallel_size=2, block_size=16,
             max_num_batched_tokens=256) as llm:  # one chunk of 200: 100 rows on each rank
        assert llm.engine.model.layers[0].mlp.down_proj.method.amx_from_rows == 65
        assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == expected
    assert sorted(set(calls)) == [100]  # rank 0's half, in this process


@pytest.mark.parametrize("method", ["blas", "kernel", "onednn"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_a_call_with_its_neighbours_equals_the_model_s_torch_ops(method, rows):
    """``Linear(x, norm=, swiglu=, residual=)``: BLAS and oneDNN run the neighbours as torch ops
    in the model's order (bit for bit), the row kernel fuses them (within fp32 rounding) for
    the rows it takes and runs them as torch ops above."""
    if method == "kernel" and not cpu_linear.available():
        pytest.skip(f"row kernel {cpu_linear.status()}")
    if method == "onednn" and not onednn_linear_available():
        pytest.skip("torch built without oneDNN")
    from longctx.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data.copy_(torch.rand(64, generator=gen) + 0.5)
    up, down = _linear(64, 96, True, seed=1), _linear(48, 64, True, seed=2)
    x = torch.randn(rows, 64, generator=gen)
    gate, upper = up(norm(x)).split(48, dim=-1)
    want = x + down(torch.nn.functional.silu(gate) * upper)
    for layer in (up, down):
        if method == "kernel":
            layer.use_row_kernel()
        elif method == "onednn":
            layer.pack_onednn(16)
    assert up.method.name == method
    got = down(up(x, norm=norm), swiglu=True, residual=x)
    if method == "blas":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2048, 1536), (300, 1000), (7, 37)])
def test_activation_by_out_forms_keeps_the_functional_forms_bits(shape, threads):
    """``activation`` (torch's out= forms, as the MLPs call them on a half of a [T, 2F] product)
    gives F.silu's and F.gelu(tanh)'s bits, into a new tensor and in place; a bad name is refused."""
    from longctx.model.linear import activation

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, f = shape
        pair = torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(m)) * 4
        gate = pair[:, :f]  # strided, as the products leave it
        for act, ref in (("silu", torch.nn.functional.silu(gate)),
                         ("gelu_tanh", torch.nn.functional.gelu(gate, approximate="tanh"))):
            assert torch.equal(activation(gate, act), ref)
            scratch = pair.clone()[:, :f]
            assert activation(scratch, act, out=scratch).data_ptr() == scratch.data_ptr()
            assert torch.equal(scratch, ref)
            assert not torch.equal(ref, gate)  # (the activation changed something)
        with pytest.raises(ValueError, match="act must be"):
            activation(gate, "relu")
    finally:
        torch.set_num_threads(before)

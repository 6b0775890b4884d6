"""HF folders quantized at load (``quantization="int8"`` / ``"int4"``): the quantizer's bytes
against llama.cpp's reference quantizers (gguf-py's Q8_0 and Q4_1, the same arithmetic as
ggml's ``quantize_row_*_ref``), group 128's rounding, and the engine on a tiny Llama against HF
transformers run on the same dequantized weights: the same 24 greedy tokens and every prompt
log-prob within 1e-4 (test_families.py's bar), alone and with lookahead, int8 KV pages and 2
sequence-parallel ranks. No float matrix is held after the load."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import ConfigError
from longctx.kernels import cpu_blocks
from longctx.model.linear import BlockEmbedding, BlockMatrix, Linear, blocks_available
from longctx.model.quantize import quantize_blocks
from tiny_models import hf_greedy, make_checkpoint, random_tokens, write_char_tokenizer, write_gguf

gguf = pytest.importorskip("gguf")

NEW_TOKENS = 24
PROMPT = random_tokens(100, seed=31)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)  # every K a multiple of 128 (int4's larger group)
SCHEMES = [("int8", 32), ("int4", 32), ("int4", 128)]
WIDE = ("model.embed_tokens.weight", "lm_head.weight")  # int8 under every scheme
needs_blocks = pytest.mark.skipif(not blocks_available(), reason="the block and row kernels do not run here")


def _awkward(rows: int, k: int, seed: int) -> np.ndarray:
    """Weights with the cases a quantizer gets wrong: zero rows and blocks, constant blocks,
    exact halves (round-half rules), one huge value in a block, tiny magnitudes, negatives only."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
    w[1] = 0.0
    w[2, :32] = 0.25
    w[3, :32] = np.arange(32, dtype=np.float32) * 0.5 - 8.0
    w[4, 5] = 1e3
    w[5] *= 1e-6
    w[6] = -np.abs(w[6])
    w[7, k - 32:] = 0.0
    w[8, :32] = 0.5 + np.arange(32) % 7 - 3  # Q8_0's d is exactly 1 here (127 below): codes land on halves
    w[8, 0] = 127.0
    return w


@pytest.mark.parametrize("scheme, fmt", [("int8", "Q8_0"), ("int4", "Q4_1")])
@pytest.mark.parametrize("rows, k", [(9, 32), (37, 256), (1030, 96)])  # 1030 rows: past one slab of 1024
def test_bytes_equal_llama_cpp_reference_quantizer(scheme, fmt, rows, k):
    w = _awkward(rows, k, seed=rows + k)
    ours = quantize_blocks(torch.from_numpy(w), scheme).numpy()
    reference = gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    assert ours.shape == reference.shape == (rows, cpu_blocks.row_bytes(fmt, k))
    assert np.array_equal(ours, reference), f"{(ours != reference).sum()} bytes differ"


def test_bfloat16_input_quantizes_its_float32_values():
    w = torch.from_numpy(_awkward(16, 128, seed=3)).to(torch.bfloat16)
    for scheme in ("int8", "int4"):
        assert torch.equal(quantize_blocks(w, scheme), quantize_blocks(w.float(), scheme))


def test_group_128_shares_one_scale_and_minimum_per_128_inputs():
    w = torch.from_numpy(_awkward(64, 512, seed=5))
    g128, g32 = quantize_blocks(w, "int4", 128), quantize_blocks(w, "int4", 32)
    assert g128.shape == g32.shape  # the same blocks: group 128's rounding, not its size
    heads = g128.view(64, 16, 20)[:, :, :4].reshape(64, 4, 4, 4)  # (d, m) of 4 blocks per group
    assert torch.equal(heads, heads[:, :, :1].expand_as(heads))
    assert not torch.equal(g128, g32)
    # each value within half a step of its group's grid, plus the fp16 rounding of d and m
    # (relative, and absolute where they are fp16 subnormals: row 5's weights are ~5e-8)
    groups = w.view(64, 4, 128)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    err128 = (cpu_blocks.dequantize(g128, "Q4_1", 512).view(64, 4, 128) - groups).abs()
    bound = step / 2 + 1e-3 * (lo.abs() + hi.abs()) + 15 * step * 1e-3 + 16 * 2.0 ** -24
    assert (err128 <= bound).all()
    err32 = (cpu_blocks.dequantize(g32, "Q4_1", 512).view(64, 4, 128) - groups).abs()
    assert err32.mean() < err128.mean()  # finer groups round closer


def test_bad_matrices_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_blocks(torch.zeros(4, 48), "int8")
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_blocks(torch.zeros(4, 96), "int4", 128)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_blocks(torch.zeros(4, 64), "int4", 64)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_blocks(torch.tensor([[float("nan")] * 32]), "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_blocks(torch.zeros(4, 32), "int2")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "hf"
    model = make_checkpoint(path, "llama-default", **SIZES)
    write_char_tokenizer(path)
    return str(path), model


def _dequantized_hf(model, scheme: str, group: int):
    """HF's model with every matrix replaced by what the scheme's blocks hold."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                kind = "int8" if name in WIDE else scheme
                fmt = "Q8_0" if kind == "int8" else "Q4_1"
                p.copy_(cpu_blocks.dequantize(quantize_blocks(p, kind, group), fmt, p.shape[1]))
    return ref


def _llm(path: str, scheme: str, group: int, **kw) -> LLM:
    return LLM(path, quantization=scheme, quantization_group_size=group,
               **{"block_size": 16, "max_num_batched_tokens": 64, "kv_cache_gb": 0.05, "lookahead": False, **kw})


def _generate(llm: LLM, prompt=PROMPT, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate({"prompt_token_ids": prompt}, sp)[0]


@needs_blocks
@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_engine_equals_hf_on_the_dequantized_weights(folder, scheme, group):
    path, model = folder
    ref = _dequantized_hf(model, scheme, group)
    expected = hf_greedy(ref, PROMPT, NEW_TOKENS)
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].double(), -1)
    with _llm(path, scheme, group) as llm:
        engine = llm.engine
        assert engine.cpu_matmul == "blocks"
        out = _generate(llm, prompt_logprobs=1)
        linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m.weight, BlockMatrix) and m.weight_t is None for m in linears)
        assert isinstance(engine.model.embed_tokens, BlockEmbedding)
        assert not any(p.dim() == 2 for p in engine.model.parameters())  # no float matrix anywhere
        want = "Q8_0" if scheme == "int8" else "Q4_1"
        layer_formats = {cpu_blocks.NAMES[c] for m in linears if m is not engine.model.lm_head for c in m.weight.codes}
        assert layer_formats == {want}
        assert engine.model.embed_tokens.blocks.codes == [cpu_blocks.FORMATS["Q8_0"]]
        k = SIZES["hidden_size"]
        held = sum(m.weight.nbytes() for m in linears if m is not engine.model.lm_head)
        weights = sum(m.weight.shape[0] * m.weight.shape[1] for m in linears if m is not engine.model.lm_head)
        assert held == weights * (34 if scheme == "int8" else 20) // 32, (held, weights, k)
    assert out.outputs[0].token_ids == expected
    worst = max(abs(out.prompt_logprobs[p][PROMPT[p]] - float(ref_lp[p - 1, PROMPT[p]])) for p in range(1, len(PROMPT)))
    print(f"{scheme} g{group}: worst prompt log-prob difference against HF {worst:.2e}")
    assert worst < 1e-4


@needs_blocks
@pytest.mark.parametrize("scheme, group", [("int8", 32), ("int4", 128)])
def test_lookahead_int8_pages_and_two_ranks_keep_the_tokens(folder, scheme, group):
    path, _ = folder
    follow = PROMPT[:80] + random_tokens(12, seed=32)
    with _llm(path, scheme, group) as llm:
        base = _generate(llm).outputs[0].token_ids
        base_follow = _generate(llm, follow).outputs[0].token_ids
    with _llm(path, scheme, group, lookahead=True) as llm:
        assert _generate(llm).outputs[0].token_ids == base
        assert _generate(llm, follow).outputs[0].token_ids == base_follow
        assert llm.cache_stats().hit_tokens["device"] >= 80  # the prefix store over quantized weights
    with _llm(path, scheme, group, sequence_parallel_size=2) as llm:
        assert llm.engine.cpu_matmul == "blocks"
        assert _generate(llm).outputs[0].token_ids == base
    # int8 pages change the numbers: against the float-weight engine with the same pages
    with _llm(path, scheme, group, kv_cache_dtype="int8") as llm:
        int8_pages = _generate(llm).outputs[0].token_ids
    with _llm(path, scheme, group, kv_cache_dtype="int8", lookahead=True) as llm:
        assert _generate(llm).outputs[0].token_ids == int8_pages


@needs_blocks
def test_fast_numerics_run_on_quantized_folders(folder):
    path, _ = folder
    with _llm(path, "int4", 32) as llm:
        exact = _generate(llm, logprobs=5)
    with _llm(path, "int4", 32, block_numerics="fast") as llm:
        assert all(m.method.fast for m in llm.engine.model.modules() if isinstance(m, Linear))
        fast = _generate(llm, logprobs=5)
    assert fast.outputs[0].token_ids[0] == exact.outputs[0].token_ids[0]  # prefill stays exact
    second, fast_second = exact.outputs[0].logprobs[1], fast.outputs[0].logprobs[1]
    diffs = [abs(fast_second[t] - second[t]) for t in second if t in fast_second]
    assert diffs and 0 < max(diffs) < 0.1, diffs  # Q4_1 has integer products: moved, a little


@needs_blocks
@pytest.mark.parametrize("scheme, group", [("int8", 32), ("int4", 128)])
def test_bfloat16_compute_takes_the_tiles_and_stays_near_hf(folder, scheme, group):
    """dtype='bfloat16' over quantized matrices: prefill chunks on bfloat16 slices and the AMX
    tiles where the CPU has them, else on the row kernel's bfloat16 panels where it rounds x
    (elsewhere the float32 slices), bfloat16 KV pages; prompt log-probs within 0.05 of HF's
    float32 on the same dequantized weights (x, the weights and K/V rounded to bfloat16), and
    the same tokens with lookahead and two ranks as alone."""
    from longctx.kernels import cpu_amx, cpu_linear

    path, model = folder
    ref = _dequantized_hf(model, scheme, group)
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].double(), -1)
    with _llm(path, scheme, group, dtype="bfloat16") as llm:
        panels = not cpu_amx.available() and cpu_linear.rounds_bf16_rows() > 0
        assert all(m.method.tiles == cpu_amx.available() and m.method.bf16_panels == panels
                   for m in llm.engine.model.modules() if isinstance(m, Linear))
        assert llm.engine.kv_format.dtype == torch.bfloat16
        out = _generate(llm, prompt_logprobs=1)
    worst = max(abs(out.prompt_logprobs[p][PROMPT[p]] - float(ref_lp[p - 1, PROMPT[p]])) for p in range(1, len(PROMPT)))
    print(f"{scheme} g{group} bfloat16: worst prompt log-prob difference against HF float32 {worst:.2e}")
    assert worst < 0.05
    with _llm(path, scheme, group, dtype="bfloat16", lookahead=True) as llm:
        assert _generate(llm).outputs[0].token_ids == out.outputs[0].token_ids
    with _llm(path, scheme, group, dtype="bfloat16", sequence_parallel_size=2) as llm:
        assert _generate(llm).outputs[0].token_ids == out.outputs[0].token_ids


def test_quantization_refused_where_it_cannot_serve(folder, tmp_path):
    path, model = folder
    cases = [
        (dict(quantization="int2"), "quantization must be one of"),
        (dict(quantization="int4", quantization_group_size=64), "quantization_group_size must be 32 or 128"),
        (dict(quantization="int8", quantization_group_size=128), "quantization_group_size is int4's"),
        (dict(quantization="int8", dtype="float16"), "computes in float32 or bfloat16"),
        (dict(quantization="int8", device="cuda"), "is for the CPU"),
        (dict(quantization="int8", cpu_matmul="blas"), "multiplies with the block kernel"),
        (dict(quantization="int8", gguf_weights="float"), "is for HF folders"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(path, **kwargs)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, model)
    with pytest.raises(ConfigError, match="is a .gguf file"):
        LLM(str(gguf_path), quantization="int8")


@needs_blocks
def test_inputs_off_the_group_are_refused_naming_the_matrix(tmp_path):
    path = tmp_path / "odd"
    make_checkpoint(path, "llama-default", hidden_size=96, intermediate_size=160, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024)
    write_char_tokenizer(path)
    with pytest.raises(Exception, match=r"cannot be quantized to int4: a int4 matrix's inputs must be a multiple of 128"):
        LLM(str(path), quantization="int4", quantization_group_size=128, kv_cache_gb=0.05)

"""GGUF weights kept as the file stores them (``gguf_weights='blocks'``): tiny Llama GGUFs in
every block format the kernel reads, mixed within a model and within a fused q/k/v matrix as
llama.cpp's Q4_K_M files mix them, against the same file expanded to float32 at load
(``gguf_weights='float'``, itself checked against HF in test_model_parity.py): every prompt
log-prob within 1e-4 (the bar test_families.py holds against HF) and the same 24 greedy tokens, alone and with lookahead, a prefix hit,
int8 KV pages and 2 sequence-parallel ranks. The model holds no float32 copy of its matrices.
The real model's blocks against HF transformers are in test_real_model.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import BLOCK_TERMS, ConfigError
from longctx.kernels import cpu_amx
from longctx.model import loader, rope
from longctx.model.linear import BlockEmbedding, BlockMatrix, Linear, blocks_available
from tiny_models import make_checkpoint, random_tokens, write_char_tokenizer, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not blocks_available(), reason="the block and row kernels do not run here")

NEW_TOKENS = 24
PROMPT = random_tokens(100, seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)  # K of every matrix a multiple of 256 (the K formats' blocks)
Q = gguf.GGMLQuantizationType
# tensor kind (or "*") -> format; llama.cpp's Q4_K_M: Q4_K with attn_v and ffn_down in Q6_K
CASES = {
    "q8_0": {"*": "Q8_0"},
    "q4_1-embed-q8_0": {"*": "Q4_1", "token_embd": "Q8_0"},  # the default model's mix
    "q4_0-q5_0-q5_1": {"*": "Q4_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "attn_v": "Q5_1", "token_embd": "Q5_0"},
    "q4_k_m": {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "attn_k": "Q5_K"},
    "f16-bf16": {"*": "F16", "ffn_up": "BF16", "attn_q": "BF16"},
}
# the formats whose runs of the slower combined tests stay in the default run (the rest: -m slow)
FORMATS_DEFAULT = ("q4_1-embed-q8_0", "q4_k_m")
SIMPLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")  # gguf-py quantizes these
K_LAYOUT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # bytes, fp16 scale offsets


def _k_blocks(fmt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-format blocks with small positive fp16 scales (weights of ~0.1): gguf-py has no
    quantizer for these formats; the file's values are what both paths read."""
    size, offsets = K_LAYOUT[fmt]
    raw = rng.integers(0, 256, size=(rows, k // 256, size), dtype=np.uint8)
    for off in offsets:
        scale = rng.uniform(1e-5, 8e-5 if fmt == "Q6_K" else 3e-4, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _quantizer(case: dict[str, str], seed: int):
    rng = np.random.default_rng(seed)

    def quant(name: str, data: np.ndarray):
        if data.ndim != 2:
            return None  # norms stay fp32
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        fmt = case.get(kind, case["*"])
        if fmt in SIMPLE:
            return gguf.quants.quantize(data.astype(np.float32), Q[fmt]), Q[fmt]
        return _k_blocks(fmt, data.shape[0], data.shape[1], rng), Q[fmt]

    return quant


@pytest.fixture(scope="module", params=list(CASES))
def model_file(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder / "hf", "llama-default", **SIZES)
    path = folder / f"{request.param}.gguf"
    write_gguf(path, hf, quant=_quantizer(CASES[request.param], seed=len(request.param)))
    write_char_tokenizer(loader.cache_dir_for(path) / "tokenizer")  # (a tiny GGUF carries no tokenizer)
    return str(path)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **{"block_size": 16, "max_num_batched_tokens": 64, "kv_cache_gb": 0.05, **kw})


def _run(path: str, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    with _llm(path, lookahead=False, **kw) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        return out.outputs[0].token_ids, out.prompt_logprobs, llm.engine


@pytest.fixture(scope="module")
def float_reference(model_file):
    tokens, logprobs, engine = _run(model_file, gguf_weights="float")
    assert engine.cpu_matmul == "kernel"
    return tokens, logprobs


def test_blocks_equal_the_float_expansion(model_file, float_reference):
    tokens, logprobs, engine = _run(model_file)  # gguf_weights='auto': blocks here
    assert engine.cpu_matmul == "blocks"
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight, BlockMatrix) and m.weight_t is None for m in linears)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert not any(p.dim() == 2 for p in model.parameters())  # no float matrix anywhere
    expected_tokens, expected = float_reference
    assert tokens == expected_tokens
    worst = max(abs(logprobs[p][PROMPT[p]] - expected[p][PROMPT[p]]) for p in range(1, len(PROMPT)))
    print(f"worst prompt log-prob difference {worst:.2e}")
    assert worst < 1e-4  # the families' bar against HF (measured here: 0 to 1.2e-5, float32 sums in another order)


def test_matrices_are_views_of_the_file(model_file):
    """Every part's bytes lie in the GGUF's memory map, a Llama's permuted q/k rows too (read
    as stored, their outputs put in order): the load copies no matrix."""
    model = loader.load_blocks_model(model_file)
    mapped = [(lo, hi) for lo, hi in _mapped_ranges(model_file)]
    assert mapped
    inside = outside = 0
    for module in model.modules():
        if isinstance(module, Linear):
            for data, _ in module.weight.parts:
                hit = any(lo <= data.data_ptr() < hi for lo, hi in mapped)
                inside, outside = inside + hit, outside + (not hit)
    layers = model.config.num_hidden_layers
    assert outside == 0
    assert inside == 7 * layers + (0 if model.config.tie_word_embeddings else 1)  # q, k, v, o, gate, up, down (+ head)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    heads, kv_heads, d = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    q_order = rope.unpermute_rope_rows(torch.arange(heads * d), heads)
    k_order = heads * d + rope.unpermute_rope_rows(torch.arange(kv_heads * d), kv_heads)
    v_order = torch.arange((heads + kv_heads) * d, (heads + 2 * kv_heads) * d)
    assert torch.equal(qkv.order, torch.cat([q_order, k_order, v_order]))
    assert model.layers[0].mlp.gate_up_proj.weight.order is None


@pytest.mark.parametrize("fast", [0, 1])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_row_order_puts_outputs_in_order(fast, rows):
    """A ``BlockMatrix`` with an ``order`` gives what its rows moved into that order give: decode
    and verification steps (the block kernel, the norm prologue, bias and residual in the call)
    and prefill steps (dequantized slices), exact and integer numerics."""
    from longctx.model.linear import BLOCK_METHODS
    from longctx.model.llama import RMSNorm
    from longctx.model.quantize import quantize_blocks

    g = torch.Generator().manual_seed(rows + 7 * fast)
    n, k = 96, 64
    data = quantize_blocks(torch.randn(n, k, generator=g), "int8")
    order = torch.randperm(n, generator=g)
    moved, ordered = Linear(k, n, bias=True), Linear(k, n, bias=True)
    moved.weight, ordered.weight = BlockMatrix([(data[order].contiguous(), 8)], k), BlockMatrix([(data, 8)], k, order)
    for layer in (moved, ordered):
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
        layer.hold(BLOCK_METHODS[fast])
    ordered.bias.copy_(moved.bias)
    norm = RMSNorm(k, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    x, residual = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    for kw in ({}, {"residual": residual}, {"norm": norm, "residual": residual}):
        want, got = moved(x, **kw), ordered(x, **kw)
        assert torch.equal(got, want), kw
    assert not torch.equal(ordered(x), Linear.forward(_unordered(ordered), x))  # the order is not a no-op


def _unordered(layer: Linear) -> Linear:
    out = Linear(layer.weight.k, layer.weight.shape[0], bias=True)
    out.weight, out.bias = layer.weight.stored(), layer.bias
    out.hold(layer.method)
    return out


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("split, way", [((136, 136), "kernel"), ((50, 150, 72), "kernel"), ((272,), "kernel"),
                                        ((136, 136), "blas")])  # (BLAS: where gate and up are parts of their own)
def test_gated_mlp_is_the_whole_products_swiglu(monkeypatch, act, split, way):
    """A long step's gate/up product made a slice of F at a time (``BlockWeights.gated``) gives
    act(gate) * up bit for bit as the whole [T, 2F] product and the prologue do: parts split at
    F, parts that slices cross, one fused part; with a bias and the norm; several slices; F and
    the rows not multiples of torch's vector width (its vector and scalar silu / gelu differ in
    the last bit, so the slices must hand each element to the same code); the row kernel's
    products and BLAS's; one thread and two."""
    from longctx.model import linear
    from longctx.model.linear import BlockWeights
    from longctx.model.llama import RMSNorm
    from longctx.model.quantize import quantize_blocks

    monkeypatch.setattr(linear, "SLICE_BYTES", 4 * 64 * 64)  # slices of 64 rows: 64, 64, 8 of F = 136
    g = torch.Generator().manual_seed(len(split) + 7 * (way == "blas"))
    k, f = 64, 136
    data = quantize_blocks(torch.randn(2 * f, k, generator=g), "int8")
    four = quantize_blocks(torch.randn(2 * f, k, generator=g), "int4")
    parts, lo = [], 0
    for i, n in enumerate(split):  # formats alternate between the parts
        parts.append(((data if i % 2 == 0 else four)[lo:lo + n].contiguous(), 8 if i % 2 == 0 else 3))
        lo += n
    layer = Linear(k, 2 * f, bias=True)
    layer.weight = BlockMatrix(parts, k)
    layer.bias = torch.nn.Parameter(torch.randn(2 * f, generator=g), requires_grad=False)
    layer.hold(BlockWeights(blas_from_rows=17 if way == "blas" else linear.cpu_linear.UNBOUNDED))
    norm = RMSNorm(k, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    fn = torch.nn.functional
    threads = torch.get_num_threads()
    try:
        for n_threads, rows in ((1, 41), (threads, 41), (threads, 300)):
            torch.set_num_threads(n_threads)
            x = torch.randn(rows, k, generator=g)
            whole = layer(x, norm=norm)  # [T, 2F], then the prologue the down product would run
            gate, up = whole.split(f, dim=-1)  # (silu: the prologue's SwiGLU, C's where it runs)
            want = (layer.method.prologue(whole, None, True) if act == "silu"
                    else fn.gelu(gate, approximate="tanh").mul_(up))
            got = layer.method.gated(layer, x, norm, act)
            assert got.shape == (rows, f) and torch.equal(got, want), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)
    assert layer.method.gated(layer, x[:16], norm, act) is None  # decode rows: the fused block kernel
    with pytest.raises(ValueError, match="act must be"):
        layer.method.gated(layer, x, norm, "relu")


def test_row_order_must_be_a_permutation():
    from longctx.model.quantize import quantize_blocks

    data = quantize_blocks(torch.randn(8, 32), "int8")
    for bad in (torch.arange(7), torch.zeros(8, dtype=torch.int64), torch.arange(8).int()):
        with pytest.raises(ValueError, match="permutation of its 8 rows"):
            BlockMatrix([(data, 8)], 32, bad)


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    import os

    real = os.path.realpath(path)
    out = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == real:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def test_lookahead_prefix_hit_int8_pages_keep_the_tokens(model_file, float_reference):
    expected_tokens, _ = float_reference
    follow = PROMPT[:80] + random_tokens(12, seed=22)
    with _llm(model_file, gguf_weights="float", lookahead=False) as ref:
        expected_follow = ref.generate({"prompt_token_ids": follow}, GREEDY)[0].outputs[0].token_ids
        expected_int8 = None
    with _llm(model_file, lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == expected_tokens
        assert llm.generate({"prompt_token_ids": follow}, GREEDY)[0].outputs[0].token_ids == expected_follow
        assert llm.cache_stats().hit_tokens["device"] >= 80
    with _llm(model_file, gguf_weights="float", kv_cache_dtype="int8", lookahead=False) as ref:
        expected_int8 = ref.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    with _llm(model_file, kv_cache_dtype="int8", lookahead=False) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == expected_int8


@pytest.mark.parametrize("model_file", [case if case in FORMATS_DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                        for case in CASES], indirect=True)
def test_two_sequence_parallel_ranks_keep_the_tokens(model_file, float_reference):
    expected_tokens, _ = float_reference
    with _llm(model_file, sequence_parallel_size=2, lookahead=False) as llm:
        assert llm.engine.cpu_matmul == "blocks"
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == expected_tokens


@pytest.mark.parametrize("model_file", [case if case in FORMATS_DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                        for case in CASES], indirect=True)
def test_prefill_chunks_on_blas_keep_the_tokens(model_file, float_reference, monkeypatch):
    """LONGCTX_CPU_TUNE as a row count (what kernels/cpu_tune.py may measure on a machine whose
    BLAS is faster at prefill's rows): the 100-token prompt's one chunk multiplies the
    dequantized slices through BLAS, decode stays on the block kernel; the float expansion's
    tokens and log-probs in one process, its tokens on two sequence-parallel ranks."""
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "65")
    expected_tokens, expected = float_reference
    for sp in (1, 2):
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                prompt_logprobs=1 if sp == 1 else None)  # (SP gives no prompt log-probs)
        with _llm(model_file, max_num_batched_tokens=128, sequence_parallel_size=sp, lookahead=False) as llm:
            assert llm.engine.cpu_matmul == "blocks"
            methods = {m.method for m in llm.engine.model.modules() if isinstance(m, Linear)}
            assert {m.blas_from_rows for m in methods} == {65}
            out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        assert out.outputs[0].token_ids == expected_tokens
        if sp == 1:
            worst = max(abs(out.prompt_logprobs[p][PROMPT[p]] - expected[p][PROMPT[p]])
                        for p in range(1, len(PROMPT)))
            assert worst < 1e-4, worst


@pytest.mark.parametrize("model_file", [case if case in FORMATS_DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                        for case in CASES], indirect=True)
def test_integer_numerics_work_with_lookahead_prefix_hits_int8_pages_and_ranks(model_file):
    """fast inside the other modes: lookahead's verification steps (several rows a product), a
    prefix hit, int8 pages and two sequence-parallel ranks give the tokens the same numerics
    give alone (each row of a product is computed as a one-row step's)."""
    _integer_numerics_with_the_other_modes(model_file, "fast")


# (every argument indirect, so model_file keeps its module scope: one file per format)
@pytest.mark.parametrize("model_file", [case if case in FORMATS_DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                        for case in CASES], indirect=True)
def test_two_term_numerics_work_with_lookahead_prefix_hits_int8_pages_and_ranks(model_file):
    """The same for fast2 (two int8 terms), on the default model's mix and the K formats; on the
    others under -m slow."""
    _integer_numerics_with_the_other_modes(model_file, "fast2")


def _integer_numerics_with_the_other_modes(model_file, numerics: str) -> None:
    follow = PROMPT[:80] + random_tokens(12, seed=22)
    with _llm(model_file, block_numerics=numerics, lookahead=False) as llm:
        alone = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in (PROMPT, follow)]
    with _llm(model_file, block_numerics=numerics, lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == alone[0]
        assert llm.generate({"prompt_token_ids": follow}, GREEDY)[0].outputs[0].token_ids == alone[1]
        assert llm.cache_stats().hit_tokens["device"] >= 80
    with _llm(model_file, block_numerics=numerics, kv_cache_dtype="int8", lookahead=False) as llm:
        int8_pages = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids
    with _llm(model_file, block_numerics=numerics, kv_cache_dtype="int8", lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == int8_pages
    with _llm(model_file, block_numerics=numerics, sequence_parallel_size=2, lookahead=False) as llm:
        assert all(m.method.fast == BLOCK_TERMS[numerics] for m in llm.engine.model.modules() if isinstance(m, Linear))
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == alone[0]


needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason=f"AMX kernel {cpu_amx.status()}")


def _tile_layer(split, k: int, seed: int, tiles: bool = True, bf16_panels: bool = False):
    """A Linear over int8 and int4 parts (alternating, ``split`` rows each) with a bias, held by
    BlockWeights with or without the AMX tiles (or the row kernel's bfloat16 panels); and its
    float32 weights (the dequantized parts)."""
    from longctx.kernels import cpu_blocks
    from longctx.model.linear import BlockWeights
    from longctx.model.quantize import quantize_blocks

    g = torch.Generator().manual_seed(seed)
    n = sum(split)
    data = quantize_blocks(torch.randn(n, k, generator=g), "int8")
    four = quantize_blocks(torch.randn(n, k, generator=g), "int4")
    parts, lo = [], 0
    for i, rows in enumerate(split):
        parts.append(((data if i % 2 == 0 else four)[lo:lo + rows].contiguous(), 8 if i % 2 == 0 else 3))
        lo += rows
    layer = Linear(k, n, bias=True)
    layer.weight = BlockMatrix(parts, k)
    layer.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    layer.hold(BlockWeights(tiles=tiles, bf16_panels=bf16_panels))
    w = torch.cat([cpu_blocks.dequantize(d, f, k) for d, f in parts])
    return layer, w, g


def _near_the_rounded_product(got, x, w, bias, res) -> None:
    """got within float32 rounding (2e-6 of the largest product) of the float64 product of x and
    w rounded to bfloat16, + bias + res, and not the float32 numbers (x and w were rounded)."""
    rounded = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()
    want = rounded + bias.double() + res.double()
    err = float((got.double() - want).abs().max() / rounded.abs().max())
    assert err < 2e-6, (x.shape[0], err)
    exact = x.double() @ w.double().t() + bias.double() + res.double()
    assert (got.double() - exact).abs().max() > 1e-4


@needs_amx
@pytest.mark.parametrize("split", [(48, 96, 16), (64, 40)])
def test_bf16_tiles_match_float64_on_the_rounded_numbers(monkeypatch, split):
    """A bfloat16 model's long steps over blocks (``BlockWeights.tiles``): slices of each part
    dequantized to bfloat16 and multiplied on the AMX tiles, across slice and part boundaries,
    with the bias and residual: within float32 rounding of the float64 product of x and the
    weights rounded to bfloat16 (the AMX kernel's own bar). A part whose rows are not a multiple
    of 16 (40) sends the matrix to the float32 slices (exact numerics). Steps of up to 16 rows
    are the block kernel's, the same bits as without the tiles."""
    from longctx.model import linear

    monkeypatch.setattr(linear, "SLICE_BYTES", 4 * 64 * 64)  # slices of 64 rows (the least): 48+16 | 64 | 16 | 16
    k = 64
    layer, w, g = _tile_layer(split, k, seed=sum(split))
    plain, _, _ = _tile_layer(split, k, seed=sum(split), tiles=False)
    on_tiles = all(r % 16 == 0 for r in split)
    assert layer.method._on_tiles(layer.weight) == on_tiles
    for rows in (17, 41, 300):
        x = torch.randn(rows, k, generator=g)
        res = torch.randn(rows, sum(split), generator=g)
        got = layer(x, residual=res)
        assert got.shape == (rows, sum(split)) and got.dtype == torch.float32
        if on_tiles:
            _near_the_rounded_product(got, x, w, layer.bias, res)
        else:
            assert torch.equal(got, plain(x, residual=res))
    x = torch.randn(16, k, generator=g)
    assert torch.equal(layer(x), plain(x))


def _rounds_rows() -> bool:
    from longctx.kernels import cpu_linear

    return cpu_linear.available() and cpu_linear.rounds_bf16_rows() > 0


@pytest.mark.skipif(not _rounds_rows(), reason="the row kernel does not round x to bfloat16 here (no vdpbf16ps)")
@pytest.mark.parametrize("split", [(48, 96, 16), (64, 40)])
def test_bf16_panels_match_float64_on_the_rounded_numbers(monkeypatch, split):
    """A bfloat16 model's long steps over blocks without AMX (``BlockWeights.bf16_panels``):
    slices of each part dequantized to bfloat16 and multiplied by the row kernel's vdpbf16ps
    panels, across slice and part boundaries (any part's rows), with the bias and residual:
    within float32 rounding of the float64 product of x and the weights rounded to bfloat16,
    never BLAS (a BLAS row count of 1 is ignored); gate/up a slice of F at a time give the bits
    of the whole product's activation; steps of up to 16 rows are the block kernel's, the same
    bits as the float32 slices'."""
    from longctx.model import linear
    from longctx.model.llama import RMSNorm

    monkeypatch.setattr(linear, "SLICE_BYTES", 4 * 64 * 64)  # slices of 64 rows (the least): 48+16 | 64 | 16 | 16
    k = 64
    layer, w, g = _tile_layer(split, k, seed=sum(split), tiles=False, bf16_panels=True)
    layer.method.blas_from_rows = 1
    plain, _, _ = _tile_layer(split, k, seed=sum(split), tiles=False)
    for rows in (17, 41, 300):
        x = torch.randn(rows, k, generator=g)
        res = torch.randn(rows, sum(split), generator=g)
        got = layer(x, residual=res)
        assert got.shape == (rows, sum(split)) and got.dtype == torch.float32
        _near_the_rounded_product(got, x, w, layer.bias, res)
    x = torch.randn(16, k, generator=g)
    assert torch.equal(layer(x), plain(x))
    norm = RMSNorm(k, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    if len(split) == 3:  # F = 80: slices 64 | 16
        for rows in (17, 300):
            x = torch.randn(rows, k, generator=g)
            whole = layer(x, norm=norm)
            assert torch.equal(layer.method.gated(layer, x, norm, "silu"), layer.method.prologue(whole, None, True))


@needs_amx
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("split", [(144, 144), (48, 176, 64), (64, 128, 64)])
def test_gated_mlp_on_tiles_is_the_whole_products_swiglu(monkeypatch, act, split):
    """gate/up on the tiles, a slice of F at a time, gives the bits of the whole product's
    activation (each output column's sums do not depend on the slice it is in). For a down
    projection on the tiles (``rounded=True``, F a multiple of 32) it hands over the rounded
    rows instead: ``cpu_amx.round_gated`` of the whole product's halves, bit for bit, which the
    down projection takes as it takes x rounded (F = 144: the float32 rows as before)."""
    from longctx.kernels import cpu_amx
    from longctx.model import linear
    from longctx.model.llama import RMSNorm

    monkeypatch.setattr(linear, "SLICE_BYTES", 4 * 64 * 64)  # slices of 64 rows: 64, 64, 16 of F = 144
    k, f = 64, sum(split) // 2
    layer, _, g = _tile_layer(split, k, seed=len(split))
    norm = RMSNorm(k, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    fn = torch.nn.functional
    for rows in (17, 41, 300):
        x = torch.randn(rows, k, generator=g)
        whole = layer(x, norm=norm)
        gate, up = whole.split(f, dim=-1)  # (silu: the prologue's SwiGLU, C's where it runs)
        want = (layer.method.prologue(whole, None, True) if act == "silu"
                else fn.gelu(gate, approximate="tanh").mul_(up))
        got = layer.method.gated(layer, x, norm, act)
        assert got.shape == (rows, f) and torch.equal(got, want), rows
        handed = layer.method.gated(layer, x, norm, act, rounded=True)
        if f % 32:
            assert torch.equal(handed, want)
            continue
        assert isinstance(handed, linear.RoundedRows) and handed.rows == rows
        assert torch.equal(handed.xb, cpu_amx.round_gated(gate, up, act))
        down, _, _ = _tile_layer((32, 32), f, seed=rows)
        assert down.method.takes_rounded(down, rows)
        mp = handed.xb.shape[0]  # the rounded rows back in row order, as float32 (bfloat16 values: rounding keeps them)
        as_rows = handed.xb.view(mp // 16, f // 32, 16, 32).permute(0, 2, 1, 3).reshape(mp, f)[:rows].float()
        res = torch.randn(rows, 64, generator=g)
        assert torch.equal(down(handed, residual=res), down(as_rows, residual=res))
        with pytest.raises(ValueError, match="rounded rows are for a long step"):
            down(handed, swiglu=True)


@pytest.mark.parametrize("model_file", [case if case in FORMATS_DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                        for case in CASES], indirect=True)
def test_bfloat16_blocks_work_with_lookahead_prefix_hits_int8_pages_and_ranks(model_file, float_reference):
    """dtype='bfloat16' over the blocks: prefill chunks on the AMX tiles where the CPU has them,
    else on the row kernel's bfloat16 panels where it rounds x (elsewhere the float32 slices),
    bfloat16 KV pages by default; prompt log-probs near float32's
    (x and the weights rounded to bfloat16 in the long steps, K and V in the pages), and inside
    the other modes the tokens it gives alone: lookahead, a prefix hit whose 30 new rows are a
    long step again, two sequence-parallel ranks; int8 pages with lookahead up to a near tie."""
    from longctx.kernels import cpu_amx
    from longctx.model.linear import BlockWeights

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    follow = PROMPT[:80] + random_tokens(30, seed=23)
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=False) as llm:
        methods = {m.method for m in llm.engine.model.modules() if isinstance(m, Linear)}
        assert all(isinstance(m, BlockWeights) and m.tiles == cpu_amx.available()
                   and m.bf16_panels == (not cpu_amx.available() and _rounds_rows()) for m in methods)
        assert llm.engine.kv_format.dtype == torch.bfloat16
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        alone = [out.outputs[0].token_ids, llm.generate({"prompt_token_ids": follow}, GREEDY)[0].outputs[0].token_ids]
    _, expected = float_reference
    worst = max(abs(out.prompt_logprobs[p][PROMPT[p]] - expected[p][PROMPT[p]]) for p in range(1, len(PROMPT)))
    print(f"worst prompt log-prob difference against float32's {worst:.2e}")
    # measured 0.003-0.006 on four of the files; on q4_k_m's, 0.034 while the flash kernel kept
    # float32 q in its first and diagonal key tiles (every tile of this short prompt) and 0.106
    # with q rounded to bfloat16 in every tile, as bf16 engines score (2026-12-06, Intel Xeon)
    assert worst < (0.15 if Path(model_file).stem == "q4_k_m" else 0.05)
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=True) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == alone[0]
        assert llm.generate({"prompt_token_ids": follow}, GREEDY)[0].outputs[0].token_ids == alone[1]
        assert llm.cache_stats().hit_tokens["device"] >= 80
    # int8 pages: lookahead's verification reads a page's values before and after its rounding
    # at other steps than plain decode does (log-probs move by 4e-4 to 3e-3 here, with float32
    # blocks too): the two runs' log-probs agree within 1e-2 while their tokens do, and part only
    # at a near tie
    tied = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = []
    for la in (False, True):
        with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", kv_cache_dtype="int8", lookahead=la) as llm:
            runs.append(llm.generate({"prompt_token_ids": PROMPT}, tied)[0].outputs[0])
    plain, ahead = runs
    parted = next((i for i, (a, b) in enumerate(zip(plain.token_ids, ahead.token_ids)) if a != b), NEW_TOKENS)
    for i in range(parted):
        tok = plain.token_ids[i]
        assert abs(plain.logprobs[i][tok] - ahead.logprobs[i][tok]) < 1e-2, i
    if parted < NEW_TOKENS:
        top = sorted(plain.logprobs[parted].values())[-2:]
        assert top[1] - top[0] < 1e-2, (parted, plain.logprobs[parted])
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", sequence_parallel_size=2, lookahead=False) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids == alone[0]


@needs_amx
@pytest.mark.parametrize("model_file", ["q4_k_m"], indirect=True)
def test_a_model_whose_blocks_all_take_the_tiles_measures_nothing(model_file, monkeypatch):
    """bfloat16 over blocks that all take the AMX tiles: no float32 slice is multiplied, so the
    BLAS tuning (a first load's measurement) is not run; float32 over the same file measures its
    slices' products bare (way "slices"), and only those."""
    from longctx.kernels import cpu_tune
    from longctx.model.linear import all_on_tiles

    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_MEMO", {})
    monkeypatch.setattr(cpu_tune, "_read", lambda path: {})  # nothing cached,
    monkeypatch.setattr(cpu_tune, "_write", lambda path, data: None)  # nothing kept
    measured = []
    monkeypatch.setattr(cpu_tune, "measure", lambda shapes, threads, way="blas": measured.append(way) or
                        {"rows": {}, "blas_from_rows": None})
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=False) as llm:
        assert all_on_tiles(llm.engine.model)
    assert measured == []
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "fastest")  # nothing measured, still refused
    with pytest.raises(ConfigError, match="LONGCTX_CPU_TUNE"):
        _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=False)
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    with _llm(model_file, gguf_weights="blocks", lookahead=False) as llm:
        assert not all_on_tiles(llm.engine.model)
    assert measured == ["slices"]  # (the blocks model has no float32 row-kernel matrix: nothing else)


@pytest.mark.skipif(cpu_amx.available() or not _rounds_rows(), reason="needs the bfloat16 panels without AMX")
def test_a_model_whose_blocks_all_take_the_panels_measures_nothing(model_file, monkeypatch):
    """bfloat16 over blocks on the row kernel's bfloat16 panels (no AMX): no float32 slice is
    multiplied, so the BLAS tuning is not run (float32 over the same file: its slices measured)."""
    from longctx.kernels import cpu_tune
    from longctx.model.linear import BlockWeights

    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_MEMO", {})
    monkeypatch.setattr(cpu_tune, "_read", lambda path: {})
    monkeypatch.setattr(cpu_tune, "_write", lambda path, data: None)
    measured = []
    monkeypatch.setattr(cpu_tune, "measure", lambda shapes, threads, way="blas": measured.append(way) or
                        {"rows": {}, "blas_from_rows": None})
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=False) as llm:
        assert all(isinstance(m.method, BlockWeights) and m.method.bf16_panels
                   for m in llm.engine.model.modules() if isinstance(m, Linear))
    assert measured == []
    with _llm(model_file, gguf_weights="blocks", lookahead=False):
        pass
    assert measured == ["slices"]


@pytest.fixture
def widened():
    """The row kernel's bfloat16 products widened to float32 for the test (x stays float32), as a
    process whose measurement chose widening runs them; its way put back after."""
    from longctx.kernels import cpu_linear

    lib = cpu_linear._load()
    if lib is None:
        pytest.skip(f"the row kernel is {cpu_linear.status()}")
    was = lib.longctx_linear_bf16_panels()
    lib.longctx_linear_set_bf16_dot(0)
    yield
    lib.longctx_linear_set_bf16_dot(was)


def test_bf16_slices_stay_float32_where_the_row_kernel_widens(model_file, widened, monkeypatch):
    """Where this process widens bfloat16 products (x float32), a bfloat16 model's blocks keep
    float32 slices: ``use_bf16_slices`` takes no panels, and a method handed ``bf16_panels`` (a
    sequence-parallel rank's, chosen by rank 0) gives the float32 slices' bits."""
    from longctx.model import linear

    monkeypatch.setattr(linear, "SLICE_BYTES", 4 * 64 * 64)
    with _llm(model_file, gguf_weights="blocks", dtype="bfloat16", lookahead=False) as llm:
        assert not any(m.method.bf16_panels for m in llm.engine.model.modules() if isinstance(m, Linear))
    layer, _, g = _tile_layer((48, 96, 16), 64, seed=5, tiles=False, bf16_panels=True)
    plain, _, _ = _tile_layer((48, 96, 16), 64, seed=5, tiles=False)
    for rows in (17, 300):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(layer(x), plain(x))


def test_bfloat16_keeps_a_quantized_files_blocks_by_default(model_file, monkeypatch):
    """gguf_weights='auto' under dtype='bfloat16': a file whose matrices take fewer bytes as
    stored than as bfloat16 keeps its blocks, with or without AMX (its prefill slices then on the
    tiles, the row kernel's bfloat16 panels or float32); one of F16/BF16 matrices (no smaller) is
    expanded to bf16 weights on the row kernel."""
    from longctx.model.prepare import narrower_than_bf16

    quantized = not model_file.endswith("f16-bf16.gguf")
    assert narrower_than_bf16(model_file) == quantized
    with _llm(model_file, dtype="bfloat16", lookahead=False) as llm:
        assert llm.engine.cpu_matmul == ("blocks" if quantized else "kernel")
    monkeypatch.setattr(cpu_amx, "available", lambda: False)  # a CPU without AMX: the same choice
    with _llm(model_file, dtype="bfloat16", lookahead=False) as llm:
        assert llm.engine.cpu_matmul == ("blocks" if quantized else "kernel")
        if quantized:  # (the row kernel's bfloat16 panels where it rounds x here, else float32 slices)
            assert all(not m.method.tiles and m.method.bf16_panels == _rounds_rows()
                       for m in llm.engine.model.modules() if isinstance(m, Linear))


def test_blocks_refused_where_they_cannot_serve(tmp_path):
    hf_folder = tmp_path / "hf"
    make_checkpoint(hf_folder, "llama-default")
    write_char_tokenizer(hf_folder)
    with pytest.raises(ConfigError, match="gguf_weights='blocks' is for .gguf models"):
        LLM(str(hf_folder), gguf_weights="blocks")
    with pytest.raises(ConfigError, match="computes in float32 or bfloat16"):
        LLM(str(hf_folder), gguf_weights="blocks", dtype="float16")
    with pytest.raises(ConfigError, match="gguf_weights must be one of"):
        LLM(str(hf_folder), gguf_weights="int4")


def test_fast_numerics_take_the_integer_products(model_file):
    """block_numerics='fast': prefill stays exact (the first token and the prompt log-probs are
    exact's), decode steps run on int8-rounded activations: the second token's log-probs move
    by x's rounding, a little and not nothing. 'fast2' (x as two int8 terms): the same, moved
    much less."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    outs = {}
    for numerics, terms in BLOCK_TERMS.items():
        with _llm(model_file, lookahead=False, block_numerics=numerics) as llm:
            assert all(m.method.fast == terms for m in llm.engine.model.modules() if isinstance(m, Linear))
            outs[numerics] = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    from longctx.kernels import cpu_blocks

    has_integer = any(cpu_blocks.fast_supported(f) for m in loader.load_blocks_model(model_file).modules()
                      if isinstance(m, Linear) for f in m.weight.codes)
    exact, moved = outs["exact"], {}
    for numerics in ("fast", "fast2"):
        fast = outs[numerics]
        assert fast.prompt_logprobs == exact.prompt_logprobs
        assert fast.outputs[0].token_ids[0] == exact.outputs[0].token_ids[0]
        second = exact.outputs[0].logprobs[1]
        common = [t for t in second if t in fast.outputs[0].logprobs[1]]
        diffs = [abs(fast.outputs[0].logprobs[1][t] - second[t]) for t in common]
        assert common and max(diffs) < 0.1, diffs
        assert (max(diffs) > 0) == has_integer, diffs  # F16/BF16 files have no integer products: exact's numbers
        moved[numerics] = max(diffs)
    if has_integer:
        assert moved["fast2"] * 10 < moved["fast"], moved  # F16/BF16 files have no integer products: exact's numbers


def test_blocks_rotate_q_and_k_in_place(model_file):
    """A block layer's q/k/v output is a fresh float32 tensor: RoPE turns q and k in it in place
    (the row kernel's ``rope_``, the same arithmetic as ``apply_rotary`` bit for bit), so q, k
    and v reach attention as one buffer's consecutive heads (what lets int8 pages' rotation
    take them in one product)."""
    from longctx.model.rope import apply_rotary

    model = loader.load_blocks_model(model_file)
    attn = model.layers[0].self_attn
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([4, 5, 6])
    cos, sin = model.rotary_for(torch.device("cpu")).cos_sin(positions)
    qkv = attn.qkv_proj(x)
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    # a Llama file: q and k come as llama.cpp stores them, RoPE reads the pairs and puts them in order
    assert attn.rope_pairs and attn.qkv_proj.rows_as_stored
    in_order = qkv.index_select(1, attn.qkv_proj.weight.order)
    assert torch.equal(in_order, Linear.forward(_unordered(attn.qkv_proj), x)[:, attn.qkv_proj.weight.order])
    want = apply_rotary(in_order[:, :(h + hkv) * d].reshape(3, h + hkv, d).clone(), cos, sin)
    seen = {}

    class Capture:
        def run(self, layer_idx, q, k, v, plan, **options):
            seen.update(q=q, k=k, v=v)
            return q

    attn.attend(qkv, cos, sin, Capture(), None)
    q, k, v = seen["q"], seen["k"], seen["v"]
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == q.data_ptr() + 4 * h * d
    assert v.data_ptr() == k.data_ptr() + 4 * hkv * d
    assert torch.equal(torch.cat([q, k], 1), want)
    assert torch.equal(v.reshape(3, hkv * d), in_order[:, (h + hkv) * d:])
    attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(qkv.shape[1]), requires_grad=False)
    for rows in (3, 40):  # (a bias would be in order, the outputs not: refused on short and long steps)
        with pytest.raises(ValueError, match="takes no bias"):
            attn.qkv_proj(torch.randn(rows, model.config.hidden_size))

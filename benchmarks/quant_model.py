"""The 1B- and 8B-shaped models of bench_quant.py, random weights (normal, std 0.02, numpy
seed 0) in the layers of Llama-3.2-1B (hidden 2,048, 16 layers, 32 query / 8 KV heads of 64,
MLP 8,192, tied embedding) and Llama-3.1-8B (hidden 4,096, 32 layers, 32 / 8 heads of 128, MLP
14,336, its own LM head), RoPE base 500,000, with the default model's tokenizer (so its
vocabulary, 49,152, not Llama 3's 128,256: both engines need a tokenizer the file carries).
The 1B model is written as an F32 GGUF, the 8B as F16 (F32 would be ~30 GB of disk and of
writing), each tensor made and written one at a time (``GGUFWriter`` told every tensor's
shape first, then given their data in turn: never the model whole in memory), then quantized
to Q8_0 and Q4_K_M by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``,
llama-cpp-python built from source: a benchmark extra, never a test dependency). Files go to
``$LONGCTX_CACHE_DIR/bench-<size>/`` (default ``~/.cache/longctx``) and are reused.

Usage: python benchmarks/quant_model.py [1b|8b]   (prints the paths; bench_quant.py calls it)
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192, theta=500000.0, ctx=131072,
               tied=True, source="f32"),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336, theta=500000.0, ctx=131072,
               tied=False, source="f16"),
}
FTYPES = {"q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_K_M


def folder(size: str = "1b") -> Path:
    from longctx.settings import cache_dir

    return cache_dir() / f"bench-{size}"


def write_source(path: Path, size: str = "1b") -> None:
    """The ``size`` model's unquantized GGUF (F32 for 1b, F16 for 8b), a tensor at a time."""
    import gguf

    from longctx.model.loader import resolve_model

    src = gguf.GGUFReader(str(resolve_model("smollm2-135m")))
    s = SHAPES[size]
    dtype = np.float32 if s["source"] == "f32" else np.float16
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_suffix(".tmp")  # written under a temporary name, renamed when whole
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random {size.upper()}-shaped (Llama-3 layers)")
    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["mlp"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["head_dim"])
    w.add_vocab_size(vocab)
    w.add_file_type(0 if s["source"] == "f32" else 1)  # LLAMA_FTYPE_ALL_F32 / MOSTLY_F16
    f = src.fields
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list(f["tokenizer.ggml.tokens"].contents())
    w.add_token_types(f["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"].contents())
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"].contents())
    w.add_add_bos_token(False)
    rng = np.random.default_rng(0)
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    tensors = [("token_embd.weight", (vocab, h))]  # (name, shape): every tensor in file order
    for i in range(s["layers"]):
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.attn_q.weight", (q, h)), (f"blk.{i}.attn_k.weight", (kv, h)),
                    (f"blk.{i}.attn_v.weight", (kv, h)), (f"blk.{i}.attn_output.weight", (h, q)),
                    (f"blk.{i}.ffn_gate.weight", (s["mlp"], h)), (f"blk.{i}.ffn_up.weight", (s["mlp"], h)),
                    (f"blk.{i}.ffn_down.weight", (h, s["mlp"]))]
    tensors.append(("output_norm.weight", (h,)))
    if not s["tied"]:
        tensors.append(("output.weight", (vocab, h)))

    def data(shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 1:  # norms: float32 in every GGUF
            return np.ones(shape, dtype=np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    for name, shape in tensors:
        kind = np.dtype(np.float32 if len(shape) == 1 else dtype)
        w.add_tensor_info(name, shape, kind, int(np.prod(shape)) * kind.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in tensors:  # made and written one at a time, in the order of their infos
        w.write_tensor_data(data(shape))
    w.close()
    tmp.replace(path)


def quantize(src: Path, dst: Path, kind: str, threads: int = 2) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed ({rc})")
    tmp.replace(dst)


def ensure(kinds: tuple[str, ...] = tuple(FTYPES), size: str = "1b") -> dict[str, Path]:
    """{'f32' (or 'f16' for 8b): the source, and each of ``kinds`` ('q8_0', 'q4_k_m')}, built
    where missing (the source only where a kind asked for is missing, or none is asked for: it
    may be deleted once its quantized files exist). Only the quantized kinds need
    llama-cpp-python: ``ensure(())`` writes the source alone."""
    unknown = [k for k in kinds if k not in FTYPES]
    if unknown or size not in SHAPES:
        raise ValueError(f"unknown kinds {unknown} or size {size!r}; choose from {sorted(FTYPES)} and {sorted(SHAPES)}")
    out = folder(size)
    out.mkdir(parents=True, exist_ok=True)
    source = SHAPES[size]["source"]
    paths = {source: out / f"random-{size}-{source}.gguf", **{k: out / f"random-{size}-{k}.gguf" for k in kinds}}
    if not paths[source].exists() and (not kinds or not all(paths[k].exists() for k in kinds)):
        write_source(paths[source], size)  # (not when every file asked for is there: the 8B source is 15 GB)
    for kind in kinds:
        if not paths[kind].exists():
            quantize(paths[source], paths[kind], kind)
    return paths


if __name__ == "__main__":
    for name, p in ensure(size=sys.argv[1] if len(sys.argv) > 1 else "1b").items():
        print(name, p, f"{p.stat().st_size / 2**30:.2f} GiB")

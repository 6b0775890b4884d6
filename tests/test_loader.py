"""Model resolution, the converted-weights cache, and the install layout."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from longctx.model import loader
from tiny_models import make_checkpoint, write_gguf


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


def test_unknown_model_name_gives_clear_error():
    with pytest.raises(loader.ModelNotFoundError, match="not found: give an alias"):
        loader.resolve_model("/no/such/model")


def test_kernels_installs_only_under_longctx(tmp_path):
    """``longctx.kernels`` imports; a top-level ``kernels`` must not (it belongs to a PyPI package)."""
    code = ("import importlib.util, longctx.kernels, longctx.parallel\n"
            "print(importlib.util.find_spec('kernels') is None, importlib.util.find_spec('parallel') is None)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["True", "True"]

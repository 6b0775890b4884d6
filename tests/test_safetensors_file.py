"""The safetensors reader (``longctx.model.safetensors_file``): every tensor and every row range
read back equal to what ``safetensors`` saved, dtypes and edge shapes included; damaged files
refused with a message naming what is wrong; a matrix quantized or converted slice by slice of
its rows at load gives the bytes it gives whole, and a model loaded in another dtype than its
checkpoint's is the model converted after reading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from longctx.model import loader, safetensors_file
from tiny_models import make_checkpoint
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


def test_unsigned_and_float8_dtypes_read_back(tmp_path):
    """Dtypes torch stores but cannot compare: the bytes read are the bytes saved."""
    tensors = {
        "u16": torch.tensor([1, 65535, 7], dtype=torch.int32).to(torch.uint16),
        "u32": torch.tensor([2**32 - 1, 0], dtype=torch.int64).to(torch.uint32),
        "u64": torch.tensor([2**63 + 5, 1], dtype=torch.uint64),
        "e4m3": torch.tensor([0.5, -448.0, 1e-3]).to(torch.float8_e4m3fn),
        "e5m2": torch.tensor([57344.0, -2e-5]).to(torch.float8_e5m2),
    }
    for entry in entries(_saved(tmp_path, tensors)):
        t, want = entry.read(), tensors[entry.name]
        assert t.dtype == want.dtype and t.shape == want.shape, entry.name
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), entry.name


@pytest.mark.parametrize("kind, rows, k", [("int8", 37, 64), ("int4", 50, 128), ("int8", 1, 32), ("int8", 5, 32),
                                          ("int4", 0, 32)])
def test_quantized_slice_by_slice_equals_whole(tmp_path, monkeypatch, kind, rows, k):
    weight = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    path = _saved(tmp_path, {"w": weight})
    monkeypatch.setattr(loader, "READ_SLICE_BYTES", 5 * k * 2)  # 5 rows a slice: uneven last slice
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


@pytest.mark.parametrize("stored, dtype, rows", [(torch.float32, torch.bfloat16, 37), (torch.float32, torch.float16, 1),
                                                 (torch.bfloat16, torch.float32, 23), (torch.float16, torch.bfloat16, 5),
                                                 (torch.float32, torch.bfloat16, 4), (torch.float32, torch.bfloat16, 0)])
def test_converted_slice_by_slice_equals_whole(tmp_path, monkeypatch, stored, dtype, rows):
    """Values that round differently in every direction (ties, subnormals, past fp16's range)."""
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(rows, 48, generator=g) * torch.logspace(-9, 5, 48)).to(stored)
    path = _saved(tmp_path, {"w": weight})
    monkeypatch.setattr(loader, "READ_SLICE_BYTES", 4 * weight.shape[1] * weight.element_size())  # 4 rows a slice
    sizes = []
    real = safetensors_file.Entry.rows
    monkeypatch.setattr(safetensors_file.Entry, "rows", lambda self, first, count: sizes.append(count) or
                        real(self, first, count))
    got = loader._read_as(entries(path)[0], dtype)
    assert got.dtype == dtype and torch.equal(got, weight.to(dtype))
    assert sum(sizes) == rows and sizes[:1] == [min(4, rows)] * (rows > 0) and max(sizes, default=0) <= 4


def test_integer_tensors_are_not_converted(tmp_path):
    ids = torch.arange(12).reshape(3, 4) * 1001  # (not all exact in bf16)
    got = loader._read_as(entries(_saved(tmp_path, {"ids": ids}))[0], torch.bfloat16)
    assert got.dtype == torch.int64 and torch.equal(got, ids)


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2", "gemma2", "phi3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows_kernel", [False, True])
def test_model_loaded_in_another_dtype_is_the_converted_model(tmp_path, monkeypatch, kind, dtype, rows_kernel):
    """An fp32 folder loaded as bf16/fp16 (matrices converted as read) holds the same tensors as
    reading it whole in fp32 and converting after, Gemma's fp32 norms (1 + w) included; and the
    load did read every matrix in slices, none whole."""
    if rows_kernel and dtype == torch.float16:
        pytest.skip("the row kernel reads float32 and bfloat16 weights")
    make_checkpoint(tmp_path, kind, max_shard_size="40KB")
    monkeypatch.setattr(loader, "READ_SLICE_BYTES", 1000)  # slices of a few rows
    config, state = loader.load_state(tmp_path)  # read in fp32, converted after (the old path)
    want = loader._model_from_state(config, state, dtype, "cpu", None)
    whole, sliced = [], []
    read, rows = safetensors_file.Entry.read, safetensors_file.Entry.rows
    monkeypatch.setattr(safetensors_file.Entry, "read", lambda self: whole.append(self) or read(self))
    monkeypatch.setattr(safetensors_file.Entry, "rows", lambda self, first, count: sliced.append((self, count))
                        or rows(self, first, count))
    if rows_kernel:
        got = loader.load_row_kernel_model(str(tmp_path), dtype=dtype, use_cache=False)
        want.use_row_kernel()
    else:
        got = loader.load_model(str(tmp_path), dtype=dtype)
    got, want = got.state_dict(), want.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert any(v.dtype == dtype for v in got.values())
    assert [e.name for e in whole if len(e.shape) == 2] == []  # every matrix converted as read
    matrices = {e.name: e for e, _ in sliced}
    assert len(matrices) >= 4 and all(count * e.row_bytes <= 1000 for e, count in sliced if e.shape[0] > 1)


def test_fp8_checkpoints_are_refused_before_reading(tmp_path, monkeypatch):
    """An FP8 matrix means nothing without its scales: the load stops at the headers, naming it."""
    make_checkpoint(tmp_path, "llama-tied")
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 96).to(torch.float8_e4m3fn)}
    save_file(tensors, str(tmp_path / "model-fp8.safetensors"))
    monkeypatch.setattr(safetensors_file.Entry, "_read", lambda *a: pytest.fail("read a tensor"))
    for load in (lambda: loader.load_model(str(tmp_path)), lambda: loader.load_quantized_model(str(tmp_path), "int8")):
        with pytest.raises(loader.UnsupportedModelError, match="down_proj.weight is float8_e4m3fn: FP8"):
            load()

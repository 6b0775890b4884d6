"""An HF checkpoint's safetensors file read a tensor (or a range of rows) at a time, into memory
the caller owns, with no memory map.

Owns: parsing the safetensors container (an 8-byte little-endian header length, a JSON header
of ``name -> {dtype, shape, data_offsets}``, then the data) and checking every entry against
the file before anything is read. Never: what a tensor means (``longctx.model.loader``).

Why not ``safetensors.safe_open``: it maps the file, and every page a read touches stays in the
process's resident set until the file is closed, beside the copy the loader keeps. Quantizing
a 1B-shaped float32 folder at load (``quantization="int8"``) peaked at 6.26 GiB that way, the
mapped 4.6 GiB of float32 plus the 1.2 GiB of blocks (AMD EPYC, benchmarks/bench_quant.py,
record 93abce3); an 8B bfloat16 folder (16 GB) would need ~24 GB. Read with ``readinto``, the
file's data passes through the page cache, which the kernel may drop, and the process holds
only what it keeps; ``rows`` reads part of a tensor, so a large embedding is quantized in
slices (``loader.load_quantized_model``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


class SafetensorsError(ValueError):
    """Not a safetensors file, or one cut short or malformed (the message says what and where)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes lie (``begin`` from the file's start)."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes

    def read(self) -> torch.Tensor:
        """The whole tensor, in new memory."""
        return self.rows(0, self.shape[0]) if self.shape else self._read(0, 1, ())

    def rows(self, first: int, count: int) -> torch.Tensor:
        """Indices ``first .. first + count - 1`` of dim 0, in new memory."""
        if not self.shape or first < 0 or count < 0 or first + count > self.shape[0]:
            raise IndexError(f"rows {first}..{first + count} of {self.name} {list(self.shape)}")
        return self._read(first * self.row_bytes, count, (count, *self.shape[1:]))

    def _read(self, offset: int, count: int, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=self.dtype)
        want = out.numel() * out.element_size()
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if want else memoryview(b"")
        with open(self.path, "rb") as f:
            f.seek(self.begin + offset)
            got = f.readinto(view) if want else 0
        if got != want:
            raise SafetensorsError(f"{self.path}: {self.name} ends {want - got} bytes past the end of the file")
        return out


def entries(path: str | Path) -> list[Entry]:
    """The file's tensors in the order of their data, each checked: a known dtype, a shape of
    non-negative ints, and data offsets inside the file that hold exactly its bytes."""
    path = Path(path)
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors files are little-endian; this machine is not")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path}: header of {n} bytes does not fit the file's {size} (not safetensors?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SafetensorsError(f"{path}: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    start, out = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has no dtype of {sorted(DTYPES)}, shape and "
                                   f"data_offsets: {info!r}") from None
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(isinstance(o, int) for o in (begin, end)):
            raise SafetensorsError(f"{path}: tensor {name!r} has a bad shape or offsets: {info!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if not 0 <= begin <= end <= size - start or end - begin != nbytes:
            raise SafetensorsError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}, {nbytes} bytes) has data "
                                   f"offsets {begin}..{end} in a data section of {size - start} bytes")
        out.append(Entry(path, name, dtype, shape, start + begin, nbytes))
    return sorted(out, key=lambda e: e.begin)

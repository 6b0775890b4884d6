"""A GGUF file's header read lazily: its metadata, its tensors' names, types, shapes and
memory-mapped data, without decoding the tokenizer's arrays.

Owns: parsing the GGUF container (versions 2 and 3, little-endian): the key/value metadata,
the tensor infos and the data section's alignment. Never: what a key or a tensor means
(``longctx.model.loader``), quantized formats (``gguf.quants`` and the block kernel).

Why not ``gguf.GGUFReader``: it builds a numpy view for every element of every array, and a
tokenizer's 49K tokens and 48K merges cost ~100,000 such views, 3-6 s of a 1B model's load,
for arrays the loader never reads (transformers loads the tokenizer itself). Here an array of
the keys in ``SKIPPED_ARRAYS`` is stepped over and only its length kept; numeric arrays are one
``numpy.frombuffer`` each. Tensors carry the same ``name``, ``tensor_type``, ``shape`` (``ne``:
inputs first) and ``data`` (a read-only map: F32/F16 as their values in reversed ``ne`` order,
the other formats as rows of bytes) as the reader's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# value types: u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
          12: "<f8"}
STRING, ARRAY = 8, 9
SKIPPED_PREFIX = "tokenizer.ggml."  # arrays under it are stepped over (their lengths kept)
KEPT_TOKENIZER_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


class GGUFError(ValueError):
    """Not a GGUF file, or one cut short or malformed (the message says where)."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ne, inputs first (uint64)
    data: np.ndarray
    offset: int = 0  # of data's first byte in the file


class GGUFFile:
    """``fields``: key -> value (ints, floats, strings, lists); ``array_lengths``: key ->
    element count of every array (skipped ones included); ``tensors``: in file order."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as err:  # an empty file
                raise GGUFError(f"{self.path}: not a GGUF file ({err})") from None
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        self._buf, self._pos = buf, 4
        version = self._u(4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._u(8), self._u(8)
        self.fields: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._u(4)
            skip = key.startswith(SKIPPED_PREFIX) and key not in KEPT_TOKENIZER_KEYS
            value = self._value(vtype, key, skip)
            if not skip:
                self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u(4)
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = [self._u(8) for _ in range(n_dims)]
            infos.append((name, dims, self._u(4), self._u(8)))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, code, offset in infos:
            qtype = gguf.GGMLQuantizationType(code)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if dims else 1
            nbytes = n * size // block
            begin = start + offset
            if begin + nbytes > len(buf):
                raise GGUFError(f"{self.path}: tensor {name!r} ends at byte {begin + nbytes}, past the "
                                f"file's end ({len(buf)}): the file is cut short")
            raw = whole[begin:begin + nbytes]
            shape = tuple(reversed(dims))
            if qtype == gguf.GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == gguf.GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * size)
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data, begin))

    def release(self, tensor: GGUFTensor) -> None:
        """Let go of the pages of ``tensor``'s bytes this process has mapped (``madvise``
        MADV_DONTNEED; the file's pages stay in the page cache, and its data, still valid,
        comes back from there if read again): for a loader that has copied the tensor out, so
        that a conversion of the whole file does not hold the file's pages and the converted
        copy at once (an F32 file of 4 GB had peaked at twice its size). A no-op where the
        platform has no madvise."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or tensor.data.nbytes == 0:
            return
        page = mmap.PAGESIZE
        start = tensor.offset // page * page  # (a page shared with a neighbour is read again if needed)
        end = min(-(-(tensor.offset + tensor.data.nbytes) // page) * page, len(self._map))
        try:
            self._map.madvise(advice, start, end - start)
        except OSError:  # advice only: a refusal changes nothing
            pass

    # ------------------------------------------------------------------ parsing

    def _u(self, size: int) -> int:
        fmt = "<I" if size == 4 else "<Q"
        try:
            (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        except struct.error:
            raise GGUFError(f"{self.path}: the header is cut short at byte {self._pos}") from None
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._u(8)
        end = self._pos + n
        if end > len(self._buf):
            raise GGUFError(f"{self.path}: a string at byte {self._pos} runs past the file's end")
        text = self._buf[self._pos:end].decode("utf-8", "replace")
        self._pos = end
        return text

    def _value(self, vtype: int, key: str, skip: bool) -> Any:
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            try:
                (value,) = struct.unpack_from(fmt, self._buf, self._pos)
            except struct.error:
                raise GGUFError(f"{self.path}: the value of {key!r} is cut short") from None
            self._pos += struct.calcsize(fmt)
            return value
        if vtype == STRING:
            return self._string()
        if vtype != ARRAY:
            raise GGUFError(f"{self.path}: {key!r} has an unknown value type {vtype}")
        etype, count = self._u(4), self._u(8)
        self.array_lengths[key] = count
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype])
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise GGUFError(f"{self.path}: the array {key!r} runs past the file's end")
            values = None if skip else np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).tolist()
            self._pos = end
            return values
        if etype == STRING:
            if skip:  # step over the strings: their lengths only
                buf, pos, unpack = self._buf, self._pos, struct.Struct("<Q").unpack_from
                try:
                    for _ in range(count):
                        pos += 8 + unpack(buf, pos)[0]
                except struct.error:
                    raise GGUFError(f"{self.path}: the array {key!r} is cut short") from None
                if pos > len(buf):
                    raise GGUFError(f"{self.path}: the array {key!r} runs past the file's end")
                self._pos = pos
                return None
            return [self._string() for _ in range(count)]
        return [self._value(etype, key, skip) for _ in range(count)]  # arrays of arrays

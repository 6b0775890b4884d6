"""The disk KV tier: one file per page, named by the chained hash of its prefix, checksummed.

Owns: the folder's files, their format, the disk budget (least recently used files go first)
and reading pages back with every check a file from another run or process needs.
Never: deciding which pages to write (``longctx.kv.prefix_cache``) or what a key means
(``longctx.cache.radix_tree.page_hashes``: the key of page ``i`` hashes page ``i - 1``'s key,
the page's token ids and the cache's extra key, so a name stands for the whole prefix).

File layout (``<folder>/<key[:2]>/<key>.kvpage``)::

    b"LCKVPAGE2\\n" | u32 header length | JSON header | payload
    header: {"key", "dtype", "shape", "nbytes", "sha256" (of the payload)}
    shape: [L, 2, BS, Hkv, D] for pages of the model's dtype; [L, 2, BS * Hkv * D + 4 * Hkv]
    (dtype uint8) for int8 pages: per layer and K/V, the int8 values then the fp32 scales.

Version 2 added int8 pages; a file of version 1 (or of any other magic) is a miss.

Files are written to a temporary name and renamed, so a reader never sees half a file. A file
that is missing, truncated, corrupted or of another layout is a miss: it is logged, counted,
removed if it is damaged, and never used. A temporary file whose writer (the pid in its name)
is gone, left by a process killed mid-write, is removed when a store opens the folder.

The KV of a private document is as sensitive as the document: folders are created 0700 and
files 0600 (owner only, whatever the umask); the pages are checksummed, not authenticated
(docs/prefix-store.md says what that does and does not stop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import Counter, OrderedDict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"LCKVPAGE2\n"
OLD_MAGICS = (b"LCKVPAGE1\n",)
SUFFIX = ".kvpage"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class DiskKVStore:
    def __init__(self, folder: str | os.PathLike, budget_bytes: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"cannot use disk_cache_dir {str(self.folder)!r}: {err}") from err
        self.budget_bytes = budget_bytes
        self.page_shape, self.dtype = tuple(page_shape), dtype
        self.misses: Counter[str] = Counter()  # reason -> count
        self.num_written = self.num_read = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        self._pending: OrderedDict[str, torch.Tensor] = OrderedDict()  # put, not yet written
        self._lock = threading.RLock()  # the engine's thread and the disk thread share the index
        self.num_stale_tmp_removed = 0
        self._scan()

    def _scan(self) -> None:
        for tmp in self.folder.glob("*/.*.tmp"):  # (``.<name>.<pid>.tmp``) writers killed midway
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                try:
                    tmp.unlink()
                    self.num_stale_tmp_removed += 1
                except OSError:
                    pass
        found = []
        for path in self.folder.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path.stem, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size

    # ------------------------------------------------------------------ queries

    @property
    def num_pages(self) -> int:
        with self._lock:
            return len(self._sizes) + sum(k not in self._sizes for k in self._pending)

    @property
    def num_bytes(self) -> int:
        return sum(self._sizes.values())

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._sizes or key in self._pending:
                return True
        return self.path(key).exists()

    def put(self, key: str, page: torch.Tensor) -> None:
        """Queue one page for writing (``flush`` writes it); readable and ``contains`` at once.
        ``page`` must not change afterwards (the mover hands over a copy)."""
        if tuple(page.shape) != self.page_shape or page.dtype != self.dtype:
            raise ValueError(f"page of shape {tuple(page.shape)} {page.dtype} does not match the "
                             f"store's {self.page_shape} {self.dtype}")
        with self._lock:
            if key not in self._sizes:
                self._pending[key] = page

    def flush(self) -> None:
        """Write every queued page (the disk thread calls this; so does ``close``). A page that
        cannot be written (disk full, folder gone) is dropped, logged and counted as a
        ``write`` miss: the tier loses that page, nothing else."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                key, page = next(iter(self._pending.items()))
            try:
                self.write(key, page)
            except OSError as err:
                log.warning("disk KV cache: cannot write page %s: %s", key[:16], err)
                with self._lock:
                    self.misses["write"] += 1
            with self._lock:
                self._pending.pop(key, None)

    def miss_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.misses)

    # ------------------------------------------------------------------ write

    def write(self, key: str, page: torch.Tensor) -> None:
        """Store one page ``[L, 2, BS, Hkv, D]`` under ``key`` (nothing if it is there)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return
        if tuple(page.shape) != self.page_shape or page.dtype != self.dtype:
            raise ValueError(f"page of shape {tuple(page.shape)} {page.dtype} does not match the "
                             f"store's {self.page_shape} {self.dtype}")
        payload = page.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"key": key, "dtype": str(self.dtype).removeprefix("torch."),
                             "shape": list(self.page_shape), "nbytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = self.path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner only, whatever the umask
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._sizes[key] = path.stat().st_size
            self.num_written += 1
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        total = self.num_bytes
        while total > self.budget_bytes and len(self._sizes) > 1:
            key, size = self._sizes.popitem(last=False)
            self.path(key).unlink(missing_ok=True)
            total -= size

    # ------------------------------------------------------------------ read

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The page stored under ``key`` (copied into ``out`` when given, else a tensor over
        the file's bytes), or None (a miss, logged with its reason)."""
        return self.accept(key, self.fetch(key), out)

    def fetch(self, key: str) -> tuple[torch.Tensor | bytearray | None, str | None]:
        """Read and check one page without recording anything: (the page or the file's bytes,
        None) or (None, why it is a miss). Safe to run for several keys at once (threads: the
        reads and the checksum release the GIL); ``accept`` then records the outcome."""
        with self._lock:
            queued = self._pending.get(key)
        if queued is not None:
            return queued, None
        try:
            with open(self.path(key), "rb") as f:  # one buffer: no copy of the payload until ``out``
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data):]
        except FileNotFoundError:
            return None, "missing"
        except OSError as err:
            return None, f"unreadable ({err})"
        return data, self._check(key, data)

    def accept(self, key: str, fetched: tuple, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Record a ``fetch``: a hit (the page, into ``out`` when given) or a miss (logged,
        counted, a damaged file removed; None)."""
        data, reason = fetched
        if data is None or reason is not None:
            return self._miss(key, reason, remove=data is not None)
        if isinstance(data, torch.Tensor):  # queued, not yet written
            return out.copy_(data) if out is not None else data.clone()
        start = len(MAGIC) + 4 + struct.unpack_from("<I", data, len(MAGIC))[0]
        page = torch.frombuffer(data, dtype=torch.uint8, offset=start).view(self.dtype).reshape(self.page_shape)
        with self._lock:
            self._sizes[key] = len(data)
            self._sizes.move_to_end(key)
            self.num_read += 1
        return out.copy_(page) if out is not None else page

    def _check(self, key: str, data: bytes) -> str | None:
        """Why ``data`` is not a valid page for ``key``; None if it is."""
        if data.startswith(OLD_MAGICS):
            return "old format (written by an earlier version)"
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return "truncated or not a page file"
        size = struct.unpack_from("<I", data, len(MAGIC))[0]
        start = len(MAGIC) + 4 + size
        try:
            header = json.loads(data[len(MAGIC) + 4:start])
        except ValueError:
            return "corrupted header"
        if not isinstance(header, dict) or header.get("key") != key:
            return "header names another page"
        if (header.get("shape") != list(self.page_shape)
                or header.get("dtype") != str(self.dtype).removeprefix("torch.")):
            return f"another layout ({header.get('shape')} {header.get('dtype')})"
        if len(data) - start != header.get("nbytes"):
            return "truncated"
        if hashlib.sha256(memoryview(data)[start:]).hexdigest() != header.get("sha256"):
            return "checksum mismatch"
        return None

    def _miss(self, key: str, reason: str, remove: bool) -> None:
        kind = reason.split(" ")[0]
        log.warning("disk KV cache miss for page %s: %s", key[:16], reason)
        with self._lock:
            self.misses[kind] += 1
            self._sizes.pop(key, None)
        if remove:
            self.path(key).unlink(missing_ok=True)
        return None

"""The disk KV tier: one file per page, named by the chained hash of its prefix, authenticated
with HMAC-SHA-256, every read and write bounded by a deadline.

Owns: the folder's files, their format, quarantining bad files, and reading pages back with
every check a file from another run or process needs. The deadline, the key file and the
budget shared by every process using the folder are ``longctx.kv.disk_io``'s.
Never: deciding which pages to write (``longctx.kv.prefix_cache``) or what a key means
(``longctx.cache.radix_tree.page_hashes``: the key of page ``i`` hashes page ``i - 1``'s key,
the page's token ids and the cache's extra key, so a name stands for the whole prefix); never
holding its lock while it waits on the disk.

File layout (``<folder>/<key[:2]>/<key>.kvpage``)::

    b"LCKVPAGE3\\n" | HMAC (32 bytes) | u32 header length | JSON header | payload
    HMAC: HMAC-SHA-256 under the store's key of the magic and of everything after the HMAC
    header: {"key", "dtype", "shape", "nbytes"}
    shape: [L, 2, BS, Hkv, D] for pages of the model's dtype; [L, 2, BS * Hkv * D + 4 * Hkv]
    (dtype uint8) for int8 pages: per layer and K/V, the int8 values then the fp32 scales.

Version 3 authenticates the whole file (version 2 carried a plain SHA-256 of the payload, which
anyone able to write the folder could recompute); a file of version 1 or 2 is a miss ("old").
The key is read from a file outside the folder (docs/prefix-store.md: what that stops).

Files are written to a temporary name and renamed, so a reader never sees half a file. A file
that is missing is a miss. A bad one (truncated, forged or damaged, of another layout, not a
regular file, unreadable, or whose read missed the deadline) is a miss too, logged and counted
by reason, and quarantined: removed, and never read again by this store unless it writes the
page anew. The pages chained after a bad one in the same read are quarantined with it
(``quarantine_after``): no lookup can reach them this run, which recomputes them, and without
their removal a chain damaged throughout would be repaired one page per run. A temporary file
whose writer (the pid in its name) is gone, left by a process killed mid-write, is removed when
a store opens the folder.

Deadlines. Each read, write and probe runs on a thread of its own and is waited for at most
``timeout_s``: past it, a read is a miss ("timeout") and its file quarantined, a write is
dropped; while an operation is stuck past its deadline the tier is "stalled" and refuses
every operation at once (a miss, "stalled"), so a stalled mount costs one deadline, not one per
page. ``state()`` reports it for /health and /metrics.

The KV of a private document is as sensitive as the document: folders are created 0700 and
files 0600 (owner only, whatever the umask).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import math
import os
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from longctx.config import ConfigError
from longctx.kv.disk_io import (DiskStalled, DiskTimeout, FileTooLarge, FolderBudget, NotRegularFile, TimedIO,
                                load_cache_key, read_regular_file)

log = logging.getLogger(__name__)

MAGIC = b"LCKVPAGE3\n"
OLD_MAGICS = (b"LCKVPAGE1\n", b"LCKVPAGE2\n")
SUFFIX = ".kvpage"
MAC_BYTES = 32
PREFIX = len(MAGIC) + MAC_BYTES + 4  # magic, HMAC, header length
MAX_HEADER = 64 << 10  # a real header is ~150 bytes
# Misses that say nothing against the file: nothing to quarantine.
HARMLESS_MISSES = ("missing", "stalled", "quarantined", "error")
_tmp_ids = itertools.count()


def page_file_bytes(mac_key: bytes, header: bytes, payload: bytes) -> bytes:
    """A whole page file: magic, HMAC, header length, header, payload."""
    body = struct.pack("<I", len(header)) + header
    mac = hmac.new(mac_key, MAGIC, "sha256")
    mac.update(body)
    mac.update(payload)
    return b"".join((MAGIC, mac.digest(), body, payload))


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
                 dtype: torch.dtype, timeout_s: float = 10.0, key_file: str = "") -> None:
        """``key_file``: the HMAC key (``""``: the per-user default, made if missing); raises
        ``ConfigError`` for an unusable folder or key file."""
        self.folder = Path(folder).expanduser()
        self.budget_bytes = budget_bytes
        self.page_shape, self.dtype = tuple(page_shape), dtype
        self.payload_bytes = math.prod(self.page_shape) * dtype.itemsize
        self._mac_key = load_cache_key(key_file, self.folder)
        self.io = TimedIO(timeout_s)
        self.budget = FolderBudget(self.folder, budget_bytes, SUFFIX)
        self.misses: Counter[str] = Counter()  # reason -> count
        self.num_written = self.num_read = self.num_quarantined = 0
        self.num_stale_tmp_removed = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        self._pending: OrderedDict[str, torch.Tensor] = OrderedDict()  # put, not yet written
        self._writing: dict[str, torch.Tensor] = {}  # taken from _pending by a flush
        self._quarantined: set[str] = set()
        self._lock = threading.Lock()  # the engine's and the disk threads share the index; never held on I/O
        self._open()

    def _open(self) -> None:
        """Create the folder, remove dead writers' temporary files and trim the folder to the
        budget, within the deadline; past it the store starts stalled and the open goes on."""
        try:
            self.io.run(self._open_folder)
        except DiskTimeout:
            log.warning("disk KV cache: %s did not answer within %g s; the tier is stalled until it does",
                        self.folder, self.io.timeout_s)
        except OSError as err:
            raise ConfigError(f"cannot use disk_cache_dir {str(self.folder)!r}: {err}") from err

    def _open_folder(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for tmp in self.folder.glob("*/.*.tmp"):  # ``.<name>.<pid>[.<n>].tmp``: writers killed midway
            pid = tmp.name.partition(SUFFIX + ".")[2].split(".")[0]
            if pid.isdigit() and not _alive(int(pid)):
                try:
                    tmp.unlink()
                    self.num_stale_tmp_removed += 1
                except OSError:
                    pass
        found, removed = self.budget.open()
        if removed:
            log.info("disk KV cache: removed %d least recently used pages to fit disk_cache_gb", len(removed))
        with self._lock:
            index = OrderedDict(found)
            index.update(self._sizes)  # (pages written while a slow open went on are newer)
            self._sizes = index

    # ------------------------------------------------------------------ queries

    @property
    def num_pages(self) -> int:
        with self._lock:
            queued = itertools.chain(self._pending, self._writing)
            return len(self._sizes) + sum(k not in self._sizes for k in queued)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def max_file_bytes(self) -> int:
        """The largest file read: a page of up to 4x this store's bytes (another layout is
        reported as such), never an arbitrary file's whole size."""
        return PREFIX + MAX_HEADER + 4 * self.payload_bytes

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        """Whether a page is stored under ``key`` (by name: a file another process wrote counts;
        a quarantined one does not, nor anything while the tier is stalled)."""
        with self._lock:
            if key in self._pending or key in self._writing:
                return True
            if key in self._quarantined:
                return False
            if key in self._sizes:
                return True
        try:
            return self.io.run(os.path.lexists, self.path(key))
        except OSError:
            return False

    def miss_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.misses)

    def state(self) -> dict[str, Any]:
        """The tier's health, without touching the disk: ``state`` is "stalled" while an
        operation is stuck past its deadline, "degraded" once one timed out, a file was
        quarantined or a write failed this run, else "ok"; with the counts behind it."""
        stuck = self.io.num_stuck()
        with self._lock:
            failed = self.misses["write"]
            pages, nbytes, quarantined = len(self._sizes), sum(self._sizes.values()), self.num_quarantined
        timeouts = self.io.num_timeouts
        state = "stalled" if stuck else "degraded" if timeouts or quarantined or failed else "ok"
        return {"state": state, "stuck_io": stuck, "timeouts": timeouts, "quarantined": quarantined,
                "failed_writes": failed, "pages": pages, "bytes": nbytes, "budget_bytes": self.budget_bytes,
                "timeout_s": self.io.timeout_s}

    # ------------------------------------------------------------------ write

    def put(self, key: str, page: torch.Tensor) -> None:
        """Queue one page for writing (``flush`` writes it); readable and ``contains`` at once.
        ``page`` must not change afterwards (the mover hands over a copy)."""
        self._check_page(page)
        with self._lock:
            if key not in self._sizes:
                self._pending[key] = page

    def flush(self) -> None:
        """Write every queued page (the disk thread calls this; so do ``close`` and
        ``persist``). A page that cannot be written (disk full, folder gone, past the deadline,
        the tier stalled) is dropped, logged and counted as a ``write`` miss: the tier loses
        that page, nothing else."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                key, page = self._pending.popitem(last=False)
                self._writing[key] = page
            try:
                self.write(key, page)
            except OSError as err:
                log.warning("disk KV cache: cannot write page %s: %s", key[:16], err)
                with self._lock:
                    self.misses["write"] += 1
            finally:
                with self._lock:
                    self._writing.pop(key, None)

    def write(self, key: str, page: torch.Tensor) -> None:
        """Store one page ``[L, 2, BS, Hkv, D]`` under ``key`` (nothing if it is there); raises
        OSError when it cannot (``DiskTimeout``, ``DiskStalled`` among them)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return
        self._check_page(page)
        payload = page.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        size, removed = self.io.run(self._write_file, key, payload)
        with self._lock:
            self._sizes[key] = size
            self._sizes.move_to_end(key)
            self._quarantined.discard(key)
            self.num_written += 1
            for gone in removed:
                self._sizes.pop(gone, None)

    def _write_file(self, key: str, payload: bytes) -> tuple[int, list[str]]:
        """(On an I/O thread.) The file, written under a temporary name and handed to the
        budget, which renames it in; its size and the keys the budget removed."""
        header = json.dumps({"key": key, "dtype": str(self.dtype).removeprefix("torch."),
                             "shape": list(self.page_shape), "nbytes": len(payload)}).encode()
        data = page_file_bytes(self._mac_key, header, payload)
        path = self.path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_tmp_ids)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)  # owner only, whatever the umask
                f.write(data)
            return len(data), self.budget.admit(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # (renamed away unless something failed)

    def _check_page(self, page: torch.Tensor) -> None:
        if tuple(page.shape) != self.page_shape or page.dtype != self.dtype:
            raise ValueError(f"page of shape {tuple(page.shape)} {page.dtype} does not match the "
                             f"store's {self.page_shape} {self.dtype}")

    # ------------------------------------------------------------------ read

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The page stored under ``key`` (copied into ``out`` when given, else a tensor over
        the file's bytes), or None (a miss, logged with its reason)."""
        return self.accept(key, self.fetch(key), out)

    def fetch(self, key: str) -> tuple[torch.Tensor | bytearray | None, str | None]:
        """Read and check one page without recording anything: (the page or the file's bytes,
        None) or (None, why it is a miss), within the deadline. Safe to run for several keys
        at once (threads: the reads and the HMAC release the GIL); ``accept`` then records the
        outcome."""
        with self._lock:
            queued = self._pending.get(key)
            if queued is None:
                queued = self._writing.get(key)
            quarantined = key in self._quarantined
        if queued is not None:
            return queued, None
        if quarantined:
            return None, "quarantined (a bad file earlier in this run)"
        try:
            return self.io.run(self._fetch_file, key)
        except DiskTimeout as err:
            return None, f"timeout ({err})"
        except DiskStalled as err:
            return None, f"stalled ({err})"

    def _fetch_file(self, key: str) -> tuple[bytearray | None, str | None]:
        """(On an I/O thread.) The checked file, marked as just used; or why it is a miss."""
        path = self.path(key)
        try:
            data = read_regular_file(path, self.max_file_bytes)
        except FileNotFoundError:
            return None, "missing"
        except NotRegularFile as err:
            return None, f"special file ({err})"
        except FileTooLarge as err:
            return None, f"truncated or not a page file ({err})"
        except OSError as err:
            return None, f"unreadable ({err})"
        reason = self._check(key, data)
        if reason is not None:
            return None, reason
        try:
            self.budget.touch(path)
        except OSError:
            pass  # (recency only)
        return data, None

    def accept(self, key: str, fetched: tuple, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Record a ``fetch``: a hit (the page, into ``out`` when given) or a miss (logged,
        counted, a bad file quarantined; None)."""
        data, reason = fetched
        if reason is not None:
            return self._miss(key, reason)
        if isinstance(data, torch.Tensor):  # queued, not yet written
            return out.copy_(data) if out is not None else data.clone()
        start = PREFIX + struct.unpack_from("<I", data, PREFIX - 4)[0]
        page = torch.frombuffer(data, dtype=torch.uint8, offset=start).view(self.dtype).reshape(self.page_shape)
        with self._lock:
            self._sizes[key] = len(data)
            self._sizes.move_to_end(key)
            self.num_read += 1
        return out.copy_(page) if out is not None else page

    def _check(self, key: str, data: bytearray) -> str | None:
        """Why ``data`` is not a valid page for ``key``; None if it is. The header is read
        first only to name what is wrong (at most ``MAX_HEADER`` bytes, any JSON error a miss);
        nothing is valid unless the HMAC over the whole file matches."""
        if data.startswith(OLD_MAGICS):
            return "old format (written by an earlier version)"
        if not data.startswith(MAGIC) or len(data) < PREFIX:
            return "truncated or not a page file"
        size = struct.unpack_from("<I", data, PREFIX - 4)[0]
        start = PREFIX + size
        if size > MAX_HEADER or start > len(data):
            return f"truncated or not a page file (header of {size} bytes)"
        try:
            header = json.loads(bytes(data[PREFIX:start]))
        except (ValueError, RecursionError):
            return "corrupted header"
        if not isinstance(header, dict) or header.get("key") != key:
            return "header names another page"
        if (header.get("shape") != list(self.page_shape)
                or header.get("dtype") != str(self.dtype).removeprefix("torch.")):
            return f"another layout ({header.get('shape')} {header.get('dtype')})"
        if not len(data) - start == header.get("nbytes") == self.payload_bytes:
            return "truncated"
        mac = hmac.new(self._mac_key, MAGIC, "sha256")
        mac.update(memoryview(data)[PREFIX - 4:])
        if not hmac.compare_digest(mac.digest(), bytes(data[len(MAGIC):len(MAGIC) + MAC_BYTES])):
            return "checksum mismatch (HMAC: damaged, or not written with this key)"
        return None

    # ------------------------------------------------------------------ misses and quarantine

    def _miss(self, key: str, reason: str) -> None:
        kind = reason.split(" ")[0]
        log.warning("disk KV cache miss for page %s: %s", key[:16], reason)
        with self._lock:
            self.misses[kind] += 1
            self._sizes.pop(key, None)
        if kind not in HARMLESS_MISSES:
            self._quarantine([key])
        return None

    def quarantine_after(self, reason: str, keys: Sequence[str]) -> None:
        """The pages chained after a page that missed for ``reason`` in one read: quarantined
        if that page was bad (not merely absent), so this run writes them anew."""
        if keys and reason.split(" ")[0] not in HARMLESS_MISSES:
            self._quarantine(keys)

    def _quarantine(self, keys: Sequence[str]) -> None:
        """Never read ``keys`` again (until written anew); remove their files if the disk
        answers within the deadline."""
        with self._lock:
            new = [k for k in keys if k not in self._quarantined]
            self._quarantined.update(new)
            self.num_quarantined += len(new)
            for k in new:
                self._sizes.pop(k, None)
        if not new:
            return
        try:
            self.io.run(self.budget.discard, [self.path(k) for k in new])
        except OSError as err:
            log.warning("disk KV cache: cannot remove %d quarantined page files: %s", len(new), err)

"""The disk tier's file operations: bounded by a deadline, refusing anything but regular files,
authenticated under a key kept outside the cache folder, and held to one budget across every
process that shares the folder.

Owns: ``TimedIO`` (runs each operation on a daemon thread of its own and waits for it up to
``disk_timeout_s``), ``read_regular_file``, ``load_cache_key`` (the HMAC key file) and
``FolderBudget`` (the folder's bytes, least recently used files removed first).
Never: the page format, what a file name means or which pages to keep
(``longctx.kv.disk_store``).

Why a thread per operation. A page file on a stalled network mount (or a FIFO put in a page's
place) blocks its reader inside the kernel, where no timeout reaches: the thread is left
behind and counted as stuck until the call returns. It is a daemon, so it never holds up the
interpreter's exit (``concurrent.futures`` workers are joined at exit). While an operation is
stuck past its deadline, ``TimedIO`` refuses new ones at once (``DiskStalled``) instead of
leaving one more thread on the same mount per page.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from longctx.config import ConfigError

KEY_BYTES = 32  # HMAC-SHA-256 key: a key file holds at least this many bytes


class DiskTimeout(TimeoutError):
    """A file operation did not finish within the deadline (it may still be running)."""


class DiskStalled(OSError):
    """Refused: an earlier operation is still stuck past its deadline."""


class NotRegularFile(OSError):
    """A FIFO, device, socket or folder where a file was expected."""


class FileTooLarge(OSError):
    """A file larger than the caller can use (read nothing of it)."""


class _Op:
    """One operation on its thread: its deadline, and its outcome once ``done`` is set."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class TimedIO:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.num_timeouts = 0  # waits that gave up
        self.num_finished = 0  # operations that returned (in time or not)
        self._running: set[_Op] = set()
        self._lock = threading.Lock()

    def num_stuck(self) -> int:
        """Operations still running past their deadline."""
        now = time.monotonic()
        with self._lock:
            return sum(op.deadline < now for op in self._running)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread of its own, waited for up to the deadline."""
        return self.wait(self.start(fn, *args))

    def start(self, fn: Callable[..., Any], *args: Any) -> _Op:
        if self.num_stuck():
            raise DiskStalled("an earlier disk operation is stuck past disk_timeout_s")
        op = _Op(time.monotonic() + self.timeout_s)
        with self._lock:
            self._running.add(op)
        threading.Thread(target=self._call, args=(op, fn, args), name="longctx-disk-io", daemon=True).start()
        return op

    def wait(self, op: _Op) -> Any:
        """The result of ``op`` (its exception re-raised); ``DiskTimeout`` once its deadline
        passes."""
        if not op.done.wait(max(0.0, op.deadline - time.monotonic())):
            with self._lock:
                self.num_timeouts += 1
            raise DiskTimeout(f"no answer within disk_timeout_s={self.timeout_s:g} s")
        if op.error is not None:
            raise op.error
        return op.result

    def _call(self, op: _Op, fn: Callable[..., Any], args: tuple) -> None:
        try:
            op.result = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            op.error = err
        finally:
            with self._lock:
                self._running.discard(op)
                self.num_finished += 1
            op.done.set()


def read_regular_file(path: Path, max_bytes: int) -> bytearray:
    """The bytes of ``path``, opened without blocking (a FIFO opens at once) and without
    following a symlink; ``NotRegularFile`` for anything but a regular file and
    ``FileTooLarge`` past ``max_bytes``, both before reading a byte."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path.name} is not a regular file (mode {st.st_mode:o})")
        if st.st_size > max_bytes:
            raise FileTooLarge(f"{st.st_size} bytes, more than a page file holds")
        data = bytearray(st.st_size)
        view, n = memoryview(data), 0
        while n < len(data):
            got = os.readv(fd, [view[n:]])
            if not got:
                break
            n += got
        del view
        del data[n:]
        return data
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the key


def default_key_file() -> Path:
    """The per-user key: ``$XDG_CONFIG_HOME/longctx/disk-cache.key`` (``~/.config`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "longctx" / "disk-cache.key"


def load_cache_key(key_file: str, folder: Path) -> bytes:
    """The key that authenticates ``folder``'s page files: ``key_file``'s bytes, or the per-user
    default file's, which is made (``KEY_BYTES`` random bytes, 0600, in a 0700 folder) if
    missing. A key file inside the cache folder, readable or writable by other users, or too
    short is refused with a ``ConfigError`` saying what to do."""
    path = Path(key_file).expanduser() if key_file else default_key_file()
    name = f"disk_cache_key_file {str(path)!r}" if key_file else f"the disk cache key {str(path)!r}"
    if Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder)):
        raise ConfigError(f"{name} is inside disk_cache_dir {str(folder)!r}: keep the key outside the "
                          "cache folder (give disk_cache_key_file elsewhere)")
    if not key_file and not os.path.lexists(path):
        _create_key(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise ConfigError(f"cannot read {name}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{name} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"{name} can be read or changed by other users (mode {st.st_mode & 0o777:04o}): "
                              f"chmod 600 {path}")
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(key) < KEY_BYTES:
        raise ConfigError(f"{name} holds {len(key)} bytes; a key needs at least {KEY_BYTES} "
                          f"(head -c {KEY_BYTES} /dev/urandom > FILE; chmod 600 FILE)")
    return key


def _create_key(path: Path) -> None:
    """Write a new random key to ``path``, whole or not at all: written under a temporary name
    and hard-linked in, so of two processes making it at once both read the winner's."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    except OSError as err:
        raise ConfigError(f"cannot create the disk cache key {str(path)!r}: {err.strerror or err} "
                          "(give disk_cache_key_file)") from None


# ---------------------------------------------------------------------- the budget


class FolderBudget:
    """The folder's page files held to ``budget_bytes`` across every process using it.

    A ledger file (``.budget``: the folder's bytes in decimal) is read and written under an
    exclusive ``flock`` of itself. A writer renames its page in and adds its size under the
    lock, so at any moment at most the lock holder's page is over the budget; while the total is
    over, the least recently used files go. Recency is a file's mtime, set to the nanosecond when
    a page is written and when a read hits it (``touch``), so every process sees every other's
    reads. Trimming walks a list of the files, oldest first, measured when it runs out (each
    measurement also corrects the ledger: files removed by hand are not subtracted); a file
    whose mtime moved since is skipped, as used. ``open`` measures and trims at once, so a folder
    left over its budget is brought under it by a run that only reads.
    """

    LEDGER = ".budget"

    def __init__(self, folder: Path, budget_bytes: int, suffix: str) -> None:
        self.folder, self.budget_bytes, self.suffix = folder, budget_bytes, suffix
        self._oldest: deque[tuple[int, str, Path, int]] = deque()  # (mtime ns, name, path, bytes)

    def open(self) -> tuple[list[tuple[str, int]], list[str]]:
        """Measure and trim the folder: its pages (key, bytes) least recently used first, and
        the keys removed."""
        with self._locked() as fd:
            self._oldest, total = self._measure()
            total, removed = self._trim(total, measured=True)
            self._store_total(fd, total)
            return [(name.removesuffix(self.suffix), size) for _, name, _, size in self._oldest], removed

    def admit(self, tmp: Path, path: Path) -> list[str]:
        """Rename the written file ``tmp`` to ``path`` as the most recently used, and trim the
        folder back to the budget; the keys removed."""
        with self._locked() as fd:
            now = time.time_ns()
            os.utime(tmp, ns=(now, now))
            try:
                replaced = os.lstat(path).st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(tmp, path)
            total = self._load_total(fd)
            measured = total is None  # (no ledger yet, or not one of ours)
            if measured:
                self._oldest, total = self._measure()
            else:
                total += os.lstat(path).st_size - replaced
            total, removed = self._trim(total, measured)
            self._store_total(fd, total)
            return removed

    def discard(self, paths: list[Path]) -> None:
        """Remove files (bad ones) and their bytes from the ledger."""
        with self._locked() as fd:
            total = self._load_total(fd)
            for path in paths:
                try:
                    size = os.lstat(path).st_size
                    path.unlink()
                except OSError:  # gone already, or not ours to remove
                    continue
                if total is not None:
                    total -= size
            if total is not None:
                self._store_total(fd, max(0, total))

    @staticmethod
    def touch(path: Path) -> None:
        """Mark ``path`` as just used."""
        now = time.time_ns()
        os.utime(path, ns=(now, now), follow_symlinks=False)

    def _trim(self, total: int, measured: bool) -> tuple[int, list[str]]:
        """Remove least recently used files while ``total`` is over the budget (the newest file
        always stays); the new total and the keys removed."""
        removed = []
        while total > self.budget_bytes:
            if len(self._oldest) <= int(measured):
                if measured:
                    break
                self._oldest, total = self._measure()
                measured = True
                continue
            mtime, name, path, _ = self._oldest.popleft()
            try:
                st = os.lstat(path)
                if st.st_mtime_ns != mtime:
                    continue  # used since it was listed: no longer the least recent
                path.unlink()
            except OSError:
                continue  # removed by another process (which counted it), or not removable
            total -= st.st_size
            removed.append(name.removesuffix(self.suffix))
        return total, removed

    def _measure(self) -> tuple[deque[tuple[int, str, Path, int]], int]:
        """Every page file, least recently used first, and their bytes."""
        found = []
        for sub in _entries(self.folder):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for entry in _entries(Path(sub.path)):
                if entry.name.startswith(".") or not entry.name.endswith(self.suffix):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, entry.name, Path(entry.path), st.st_size))
        found.sort()
        return deque(found), sum(f[3] for f in found)

    @contextmanager
    def _locked(self) -> Iterator[int]:
        fd = os.open(self.folder / self.LEDGER, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFile(f"{self.LEDGER} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # (releases the lock)

    @staticmethod
    def _load_total(fd: int) -> int | None:
        text = os.pread(fd, 32, 0).strip()
        return int(text) if text.isdigit() else None

    @staticmethod
    def _store_total(fd: int, total: int) -> None:
        data = str(total).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []

"""Building the C kernels of ``csrc/`` on first use, for ``cpu_decode.py``, ``cpu_flash.py`` and
``cpu_linear.py``.

Owns: compiling one C source with the machine's C compiler into a per-user cache and loading it
with ctypes. Never: deciding whether a kernel is used (each kernel module does, and reports why
not).

A library is built with ``-march=native`` into ``$LONGCTX_CACHE_DIR`` (default
``~/.cache/longctx``), under a name that hashes the source, the headers beside it, the compiler
command and the CPU's flags, so a home directory shared by different machines never loads a
foreign build, and a changed header rebuilds its users. Builds are written to a temporary name
and renamed, so concurrent processes (test workers, sequence-
parallel ranks) never load a half-written file. ``LONGCTX_CPU_KERNEL=0`` switches every C
kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# what a failed or refused build raises; kernel modules catch these and fall back
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)


def enabled() -> bool:
    return os.environ.get("LONGCTX_CPU_KERNEL", "1") != "0"


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads  # ctypes builds a class per CDLL: once
    except (OSError, AttributeError):
        return None


def set_cpu_threads(num: int) -> None:
    """Threads for torch and for the C kernels' OpenMP runtime (a separate one), from the
    calling thread on. Unchanged counts cost nothing (torch rebuilds its pool on a change)."""
    if torch.get_num_threads() != num:
        torch.set_num_threads(num)
    set_omp_threads(num)


def set_omp_threads(num: int) -> None:
    """Threads the C kernels' OpenMP runtime (the system's libgomp, not torch's own copy, so
    ``torch.set_num_threads`` does not reach it) starts in parallel regions begun by the
    calling thread. Nothing happens where that runtime is not present."""
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(num)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("LONGCTX_CACHE_DIR") or os.path.join(Path.home(), ".cache", "longctx")
    return Path(root) / "cpu_kernels"


def build(source: Path) -> ctypes.CDLL:
    """Compile ``source`` (or reuse its cached build) and load it. Raises one of
    ``BUILD_ERRORS`` when there is no compiler or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it may include
    for part in (source.read_bytes(), *headers, " ".join([compiler, *FLAGS]).encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


class KernelLibrary:
    """One C source's library, built and loaded on first use, never failing the caller:
    ``load()`` gives the library or None, and ``status()`` says 'ok' or why not (switched off,
    no compiler, a failed build). ``declare`` sets the ctypes signatures after loading."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.declare = source, declare
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._status: str | None = None  # None: not tried yet

    def load(self) -> ctypes.CDLL | None:
        if self._status is not None:
            return self._lib
        with self._lock:
            if self._status is None:
                if not enabled():
                    self._status = "disabled by LONGCTX_CPU_KERNEL=0"
                else:
                    try:
                        lib = build(self.source)
                        self.declare(lib)
                        self._lib, self._status = lib, "ok"
                    except BUILD_ERRORS as exc:
                        self._status = f"unavailable: {exc}"
        return self._lib

    def available(self) -> bool:
        return self.load() is not None

    def status(self) -> str:
        """'ok', or why the kernel is not used."""
        self.load()
        return self._status or ""

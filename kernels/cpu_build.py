"""Building the C kernels of ``csrc/`` on first use, for ``cpu_decode.py``, ``cpu_flash.py`` and
``cpu_linear.py``.

Owns: compiling one C source with the machine's C compiler into a per-user cache and loading it
with ctypes. Never: deciding whether a kernel is used (each kernel module does, and reports why
not).

The instruction set is chosen at run time (``isa()``), from the CPU's features: on x86
``avx512bf16`` (AVX-512 F/BW/VL/DQ/CD + AVX-512 BF16 and VNNI: every CPU with the first has the
second), ``avx512``, ``avx2`` (AVX2 + FMA) or
``portable`` (x86-64 baseline: SSE2, no AVX2, FMA or AVX-512); elsewhere (ARM) ``native``
(the compiler's ``-march=native``: NEON and what else the core has) or ``portable``. The
sources pick their paths by the compiler's macros (``__AVX512F__``, ``__AVX2__`` ...), so one
source gives every level. ``LONGCTX_CPU_ISA`` forces a level (a lower one to compare paths, or
``portable`` for the plain C loops); a level this CPU cannot run is refused, never loaded. The
choice is logged once.

A library is built into ``$LONGCTX_CACHE_DIR`` (default
``~/.cache/longctx``), under a name that hashes the source, the headers beside it, the compiler
command (the level's flags included) and the CPU's flags, so a home directory shared by different machines never loads a
foreign build, and a changed header rebuilds its users. Builds are written to a temporary name
and renamed, so concurrent processes (test workers, sequence-
parallel ranks) never load a half-written file. ``LONGCTX_CPU_KERNEL=0`` switches every C
kernel off.

The kernels are torch operators in the ``longctx`` namespace (``define_op``; e.g.
``torch.ops.longctx.paged_decode``), each with a fake implementation, so the profiler records
them by name and ``torch.compile`` traces through them. They are registered with
``torch.library.Library`` (``define`` + ``impl`` for the CPU key) rather than
``torch.library.custom_op``: a call through custom_op's Python wrapper measured 12-18 us here
against 2-3 us, and a decode step makes ~240 kernel calls (8 per layer, 30 layers).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("longctx.kernels")

CSRC = Path(__file__).parent / "csrc"
# + the ISA level's (isa_flags). No contraction into FMAs (GCC's default in ISO C, not clang's): the
# kernels that promise torch's bits (rope_, the float page writes) keep them with any compiler
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off"]
# x86 levels, best first: the compiler flags and the /proc/cpuinfo features each needs
_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# The vector width is fixed per level, not left to -mtune: the C files' `omp simd reduction`
# loops (the RMSNorm's sum of squares, some dot products) sum in as many lanes as the vectorizer
# picks, and the tunings disagree (an Intel Xeon's, rocketlake, prefers 256 bits; the AMD EPYC
# Zen 4's 512), so one revision at one level gave other float32 sums on the two CPUs. fast's
# tokens followed (4 of 5 real prompts kept on the Zen 4, 1 of 5 on the Xeon, the same 4 with
# -mprefer-vector-width=512 there; 2026-12-03).
X86_LEVELS = {
    "avx512bf16": (["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native",
                    "-mprefer-vector-width=512"], _V4 | {"avx512_bf16", "avx512_vnni"}),
    "avx512": (["-march=x86-64-v4", "-mtune=native", "-mprefer-vector-width=512"], _V4),
    "avx2": (["-march=x86-64-v3", "-mtune=native", "-mprefer-vector-width=256"], _V3),
    "portable": (["-march=x86-64", "-mtune=native"], set()),
    # only when the CPU's features cannot be read (no /proc/cpuinfo), or when forced
    "native": (["-march=native"], set()),
}
OTHER_LEVELS = {"native": (["-march=native"], set()), "portable": ([], set())}
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


# glibc's mallopt parameters; the size below which a loaded engine's blocks come from the heap, and
# how much free memory at the heap's top it keeps (twice that, glibc's own rule when it adapts)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCKS_BELOW = 256 << 20


@functools.lru_cache(maxsize=1)
def keep_large_blocks() -> bool:
    """Have glibc serve blocks of up to ``HEAP_BLOCKS_BELOW`` bytes from its heap from now on
    (mallopt M_MMAP_THRESHOLD), and keep up to twice that free at the heap's top
    (M_TRIM_THRESHOLD, else a freed block at the top goes back to the system and is faulted in
    again), instead of mapping each one afresh, once per process; the engine
    calls it on the CPU once its weights are loaded, before the first-use tuning measures
    (``longctx.model.prepare``: the measurements then see the heap the steps will), and again
    once its pages are allocated (a KV pool made after it may take pages the tuning freed). Why: glibc maps every block of
    32 MiB or more (its dynamic threshold stops there) and unmaps it when freed, so a prefill
    chunk's large activations (a 1B model's [512, 16384] float32 gate/up product is exactly
    32 MiB) came back as fresh pages each time: ~8,000 page faults and zeroing a call, which cut
    the AMX product of that shape from ~2.4 to ~1.2 TFLOP/s and made a 1B bfloat16 prefill of
    2K tokens 1.27x slower on the Intel Xeon (5.34 against 4.20 s, docs/kernels.md). Returns
    whether the setting took (False off glibc, or with ``LONGCTX_MALLOC_TUNE=0``)."""
    if os.environ.get("LONGCTX_MALLOC_TUNE", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_BELOW) == 1 and mallopt(M_TRIM_THRESHOLD, 2 * HEAP_BLOCKS_BELOW) == 1


MADV_NOHUGEPAGE = 15  # Linux's madvise advice


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None where there is none."""
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def small_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s whole pages with base pages (4 KiB on x86), not transparent
    huge pages (madvise MADV_NOHUGEPAGE), for a contiguous CPU tensor of 2 MiB or more that
    nobody has written yet: the KV pool's (``longctx.kv.formats``). Why: torch puts such a block
    on huge pages (``THP_MEM_ALLOC_ENABLE``, set by ``import longctx``), and the pool is touched
    for the first time by the prefill that writes it. On the shared VMs this project runs on, a
    huge page faulted in for the first time cost 2.5-5 ms (0.4-0.7 GB/s: freed 2 MiB runs seem
    to go back to the host), against ~6 GB/s on 4 KiB pages, so the first 8K prefill of the
    default model after start-up took 0.5-1.0 s longer than the next ones (2 processes each
    way, Intel Xeon model 167), where the peers touch their pools while they start. Reading the
    pool is not slower on 4 KiB pages: decode over 8K tokens of 30 layers 34.3-34.5 against
    34.5-35.0 ms, a 512-row prefill chunk level (docs/kernels.md). A pool from glibc's heap
    (``keep_large_blocks``) leaves the advice on its addresses when freed; torch advises every
    later block of 2 MiB or more afresh. Returns whether the advice was given (False off
    Linux, for a small, strided or non-CPU tensor, or where madvise fails)."""
    size = tensor.numel() * tensor.element_size()
    if (not sys.platform.startswith("linux") or tensor.device.type != "cpu" or size < (2 << 20)
            or not tensor.is_contiguous()):
        return False
    madvise = _madvise()
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + size) // page * page
    return madvise is not None and end > start and madvise(start, end - start, MADV_NOHUGEPAGE) == 0


def c_compiler() -> str:
    """$CC, else cc or gcc on PATH; RuntimeError where there is none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return compiler


def _levels() -> dict[str, tuple[list[str], set[str]]]:
    return X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386") else OTHER_LEVELS


@functools.lru_cache(maxsize=None)
def _choose_isa(forced: str | None) -> tuple[str, str]:
    """(level, how it was chosen) or raises RuntimeError for a level that cannot run here."""
    levels, have = _levels(), set(_cpu_flags().split())
    if levels is X86_LEVELS and not have and not forced:  # features unknown: trust the compiler
        log.info("C kernels: instruction set native (this CPU's features could not be read)")
        return "native", "this CPU's features could not be read"
    if forced:
        if forced not in levels:
            raise RuntimeError(f"LONGCTX_CPU_ISA={forced!r} is not one of {', '.join(levels)}")
        missing = levels[forced][1] - have
        if missing:
            raise RuntimeError(f"LONGCTX_CPU_ISA={forced} needs CPU features this machine lacks: "
                               f"{', '.join(sorted(missing))}")
        level, why = forced, "forced by LONGCTX_CPU_ISA"
    else:
        level = next(name for name, (_, needs) in levels.items() if needs <= have)
        why = "the best this CPU supports"
    log.info("C kernels: instruction set %s (%s)", level, why)
    return level, why


def isa() -> str:
    """The instruction-set level the C kernels are built for here (see the module's text).
    Raises RuntimeError when ``LONGCTX_CPU_ISA`` names one this CPU cannot run."""
    return _choose_isa(os.environ.get("LONGCTX_CPU_ISA") or None)[0]


VECTOR_LEVELS = ("avx512bf16", "avx512", "avx2")  # the levels with the kernels' intrinsic paths


@functools.lru_cache(maxsize=None)
def _vectorized(forced: str | None) -> bool:
    try:
        return _choose_isa(forced)[0] in VECTOR_LEVELS
    except RuntimeError:
        return False


def vectorized() -> bool:
    """Whether the kernels here have their intrinsic paths (AVX2 and up). Without them (the
    ``portable`` and ``native`` builds: plain C loops) they measured slower than the torch
    paths on the AMD EPYC (benchmarks/bench_cpu_isa.py), so the engine takes them only with."""
    return _vectorized(os.environ.get("LONGCTX_CPU_ISA") or None)


def isa_flags() -> list[str]:
    return list(_levels()[isa()][0])


CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(*names: str) -> str | None:
    """The value (after the colon, unstripped) of /proc/cpuinfo's first line starting with one of
    ``names``, or None where there is none or the file cannot be read."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(names):
                return line.partition(":")[2]
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's first flags line), or "" where unknown."""
    return cpuinfo_field("flags", "Features") or ""


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where unknown."""
    return (cpuinfo_field("vendor_id") or "").strip()


def vendor_flags(by_vendor: dict[str, tuple[str, ...]], vendor: str | None = None) -> tuple[str, ...]:
    """The extra compiler flags ``by_vendor`` gives the CPU's vendor (``vendor``, default
    ``cpu_vendor()``), () for a vendor it does not name: a kernel's build tuned per CPU maker."""
    return by_vendor.get(cpu_vendor() if vendor is None else vendor, ())


@contextlib.contextmanager
def flocked(lock_file: Path):
    """Hold an exclusive flock on ``lock_file`` (made 0600, with its folder, if missing): one
    process at a time past this point, e.g. processes starting together on one cache."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def cache_root() -> Path:
    """longctx's cache folder: ``LONGCTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/longctx``, else
    ``~/.cache/longctx`` (``longctx.settings`` lists every variable)."""
    env = os.environ.get("LONGCTX_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longctx"


def cache_dir() -> Path:
    return cache_root() / "cpu_kernels"


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile ``source`` (or reuse its cached build) and load it; ``extra_flags`` follow the
    level's (e.g. the AMX kernel's ``-mamx-tile``). Raises one of ``BUILD_ERRORS`` when there is
    no compiler or the build fails."""
    compiler = c_compiler()
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it may include
    flags = [*FLAGS[:1], *isa_flags(), *extra_flags, *FLAGS[1:]]  # appended FLAGS (tests: -mno-avx2) come last
    for part in (source.read_bytes(), *headers, " ".join([compiler, *flags]).encode(),
                 (_cpu_flags() or platform.processor()).encode(), platform.machine().encode()):
        key.update(part)
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


OPS = torch.library.Library("longctx", "FRAGMENT")


def _writes_only(*args, **kwargs) -> None:
    return None


def define_op(schema: str, impl: Callable, fake: Callable = _writes_only) -> torch._ops.OpOverload:
    """Register ``longctx::<schema>`` with ``impl`` for CPU tensors and ``fake`` for fake and
    meta tensors (shapes only; by default nothing, the fake of an operator that only writes
    into its arguments and returns nothing, as every one here does). Returns the op's default
    overload, the thing callers call."""
    name = schema.split("(", 1)[0]
    if hasattr(torch.ops.longctx, name):  # this file imported under a second name (e.g. a script's path)
        return getattr(torch.ops.longctx, name).default
    OPS.define(schema)
    OPS.impl(name, impl, "CPU")
    torch.library.register_fake(f"longctx::{name}", fake, lib=OPS)
    return getattr(torch.ops.longctx, name).default


class KernelLibrary:
    """One C source's library, built and loaded on first use, never failing the caller:
    ``load()`` gives the library or None, and ``status()`` says 'ok' or why not (switched off,
    no compiler, a failed build, a CPU without what it needs). ``declare`` sets the ctypes
    signatures after loading (and may raise RuntimeError: the library is then not used);
    ``extra_flags`` go to the compiler after the level's; ``unsupported()``, when given, says why
    this machine cannot run the source (None: it can), before anything is built. ``settle(lib)``,
    when given, runs once after ``declare`` and before any caller gets the library (settings a
    process keeps, chosen by measuring: ``cpu_tune.settle_bf16_dot``); it must use ``lib`` itself,
    not ``load()``. A ValueError it raises (a bad setting) reaches the caller, and the next
    ``load()`` tries again; anything else is logged and the build's defaults stand."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], extra_flags: tuple[str, ...] = (),
                 unsupported: Callable[[], str | None] | None = None,
                 settle: Callable[[ctypes.CDLL], None] | None = None) -> None:
        self.source, self.declare = source, declare
        self.extra_flags, self.unsupported, self.settle = tuple(extra_flags), unsupported, settle
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._status: str | None = None  # None: not tried yet

    def load(self) -> ctypes.CDLL | None:
        if self._status is not None:
            return self._lib
        with self._lock:
            if self._status is None:
                expected = not enabled()  # the user's choice, or a CPU without what it needs: INFO
                if not enabled():
                    self._status = "disabled by LONGCTX_CPU_KERNEL=0"
                else:
                    try:
                        why_not = self.unsupported() if self.unsupported else None
                        if why_not:
                            expected = True
                            raise RuntimeError(why_not)
                        lib = build(self.source, self.extra_flags)
                        self.declare(lib)
                        if self.settle is not None:
                            try:
                                self.settle(lib)
                            except ValueError:
                                raise
                            except Exception as exc:  # noqa: BLE001 - a setting left at its default, said
                                log.warning("C kernel %s: its settings were not chosen (%r): the build's "
                                            "defaults stand", self.source.name, exc)
                        self._lib, self._status = lib, "ok"
                    except BUILD_ERRORS as exc:
                        self._status = f"unavailable: {exc}"
                if self._lib is None:  # once per library and process
                    log.log(logging.INFO if expected else logging.WARNING,
                            "C kernel %s not used (%s): the torch paths run instead", self.source.name, self._status)
        return self._lib

    def available(self) -> bool:
        return self.load() is not None

    def status(self) -> str:
        """'ok', or why the kernel is not used."""
        self.load()
        return self._status or ""

"""Choices measured on this machine at first use and cached per CPU and build, the way Triton's
autotuner keeps its configs: where a model's long float32 steps (prefill chunks, on float32
matrices or on the dequantized slices of GGUF blocks) leave the C row kernel's panels for torch's
BLAS on the same numbers, and where a bfloat16 model's leave them for the AMX tiles
(``cpu_amx``: the same numerics, on CPUs that have AMX-BF16).

Owns: ``blas_from_rows(shapes)`` (and ``slices_from_rows``, the same for GGUF blocks' bare
slice products, and ``amx_from_rows``, for bfloat16 matrices and the AMX kernel, each keyed
apart): the row count from which BLAS runs a float32 product
(``NEVER``: the kernel takes every step), measured once per CPU model, kernel build, torch
version, thread count and model shape, and cached in ``<cache_root>/cpu_kernels/tune.json``
(0600, written whole under a lock so that processes starting together, e.g. torchrun's ranks
on one host, measure once and agree); a measurement taken while the machine is busy (load
average above ``BUSY_LOAD`` per CPU) serves its process only and is not cached.
``LONGCTX_CPU_TUNE`` overrides it: ``off`` measures nothing and keeps the kernel for every
step; an integer N sends steps of N rows and more to BLAS without measuring. Never: which method a layer holds (``longctx.model``), or failing a
load: a measurement that cannot run (no kernel, an unwritable cache) keeps the kernel and says
why in the log.

Why measured rather than fixed: at prefill's rows both are compute-bound products, and which
is faster is the CPU's business. On the AMD EPYC where the kernel was written its panels beat
torch's BLAS up to 2,048 rows (benchmarks/bench_linear.py); an Intel Xeon has two 512-bit FMA
ports and a BLAS (oneDNN/MKL) tuned for them, and the Xeon's float32 prefill trailed vLLM-CPU,
whose products are oneDNN's, by 8-10% (issue 42). A fixed rule tuned on one of them would lose
on the other.

What a measurement costs: per candidate row count (``ROWS``), the kernel's way and BLAS's
alternate ``REPEATS`` times on one decoder MLP of the model's shape as the model calls it (the
norm, SwiGLU and residual fused into the kernel's calls, torch ops around BLAS's; the
intermediate size cut so the gate/up matrix holds at most ``MAX_ELEMENTS`` weights and the
whole tune stays near a second or two), random float32 numbers, on the threads the model will
use. BLAS must win by ``MARGIN`` at a row count and at every larger one to be chosen: a near
tie keeps the kernel, whose rows do not depend on the step's other rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from . import cpu_amx, cpu_build, cpu_linear

__all__ = ["NEVER", "ROWS", "WAYS", "blas_from_rows", "slices_from_rows", "amx_from_rows", "setting", "measure",
           "cache_file", "key", "bf16_dot", "bf16_dot_ways", "bf16_dot_setting", "settle_bf16_dot", "measure_bf16_dot"]

log = logging.getLogger(__name__)

ENV = "LONGCTX_CPU_TUNE"
NEVER = cpu_linear.UNBOUNDED  # BLAS from this many rows: never
ROWS = (128, 512, 2048)  # the row counts measured: a short last chunk, a 1B model's chunk, a 135M's
MIN_ROWS = 65  # a forced N below this is raised to it: decode and verification steps stay on the kernel
REPEATS = 5
MARGIN = 0.03  # BLAS must be this much faster (a fraction of the kernel's time) to be chosen
MAX_ELEMENTS = 1 << 21  # each measured matrix at most this many weights (8 MB of float32)
VERSION = 3  # of the measurement: a change here re-measures (2: five repeats, from three; 3: in the heap regime
# the steps run in, longctx.model.prepare)


def setting() -> str | int:
    """``LONGCTX_CPU_TUNE``: 'auto' (unset: measure at first use), 'off', or a forced row count.
    Raises ValueError for anything else."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "auto", "1", "on"):
        return "auto"
    if raw in ("off", "0", "never"):
        return "off"
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be 'auto', 'off' or a row count (BLAS from that many rows), "
                         f"got {os.environ[ENV]!r}") from None
    if rows < 1:
        raise ValueError(f"{ENV} as a row count must be >= 1, got {rows}")
    return max(rows, MIN_ROWS)


def cache_file() -> Path:
    return cpu_build.cache_dir() / "tune.json"


def _cpu_model() -> str:
    model = cpu_build.cpuinfo_field("model name")
    return model.strip() if model is not None else platform.processor() or platform.machine()


# float32 matrices: the kernel (its fused calls) or BLAS; GGUF blocks' float32 slices: the kernel
# or BLAS on bare products; bfloat16 matrices: the kernel or the AMX tiles
WAYS = ("blas", "slices", "amx")


def _build_name(lib) -> str:
    return os.path.basename(getattr(lib, "_name", "") or "") if lib is not None else "none"


def _flags_digest() -> str:
    """The CPU's flags, hashed short: what tells two machines of one model name apart in a key."""
    return hashlib.sha256(cpu_build._cpu_flags().encode()).hexdigest()[:12]


def key(shapes: Iterable[tuple[int, int]], threads: int, way: str = "blas") -> str:
    """What a measurement holds for: the CPU (its model name and feature flags), the row
    kernel's build (its library's file name carries the hash of its source and flags), torch's
    version (its BLAS) or the AMX kernel's build, the threads and the measured shapes."""
    parts = [f"v{VERSION}", _cpu_model(), _flags_digest(),
             _build_name(cpu_linear._load()), torch.__version__, f"threads={threads}",
             ",".join(f"{k}x{n}" for k, n in shapes), ",".join(map(str, ROWS))]
    if way == "amx":  # (the fused float32 way's keys carry no suffix; the row kernel's bf16 way is measured against)
        parts += [way, _build_name(cpu_amx._LIBRARY.load()), f"bf16dot={_BF16_DOT.get('linear')}"]
    elif way != "blas":
        parts.append(way)
    return "|".join(parts)


def _measured_mlp(hidden: int, inter: int, multiple: int = 1) -> tuple[int, int]:
    """(hidden, intermediate) with the intermediate size cut so that the gate/up matrix
    [2 I, H] holds at most ``MAX_ELEMENTS`` weights (a product's time is linear in its output
    rows), never below 32, and to a multiple of ``multiple`` (the AMX tiles' 32)."""
    inter = max(32, min(inter, MAX_ELEMENTS // max(2 * hidden, 1)))
    return hidden, max(multiple, inter // multiple * multiple)


def _elapsed_ms(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    return (clock() - t0) * 1e3


def measure(shapes: Iterable[tuple[int, int]], threads: int,
            clock: Callable[[], float] = time.perf_counter, way: str = "blas") -> dict:
    """Time one decoder MLP's two calls as the model makes them, at each of ``ROWS``, the
    kernel's way against BLAS's, alternating, ``REPEATS`` each after a warm-up. ``shapes``:
    the model's ``[(H, 2 I), (I, H)]`` (``mlp_shapes``), cut by ``_measured_mlp``. The kernel's
    way is its fused calls (the RMSNorm inside the gate/up product; SwiGLU and the residual
    inside the down product); BLAS's is what ``LinearMethod.apply`` then runs: the norm and
    SwiGLU as torch ops, ``torch.mm``, the residual added. Bare products would favour BLAS:
    on the AVX2 Zen 3 they did (BLAS 5% ahead at 2,048 rows on the 135M model's shapes) while
    its prefill took 13% longer on BLAS. ``way="amx"``: bfloat16 matrices, the kernel's fused
    calls against the same torch ops around the AMX kernel's products (``cpu_amx``); the
    result's "blas_ms" and "blas_from_rows" are then the AMX kernel's. ``way="slices"``: the
    two products bare, as ``BlockWeights`` runs a GGUF matrix's dequantized slices in a long
    step (its norm and SwiGLU are torch ops whichever multiplies: nothing fused to weigh), the
    kernel writing into the result against BLAS's product copied there (the residual added by
    both). Returns ``{"rows": {R: {"kernel_ms", "blas_ms"}}, "blas_from_rows": R or None}``."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    amx = way == "amx"
    hidden, twice = (int(v) for v in next(iter(shapes)))  # gate/up's (H, 2 I): the down matrix follows
    hidden, inter = _measured_mlp(hidden, max(twice // 2, 1), cpu_amx.K_MULTIPLE if amx else 1)
    gen = torch.Generator().manual_seed(0)
    w_up = torch.randn(2 * inter, hidden, generator=gen) * hidden ** -0.5
    w_down = torch.randn(hidden, inter, generator=gen) * inter ** -0.5
    if amx:
        w_up, w_down = w_up.to(torch.bfloat16), w_down.to(torch.bfloat16)

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cpu_amx.linear(a, w, num_threads=threads) if amx else torch.mm(a, w.t())

    norm_w = torch.rand(hidden, generator=gen) + 0.5
    eps = 1e-5
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows: dict[int, dict[str, float]] = {}
        for r in ROWS:
            x = torch.randn(r, hidden, generator=gen)
            up = torch.empty(r, 2 * inter)
            out = torch.empty(r, hidden)

            def kernel() -> None:
                cpu_linear.linear(x, w_up, None, norm_weight=norm_w, eps=eps, out=up, num_threads=threads)
                cpu_linear.linear(up, w_down, None, swiglu=True, residual=x, out=out, num_threads=threads)

            def bare_kernel() -> None:  # (up's first half stands for the SwiGLU product: same shape)
                cpu_linear.linear(x, w_up, None, out=up, num_threads=threads)
                cpu_linear.linear(up[:, :inter], w_down, None, residual=x, out=out, num_threads=threads)

            def bare_blas() -> None:
                up.copy_(torch.mm(x, w_up.t()))
                out.copy_(torch.mm(up[:, :inter], w_down.t()).add_(x))

            def blas() -> None:
                h = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
                g = mm(h, w_up)
                gate, lin = g.chunk(2, dim=-1)
                mm(torch.nn.functional.silu(gate) * lin, w_down).add_(x)

            ways = {"kernel": bare_kernel, "blas": bare_blas} if way == "slices" else {"kernel": kernel, "blas": blas}
            for fn in ways.values():  # warm-up: page the matrices in, let BLAS set up its threads
                fn()
            times: dict[str, list[float]] = {"kernel": [], "blas": []}
            for _ in range(REPEATS):
                for name, fn in ways.items():
                    times[name].append(_elapsed_ms(fn, clock))
            rows[r] = {f"{name}_ms": round(statistics.median(v), 3) for name, v in times.items()}
    finally:
        torch.set_num_threads(prev)
    return {"rows": rows, "blas_from_rows": choose(rows)}


def choose(rows: dict[int, dict[str, float]]) -> int | None:
    """The smallest measured row count from which BLAS wins by ``MARGIN`` at it and every
    larger one, else None (the kernel everywhere)."""
    chosen = None
    for r in sorted(rows, reverse=True):
        t = rows[r]
        if t["blas_ms"] < (1.0 - MARGIN) * t["kernel_ms"]:
            chosen = r
        else:
            break
    return chosen


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("CPU tune cache %s unreadable (%s): measuring again", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp makes it 0600
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_MEMO: dict[str, int] = {}
BUSY_LOAD = 0.75  # a 1-minute load average above this many per CPU: the measurement is not cached


def _busy() -> tuple[bool, float]:
    """Whether other work shares the CPUs now (their timings would be the neighbours'), and the
    1-minute load average."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False, -1.0
    return load > BUSY_LOAD * (os.cpu_count() or 1), round(load, 2)


def blas_from_rows(shapes: Iterable[tuple[int, int]], threads: int | None = None) -> int:
    """The row count from which a float32 product of these shapes runs on BLAS, ``NEVER`` for
    the kernel at every step: ``LONGCTX_CPU_TUNE``'s forced value, else this machine's cached
    measurement, else a new one (cached). Never raises for a failed measurement."""
    return _from_rows(shapes, threads, "blas")


def slices_from_rows(shapes: Iterable[tuple[int, int]], threads: int | None = None) -> int:
    """As ``blas_from_rows``, for GGUF blocks' long steps: their dequantized float32 slices
    multiplied bare (``measure``'s ``way="slices"``), measured and cached apart."""
    return _from_rows(shapes, threads, "slices")


def amx_from_rows(shapes: Iterable[tuple[int, int]], threads: int | None = None) -> int:
    """The row count from which a bfloat16 product of these shapes runs on the AMX tiles
    (``cpu_amx``), ``NEVER`` for the row kernel at every step (always where the CPU has no
    AMX, and for a hidden size the tiles do not take): as ``blas_from_rows``, measured and cached
    separately. Like it, a count of rows per step: a batched decode of that many sequences takes
    the tiles too (their numerics differ from the kernel's only in the order of the sums)."""
    shapes = [(int(k), int(n)) for k, n in shapes]
    if setting() == "off" or not shapes or shapes[0][0] % cpu_amx.K_MULTIPLE or not cpu_amx.available():
        return NEVER
    return _from_rows(shapes, threads, "amx")


def _cached(k: str, valid: Callable[[object], bool], take: Callable[[], dict]) -> tuple[dict, str | None]:
    """The cache file's record under ``k`` where ``valid`` accepts it (returned with None), else
    ``take()``'s new measurement, stamped with its seconds and the load before it, and written
    to the file unless the machine was busy (its timings then hold for this process only);
    returned with a note of where it went. Entries of earlier versions are dropped on a write."""
    path = cache_file()
    with cpu_build.flocked(path.with_name(path.name + ".lock")):
        record = _read(path).get(k)
        if valid(record):
            return record, None
        busy = _busy()
        t0 = time.perf_counter()
        record = take()
        record["seconds"], record["load_before"] = round(time.perf_counter() - t0, 2), busy[1]
        if busy[0]:
            return record, f"not cached: the machine was busy (load average {busy[1]} on {os.cpu_count()} CPUs)"
        data = {old: v for old, v in _read(path).items()
                if old.startswith((f"v{VERSION}|", f"bf16dot{BF16_DOT_VERSION}|"))}
        data[k] = record
        _write(path, data)
        return record, f"cached in {path}"


def _from_rows(shapes: Iterable[tuple[int, int]], threads: int | None, way: str) -> int:
    forced = setting()
    if forced == "off" or not cpu_linear.available() or cpu_linear.max_rows() < NEVER:
        return NEVER  # off, or no panel path (then BLAS already takes every long step)
    if isinstance(forced, int):
        return forced
    shapes = [(int(k), int(n)) for k, n in shapes]
    threads = threads or torch.get_num_threads()
    k = key(shapes, threads, way)
    if k in _MEMO:
        return _MEMO[k]
    try:
        record, kept = _cached(k, lambda r: isinstance(r, dict) and "blas_from_rows" in r,
                               lambda: measure(shapes, threads, way=way))
        if kept is not None:
            other = {"blas": "BLAS", "slices": "BLAS (bare slices)", "amx": "the AMX tiles"}[way]
            log.info("CPU tune (%s, %d threads, shapes %s): %s; kernel vs %s ms %s; %s",
                     _cpu_model(), threads, shapes,
                     f"{other} from {record['blas_from_rows']} rows" if record["blas_from_rows"]
                     else "the row kernel at every step", other,
                     {r: (t["kernel_ms"], t["blas_ms"]) for r, t in record["rows"].items()}, kept)
    except (OSError, RuntimeError, ValueError) as err:
        log.warning("CPU tune could not measure or cache (%s): the row kernel takes every step", err)
        return NEVER
    value = record["blas_from_rows"]
    _MEMO[k] = NEVER if value is None else max(int(value), MIN_ROWS)
    return _MEMO[k]


# --- bfloat16 products: vdpbf16ps or widened to float32 -----------------------------------------

BF16_DOT_ENV = "LONGCTX_BF16_DOT"
BF16_DOT_KINDS = ("linear", "flash")
BF16_DOT_VERSION = 1  # of this measurement: a change here re-measures
_BF16_DOT: dict[str, bool] = {}  # kind -> the process's choice, once its library loaded


def bf16_dot_setting() -> str:
    """``LONGCTX_BF16_DOT``: 'auto' (unset: measured at first use), 'on' or 'off'. Raises
    ValueError for anything else."""
    raw = os.environ.get(BF16_DOT_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("on", "1"):
        return "on"
    if raw in ("off", "0"):
        return "off"
    raise ValueError(f"{BF16_DOT_ENV} must be 'auto', 'on' or 'off', got {os.environ[BF16_DOT_ENV]!r}")


def bf16_dot_ways() -> dict[str, bool | None]:
    """``bf16_dot`` of every kind: what a benchmark records of the process it ran in."""
    return {kind: bf16_dot(kind) for kind in BF16_DOT_KINDS}


def bf16_dot(kind: str) -> bool | None:
    """The process's choice for ``kind`` ('linear': a bfloat16 matrix's products of 17 rows and
    more in the row kernel; 'flash': bfloat16 pages in the flash kernel's vector build): True
    where they run by vdpbf16ps (x, or q and the softmax weights, rounded to bfloat16), False
    where they are widened to float32, None before that kernel's library loaded."""
    if kind not in BF16_DOT_KINDS:
        raise ValueError(f"kind must be one of {BF16_DOT_KINDS}, got {kind!r}")
    return _BF16_DOT.get(kind)


def _linear_ways(lib, threads: int) -> tuple[Callable[[], None], Callable[[int], int]]:
    """A bfloat16 matrix's product of 192 rows (the panel path) through ``lib``'s row kernel."""
    gen = torch.Generator().manual_seed(0)
    rows, k, n = 192, 1024, 1536
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    y = torch.empty(rows, n)

    def run() -> None:
        rc = lib.longctx_linear_rows(x.data_ptr(), k, rows, w.data_ptr(), 1, n, k, None, y.data_ptr(), n, 0,
                                     None, 0.0, None, 0, threads)
        if rc != 0:
            raise RuntimeError(f"linear_rows returned {rc}")

    return run, lib.longctx_linear_set_bf16_dot


def _flash_ways(lib, threads: int) -> tuple[Callable[[], None], Callable[[int], int]]:
    """A prefill chunk's attention over bfloat16 pages through ``lib``'s flash kernel: 512 new
    tokens after 512, 6 query heads on 2 KV heads, head dims 64 and 128 (two calls)."""
    from .cpu_decode import call_batch  # (imports cpu_linear: not at this module's import)

    gen = torch.Generator().manual_seed(0)
    calls = []
    for d in (64, 128):
        ctx, new, heads, kv, bs = 1024, 512, 6, 2, 16
        k = torch.randn(ctx // bs, bs, kv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(ctx // bs, bs, kv, d, generator=gen).to(torch.bfloat16)
        q = torch.randn(new, heads, d, generator=gen)
        table = torch.arange(ctx // bs, dtype=torch.int32)[None].contiguous()
        ints = [torch.tensor(vals, dtype=torch.int32) for vals in ([ctx], [0, new], [0], [1])]
        out, lse = torch.empty(new, heads, d), torch.empty(new, heads)
        calls.append((q, k, v, table, ints, out, lse, d))

    def run() -> None:
        for q, k, v, table, (ctx_lens, cu_q, seqs, splits), out, lse, d in calls:
            call_batch("paged_flash", lib.longctx_paged_flash_batch, q, k, v, None, None, table, ctx_lens, cu_q,
                       seqs, None, d ** -0.5, threads, out, lse, splits=splits)

    return run, lib.longctx_flash_set_bf16_dot


def measure_bf16_dot(run: Callable[[], None], set_dot: Callable[[int], int],
                     clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time ``run`` with the vdpbf16ps products (``set_dot(1)``) and widened (``set_dot(0)``),
    alternating, ``REPEATS`` each after a warm-up of both. Returns ``{"dot_ms", "widen_ms",
    "dot": bool}``: the dot products are kept unless widening wins by ``MARGIN`` (a near tie keeps
    them, the build's default). Leaves ``set_dot`` at the choice."""
    times: dict[int, list[float]] = {1: [], 0: []}
    try:
        for on in (1, 0):
            set_dot(on)
            run()
        for _ in range(REPEATS):
            for on in (1, 0):
                set_dot(on)
                times[on].append(_elapsed_ms(run, clock))
    finally:
        set_dot(1)
    dot_ms, widen_ms = statistics.median(times[1]), statistics.median(times[0])
    dot = not widen_ms < (1.0 - MARGIN) * dot_ms
    set_dot(int(dot))
    return {"dot_ms": round(dot_ms, 3), "widen_ms": round(widen_ms, 3), "dot": dot}


def settle_bf16_dot(kind: str, lib, threads: int | None = None) -> bool:
    """Choose, once a process, whether ``lib`` (the row kernel's library for ``kind='linear'``, the
    flash kernel's vector build for 'flash') runs bfloat16 products by vdpbf16ps or widened to
    float32, and set it there (``KernelLibrary``'s ``settle`` hook, before any caller gets the
    library). Builds without AVX-512 BF16 always widen. ``LONGCTX_BF16_DOT`` on/off forces the
    choice, ``LONGCTX_CPU_TUNE=off`` keeps the dot products (measuring nothing); else this machine's
    cached measurement, else a new one (cached as ``blas_from_rows``'s are: not while the machine
    is busy). Returns the choice (True: vdpbf16ps). A bad setting raises ValueError; a failed
    measurement keeps the dot products and says why in the log."""
    if kind not in BF16_DOT_KINDS:
        raise ValueError(f"kind must be one of {BF16_DOT_KINDS}, got {kind!r}")
    run_setter = {"linear": "longctx_linear_set_bf16_dot", "flash": "longctx_flash_set_bf16_dot"}[kind]
    set_dot = getattr(lib, run_setter)  # (declared with the library)
    forced = bf16_dot_setting()
    if not set_dot(1):  # no vdpbf16ps in this build: nothing to choose
        _BF16_DOT[kind] = False
        return False
    if forced != "auto" or setting() == "off":
        dot = forced != "off"
        set_dot(int(dot))
        _BF16_DOT[kind] = dot
        return dot
    dot = True
    try:  # (whatever fails below keeps vdpbf16ps, and says why)
        threads = threads or torch.get_num_threads()
        k = "|".join([f"bf16dot{BF16_DOT_VERSION}", kind, _cpu_model(), _flags_digest(), _build_name(lib),
                      f"threads={threads}"])

        def take() -> dict:
            run, _ = (_linear_ways if kind == "linear" else _flash_ways)(lib, threads)
            prev = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return measure_bf16_dot(run, set_dot)
            finally:
                torch.set_num_threads(prev)

        record, kept = _cached(k, lambda r: isinstance(r, dict) and isinstance(r.get("dot"), bool), take)
        if kept is not None:
            log.info("CPU tune (%s, %d threads): bfloat16 %s products %s (vdpbf16ps %.2f ms, widened %.2f ms); %s",
                     _cpu_model(), threads, kind, "by vdpbf16ps" if record["dot"] else "widened to float32",
                     record["dot_ms"], record["widen_ms"], kept)
        dot = record["dot"]
    except Exception as err:  # noqa: BLE001 - a failed measurement keeps the build's default, said
        log.warning("CPU tune could not measure or cache the bfloat16 %s products (%r): vdpbf16ps kept", kind, err)
        dot = True
    set_dot(int(dot))
    _BF16_DOT[kind] = dot
    return dot

"""The block kernel's products (``longctx.kernels.cpu_blocks``) by format, at decode shapes:
how many weight bytes a second each format streams, against the machine's own read rate.

A decode step of a quantized model is one pass over every weight matrix with one row of x (a
lookahead verify step or a batch: a few rows). This times ``cpu_blocks.linear`` on random
blocks (valid fp16 scales, random quants; numpy seed 0) for each format at two shapes of
Llama-3.2-1B (the MLP's up projection, 8192 x 2048, and its down projection, 2048 x 8192), for
m = 1 and m = 4 rows, exact, fast and fast2 numerics (x as one or two int8 terms), one thread and all threads. The matrices rotate
through enough copies (``--pool-mb``, default 96 MB, above this kind of machine's L3) that each
call reads its weights from memory, as a decode step does, not from the cache.

The floor: the time of ``torch.amax`` over the same pool of bytes (a vectorized byte max:
``torch.sum`` of bytes into int64 reads at ~0.1 GB/s), read the same way (one
matrix a call), for the same threads: a product cannot stream its bytes faster than the
machine reads them.

Each figure is the median of ``--repeats`` calls (wall time), the calls of all formats and
modes interleaved within each round, so a slow spell of a shared machine hits all alike.

Usage:  python benchmarks/run.py blocks -- [--repeats 30] [--formats Q4_K Q6_K ...]
        (or python benchmarks/bench_blocks.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (benchmarks/run.py blocks records it as
benchmarks/results/blocks/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table (us per call, GB/s of weight bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine_info, save_result  # noqa: E402

# byte offsets of each format's fp16 scales within its block (the rest are random quants)
SCALES = {"Q8_0": (34, [0]), "Q4_0": (18, [0]), "Q4_1": (20, [0, 2]), "Q5_0": (22, [0]), "Q5_1": (24, [0, 2]),
          "Q4_K": (144, [0, 2]), "Q5_K": (176, [0, 2]), "Q6_K": (210, [208])}
SHAPES = {"up 8192x2048": (8192, 2048), "down 2048x8192": (2048, 8192)}


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    from longctx.kernels import cpu_blocks

    rb = cpu_blocks.row_bytes(fmt, k)
    a = rng.integers(0, 256, size=(n, rb), dtype=np.uint8)
    bb, offsets = SCALES[fmt]
    blocks = a.reshape(n, rb // bb, bb)
    for off in offsets:
        half = rng.uniform(1e-3, 1e-2, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off:off + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return torch.from_numpy(a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_K"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--pool-mb", type=float, default=96.0)
    ap.add_argument("--threads", nargs="+", type=int, default=sorted({1, torch.get_num_threads()}))
    ap.add_argument("--no-fast", action="store_true", help="time exact numerics only")
    ap.add_argument("--out")
    args = ap.parse_args()

    from longctx.kernels import cpu_blocks, cpu_build

    if not cpu_blocks.available():
        raise SystemExit(f"the block kernel is {cpu_blocks.status()}")
    rng = np.random.default_rng(0)
    cases = []  # (format, shape name, pool of matrices, n, k)
    for fmt in args.formats:
        for shape, (n, k) in SHAPES.items():
            one = random_blocks(fmt, n, k, rng)
            copies = max(2, int(args.pool_mb * 2**20 // one.numel()) + 1)
            pool = [one] + [random_blocks(fmt, n, k, rng) for _ in range(copies - 1)]
            cases.append((fmt, shape, pool, n, k))
    timings: dict[tuple, list[float]] = {}
    floors: dict[tuple, list[float]] = {}
    xs = {(m, k): torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) for m in args.rows
          for k in {c[4] for c in cases}}
    modes = ["exact"] + ([] if args.no_fast else ["fast", "fast2"])  # fast2: x as two int8 terms
    for rep in range(args.repeats + 2):  # the first two rounds warm up
        for threads in args.threads:
            torch.set_num_threads(threads)
            for fmt, shape, pool, n, k in cases:
                t = time.perf_counter()
                torch.amax(pool[rep % len(pool)])
                floor = time.perf_counter() - t
                if rep >= 2:
                    floors.setdefault((fmt, shape, threads), []).append(floor)
                for m in args.rows:
                    for mode in modes:
                        if mode != "exact" and not cpu_blocks.fast_supported(fmt):
                            continue
                        w = pool[(rep + 1) % len(pool)]
                        t = time.perf_counter()
                        cpu_blocks.linear(xs[(m, k)], w, fmt, k, num_threads=threads, fast={"exact": 0, "fast": 1, "fast2": 2}[mode])
                        dt = time.perf_counter() - t
                        if rep >= 2:
                            timings.setdefault((fmt, shape, threads, m, mode), []).append(dt)
    rows = []
    print(f"{'format':<7}{'shape':<16}{'thr':>4}{'m':>3}{'mode':>7}{'us':>9}{'GB/s':>8}{'floor GB/s':>12}{'of floor':>10}")
    for (fmt, shape, threads, m, mode), ts in timings.items():
        nbytes = cases[[c[:2] for c in cases].index((fmt, shape))][2][0].numel()
        med, floor = statistics.median(ts), statistics.median(floors[(fmt, shape, threads)])
        row = {"format": fmt, "shape": shape, "threads": threads, "m": m, "mode": mode, "us": 1e6 * med,
               "us_spread": [1e6 * min(ts), 1e6 * max(ts)], "gb_s": nbytes / med / 1e9,
               "floor_gb_s": nbytes / floor / 1e9, "of_floor": floor / med}
        rows.append(row)
        print(f"{fmt:<7}{shape:<16}{threads:>4}{m:>3}{mode:>7}{row['us']:9.0f}{row['gb_s']:8.1f}"
              f"{row['floor_gb_s']:12.1f}{row['of_floor']:10.2f}")
    save_result(args.out, {"machine": machine_info(isa=cpu_build.isa()), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

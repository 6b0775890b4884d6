"""The default model's matrix products at few rows: which weight layout streams fastest.

Decode runs one row per sequence through every weight matrix; a lookahead verify step or a
batch of decodes runs a few rows; a prefill chunk thousands. On the CPU the BLAS picks
different code for each shape, so the layout that is fastest for one row need not be for
four. This times SmolLM2-135M's 121 weight matrices (30 layers of fused qkv, o, fused
gate/up, down, plus the 49,152-row LM head) per step, for T rows, four ways on the same
numbers, the ways alternating within each repeat so a slow spell of the machine hits all:

* ``x @ W_t``          weights held ``[in, out]`` (BLAS; the model's ``cpu_matmul="blas"``);
* ``(W @ x.T).T``      weights held ``[out, in]`` (HF's layout), product taken column-major;
* ``F.linear(x, W)``   weights held ``[out, in]``, torch's usual call;
* ``oneDNN packed``    weights pre-packed once by oneDNN for 16 rows (``cpu_matmul="onednn"``);
* ``row kernel``       weights held ``[out, in]``, the C kernel of ``longctx.kernels.cpu_linear``
                       (the model's fp32 default, ``cpu_matmul="kernel"``: dot products up to 16
                       rows, register-blocked panels from 17; the model takes it for every step
                       where it has the panels, ``cpu_linear.max_rows()``).

It also times one plain read of all the weights (``torch.sum`` over each matrix), the floor
for a one-row step.

Usage:  python benchmarks/run.py linear -- [--threads 2] [--repeats 7]
        (or python benchmarks/bench_linear.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py linear, which records it
as benchmarks/results/linear/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table (median ms per step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from machine import machine_info, save_result

from longctx.kernels import cpu_linear
from longctx.model.llama import PACK_ROWS_HINT

HIDDEN, QKV, INTERMEDIATE, LAYERS, VOCAB = 576, 576 + 2 * 192, 1536, 30, 49152  # SmolLM2-135M
ROWS = (1, 2, 3, 4, 8, 16, 17, 24, 32, 64, 96, 128, 256, 512, 2048)


def weights() -> list[tuple[int, int]]:
    """(in, out) of every matrix of one forward pass, LM head last."""
    layer = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    return layer * LAYERS + [(HIDDEN, VOCAB)]


def time_steps(mats, rows: int, repeats: int) -> dict[str, float]:
    """Median ms of one pass of each product over every matrix, ``rows`` rows each."""
    xs = [torch.randn(rows, m[0].shape[0]) for m in mats]
    for product in PRODUCTS.values():
        product(xs[0], *mats[0])  # warm up
    times: dict[str, list[float]] = {name: [] for name in PRODUCTS}
    for _ in range(repeats):
        for name, product in PRODUCTS.items():
            start = time.perf_counter()
            for x, m in zip(xs, mats):
                product(x, *m)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


PRODUCTS = {
    "x @ W_t [in,out]": lambda x, w_t, w, packed: x @ w_t,
    "(W @ x.T).T [out,in]": lambda x, w_t, w, packed: (w @ x.t()).t(),
    "F.linear [out,in]": lambda x, w_t, w, packed: F.linear(x, w),
    "oneDNN packed": lambda x, w_t, w, packed: torch.ops.mkldnn._linear_pointwise(
        x, packed, None, "none", [], ""),
}
if cpu_linear.available():
    PRODUCTS["row kernel [out,in]"] = lambda x, w_t, w, packed: cpu_linear.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    mats = []
    for n_in, n_out in weights():
        w_t = torch.randn(n_in, n_out, generator=gen)
        w = w_t.t().contiguous()  # the same numbers in each layout
        mats.append((w_t, w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)))
    result: dict[str, dict[int, float]] = {name: {} for name in PRODUCTS}
    reads = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for w_t, _, _ in mats:
            w_t.sum()
        reads.append(1000 * (time.perf_counter() - start))
    read_ms = statistics.median(reads)
    weight_gb = sum(w_t.numel() for w_t, _, _ in mats) * 4 / 1e9
    print(f"one read of the weights ({weight_gb:.2f} GB): {read_ms:.1f} ms "
          f"({weight_gb / read_ms * 1000:.1f} GB/s)", flush=True)
    for rows in ROWS:
        # up to 64 rows: every matrix; more: the first 4 layers (the time scales with layers)
        subset = mats if rows <= 64 else mats[:16]
        for name, ms in time_steps(subset, rows, args.repeats if rows <= 64 else 3).items():
            result[name][rows] = ms
        print(f"rows {rows}: " + "  ".join(f"{n} {result[n][rows]:.1f}" for n in PRODUCTS), flush=True)
    report = {"machine": machine_info(threads=args.threads),
              "what": "median ms per forward pass over the weight matrices (rows <= 64: all 121 "
                      "plus the LM head; more rows: the first 4 layers only)",
              "weights_gb": weight_gb, "read_weights_ms": read_ms,
              "ms": result}
    save_result(args.out, report, indent=2)
    print(f"\n{'rows':>5} " + " ".join(f"{n:>22}" for n in PRODUCTS))
    for rows in ROWS:
        print(f"{rows:>5} " + " ".join(f"{result[n][rows]:>22.1f}" for n in PRODUCTS))


if __name__ == "__main__":
    main()

"""Whether the row kernel's panel tiles are worth tuning per machine: the prefill products of
``kernels/csrc/linear_rows.c`` built with other cache blockings, timed on the same numbers.

Issue 42 asks for tiles measured at first use on each machine, like Triton's autotuner. Before
building that, this measures what it could win: the panel path's two blockings, ``PANEL_K``
(the K block whose packed panels stay in L2: 2048 x 32 floats = 256 KB by default) and
``PANEL_M`` (x rows per pass over a slice's weights: 1024), are compile-time constants; each
variant here is the same source built with ``-DPANEL_K=...`` / ``-DPANEL_M=...`` (one factor
at a time, the rest at its default) by ``cpu_build.build``, the way the engine builds it. The
``twin`` is the default's code in a library of its own, and a variant whose blockings give a
shape the default's loops (``same_loops_as_default``, e.g. ``PANEL_M=2048`` at 512 rows) is
marked: their spread is the machine's noise, the yardstick for the others.

Per model shape and weight dtype, one step of that model's prefill chunk through one layer's
matrices (fused qkv, o, fused gate/up, down; no prologue), each variant timed ``--repeats``
times, the variants alternating within a repeat (each repeat starting one later) so a slow
spell of the machine hits all. Every variant's output is checked against the default build's
(the K blocking changes the order of the sums: relative differences of float32 rounding, at
most ``MAX_REL_DIFF``, or the run stops).

Shapes: Llama-3.2-1B's layer at a 512-row chunk (its CPU chunk), SmolLM2-135M's at 2048.

Usage:  python benchmarks/run.py tiles -- [--threads 2] [--repeats 5]
        (or python benchmarks/bench_tiles.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py tiles, which records it
as benchmarks/results/tiles/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table (median ms per step, GFLOP/s, the variant's time over the default's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from machine import machine_info, save_result

from longctx.kernels import cpu_build, cpu_linear

SHAPES = {  # name -> (rows, [(out, in) of one layer's matrices])
    "1b": (512, [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]),
    "135m": (2048, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
}
DEFAULT_K, DEFAULT_M = 2048, 1024  # linear_rows.c's PANEL_K and PANEL_M
VARIANTS = {"default": (), "twin": ("-DLONGCTX_TILE_TWIN=1",),  # twin: the default's code in a build of its own
            "K512": ("-DPANEL_K=512",), "K1024": ("-DPANEL_K=1024",), "K4096": ("-DPANEL_K=4096",),
            "M256": ("-DPANEL_M=256",), "M512": ("-DPANEL_M=512",), "M2048": ("-DPANEL_M=2048",)}
MAX_REL_DIFF = 1e-4  # a variant's output against the default's: float32 rounding of other sum orders, no more


def tiles(flags: tuple[str, ...]) -> tuple[int, int]:
    """(PANEL_K, PANEL_M) of a variant's flags."""
    values = {"PANEL_K": DEFAULT_K, "PANEL_M": DEFAULT_M}
    for flag in flags:
        name, _, value = flag.removeprefix("-D").partition("=")
        if name in values:
            values[name] = int(value)
    return values["PANEL_K"], values["PANEL_M"]


def loops(flags: tuple[str, ...], rows: int, mats: list[tuple[int, int]]) -> tuple:
    """What the blockings decide for these products (linear_rows.c's panel_block and its
    passes over the rows): equal for two variants means the same loops, so any difference
    in their times is the machine's noise."""
    panel_k, panel_m = tiles(flags)

    def block(k: int) -> int:
        blocks = -(-k // panel_k)
        return (-(-k // blocks) + 7) // 8 * 8

    return -(-rows // panel_m), tuple(block(k) for _, k in mats)


def step(lib, xs: dict[int, torch.Tensor], ws: list[torch.Tensor], outs: list[torch.Tensor], threads: int) -> None:
    for w, out in zip(ws, outs):
        x = xs[w.shape[1]]
        rc = lib.longctx_linear_rows(x.data_ptr(), x.shape[1], x.shape[0], w.data_ptr(),
                                     cpu_linear.WEIGHT_TYPES[w.dtype], w.shape[0], w.shape[1], None, out.data_ptr(),
                                     out.shape[1], 0, None, 0.0, None, 0, threads)
        if rc != 0:
            raise RuntimeError(f"linear_rows refused {tuple(x.shape)} x {tuple(w.shape)} (code {rc})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_linear.max_rows() < 2048:
        raise SystemExit(f"the row kernel has no panel path here ({cpu_linear.status()}, isa {cpu_build.isa()})")
    libs = {}
    for name, flags in VARIANTS.items():
        lib = cpu_build.build(cpu_linear.SOURCE, flags)
        cpu_linear._declare(lib)
        libs[name] = lib
    rows_out = []
    print(f"isa {cpu_build.isa()}, {args.threads} threads, median of {args.repeats}")
    print(f"{'shape':6s} {'weights':8s} {'variant':8s} {'ms':>8s} {'GFLOP/s':>8s} {'x default':>9s} {'max rel diff':>12s}")
    for shape, (rows, mats) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in mats}
        for dtype in cpu_linear.WEIGHT_TYPES:
            ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for n, k in mats]
            outs = {v: [torch.empty(rows, n) for n, _ in mats] for v in libs}
            for v, lib in libs.items():
                step(lib, xs, ws, outs[v], args.threads)  # warm up, and the outputs compared below
            times: dict[str, list[float]] = {v: [] for v in libs}
            names = list(libs)
            for r in range(args.repeats):  # each repeat starts one variant later: none always runs first
                for v in names[r % len(names):] + names[:r % len(names)]:
                    t = time.perf_counter()
                    step(libs[v], xs, ws, outs[v], args.threads)
                    times[v].append(time.perf_counter() - t)
            flops = 2 * rows * sum(n * k for n, k in mats)
            base = statistics.median(times["default"])
            for v in libs:
                med = statistics.median(times[v])
                diff = max(float(((a - b).abs().max() / b.abs().max())) for a, b in zip(outs[v], outs["default"]))
                if diff > MAX_REL_DIFF:
                    raise SystemExit(f"{v} computes another product on {shape} {dtype}: relative difference {diff:.2e}")
                same = loops(VARIANTS[v], rows, mats) == loops((), rows, mats)
                rows_out.append({"shape": shape, "rows": rows, "weights": str(dtype).removeprefix("torch."),
                                 "variant": v, "flags": list(VARIANTS[v]), "same_loops_as_default": same,
                                 "ms": 1e3 * med,
                                 "times_ms": [1e3 * t for t in times[v]], "gflops": flops / med / 1e9,
                                 "vs_default": med / base, "max_rel_diff": diff})
                r = rows_out[-1]
                print(f"{shape:6s} {r['weights']:8s} {v:8s} {r['ms']:8.1f} {r['gflops']:8.1f} {r['vs_default']:9.3f} "
                      f"{diff:12.2e}{'  (the default loops: noise)' if same else ''}")
    report = {"machine": machine_info(threads=args.threads, isa=cpu_build.isa()), "repeats": args.repeats,
              "results": rows_out}
    save_result(args.out, report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

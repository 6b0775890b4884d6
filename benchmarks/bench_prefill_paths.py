"""Prefill with the row kernel for every step against the other products for the long steps,
and what ``cpu_tune`` measures and would choose on this machine.

The CPU model multiplies its float32 weights (and the dequantized slices of GGUF blocks) with
the C row kernel for every step, except the long steps (prefill chunks) that ``cpu_tune``
measured faster on torch's BLAS here (``longctx.model.linear.tune_long_steps``); a bfloat16
model's go to the AMX tiles instead where the CPU has them and they measured faster
(``cpu_amx``, ``tune_bf16_long_steps``). This times the same engine several ways on the same
prompts, the ways alternating within each repeat in one process so a slow spell of the machine
hits them all (OTHER: ``blas`` for ``--dtype float32``, ``amx`` for ``bfloat16``):

- ``kernel``: the row kernel takes every step;
- ``OTHER-from-65``: every step of 65 rows and more goes to OTHER (the most a long step can be
  sent there; decode and verification steps stay on the kernel);
- ``OTHER-from-R``: OTHER from the row count R that ``cpu_tune.measure`` chose on this
  machine, when it chose one (its choice being "the kernel everywhere" adds no way: that is
  ``kernel``).

Before the prefills it also times the bare products of one gate/up matrix of the model's shape
at a chunk's rows (``--product-rows``): the row kernel on float32 weights, torch's BLAS on them
(MKL), the row kernel on bfloat16 weights (float32 x, rounded to bfloat16 in the product from
``cpu_linear.rounds_bf16_rows()`` rows), torch's bfloat16 product (oneDNN: AMX tiles where the
CPU has them; x and the result rounded to bfloat16) and, where it runs, the AMX kernel
(``cpu_amx``: x rounded, the result float32). Its GFLOP/s say where a bfloat16 model's prefill
time goes on this CPU.

The engine loads with ``LONGCTX_CPU_TUNE=off``; the bench then runs ``cpu_tune.measure`` on the
model's MLP shapes itself (nothing cached) and records its timings and choice beside the
prefills, so one record says both what the tuner saw and whether the prefill agrees. Each run is
a prefill of the bundled GPL text (repeated when a length asks for more) cut to N tokens plus a
few greedy tokens; the tokens of every way are compared with the kernel's.

Usage:  python benchmarks/run.py prefill-paths -- [--model M] [--gguf-weights float|blocks]
            [--lengths 1024,2048,4096,7600] [--repeats 3]
        (or python benchmarks/bench_prefill_paths.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py prefill-paths, which
records it as benchmarks/results/prefill-paths/<machine>/<git rev>.json); without ``--out`` it
writes nothing. Prints a table (median seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ["LONGCTX_CPU_TUNE"] = "off"  # the bench sets each way itself; before longctx reads it

import torch  # noqa: E402

from machine import machine_info, save_result  # noqa: E402

from longctx import LLM, SamplingParams  # noqa: E402
from longctx.kernels import cpu_amx, cpu_linear, cpu_tune  # noqa: E402
from longctx.model.linear import tune_bf16_long_steps, tune_long_steps  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "examples" / "data" / "gpl-3.txt"


def prompt_ids(tokenizer, longest: int) -> list[int]:
    """The GPL text's tokens, the text repeated until it holds ``longest``."""
    ids = tokenizer.encode(TEXT.read_text())
    while len(ids) < longest:
        ids = ids + ids
    return ids


def ways(choice: int | None, other: str) -> dict[str, int]:
    """Name -> the row count from which long steps go to ``other`` (``cpu_tune.NEVER``: never)."""
    out = {"kernel": cpu_tune.NEVER, f"{other}-from-{cpu_tune.MIN_ROWS}": cpu_tune.MIN_ROWS}
    if choice is not None and choice != cpu_tune.MIN_ROWS:
        out[f"{other}-from-{choice}"] = int(choice)
    return out


def product_rates(shapes: list[tuple[int, int]], rows: int, threads: int, repeats: int = 3) -> dict:
    """GFLOP/s of the model's gate/up product (``shapes[0]``: in, out) at ``rows`` rows, the
    ways alternating after a warm-up; median of ``repeats``."""
    k, n = shapes[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w_bf16, x_bf16 = w.to(torch.bfloat16), x.to(torch.bfloat16)
    out = torch.empty(rows, n)
    calls = {
        "kernel float32": lambda: cpu_linear.linear(x, w, out=out, num_threads=threads),
        "BLAS float32": lambda: torch.mm(x, w.t(), out=out),
        "kernel bfloat16": lambda: cpu_linear.linear(x, w_bf16, out=out, num_threads=threads),
        "torch bfloat16 (oneDNN)": lambda: torch.mm(x_bf16, w_bf16.t()),
    }
    if cpu_amx.supports(x, w_bf16):
        calls["AMX kernel bfloat16"] = lambda: cpu_amx.linear(x, w_bf16, num_threads=threads)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    flop = 2.0 * rows * k * n
    return {"shape": [rows, k, n], "ms": {m: round(statistics.median(v) * 1e3, 2) for m, v in times.items()},
            "gflops": {m: round(flop / statistics.median(v) / 1e9, 1) for m, v in times.items()},
            "kernel_rounds_x_from_rows": cpu_linear.rounds_bf16_rows()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--gguf-weights", default=None, choices=["float", "blocks"],
                        help="how a GGUF file's weights load (the engine's default when not given)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32: kernel against BLAS; bfloat16: kernel against the AMX tiles")
    parser.add_argument("--lengths", default="1024,2048,4096,7600")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--product-rows", type=int, default=512,
                        help="rows of the bare-product timing (0: skip it)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_linear.max_rows() < cpu_linear.UNBOUNDED:
        raise SystemExit(f"the row kernel has no panel path here (max_rows {cpu_linear.max_rows()}): "
                         "BLAS already takes every long step, nothing to compare")
    other = "blas" if args.dtype == "float32" else "amx"
    if other == "amx" and not cpu_amx.available():
        raise SystemExit(f"the AMX kernel is {cpu_amx.status()}: nothing to compare for bfloat16")
    lengths = [int(n) for n in args.lengths.split(",")]
    # bfloat16 compares the row kernel's and the AMX kernel's products on bf16 weights: the file
    # expanded (a quantized file would keep its blocks under bfloat16 otherwise)
    weights = args.gguf_weights or ("float" if args.dtype == "bfloat16" else None)
    extra = {"gguf_weights": weights} if weights else {}
    llm = LLM(args.model, enable_prefix_caching=False, lookahead=False, num_threads=args.threads,
              dtype=args.dtype, max_model_len=max(lengths) + args.new_tokens + 64, **extra)
    model = llm.engine.model
    switch = tune_long_steps if other == "blas" else tune_bf16_long_steps
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    tune = cpu_tune.measure(model.mlp_shapes(), args.threads, way=other)
    tune["seconds"], tune["load_before"] = round(time.perf_counter() - t0, 2), round(load_before, 2)
    print(f"cpu_tune.measure on {model.mlp_shapes()}: kernel vs {other} ms "
          f"{ {r: (t['kernel_ms'], t['blas_ms']) for r, t in tune['rows'].items()} }; "
          f"choice: {tune['blas_from_rows'] or 'the kernel everywhere'}", flush=True)
    products = product_rates(model.mlp_shapes(), args.product_rows, args.threads) if args.product_rows else None
    if products:
        print(f"gate/up product {products['shape']} GFLOP/s: {products['gflops']}", flush=True)
    chosen = ways(tune["blas_from_rows"], other)
    ids = prompt_ids(llm.get_tokenizer(), max(lengths))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    layers = switch(model, cpu_tune.NEVER)
    llm.generate([{"prompt_token_ids": ids[:min(lengths)]}], params)  # warm up
    seconds: dict[str, dict[int, list[float]]] = {way: {n: [] for n in lengths} for way in chosen}
    same_tokens: dict[int, bool] = {}
    try:
        for n in lengths:
            for _ in range(args.repeats):
                tokens = {}
                for way, rows in chosen.items():
                    switch(model, rows)
                    start = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": ids[:n]}], params)[0]
                    seconds[way][n].append(time.perf_counter() - start)
                    tokens[way] = out.outputs[0].token_ids
                same_tokens[n] = same_tokens.get(n, True) and all(t == tokens["kernel"] for t in tokens.values())
            print(f"{n} tokens: " + "  ".join(f"{w} {statistics.median(seconds[w][n]):.2f} s" for w in chosen),
                  flush=True)
    finally:
        switch(model, cpu_tune.NEVER)
    report = {"machine": machine_info(threads=args.threads), "args": vars(args) | {"out": str(args.out)},
              "what": f"seconds per run: prefill of the GPL text cut to N tokens + {args.new_tokens} "
                      "greedy tokens; the ways alternate within each repeat; 'tune' is cpu_tune.measure "
                      f"(way {other}: its blas_* fields are {other}'s) on the model's MLP shapes in the "
                      "same process, before the prefills",
              "layers_switched": layers, "mlp_shapes": model.mlp_shapes(), "tune": tune,
              "products": products,
              "ways": chosen, "seconds": seconds, "same_tokens": same_tokens,
              "median_s": {w: {n: statistics.median(v) for n, v in by_n.items()} for w, by_n in seconds.items()}}
    save_result(args.out, report, indent=2)
    names = list(chosen)
    print(f"\n{'tokens':>7} " + " ".join(f"{w:>14}" for w in names) + "  same")
    for n in lengths:
        k = report["median_s"]["kernel"][n]
        cells = [f"{report['median_s'][w][n]:>8.2f}s" + (f" {report['median_s'][w][n] / k:4.2f}x" if w != "kernel" else " " * 6)
                 for w in names]
        print(f"{n:>7} " + " ".join(f"{c:>14}" for c in cells) + f"  {same_tokens[n]}")


if __name__ == "__main__":
    main()

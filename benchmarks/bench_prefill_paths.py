"""Prefill with the row kernel for every step against BLAS for chunks over 64 rows.

The fp32 CPU model multiplies its weights with the C row kernel for every step the kernel
takes (``cpu_linear.max_rows()``: all of them where it has its panel path). This times the
same engine two ways on the same prompts, the ways alternating in one process so a slow spell
of the machine hits both: ``kernel`` (the default) and ``blas-above-64`` (the kernel's limit
set to 64 rows, so prefill chunks go to ``F.linear`` on the same ``[out, in]`` weights, as the
model did before the panel path). Each run is a prefill of the bundled GPL text cut to N
tokens plus a few greedy tokens; the tokens of both ways are compared.

Usage:  python benchmarks/run.py prefill-paths -- [--lengths 1024,2048,4096,7600] [--repeats 3]
        (or python benchmarks/bench_prefill_paths.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py prefill-paths, which records it
as benchmarks/results/prefill-paths/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table (median seconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from machine import machine_info, save_result

from longctx import LLM, SamplingParams
from longctx.kernels import cpu_linear

TEXT = Path(__file__).resolve().parent.parent / "examples" / "data" / "gpl-3.txt"
WAYS = {"kernel": None, "blas-above-64": cpu_linear.DOT_MAX_ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,7600")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_linear.max_rows() < cpu_linear.UNBOUNDED:
        raise SystemExit(f"the row kernel has no panel path here (max_rows {cpu_linear.max_rows()}): "
                         "nothing to compare")
    llm = LLM(enable_prefix_caching=False, lookahead=False)
    ids = llm.get_tokenizer().encode(TEXT.read_text())
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > len(ids):
        raise SystemExit(f"the text has {len(ids)} tokens; longest length asked: {max(lengths)}")
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    llm.generate([{"prompt_token_ids": ids[:256]}], params)  # warm up
    real_max_rows = cpu_linear.max_rows
    seconds: dict[str, dict[int, list[float]]] = {way: {n: [] for n in lengths} for way in WAYS}
    same_tokens: dict[int, bool] = {}
    try:
        for n in lengths:
            for _ in range(args.repeats):
                tokens = {}
                for way, limit in WAYS.items():
                    cpu_linear.max_rows = real_max_rows if limit is None else (lambda limit=limit: limit)
                    start = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": ids[:n]}], params)[0]
                    seconds[way][n].append(time.perf_counter() - start)
                    tokens[way] = out.outputs[0].token_ids
                same_tokens[n] = same_tokens.get(n, True) and tokens["kernel"] == tokens["blas-above-64"]
            print(f"{n} tokens: " + "  ".join(f"{w} {statistics.median(seconds[w][n]):.2f} s" for w in WAYS),
                  flush=True)
    finally:
        cpu_linear.max_rows = real_max_rows
    report = {"machine": machine_info(threads=args.threads), "args": vars(args) | {"out": str(args.out)},
              "what": f"seconds per run: prefill of the GPL text cut to N tokens + {args.new_tokens} "
                      "greedy tokens; the ways alternate within each repeat",
              "seconds": seconds, "same_tokens": same_tokens,
              "median_s": {w: {n: statistics.median(v) for n, v in by_n.items()} for w, by_n in seconds.items()}}
    save_result(args.out, report, indent=2)
    print(f"\n{'tokens':>7} {'kernel':>9} {'blas>64':>9} {'ratio':>6} same")
    for n in lengths:
        k, b = report["median_s"]["kernel"][n], report["median_s"]["blas-above-64"][n]
        print(f"{n:>7} {k:>8.2f}s {b:>8.2f}s {b / k:>5.2f}x {same_tokens[n]}")


if __name__ == "__main__":
    main()

"""Detokenization cost per output token: "before" (a full decode of the output after every
token, as ``LLMEngine._append`` did) vs "after" (``longctx.engine.detokenizer``: a window of the last
tokens), with the real default model's tokenizer (SmolLM2, byte-level BPE), on the token ids of
examples/data/gpl-3.txt taken as the output.

For each output length N (100 and 4,000 tokens): the mean cost per token over the whole
output (all N tokens, one at a time) and the cost per token of its last 100 tokens; the median
of ``--repeats`` runs. Both give the same text after every token (checked once per length).
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py detok, which records it
as benchmarks/results/detok/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.
Usage: python benchmarks/run.py detok -- [--repeats 5]
       (or python benchmarks/bench_detok.py ... [--out FILE])
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import ROOT, machine_info, save_result

sys.path.insert(0, str(ROOT))

TEXT = ROOT / "examples" / "data" / "gpl-3.txt"
LENGTHS = (100, 4000)
TAIL = 100


def before(tokenizer, ids: list[int]) -> list[float]:
    """The old path: append, then decode all output tokens. Per-token seconds."""
    out: list[int] = []
    times = []
    for token in ids:
        t0 = time.perf_counter()
        out.append(token)
        tokenizer.decode(out, skip_special_tokens=True)
        times.append(time.perf_counter() - t0)
    return times


def after(tokenizer, ids: list[int]) -> list[float]:
    from longctx.engine.detokenizer import IncrementalDetokenizer, make_detokenizer  # noqa: PLC0415 - not for --help

    detok = make_detokenizer(tokenizer)
    assert isinstance(detok, IncrementalDetokenizer)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        detok.add(token)
        times.append(time.perf_counter() - t0)
    return times


def check_same_text(tokenizer, ids: list[int]) -> None:
    from longctx.engine.detokenizer import make_detokenizer  # noqa: PLC0415

    detok = make_detokenizer(tokenizer)
    for i, token in enumerate(ids):
        if detok.add(token) != tokenizer.decode(ids[: i + 1], skip_special_tokens=True):
            raise SystemExit(f"text differs after token {i}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = p.parse_args()
    from longctx.model.loader import resolve_model  # noqa: PLC0415 - not for --help
    from longctx.model.tokenizer import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(ids) < max(LENGTHS):
        raise SystemExit(f"{TEXT} gives {len(ids)} tokens, fewer than {max(LENGTHS)}")
    rows = {}
    for n in LENGTHS:
        out = ids[:n]
        check_same_text(tokenizer, out)
        row = {}
        for name, fn in (("before", before), ("after", after)):
            runs = [fn(tokenizer, out) for _ in range(args.repeats)]
            row[name] = {
                "us_per_token_mean": statistics.median(sum(r) / n for r in runs) * 1e6,
                f"us_per_token_last_{TAIL}": statistics.median(sum(r[-TAIL:]) / TAIL for r in runs) * 1e6,
                "runs_us_per_token_mean": [sum(r) / n * 1e6 for r in runs],
            }
        row["speedup_mean"] = row["before"]["us_per_token_mean"] / row["after"]["us_per_token_mean"]
        rows[str(n)] = row
        print(f"  {n} tokens done", file=sys.stderr, flush=True)

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    report = {"machine": machine_info(commit=commit),
              "tokenizer": "SmolLM2-135M-Instruct (GGUF), byte-level BPE",
              "text": str(TEXT.relative_to(ROOT)), "text_tokens": len(ids), "repeats": args.repeats,
              "statistic": "median over repeats", "lengths": rows}
    save_result(args.out, report)
    print(f"{'output tokens':>13} {'path':>7} {'us/token (mean)':>16} {f'us/token (last {TAIL})':>20}")
    for n, row in rows.items():
        for name in ("before", "after"):
            r = row[name]
            tail = r[f"us_per_token_last_{TAIL}"]
            print(f"{n:>13} {name:>7} {r['us_per_token_mean']:>16.2f} {tail:>20.2f}")
    print("speedup (mean): " + ", ".join(f"{n} tokens {row['speedup_mean']:.1f}x" for n, row in rows.items()))


if __name__ == "__main__":
    main()

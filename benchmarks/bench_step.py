"""The engine's own cost per step: decode steps of a tiny random Llama (2 layers, hidden 64), where
the model's work is a few hundred microseconds and what is left is the step's Python: schedule,
inputs, sampling, update, detokenizing.

Usage:  python benchmarks/run.py step -- [--batches 1,8] [--steps 200] [--repeats 5] [--threads 1]
                                        [--cpu-time]
        (or python benchmarks/bench_step.py ... [--out FILE])

Per batch size and with lookahead off/on: the median wall time (``--cpu-time``: the engine
thread's CPU time) of one ``engine.step()`` over ``steps`` decode steps (prompts of 32 random tokens, greedy, ignore_eos), median over repeats.
To compare two revisions, run it from each in turn, alternating (the machine drifts by tens of
percent over minutes; docs/benchmarks.md). The tiny checkpoint is built with the tests' helper
(tests/tiny_models.py) in a temporary folder.
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py step, which records it
as benchmarks/results/step/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from machine import machine_info, save_result  # noqa: E402


def step_times(llm, batch: int, steps: int, cpu_time: bool) -> list[float]:
    import torch

    from longctx import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 150, (32,), generator=gen).tolist(), params)
    engine.step()  # the prefill
    times = []
    clock = time.thread_time if cpu_time else time.perf_counter
    while engine.has_unfinished() and len(times) < steps:
        t = clock()
        engine.step()
        times.append(clock() - t)
    for rid in list(engine.processor.tracked if hasattr(engine, "processor") else engine._tracked):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-time", action="store_true",
                    help="the engine thread's CPU time per step instead of wall time (time a busy "
                         "neighbour steals is not counted; with --threads 1 it is the step's work)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = ap.parse_args()
    import torch

    from longctx import LLM
    from tiny_models import make_engine_checkpoint

    torch.set_num_threads(args.threads)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        make_engine_checkpoint(Path(folder))
        for lookahead in (False, True):
            llm = LLM(folder, block_size=16, lookahead=lookahead, enable_prefix_caching=False)
            for batch in (int(b) for b in args.batches.split(",")):
                step_times(llm, batch, 20, args.cpu_time)  # warm-up
                medians = [statistics.median(step_times(llm, batch, args.steps, args.cpu_time)) * 1e6
                           for _ in range(args.repeats)]
                rows[f"batch{batch}-lookahead{int(lookahead)}"] = {
                    "step_us_median": statistics.median(medians), "step_us_per_repeat": medians}
    result = {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)}, "steps": rows}
    save_result(args.out, result)
    print(f"{'case':24} {'us per step (median of repeats)':>32}")
    for name, row in rows.items():
        print(f"{name:24} {row['step_us_median']:32.0f}")


if __name__ == "__main__":
    main()

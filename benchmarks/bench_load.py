"""Model load time: cold (empty weight cache: GGUF dequantized and cached) vs warm (cache hit).

Each load runs in a fresh process (``python -c``), timing model + tokenizer construction after
imports: ``load_model`` (the converted fp32 cache, which the BLAS and oneDNN paths read) and
``load_row_kernel_model`` per dtype (the row kernel's own cache, memory-mapped), cold and warm.
Then, per ``cpu_matmul`` path and dtype, the memory of a fresh process after
``LLM(kv_cache_gb=0.1)``: resident now (VmRSS) and at peak (VmHWM). For the row kernel also
"kernel-converted": the same LLM built the way it was before the mapped cache (``load_model``
then ``use_row_kernel``: the fp32 cache read and every matrix transposed into a new copy).
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py load, which records it
as benchmarks/results/load/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.
Usage: python benchmarks/run.py load -- [--repeats 3]
       (or python benchmarks/bench_load.py ... [--out FILE])
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine_info, save_result

PROBE = """
import time, torch
torch.set_num_threads(2)
from longctx.model.loader import load_model, resolve_model
from longctx.model.tokenizer import load_tokenizer
t0 = time.perf_counter()
model = load_model("smollm2-135m")
tok = load_tokenizer(resolve_model("smollm2-135m"))
print(time.perf_counter() - t0)
"""

ROW_PROBE = """
import sys, time, torch
torch.set_num_threads(2)
from longctx.model.loader import load_row_kernel_model, resolve_model
from longctx.model.tokenizer import load_tokenizer
dtype = getattr(torch, sys.argv[1])
t0 = time.perf_counter()
model = load_row_kernel_model("smollm2-135m", dtype)
tok = load_tokenizer(resolve_model("smollm2-135m"))
print(time.perf_counter() - t0)
"""

MEMORY_PROBE = """
import sys, torch
torch.set_num_threads(2)
from longctx import LLM
path, dtype = sys.argv[1], sys.argv[2]
if path == "kernel-converted":  # the row-kernel model as built before the mapped cache
    import longctx.engine.llm_engine as engine
    from longctx.model.loader import load_model

    def converted(name, dtype, use_cache=True, rope_scaling=None):
        model = load_model(name, dtype=dtype, rope_scaling=rope_scaling)
        model.use_row_kernel()
        return model

    engine.load_row_kernel_model = converted
    path = "kernel"
llm = LLM("smollm2-135m", cpu_matmul=path, dtype=dtype, kv_cache_gb=0.1)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(int(status["VmRSS"].split()[0]) / 1e6, int(status["VmHWM"].split()[0]) / 1e6)
"""


def memory_after_load(cpu_matmul: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, cpu_matmul, dtype], capture_output=True,
                         text=True, check=True)
    resident, peak = map(float, out.stdout.strip().splitlines()[-1].split())
    return {"resident_gb": resident, "peak_gb": peak}


def load_once(cache_dir: str | None, probe: str = PROBE, *args: str) -> float:
    """Seconds the probe reports, run in a fresh process (cache_dir None: the default cache)."""
    env = {**os.environ, **({"LONGCTX_CACHE_DIR": cache_dir} if cache_dir else {})}
    out = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = load_once(cache)
        warm = [load_once(cache) for _ in range(args.repeats)]
    rows = {}
    for dtype in ("float32", "bfloat16"):
        with tempfile.TemporaryDirectory() as cache:
            row_cold = load_once(cache, ROW_PROBE, dtype)
            rows[dtype] = {"cold_s": row_cold, "warm_s": [load_once(cache, ROW_PROBE, dtype) for _ in range(args.repeats)]}
    for dtype in ("float32", "bfloat16"):  # the memory probes below read the default cache: fill it
        load_once(None, ROW_PROBE, dtype)
    memory = {f"{path} {dtype}": memory_after_load(path, dtype)
              for path, dtype in (("blas", "float32"), ("onednn", "float32"), ("kernel", "float32"),
                                  ("kernel-converted", "float32"), ("kernel", "bfloat16"),
                                  ("kernel-converted", "bfloat16"))}
    report = {"machine": machine_info(), "cold_s": cold, "warm_s": warm, "row_kernel_load": rows,
              "memory_after_llm_load": memory}
    save_result(args.out, report)
    print(f"{'load':<6} {'seconds':>8}")
    print(f"{'cold':<6} {cold:>8.2f}")
    print(f"{'warm':<6} {statistics.median(warm):>8.2f}  (median of {len(warm)}: "
          f"{', '.join(f'{w:.2f}' for w in warm)})")
    for dtype, r in rows.items():
        print(f"row kernel {dtype}: cold {r['cold_s']:.2f} s, warm {statistics.median(r['warm_s']):.2f} s "
              f"(median of {len(r['warm_s'])})")
    for path, m in memory.items():
        print(f"LLM({path}): resident {m['resident_gb']:.2f} GB, peak {m['peak_gb']:.2f} GB")


if __name__ == "__main__":
    main()

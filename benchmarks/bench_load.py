"""Model load time: cold (empty weight cache: GGUF dequantized and cached) vs warm (cache hit).

Each load runs in a fresh process (``python -c``), timing model + tokenizer construction as
``LLM()`` does it, after imports. Then, per ``cpu_matmul`` path, the memory of a fresh process
after ``LLM(kv_cache_gb=0.1)``: resident now (VmRSS) and at peak (VmHWM).
Writes benchmarks/results/load-<host>.json, prints a table.
Usage: python benchmarks/bench_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from bench_e2e import RESULTS, machine_info

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

MEMORY_PROBE = """
import sys, torch
torch.set_num_threads(2)
from longctx import LLM
llm = LLM("smollm2-135m", cpu_matmul=sys.argv[1], kv_cache_gb=0.1)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(int(status["VmRSS"].split()[0]) / 1e6, int(status["VmHWM"].split()[0]) / 1e6)
"""


def memory_after_load(cpu_matmul: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, cpu_matmul], capture_output=True,
                         text=True, check=True)
    resident, peak = map(float, out.stdout.strip().splitlines()[-1].split())
    return {"resident_gb": resident, "peak_gb": peak}


def load_once(cache_dir: str) -> float:
    env = {**os.environ, "LONGCTX_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = load_once(cache)
        warm = [load_once(cache) for _ in range(args.repeats)]
    memory = {path: memory_after_load(path) for path in ("blas", "onednn", "kernel")}
    report = {"machine": machine_info(), "cold_s": cold, "warm_s": warm, "memory_after_llm_load": memory}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"load-{platform.node() or 'host'}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    print(f"{'load':<6} {'seconds':>8}")
    print(f"{'cold':<6} {cold:>8.2f}")
    print(f"{'warm':<6} {statistics.median(warm):>8.2f}  (median of {len(warm)}: "
          f"{', '.join(f'{w:.2f}' for w in warm)})")
    for path, m in memory.items():
        print(f"LLM(cpu_matmul={path!r}): resident {m['resident_gb']:.2f} GB, peak {m['peak_gb']:.2f} GB")


if __name__ == "__main__":
    main()

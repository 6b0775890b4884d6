"""The C kernels at each instruction-set level this CPU runs, against the torch paths they replace.

Per level (``LONGCTX_CPU_ISA``: each in its own process, the levels alternating round by round so
a slow spell of the machine hits all of them), SmolLM2-135M's shapes:

* weight products: the model's 121 matrices (30 layers of fused qkv, o, fused gate/up, down,
  plus the 49,152-row LM head) for 1, 2, 4, 8 and 64 rows, with float32 and bfloat16 weights
  through the row kernel (``cpu_linear.linear``);
* decode attention: one new token over 8,000 cached tokens in each of 30 layers' pages
  (9 query / 3 KV heads of 64), float32, bfloat16 and int8 pages (``cpu_decode.attend``).

The peers, timed in the same processes: ``F.linear`` on float32 weights; ``x @ W_t`` with
bf16 activations and weights (a bf16 model's BLAS path before the row kernel took bf16) and
``F.linear`` on bf16 activations and ``[out, in]`` bf16 weights, its result widened; and
the torch attention forms of ``torch_paged`` with the compiled kernels switched off. The
floor: a plain read (``torch.sum``) of the same weight and KV bytes.

Usage:  python benchmarks/run.py cpu-isa -- [--rounds 2] [--repeats 9] [--levels avx512bf16,avx2,portable]
        (or python benchmarks/bench_cpu_isa.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py cpu-isa, which records it
as benchmarks/results/cpu-isa/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table (median ms per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MLP, VOCAB  # noqa: E402  (SmolLM2-135M)

MATRICES = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]
ROWS = (1, 2, 4, 8, 64)
CTX, BLOCK = 8000, 64


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def worker(repeats: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from longctx.kernels import cpu_build, cpu_decode, cpu_linear, kv_quant, torch_paged

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k ** 0.5 for _ in range(LAYERS) for n, k in MATRICES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5)
    res = {"isa": cpu_build.isa(), "linear_status": cpu_linear.status(), "decode_status": cpu_decode.status(),
           "linear_ms": {}, "decode_ms": {}}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ws = [w.to(dtype) for w in weights]
        res["linear_ms"][f"read {name}"] = _median_ms(lambda: [w.sum() for w in ws], repeats)
        wts = [w.t().contiguous() for w in ws] if name == "bf16" else None
        for rows in ROWS:
            xs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, MLP)}
            res["linear_ms"][f"kernel {name} {rows}"] = _median_ms(
                lambda: [cpu_linear.linear(xs[w.shape[1]], w) for w in ws], repeats)
            if name == "fp32":
                res["linear_ms"][f"F.linear fp32 {rows}"] = _median_ms(
                    lambda: [F.linear(xs[w.shape[1]], w) for w in ws], repeats)
            else:  # the bf16 model's former path: weights [in, out], bf16 activations, BLAS
                xb = {k: x.to(torch.bfloat16) for k, x in xs.items()}
                res["linear_ms"][f"x @ W_t bf16 {rows}"] = _median_ms(
                    lambda: [xb[w.shape[0]] @ w for w in wts], repeats)
                res["linear_ms"][f"F.linear bf16 {rows}"] = _median_ms(  # weights [out, in], as the model holds them
                    lambda: [F.linear(xb[w.shape[1]], w).float() for w in ws], repeats)
        del ws, wts
    del weights
    blocks = (CTX + BLOCK - 1) // BLOCK
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    ctx_t, cu = torch.tensor([CTX], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    for name in ("fp32", "bf16", "int8"):
        pages = []
        for _ in range(LAYERS):
            k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
            if name == "int8":
                quant = []
                for x in (k, v):
                    scale = x.abs().amax(dim=(1, 3)) / kv_quant.QMAX
                    quant += [(x / scale[:, None, :, None]).round().to(torch.int8), scale.contiguous()]
                pages.append((quant[0], quant[2], {"k_scale": quant[1], "v_scale": quant[3]}))
            else:
                dtype = torch.float32 if name == "fp32" else torch.bfloat16
                pages.append((k.to(dtype), v.to(dtype), {}))
        prepared = cpu_decode.prepare(list(range(blocks)), CTX, pages[0][0])
        res["decode_ms"][f"read {name}"] = _median_ms(lambda: [(k.sum(), v.sum()) for k, v, _ in pages], repeats)
        res["decode_ms"][f"kernel {name}"] = _median_ms(
            lambda: [cpu_decode.attend(q, k, v, prepared, CTX, 0.125, **s) for k, v, s in pages], repeats)
        torch_paged.USE_CPU_KERNEL = False
        res["decode_ms"][f"torch {name}"] = _median_ms(
            lambda: [torch_paged.paged_attention(q, k, v, table, ctx_t, cu, scale=0.125, **s) for k, v, s in pages],
            repeats)
        torch_paged.USE_CPU_KERNEL = True
        del pages
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--levels", default=None, help="comma-separated (default: this CPU's best, avx2, portable)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.repeats, args.threads)))
        return
    from machine import machine_info, save_result

    from longctx.kernels import cpu_build

    levels = args.levels.split(",") if args.levels else list(dict.fromkeys([cpu_build.isa(), "avx2", "portable"]))
    runs: dict[str, list[dict]] = {level: [] for level in levels}
    for r in range(args.rounds):
        for level in levels:
            print(f"round {r + 1}: {level} ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "--worker", "--repeats", str(args.repeats),
                                   "--threads", str(args.threads)], capture_output=True, text=True,
                                  env={**os.environ, "LONGCTX_CPU_ISA": level})
            if proc.returncode:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"level {level} failed with exit code {proc.returncode}")
            runs[level].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    report = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
              "runs": runs}
    save_result(args.out, report)
    for section in ("linear_ms", "decode_ms"):
        keys = list(runs[levels[0]][0][section])
        print(f"{section:<22}" + "".join(f"{level:>24}" for level in levels))
        for key in keys:
            cells = ["/".join(f"{run[section][key]:.1f}" for run in runs[level]) for level in levels]
            print(f"{key:<22}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()

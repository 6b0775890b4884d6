"""End-to-end benchmark: longctx vs HF transformers (and, optionally, vLLM's CPU build) on the
same token ids, in one run.

Scenarios (default model, real text: the GPL-3 repeated):
  * prefill time at 1K, 2K, 4K, 8K prompt tokens (time to first token);
  * decode ms/token at 8K context, batch 1;
  * a batch of 8 requests of 2K tokens each: output tokens/s;
  * peak RSS of each engine (each runs in its own process);
  * the machine's ceilings, measured in the same run: fp32/bf16 GEMM GFLOP/s, memory copy and read GB/s
    (decode's floor: bytes read per token / the read rate).

Usage:  python benchmarks/run.py e2e -- [--quick] [--repeats N] [--engines longctx-fp32,...]
        (or python benchmarks/bench_e2e.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py e2e, which records it as
benchmarks/results/e2e/<machine>/<git rev>.json); without ``--out`` it writes nothing. Prints a
table last.

vLLM's CPU build (the peer to beat) lives in its own venv (see shared/BENCHMARKS.md):
        --vllm-python /work/vllm-venv/bin/python     (or env LONGCTX_VLLM_PYTHON)
adds the engines vllm-fp32 and vllm-bf16; without --engines the run is then
vllm-fp32,longctx-fp32,vllm-bf16,longctx-bf16 (add hf-fp32 with --engines). A vLLM worker is
this file run by that python (so this file imports only the stdlib at module level); it reads
an HF folder that benchmarks/hf_folder.py writes from the GGUF with this venv's transformers.
vLLM figures: prefill = wall time of a max_tokens=1 generate; decode ms/token = (last token's
engine timestamp - first token's) / decode_tokens on the decode_ctx prompt (prefix cache off,
greedy, ignore_eos; the wall-time form (t(decode_tokens + 1) - t(1)) / decode_tokens is kept as
decode_ms_wall). Each longctx engine is compared with the vLLM engine of its dtype (time ratios
longctx/vLLM, so < 1 means longctx is faster; peak RSS ratio; greedy tokens equal or not).
``--rounds R`` runs the engines R times in turn (each run a fresh process), for a machine whose
speed drifts between one engine's process and the next: an engine's prefill and decode figures
are then the medians over every round's repeats, its batch rate the median of its rounds, its
peak RSS the largest, and ``rounds`` keeps each round's own figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

from hf_worker import peer_env, spawn
from machine import machine_info, save_result

LICENSE = Path("/usr/share/common-licenses/GPL-3")
ENGINES = ("hf-fp32", "longctx-fp32", "longctx-bf16")
VLLM_ENGINES = ("vllm-fp32", "vllm-bf16")
VLLM_DEFAULT_ENGINES = ("vllm-fp32", "longctx-fp32", "vllm-bf16", "longctx-bf16")


# ---------------------------------------------------------------- machine facts and ceilings

def _chunk(text: str) -> int | str:
    """--chunk: 'auto' or a positive token count."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunk must be 'auto' or a token count, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--chunk must be at least 1, got {value}")
    return value


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
    # decode reads weights and KV and writes almost nothing: its floor is the read rate (a
    # reduction over the same 256 MiB), which measured ~1.8x the copy rate on the AMD EPYC
    t = best(lambda: src.sum())
    out["read_gbps"] = src.numel() * 4 / t / 1e9
    return out


# ---------------------------------------------------------------- workers (one process each)

def document_ids(tokenizer, n: int) -> list[int]:
    text = LICENSE.read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    reps = n // len(ids) + 1
    return (ids * reps)[:n]


def document_fingerprint(ids: list[int]) -> dict:
    """What the driver compares across engines: every engine must see the same prompt ids."""
    return {"n": len(ids), "head": ids[:50], "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


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
    # bf16: the file expanded to bf16 weights (gguf_weights="float"), the same work as vLLM's bf16
    # on the HF folder and as every earlier record (by default a quantized file keeps its blocks)
    llm = LLM("smollm2-135m", dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
              **({"gguf_weights": "float"} if dtype == "bf16" else {}),
              block_size=args.block_size, max_num_batched_tokens=args.chunk,
              enable_prefix_caching=False, lookahead=False)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": document_ids(tok, 256)}, one)  # warm-up
    res = {"load_s": load_s, "max_num_batched_tokens": llm.engine.sched_config.max_num_batched_tokens,
           "prefill_s": {}}
    for n in args.lengths:
        ids = document_ids(tok, n)
        times = [llm.generate({"prompt_token_ids": ids}, one)[0].metrics.time_to_first_token
                 for _ in range(args.repeats)]
        res["prefill_s"][str(n)] = times
        print(f"  {args.worker} prefill {n}: {times}", file=sys.stderr, flush=True)
    res["document"] = document_fingerprint(document_ids(tok, max(args.lengths)))
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
    from longctx.kernels import cpu_tune  # (vdpbf16ps True, widened False, not loaded None)

    res["bf16_dot"] = cpu_tune.bf16_dot_ways()
    return res


def worker_hf(args) -> dict:
    import hf_worker

    tok, model, load_s = hf_worker.load(args.threads)
    res = {"load_s": load_s, "prefill_s": {}}

    def prefill(ids):
        return hf_worker.forward(model, ids, use_cache=True)

    prefill(document_ids(tok, 256))  # warm-up
    for n in args.lengths:
        ids = document_ids(tok, n)
        res["prefill_s"][str(n)] = [prefill(ids)[0] for _ in range(args.repeats)]
        print(f"  hf prefill {n}: {res['prefill_s'][str(n)]}", file=sys.stderr, flush=True)
    res["document"] = document_fingerprint(document_ids(tok, max(args.lengths)))
    _, out = prefill(document_ids(tok, args.decode_ctx))
    tokens, times = hf_worker.decode(model, out, args.decode_tokens)
    res["decode_ms"] = [1000 * t for t in times]
    res["decode_tokens"] = tokens
    del out
    prompts = [document_ids(tok, args.batch_ctx + 97 * i)[97 * i:] for i in range(args.batch)]
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token_id = tok.eos_token_id
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    wall, gen = hf_worker.generate(model, dict(batch), max_new_tokens=args.batch_tokens,
                                   min_new_tokens=args.batch_tokens, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
    generated = (gen.shape[1] - batch["input_ids"].shape[1]) * args.batch
    res["batch"] = {"wall_s": wall, "output_tok_s": generated / wall, "decode_tok_s": None}
    res["peak_rss_gib"] = peak_rss_gib()
    return res


def _process_tree_hwm() -> dict:
    """Peak RSS (VmHWM) of this process and of every live descendant, from /proc: vLLM runs its
    engine core (and, with the mp executor, its model worker) in child processes."""
    def children(pid: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    procs, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        name = re.search(r"^Name:\s*(.*)$", status, re.MULTILINE)
        hwm = re.search(r"^VmHWM:\s*(\d+) kB", status, re.MULTILINE)
        procs[str(pid)] = {"name": name.group(1) if name else "?",
                           "peak_rss_gib": int(hwm.group(1)) / (1 << 20) if hwm else None}
        todo += children(pid)
    return procs


def worker_vllm(args) -> dict:
    """vLLM's CPU build on the HF folder of the same model; run by the python of vLLM's venv."""
    dtype = args.worker.split("-")[1]
    # before vLLM reads them: bind its OpenMP threads to cores 0..threads-1 (its default,
    # 'auto', keeps one core for the engine itself)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    folder = Path(args.hf_folder)
    config = json.loads((folder / "config.json").read_text())
    need = max(max(args.lengths), args.decode_ctx + args.decode_tokens + 1,
               args.batch_ctx + args.batch_tokens)
    max_model_len = min(need + 64, max(need, config.get("max_position_embeddings", need)))
    if args.vllm_kv_gib:
        kv_bytes = int(args.vllm_kv_gib * (1 << 30))
    else:
        # vLLM zeroes its whole KV pool (resident at once) where longctx's pages become resident
        # when written: size it to the workload (the longest request or the batch, in its
        # 128-token CPU blocks, +10%) so that peak RSS compares like with like
        def blocks(n: int) -> int:
            return -(-n // 128)

        per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                     * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
                     * (4 if dtype == "fp32" else 2))
        tokens = 128 * max(blocks(max_model_len), args.batch * blocks(args.batch_ctx + args.batch_tokens))
        kv_bytes = int(1.1 * tokens * per_token)
    kwargs = dict(model=str(folder), dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                  max_model_len=max_model_len, enable_prefix_caching=False, seed=0,
                  kv_cache_memory_bytes=kv_bytes,
                  disable_log_stats=False)  # RequestOutput.metrics is None without stats
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    print(f"  {args.worker} start-up {load_s:.1f} s", file=sys.stderr, flush=True)
    tok = llm.get_tokenizer()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(prompts, params):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    def engine_ts(out, first, last):
        m = out.metrics  # engine-core timestamps (monotonic), None when stats are off
        if m is None or not getattr(m, first, 0) or not getattr(m, last, 0):
            return None
        return getattr(m, last) - getattr(m, first)

    run([document_ids(tok, 256)], one)  # warm-up: a prefill and a few decode steps
    run([document_ids(tok, 256)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sched = llm.llm_engine.vllm_config.scheduler_config
    res = {"load_s": load_s, "vllm": vllm.__version__, "torch": torch.__version__,
           "hf_folder": str(folder), "max_model_len": max_model_len,
           "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
           "kv_cache_gib": kv_bytes / (1 << 30),
           "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING",
                                                   "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD",
                                                   "THP_MEM_ALLOC_ENABLE")},
           "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
           "prefill_s": {}, "prefill_engine_s": {}}
    for n in args.lengths:
        ids = document_ids(tok, n)
        runs = [run([ids], one) for _ in range(args.repeats)]
        res["prefill_s"][str(n)] = [t for t, _ in runs]
        res["prefill_engine_s"][str(n)] = [engine_ts(o[0], "scheduled_ts", "first_token_ts") for _, o in runs]
        print(f"  {args.worker} prefill {n}: {res['prefill_s'][str(n)]}", file=sys.stderr, flush=True)
    res["document"] = document_fingerprint(document_ids(tok, max(args.lengths)))

    # decode ms/token = (t(decode_tokens + 1) - t(1)) / decode_tokens on the decode_ctx prompt
    ids = document_ids(tok, args.decode_ctx)
    t1 = res["prefill_s"].get(str(args.decode_ctx)) or [run([ids], one)[0] for _ in range(args.repeats)]
    d = args.decode_tokens
    long_runs = [run([ids], SamplingParams(temperature=0.0, max_tokens=d + 1, ignore_eos=True))
                 for _ in range(args.repeats)]
    res["decode_t1_s"], res["decode_tn_s"] = t1, [t for t, _ in long_runs]
    res["decode_ms_wall"] = [1000 * (t - statistics.median(t1)) / d for t, _ in long_runs]
    # RequestOutput.metrics has the first and last token's engine timestamps, no per-token list:
    # (last - first) / d is the mean time per decoded token, what longctx's inter-token
    # latencies measure. It is the figure compared ("decode_ms"): the wall-time difference
    # above subtracts two ~20 s prefills at 8K and moved by +-15 ms/token between repeats.
    spans = [engine_ts(o[0], "first_token_ts", "last_token_ts") for _, o in long_runs]
    res["decode_ms_engine"] = [None if s is None else 1000 * s / d for s in spans]
    engine_ms = [x for x in res["decode_ms_engine"] if x is not None]
    res["decode_ms"] = engine_ms or res["decode_ms_wall"]
    res["decode_tokens"] = list(long_runs[0][1][0].outputs[0].token_ids)[:d]
    res["decode_tokens_all_repeats_equal"] = all(
        list(o[0].outputs[0].token_ids) == list(long_runs[0][1][0].outputs[0].token_ids) for _, o in long_runs)
    print(f"  {args.worker} decode ms/token: {res['decode_ms']} (engine timestamps: "
          f"{res['decode_ms_engine']})", file=sys.stderr, flush=True)

    prompts = [document_ids(tok, args.batch_ctx + 97 * i)[97 * i:] for i in range(args.batch)]
    wall, outs = run(prompts, SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    res["batch"] = {"wall_s": wall, "output_tok_s": generated / wall, "decode_tok_s": None}
    if all(o.metrics is not None and o.metrics.first_token_ts and o.metrics.last_token_ts for o in outs):
        span = max(o.metrics.last_token_ts for o in outs) - max(o.metrics.first_token_ts for o in outs)
        res["batch"]["decode_tok_s"] = (generated - len(outs)) / span if span > 0 else None

    # peak RSS: this process, and the engine processes vLLM started (VmHWM while they live;
    # RUSAGE_CHILDREN after they have exited and been waited for)
    res["processes"] = _process_tree_hwm()
    self_gib = peak_rss_gib()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001 - recorded, the figures above stand
        res["shutdown_error"] = repr(err)
    children_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1 << 20)
    hwm = [p["peak_rss_gib"] for p in res["processes"].values() if p["peak_rss_gib"] is not None]
    res["peak_rss_self_gib"], res["peak_rss_children_gib"] = self_gib, children_gib
    res["peak_rss_gib"] = max([self_gib, children_gib, *hwm])  # the largest single process
    res["peak_rss_sum_gib"] = sum(hwm)  # every process at its own peak: an upper bound of the total
    return res


# ---------------------------------------------------------------- driver

def run_worker(engine: str, args) -> dict:
    python = args.vllm_python if engine in VLLM_ENGINES else sys.executable
    cmd = ["--worker", engine, "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--lengths", ",".join(map(str, args.lengths)),
           "--decode-ctx", str(args.decode_ctx), "--decode-tokens", str(args.decode_tokens),
           "--batch", str(args.batch), "--batch-ctx", str(args.batch_ctx),
           "--batch-tokens", str(args.batch_tokens), "--chunk", str(args.chunk),
           "--block-size", str(args.block_size)]
    if engine in VLLM_ENGINES:
        cmd += ["--hf-folder", str(args.hf_folder), "--vllm-kv-gib", str(args.vllm_kv_gib)]
    res, wall = spawn(__file__, cmd, engine, python=python, env=None if engine.startswith("longctx") else peer_env())
    res["worker_wall_s"] = wall
    return res


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
        floor_ms = 1000 * decode_bytes(args.decode_ctx, 2 if name.endswith("bf16") else 4) / (
            ceil.get("read_gbps", ceil["copy_gbps"]) * 1e9)
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
        peer = vllm_peer(name, results)
        if peer is not None:
            out[name]["vs_vllm"] = vs_vllm(r, results[peer], peer)
    return out


def vllm_peer(name: str, results: dict) -> str | None:
    """The vLLM engine a longctx engine is compared with: the one of the same dtype."""
    if not name.startswith("longctx-"):
        return None
    peer = "vllm-" + name.split("-", 1)[1]
    return peer if peer in results else None


def leading_equal(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def vs_vllm(r: dict, v: dict, peer: str) -> dict:
    """longctx / vLLM: time ratios (< 1: longctx faster), peak RSS ratio, greedy tokens."""
    med = statistics.median
    a, b = r["decode_tokens"], v["decode_tokens"]
    n = min(len(a), len(b))
    return {"engine": peer,
            "prefill_time_ratio": {k: med(r["prefill_s"][k]) / med(v["prefill_s"][k])
                                   for k in r["prefill_s"] if k in v["prefill_s"]},
            "decode_ms_ratio": med(r["decode_ms"]) / med(v["decode_ms"]),
            "batch_time_ratio": v["batch"]["output_tok_s"] / r["batch"]["output_tok_s"],
            "peak_rss_ratio": r["peak_rss_gib"] / v["peak_rss_gib"],
            "peak_rss_ratio_vs_process_sum": r["peak_rss_gib"] / v.get("peak_rss_sum_gib", v["peak_rss_gib"]),
            "decode_tokens_equal": a[:n] == b[:n] and n > 0,
            "decode_tokens_compared": n,
            "identical_leading_tokens": leading_equal(a, b)}


POOLED_LISTS = ("decode_ms", "decode_ms_wall", "decode_ms_engine")  # merge_rounds' treatment of a result's fields
POOLED_DICTS = ("prefill_s", "prefill_engine_s")
MAXED = ("peak_rss_gib", "peak_rss_sum_gib", "peak_rss_self_gib", "peak_rss_children_gib")


def merge_rounds(rounds: list[dict]) -> dict:
    """Each engine's results over rounds of the same run (one dict of engine -> result per
    round) as one result: the prefill and decode samples pooled (their medians are taken
    later), the batch of the round with the median rate, the peak RSS figures the largest (and
    the process tree of the round with the largest); the first round's other fields, each
    round's own figures under ``rounds``, and whether every round gave the same greedy tokens.
    One round: its results as they are."""
    if len(rounds) == 1:
        return rounds[0]
    merged = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        m = dict(runs[0])
        for key in POOLED_LISTS:
            if key in m:
                m[key] = [t for r in runs for t in r[key]]
        for key in POOLED_DICTS:
            if key in m:
                m[key] = {n: [t for r in runs for t in r[key][n]] for n in m[key]}
        m["batch"] = sorted((r["batch"] for r in runs), key=lambda b: b["output_tok_s"])[len(runs) // 2]
        for key in MAXED:
            if key in m:
                m[key] = max(r[key] for r in runs)
        if "processes" in m:
            m["processes"] = max(runs, key=lambda r: r["peak_rss_gib"])["processes"]
        m["decode_tokens_same_in_every_round"] = all(r["decode_tokens"] == runs[0]["decode_tokens"] for r in runs)
        m["rounds"] = [{"prefill_s": r["prefill_s"], "decode_ms": r["decode_ms"],
                        "batch_output_tok_s": r["batch"]["output_tok_s"], "peak_rss_gib": r["peak_rss_gib"]}
                       for r in runs]
        merged[name] = m
    return merged


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
    pairs = [(name, vllm_peer(name, results)) for name in results if vllm_peer(name, results)]
    if pairs:
        rows.append("longctx / vLLM of the same dtype (time and RSS ratios: < 1 = longctx faster or smaller)")
        for name, peer in pairs:
            d = vs_vllm(results[name], results[peer], peer)
            def x(value):
                return f"{value:.2f}x"

            cells = " ".join(f"{x(d['prefill_time_ratio'][str(n)]):>13}" for n in lengths)
            tokens = (f"greedy tokens equal ({d['decode_tokens_compared']})" if d["decode_tokens_equal"] else
                      f"greedy tokens differ from #{d['identical_leading_tokens']} of {d['decode_tokens_compared']}")
            rows.append(f"{name + '/vllm':<14} {cells} {x(d['decode_ms_ratio']):>14}"
                        f" {x(d['batch_time_ratio']):>12} {x(d['peak_rss_ratio']):>13}  {tokens}")
    bf16 = f"{ceil['gemm_bf16_gflops']:.0f} GFLOP/s" if "gemm_bf16_gflops" in ceil else "not measured"
    rows.append(f"ceilings: fp32 GEMM {ceil['gemm_fp32_gflops']:.0f} GFLOP/s, bf16 GEMM {bf16}, "
                f"copy {ceil['copy_gbps']:.1f} GB/s, read {ceil.get('read_gbps', float('nan')):.1f} GB/s")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=ENGINES + VLLM_ENGINES)
    p.add_argument("--engines", default=None,
                   help=f"default: {','.join(ENGINES)}; with --vllm-python: {','.join(VLLM_DEFAULT_ENGINES)}")
    p.add_argument("--vllm-python", default=os.environ.get("LONGCTX_VLLM_PYTHON"),
                   help="python of vLLM's CPU venv (env LONGCTX_VLLM_PYTHON); enables vllm-fp32, vllm-bf16")
    p.add_argument("--vllm-kv-gib", type=float, default=0.0,
                   help="vLLM's KV cache in GiB (kv_cache_memory_bytes); 0: sized to the workload")
    p.add_argument("--hf-folder", default=None,
                   help="HF folder of the model for vLLM (default: written by benchmarks/hf_folder.py)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engines this many times in turn (fresh processes): medians over all rounds")
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--decode-ctx", type=int, default=8000)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-ctx", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--chunk", type=_chunk, default="auto",
                   help="longctx's max_num_batched_tokens: a token count, or 'auto' (the engine's own choice, "
                        "4096 for this model since 2026-12-07; the records before used 2048)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.quick:
        args.lengths, args.decode_ctx, args.decode_tokens = [256, 512], 512, 8
        args.batch, args.batch_ctx, args.batch_tokens, args.repeats = 2, 256, 4, 1
    if args.worker:
        res = (worker_hf if args.worker == "hf-fp32" else
               worker_vllm if args.worker in VLLM_ENGINES else worker_longctx)(args)
        print(json.dumps(res), flush=True)
        return
    if args.engines is None:
        args.engines = ",".join(VLLM_DEFAULT_ENGINES if args.vllm_python else ENGINES)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES + VLLM_ENGINES]
    if unknown:
        p.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES + VLLM_ENGINES)}")
    if any(e in VLLM_ENGINES for e in engines):
        if not args.vllm_python:
            p.error("vllm-* engines need --vllm-python (or LONGCTX_VLLM_PYTHON): the python of vLLM's venv")
        if not os.access(args.vllm_python, os.X_OK):
            p.error(f"--vllm-python {args.vllm_python} is not an executable")
        if args.hf_folder is None:
            from hf_folder import write_hf_folder
            args.hf_folder = str(write_hf_folder())
    ceil = ceilings(args.threads, bf16="bf16" in args.engines)
    results = merge_rounds([{e: run_worker(e, args) for e in engines} for _ in range(args.rounds)])
    info = machine_info()
    report = {"machine": info, "ceilings": ceil, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results, "derived": derived(results, ceil, args)}
    if "longctx-fp32" in results and "longctx-bf16" in results:
        a, b = results["longctx-fp32"]["decode_tokens"], results["longctx-bf16"]["decode_tokens"]
        report["bf16_vs_fp32_identical_leading_tokens"] = leading_equal(a, b)
    if "hf-fp32" in results and "longctx-fp32" in results:
        report["longctx_fp32_decode_tokens_equal_hf"] = (
            results["hf-fp32"]["decode_tokens"] == results["longctx-fp32"]["decode_tokens"])
    docs = {json.dumps(r["document"], sort_keys=True) for r in results.values() if "document" in r}
    if len(results) > 1 and docs:
        # every engine tokenized the same text itself: its prompt ids must be the same
        report["document_ids_identical"] = len(docs) == 1
    save_result(args.out, report)
    for row in summarize(results, ceil, args.lengths, args.decode_ctx):
        print(row)
    for name, d in report["derived"].items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in d.items() if not isinstance(v, dict)))
    for name, r in results.items():
        if name in VLLM_ENGINES:
            procs = ", ".join(f"{q['name']} {q['peak_rss_gib']:.2f}" for q in r["processes"].values()
                              if q["peak_rss_gib"] is not None)
            print(f"{name}: vLLM {r['vllm']}, start-up {r['load_s']:.1f} s, multiprocessing "
                  f"{r['multiprocessing']}, decode ms/token from engine timestamps "
                  f"{[round(x, 2) for x in r['decode_ms_engine'] if x is not None]}, peak RSS GiB per "
                  f"process: {procs} (sum {r['peak_rss_sum_gib']:.2f}; RUSAGE_CHILDREN {r['peak_rss_children_gib']:.2f})")
    for name, r in results.items():
        if "decode_tokens_same_in_every_round" in r:
            print(f"{name}: greedy tokens the same in every round: {r['decode_tokens_same_in_every_round']}")
    for key in ("bf16_vs_fp32_identical_leading_tokens", "longctx_fp32_decode_tokens_equal_hf",
                "document_ids_identical"):
        if key in report:
            print(f"{key}: {report[key]}")


if __name__ == "__main__":
    main()

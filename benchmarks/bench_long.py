"""Long-context benchmark: float32 vs int8 KV pages at 8K, 16K and 32K tokens, in one run.

The default model (SmolLM2-135M, an 8K window) stretched to 32K with RoPE scaling (YaRN,
factor 4, ``original_max_position_embeddings`` 8192; the same override at every context, so
the contexts are comparable), greedy, ``ignore_eos``, lookahead off, prefix caching on.
The prompt is real text: the licenses in /usr/share/common-licenses (GPL-3 first, then the
others by name; the repository's docs and a repeat only if more tokens are needed), tokenized
file by file with the engine's tokenizer and concatenated. Token ids are passed, not text.

Per KV dtype (``auto``: the model's dtype, float32 on the CPU; ``int8``), one process
(this script re-invoked with ``--one-dtype``), one engine, contexts as a staircase, so the
machine runs one 32K prefill per dtype and not 8K + 16K + 32K:

  * prompt[:8192], ``--decode-tokens`` new tokens: its TTFT is the 8K prefill; decode
    ms/token = (time of the last token - time of the first) / (N - 1), from the request's
    metrics (``RequestMetrics.token_times``);
  * prompt[:16384]: the prefix store serves the first 8K from the device tier, so its TTFT
    is the prefill of tokens 8K..16K over them; the cold 16K prefill is reported as the sum
    TTFT(8K) + TTFT(16K stage): each stage prefills only its new tokens over the cached
    earlier ones, the same chunks a cold prefill runs (when the contexts are multiples of
    ``max_num_batched_tokens``; ``staircase_aligned`` in the JSON says whether they are);
    each stage adds one extra first-token sampling step, a few ms;
  * prompt[:32768] likewise.

KV budget: int8 runs with the engine's default ``kv_cache_gb`` (1 GiB on the CPU; not
passed); float32 is given a budget just big enough for the longest context + decode,
computed from the model config, and the JSON records how many tokens float32 pages fit in
the default budget (32K does not fit 1 GiB in float32; it does in int8).

Also per dtype: KV bytes per token (the format's ``page_bytes / block_size``, int8 including its
scales), peak RSS (``ru_maxrss`` of the process, after the staircase and at its end), RSS
after the model loaded, and the TTFT of a device-tier prefix hit at the longest context
(prompt + a new ~20-token question, one output token).

Prefix hits per tier at the longest context, int8 only: the int8 engine has a
``disk_cache_dir``; after the staircase and the device hit, ``llm.close()`` persists its
pages; a fresh process with the same folder asks prompt + another question: disk-tier TTFT
(model load not counted; the files are likely in the OS page cache, as after any recent
write). That process has a 1 GiB host tier (``--host-cache-gb``; on the CPU the host tier
exists only when sized): it then pushes every device page to the host tier (untimed) and asks
a third question: host-tier TTFT. Each is also given as a fraction of the cold prefill (the
staircase sum).

Paired decode steps at the longest context (``--paired-rounds``, default 4; 0 skips): both
staircases persist their pages (float32 to a folder of its own), and one more process loads a
float32 and an int8 engine from them and runs their decode steps alternately, each
``engine.step()`` timed, the order swapped every step; the median of the per-pair int8/float32
ratios is ``derived.decode_ms_ratio_int8_over_fp32_paired``. This machine's speed drifts by tens
of percent between and within runs; pairs ~0.1 s apart mostly cancel it (see ``worker_paired``).

One staircase per dtype (a 32K prefill takes minutes here): no repeats; decode is the mean
over N - 1 steps, and the median inter-token latency is also given. The machine's ceilings
(fp32 GEMM, memory copy) are measured first, and decode is given as a multiple of its
bandwidth floor (fp32 weights + the KV bytes of the context read once per token).

Usage:  python benchmarks/run.py long -- [--contexts 8192 16384 32768] [--decode-tokens 32]
            [--dtypes auto int8] [--max-num-batched-tokens N] [--threads 2] [--paired-rounds 4]
        (or python benchmarks/bench_long.py ... [--out FILE])
Prints one JSON line per measurement as it goes and a table last.
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py long, which records it
as benchmarks/results/long/<machine>/<git rev>.json); without ``--out`` it writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_e2e import peak_rss_gib
from machine import ROOT, machine_info, save_result

LICENSES = Path("/usr/share/common-licenses")
MODEL = "smollm2-135m"
ROPE_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
QUESTION_TOKENS = 20
FP32_MARGIN_BLOCKS = 8  # spare pages in the float32 budget (cached decode pages of earlier stages)
STAIRCASE_NOTE = ("prefill_s is the sum of the staircase stages; each stage prefills only its new "
                  "tokens over the cached earlier ones, the same chunks a cold prefill runs")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def emit(record: dict) -> None:
    """One measurement, one JSON line, at once (a long run shows its progress)."""
    print(json.dumps(record), flush=True)


# ---------------------------------------------------------------- the prompt

def text_sources() -> list[Path]:
    """Real text, GPL-3 first (the project's usual prompt), then the other licenses by name
    (links skipped: they repeat a file), then the repository's docs."""
    licenses = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink()) \
        if LICENSES.is_dir() else []
    first = [p for p in licenses if p.name == "GPL-3"]
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return first + [p for p in licenses if p.name != "GPL-3"] + [p for p in docs if p.is_file()]


def document_ids(tokenizer, n: int) -> tuple[list[int], list[str]]:
    """``n`` token ids of real text (repeated if all the sources are shorter) and the names of
    the files used."""
    ids: list[int] = []
    used: list[str] = []
    sources = text_sources()
    if not sources:
        raise SystemExit(f"no text found under {LICENSES} or {ROOT / 'docs'}")
    while len(ids) < n:
        for path in sources:
            ids += tokenizer.encode(path.read_text(errors="replace") + "\n\n", add_special_tokens=False)
            used.append(str(path))
            if len(ids) >= n:
                break
    return ids[:n], used


def question_ids(tokenizer, i: int) -> list[int]:
    text = (f"\n\nQuestion {i}: which obligations does section {i + 3} of the text above place on "
            f"someone who conveys the work, and why?\nAnswer:")
    ids = tokenizer.encode(text, add_special_tokens=False)[:QUESTION_TOKENS]
    return ids


def warmup_ids(tokenizer) -> list[int]:
    """A prompt sharing no page with the document (so the warm-up caches nothing it uses)."""
    text = " ".join(f"Item {i} of the warm-up list is the number {i * 7 % 31}." for i in range(40))
    return tokenizer.encode(text, add_special_tokens=False)[:256]


# ---------------------------------------------------------------- memory

def current_rss_gib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- workers (one process each)

def engine_kwargs(args, dtype: str) -> dict:
    kw: dict = {"kv_cache_dtype": "int8" if dtype == "int8" else "auto", "lookahead": False,
                "enable_prefix_caching": True, "max_model_len": args.max_model_len}
    if args.rope_scaling:
        kw["rope_scaling"] = args.rope_scaling
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.kv_cache_gb:
        kw["kv_cache_gb"] = args.kv_cache_gb
    if args.disk_dir:
        kw["disk_cache_dir"] = args.disk_dir
    return kw


def hit_delta(before, after) -> dict:
    return {k: after.hit_tokens.get(k, 0) - before.hit_tokens.get(k, 0) for k in after.hit_tokens}


def timed_request(llm, ids: list[int], max_tokens: int) -> dict:
    """One request alone; TTFT, decode ms/token and the cache tiers that served its prompt."""
    from longctx import SamplingParams

    before = llm.cache_stats()
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    after = llm.cache_stats()
    m = out.metrics
    tokens = out.outputs[0].token_ids
    res = {"prompt_tokens": len(ids), "ttft_s": m.time_to_first_token, "hit_tokens": hit_delta(before, after),
           "computed_prompt_tokens": after.computed_prompt_tokens - before.computed_prompt_tokens,
           "output_tokens": len(tokens), "output_token_ids": tokens}
    if len(tokens) >= 2:
        last = m.token_times[-1] if m.token_times else m.finished_time
        res["decode_ms_per_token"] = 1000 * (last - m.first_token_time) / (len(tokens) - 1)
        res["decode_itl_ms_median"] = 1000 * statistics.median(m.inter_token_latencies)
    return res


def engine_facts(llm) -> dict:
    from dataclasses import asdict

    eng = llm.engine
    cc = eng.cache_config
    return {"kv_cache_gb": cc.kv_cache_gb, "num_blocks": eng.kv.num_blocks, "block_size": cc.block_size,
            "capacity_tokens": eng.kv.num_blocks * cc.block_size, "kv_storage_dtype": str(eng.kv_dtype),
            "model_dtype": str(eng.dtype), "max_num_batched_tokens": eng.scheduler.config.max_num_batched_tokens,
            "max_model_len": eng.max_model_len, "host_cache_gb": cc.host_cache_gb,
            "model_rope_scaling": asdict(eng.model_config.rope_scaling)}


def build_llm(args, dtype: str, **extra):
    import torch

    from longctx import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args, dtype), **extra)
    load_s = time.perf_counter() - t0
    rss = current_rss_gib()  # after the model loaded, before the warm-up
    tok = llm.engine.tokenizer
    llm.generate({"prompt_token_ids": warmup_ids(tok)},  # warm-up: prefill and decode paths
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.clear_prefix_cache()  # the warm-up's pages (they share nothing with the document anyway)
    return llm, tok, load_s, rss


def worker_staircase(args) -> dict:
    dtype = args.one_dtype
    res: dict = {"dtype": dtype, "started_at": now_iso(), "kv_cache_gb_passed": args.kv_cache_gb or None}
    llm, tok, res["load_s"], res["rss_after_load_gib"] = build_llm(args, dtype)
    res["engine"] = engine_facts(llm)
    emit({"dtype": dtype, "event": "loaded", "load_s": res["load_s"], "rss_gib": res["rss_after_load_gib"],
          **{k: res["engine"][k] for k in ("kv_cache_gb", "num_blocks", "block_size", "kv_storage_dtype")}})
    contexts = sorted(args.contexts)
    doc, res["prompt_sources"] = document_ids(tok, max(contexts))
    stages, prefill = [], 0.0
    for ctx in contexts:
        r = timed_request(llm, doc[:ctx], args.decode_tokens)
        prefill += r["ttft_s"]
        r = {"context": ctx, "cached_tokens": sum(r["hit_tokens"].values()),
             "new_tokens": r["computed_prompt_tokens"], "stage_ttft_s": r["ttft_s"], "prefill_s": prefill, **r}
        del r["ttft_s"]
        stages.append(r)
        emit({"dtype": dtype, "event": "stage", **{k: v for k, v in r.items() if k != "output_token_ids"}})
    res["stages"] = stages
    res["peak_rss_gib_after_staircase"] = peak_rss_gib()
    res["rss_after_staircase_gib"] = current_rss_gib()  # the pages in use now, without the load's transient peak
    hit = timed_request(llm, doc[:max(contexts)] + question_ids(tok, 1), 1)
    hit["context"] = max(contexts)
    res["device_hit"] = hit
    emit({"dtype": dtype, "event": "device_hit", **{k: v for k, v in hit.items() if k != "output_token_ids"}})
    if args.disk_dir:
        t0 = time.perf_counter()
        llm.close()  # persists every cached page to the disk tier
        res["persist_s"] = time.perf_counter() - t0
        res["pages_written_to_disk"] = llm.engine.prefix_cache.disk.num_written
        emit({"dtype": dtype, "event": "persisted", "persist_s": res["persist_s"],
              "pages_written_to_disk": res["pages_written_to_disk"]})
    res["peak_rss_gib"] = peak_rss_gib()
    res["finished_at"] = now_iso()
    emit({"dtype": dtype, "event": "done", "rss_after_staircase_gib": res["rss_after_staircase_gib"],
          "peak_rss_gib_after_staircase": res["peak_rss_gib_after_staircase"], "peak_rss_gib": res["peak_rss_gib"]})
    return res


def worker_tiers(args) -> dict:
    """A fresh process on the disk folder the staircase process persisted: disk hit, then the
    same pages pushed to the host tier: host hit."""
    dtype = args.one_dtype
    res: dict = {"dtype": dtype, "started_at": now_iso()}
    llm, tok, res["load_s"], _ = build_llm(args, dtype, host_cache_gb=args.host_cache_gb)
    res["engine"] = engine_facts(llm)
    ctx = max(args.contexts)
    doc, _ = document_ids(tok, ctx)
    disk = timed_request(llm, doc + question_ids(tok, 2), 1)
    disk["context"] = ctx
    res["disk_hit"] = disk
    emit({"dtype": dtype, "event": "disk_hit", **{k: v for k, v in disk.items() if k != "output_token_ids"}})
    cache = llm.engine.prefix_cache
    if cache.host_kv is None:
        res["host_hit"] = {"not_measured": "no host tier was built (host_cache_gb 0)"}
    else:
        cache.make_room(cache.tree.num_device_pages)  # every cached page to the host tier
        llm.engine.run_pending_kv_orders()  # the copies themselves, not timed
        res["pages_on_host"] = cache.tree.num_host_pages
        host = timed_request(llm, doc + question_ids(tok, 3), 1)
        host["context"] = ctx
        res["host_hit"] = host
        emit({"dtype": dtype, "event": "host_hit", "pages_on_host": res["pages_on_host"],
              **{k: v for k, v in host.items() if k != "output_token_ids"}})
    res["peak_rss_gib"] = peak_rss_gib()
    res["finished_at"] = now_iso()
    llm.close()
    return res


def worker_paired(args) -> dict:
    """Decode at the longest context, float32 and int8 pages in one process, step by step in
    turn: two engines, each loaded from the disk folder its staircase persisted (that request,
    a disk hit, is not counted). Then per round each engine takes the same request (the
    document alone: a device hit that recomputes its last page), runs it to its first token,
    and the two run their decode steps alternately (``engine.step()``, timed one by one; the
    order swaps every step: fp32 first on even steps) for ``--decode-tokens`` steps. The
    machine's speed moves by tens of percent over seconds to minutes (the staircases' decode
    rates moved 20-40% between runs here, and whole requests of a few seconds by as much), so
    a ratio of two separate measurements carries that drift; a pair of steps taken ~0.1 s
    apart mostly does not. Reported: each step's time, the per-pair int8/fp32 ratios and
    their median."""
    import torch

    from longctx import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    ctx = max(args.contexts)
    res: dict = {"context": ctx, "started_at": now_iso(), "rounds": []}
    llms = {}
    for dtype, folder in (("auto", args.disk_dir_fp32), ("int8", args.disk_dir)):
        kw = {**engine_kwargs(args, dtype), "disk_cache_dir": folder}
        if dtype == "int8":  # the budget passed is the float32 staircase's; int8 keeps the default
            kw.pop("kv_cache_gb", None)
        llms[dtype] = LLM(args.model, **kw)
    tok = llms["int8"].engine.tokenizer
    doc, _ = document_ids(tok, ctx)
    for dtype, llm in llms.items():
        first = timed_request(llm, doc, 2)
        res[f"{dtype}_load_request"] = {k: v for k, v in first.items() if k != "output_token_ids"}
    # two tokens past the timed steps: the first comes with the prompt, the last step finishes
    # the request (its pages go to the prefix store), which is not a decode step's work
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 2, ignore_eos=True)
    engines = {d: llm.engine for d, llm in llms.items()}
    every: dict = {"auto": [], "int8": []}  # every timed step, over the rounds
    for i in range(args.paired_rounds):
        for eng in engines.values():  # the prompt, to its first token (not timed)
            rid = eng.add_request(doc, params)
            while not eng.output(rid).outputs[0].token_ids:
                eng.step()
        ms: dict = {"auto": [], "int8": []}
        for step in range(args.decode_tokens):
            for d in (("auto", "int8") if step % 2 == 0 else ("int8", "auto")):
                t0 = time.perf_counter()
                engines[d].step()
                ms[d].append(1000 * (time.perf_counter() - t0))
        for eng in engines.values():
            while eng.has_unfinished():
                eng.step()
        for d, v in ms.items():
            every[d] += v
        ratios = [b / a for a, b in zip(ms["auto"], ms["int8"])]
        row = {"round": i, "fp32_step_ms": ms["auto"], "int8_step_ms": ms["int8"], "int8_over_fp32": ratios,
               "median_ratio": statistics.median(ratios),
               "median_ms": {d: statistics.median(v) for d, v in ms.items()}}
        res["rounds"].append(row)
        emit({"event": "paired_round", "context": ctx, "round": i, "fp32_ms_median": row["median_ms"]["auto"],
              "int8_ms_median": row["median_ms"]["int8"], "int8_over_fp32_median": row["median_ratio"]})
    if res["rounds"]:
        res["decode_ms_median"] = {d: statistics.median(v) for d, v in every.items()}
        res["ratio_median"] = statistics.median(x for r in res["rounds"] for x in r["int8_over_fp32"])
        res["ratio_of_medians"] = res["decode_ms_median"]["int8"] / res["decode_ms_median"]["auto"]
        res["round_medians"] = [r["median_ratio"] for r in res["rounds"]]
    res["peak_rss_gib"] = peak_rss_gib()
    res["finished_at"] = now_iso()
    return res


# ---------------------------------------------------------------- driver

def kv_facts(args, block_size: int) -> dict:
    """Bytes per KV page and token per dtype, from the model config (header only, no weights),
    and what the default budget holds."""
    import torch

    from longctx.config import DEFAULT_KV_CACHE_GB
    from longctx.kv.formats import FloatPages, Int8Pages
    from longctx.model.config import ModelConfig
    from longctx.model.loader import read_gguf, resolve_model

    path = resolve_model(args.model)
    cfg = ModelConfig.from_hf_folder(path) if path.is_dir() else read_gguf(path)[0]
    need = max(args.contexts) + args.extra_tokens
    out: dict = {"model_config": {"num_hidden_layers": cfg.num_hidden_layers,
                                  "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                                  "max_position_embeddings": cfg.max_position_embeddings},
                 "block_size": block_size, "default_kv_cache_gb": DEFAULT_KV_CACHE_GB,
                 "tokens_needed_at_max_context": need}
    for fmt in (FloatPages(cfg, torch.float32), Int8Pages(cfg, torch.float32)):  # auto = float32 on the CPU
        name, dtype, bpb = fmt.name, fmt.storage_dtype, fmt.page_bytes(block_size)
        blocks = int(DEFAULT_KV_CACHE_GB * (1 << 30)) // bpb
        out[name] = {"storage_dtype": str(dtype).removeprefix("torch."), "bytes_per_block": bpb,
                     "bytes_per_token": bpb / block_size, "default_budget_blocks": blocks,
                     "default_budget_tokens": blocks * block_size,
                     "fits_default_budget_at_max_context": blocks * block_size >= need}
    out["int8_over_fp32_bytes"] = out["int8"]["bytes_per_token"] / out["auto"]["bytes_per_token"]
    blocks = math.ceil(need / block_size) + FP32_MARGIN_BLOCKS
    bpb = out["auto"]["bytes_per_block"]
    out["auto"]["budget_passed_gb"] = (blocks * bpb + bpb // 2) / (1 << 30)  # blocks pages, exactly
    out["auto"]["budget_passed_blocks"] = blocks
    return out


def run_worker(args, dtype: str, phase: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        json_out, err = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        cmd = [sys.executable, __file__, "--one-dtype", dtype, "--phase", phase, "--json-out", str(json_out),
               "--contexts", *map(str, args.contexts), "--decode-tokens", str(args.decode_tokens),
               "--threads", str(args.threads), "--model", args.model, "--max-model-len", str(args.max_model_len),
               "--rope-scaling", json.dumps(args.rope_scaling) if args.rope_scaling else "none",
               "--host-cache-gb", str(args.host_cache_gb), "--paired-rounds", str(args.paired_rounds), *extra]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        emit({"event": "start", "dtype": dtype, "phase": phase, "at": now_iso()})
        with open(err, "w") as errf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True)
            for line in proc.stdout:  # the worker's measurement lines, as they come
                print(line, end="", flush=True)
            rc = proc.wait()
        if rc != 0 or not json_out.is_file():
            tail = err.read_text(errors="replace")[-3000:]
            sys.stderr.write(tail)
            return {"error": f"worker {dtype} {phase} failed with exit code {rc}", "stderr_tail": tail}
        return json.loads(json_out.read_text())


def derive(report: dict, ceil: dict | None) -> dict:
    res = report["results"]
    out: dict = {}
    ok = {d: r for d, r in res.items() if "stages" in r}
    by_ctx = {d: {s["context"]: s for s in r["stages"]} for d, r in ok.items()}
    if "auto" in ok and "int8" in ok:
        ctxs = sorted(set(by_ctx["auto"]) & set(by_ctx["int8"]))
        a, b = by_ctx["auto"], by_ctx["int8"]
        out["decode_ms_ratio_int8_over_fp32"] = {
            str(c): b[c]["decode_ms_per_token"] / a[c]["decode_ms_per_token"]
            for c in ctxs if a[c].get("decode_ms_per_token") and b[c].get("decode_ms_per_token")}
        out["prefill_s_ratio_int8_over_fp32"] = {str(c): b[c]["prefill_s"] / a[c]["prefill_s"] for c in ctxs}
        out["peak_rss_ratio_int8_over_fp32"] = ok["int8"]["peak_rss_gib"] / ok["auto"]["peak_rss_gib"]
        out["int8_vs_fp32_identical_leading_tokens"] = {}
        for c in ctxs:
            x, y = a[c]["output_token_ids"], b[c]["output_token_ids"]
            out["int8_vs_fp32_identical_leading_tokens"][str(c)] = next(
                (i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    paired = report.get("paired_decode") or {}
    if "ratio_median" in paired:
        out["decode_ms_ratio_int8_over_fp32_paired"] = {str(paired["context"]): paired["ratio_median"]}
    if ceil and ceil.get("copy_gbps"):
        from bench_e2e import decode_bytes

        weights = decode_bytes(0, 4)  # float32 weights, tied LM head included, read once per token
        out["weight_bytes"] = weights
        out["decode_floor_ms"], out["decode_multiple_of_floor"] = {}, {}
        for d, stages in by_ctx.items():
            bpt = report["kv"][d]["bytes_per_token"]
            floors = {c: 1000 * (weights + bpt * c) / (ceil["copy_gbps"] * 1e9) for c in stages}
            out["decode_floor_ms"][d] = {str(c): f for c, f in floors.items()}
            out["decode_multiple_of_floor"][d] = {str(c): s["decode_ms_per_token"] / floors[c]
                                                  for c, s in stages.items() if s.get("decode_ms_per_token")}
    tiers = report.get("tiers") or {}
    cold = (by_ctx.get("int8") or {}).get(max(report["args"]["contexts"]), {}).get("prefill_s")
    if cold:
        out["int8_cold_prefill_s_at_max_context"] = cold
        out["int8_hit_fraction_of_cold"] = {t: v["ttft_s"] / cold for t, v in tiers.items()
                                           if isinstance(v, dict) and "ttft_s" in v}
    return out


def table(report: dict) -> list[str]:
    rows = [f"{'KV dtype':<15} {'context':>8} {'new tok':>8} {'stage s':>9} {'prefill s':>10} "
            f"{'decode ms/tok':>14} {'int8/fp32':>10}"]
    ratio = (report.get("derived") or {}).get("decode_ms_ratio_int8_over_fp32") or {}
    for d, r in report["results"].items():
        if "stages" not in r:
            rows.append(f"{d:<15} {r.get('error', 'no result')}")
            continue
        name = f"{d} ({r['engine']['kv_storage_dtype'].removeprefix('torch.')})" if d == "auto" else d
        for s in r["stages"]:
            dec = s.get("decode_ms_per_token")
            rat = f"{ratio[str(s['context'])]:.2f}x" if d == "int8" and str(s["context"]) in ratio else ""
            rows.append(f"{name:<15} {s['context']:>8} {s['new_tokens']:>8} {s['stage_ttft_s']:>9.2f} "
                        f"{s['prefill_s']:>10.2f} {(f'{dec:.1f}' if dec else '-'):>14} {rat:>10}")
        rows.append(f"{'':<15} peak RSS {r['peak_rss_gib']:.2f} GiB (after the staircase "
                    f"{r['rss_after_staircase_gib']:.2f} GiB), KV pool {r['engine']['kv_cache_gb']:.3g} GiB "
                    f"= {r['engine']['num_blocks']} pages of {r['engine']['block_size']}, device hit at "
                    f"{r['device_hit']['context']}: {r['device_hit']['ttft_s']:.3f} s")
    kv = report["kv"]
    rows.append(f"KV bytes/token: fp32 {kv['auto']['bytes_per_token']:.0f}, int8 {kv['int8']['bytes_per_token']:.1f} "
                f"({kv['int8_over_fp32_bytes']:.3f}x); default {kv['default_kv_cache_gb']:g} GiB holds "
                f"{kv['auto']['default_budget_tokens']} fp32 / {kv['int8']['default_budget_tokens']} int8 tokens")
    paired = report.get("paired_decode") or {}
    if "ratio_median" in paired:
        each = " ".join(f"{x:.3f}" for x in paired["round_medians"])
        rows.append(f"paired decode steps at {paired['context']} ({len(paired['rounds'])} rounds, alternating): fp32 "
                    f"{paired['decode_ms_median']['auto']:.1f} ms/tok, int8 {paired['decode_ms_median']['int8']:.1f} "
                    f"ms/tok (medians); int8/fp32 median of the pairs {paired['ratio_median']:.3f}x (rounds: {each})")
    elif paired:
        rows.append(f"paired decode: {paired.get('not_measured') or paired.get('error')}")
    frac = (report.get("derived") or {}).get("int8_hit_fraction_of_cold") or {}
    for t, v in (report.get("tiers") or {}).items():
        if t == "process":
            continue
        if isinstance(v, dict) and "ttft_s" in v:
            rows.append(f"int8 {t} at {v['context']}: TTFT {v['ttft_s']:.3f} s ({100 * frac.get(t, 0):.2f}% of cold), "
                        f"hit tokens {v['hit_tokens']}")
        else:
            rows.append(f"int8 {t}: {v}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--dtypes", nargs="+", choices=("auto", "int8"), default=["auto", "int8"])
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="prefill chunk (0: the engine's default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=0, help="tokens per KV page (0: the engine's default)")
    p.add_argument("--rope-scaling", default=json.dumps(ROPE_SCALING),
                   help="RoPE override as JSON, or 'none' (default: YaRN x4 of the 8K window)")
    p.add_argument("--host-cache-gb", type=float, default=1.0, help="host tier of the tiers process (0: skip)")
    p.add_argument("--skip-tiers", action="store_true", help="no disk/host prefix-hit process")
    p.add_argument("--skip-ceilings", action="store_true", help="do not measure GEMM and copy rates")
    p.add_argument("--paired-rounds", type=int, default=4,
                   help="rounds of float32 and int8 decode steps alternating at the longest context (0: skip)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    # worker-side (the script re-invokes itself)
    p.add_argument("--one-dtype", choices=("auto", "int8"), help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("staircase", "tiers", "paired"), default="staircase", help=argparse.SUPPRESS)
    p.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--kv-cache-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--disk-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--disk-dir-fp32", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.contexts = sorted(set(args.contexts))
    args.rope_scaling = None if args.rope_scaling.strip().lower() in ("", "none") else json.loads(args.rope_scaling)
    args.extra_tokens = max(args.decode_tokens + 2, QUESTION_TOKENS + 1)  # + 2: the paired requests
    if not args.max_model_len:
        args.max_model_len = max(args.contexts) + args.extra_tokens

    if args.one_dtype:
        res = {"tiers": worker_tiers, "paired": worker_paired}.get(args.phase, worker_staircase)(args)
        args.json_out.write_text(json.dumps(res))
        return 0

    started = now_iso()
    import torch

    torch.set_num_threads(args.threads)
    from longctx.config import DEFAULT_BLOCK_SIZE

    block = args.block_size or DEFAULT_BLOCK_SIZE
    kv = kv_facts(args, block)
    emit({"event": "kv", **{d: {k: kv[d][k] for k in ("bytes_per_token", "default_budget_tokens",
                                                       "fits_default_budget_at_max_context")} for d in ("auto", "int8")},
          "int8_over_fp32_bytes": kv["int8_over_fp32_bytes"]})
    ceil = None
    if not args.skip_ceilings:
        from bench_e2e import ceilings

        ceil = ceilings(args.threads, bf16=False)
        emit({"event": "ceilings", **ceil})
    results: dict = {}
    tiers: dict = {}
    paired: dict = {}
    pair = args.paired_rounds > 0 and set(args.dtypes) == {"auto", "int8"}
    with tempfile.TemporaryDirectory(prefix="bench-long-disk-") as disk, \
            tempfile.TemporaryDirectory(prefix="bench-long-disk-fp32-") as disk_fp32:
        fp32_budget = ["--kv-cache-gb", repr(kv["auto"]["budget_passed_gb"])]
        for dtype in args.dtypes:
            extra = []
            if dtype == "auto":
                extra = fp32_budget + (["--disk-dir", disk_fp32] if pair else [])
            elif not args.skip_tiers or pair:
                extra = ["--disk-dir", disk]
            results[dtype] = run_worker(args, dtype, "staircase", extra)
        if "int8" in args.dtypes and not args.skip_tiers and "stages" in results["int8"]:
            t = run_worker(args, "int8", "tiers", ["--disk-dir", disk])
            tiers = {"device_hit": results["int8"]["device_hit"]}
            if "error" in t:
                tiers["disk_hit"] = tiers["host_hit"] = t
            else:
                tiers["disk_hit"], tiers["host_hit"] = t["disk_hit"], t["host_hit"]
                tiers["process"] = {k: t[k] for k in ("load_s", "engine", "peak_rss_gib", "pages_on_host")
                                    if k in t}
        elif "int8" in args.dtypes:
            tiers = {"not_measured": "--skip-tiers" if args.skip_tiers else "the int8 staircase failed"}
        if pair and all("stages" in results[d] for d in ("auto", "int8")):
            paired = run_worker(args, "int8", "paired", fp32_budget + ["--disk-dir", disk, "--disk-dir-fp32", disk_fp32])
        elif args.paired_rounds > 0:
            paired = {"not_measured": "needs both dtypes' staircases"}

    chunk = next((r["engine"]["max_num_batched_tokens"] for r in results.values() if "engine" in r), None)
    stair_aligned = bool(chunk) and all(c % chunk == 0 for c in args.contexts)
    report = {
        "benchmark": "bench_long.py",
        "machine": machine_info(),
        "started_at": started, "finished_at": now_iso(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("one_dtype", "phase", "json_out", "kv_cache_gb", "disk_dir")},
        "model": args.model, "rope_scaling": args.rope_scaling, "max_model_len": args.max_model_len,
        "question_tokens": QUESTION_TOKENS,
        "method": {
            "prefill": STAIRCASE_NOTE + " (TTFT from RequestMetrics: first token time - arrival)",
            "staircase_aligned": stair_aligned,
            "decode": "decode_ms_per_token = (last token time - first token time) / (N - 1) of each stage's "
                      "request; decode_itl_ms_median: the median step",
            "kv_budget": "int8: the engine's default kv_cache_gb (not passed); auto (float32 on the CPU): "
                         "kv_cache_gb passed, just big enough for the longest context + decode",
            "memory": "peak_rss_gib: ru_maxrss of the dtype's own process (peak_rss_gib_after_staircase: the same "
                      "before the device hit and persist); rss_after_load_gib: VmRSS after the model loaded (before "
                      "the warm-up); rss_after_staircase_gib: VmRSS after the staircase (the peak can be the model "
                      "load's transient when the KV touched is small)",
            "tiers": "int8 at the longest context + a new question, one output token: device hit in the "
                     "staircase process; disk hit in a fresh process on the folder the first persisted "
                     "(llm.close(); files likely in the OS page cache); host hit in that process after "
                     "every device page was pushed to its host tier (untimed)",
            "repeats": "one staircase per dtype; no repeats (the machine is noisy; compare within a run)",
            "paired_decode": "at the longest context, float32 and int8 engines in one process, each loaded from "
                             "the disk folder its staircase persisted (that request not counted); per round each "
                             "takes the document alone (a device hit recomputing its last page) to its first "
                             "token, then their decode steps run alternately (engine.step() timed one by one, "
                             "order swapped every step) for --decode-tokens steps; ratio_median: the median over "
                             "all pairs of int8 step ms / fp32 step ms",
        },
        "kv": kv,
        "ceilings": ceil,
        "results": results,
        "tiers": tiers,
        "paired_decode": paired,
    }
    report["derived"] = derive(report, ceil)
    save_result(args.out, report)
    print(f"\nlong context, {args.threads} threads, rope_scaling {args.rope_scaling}; {STAIRCASE_NOTE}")
    for row in table(report):
        print(row)
    failed = [d for d, r in results.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix store benchmark, in one run: an 8K-token document, then new 40-token questions on it.

Time to first token (one new token, greedy) for document + question:
  * cold: nothing cached (longctx computes all ~8,040 tokens);
  * device hit: the document's pages are on the device (a question asked before);
  * host hit: the same pages after they were pushed to the host tier;
  * disk hit: a fresh process with the same ``disk_cache_dir`` (model load not counted);
  * HF transformers, which recomputes the whole prompt every time.
Each longctx case uses a question not seen before, so only the document is shared.

Usage:  python benchmarks/run.py prefix -- [--doc-tokens 8000] [--threads 2]
        (or python benchmarks/bench_prefix.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py prefix, which records it as
benchmarks/results/prefix/<machine>/<git rev>.json); without ``--out`` it writes nothing. Prints
a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import hf_worker
from machine import machine_info, save_result

LICENSE = Path("/usr/share/common-licenses/GPL-3")
TARGETS = {"device_hit": 0.025, "host_hit": 0.05, "disk_hit": 0.15}


def document_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(LICENSE.read_text(), add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def question_ids(tokenizer, i: int) -> list[int]:
    text = (f"\n\nQuestion {i}: in at most three sentences, what does section {i + 2} of the text "
            f"above require of someone who conveys the program, and why does it matter?\nAnswer:")
    return tokenizer.encode(text, add_special_tokens=False)[:40]


def ttft(llm, prompt: list[int]) -> float:
    from longctx import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    return out[0].metrics.time_to_first_token


def worker_longctx(args) -> dict:
    import torch

    from longctx import LLM

    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", disk_cache_dir=args.disk_dir, host_cache_gb=2.0)  # the host tier on the CPU too
    tok = llm.get_tokenizer()
    doc = document_ids(tok, args.doc_tokens)
    ttft(llm, tok.encode("warm up", add_special_tokens=False))
    res: dict = {}
    if args.phase == "disk":
        res["disk_hit_s"] = ttft(llm, doc + question_ids(tok, 4))
    else:
        res["cold_s"] = ttft(llm, doc + question_ids(tok, 1))
        res["device_hit_s"] = ttft(llm, doc + question_ids(tok, 2))
        cache = llm.engine.prefix_cache
        cache.make_room(cache.tree.num_device_pages)  # push every cached page to the host tier
        llm.engine.run_pending_kv_orders()  # the write-back itself, not timed (as before 22)
        res["pages_on_host"] = cache.tree.num_host_pages
        res["host_hit_s"] = ttft(llm, doc + question_ids(tok, 3))
        t0 = time.perf_counter()
        llm.close()
        res["persist_s"] = time.perf_counter() - t0
    res["stats"] = {k: v for k, v in vars(llm.cache_stats()).items()}
    return res


def worker_hf(args) -> dict:
    tok, model, _ = hf_worker.load(args.threads)
    prompt = document_ids(tok, args.doc_tokens) + question_ids(tok, 2)
    hf_worker.forward(model, prompt[:256])  # warm-up
    # the time to the first token: the forward pass and the greedy pick
    return {"recompute_s": hf_worker.forward(model, prompt, next_token=True, use_cache=True)[0]}


def run_worker(name: str, phase: str, args) -> dict:
    cmd = ["--worker", name, "--phase", phase, "--disk-dir", args.disk_dir,
           "--doc-tokens", str(args.doc_tokens), "--threads", str(args.threads)]
    return hf_worker.spawn(__file__, cmd, f"{name} {phase}")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-tokens", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    parser.add_argument("--worker", choices=("longctx", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps((worker_hf if args.worker == "hf" else worker_longctx)(args)))
        return
    with tempfile.TemporaryDirectory(prefix="longctx-bench-disk-") as disk:
        args.disk_dir = disk
        main_run = run_worker("longctx", "main", args)
        disk_run = run_worker("longctx", "disk", args)
    hf = None if args.skip_hf else run_worker("hf", "main", args)
    cold = main_run["cold_s"]
    cases = {"cold": cold, "device_hit": main_run["device_hit_s"], "host_hit": main_run["host_hit_s"],
             "disk_hit": disk_run["disk_hit_s"]}
    report = {
        "machine": machine_info(), "threads": args.threads, "doc_tokens": args.doc_tokens, "question_tokens": 40,
        "ttft_s": cases, "fraction_of_cold": {k: v / cold for k, v in cases.items()},
        "targets_fraction_of_cold": TARGETS, "hf_recompute_s": hf and hf["recompute_s"],
        "persist_s": main_run["persist_s"], "pages_on_host": main_run["pages_on_host"],
        "stats": {"main": main_run["stats"], "disk": disk_run["stats"]},
    }
    save_result(args.out, report, indent=2)
    print(f"\n8K document + 40-token question, time to first token ({args.threads} threads)")
    print(f"{'case':<12} {'TTFT s':>9} {'of cold':>9} {'target':>8}")
    for name, t in cases.items():
        target = f"<= {TARGETS[name]:.1%}" if name in TARGETS else ""
        print(f"{name:<12} {t:>9.3f} {t / cold:>9.2%} {target:>8}")
    if hf:
        print(f"{'HF (recompute)':<12} {hf['recompute_s']:>7.3f} {hf['recompute_s'] / cold:>9.2%}")


if __name__ == "__main__":
    main()

"""The user-facing paths at 32K on the default model: `longctx ask`, `longctx summarize` and
`longctx serve` (chat completions over HTTP) on one ~31K-token document, with the window
stretched by YaRN x4 and int8 KV pages, each as its own process, as a user runs them.

The document: license texts from /usr/share/common-licenses, concatenated until
``--doc-tokens`` tokens of the model's tokenizer (default 31,000, which leaves room for the
prompt template and the answer in a 32,768-token window). The three runs share a disk cache
folder, so later ones may hit the KV the earlier ones wrote (reported per run: the prompt
tokens the prefix store served, by tier, where the output says).

Reported per run: wall time of the process (model load included), the answer's prompt and
completion tokens, time to first token where the path reports it, and for ask/summarize how
the document was used (whole in the window, or retrieval / map-reduce). What it must show: the
whole document in every prompt (``retrieval`` None, ``map_reduce`` false, prompt tokens above
the model's native 8,192) and an answer from each path.

Usage:  python benchmarks/run.py tasks-32k -- [--doc-tokens 31000] [--max-tokens 48]
        (or python benchmarks/bench_32k_tasks.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py tasks-32k, which records it
as benchmarks/results/tasks-32k/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_serve import Server
from machine import ROOT, machine_info, save_result

LICENSES = Path("/usr/share/common-licenses")
ORDER = ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic", "MPL-1.1",
         "GFDL-1.2", "BSD", "CC0-1.0")
ROPE = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}'
QUESTIONS = ("Which licenses does this document contain?", "What does the GPL say about warranty?")


def build_document(doc_tokens: int) -> str:
    from longctx.model.tokenizer import load_tokenizer  # noqa: PLC0415 - only here
    from longctx.model.loader import resolve_model  # noqa: PLC0415

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    parts, total = [], 0
    for name in ORDER * 4:
        text = (LICENSES / name).read_text(errors="replace")
        n = len(tok.encode(text, add_special_tokens=False))
        if total + n > doc_tokens:
            ids = tok.encode(text, add_special_tokens=False)[:doc_tokens - total]
            parts.append(tok.decode(ids))
            break
        parts.append(text)
        total += n
    return "\n\n".join(parts)


def engine_flags(disk: str) -> list[str]:
    return ["--kv-cache-dtype", "int8", "--max-model-len", "32768", "--rope-scaling", ROPE,
            "--disk-cache-dir", disk, "--num-threads", "2"]


def run_cli(args: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "longctx", *args, "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"longctx {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=31_000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = ap.parse_args()
    report = machine_info(doc_tokens=args.doc_tokens, max_tokens=args.max_tokens, rope_scaling=json.loads(ROPE),
                          kv_cache_dtype="int8")
    with tempfile.TemporaryDirectory(prefix="bench-32k-") as folder:
        doc = Path(folder) / "document.txt"
        doc.write_text(build_document(args.doc_tokens))
        disk = str(Path(folder) / "kv")
        flags = engine_flags(disk)

        ask, wall = run_cli(["ask", str(doc), *QUESTIONS, "--max-tokens", str(args.max_tokens), *flags])
        report["ask"] = {"wall_s": round(wall, 1), "elapsed_s": ask["elapsed_s"], "retrieval": ask["retrieval"],
                         "document_tokens": ask["document_tokens"],
                         "shared_prefix_tokens": ask["shared_prefix_tokens"],
                         "answers": [{k: a[k] for k in ("question", "text", "prompt_tokens", "completion_tokens",
                                                        "time_to_first_token", "latency_s")}
                                     for a in ask["answers"]]}
        print(f"ask: {wall:.1f} s, retrieval {ask['retrieval']}, prompt tokens "
              f"{[a['prompt_tokens'] for a in ask['answers']]}", file=sys.stderr, flush=True)

        summ, wall = run_cli(["summarize", str(doc), "--max-tokens", str(args.max_tokens), *flags])
        report["summarize"] = {"wall_s": round(wall, 1), "elapsed_s": summ["elapsed_s"],
                               "map_reduce": summ["map_reduce"], "num_pieces": summ["num_pieces"],
                               "prompt_tokens": summ["prompt_tokens"], "completion_tokens": summ["completion_tokens"],
                               "time_to_first_token": summ["steps"][0]["time_to_first_token"],
                               "text": summ["text"]}
        print(f"summarize: {wall:.1f} s, map_reduce {summ['map_reduce']}, prompt tokens {summ['prompt_tokens']}",
              file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        server = Server("smollm2-135m", "float32", flags, start_timeout=600)
        try:
            body = {"model": "smollm2-135m", "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": doc.read_text() + "\n\n" + QUESTIONS[0]}]}
            t1 = time.perf_counter()
            resp = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=3600)
            latency = time.perf_counter() - t1
            resp.raise_for_status()
            data = resp.json()
        finally:
            server.stop()
        report["serve"] = {"wall_s": round(time.perf_counter() - t0, 1), "start_s": round(server.start_s, 1),
                           "latency_s": round(latency, 1), "usage": data["usage"],
                           "text": data["choices"][0]["message"]["content"],
                           "finish_reason": data["choices"][0]["finish_reason"]}
        print(f"serve: request {latency:.1f} s, usage {data['usage']}", file=sys.stderr, flush=True)

    ok = {"ask whole document": report["ask"]["retrieval"] is None
          and all(a["prompt_tokens"] > 8192 and a["completion_tokens"] > 0 for a in report["ask"]["answers"]),
          "summarize one pass": not report["summarize"]["map_reduce"] and report["summarize"]["prompt_tokens"] > 8192
          and report["summarize"]["completion_tokens"] > 0,
          "serve answered": report["serve"]["usage"]["prompt_tokens"] > 8192
          and report["serve"]["usage"]["completion_tokens"] > 0}
    report["checks"] = ok
    save_result(args.out, report, ensure_ascii=False)
    print(json.dumps({"ask_wall_s": report["ask"]["wall_s"], "summarize_wall_s": report["summarize"]["wall_s"],
                      "serve_latency_s": report["serve"]["latency_s"], "checks": ok}, indent=1))


if __name__ == "__main__":
    main()

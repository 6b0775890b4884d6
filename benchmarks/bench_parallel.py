"""Benchmark sequence parallelism inside the engine: prefill and decode for N = 1, 2 ranks.

For each N a fresh process builds ``LLM(sequence_parallel_size=N)`` once (the ranks start
there and live for the whole run), then for each context length (``--contexts``, default
4096 and 8192 tokens of the GPL-3 text, token ids, prefix caching and lookahead off):

* prefill: the time to the first token of a ``max_tokens=1`` request;
* decode: ``(t(1 + D tokens) - t(1 token)) / D`` ms/token (``--decode-tokens`` D, default 64),
  the same prompt again with a cold cache, as shared/BENCHMARKS.md measures decode;
* bytes sent per rank in each phase (``RankExecutor.report``: logical bytes as ``RingComm``
  counts them) against the cost model (``longctx.parallel.paged_sp.exchange_bytes``);
* seconds each rank was blocked in exchanges.

The processes run one after another, N = 1 and N = 2 alternating ``--repeats`` times (the
machine's speed drifts; medians are reported). On a 2-core CPU two ranks share the two cores:
the figure to read is decode with N = 2 against N = 1 (the issue's bar: at most 1.3x).

Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py parallel, which records it
as benchmarks/results/parallel/<machine or GPU>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table last.
Usage: python benchmarks/run.py parallel -- [--contexts 4096 8192] [--world-sizes 1 2] [--repeats 2]
       (or python benchmarks/bench_parallel.py ... [--out FILE])
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = Path("/usr/share/common-licenses/GPL-3")


def document_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(DOCUMENT.read_text(), add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def predicted(world: int, tokens: int, config, itemsize: int, sampled: int = 1) -> int:
    """Cost-model bytes rank 0 sends for one step of ``tokens`` tokens of one sequence, with
    the engine's own token assignment: split by tokens, or (a small step of a row-kernel
    model) every product split by output features."""
    from longctx.parallel.paged_sp import assign_tokens, column_exchange_bytes, exchange_bytes

    c = config
    owned = assign_tokens([tokens], world)
    if len(owned[0]) == tokens:  # a small step: ColumnSplit (the fp32 CPU default)
        q_kv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        outs = [q_kv, c.hidden_size, 2 * c.intermediate_size, c.hidden_size]
        return column_exchange_bytes(tokens, world, outs, c.num_attention_heads, c.head_dim, itemsize,
                                     c.num_hidden_layers, sampled, c.vocab_size)
    return exchange_bytes(max(len(o) for o in owned), world, c.num_attention_heads,
                          c.num_key_value_heads, c.head_dim, itemsize, c.num_hidden_layers)


def run_one(world: int, contexts: list[int], decode_tokens: int, chunk: int) -> dict:
    """One process's measurements (this runs inside the child)."""
    from longctx import LLM, SamplingParams

    llm = LLM("smollm2-135m", sequence_parallel_size=world, enable_prefix_caching=False,
              lookahead=False, max_num_batched_tokens=chunk, max_model_len=max(contexts) + decode_tokens + 8)
    runner = llm.engine.runner
    config, itemsize = llm.engine.model_config, llm.engine.kv.dtype.itemsize
    reports = (lambda: runner.comm_reports(reset=True)) if world > 1 else (lambda: [])
    tok = llm.get_tokenizer()
    llm.generate({"prompt_token_ids": document_ids(tok, 256)}, SamplingParams(max_tokens=4, ignore_eos=True))
    reports()
    out = []
    for ctx in contexts:
        ids = document_ids(tok, ctx)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill_s = time.perf_counter() - start
        prefill_comm = reports()
        start = time.perf_counter()
        res = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=1 + decode_tokens, ignore_eos=True))[0]
        total_s = time.perf_counter() - start
        decode_comm = reports()
        m = res.metrics
        decode_ms = 1000 * (m.finished_time - m.first_token_time) / decode_tokens
        chunks = [min(chunk, ctx - s) for s in range(0, ctx, chunk)]
        out.append({
            "context": ctx, "prefill_s": prefill_s, "decode_ms_per_token": decode_ms, "decode_run_s": total_s,
            "prefill_bytes_sent": [r["bytes_sent"] for r in prefill_comm],
            "prefill_blocked_s": [r["blocked_s"] for r in prefill_comm],
            # the decode run prefills again (same traffic as the prefill run): the rest is decode
            "decode_bytes_sent_per_token": [(d["bytes_sent"] - p["bytes_sent"]) / decode_tokens
                                            for d, p in zip(decode_comm, prefill_comm)],
            "decode_blocked_s": [r["blocked_s"] for r in decode_comm],
            "model_prefill_bytes_rank0": (sum(predicted(world, c, config, itemsize, 0) for c in chunks[:-1])
                                          + predicted(world, chunks[-1], config, itemsize, 1)) if world > 1 else 0,
            "model_decode_bytes_per_token": predicted(world, 1, config, itemsize) if world > 1 else 0,
        })
    llm.close()
    return {"world": world, "threads_per_rank": runner.executor.threads if world > 1 else None, "rows": out}


def child_main() -> None:
    args = json.loads(sys.argv[2])
    print("RESULT " + json.dumps(run_one(**args)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = p.parse_args()
    import torch
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine_info, save_result

    runs: dict[int, list[dict]] = {w: [] for w in args.world_sizes}
    for rep in range(args.repeats):
        for world in args.world_sizes:
            spec = json.dumps({"world": world, "contexts": args.contexts, "decode_tokens": args.decode_tokens,
                               "chunk": args.chunk})
            done = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                raise SystemExit(f"N={world} failed:\n{done.stderr[-3000:]}")
            runs[world].append(json.loads(line[0][7:]))
            print(f"repeat {rep} N={world}: " + ", ".join(
                f"{r['context']}: prefill {r['prefill_s']:.2f} s, decode {r['decode_ms_per_token']:.1f} ms"
                for r in runs[world][-1]["rows"]), flush=True)
    summary = []
    for world, reps in runs.items():
        for i, ctx in enumerate(args.contexts):
            rows = [r["rows"][i] for r in reps]
            med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
            summary.append({"world": world, "context": ctx, "prefill_s": med("prefill_s"),
                            "prefill_s_all": [r["prefill_s"] for r in rows],
                            "decode_ms_per_token": med("decode_ms_per_token"),
                            "decode_ms_all": [r["decode_ms_per_token"] for r in rows],
                            **{k: rows[-1][k] for k in ("prefill_bytes_sent", "prefill_blocked_s",
                                                        "decode_bytes_sent_per_token", "decode_blocked_s",
                                                        "model_prefill_bytes_rank0",
                                                        "model_decode_bytes_per_token")}})
    base = {s["context"]: s for s in summary if s["world"] == 1}
    lines = ["| N | context | prefill s | vs N=1 | decode ms/token | vs N=1 | bytes/rank prefill (model r0) | bytes/rank/token decode (model) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        b = base.get(s["context"])
        rp = f"{s['prefill_s'] / b['prefill_s']:.2f}x" if b else "-"
        rd = f"{s['decode_ms_per_token'] / b['decode_ms_per_token']:.2f}x" if b else "-"
        mb = lambda x: f"{x / 1e6:.1f} MB"  # noqa: E731
        pb = "/".join(mb(x) for x in s["prefill_bytes_sent"]) or "-"
        db = "/".join(f"{x / 1e3:.0f} kB" for x in s["decode_bytes_sent_per_token"]) or "-"
        lines.append(f"| {s['world']} | {s['context']} | {s['prefill_s']:.2f} | {rp} | {s['decode_ms_per_token']:.1f} | "
                     f"{rd} | {pb} ({mb(s['model_prefill_bytes_rank0'])}) | {db} "
                     f"({s['model_decode_bytes_per_token'] / 1e3:.0f} kB) |")
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    save_result(args.out, {"machine": machine_info(**gpu), "args": vars(args) | {"out": str(args.out)},
                           "summary": summary, "runs": {str(k): v for k, v in runs.items()}})
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main()
    else:
        main()

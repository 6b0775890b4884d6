"""Benchmark sequence parallelism: prefill time, bytes sent per rank, and how much of the
communication hides behind compute, for N = 1, 2, ... ranks; plus ring vs Ulysses attention.

For each world size N the real model prefills one document (``--tokens`` of the GPL-3 text,
``--chunk`` tokens per rank per round) through ``SequenceParallelGenerator`` in N processes
(gloo on the CPU; NCCL, one GPU per rank, when CUDA exists), then decodes ``--decode-tokens``
tokens over the sharded KV. Per rank it records:

* prefill seconds (from a barrier to the end of the last round) and decode ms/token;
* bytes sent (logical: what a direct exchange puts on the wire from this rank);
* blocked seconds per kind of call (ring transfers, query all-gather, partial all-to-all,
  broadcasts): time the rank waited on communication while it could have computed;
* comm-only seconds per kind: the same calls, same sizes, same order, replayed with no
  compute in between right after the prefill (what the communication costs on its own);
* hidden fraction = 1 - blocked / comm-only, overall and per kind, clamped to [0, 1].
  Blocked time also counts waiting for a slower peer's compute (imbalance, or a core taken
  by another process), which no overlap can hide; the raw seconds are kept next to it.
  (Gloo's p2p handles report completion only once waited on, so "was this step's transfer
  done before its compute" cannot be asked directly.)

On CUDA the host does not block on NCCL, so blocked and hidden are not reported there (use
torch.profiler); prefill times are taken after ``torch.cuda.synchronize``.

The attention section times one attention call (ring and, where the heads divide by N,
Ulysses) on random q/k/v for short-sequence, many-head shapes and a long one.

Results go to ``benchmarks/results/parallel-<cpu|cuda>.json`` (or ``--out``).
Usage: python benchmarks/bench_parallel.py [--tokens 8000] [--chunk 2048] [--world-sizes 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from longctx.model.loader import load_model, resolve_model
from longctx.model.tokenizer import load_tokenizer
from longctx.parallel import CommStats, RingComm, SequenceSharding, ring_attention, spawn_ranks, ulysses_attention
from longctx.parallel.sp_engine import DTYPES, SequenceParallelConfig
from longctx.parallel.sp_generate import SequenceParallelGenerator
from machine import machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENT = Path("/usr/share/common-licenses/GPL-3")
ATTENTION_SHAPES = [  # (name, S, H, Hkv, D)
    ("short-many-heads-S1024-H32/8-D128", 1024, 32, 8, 128),
    ("short-many-heads-S2048-H32/8-D128", 2048, 32, 8, 128),
    ("smollm-S8192-H9/3-D64", 8192, 9, 3, 64),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replay(ops: list[tuple], device: torch.device) -> dict[str, float]:
    """The recorded calls again, same sizes and order, no compute: seconds per kind."""
    comm = RingComm()
    comm.barrier()
    for op in ops:
        kind, size = op[0], op[1]
        if kind == "ring":
            comm.send_recv(torch.empty(size, dtype=torch.uint8, device=device),
                           torch.empty(op[2], dtype=torch.uint8, device=device))
            comm.wait()
        elif kind == "all_gather":
            comm.all_gather(torch.empty(size, dtype=torch.uint8, device=device))
        elif kind == "all_to_all":
            parts = torch.empty(comm.world_size, size // comm.world_size, dtype=torch.uint8, device=device)
            comm.all_to_all(parts)
        else:
            comm.broadcast(torch.empty(size, dtype=torch.uint8, device=device), op[2])
    return comm.stats.blocked


def _hidden(blocked: dict[str, float], alone: dict[str, float]) -> dict[str, float | None]:
    def fraction(exposed: float, cost: float) -> float | None:
        return min(1.0, max(0.0, 1.0 - exposed / cost)) if cost > 0 else None

    kinds = {k: fraction(blocked.get(k, 0.0), alone[k]) for k in alone}
    kinds["all"] = fraction(sum(blocked.values()), sum(alone.values()))
    return kinds


def prefill_on_rank(comm: RingComm, device: torch.device, model, ids: list[int],
                    config: SequenceParallelConfig, decode_tokens: int) -> dict:
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    model = model.to(device=device, dtype=DTYPES[config.dtype])
    generator = SequenceParallelGenerator(model, comm, config, device)
    kv = generator.new_shard(len(ids), decode_tokens + 1)
    comm.barrier()
    comm.stats = CommStats()
    start = time.perf_counter()
    generator.prefill(ids, kv)
    _sync(device)
    prefill_s = time.perf_counter() - start
    stats, comm.stats = comm.stats, CommStats()  # decode traffic is not part of the prefill's
    comm.barrier()
    start = time.perf_counter()
    for i in range(decode_tokens):
        generator.decode_step(ids[i], len(ids) + i, kv)
    _sync(device)
    decode_ms = 1000 * (time.perf_counter() - start) / max(decode_tokens, 1)
    row = {"rank": comm.rank, "prefill_s": prefill_s, "decode_ms_per_token": decode_ms,
           "bytes_sent": stats.bytes_sent, "num_calls": len(stats.ops), "tokens_held": kv.num_tokens}
    if device.type == "cpu" and comm.world_size > 1:
        alone = replay(stats.ops, device)
        row.update(blocked_s=stats.blocked, comm_only_s=alone, hidden_fraction=_hidden(stats.blocked, alone))
    return row


def attention_on_rank(comm: RingComm, device: torch.device, reps: int) -> list[dict]:
    rows = []
    for name, seq_len, heads, kv_heads, head_dim in ATTENTION_SHAPES:
        layout = SequenceSharding(seq_len, comm.world_size, "zigzag")
        gen = torch.Generator().manual_seed(0)
        local = layout.length(comm.rank)
        q = torch.randn(local, heads, head_dim, generator=gen).to(device)
        k = torch.randn(local, kv_heads, head_dim, generator=gen).to(device)
        v = torch.randn(local, kv_heads, head_dim, generator=gen).to(device)
        fns = {"ring": ring_attention}
        if heads % comm.world_size == 0 and kv_heads % comm.world_size == 0:
            fns["ulysses"] = ulysses_attention
        for kind, fn in fns.items():
            times, sent = [], 0
            for rep in range(reps + 1):  # the first call warms up
                ring = RingComm()
                comm.barrier()
                start = time.perf_counter()
                fn(q, k, v, ring, True, sharding=layout)
                _sync(device)
                if rep:
                    times.append(time.perf_counter() - start)
                sent = ring.stats.bytes_sent
            rows.append({"shape": name, "kind": kind, "rank": comm.rank, "median_s": statistics.median(times),
                         "bytes_sent": sent})
    return rows


def _document_ids(model_name: str, num_tokens: int) -> list[int]:
    tokenizer = load_tokenizer(resolve_model(model_name))
    text = DOCUMENT.read_text()
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
    return ids[:num_tokens]


def _threads(world: int, given: int) -> int:
    return given or max(1, (os.cpu_count() or 1) // world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per rank per round")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="default: 1 2 (CPU) or 1 2 4 8 up to the GPUs present")
    parser.add_argument("--threads-per-rank", type=int, default=0, help="0: cores / N")
    parser.add_argument("--attention-reps", type=int, default=3, help="0 skips the attention section")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    worlds = args.world_sizes or ([w for w in (1, 2, 4, 8) if w <= torch.cuda.device_count()] if cuda else [1, 2])
    model = load_model(args.model, dtype=torch.float32)  # shared with the ranks through shared memory
    ids = _document_ids(args.model, args.tokens)
    runs, attention = [], []
    for world in worlds:
        config = SequenceParallelConfig(world, args.chunk, dtype=args.dtype)
        threads = _threads(world, args.threads_per_rank)
        ranks = spawn_ranks(prefill_on_rank, world, (model, ids, config, args.decode_tokens),
                            num_threads=threads, group_timeout_s=1800)
        runs.append({"world_size": world, "threads_per_rank": threads,
                     "prefill_s": max(r["prefill_s"] for r in ranks), "ranks": ranks})
        hidden = [round(r["hidden_fraction"]["all"], 3) for r in ranks if "hidden_fraction" in r]
        print(f"N={world} ({threads} threads/rank): prefill {runs[-1]['prefill_s']:.2f} s, "
              f"bytes/rank {[r['bytes_sent'] for r in ranks]}, blocked s "
              f"{[round(sum(r['blocked_s'].values()), 2) for r in ranks if 'blocked_s' in r]}, comm-only s "
              f"{[round(sum(r['comm_only_s'].values()), 2) for r in ranks if 'comm_only_s' in r]}, "
              f"hidden {hidden or 'n/a'}")
        if args.attention_reps:
            rows = spawn_ranks(attention_on_rank, world, (args.attention_reps,), num_threads=threads)
            for row in rows[0]:
                key = (row["shape"], row["kind"])
                same = [r for rank_rows in rows for r in rank_rows if (r["shape"], r["kind"]) == key]
                attention.append({"world_size": world, "shape": row["shape"], "kind": row["kind"],
                                  "seconds": max(r["median_s"] for r in same),
                                  "bytes_sent_per_rank": max(r["bytes_sent"] for r in same)})
                print(f"  attention {row['shape']} {row['kind']}: {attention[-1]['seconds'] * 1000:.1f} ms")
    result = {"machine": machine_info(device="cuda" if cuda else "cpu", backend="nccl" if cuda else "gloo"),
              "model": args.model, "dtype": args.dtype, "prompt_tokens": len(ids), "chunk_per_rank": args.chunk,
              "decode_tokens": args.decode_tokens, "runs": runs, "attention": attention}
    out = args.out or RESULTS / f"parallel-{'cuda' if cuda else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

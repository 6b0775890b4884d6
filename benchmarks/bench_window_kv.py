"""Sliding-window layers keeping only their window (``window_kv="free"``): KV bytes, speed, tokens.

Model: Gemma-3-shaped, random fp32 weights, built in a temporary folder: 6 layers, 5 sliding
(window 1,024) to 1 global, Gemma-3-1B's attention (4 query heads, 1 KV head, head_dim 256,
query_pre_attn_scalar 256, RoPE base 1e4 local, 1e6 global), a small body (hidden 512, MLP
1,024, vocab 512) so a 32K prefill is affordable on a CPU, and an untied output head (tied to
the random embedding the model copies its input: greedy repeats one token, a weak token check).
The all-global model is the same safetensors with every layer "full_attention".

Per context (``--contexts``, default 16K and 32K) one random prompt (seed 0) and three engines,
alive together (prefix caching off, lookahead off, ``max_num_seqs=1``, one greedy
``ignore_eos`` request of ``--new-tokens`` tokens), each after an untimed 64-token warm-up:
free (the windowed model, ``window_kv="free"``: a ring of pages for the windowed layers), keep
(the windowed model, ``window_kv="keep"``) and global (the all-global model). Each pool has
exactly the request's pages + 2 (``num_blocks``), so "alloc" (the bytes of ``kv.caches``) is
about what the request needs too.

KV bytes held, from the page accounting (read after every step while the request runs: the
step that ends it releases its pages): the most pool pages it held (``kv_usage()["device"]
["in_use"]``, ctx + new tokens) x ``pool_page_bytes`` (the global layers only when a ring
exists) + with a ring that sequence's whole ring (``pages_per_seq`` pages of the windowed layers).

Timing: each request is stepped by hand (``engine.step()`` timed with ``perf_counter``; the
accounting read outside it). prefill_s: ``add_request`` to the step that returns the first
token (every ``--chunk``-token prefill chunk and the first sampling); the three prefills run
one after the other. Then the decode steps are interleaved, one step per engine per round, the
order rotated every round, so a drift of the machine's speed (tens of percent over minutes
here) hits the three alike. decode ms/token: the mean (and median) of a run's N - 1 decode
steps, scheduling and detokenizing included; "vs global": the median over rounds of its step
time / the all-global run's step time in the same round.

Checks: KV held free/global (the bar: <= 0.3) and keep/global per context; free and keep
give the same tokens (the all-global model is another model: its tokens are not compared).

Usage:  python benchmarks/run.py window-kv -- [--contexts 16384 32768] [--new-tokens 32] [--threads 2]
        (or python benchmarks/bench_window_kv.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py window-kv, which records it
as benchmarks/results/window-kv/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from machine import machine_info, save_result  # noqa: E402

WINDOW, BLOCK = 1024, 16
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
MODES = ("free", "keep", "global")
TARGET_RATIO = 0.3


def make_models(folder: Path, args, max_pos: int) -> dict[str, Path]:
    """The windowed checkpoint and its all-global twin (same weights, config changed)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tiny_models import write_char_tokenizer

    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    cfg = Gemma3TextConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=1,
                           head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                           max_position_embeddings=max_pos, rms_norm_eps=1e-6, rope_parameters=rope,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = Gemma3ForCausalLM(cfg).float().eval()  # (hf_worker.py is the one HF loader)
    with torch.no_grad():  # Gemma's norms multiply by 1 + w: w about 0 +- 0.1, as in real checkpoints
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    windowed, all_global = folder / "windowed", folder / "global"
    model.save_pretrained(windowed, safe_serialization=True)
    write_char_tokenizer(windowed, args.vocab)
    shutil.copytree(windowed, all_global)
    config = json.loads((all_global / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * len(LAYER_TYPES)
    # the global layers' RoPE, flat: a per-layer-type dict makes the engine build a local RoPE
    # that no layer uses, and its forward then fails (StopIteration in _local_rotary_for)
    config["rope_parameters"] = rope["full_attention"]
    (all_global / "config.json").write_text(json.dumps(config, indent=2))
    return {"windowed": windowed, "global": all_global}


class Run:
    """One engine (``mode``) with its one request, stepped by hand."""

    def __init__(self, folder: Path, mode: str, prompt: list[int], args) -> None:
        from longctx import LLM, SamplingParams

        n_new, ctx = args.new_tokens, len(prompt)
        self.mode, self.ctx = mode, ctx
        self.llm = LLM(str(folder), block_size=BLOCK, max_num_batched_tokens=args.chunk, max_num_seqs=1,
                       enable_prefix_caching=False, lookahead=False, num_blocks=math.ceil((ctx + n_new) / BLOCK) + 2,
                       window_kv="free" if mode == "free" else "keep", max_model_len=ctx + n_new)
        self.eng = self.llm.engine
        greedy = dict(temperature=0.0, ignore_eos=True)
        self.llm.generate({"prompt_token_ids": prompt[:64]}, SamplingParams(max_tokens=2, **greedy))  # warm-up
        self.tokens: list[int] = []
        self.decode: list[float] = []
        self.peak_pages = 0
        t0 = time.perf_counter()
        self.rid = self.eng.add_request(prompt, SamplingParams(max_tokens=n_new, **greedy))
        while not self.tokens:  # the prefill chunks and the first token
            self.step()
        self.prefill_s = time.perf_counter() - t0
        self.decode.clear()

    def step(self) -> float | None:
        """One engine step, timed (the page accounting read after it, untimed); None once done."""
        if not self.eng.has_unfinished():
            return None
        t = time.perf_counter()
        updates = self.eng.step()
        dt = time.perf_counter() - t
        self.tokens += [tok for u in updates if u.request_id == self.rid for tok in u.new_token_ids]
        self.decode.append(dt)
        if self.eng.has_unfinished():  # (the step that ends the request releases its pages)
            self.peak_pages = max(self.peak_pages, self.eng.kv_usage()["device"]["in_use"])
        return dt

    def row(self) -> dict:
        from longctx.kv.device_pool import pool_page_bytes, ring_bytes

        self.eng.release(self.rid)
        kv, fmt = self.eng.kv, self.eng.kv_format
        ring = kv.ring
        ring_seq = ring_bytes(fmt, ring) // ring.num_slots if ring is not None else 0
        row = {"context": self.ctx, "mode": self.mode, "pool_pages_held": self.peak_pages,
               "ring_pages_per_seq": ring.pages_per_seq if ring is not None else 0,
               "ring_layers": list(ring.layers) if ring is not None else [],
               "kv_bytes_held": self.peak_pages * pool_page_bytes(fmt, BLOCK, ring) + ring_seq,
               "kv_bytes_allocated": sum(t.nbytes for c in kv.caches for t in c), "prefill_s": self.prefill_s,
               "decode_ms_per_token": 1000 * statistics.mean(self.decode) if self.decode else None,
               "decode_ms_median": 1000 * statistics.median(self.decode) if self.decode else None,
               "decode_steps": len(self.decode), "tokens": self.tokens}
        self.llm.close()
        return row


def run_context(folders: dict[str, Path], prompt: list[int], args) -> tuple[dict[str, dict], dict]:
    """The three engines prefilled one after the other, then their decode steps interleaved
    (one step each per round, the order rotated every round); rows and the paired ratios."""
    runs = [Run(folders["global" if m == "global" else "windowed"], m, prompt, args) for m in MODES]
    pairs: dict[str, list[float]] = {"free": [], "keep": []}
    for i in range(args.new_tokens):  # (N - 1 decode steps each; the last round finds them done)
        times = {r.mode: r.step() for r in runs[i % 3:] + runs[:i % 3]}
        for m in pairs:
            if times[m] and times["global"]:
                pairs[m].append(times[m] / times["global"])
    rows = {r.mode: r.row() for r in runs}
    del runs
    gc.collect()
    return rows, {m: statistics.median(v) if v else None for m, v in pairs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode is timed after the first token)")
    import torch

    from tiny_models import random_tokens

    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="longctx-window-kv-") as tmp:
        folders = make_models(Path(tmp), args, max(args.contexts) + args.new_tokens + 1024)
        for ctx in args.contexts:
            by_mode, paired = run_context(folders, random_tokens(ctx, seed=0, high=args.vocab), args)
            same = by_mode["free"]["tokens"] == by_mode["keep"]["tokens"]
            for mode, row in by_mode.items():
                row.update(kv_ratio_vs_global=row["kv_bytes_held"] / by_mode["global"]["kv_bytes_held"],
                           decode_vs_global_paired=paired.get(mode, 1.0),
                           same_tokens_as_keep=same if mode == "free" else None)
                print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
                rows.append(row)

    def per_context(mode: str, key: str) -> dict[int, object]:
        return {r["context"]: r[key] for r in rows if r["mode"] == mode}

    checks = {"kv_ratio_free_vs_global": per_context("free", "kv_ratio_vs_global"),
              "kv_ratio_keep_vs_global": per_context("keep", "kv_ratio_vs_global"),
              "same_tokens": per_context("free", "same_tokens_as_keep"),
              "decode_ratio_free_vs_global_paired": per_context("free", "decode_vs_global_paired"),
              "decode_ratio_keep_vs_global_paired": per_context("keep", "decode_vs_global_paired"),
              "target_kv_ratio": TARGET_RATIO}
    checks["kv_ratio_ok"] = all(r <= TARGET_RATIO for r in checks["kv_ratio_free_vs_global"].values())
    checks["tokens_ok"] = all(checks["same_tokens"].values())
    config = {"layer_types": LAYER_TYPES, "sliding_window": WINDOW, "block_size": BLOCK, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 256, "dtype": "float32", "seed": 0,
              **{k: v for k, v in vars(args).items() if k != "out"}}
    save_result(args.out, {"machine": machine_info(), "config": config, "rows": rows, "checks": checks})
    print(f"\nGemma-3-shaped (5 sliding : 1 global, window {WINDOW}), {args.new_tokens} new tokens, "
          f"{args.threads} threads, {machine_info()['cpu']}")
    print(f"{'context':>7} {'mode':<6} {'KV MiB':>8} {'vs global':>9} {'alloc MiB':>9} {'prefill s':>9} "
          f"{'decode ms/tok':>13} {'vs global':>9} {'same tokens':>11}")
    for r in rows:
        same = "" if r["same_tokens_as_keep"] is None else ("yes" if r["same_tokens_as_keep"] else "NO")
        dec = f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] else "-"
        ratio = f"{r['decode_vs_global_paired']:.2f}" if r["decode_vs_global_paired"] else "-"
        print(f"{r['context']:>7} {r['mode']:<6} {r['kv_bytes_held'] / 2**20:>8.1f} {r['kv_ratio_vs_global']:>9.3f} "
              f"{r['kv_bytes_allocated'] / 2**20:>9.1f} {r['prefill_s']:>9.2f} {dec:>13} {ratio:>9} {same:>11}")
    print(f"KV held free/global <= {TARGET_RATIO}: {'yes' if checks['kv_ratio_ok'] else 'NO'}; "
          f"free and keep give the same tokens: {'yes' if checks['tokens_ok'] else 'NO'}")


if __name__ == "__main__":
    main()

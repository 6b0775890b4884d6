"""Study: how int8 KV rounding moves the real model's greedy tokens, against other roundings.

Not a speed benchmark and not the shipped int8 path: a temporary attention hook runs the
float32 engine and, before each attention call, overwrites the KV pages of every sequence
with a rounded copy of their exact rows (kept aside by the hook). What is rounded and how is
the variant; everything else (model, prompts, chunks of 512, greedy, lookahead off) is
``tests/test_int8_kv_real.py``'s. Rounding from the exact rows each step means no page is
rounded twice (the shipped write requantises a page when a later row raises its scale).

A variant is ``name:W:sink[:kind][:seed]``:

* ``W``: the last W tokens of each sequence stay exact (pages wholly before ``L - W`` are
  rounded once, when they leave the window); ``0``: every page, the last partial one
  included, is rounded every step.
* ``sink``: ``1`` keeps the sequence's first page exact; ``c`` subtracts the first token's K
  and V from every row before rounding and adds them back (exact in real arithmetic: the
  first token is then stored exactly); ``e`` rounds every page in the cache (as ``0``) and
  puts the exact rows of the first page and the last page (1-64 tokens) back after the
  kernel, from its output and log-sum-exp (``kv_quant.exchange_keys``: the engine-side form
  of "first page and last page exact" that needs no second page dtype; with W = 0 each step
  equals ``1:1``'s to float32 rounding, the run is another draw of int8's rounding noise, as
  last-bit differences make it); ``0`` none of these.
* ``kind``: ``-`` (default) int8, one scale per 64-token page and KV head (amax / 127, as
  shipped); ``1`` one scale per row and head instead; ``k`` / ``v`` round only K / only V;
  ``b`` bfloat16 rounding; ``h`` float16 rounding; ``f`` float8 e4m3 with one scale per page
  and KV head (amax / 448); ``e`` float8 e4m3 with scale 1 (vLLM's fp8 KV cache when no
  scales are calibrated).
* ``seed``: ``0`` (default) the shipped Hadamard rotation; ``n`` a random orthogonal rotation
  seeded with n (another draw of the rounding noise, the same error size); ``x`` no rotation
  (the rows as the model makes them, as vLLM stores fp8 KV).

Printed per variant: how many of the five prompts keep float32's first 32 greedy tokens (and
where the others part), and the mean and largest |change| of float32's chosen token's
log-probability over the steps before the first difference, and at each prompt's tightest
float32 tie the lead (nats) of float32's token in the variant's run (None where it parted
there or before: how near the kept prompts came to parting). First the float32 run's
top-2 gaps: the four smallest of each prompt's first 32 steps (the near-ties).

    python benchmarks/run.py int8-error -- base:0:0,w64s:64:1,bf16:0:0:b --tokens 32
    (or python benchmarks/int8_error_study.py ... [--out FILE])

Each variant costs about as much as one pass of the five 6,000-token prompts (~100 s on 2
cores). Results: docs/benchmarks.md (int8 KV pages and 32K prompts).
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py int8-error, which
records it as benchmarks/results/int8-error/<machine>/<git rev>.json); without ``--out`` it
writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_int8_kv_real import LEADS, engine, prompts, top2_gap  # noqa: E402

import longctx.attention as attention  # noqa: E402
from longctx import SamplingParams  # noqa: E402
from longctx.kernels import kv_quant, reference  # noqa: E402


KINDS = ("-", "1", "k", "v", "b", "h", "f", "e")
FP8_MAX = 448.0  # largest finite float8 e4m3fn


class Variant:
    def __init__(self, spec: str) -> None:
        fields = spec.split(":")
        if not 3 <= len(fields) <= 5:
            raise SystemExit(f"variant {spec!r}: expected name:W:sink[:kind][:seed]")
        name, window, sink, *rest = fields
        if not window.isdigit():
            raise SystemExit(f"variant {spec!r}: W must be a whole number of tokens, got {window!r}")
        if sink not in ("0", "1", "c", "e"):
            raise SystemExit(f"variant {spec!r}: sink must be 0, 1, c or e, got {sink!r}")
        if len(rest) == 2 and not (rest[1].isdigit() or rest[1] == "x"):
            raise SystemExit(f"variant {spec!r}: seed must be a whole number or x, got {rest[1]!r}")
        self.spec, self.name, self.window, self.sink = spec, name, int(window), sink
        seed = rest.pop() if len(rest) == 2 else "0"
        self.seed = None if seed == "x" else int(seed)
        self.kind = rest[0] if rest else "-"
        if self.kind not in KINDS:
            raise SystemExit(f"variant {spec!r}: kind must be one of {' '.join(KINDS)}, got {self.kind!r}")

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Pages [n, BS, Hkv, D] rounded as the variant says."""
        if self.kind == "b":
            return x.to(torch.bfloat16).float()
        if self.kind == "h":
            return x.to(torch.float16).float()
        if self.kind == "e":
            return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        if self.kind == "f":
            s = (x.abs().amax(dim=(-3, -1), keepdim=True) / FP8_MAX).clamp_min(1e-30)
            return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        dims = -1 if self.kind == "1" else (-3, -1)
        s = x.abs().amax(dim=dims, keepdim=True) / kv_quant.QMAX
        q = torch.round(x / s.clamp_min(1e-30)).clamp(-kv_quant.QMAX, kv_quant.QMAX) * s
        return torch.where(s > 0, q, x)


class Hook:
    """Replaces ``PagedAttentionBackend.run`` while a variant is set."""

    def __init__(self) -> None:
        self.variant: Variant | None = None
        self.exact: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.rotations: dict[int, torch.Tensor] = {}
        self.original = attention.PagedAttentionBackend.run

    def rotation(self, d: int, seed: int | None) -> torch.Tensor:
        if seed not in self.rotations:
            if seed is None:
                self.rotations[seed] = torch.eye(d)
            elif seed == 0:
                self.rotations[seed] = kv_quant.rotation(d)
            else:
                gen = torch.Generator().manual_seed(seed)
                r, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
                self.rotations[seed] = r.float()
        return self.rotations[seed]

    def forward(self, backend, layer, q, k, v, plan):
        var = self.variant
        if var is None:
            return self.original(backend, layer, q, k, v, plan)
        meta = plan.meta
        k_cache, v_cache = meta.kv_caches[layer][:2]
        rot = self.rotation(q.shape[-1], var.seed)
        q, k, v = ((x.float() @ rot) for x in (q, k, v))
        bs = k_cache.shape[1]
        if layer not in self.exact:
            self.exact[layer] = (torch.zeros_like(k_cache), torch.zeros_like(v_cache),
                                 torch.zeros(k_cache.shape[0], dtype=torch.bool))
        ek, ev, rounded = self.exact[layer]
        slots = meta.slot_mapping.long()
        fresh = slots[slots % bs == 0] // bs  # pages started in this step: forget old rows
        ek[fresh], ev[fresh], rounded[fresh] = 0, 0, False
        ek.view(-1, *ek.shape[2:])[slots] = k
        ev.view(-1, *ev.shape[2:])[slots] = v
        backend.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        for s, length in enumerate(meta.context_lens_t.tolist()):
            blocks = meta.block_table[s, :(length + bs - 1) // bs].long()
            old = max(0, (length - var.window) // bs) if var.window else len(blocks)
            pages = blocks[(1 if var.sink == "1" else 0):old]
            if var.window:
                pages = pages[~rounded[pages]]
            if not pages.numel():
                continue
            k_off = ek[blocks[0], 0] if var.sink == "c" else 0
            v_off = ev[blocks[0], 0] if var.sink == "c" else 0
            if var.kind != "v":
                k_cache[pages] = var.round(ek[pages] - k_off) + k_off
            if var.kind != "k":
                v_cache[pages] = var.round(ev[pages] - v_off) + v_off
            rounded[pages] = True
        out, lse = backend.kernels.paged_attention(q, k_cache, v_cache, meta.block_table, meta.context_lens_t,
                                                   meta.cu_seqlens_q, scale=backend.scale, tree_mask=meta.tree_mask)
        if var.sink == "e":
            self.exchange(backend, meta, q, out, lse, k_cache, v_cache, ek, ev)
        return out @ rot.T

    @staticmethod
    def exchange(backend, meta, q, out, lse, k_cache, v_cache, ek, ev) -> None:
        """In place: out / lse with each sequence's first and last page seen exact."""
        bs, cu = k_cache.shape[1], meta.cu_seqlens_q.tolist()
        for s, length in enumerate(meta.context_lens_t.tolist()):
            lo, hi = cu[s], cu[s + 1]
            if hi == lo:
                continue
            keys = sorted(set(range(min(bs, length))) | set(range((length - 1) // bs * bs, length)))
            idx = torch.tensor(keys)
            blocks = meta.block_table[s].long()[idx // bs]
            offs = idx % bs
            tree = meta.tree_mask[lo:hi] if meta.tree_mask is not None else None
            visible = reference.causal_visibility(hi - lo, length, tree)[:, idx]
            out[lo:hi], lse[lo:hi] = kv_quant.exchange_keys(
                out[lo:hi], lse[lo:hi], q[lo:hi], k_cache[blocks, offs], v_cache[blocks, offs],
                ek[blocks, offs], ev[blocks, offs], visible, backend.scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", help="comma-separated name:W:sink[:kind][:seed]")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = ap.parse_args()
    variants = [Variant(v) for v in args.variants.split(",")]
    hook = Hook()
    attention.PagedAttentionBackend.run = lambda backend, *a: hook.forward(backend, *a)
    llm = engine("auto")
    ids = prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)

    def run():
        hook.exact.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    ref, ref_lp = run()
    results = {"near_ties": {}, "variants": {}}
    tightest = []  # each prompt's step with float32's smallest top-2 gap
    for lead, steps in zip(LEADS, ref_lp):
        gaps = [top2_gap(step) for step in steps]
        tight = sorted(range(len(gaps)), key=gaps.__getitem__)[:4]
        tightest.append(tight[0])
        results["near_ties"][lead] = {str(i): round(gaps[i], 4) for i in tight}
        print(f"float32 {lead}: smallest top-2 gaps (token: nats) {results['near_ties'][lead]}", flush=True)
    for var in variants:
        hook.variant = var
        start = time.time()
        got, got_lp = run()
        hook.variant = None
        firsts, moves, margins = [], [], []
        for want, mine, lp_want, lp_mine in zip(ref, got, ref_lp, got_lp):
            first = next((i for i, (a, b) in enumerate(zip(want, mine)) if a != b), None)
            firsts.append(first)
            t = tightest[len(firsts) - 1]
            if first is None or first > t:  # float32's token's lead over the best other there
                others = [lp for tok, lp in lp_mine[t].items() if tok != want[t]]
                margins.append(round(lp_mine[t][want[t]] - max(others), 4))
            else:
                margins.append(None)
            moves += [abs(lp_want[i][want[i]] - lp_mine[i][want[i]]) for i in range(len(want) if first is None else first)]
        row = {"equal": firsts.count(None), "first_difference": dict(zip(LEADS, firsts)),
               "margin_at_tightest": dict(zip(LEADS, margins)),
               "mean_abs_dlogp": sum(moves) / len(moves), "max_abs_dlogp": max(moves)}
        results["variants"][var.spec] = row
        print(f"{var.spec}: equal {row['equal']}/5 {firsts}; mean |dlogp| {row['mean_abs_dlogp']:.5f}, "
              f"max {row['max_abs_dlogp']:.4f}; lead at float32's tightest tie {margins} "
              f"({time.time() - start:.0f} s)", flush=True)
    llm.close()
    from machine import save_result  # noqa: PLC0415 - the tests import this file without benchmarks/ on the path

    save_result(args.out, results)


if __name__ == "__main__":
    main()

"""Lookahead decoding benchmark, in one run, on real text with the default model (greedy).

Four chat prompts: (a) extraction (quote a section of a ~3,000-token document), (b)
summarization of the same document, (c) a free-form story and (d) a short email, prompts with
nothing to copy (the email's greedy text copies nothing; a 135M model's story may fall into
repeating itself, which lookahead then drafts from, so it is kept beside it). For each:
decode tokens/s of longctx with and without lookahead, mean tokens per verify step, and HF
transformers ``generate`` without and with ``prompt_lookup_num_tokens`` on the same token ids.
Decode speed counts the tokens after the first over the time after the first token, so the
prompt's prefill is left out on both sides. Every run starts with an empty shared draft
pool: the pool keeps finished outputs per document, so a repeated prompt would otherwise
draft its own earlier answer and measure copying, not the prompt.

Usage:  python benchmarks/run.py lookahead -- [--max-tokens 160] [--threads 2] [--skip-hf]
        (or python benchmarks/bench_lookahead.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py lookahead, which records it
as benchmarks/results/lookahead/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hf_worker
from machine import machine_info, save_result

LICENSE = Path("/usr/share/common-licenses/GPL-3")
TARGETS = {"extraction": 2.5, "summarization": 1.3, "free_form_story": 0.95, "nothing_to_copy": 0.95}


def build_prompts(tokenizer, doc_tokens: int) -> dict[str, list[int]]:
    doc = tokenizer.decode(tokenizer.encode(LICENSE.read_text(), add_special_tokens=False)[:doc_tokens])
    asks = {
        "extraction": doc + "\n\nCopy the section titled \"Basic Permissions\" from the text above, "
                            "word for word.",
        "summarization": doc + "\n\nSummarize the text above in a few sentences.",
        "free_form_story": "Write a story about a dragon who learns to bake bread in a small village.",
        "nothing_to_copy": "Write a short, friendly email inviting my colleagues to a team lunch next Friday.",
    }

    def chat(text):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return {name: chat(text) for name, text in asks.items()}


def worker_longctx(args) -> dict:
    import torch

    from longctx import LLM, SamplingParams
    from longctx.lookahead.drafter import SharedDraftPool

    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    res: dict = {}
    # both engines live side by side and their runs alternate, so a slow spell of this shared
    # machine hits both modes alike (run one after the other, the modes' figures drifted apart
    # by up to 20% between runs with identical tokens)
    llms = {mode: LLM("smollm2-135m", lookahead=mode == "lookahead", enable_prefix_caching=False)
            for mode in ("plain", "lookahead")}
    prompts = build_prompts(llms["plain"].get_tokenizer(), args.doc_tokens)
    for llm in llms.values():
        llm.generate("warm up", SamplingParams(max_tokens=4))
    for name, ids in prompts.items():
        for _ in range(args.repeats):
            for mode, llm in llms.items():
                look = llm.engine.lookahead
                if look is not None:  # forget earlier runs' outputs (see the module docstring)
                    look.pool = SharedDraftPool(look.drafter_config)
                out = llm.generate({"prompt_token_ids": ids}, params)[0]
                m = out.metrics
                n = len(out.outputs[0].token_ids)
                run = {"tokens": out.outputs[0].token_ids, "num_tokens": n,
                       "decode_tok_s": (n - 1) / (m.finished_time - m.first_token_time),
                       "verify_steps": m.num_verify_steps, "drafted": m.num_draft_tokens,
                       "accepted": m.num_accepted_tokens}
                best = res.setdefault(name, {}).get(mode)
                runs = (best or {}).get("all_decode_tok_s", []) + [run["decode_tok_s"]]
                if best is None or run["decode_tok_s"] > best["decode_tok_s"]:
                    best = run
                best["all_decode_tok_s"] = runs
                res[name][mode] = best
    return res


def worker_hf(args) -> dict:
    import torch

    tok, model, _ = hf_worker.load(args.threads)
    res: dict = {}
    for name, ids in build_prompts(tok, args.doc_tokens).items():
        x = torch.tensor([ids])
        with torch.inference_mode():
            prefill, _ = hf_worker.generate(model, x, max_new_tokens=1, do_sample=False)
            for mode, extra in (("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": 10})):
                total, out = hf_worker.generate(model, x, max_new_tokens=args.max_tokens, do_sample=False, **extra)
                n = out.shape[1] - x.shape[1]
                res.setdefault(name, {})[mode] = {
                    "tokens": out[0, x.shape[1]:].tolist(), "num_tokens": n,
                    "decode_tok_s": (n - 1) / max(total - prefill, 1e-9)}
    return res


def run_worker(name: str, args) -> dict:
    cmd = ["--worker", name, "--max-tokens", str(args.max_tokens),
           "--threads", str(args.threads), "--doc-tokens", str(args.doc_tokens),
           "--repeats", str(args.repeats)]
    return hf_worker.spawn(__file__, cmd, name)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    parser.add_argument("--worker", choices=("longctx", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps((worker_hf if args.worker == "hf" else worker_longctx)(args)))
        return
    ours = run_worker("longctx", args)
    hf = None if args.skip_hf else run_worker("hf", args)
    table, report = [], {"machine": machine_info(), "threads": args.threads,
                         "max_tokens": args.max_tokens, "doc_tokens": args.doc_tokens,
                         "targets_speedup": TARGETS, "cases": {}}
    for name in TARGETS:
        plain, look = ours[name]["plain"], ours[name]["lookahead"]
        case = {"longctx": ours[name], "speedup": look["decode_tok_s"] / plain["decode_tok_s"],
                "identical_tokens": look["tokens"] == plain["tokens"],
                "tokens_per_verify_step": ((look["accepted"] + look["verify_steps"]) / look["verify_steps"]
                                           if look["verify_steps"] else None)}
        if hf:
            case["hf"] = hf[name]
            case["hf_prompt_lookup_speedup"] = (hf[name]["prompt_lookup"]["decode_tok_s"]
                                                / hf[name]["plain"]["decode_tok_s"])
            case["longctx_lookahead_vs_hf_prompt_lookup"] = (look["decode_tok_s"]
                                                             / hf[name]["prompt_lookup"]["decode_tok_s"])
        report["cases"][name] = case
        table.append((name, plain, look, case, hf and hf[name]))
    save_result(args.out, report, indent=2)
    print(f"\ndecode tokens/s, greedy, {args.max_tokens} new tokens at most ({args.threads} threads)")
    print(f"{'case':<16} {'plain':>7} {'lookahead':>9} {'speedup':>8} {'target':>7} {'tok/step':>8} "
          f"{'same':>5} {'HF':>7} {'HF+PL':>7}")
    for name, plain, look, case, h in table:
        tps = case["tokens_per_verify_step"]
        print(f"{name:<16} {plain['decode_tok_s']:>7.1f} {look['decode_tok_s']:>9.1f} "
              f"{case['speedup']:>7.2f}x {TARGETS[name]:>6.2f}x {tps or 0:>8.2f} "
              f"{str(case['identical_tokens']):>5} "
              f"{h['plain']['decode_tok_s'] if h else 0:>7.1f} {h['prompt_lookup']['decode_tok_s'] if h else 0:>7.1f}")


if __name__ == "__main__":
    main()

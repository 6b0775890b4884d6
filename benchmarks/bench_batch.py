"""Batch benchmark: documents x questions through ``longctx batch`` vs HF transformers one
prompt at a time, in one run.

The work: 4 documents (license texts from /usr/share/common-licenses, each cut to
``--doc-tokens`` tokens) x 5 questions, greedy, ``--max-tokens`` new tokens per answer at
most, both engines stopping at EOS (identical answers mean the same number of tokens). Both
get the same prompt token ids: the document, then the question, in the model's chat template (``longctx.entrypoints.tasks``).

  * longctx: one ``longctx batch`` process over 4 ``ask`` records (each document prefilled once
    through the prefix cache, its 5 questions decoded as one batch);
  * HF transformers (fp32): ``generate`` on each of the 20 prompts, one after another, in its
    own process.

Reported per engine: wall time of the whole process (model load included), time of the work
alone, generated tokens and tokens/s; ratios longctx / HF; how many answers are identical.

Usage:  python benchmarks/run.py batch -- [--quick] [--threads 2] [--doc-tokens 2000]
        (or python benchmarks/bench_batch.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py batch, which records it as
benchmarks/results/batch/<machine>/<git rev>.json); without ``--out`` it writes nothing. Prints a
table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hf_worker
from machine import ROOT, machine_info, save_result

LICENSES = Path("/usr/share/common-licenses")
DOCUMENTS = ("GPL-2", "LGPL-2.1", "MPL-2.0", "Apache-2.0")
QUESTIONS = ("What is the name of this license?", "Who may copy or distribute the work?",
             "What must be included when the work is distributed?",
             "Does the license give any warranty?", "What happens if the terms are violated?")


def write_documents(tok, folder: Path, num_docs: int, doc_tokens: int) -> list[Path]:
    """The first ``doc_tokens`` tokens of each license, decoded back to text, as files."""
    paths = []
    for name in DOCUMENTS[:num_docs]:
        ids = tok.encode((LICENSES / name).read_text(), add_special_tokens=False)[:doc_tokens]
        path = folder / f"{name}.txt"
        path.write_text(tok.decode(ids), encoding="utf-8")
        paths.append(path)
    return paths


def prompt_ids(tok, document: str, question: str) -> list[int]:
    from longctx.entrypoints import tasks

    content = tasks.document_prompt(document, tasks.QUESTION_INSTRUCTIONS.format(question=question))
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------- engines

def run_hf(args) -> dict:
    """Worker process: every prompt through ``model.generate``, one at a time."""
    import torch

    tok, model, load_s = hf_worker.load(args.threads)
    answers = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for path in sorted(Path(args.docs).glob("*.txt")):
            document = path.read_text(encoding="utf-8")
            for question in args.questions:
                ids = torch.tensor([prompt_ids(tok, document, question)])
                _, out = hf_worker.generate(model, ids, max_new_tokens=args.max_tokens, do_sample=False,
                                            pad_token_id=tok.eos_token_id)
                new = out[0, ids.shape[1]:].tolist()
                answers[f"{path.stem}|{question}"] = {
                    "text": tok.decode(new, skip_special_tokens=True).strip(),
                    "prompt_tokens": ids.shape[1], "completion_tokens": len(new)}
    return {"load_s": load_s, "work_s": time.perf_counter() - t0, "answers": answers}


def run_longctx(args, docs: list[Path], folder: Path) -> dict:
    records = [{"id": p.stem, "task": "ask", "document_path": str(p), "questions": list(args.questions),
                "max_tokens": args.max_tokens} for p in docs]
    jobs, out = folder / "jobs.jsonl", folder / "results.jsonl"
    jobs.write_text("".join(json.dumps(r) + "\n" for r in records))
    cmd = [sys.executable, "-m", "longctx", "batch", str(jobs), "--output", str(out), "--overwrite",
           "--num-threads", str(args.threads), "--progress", "off"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"longctx batch failed ({proc.returncode}): {proc.stderr[-3000:]}")
    results = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"longctx batch wrote error lines: {errors}")
    answers = {f"{r['id']}|{a['question']}": {k: a[k] for k in ("text", "prompt_tokens", "completion_tokens")}
               for r in results for a in r["answers"]}
    return {"wall_s": wall, "work_s": sum(r["elapsed_s"] for r in results), "answers": answers}


def run_hf_process(args, docs_folder: Path) -> dict:
    cmd = ["--worker", "--docs", str(docs_folder), "--threads", str(args.threads),
           "--max-tokens", str(args.max_tokens), "--num-questions", str(len(args.questions))]
    res, wall = hf_worker.spawn(__file__, cmd, "HF", announce=False)
    return {"wall_s": wall, **res}


# ---------------------------------------------------------------- report

def summarize(hf: dict, lc: dict) -> dict:
    def tokens(r):
        return sum(a["completion_tokens"] for a in r["answers"].values())

    out = {}
    for name, r in (("hf", hf), ("longctx", lc)):
        out[name] = {"wall_s": r["wall_s"], "work_s": r["work_s"], "generated_tokens": tokens(r),
                     "tok_s": tokens(r) / r["work_s"], "wall_tok_s": tokens(r) / r["wall_s"]}
    out["speedup_work"] = hf["work_s"] / lc["work_s"]
    out["speedup_wall"] = hf["wall_s"] / lc["wall_s"]
    out["tok_s_ratio"] = out["longctx"]["tok_s"] / out["hf"]["tok_s"]
    keys = sorted(hf["answers"])
    out["same_prompt_tokens"] = all(hf["answers"][k]["prompt_tokens"] == lc["answers"][k]["prompt_tokens"]
                                    for k in keys)
    out["identical_answers"] = sum(hf["answers"][k]["text"] == lc["answers"][k]["text"] for k in keys)
    out["num_answers"] = len(keys)
    return out


def table(s: dict) -> list[str]:
    rows = [f"{'engine':<10} {'wall s':>8} {'work s':>8} {'tokens':>7} {'tok/s':>7}"]
    for name in ("hf", "longctx"):
        r = s[name]
        rows.append(f"{name:<10} {r['wall_s']:>8.1f} {r['work_s']:>8.1f} {r['generated_tokens']:>7} "
                    f"{r['tok_s']:>7.1f}")
    rows.append(f"longctx vs HF: work {s['speedup_work']:.2f}x faster, wall {s['speedup_wall']:.2f}x, "
                f"tok/s ratio {s['tok_s_ratio']:.2f}; identical answers {s['identical_answers']}/"
                f"{s['num_answers']}; same prompt tokens: {s['same_prompt_tokens']}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--docs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-docs", type=int, default=4)
    p.add_argument("--num-questions", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="2 documents x 2 questions, short: checks the script runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.num_docs, args.num_questions, args.doc_tokens, args.max_tokens = 2, 2, 200, 8
    args.questions = QUESTIONS[: args.num_questions]
    if args.worker:
        print(json.dumps(run_hf(args)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        folder = Path(tmp)
        docs = write_documents(hf_worker.load_tokenizer(), folder, args.num_docs, args.doc_tokens)
        print(f"running longctx batch on {len(docs)} documents x {len(args.questions)} questions ...",
              file=sys.stderr, flush=True)
        lc = run_longctx(args, docs, folder)
        print("running HF transformers, one prompt at a time ...", file=sys.stderr, flush=True)
        hf = run_hf_process(args, folder)
    summary = summarize(hf, lc)
    report = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k not in ("out", "docs")},
              "summary": summary, "hf": hf, "longctx": lc}
    save_result(args.out, report)
    for row in table(summary):
        print(row)


if __name__ == "__main__":
    main()

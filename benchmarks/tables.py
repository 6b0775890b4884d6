"""The tables of current benchmark figures in README.md and docs/benchmarks.md, generated.

Usage:  python benchmarks/tables.py            # rewrite the tables in place
        python benchmarks/tables.py --check    # exit 1, naming each stale table, if a file differs

A table sits between two marker comments in a Markdown file::

    <!-- table:readme-results begin -->
    ... generated: never edit by hand ...
    <!-- table:readme-results end -->

Everything between the markers is generated from the result records under
``benchmarks/results/<bench>/<machine>/*.json`` (schema 1: ``{"schema_version": 1, "bench",
"machine", "git": {"rev", "dirty"}, "command", "started", "result"}``, written by
``benchmarks/run.py``; migrated ones carry ``"legacy": true``); the rest of the file is left as
it is. Files under ``results/`` that are not schema-1 records (raw outputs, logs, a study's
summary) are ignored. Every figure is read from a record, none is typed in, and every row names
its machine, git revision and record file.

Which record a row reads: the newest record of its benchmark that holds every field the row
needs ("newest that has the fields"), so a later partial run (one dtype, one prompt length)
does not push out the figures it lacks, and a comparison row (longctx against vLLM in the same
run) reads a record in which both engines ran. Newest is by the record's ``started`` time; on
a tie (records migrated from one commit share it), the record holding more figures, then the
later path name. File times play no part, so a fresh clone gives the same tables.

The functions are pure (records in, text out); ``main`` only reads and writes the files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "docs/benchmarks.md")  # the files whose tables are generated, relative to ROOT
SCHEMA_VERSION = 1

MARKER = re.compile(r"<!-- table:(?P<name>[\w-]+) begin -->\n(?P<body>.*?)<!-- table:(?P=name) end -->",
                    re.DOTALL)


# --- records -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """One result record. ``path``: relative to the repository root; ``name``: relative to the
    results folder (what the tables show)."""

    path: str
    name: str
    data: dict

    @property
    def bench(self) -> str | None:
        return self.data.get("bench")

    @property
    def result(self) -> dict:
        r = self.data.get("result")
        return r if isinstance(r, dict) else {}

    @property
    def machine(self) -> dict:
        m = self.data.get("machine")
        return m if isinstance(m, dict) else {}

    @property
    def folder(self) -> str:
        """``<bench>/<machine>``: the harness's folder, named by the CPU's model string, cores
        and ISA level."""
        return self.name.rsplit("/", 1)[0] if "/" in self.name else ""

    @property
    def kind(self) -> str:
        """The kind of machine: the folder, and the CPU's family and model where the record
        names them (two CPUs can share a model string, and so a folder: the Intel Xeons of
        model 167 and 207 both say "Intel(R) Xeon(R) Processor")."""
        cpu = self.machine.get("cpu_id")
        model = cpu.get("model") if isinstance(cpu, dict) else None
        if not model:
            return self.folder
        return f"{self.folder}@{cpu.get('family')}-{model}" + ("-noamx" if without_amx(self.machine) else "")


def without_amx(machine: dict) -> bool:
    """An Intel CPU whose cores have AMX (AVX-512 FP16 came with it) in a VM that does not pass it
    on: its bfloat16 paths differ from the same model's with AMX, so its records are a kind apart."""
    cpu_id = machine.get("cpu_id") if isinstance(machine.get("cpu_id"), dict) else {}
    isa = cpu_id.get("isa") if isinstance(cpu_id.get("isa"), list) else []
    return cpu_id.get("vendor") == "GenuineIntel" and "avx512_fp16" in isa and "amx_tile" not in isa


def is_record(data) -> bool:
    return (isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION
            and isinstance(data.get("bench"), str) and isinstance(data.get("result"), dict))


def load_records(results: Path = RESULTS, root: Path = ROOT) -> list[Record]:
    """Every schema-1 record under ``results`` (any depth), in path order."""
    out = []
    for path in sorted(results.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not is_record(data):
            continue
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            rel = path.as_posix()
        out.append(Record(rel, path.relative_to(results).as_posix(), data))
    return out


def started_at(rec: Record) -> float:
    """The record's ``started`` as a POSIX time; records without one sort oldest."""
    text = rec.data.get("started")
    if not isinstance(text, str):
        return float("-inf")
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return float("-inf")
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def count_figures(value) -> int:
    """How many numbers a result holds (the tie-break between records of one start time)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, (int, float)):
        return 1
    if isinstance(value, dict):
        return sum(count_figures(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_figures(v) for v in value)
    return 0


def order_key(rec: Record) -> tuple:
    return started_at(rec), count_figures(rec.result), rec.name


def newest(records: Iterable[Record], bench: str, needs: Callable[[Record], bool] | None = None) -> Record | None:
    """The newest record of ``bench`` for which ``needs(record)`` holds (None if there is none)."""
    found = [r for r in records if r.bench == bench and (needs is None or _holds(needs, r))]
    return max(found, key=order_key) if found else None


def kinds(records: Iterable[Record]) -> list[str]:
    """The machine kinds of ``records``, sorted. A folder's records that name no CPU model
    (older than the harness's ``cpu_id``: they cannot say which of the folder's CPUs ran them)
    count only where none of that folder's records among ``records`` names one."""
    found = {r.kind for r in records}
    named = {k.split("@", 1)[0] for k in found if "@" in k}
    return sorted(k for k in found if "@" in k or k not in named)


def newest_per_kind(records: Iterable[Record], bench: str, needs: Callable[[Record], bool]) -> list[Record]:
    """``newest`` for each kind of machine (``Record.kind``) that has such a record, in kind
    order: for figures whose bar holds on every kind of CPU (the kernels are tuned per kind)."""
    records = list(records)
    held = [r for r in records if r.bench == bench and _holds(needs, r)]
    return [newest(held, bench, lambda r, k=k: r.kind == k) for k in kinds(held)]


def _holds(needs: Callable[[Record], bool], rec: Record) -> bool:
    try:
        return bool(needs(rec))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError):
        return False


# --- reading figures -----------------------------------------------------------------------

def get(d, *keys):
    """``d[k0][k1]...`` or None where a level is missing."""
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def num(value) -> float | None:
    """A figure: a number as it is, a list of repeats as its median."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        vals = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return float(statistics.median(vals)) if vals else None
    return None


def rev(rec: Record) -> str:
    """The git revision a record ran at (``-dirty`` when its tree had changes)."""
    git = rec.data.get("git") if isinstance(rec.data.get("git"), dict) else {}
    r = git.get("rev") or rec.machine.get("git_rev") or get(rec.result, "machine", "git_rev") or "unknown"
    r = str(r)
    if git.get("dirty") and not r.endswith("-dirty"):
        r += "-dirty"
    return r


def machine_name(rec: Record) -> str:
    """The CPU model (its family and model numbers where the record has them, and the cores),
    or the GPU for a GPU run."""
    m = rec.machine
    if m.get("gpu"):
        return str(m["gpu"])
    cpu = re.sub(r"\s*\((R|TM|r|tm)\)", "", str(m.get("cpu") or "unknown CPU")).strip()
    notes = []
    if re.search(r"-avx2-\d+c$", rec.folder):  # the harness's folder of an AVX2-only x86 CPU
        notes.append("AVX2 only")
    cpu_id = m.get("cpu_id") if isinstance(m.get("cpu_id"), dict) else {}
    if without_amx(m):
        notes.append("no AMX")
    if cpu_id.get("model"):
        notes.append(f"family {cpu_id.get('family', '?')} model {cpu_id['model']}")
    if notes:
        cpu += f" ({'; '.join(notes)})"
    return f"{cpu}, {m['cores']} cores" if m.get("cores") else cpu


class Doc:
    """Where a table is written: links to records are relative to this file's folder."""

    def __init__(self, doc: Path, root: Path = ROOT):
        self.dir = (root / doc).parent if not doc.is_absolute() else doc.parent
        self.root = root

    def link(self, rec: Record) -> str:
        target = os.path.relpath(self.root / rec.path, self.dir).replace(os.sep, "/")
        return f"[`{rec.name}`]({target})"

    def run(self, rec: Record | None) -> str:
        """The row's source: machine, git revision, record file."""
        if rec is None:
            return "no record"
        return f"{machine_name(rec)}, git {rev(rec)}, {self.link(rec)}"


# --- formatting ----------------------------------------------------------------------------

def f(x: float | None, digits: int = 1) -> str:
    return "?" if x is None else f"{x:,.{digits}f}"


def sec(x: float | None) -> str:
    """Seconds: two decimals below 100 s, one above."""
    if x is None:
        return "?"
    return f"{x:,.1f}" if x >= 100 else f"{x:.2f}"


def times(a: float | None, b: float | None, digits: int = 2) -> str:
    """``a / b`` as ``1.23x``."""
    if a is None or not b:
        return "?"
    return f"{a / b:.{digits}f}x"


def tokens(n) -> str:
    """8000 -> 8K, 1024 -> 1K, 32768 -> 32K, 160 -> 160."""
    n = int(n)
    return f"{round(n / 1024)}K" if n >= 1000 else str(n)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") if "](" not in cell else cell for cell in row) + " |"
              for row in rows]
    return lines


def missing(what: str) -> list[str]:
    return [f"_No record in `benchmarks/results/` has the fields this table needs ({what})._"]


# --- e2e (bench_e2e.py) --------------------------------------------------------------------

def engine(rec: Record, name: str) -> dict:
    e = get(rec.result, "results", name)
    return e if isinstance(e, dict) else {}


def prefill(rec: Record, name: str, n) -> float | None:
    return num(get(engine(rec, name), "prefill_s", str(n)))


def lengths(rec: Record, *names: str) -> list[int]:
    """Prompt lengths every named engine has a prefill figure for, ascending."""
    sets = [{int(k) for k, v in (engine(rec, n).get("prefill_s") or {}).items() if num(v) is not None}
            for n in names]
    return sorted(set.intersection(*sets)) if sets else []


def decode(rec: Record, name: str) -> float | None:
    return num(engine(rec, name).get("decode_ms"))


def batch_tok_s(rec: Record, name: str) -> float | None:
    return num(get(engine(rec, name), "batch", "output_tok_s"))


def rss(rec: Record, name: str) -> float | None:
    return num(engine(rec, name).get("peak_rss_gib"))


def has_prefill(*names: str, at_least: int = 1):
    return lambda r: len(lengths(r, *names)) >= at_least


def has(fn, *names: str):
    """Every named engine has the figure ``fn(record, engine)``."""
    return lambda r: all(fn(r, n) is not None for n in names)


def both(*needs):
    return lambda r: all(_holds(n, r) for n in needs)


HF, LC, LB, VF, VB = "hf-fp32", "longctx-fp32", "longctx-bf16", "vllm-fp32", "vllm-bf16"
ENGINE_LABELS = {HF: "HF transformers fp32", LC: "longctx fp32", LB: "longctx bf16",
                 VF: "vLLM-CPU fp32", VB: "vLLM-CPU bf16"}


def vllm_version(rec: Record) -> str:
    v = engine(rec, VF).get("vllm") or engine(rec, VB).get("vllm")
    return f" {v}" if v else ""


def reruns(records: list[Record], rec: Record, needs) -> list[Record]:
    """Other records of the same benchmark, machine kind and revision as ``rec`` that hold
    ``needs``: reruns of part of a run (an fp32-only rerun of the vLLM comparison), newest first."""
    base = rev(rec).removesuffix("-dirty")
    out = [r for r in records if r is not rec and r.bench == rec.bench and r.kind == rec.kind
           and rev(r).removesuffix("-dirty") == base and _holds(needs, r)]
    return sorted(out, key=order_key, reverse=True)


# --- the README's results table ------------------------------------------------------------

def readme_results(records: list[Record], doc: Doc) -> list[str]:
    rows: list[list[str]] = []

    # longctx against HF transformers, each row the newest e2e record holding both engines' figures
    e = newest(records, "e2e", has_prefill(HF, LC))
    if e:
        ns = lengths(e, HF, LC)
        ns = [ns[0], ns[-1]] if len(ns) > 1 else ns
        lc = [prefill(e, LC, n) for n in ns]
        hf = [prefill(e, HF, n) for n in ns]
        rows.append([f"prefill, {' / '.join(tokens(n) for n in ns)} tokens",
                     " / ".join(sec(x) for x in lc) + " s",
                     " / ".join(sec(x) for x in hf) + " s (" + " / ".join(times(b, a, 1) for a, b in zip(lc, hf)) + ")",
                     doc.run(e)])
    e = newest(records, "e2e", has(decode, HF, LC))
    if e:
        ctx = get(e.result, "args", "decode_ctx")
        rows.append([f"decode at {tokens(ctx)} context" if ctx else "decode",
                     f"{f(decode(e, LC))} ms/token",
                     f"{f(decode(e, HF))} ms/token ({times(decode(e, HF), decode(e, LC), 1)})", doc.run(e)])
    e = newest(records, "e2e", has(batch_tok_s, HF, LC))
    if e:
        a = e.result.get("args") or {}
        what = (f"batch of {a['batch']} x {tokens(a['batch_ctx'])} prompts, {a['batch_tokens']} new tokens"
                if all(a.get(k) for k in ("batch", "batch_ctx", "batch_tokens")) else "batch")
        rows.append([what, f"{f(batch_tok_s(e, LC))} tok/s",
                     f"{f(batch_tok_s(e, HF))} tok/s ({times(batch_tok_s(e, LC), batch_tok_s(e, HF), 1)})",
                     doc.run(e)])
    e = newest(records, "e2e", has(rss, HF, LC))
    if e:
        rows.append(["peak RSS", f"{f(rss(e, LC), 2)} GiB",
                     f"{f(rss(e, HF), 2)} GiB (longctx {100 * rss(e, LC) / rss(e, HF):.0f}% of it)", doc.run(e)])

    # prefix store tiers
    p = newest(records, "prefix", lambda r: prefix_tiers(r) is not None)
    if p:
        t = prefix_tiers(p)
        h = newest(records, "prefix", lambda r: num(r.result.get("hf_recompute_s")) is not None)
        hf_cell = "not run"
        if h is p:
            hf_cell = f"{sec(num(h.result['hf_recompute_s']))} s (recomputes)"
        elif h:
            hf_cell = f"not run (an earlier run: {sec(num(h.result['hf_recompute_s']))} s, recomputes)"
        doc_tokens = p.result.get("doc_tokens")
        what = f"{tokens(doc_tokens)} document" if doc_tokens else "document"
        run = doc.run(p) + (f"; HF: {doc.run(h)}" if h and h is not p else "")
        rows.append([f"TTFT, {what} + new question: cold / device / host / disk hit",
                     " / ".join(sec(t.get(k)) for k in TIERS) + " s", hf_cell, run])

    # lookahead, the extraction prompt (or the first case of the record)
    la = newest(records, "lookahead", lambda r: bool(lookahead_cases(r)))
    if la:
        name, c = next(((n, c) for n, c in lookahead_cases(la) if n == "extraction"), lookahead_cases(la)[0])
        plain, look = get(c, "longctx", "plain", "decode_tok_s"), get(c, "longctx", "lookahead", "decode_tok_s")
        hf_pl = num(get(c, "hf", "prompt_lookup", "decode_tok_s"))
        n_tok = la.result.get("max_tokens")
        rows.append([f"lookahead, {name.replace('_', ' ')} prompt" + (f" ({n_tok} new tokens)" if n_tok else ""),
                     f"{f(look)} tok/s, plain {f(plain)} ({times(look, plain)})",
                     f"{f(hf_pl)} tok/s with prompt lookup" if hf_pl is not None else "not run", doc.run(la)])

    # batch jobs
    b = newest(records, "batch", lambda r: num(get(r.result, "summary", "longctx", "tok_s")) is not None)
    if b:
        s, a = b.result["summary"], b.result.get("args") or {}
        what = (f"batch job, {a['num_docs']} documents x {a['num_questions']} questions"
                if a.get("num_docs") and a.get("num_questions") else "batch job")
        lc, hf = s["longctx"], s.get("hf") or {}
        rows.append([what, f"{f(lc.get('tok_s'))} tok/s ({sec(lc.get('work_s'))} s)",
                     f"{f(hf.get('tok_s'))} tok/s ({sec(hf.get('work_s'))} s; longctx {times(hf.get('work_s'), lc.get('work_s'))})"
                     if hf.get("tok_s") else "not run", doc.run(b)])

    # long context: float32 against int8 pages at the longest context
    lg = newest(records, "long", lambda r: long_pair(r) is not None)
    if lg:
        ctx, fp, i8 = long_pair(lg)
        rope = lg.result.get("rope_scaling") or {}
        what = f"{tokens(ctx)} prompt" + (f" ({str(rope.get('rope_type')).replace('yarn', 'YaRN')} x{rope['factor']:g})"
                                          if rope.get("rope_type") and rope.get("factor") else "")
        paired = get(lg.result, "paired_decode", "ratio_median")
        rows.append([f"{what}: prefill / decode, float32 vs int8 KV pages",
                     f"{sec(fp['prefill_s'])} s / {f(fp['decode_ms_per_token'])} ms vs "
                     f"{sec(i8['prefill_s'])} s / {f(i8['decode_ms_per_token'])} ms "
                     f"(decode {times(i8['decode_ms_per_token'], fp['decode_ms_per_token'])}"
                     + (f"; paired steps in one process {paired:.3f}x)" if num(paired) is not None else ")"),
                     "not run", doc.run(lg)])

    # against vLLM's CPU build, same run
    v = newest(records, "e2e", has_prefill(VF, LC, VB, LB))
    if v:
        n = lengths(v, VF, LC, VB, LB)[-1]
        lc = [prefill(v, LC, n), prefill(v, LB, n)]
        vl = [prefill(v, VF, n), prefill(v, VB, n)]
        row = [f"against vLLM-CPU{vllm_version(v)} in the same run: {tokens(n)} prefill fp32 / bf16",
               " / ".join(sec(x) for x in lc) + " s",
               "vLLM " + " / ".join(sec(x) for x in vl) + " s (longctx/vLLM "
               + " / ".join(times(a, b) for a, b in zip(lc, vl)) + ")", doc.run(v)]
        # an fp32 rerun of the same revision on the same machine (the newest), in the same row
        again = reruns(records, v, has_prefill(VF, LC))
        if again:
            r = again[0]
            m = lengths(r, VF, LC)[-1]
            a, b = prefill(r, LC, m), prefill(r, VF, m)
            row[1] += f" (fp32 rerun: {sec(a)} s)"
            row[2] += f"; rerun vLLM {sec(b)} s ({times(a, b)})"
            row[3] += f"; rerun: {doc.run(r)}"
        rows.append(row)
    v = newest(records, "e2e", both(has(decode, VF, LC, VB, LB), has(rss, VF, LC, VB, LB)))
    if v:
        ctx = get(v.result, "args", "decode_ctx")
        rows.append([f"same run: decode at {tokens(ctx) if ctx else '?'} fp32 / bf16; peak RSS",
                     f"{f(decode(v, LC))} / {f(decode(v, LB))} ms/token; {f(rss(v, LC), 2)} / {f(rss(v, LB), 2)} GiB",
                     f"vLLM {f(decode(v, VF))} / {f(decode(v, VB))} (longctx/vLLM {times(decode(v, LC), decode(v, VF))}"
                     f" / {times(decode(v, LB), decode(v, VB))}); {f(rss(v, VF), 2)} / {f(rss(v, VB), 2)} GiB",
                     doc.run(v)])

    # sequence parallelism
    sp = newest(records, "parallel", lambda r: bool(sp_pairs(r)))
    if sp:
        ctx, one, two = sp_pairs(sp)[-1]
        rows.append([f"decode at {tokens(ctx)}, {two['world']} SP ranks vs 1 process",
                     f"{f(two['decode_ms_per_token'])} vs {f(one['decode_ms_per_token'])} ms/token "
                     f"({times(two['decode_ms_per_token'], one['decode_ms_per_token'])} the time: the ranks share one CPU)",
                     "", doc.run(sp)])

    # GGUF blocks against llama.cpp on the same file: the newest record per model file, machine
    # folder and prompt length (the kernels are tuned per CPU kind: Intel's and AMD's side by
    # side; the targets table in docs/benchmarks.md has every CPU model)
    for model, label in (("1b-q4_k_m", "1B-shaped Q4_K_M"), ("default", "SmolLM2-135M Q4_1")):
        for q in llama_cpp_records(records, model, per_folder=True):
            by, ctx = quant_rows(q), get(q.result, "args", "ctx")
            lc, ll = by["longctx blocks"], by["llama.cpp"]
            kv = (by.get("longctx blocks-int8kv"), by.get("llama.cpp q8_0 KV"))
            half = by.get("longctx blocks-bf16kv")  # 2-byte pages, as llama.cpp's f16 KV
            fast2 = by.get("longctx fast2-bf16kv")  # and block_numerics="fast2"
            bf = by.get("longctx blocks-bf16")  # dtype="bfloat16": bfloat16 pages, prefill on bfloat16 slices (AMX, vdpbf16ps)
            rows.append([f"GGUF {label}, {tokens(ctx) if ctx else '?'} prompt: prefill / decode"
                         + (" (8-bit KV)" if all(kv) else ""),
                         f"{sec(lc['prefill_s'])} s / {f(lc['decode_ms'])} ms"
                         + (f" ({f(kv[0]['decode_ms'])} ms, int8 pages)" if all(kv) else "")
                         + (f" ({f(half['decode_ms'])} ms, bfloat16 pages)" if half else "")
                         + (f" ({f(fast2['decode_ms'])} ms, fast2 and bfloat16 pages)" if fast2 else "")
                         + (f" ({sec(bf['prefill_s'])} s / {f(bf['decode_ms'])} ms, dtype bfloat16)" if bf else ""),
                         f"llama.cpp {sec(ll['prefill_s'])} s / {f(ll['decode_ms'])} ms"
                         + (f" ({f(kv[1]['decode_ms'])} ms, q8_0)" if all(kv) else "")
                         + f" (longctx/llama.cpp {times(lc['prefill_s'], ll['prefill_s'])} / "
                         f"{times(lc['decode_ms'], ll['decode_ms'])}"
                         + (f"; 8-bit KV {times(kv[0]['decode_ms'], kv[1]['decode_ms'])}" if all(kv) else "")
                         + (f"; bfloat16 pages {times(half['decode_ms'], ll['decode_ms'])}" if half else "")
                         + (f"; fast2 and bfloat16 pages {times(fast2['decode_ms'], ll['decode_ms'])}" if fast2 else "")
                         + (f"; dtype bfloat16 {times(bf['prefill_s'], ll['prefill_s'])} / "
                            f"{times(bf['decode_ms'], ll['decode_ms'])}" if bf else "")
                         + ")",
                         doc.run(q)])

    # weights quantized at load against vLLM-CPU bf16 on the same HF folder (issue 42's int8 bar)
    vq = [r for r in records if r.bench == "quant" and _holds(
        lambda r: {"vllm bfloat16", "longctx int8"} <= set(quant_rows(r)), r)]
    for folder in sorted({r.folder for r in vq}):  # the README: one row per folder
        q = newest(vq, "quant", lambda r, fo=folder: r.folder == fo)
        by, ctx = quant_rows(q), get(q.result, "args", "ctx")
        v = by["vllm bfloat16"]
        label = "1B-shaped" if str(get(q.result, "args", "model")).startswith("1b") else "SmolLM2-135M"
        ours = [(name, by[f"longctx {name}"]) for name in ("int8", "int8-fast", "int8-fast-bf16kv", "int8-bf16",
                                                           "int8-fast-bf16", "int4", "float", "bf16")
                if f"longctx {name}" in by]
        vf = by.get("vllm float32")  # float32 against float32 where it ran, the rest against bf16

        def peer(name: str) -> tuple[str, dict]:
            return ("fp32", vf) if name == "float" and vf else ("bf16", v)

        rows.append([f"{label} HF folder, {tokens(ctx) if ctx else '?'} prompt: prefill / decode, "
                     "weights quantized at load",
                     "; ".join(f"{name} {sec(r['prefill_s'])} s / {f(r['decode_ms'])} ms" for name, r in ours),
                     f"vLLM-CPU bf16 {sec(v['prefill_s'])} s / {f(v['decode_ms'])} ms"
                     + (f", fp32 {sec(vf['prefill_s'])} s / {f(vf['decode_ms'])} ms" if vf else "")
                     + " (longctx/vLLM " + "; ".join(
                         f"{name} {times(r['prefill_s'], peer(name)[1]['prefill_s'])} / "
                         f"{times(r['decode_ms'], peer(name)[1]['decode_ms'])} vs its {peer(name)[0]}"
                         for name, r in ours) + ")",
                     doc.run(q)])

    if not rows:
        return missing("e2e, prefix, lookahead, batch, long, parallel, quant")
    return table(["measure", "longctx", "HF transformers (or the engine named)",
                  "run (machine, git, record in `benchmarks/results/`)"], rows)


# --- helpers for the other benchmarks ------------------------------------------------------

def llama_cpp_records(records: list[Record], model: str, per_folder: bool = False) -> list[Record]:
    """bench_quant's newest record against llama.cpp on ``model``'s file for each machine kind
    (``Record.kind``; the kernels are tuned per CPU kind) and prompt length, in kind and length
    order, among those holding some longctx engine over the file's blocks (``blocks``,
    ``blocks-bf16``, ...); with ``per_folder``, for each of the harness's folders instead, among
    those holding the exact ``blocks`` engine (the README's one row per folder shows it)."""
    def ours(rows: dict) -> bool:
        return "longctx blocks" in rows if per_folder else any(n.startswith("longctx blocks") for n in rows)

    qs = [r for r in records if r.bench == "quant" and _holds(
        lambda r: get(r.result, "args", "model") == model and "llama.cpp" in quant_rows(r) and ours(quant_rows(r)), r)]
    groups = sorted({r.folder for r in qs}) if per_folder else kinds(qs)

    def group(r: Record) -> str:
        return r.folder if per_folder else r.kind

    return [newest(qs, "quant", lambda r, g=g, n=n: (group(r), get(r.result, "args", "ctx") or 0) == (g, n))
            for g in groups for n in sorted({get(r.result, "args", "ctx") or 0 for r in qs if group(r) == g})]


def quant_rows(rec: Record) -> dict[str, dict]:
    """bench_quant's rows by engine name (those with prefill and decode figures)."""
    rows = get(rec.result, "rows") or []
    return {r["engine"]: r for r in rows if isinstance(r, dict) and num(r.get("prefill_s")) is not None
            and num(r.get("decode_ms")) is not None}


TIERS = ("cold", "device_hit", "host_hit", "disk_hit")
TIER_LABELS = {"cold": "cold (nothing cached)", "device_hit": "device hit", "host_hit": "host hit",
               "disk_hit": "disk hit (a fresh process)"}


def prefix_tiers(rec: Record) -> dict[str, float] | None:
    """TTFT per tier: ``ttft_s`` (bench_prefix.py) or ``after_median`` (the before/after run of
    the tier-move change, whose ``after`` is the code as it stands)."""
    r = rec.result
    t = r.get("ttft_s")
    if not isinstance(t, dict):
        t = {k.removesuffix("_s"): v for k, v in (r.get("after_median") or {}).items()}
    out = {k: num(t.get(k)) for k in TIERS}
    return out if all(v is not None for v in out.values()) else None


def lookahead_cases(rec: Record) -> list[tuple[str, dict]]:
    cases = rec.result.get("cases")
    if not isinstance(cases, dict):
        return []
    return [(n, c) for n, c in cases.items() if isinstance(c, dict)
            and num(get(c, "longctx", "plain", "decode_tok_s")) is not None
            and num(get(c, "longctx", "lookahead", "decode_tok_s")) is not None]


def long_stages(rec: Record, dtype: str) -> dict[int, dict]:
    stages = get(rec.result, "results", dtype, "stages")
    if not isinstance(stages, list):
        return {}
    return {s["context"]: s for s in stages if isinstance(s, dict) and isinstance(s.get("context"), int)
            and num(s.get("prefill_s")) is not None and num(s.get("decode_ms_per_token")) is not None}


def long_pair(rec: Record) -> tuple[int, dict, dict] | None:
    """(longest context, float32 stage, int8 stage) where both dtypes ran it."""
    fp, i8 = long_stages(rec, "auto"), long_stages(rec, "int8")
    common = sorted(set(fp) & set(i8))
    return (common[-1], fp[common[-1]], i8[common[-1]]) if common else None


def sp_pairs(rec: Record) -> list[tuple[int, dict, dict]]:
    """(context, N = 1 row, N = 2+ row) for each context both ran, ascending."""
    rows = [r for r in (rec.result.get("summary") or []) if isinstance(r, dict)
            and isinstance(r.get("world"), int) and isinstance(r.get("context"), int)
            and num(r.get("decode_ms_per_token")) is not None and num(r.get("prefill_s")) is not None]
    out = []
    for ctx in sorted({r["context"] for r in rows}):
        one = [r for r in rows if r["context"] == ctx and r["world"] == 1]
        more = sorted((r for r in rows if r["context"] == ctx and r["world"] > 1), key=lambda r: r["world"])
        if one and more:
            out.append((ctx, one[0], more[0]))
    return out


def serve_flags(rec: Record) -> tuple[str, ...] | None:
    flags = get(rec.result, "args", "server_flags")
    return tuple(str(x) for x in flags) if isinstance(flags, list) else None


def gpu_rows(rec: Record) -> dict[tuple, dict]:
    rows = rec.result.get("rows")
    if not isinstance(rows, list):
        return {}
    return {(r["context"], bool(r.get("graphs")), str(r.get("kv_cache_dtype"))): r for r in rows
            if isinstance(r, dict) and isinstance(r.get("context"), int)
            and num(r.get("prefill_s")) is not None and num(r.get("decode_ms_per_token")) is not None}


# --- docs/benchmarks.md: current figures ---------------------------------------------------

def e2e_hf(records: list[Record], doc: Doc) -> list[str]:
    e = newest(records, "e2e", both(has_prefill(HF, LC), has(decode, HF, LC)))
    if e is None:
        return missing("bench_e2e.py with hf-fp32 and longctx-fp32")
    res = e.result.get("results") or {}
    names = [n for n in (HF, LC, LB) if n in res] + sorted(n for n in res if n not in (HF, LC, LB))
    ns = lengths(e, HF, LC)
    a = e.result.get("args") or {}
    ctx = a.get("decode_ctx")
    header = (["engine"] + [f"prefill {tokens(n)}" for n in ns]
              + [f"decode at {tokens(ctx) if ctx else '?'}, ms/token",
                 f"batch {a.get('batch', '?')} x {tokens(a['batch_ctx']) if a.get('batch_ctx') else '?'}, tok/s",
                 "peak RSS", "run"])
    rows = []
    for n in names:
        row = [ENGINE_LABELS.get(n, n)]
        for length in ns:
            x, h = prefill(e, n, length), prefill(e, HF, length)
            row.append(f"{sec(x)} s" + (f" ({times(h, x, 1)})" if n != HF and x is not None else ""))
        d, dh = decode(e, n), decode(e, HF)
        row.append(f(d) + (f" ({times(dh, d, 1)})" if n != HF and d is not None else ""))
        bt, bh = batch_tok_s(e, n), batch_tok_s(e, HF)
        row.append(f(bt) + (f" ({times(bt, bh, 1)})" if n != HF and bt is not None else ""))
        m, mh = rss(e, n), rss(e, HF)
        row.append(f"{f(m, 2)} GiB" + (f" ({100 * m / mh:.0f}%)" if n != HF and m and mh else ""))
        row.append(doc.run(e))
        rows.append(row)
    lines = table(header, rows)
    lines += ["", "In brackets: HF's time over the engine's (higher is faster), its share of HF's peak RSS. "
              + ceilings_sentence(e, (HF, LC))]
    return lines


def ceilings_sentence(rec: Record, names: Iterable[str]) -> str:
    c = rec.result.get("ceilings") or {}
    parts = []
    if num(c.get("gemm_fp32_gflops")) is not None:
        parts.append(f"fp32 GEMM {c['gemm_fp32_gflops']:.0f} GFLOP/s")
    if num(c.get("gemm_bf16_gflops")) is not None:
        parts.append(f"bf16 GEMM {c['gemm_bf16_gflops']:.0f} GFLOP/s")
    if num(c.get("copy_gbps")) is not None:
        parts.append(f"copy {c['copy_gbps']:.1f} GB/s")
    if num(c.get("read_gbps")) is not None:
        parts.append(f"read {c['read_gbps']:.1f} GB/s")
    text = f"Ceilings in the same run: {', '.join(parts)}." if parts else ""
    for n in names:
        d = get(rec.result, "derived", n) or {}
        bits = []
        if num(d.get("prefill_8000_gflops")) is not None and num(d.get("prefill_8000_fraction_of_fp32_gemm")) is not None:
            bits.append(f"8K prefill at {d['prefill_8000_gflops']:.0f} GFLOP/s "
                        f"({100 * d['prefill_8000_fraction_of_fp32_gemm']:.0f}% of the fp32 GEMM ceiling)")
        if num(d.get("decode_multiple_of_floor")) is not None and num(d.get("decode_floor_ms")) is not None:
            bits.append(f"decode {d['decode_multiple_of_floor']:.2f}x the bandwidth floor ({d['decode_floor_ms']:.1f} ms)")
        if bits:
            text += f" {ENGINE_LABELS.get(n, n)}: {'; '.join(bits)}."
    return text.strip()


def e2e_vllm(records: list[Record], doc: Doc) -> list[str]:
    rows, used = [], []
    for dtype, lc_name, vl_name in (("fp32", LC, VF), ("bf16", LB, VB)):
        for v in newest_per_kind(records, "e2e", both(has_prefill(vl_name, lc_name), has(decode, vl_name, lc_name))):
            used += [v] if v not in used else []
            n = lengths(v, vl_name, lc_name)[-1]
            a, b = prefill(v, lc_name, n), prefill(v, vl_name, n)
            rows.append([f"{dtype} {tokens(n)} prefill", f"{sec(a)} s", f"{sec(b)} s", times(a, b), doc.run(v)])
            ctx = get(v.result, "args", "decode_ctx")
            a, b = decode(v, lc_name), decode(v, vl_name)
            rows.append([f"{dtype} decode at {tokens(ctx) if ctx else '?'}, ms/token", f(a), f(b), times(a, b),
                         doc.run(v)])
            a, b = rss(v, lc_name), rss(v, vl_name)
            if a is not None and b is not None:
                rows.append([f"{dtype} peak RSS (vLLM: its largest process)", f"{f(a, 2)} GiB", f"{f(b, 2)} GiB",
                             times(a, b), doc.run(v)])
            a, b = batch_tok_s(v, lc_name), batch_tok_s(v, vl_name)
            if a is not None and b is not None:  # the ratio of times, as in the other rows
                rows.append([f"{dtype} batch, output tok/s", f(a), f(b), times(b, a), doc.run(v)])
            same = get(v.result, "derived", lc_name, "vs_vllm")
            if isinstance(same, dict) and "decode_tokens_equal" in same:
                equal, compared = same.get("identical_leading_tokens", "?"), same.get("decode_tokens_compared", "?")
                rows.append([f"{dtype} greedy tokens at {tokens(ctx) if ctx else '?'}",
                             f"{equal} of {compared} equal to vLLM's", "", "", doc.run(v)])
            for r in reruns(records, v, has_prefill(vl_name, lc_name)):
                if r is v:
                    continue
                m = lengths(r, vl_name, lc_name)[-1]
                a, b = prefill(r, lc_name, m), prefill(r, vl_name, m)
                rows.append([f"{dtype} {tokens(m)} prefill, rerun at the same revision", f"{sec(a)} s", f"{sec(b)} s",
                             times(a, b), doc.run(r)])
    if not rows:
        return missing("bench_e2e.py with vllm-fp32/longctx-fp32 or vllm-bf16/longctx-bf16")
    v = newest(records, "e2e", has_prefill(VF, LC, VB, LB)) or newest(records, "e2e", has_prefill(VF, LC))
    lines = table(["measure", "longctx", f"vLLM-CPU{vllm_version(v) if v else ''}",
                   "longctx / vLLM (below 1: longctx faster or smaller)", "run"], rows)
    for u in used:  # each machine's record its own ceilings
        sentence = ceilings_sentence(u, (LC, VF, LB, VB))
        if sentence:
            lines += ["", f"{machine_name(u)}, git {rev(u)}: {sentence}"]
    return lines


def prefix(records: list[Record], doc: Doc) -> list[str]:
    p = newest(records, "prefix", lambda r: prefix_tiers(r) is not None)
    if p is None:
        return missing("bench_prefix.py tiers")
    t = prefix_tiers(p)
    targets = p.result.get("targets_fraction_of_cold") or {}
    rows = []
    for k in TIERS:
        share = f"{100 * t[k] / t['cold']:.1f}%" if t.get("cold") else "?"
        target = f"<= {100 * targets[k]:g}%" if num(targets.get(k)) is not None else ""
        rows.append([TIER_LABELS[k], f"{sec(t[k])} s", share, target, doc.run(p)])
    h = newest(records, "prefix", lambda r: num(r.result.get("hf_recompute_s")) is not None)
    if h:
        x = num(h.result["hf_recompute_s"])
        cold = prefix_tiers(h) or {}
        share = f"{100 * x / cold['cold']:.0f}% of that run's cold" if cold.get("cold") else ""
        rows.append(["HF transformers (recomputes everything)", f"{sec(x)} s", share, "", doc.run(h)])
    return table(["case", "TTFT", "of cold", "target", "run"], rows)


def lookahead(records: list[Record], doc: Doc) -> list[str]:
    la = newest(records, "lookahead", lambda r: bool(lookahead_cases(r)))
    if la is None:
        return missing("bench_lookahead.py cases")
    targets = la.result.get("targets_speedup") or {}
    rows = []
    for name, c in lookahead_cases(la):
        plain, look = num(get(c, "longctx", "plain", "decode_tok_s")), num(get(c, "longctx", "lookahead", "decode_tok_s"))
        speed = look / plain if plain else None
        target = num(targets.get(name))
        verdict = "" if target is None or speed is None else (
            f" (target >= {target:g}x: {'met' if speed >= target else 'missed'})")
        same = c.get("identical_tokens")
        rows.append([name.replace("_", " "), f(plain), f(look), f"{speed:.3f}x{verdict}" if speed else "?",
                     f(num(c.get("tokens_per_verify_step"))),
                     "yes" if same is True else "NO" if same is False else "?",
                     f(num(get(c, "hf", "plain", "decode_tok_s"))), f(num(get(c, "hf", "prompt_lookup", "decode_tok_s"))),
                     doc.run(la)])
    return table(["prompt", "plain tok/s", "lookahead tok/s", "speedup", "tokens per verify step",
                  "same tokens", "HF tok/s", "HF prompt lookup tok/s", "run"], rows)


def window_kv(records: list[Record], doc: Doc) -> list[str]:
    """bench_window_kv.py: the Gemma-3-shaped model with its windowed layers freed, kept, and
    its all-global twin, per context."""
    w = newest(records, "window-kv", lambda r: bool(r.result.get("rows")))
    if w is None:
        return missing("bench_window_kv.py rows")
    rows = []
    for r in w.result["rows"]:
        same = r.get("same_tokens_as_keep")
        paired = num(r.get("decode_vs_global_paired"))
        rows.append([tokens(r["context"]), {"free": "freed (ring)", "keep": "kept", "global": "all-global model"}.get(
                         r["mode"], r["mode"]),
                     f(r["kv_bytes_held"] / 2 ** 20), f"{num(r['kv_ratio_vs_global']):.3f}x", sec(num(r["prefill_s"])),
                     f(num(r.get("decode_ms_per_token"))), f"{paired:.2f}x" if paired else "?",
                     "" if same is None else "yes" if same else "NO", doc.run(w)])
    return table(["context", "windowed layers' KV", "KV held (MiB)", "vs all-global", "prefill", "decode ms/token",
                  "decode vs all-global (paired)", "same tokens as kept", "run"], rows)


def batch(records: list[Record], doc: Doc) -> list[str]:
    b = newest(records, "batch", lambda r: num(get(r.result, "summary", "longctx", "tok_s")) is not None)
    if b is None:
        return missing("bench_batch.py summary")
    s = b.result["summary"]
    rows = []
    for side, label in (("longctx", "`longctx batch` (each document prefilled once)"),
                        ("hf", "HF transformers, one prompt at a time")):
        x = s.get(side) or {}
        if num(x.get("tok_s")) is None:
            continue
        rows.append([label, f"{sec(x.get('work_s'))} s", f"{sec(x.get('wall_s'))} s", f(x.get("tok_s")),
                     str(x.get("generated_tokens", "?")), doc.run(b)])
    lines = table(["engine", "work", "wall (load included)", "tok/s", "tokens", "run"], rows)
    if s.get("num_answers"):
        lines += ["", f"longctx {times(get(s, 'hf', 'work_s'), get(s, 'longctx', 'work_s'))} faster in work time; "
                      f"{s.get('identical_answers', '?')} of {s['num_answers']} answers identical."]
    return lines


def serve(records: list[Record], doc: Doc) -> list[str]:
    """One row per concurrency of the newest run of each server flag set (default: no flags)."""
    runs = {}
    for r in records:
        if r.bench == "serve" and serve_flags(r) is not None and isinstance(r.result.get("load"), list):
            k = serve_flags(r)
            if k not in runs or order_key(r) > order_key(runs[k]):
                runs[k] = r
    if not runs:
        return missing("bench_serve.py load")
    rows, inter = [], []
    for flags, r in sorted(runs.items()):
        mode = " ".join(flags) if flags else "default"
        for x in r.result["load"]:
            if not isinstance(x, dict):
                continue
            rows.append([f"{x.get('concurrency')}, `{mode}`" if flags else f"{x.get('concurrency')}, default",
                         str(x.get("requests")),
                         f"{sec(get(x, 'ttft_s', 'p50'))} / {sec(get(x, 'ttft_s', 'p99'))} s",
                         f"{f(get(x, 'itl_s', 'p50'), 3)} / {f(get(x, 'itl_s', 'p99'), 3)} s",
                         f(x.get("requests_per_s"), 2), f(x.get("output_tokens_per_s")), doc.run(r)])
        for x in r.result.get("interference") or []:
            if not isinstance(x, dict):
                continue
            sched = (f"`{' '.join(flags)}`, " if flags else "default, ") + \
                f"`--max-num-batched-tokens {x.get('max_num_batched_tokens')}`"
            ratio = num(x.get("p99_ratio"))
            target = num(x.get("target_ratio"))
            verdict = "" if ratio is None or target is None else f" ({'met' if ratio <= target else 'missed'}: <= {target:g}x)"
            inter.append([sched, f"{sec(get(x, 'solo_ttft_s', 'p50'))} / {sec(get(x, 'solo_ttft_s', 'p99'))} s",
                          f"{sec(get(x, 'during_ttft_s', 'p50'))} / {sec(get(x, 'during_ttft_s', 'p99'))} s",
                          f"{f(ratio)}x{verdict}", f"{sec(x.get('doc_ttft_s'))} s", doc.run(r)])
    lines = table(["concurrency, scheduling", "requests", "TTFT p50 / p99", "ITL p50 / p99", "req/s",
                   "output tok/s", "run"], rows)
    if inter:
        lines += ["", "Short requests while a long document's prefill is in flight:", ""]
        lines += table(["scheduling", "solo TTFT p50 / p99", "during the prefill p50 / p99", "p99 ratio",
                        "the document's TTFT", "run"], inter)
    return lines


def parallel(records: list[Record], doc: Doc) -> list[str]:
    sp = newest(records, "parallel", lambda r: bool(sp_pairs(r)))
    if sp is None:
        return missing("bench_parallel.py summary with N = 1 and N = 2")
    rows = []
    for ctx, one, more in sp_pairs(sp):
        rows.append([f"{ctx:,}", f"{sec(one['prefill_s'])} vs {sec(more['prefill_s'])} s "
                                 f"({times(more['prefill_s'], one['prefill_s'])})",
                     f"{f(one['decode_ms_per_token'])} vs {f(more['decode_ms_per_token'])} "
                     f"({times(more['decode_ms_per_token'], one['decode_ms_per_token'])})", doc.run(sp)])
    world = sp_pairs(sp)[0][2]["world"]
    return table(["context", f"prefill, 1 process vs {world} ranks", f"decode ms/token, 1 process vs {world} ranks",
                  "run"], rows)


def long_context(records: list[Record], doc: Doc) -> list[str]:
    lg = newest(records, "long", lambda r: long_pair(r) is not None)
    if lg is None:
        return missing("bench_long.py with float32 and int8 stages")
    fp, i8 = long_stages(lg, "auto"), long_stages(lg, "int8")
    rows = []
    for ctx in sorted(set(fp) & set(i8)):
        a, b = fp[ctx], i8[ctx]
        rows.append([f"{ctx:,}", f"{sec(a['prefill_s'])} / {sec(b['prefill_s'])} s",
                     f"{f(a['decode_ms_per_token'])} / {f(b['decode_ms_per_token'])}",
                     times(b["decode_ms_per_token"], a["decode_ms_per_token"]), doc.run(lg)])
    pd = lg.result.get("paired_decode") or {}
    if num(pd.get("ratio_median")) is not None:
        ms = pd.get("decode_ms_median") or {}
        rounds = ", ".join(f"{x:.3f}" for x in pd.get("round_medians") or [] if num(x) is not None)
        rows.append([f"{pd.get('context', 0):,}, paired steps in one process (median of pairs; rounds {rounds})",
                     "", f"{f(num(ms.get('auto')))} / {f(num(ms.get('int8')))}", f"{pd['ratio_median']:.3f}x", doc.run(lg)])
    lines = table(["context (tokens)", "prefill float32 / int8 (staircase sum)", "decode ms/token float32 / int8",
                   "int8 / float32 decode", "run"], rows)
    extra = []
    kv = lg.result.get("kv") or {}
    if num(get(kv, "auto", "bytes_per_token")) is not None and num(get(kv, "int8", "bytes_per_token")) is not None:
        extra.append(f"KV bytes per token {kv['auto']['bytes_per_token']:,.0f} (float32) and "
                     f"{kv['int8']['bytes_per_token']:,.0f} (int8)")
    r_fp, r_i8 = num(get(lg.result, "results", "auto", "peak_rss_gib")), num(get(lg.result, "results", "int8", "peak_rss_gib"))
    if r_fp is not None and r_i8 is not None:
        extra.append(f"peak RSS {r_fp:.2f} and {r_i8:.2f} GiB")
    tiers = lg.result.get("tiers") or {}
    frac = get(lg.result, "derived", "int8_hit_fraction_of_cold") or {}
    hits = [f"{k.removesuffix('_hit')} {sec(num(get(tiers, k, 'ttft_s')))} s"
            + (f" ({100 * frac[k]:.2f}% of the cold prefill)" if num(frac.get(k)) is not None else "")
            for k in ("device_hit", "host_hit", "disk_hit") if num(get(tiers, k, "ttft_s")) is not None]
    if hits:
        extra.append("int8 prefix hits at the longest context + a new question: " + ", ".join(hits))
    if extra:
        lines += ["", "Same run: " + "; ".join(extra) + "."]
    return lines


GPU_CONFIGS = ((False, "auto", "bf16 pages, eager"), (True, "auto", "bf16 pages, CUDA graphs"),
               (True, "int8", "int8 pages, CUDA graphs"))


def gpu(records: list[Record], doc: Doc) -> list[str]:
    """One row per (context, configuration): the newest GPU record that ran it."""
    keys = sorted({k for r in records if r.bench == "gpu" for k in gpu_rows(r)})
    rows = []
    for ctx in sorted({k[0] for k in keys}):
        for graphs, kv, label in GPU_CONFIGS:
            key = (ctx, graphs, kv)
            rec = newest(records, "gpu", lambda r, key=key: key in gpu_rows(r))
            if rec is None:
                continue
            x = gpu_rows(rec)[key]
            peak = num(x.get("prefill_share_of_matmul_peak"))
            rows.append([f"{ctx:,}", label, f"{sec(num(x['prefill_s']))} s"
                         + (f" ({100 * peak:.0f}% of the matmul peak)" if peak is not None else ""),
                         f(num(x["decode_ms_per_token"]), 2), f(num(x.get("decode_floor_ms")), 2), doc.run(rec)])
    if not rows:
        return missing("bench_gpu.py rows")
    return table(["context", "configuration", "prefill", "decode ms/token", "decode floor ms", "run"], rows)


def targets(records: list[Record], doc: Doc) -> list[str]:
    """The engine's targets against the newest record holding each figure."""
    rows = []

    def add(what, bar, value, ok, rec):
        rows.append([what, bar, value, "met" if ok else "not met", doc.run(rec)])

    def x(value: float, bar: float) -> str:
        """A ratio, with a third decimal where two would hide which side of the bar it is."""
        return f"{value:.3f}x" if abs(value - bar) < 0.01 else f"{value:.2f}x"

    e = newest(records, "e2e", both(has_prefill(HF, LC), has(decode, HF, LC), has(rss, HF, LC)))
    if e:
        n = lengths(e, HF, LC)[-1]
        s = prefill(e, HF, n) / prefill(e, LC, n)
        add(f"prefill at {tokens(n)} against HF", ">= 2x", x(s, 2), s >= 2, e)
        frac = num(get(e.result, "derived", LC, "prefill_8000_fraction_of_fp32_gemm"))
        if frac is not None:
            add("prefill at 8K, share of the run's fp32 GEMM ceiling", ">= 85%", f"{100 * frac:.0f}%", frac >= 0.85, e)
        ctx = get(e.result, "args", "decode_ctx")
        at = f" at {tokens(ctx)}" if ctx else ""
        s = decode(e, HF) / decode(e, LC)
        add(f"decode{at} against HF", ">= 15x", x(s, 15), s >= 15, e)
        mult = num(get(e.result, "derived", LC, "decode_multiple_of_floor"))
        if mult is not None:
            add(f"decode{at} against the run's bandwidth floor", "~1.5x", x(mult, 1.5), mult <= 1.5, e)
        share = rss(e, LC) / rss(e, HF)
        add("peak RSS against HF", "<= 60%", f"{100 * share:.0f}%", share <= 0.6, e)
    b16 = newest(records, "e2e", both(has_prefill(HF, LB), has(decode, HF, LB)))
    if b16:
        n = lengths(b16, HF, LB)[-1]
        s = prefill(b16, HF, n) / prefill(b16, LB, n)
        add(f"bf16 prefill at {tokens(n)} against HF fp32", ">= 3.5x", x(s, 3.5), s >= 3.5, b16)
        s = decode(b16, HF) / decode(b16, LB)
        add("bf16 decode against HF fp32", ">= 25x", x(s, 25), s >= 25, b16)
    for dtype, lc_name, vl_name, bar in (("bf16", LB, VB, 0.8), ("fp32", LC, VF, 1.0)):
        for v in newest_per_kind(records, "e2e", both(has_prefill(vl_name, lc_name), has(decode, vl_name, lc_name))):
            n = lengths(v, vl_name, lc_name)[-1]
            s = prefill(v, lc_name, n) / prefill(v, vl_name, n)
            add(f"{dtype} {tokens(n)} prefill, time against vLLM-CPU's", f"<= {bar:g}x", x(s, bar), s <= bar, v)
            if dtype == "bf16":
                s = decode(v, lc_name) / decode(v, vl_name)
                ctx = get(v.result, "args", "decode_ctx")
                add(f"bf16 decode{f' at {tokens(ctx)}' if ctx else ''}, time against vLLM-CPU's", "<= 0.8x",
                    x(s, 0.8), s <= 0.8, v)
    la = newest(records, "lookahead", lambda r: bool(lookahead_cases(r)))
    if la:
        goal = la.result.get("targets_speedup") or {}
        for name, c in lookahead_cases(la):
            if num(goal.get(name)) is None:
                continue
            s = get(c, "longctx", "lookahead", "decode_tok_s") / get(c, "longctx", "plain", "decode_tok_s")
            add(f"lookahead speedup, {name.replace('_', ' ')}", f">= {goal[name]:g}x", x(s, goal[name]), s >= goal[name], la)
    p = newest(records, "prefix", lambda r: prefix_tiers(r) is not None
               and isinstance(r.result.get("targets_fraction_of_cold"), dict))
    if p:
        t, goal = prefix_tiers(p), p.result["targets_fraction_of_cold"]
        for k in ("device_hit", "host_hit", "disk_hit"):
            if num(goal.get(k)) is not None:
                share = t[k] / t["cold"]
                add(f"prefix store TTFT, {k.replace('_', ' ')}, share of cold", f"<= {100 * goal[k]:g}%",
                    f"{100 * share:.1f}%", share <= goal[k], p)
    lg = newest(records, "long", lambda r: num(get(r.result, "paired_decode", "ratio_median")) is not None
                or long_pair(r) is not None)
    if lg:
        pd = num(get(lg.result, "paired_decode", "ratio_median"))
        ctx, fp, i8 = long_pair(lg) or (None, None, None)
        if fp:
            s = i8["decode_ms_per_token"] / fp["decode_ms_per_token"]
            add(f"int8 decode at {tokens(ctx)}, time against float32 pages'", "<= 0.6x",
                x(s, 0.6) + (f" (paired steps {pd:.3f}x)" if pd is not None else ""), s <= 0.6, lg)
    # issue 42: GGUF blocks against llama.cpp on the same file (newest record per machine kind
    # and prompt length), and weights quantized at load against vLLM-CPU on the same HF folder
    for model, label in (("1b-q4_k_m", "1B Q4_K_M"), ("default", "135M Q4_1")):
        for q in llama_cpp_records(records, model):
            by, n = quant_rows(q), get(q.result, "args", "ctx") or 0
            ll = by["llama.cpp"]  # f16 KV: against longctx's float32 and bfloat16 pages, not its int8 ones
            ours = [r for name, r in by.items() if name.startswith("longctx ") and "int8kv" not in name]
            decode_bar = 0.7 if n >= 16384 else 1.0  # long context is where the paged kernels should show
            # prefill: the exact blocks' (float32 sums over the file's values), and where a run holds it
            # the bfloat16 compute's (prefill chunks on AMX tiles), the faster of the two, named
            pre_pool = [r for r in (by.get("longctx blocks"), by.get("longctx blocks-bf16")) if r]
            for what, key, pick, pool, bar in (("decode at", "decode_ms", min, ours, decode_bar),
                                               ("prefill of", "prefill_s", min, pre_pool, 1.0),
                                               ("peak RSS at", "peak_rss_gib", min, ours, 1.1)):
                if not pool:  # e.g. a run of int8 pages alone: no figure of this kind
                    continue
                r = pick(pool, key=lambda r, k=key: r[k])
                s = r[key] / ll[key]
                add(f"{label} {what} {tokens(n)}, {'time' if key != 'peak_rss_gib' else 'RSS'} against llama.cpp's",
                    f"<= {bar:g}x", f"{x(s, bar)}" + (f" ({r['engine'].removeprefix('longctx ')})"
                                                      if pool is ours or len(pool) > 1 else ""),
                    s <= bar, q)
    vq = [r for r in records if r.bench == "quant"  # with a vLLM-CPU peer of either dtype (each row asks for its own)
          and _holds(lambda r: "vllm bfloat16" in quant_rows(r) or "vllm float32" in quant_rows(r), r)]
    for kind in kinds(vq):
        for ours, theirs, what, bar in ((("int8", "int8-fast", "int8-fast-bf16kv", "int8-bf16", "int8-fast-bf16"),
                                         "vllm bfloat16",
                                         "int8 weights' decode", 0.6),
                                        (("float",), "vllm float32", "fp32 prefill", 1.0),
                                        (("bf16",), "vllm bfloat16", "bf16 prefill", 1.0)):
            # the newest record of this machine holding one of ours and the peer
            q = newest(vq, "quant", lambda r, k=kind, o=ours, t=theirs: r.kind == k and t in quant_rows(r)
                       and any(f"longctx {name}" in quant_rows(r) for name in o))
            if not q:
                continue
            by, n = quant_rows(q), get(q.result, "args", "ctx") or 0
            size = "1B" if str(get(q.result, "args", "model")).startswith("1b") else "135M"
            key = "decode_ms" if "decode" in what else "prefill_s"
            a = min((by[f"longctx {name}"] for name in ours if f"longctx {name}" in by), key=lambda r: r[key])
            s = a[key] / by[theirs][key]
            add(f"{size} {what} at {tokens(n)}, time against vLLM-CPU {theirs.split()[1]}'s", f"<= {bar:g}x",
                x(s, bar) + (f" ({a['engine'].removeprefix('longctx ')})" if len(ours) > 1 else ""), s <= bar, q)
    if not rows:
        return missing("e2e, lookahead, prefix, long")
    return table(["target", "bar", "newest figure", "verdict", "run"], rows)


TABLES: dict[str, Callable[[list[Record], Doc], list[str]]] = {
    "readme-results": readme_results,
    "targets": targets,
    "e2e-hf": e2e_hf,
    "e2e-vllm": e2e_vllm,
    "prefix": prefix,
    "lookahead": lookahead,
    "window-kv": window_kv,
    "batch": batch,
    "serve": serve,
    "parallel": parallel,
    "long-context": long_context,
    "gpu": gpu,
}


# --- files ---------------------------------------------------------------------------------

def render(name: str, records: list[Record], doc: Doc) -> str:
    """The text between the markers of table ``name``."""
    if name not in TABLES:
        raise KeyError(f"unknown table {name!r} (known: {', '.join(TABLES)})")
    return "\n".join(TABLES[name](records, doc)) + "\n"


def regenerate(text: str, records: list[Record], doc: Doc) -> str:
    """``text`` with every marked table regenerated."""
    return MARKER.sub(lambda m: (f"<!-- table:{m['name']} begin -->\n{render(m['name'], records, doc)}"
                                 f"<!-- table:{m['name']} end -->"), text)


def stale_tables(text: str, records: list[Record], doc: Doc) -> list[str]:
    """Names of the marked tables in ``text`` that differ from what would be generated."""
    return [m["name"] for m in MARKER.finditer(text) if m["body"] != render(m["name"], records, doc)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    ap.add_argument("--results", type=Path, default=None, help="the records (default: ROOT/benchmarks/results)")
    ap.add_argument("files", nargs="*", help=f"Markdown files relative to ROOT (default: {' '.join(DOCS)})")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    records = load_records((args.results or root / "benchmarks" / "results").resolve(), root)
    stale = []
    for rel in args.files or DOCS:
        path = root / rel
        text = path.read_text()
        doc = Doc(Path(rel), root)
        if not MARKER.search(text):
            print(f"tables.py: {rel} has no table markers", file=sys.stderr)
            return 2
        if args.check:
            stale += [f"{rel}: table {name}" for name in stale_tables(text, records, doc)]
            continue
        new = regenerate(text, records, doc)
        if new != text:
            path.write_text(new)
            print(f"tables.py: rewrote {rel}")
    if stale:
        print("tables.py: stale tables (run `python benchmarks/tables.py` to regenerate them):\n  "
              + "\n  ".join(stale), file=sys.stderr)
        return 1
    if args.check:
        print(f"tables.py: {len(args.files or DOCS)} files, every table up to date ({len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

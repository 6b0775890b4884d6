"""Draw the benchmark results as PNG plots for docs/benchmarks.md.

Reads the result records under ``benchmarks/results/<bench>/<machine>/*.json`` (schema 1, see
``benchmarks/run.py``; the figures are each record's ``result``, whose schema is the benchmark
script's own) and writes, with matplotlib's Agg backend:

* ``prefill.png``      prefill time vs prompt length per engine (the newest ``e2e`` record);
* ``decode.png``       decode ms/token vs context length (the newest ``e2e`` record, and
                       ``bench_parallel``'s one-process runs, which decode at 4K and 8K);
* ``prefix.png``       time to first token per prefix-store tier (the newest ``prefix`` record);
* ``lookahead.png``    decode tokens/s and lookahead speedup per prompt (``lookahead``);
* ``parallel.png``     sequence parallelism, N = 1 vs N = 2 ranks (``parallel``);
* ``e2e-history.png``  8K prefill and decode at 8K, longctx, HF and vLLM-CPU, in every ``e2e``
                       record that ran a peer engine (HF or vLLM) beside longctx;
* ``long-context.png`` decode ms/token and prefill time vs context, float32 vs int8 KV pages
                       (the newest ``long`` record, from ``bench_long.py``);
* ``window-kv.png``    KV held and decode ms/token, sliding-window layers freed, kept and an
                       all-global model (the newest ``window-kv`` record).

"Newest" is the rule of ``benchmarks/tables.py``: the newest record (by its ``started`` time;
ties: more figures, then the later path) that holds the fields the plot needs, so the plots
and the generated tables read the same records. A plot whose data is missing is skipped with
a printed reason; nothing else is touched.

Usage:  python benchmarks/plots.py [--results benchmarks/results] [--out docs/img]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tables  # noqa: E402  (benchmarks/tables.py: the records and the newest-record rule)
from tables import Record  # noqa: E402

sys.path.pop(0)

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"longctx-fp32": "tab:blue", "longctx-bf16": "tab:cyan", "hf-fp32": "tab:orange",
          "vllm-fp32": "tab:red", "vllm-bf16": "tab:pink"}
LABELS = {"longctx-fp32": "longctx fp32", "longctx-bf16": "longctx bf16",
          "hf-fp32": "HF transformers fp32", "vllm-fp32": "vLLM-CPU fp32", "vllm-bf16": "vLLM-CPU bf16"}
TIER_LABELS = {"cold": "cold\n(nothing cached)", "device_hit": "device hit", "host_hit": "host hit",
               "disk_hit": "disk hit\n(fresh process)", "hf": "HF transformers\n(recomputes)"}
PEERS = ("hf-fp32", "vllm-fp32", "vllm-bf16")


class Skip(Exception):
    """The data a plot needs is not in the results."""


def load_results(folder: Path) -> list[Record]:
    """The schema-1 records under ``folder`` (other JSON files there are ignored)."""
    return tables.load_records(folder, ROOT)


def newest(records: list[Record], bench: str, needs) -> tuple[Record, dict]:
    """The newest record of ``bench`` whose result satisfies ``needs(result)``, and that result."""
    rec = tables.newest(records, bench, lambda r: needs(r.result))
    if rec is None:
        raise Skip(f"no {bench} record with the fields this plot needs")
    return rec, rec.result


def machine_line(rec: Record) -> str:
    m = rec.machine
    parts = [tables.machine_name(rec)]
    if m.get("threads"):
        parts.append(f"{m['threads']} threads")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    parts.append(f"git {tables.rev(rec)}")
    return ", ".join(parts) + f"  ({rec.name})"


def finish(fig, ax_or_axes, title: str, rec: Record, data: dict, path: Path) -> None:
    fig.suptitle(f"{title}\n{machine_line(rec)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def med(values) -> float:
    if isinstance(values, (int, float)):
        return float(values)
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        raise Skip("an empty list of timings")
    return statistics.median(values)


def spread(values) -> tuple[float, float]:
    """(median - min, max - median) for error bars."""
    if isinstance(values, (int, float)):
        return 0.0, 0.0
    m = med(values)
    return m - min(values), max(values) - m


def engine_order(names) -> list[str]:
    known = [n for n in COLORS if n in names]
    return known + sorted(n for n in names if n not in COLORS)


# --- (a) prefill -----------------------------------------------------------------------------

def has_prefill(d: dict) -> bool:
    """A run with prefill figures for longctx's default dtype (fp32 on the CPU): runs of one
    other dtype only (bf16 reruns) stay in the tables of docs/benchmarks.md, not the plots."""
    res = d.get("results")
    return isinstance(res, dict) and bool((res.get("longctx-fp32") or {}).get("prefill_s"))


def plot_prefill(results, out: Path) -> None:
    rec, data = newest(results, "e2e", has_prefill)
    res = data["results"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    hf = res.get("hf-fp32", {}).get("prefill_s") or {}
    for engine in engine_order(res):
        pre = (res[engine] or {}).get("prefill_s") or {}
        lengths = sorted(pre, key=int)
        if not lengths:
            continue
        ys = [med(pre[n]) for n in lengths]
        errs = list(zip(*[spread(pre[n]) for n in lengths]))
        xs = [int(n) for n in lengths]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, color=COLORS.get(engine),
                    label=LABELS.get(engine, engine))
        if engine != "hf-fp32" and hf:
            for x, n, y in zip(xs, lengths, ys):
                if n in hf:
                    ax.annotate(f"{med(hf[n]) / y:.1f}x", (x, y), textcoords="offset points",
                                xytext=(9, -9), ha="left", fontsize=8, color=COLORS.get(engine))
    reps = (data.get("args") or {}).get("repeats")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill time = time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.04)
    ax.grid(alpha=0.3)
    ax.legend(title=f"median of {reps} runs, bars min-max" if reps else None, fontsize=9)
    if hf:
        ax.text(0.99, 0.02, "labels: HF time / longctx time", transform=ax.transAxes, ha="right",
                fontsize=8, color="gray")
    finish(fig, ax, "Prefill time vs prompt length (bench_e2e.py)", rec, data, out / "prefill.png")


# --- (b) decode ------------------------------------------------------------------------------

def has_decode(d: dict) -> bool:
    """As has_prefill, for decode figures."""
    res = d.get("results")
    return isinstance(res, dict) and bool((res.get("longctx-fp32") or {}).get("decode_ms"))


def has_sp_summary(d: dict) -> bool:
    s = d.get("summary")
    return isinstance(s, list) and any(isinstance(r, dict) and "world" in r and "context" in r for r in s)


def plot_decode(results, out: Path) -> None:
    rec, data = newest(results, "e2e", has_decode)
    res = data["results"]
    ctx = (data.get("args") or {}).get("decode_ctx")
    if not ctx:
        raise Skip(f"{rec.name} has no args.decode_ctx")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, engine in enumerate(engine_order(res)):
        dec = (res[engine] or {}).get("decode_ms")
        if not dec:
            continue
        lo, hi = sorted(dec)[len(dec) // 4], sorted(dec)[(3 * len(dec)) // 4]
        m = med(dec)
        ax.errorbar([ctx], [m], yerr=[[m - lo], [hi - m]], marker="o", capsize=4, linestyle="none",
                    color=COLORS.get(engine), label=f"{LABELS.get(engine, engine)} (bench_e2e)")
        ax.annotate(f"{m:.1f}", (ctx, m), textcoords="offset points", xytext=(8, -3), fontsize=8,
                    color=COLORS.get(engine))
    floor = ((data.get("derived") or {}).get("longctx-fp32") or {}).get("decode_floor_ms")
    ceilings = data.get("ceilings") or {}
    # the run's floor is the bytes a step reads over its read rate where it measured one, else its copy rate
    rate, kind = ((ceilings["read_gbps"], "read") if ceilings.get("read_gbps")
                  else (ceilings.get("copy_gbps"), "copy"))
    if floor:
        ax.plot([ctx], [floor], marker="_", markersize=22, color="gray", linestyle="none",
                label=f"fp32 bandwidth floor ({kind} {rate:.1f} GB/s)" if rate else "bandwidth floor")
    # bench_parallel's one-process runs decode at several contexts (prefix caching and
    # lookahead off); shown when they ran on the same CPU.
    try:
        prec, pdata = newest(results, "parallel", has_sp_summary)
    except Skip:
        prec = None
    note = ""
    if prec and prec.machine.get("cpu") == rec.machine.get("cpu"):
        rows = sorted((r for r in pdata["summary"] if r.get("world") == 1 and "decode_ms_per_token" in r),
                      key=lambda r: r["context"])
        if rows:
            xs = [r["context"] for r in rows]
            ys = [r["decode_ms_per_token"] for r in rows]
            ax.plot(xs, ys, marker="s", color="tab:green",
                    label=f"longctx fp32, 1 process (bench_parallel, git {tables.rev(prec)})")
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(8, -3),
                            fontsize=8, color="tab:green")
            note = f"; green: {prec.name}, median of {len(rows[0].get('decode_ms_all') or [0])} processes"
    n = len((res.get("longctx-fp32") or {}).get("decode_ms") or [])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode time (ms per token, batch 1)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, max(ctx, 8192) * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.text(0.99, 0.02, f"e2e points: median of {n} steps, bars interquartile{note}",
            transform=ax.transAxes, ha="right", fontsize=7, color="gray")
    finish(fig, ax, "Decode ms/token vs context length", rec, data, out / "decode.png")


# --- (c) prefix store -----------------------------------------------------------------------

def plot_prefix(results, out: Path) -> None:
    rec, data = newest(results, "prefix",
                        lambda d: isinstance(d.get("ttft_s"), dict) and "cold" in d["ttft_s"])
    ttft = data["ttft_s"]
    tiers = [t for t in ("cold", "device_hit", "host_hit", "disk_hit") if isinstance(ttft.get(t), (int, float))]
    values = [ttft[t] for t in tiers]
    colors = ["tab:gray", "tab:blue", "tab:cyan", "tab:purple"][:len(tiers)]
    if isinstance(data.get("hf_recompute_s"), (int, float)):
        tiers.append("hf")
        values.append(data["hf_recompute_s"])
        colors.append("tab:orange")
    targets = data.get("targets_fraction_of_cold") or {}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    bars = ax.bar(range(len(tiers)), values, color=colors)
    cold = ttft["cold"]
    for bar, tier, v in zip(bars, tiers, values):
        label = f"{v:.2f} s\n{100 * v / cold:.1f}% of cold"
        if tier in targets:
            label += f"\n(target <= {100 * targets[tier]:g}%)"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, v), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(min(values) / 2, max(values) * 8)
    ax.set_xticks(range(len(tiers)), [TIER_LABELS.get(t, t) for t in tiers], fontsize=8)
    ax.set_ylabel("time to first token (s, log scale)")
    ax.grid(alpha=0.3, axis="y")
    doc, q = data.get("doc_tokens"), data.get("question_tokens")
    what = f"{doc}-token document + a new {q}-token question" if doc and q else "document + new question"
    finish(fig, ax, f"Prefix store: TTFT per tier ({what})", rec, data, out / "prefix.png")


# --- (d) lookahead --------------------------------------------------------------------------

def plot_lookahead(results, out: Path) -> None:
    rec, data = newest(results, "lookahead", lambda d: isinstance(d.get("cases"), dict) and d["cases"])
    cases = data["cases"]
    targets = data.get("targets_speedup") or {}
    names, series, speedups = [], {"longctx plain": [], "longctx lookahead": [], "HF": [],
                                   "HF prompt lookup": []}, []
    for case, c in cases.items():
        lc = c.get("longctx") or {}
        plain = (lc.get("plain") or {}).get("decode_tok_s")
        look = (lc.get("lookahead") or {}).get("decode_tok_s")
        if plain is None or look is None:
            continue
        names.append(case.replace("_", " "))
        hf = c.get("hf") or {}
        series["longctx plain"].append(plain)
        series["longctx lookahead"].append(look)
        series["HF"].append((hf.get("plain") or {}).get("decode_tok_s"))
        series["HF prompt lookup"].append((hf.get("prompt_lookup") or {}).get("decode_tok_s"))
        speedups.append((c.get("speedup") or look / plain, targets.get(case), c.get("identical_tokens")))
    if not names:
        raise Skip(f"{rec.name} has no case with longctx plain and lookahead tok/s")
    series = {k: v for k, v in series.items() if any(x is not None for x in v)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(series)
    colors = {"longctx plain": "tab:blue", "longctx lookahead": "tab:green", "HF": "tab:orange",
              "HF prompt lookup": "tab:red"}
    for i, (label, ys) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax1.bar(xs, [y or 0 for y in ys], width, label=label, color=colors[label])
    ax1.set_xticks(range(len(names)), names, fontsize=8)
    ax1.set_ylabel("decode tokens/s (greedy, batch 1)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, axis="y")
    ax1.set_title("decode speed (longctx: best of 3)", fontsize=9)
    bars = ax2.bar(range(len(names)), [s for s, _, _ in speedups], color="tab:green")
    for j, (bar, (s, target, same)) in enumerate(zip(bars, speedups)):
        if target:
            ax2.plot([j - 0.4, j + 0.4], [target, target], color="black", linestyle="--", linewidth=1,
                     label="target" if j == 0 else None)
        text = f"{s:.3f}x" if target and abs(s - target) < 0.01 else f"{s:.2f}x"
        if target:
            text += " (met)" if s >= target else " (missed)"
        if same is False:
            text += "\nTOKENS DIFFER"
        ax2.annotate(text, (bar.get_x() + bar.get_width() / 2, max(s, target or 0)),
                     textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_xticks(range(len(names)), names, fontsize=8)
    ax2.set_ylabel("lookahead tok/s / plain tok/s")
    ax2.set_ylim(0, max(max(s for s, _, _ in speedups), max((t or 0) for _, t, _ in speedups)) * 1.2)
    ax2.grid(alpha=0.3, axis="y")
    if any(t for _, t, _ in speedups):
        ax2.legend(fontsize=8)
    ax2.set_title("lookahead speedup", fontsize=9)
    doc, n = data.get("doc_tokens"), data.get("max_tokens")
    what = f"{n} new tokens, {doc}-token document" if doc and n else "per prompt"
    finish(fig, (ax1, ax2), f"Lookahead decoding per prompt ({what})", rec, data, out / "lookahead.png")


# --- (e) sequence parallelism --------------------------------------------------------------

def plot_parallel(results, out: Path) -> None:
    rec, data = newest(results, "parallel", has_sp_summary)
    rows = [r for r in data["summary"] if isinstance(r, dict)]
    worlds = sorted({r["world"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    if len(worlds) < 2:
        raise Skip(f"{rec.name} has one world size only")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    metrics = [("prefill_s", "prefill_s_all", "prefill time (s)", "{:.2f}"),
               ("decode_ms_per_token", "decode_ms_all", "decode time (ms per token)", "{:.1f}")]
    width = 0.8 / len(worlds)
    for ax, (key, all_key, ylabel, fmt) in zip(axes, metrics):
        base = {r["context"]: r.get(key) for r in rows if r["world"] == worlds[0]}
        for i, w in enumerate(worlds):
            for j, c in enumerate(contexts):
                r = next((r for r in rows if r["world"] == w and r["context"] == c), None)
                if not r or r.get(key) is None:
                    continue
                x = j + (i - (len(worlds) - 1) / 2) * width
                allv = r.get(all_key) or [r[key]]
                lo, hi = r[key] - min(allv), max(allv) - r[key]
                ax.bar(x, r[key], width, yerr=[[lo], [hi]], capsize=3,
                       color=["tab:blue", "tab:red", "tab:green", "tab:purple"][i % 4],
                       label=f"N = {w}" + (" (one process)" if w == 1 else " ranks") if j == 0 else None)
                text = fmt.format(r[key])
                if w != worlds[0] and base.get(c):
                    text += f"\n{r[key] / base[c]:.2f}x"
                ax.annotate(text, (x, r[key] + hi), textcoords="offset points", xytext=(0, 2),
                            ha="center", fontsize=8)
        ax.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
        ax.set_xlabel("context length")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left")
    reps = (data.get("args") or {}).get("repeats")
    title = "Sequence parallelism: N = 1 vs N ranks on one CPU"
    if reps:
        title += f" (medians of {reps} processes, bars min-max)"
    finish(fig, axes, title, rec, data, out / "parallel.png")


# --- (f) run history -----------------------------------------------------------------------

def plot_history(results, out: Path) -> None:
    """Every e2e run that measured a peer (HF or vLLM) beside longctx fp32: the runs of one
    engine alone (an ISA-level study, a bf16-only rerun) are not points of this history."""
    runs = [(r, r.result) for r in results if r.bench == "e2e" and has_prefill(r.result)
            and has_decode(r.result) and any(p in (r.result.get("results") or {}) for p in PEERS)]
    if len(runs) < 2:
        raise Skip("fewer than two e2e records with a peer engine")
    runs.sort(key=lambda rd: tables.order_key(rd[0]))
    labels = []
    cpus = [r.machine.get("cpu") for r, _ in runs] + [None]
    for r, d in runs:
        cpu = str(r.machine.get("cpu", "?")).replace("(R)", "").replace(" Processor", "")
        labels.append(f"{tables.rev(r).removesuffix('-dirty')}\n{cpu}")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for engine in ("hf-fp32", "vllm-fp32", "vllm-bf16", "longctx-fp32", "longctx-bf16"):
        pre, dec = [], []
        for n, d in runs:
            r = (d.get("results") or {}).get(engine) or {}
            p = r.get("prefill_s") or {}
            longest = max(p, key=int) if p else None
            pre.append(med(p[longest]) if longest and int(longest) >= 8000 else None)
            dec.append(med(r["decode_ms"]) if r.get("decode_ms") else None)
        for ax, ys in ((ax1, pre), (ax2, dec)):
            # one line per stretch of runs on the same CPU: runs on different machines are not joined
            label = LABELS.get(engine, engine)
            segment: list[tuple[int, float]] = []
            for i, y in enumerate(ys + [None]):
                if segment and (y is None or cpus[i] != cpus[segment[-1][0]]):
                    ax.plot(*zip(*segment), marker="o", color=COLORS.get(engine), label=label)
                    label, segment = None, []
                if y is not None:
                    segment.append((i, y))
    for ax, ylabel in ((ax1, "prefill of 8,000 tokens (s)"), (ax2, "decode at 8K context (ms per token)")):
        ax.set_xticks(range(len(runs)), labels, fontsize=7, rotation=60, ha="right")
        ax.set_xlabel("run (git revision, CPU), oldest to newest record")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("End-to-end runs over time (bench_e2e.py, 2-core VMs with 2 threads, medians; lines "
                 "join runs on the same CPU kind;\nthe machines are shared and noisy, so two runs differ by "
                 "more than the code does)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "e2e-history.png", dpi=110, metadata={"Software": None})
    plt.close(fig)


# --- (g) long context: float32 vs int8 KV pages ---------------------------------------------

def has_long_stages(d: dict) -> bool:
    res = d.get("results")
    return isinstance(res, dict) and any(isinstance(r, dict) and r.get("stages") for r in res.values())


def plot_long_context(results, out: Path) -> None:
    rec, data = newest(results, "long", has_long_stages)
    res = {d: r for d, r in data["results"].items() if isinstance(r, dict) and r.get("stages")}
    derived = data.get("derived") or {}
    colors = {"auto": "tab:blue", "int8": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.8))
    contexts = sorted({s["context"] for r in res.values() for s in r["stages"]})
    for dtype, r in res.items():
        kv = str((r.get("engine") or {}).get("kv_storage_dtype", dtype)).removeprefix("torch.")
        color = colors.get(dtype)
        stages = sorted(r["stages"], key=lambda s: s["context"])
        dec = [(s["context"], s["decode_ms_per_token"]) for s in stages if s.get("decode_ms_per_token")]
        if dec:
            ax1.plot(*zip(*dec), marker="o", color=color, label=f"{kv} KV pages")
            ratios = derived.get("decode_ms_ratio_int8_over_fp32") or {}
            for x, y in dec:
                text = f"{y:.1f}"
                if dtype == "int8" and str(x) in ratios:
                    text += f" ({ratios[str(x)]:.2f}x)"
                ax1.annotate(text, (x, y), textcoords="offset points", xytext=(6, -11 if dtype == "int8" else 5),
                             fontsize=8, color=color)
        floor = (derived.get("decode_floor_ms") or {}).get(dtype) or {}
        if floor:
            xs = sorted(floor, key=int)
            ax1.plot([int(x) for x in xs], [floor[x] for x in xs], linestyle=":", color=color,
                     label=f"{kv} bandwidth floor")
        pre = [(s["context"], s["prefill_s"]) for s in stages if s.get("prefill_s") is not None]
        ax2.plot(*zip(*pre), marker="o", color=color, label=f"{kv} KV pages")
        for x, y in pre:
            ax2.annotate(f"{y:.1f} s", (x, y), textcoords="offset points",
                         xytext=(6, -11 if dtype == "int8" else 5), fontsize=8, color=color)
    paired = data.get("paired_decode") or {}
    if "ratio_median" in paired:  # the alternating steps at the longest context (bench_long's paired phase)
        x = paired["context"]
        for dtype, ms in paired["decode_ms_median"].items():
            ax1.plot([x], [ms], marker="D", markerfacecolor="none", color=colors.get(dtype), linestyle="none",
                     label="paired steps, median" if dtype == "auto" else None)
        ax1.annotate(f"paired: {paired['ratio_median']:.2f}x", (x, paired["decode_ms_median"]["int8"]),
                     textcoords="offset points", xytext=(6, 6), fontsize=8, color=colors["int8"])
    fp32_fit = ((data.get("kv") or {}).get("auto") or {}).get("default_budget_tokens")
    budget = (data.get("kv") or {}).get("default_kv_cache_gb")
    for ax in (ax1, ax2):
        if fp32_fit and contexts and fp32_fit < max(contexts):
            ax.axvline(fp32_fit, color="gray", linestyle="--", linewidth=0.8)
            ax.annotate(f"float32 pages fill the\ndefault {budget:g} GiB pool\nat {fp32_fit} tokens",
                        (fp32_fit, 0), xycoords=("data", "axes fraction"), xytext=(4, 40),
                        textcoords="offset points", fontsize=7, color="gray")
        ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        ax.set_xlim(0, max(contexts) * 1.12)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax1.set_ylabel("decode time (ms per token, batch 1)")
    ax1.set_title("decode at each context (labels: ms, int8/float32; diamonds: the two\n"
                  "engines' steps alternating in one process, median int8/float32 of the pairs)", fontsize=9)
    ax2.set_ylabel("prefill time (s)")
    ax2.set_title("prefill of the whole context (sum of the staircase stages)", fontsize=9)
    tiers = data.get("tiers") or {}
    frac = derived.get("int8_hit_fraction_of_cold") or {}
    hits = [f"  {t.removesuffix('_hit')} tier: {v['ttft_s']:.2f} s ({100 * frac[t]:.2f}% of cold)"
            for t, v in tiers.items() if isinstance(v, dict) and "ttft_s" in v and t in frac]
    if hits:
        ax2.text(0.02, 0.8, f"int8, prefix hit at {max(contexts)} tokens + a question (TTFT):\n"
                 + "\n".join(hits), transform=ax2.transAxes, ha="left", va="top", fontsize=7, color="dimgray")
    rope = data.get("rope_scaling") or {}
    what = f"RoPE {rope.get('rope_type')} x{rope.get('factor'):g}, " if rope.get("rope_type") else ""
    n = (data.get("args") or {}).get("decode_tokens")
    finish(fig, (ax1, ax2), f"Long context: float32 vs int8 KV pages ({what}greedy, {n} new tokens per "
           "context; bench_long.py)", rec, data, out / "long-context.png")


def plot_window_kv(results, out: Path) -> None:
    rec, data = newest(results, "window-kv", lambda d: bool(d.get("rows")))
    rows = data["rows"]
    contexts = sorted({r["context"] for r in rows})
    modes = [("free", "windowed layers freed", "tab:green"), ("keep", "kept", "tab:blue"),
             ("global", "all-global model", "tab:red")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    width = 0.8 / len(modes)
    for ax, (key, ylabel, scale, fmt) in zip(axes, [("kv_bytes_held", "KV held (MiB)", 2 ** -20, "{:.0f}"),
                                                    ("decode_ms_per_token", "decode (ms per token)", 1.0, "{:.1f}")]):
        for i, (mode, label, color) in enumerate(modes):
            for j, c in enumerate(contexts):
                r = next((r for r in rows if r["mode"] == mode and r["context"] == c), None)
                if r is None or r.get(key) is None:
                    continue
                x, y = j + (i - 1) * width, r[key] * scale
                ax.bar(x, y, width, color=color, label=label if j == 0 else None)
                note = fmt.format(y) + (f"\n{r['kv_ratio_vs_global']:.2f}x" if key == "kv_bytes_held" else "")
                ax.annotate(note, (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
        ax.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left")
    finish(fig, axes, "Gemma-3-shaped model (5 sliding : 1 global, window 1,024): KV held and decode "
           "(bench_window_kv.py)", rec, data, out / "window-kv.png")


PLOTS = {"prefill.png": plot_prefill, "decode.png": plot_decode, "prefix.png": plot_prefix,
         "lookahead.png": plot_lookahead, "parallel.png": plot_parallel,
         "e2e-history.png": plot_history, "long-context.png": plot_long_context, "window-kv.png": plot_window_kv}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = p.parse_args(argv)
    results = load_results(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    written = 0
    for fname, fn in PLOTS.items():
        try:
            fn(results, args.out)
        except Skip as exc:
            print(f"skipped {fname}: {exc}")
            plt.close("all")
            continue
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            print(f"skipped {fname}: unexpected data ({type(exc).__name__}: {exc})")
            plt.close("all")
            continue
        print(f"wrote {args.out / fname}")
        written += 1
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())

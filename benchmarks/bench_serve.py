"""Serving benchmark: the real `longctx serve` process, driven over HTTP on 127.0.0.1.

Scenarios (default model, fp32, token-id prompts cut from real text: the GPL-3):
  * load: concurrency 1, 4, 16; a mix of long-document prompts (2,000 tokens, about 1 in 4)
    and short prompts (50 tokens), streaming, max_tokens 16, ignore_eos, temperature 0.
    TTFT (request sent -> first chunk with text) and ITL (gaps between text chunks) p50/p99,
    requests/s and output tokens/s;
  * interference: TTFT of short requests (50 tokens, max_tokens 4) sent one after another
    alone, then the same sent every --short-gap seconds while one 8,000-token prefill is in
    flight (only those sent before the document's first token count); the p99 ratio shows how
    long a document's prefill stalls other requests' first token (target: at most 3x solo).
    Run once per --interference-chunks value (--max-num-batched-tokens), each on its own
    server start, since the prefill chunk size bounds the stall.

Only 127.0.0.1 is contacted; request counts and timeouts are bounded; each server is stopped
with SIGTERM (then killed) at the end, also on errors.

Usage:  python benchmarks/run.py serve -- [--quick] [--concurrency 1,4,16]
            [--interference-chunks 2048,256] [-- extra server flags, e.g. --num-threads 2]
        (or python benchmarks/bench_serve.py ... [--out FILE] [-- server flags])
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py serve, which records it
as benchmarks/results/serve/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from machine import machine_info, save_result
LICENSE = Path("/usr/share/common-licenses/GPL-3")
HOST = "127.0.0.1"
READY_RE = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)/v1")


# ---------------------------------------------------------------- machine facts and prompts

class Prompts:
    """Token-id prompts cut from the GPL-3 text (repeated as needed), tokenized by the
    server's own tokenizer; each prompt starts at a different offset."""

    def __init__(self, model: str) -> None:
        from longctx.model.loader import resolve_model
        from longctx.model.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(model))
        self.ids = tok.encode(LICENSE.read_text(), add_special_tokens=False)
        self.offset = 0

    def take(self, n: int) -> list[int]:
        start = self.offset % len(self.ids)
        self.offset += 997  # a prime stride: prompts differ
        reps = (start + n) // len(self.ids) + 1
        return (self.ids * reps)[start:start + n]


def pct(xs: list[float], q: float) -> float | None:
    """Percentile q (0-100) with linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "mean": statistics.fmean(xs) if xs else None,
            "max": max(xs) if xs else None}


# ---------------------------------------------------------------- the server process

class Server:
    """`python -m longctx serve` on 127.0.0.1 with a free port (--port 0, read from stderr)."""

    def __init__(self, model: str, dtype: str, extra: list[str], start_timeout: float) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
        self.cmd = [sys.executable, "-m", "longctx", "serve", "--model", model, "--host", HOST,
                    "--port", "0", "--dtype", dtype, "--graceful-shutdown-timeout", "2", *extra]
        print(f"starting: {' '.join(self.cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
        self.port = None
        try:
            while self.port is None:
                if time.perf_counter() - t0 > start_timeout:
                    raise RuntimeError(f"server did not start in {start_timeout}s")
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
                m = READY_RE.search(Path(self.log.name).read_text(errors="replace"))
                if m:
                    self.port = int(m.group(1))
                else:
                    time.sleep(0.2)
            self.base = f"http://{HOST}:{self.port}"
            while True:  # the line is printed just before uvicorn starts: wait for /health
                if time.perf_counter() - t0 > start_timeout:
                    raise RuntimeError(f"/health not 200 in {start_timeout}s")
                try:
                    if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        print(f"  ready on port {self.port} in {self.start_s:.1f}s", file=sys.stderr, flush=True)

    def tail(self, n: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return self.proc.returncode


# ---------------------------------------------------------------- one streaming request

async def stream_request(client: httpx.AsyncClient, model: str, ids: list[int], max_tokens: int,
                         timeout: float) -> dict:
    """Send one streaming completion; time its text chunks relative to the send time."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage, error = [], None, None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = str(chunk["error"])
                            continue
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            times.append(time.perf_counter())
    except (TimeoutError, httpx.HTTPError) as err:
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    return {"prompt_tokens": len(ids), "sent": t0, "end": end,
            "ttft": times[0] - t0 if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])],
            "latency": end - t0, "chunks": len(times),
            "output_tokens": usage["completion_tokens"] if usage else None, "error": error}


# ---------------------------------------------------------------- scenarios

async def warm_up(server: Server, args, prompts: Prompts) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=args.timeout) as client:
        r = await stream_request(client, args.model, prompts.take(64), 4, args.timeout)
        if r["error"]:
            raise RuntimeError(f"warm-up request failed: {r['error']}\n{server.tail()}")


async def load_level(server: Server, args, prompts: Prompts, concurrency: int, n_requests: int) -> dict:
    """n_requests streaming requests, at most `concurrency` in flight; every `long_every`-th is long."""
    jobs = [prompts.take(args.long_tokens if i % args.long_every == args.long_every - 1 else args.short_tokens)
            for i in range(n_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for ids in jobs:
        queue.put_nowait(ids)
    results = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)

    async def worker(client):
        while True:
            try:
                ids = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await stream_request(client, args.model, ids, args.max_tokens, args.timeout))

    async with httpx.AsyncClient(base_url=server.base, timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r["error"]]
    out_tokens = sum(r["output_tokens"] or r["chunks"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    res = {"concurrency": concurrency, "requests": n_requests, "errors": len(results) - len(ok),
           "long_requests": sum(1 for ids in jobs if len(ids) == args.long_tokens),
           "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
           "output_tokens": out_tokens, "ttft_s": stats(ttft),
           "ttft_short_s": stats([r["ttft"] for r in ok if r["ttft"] is not None
                                  and r["prompt_tokens"] == args.short_tokens]),
           "ttft_long_s": stats([r["ttft"] for r in ok if r["ttft"] is not None
                                 and r["prompt_tokens"] == args.long_tokens]),
           "itl_s": stats([x for r in ok for x in r["itl"]]),
           "first_errors": [r["error"] for r in results if r["error"]][:3]}
    print(f"  concurrency {concurrency}: {n_requests} requests in {wall:.1f}s, "
          f"TTFT p50 {res['ttft_s']['p50']}, errors {res['errors']}", file=sys.stderr, flush=True)
    return res


async def interference(server: Server, args, prompts: Prompts, chunk: int) -> dict:
    """Short requests alone (sequential), then the same while one long prefill is in flight."""
    shorts = [prompts.take(args.short_tokens) for _ in range(args.interference_shorts)]
    async with httpx.AsyncClient(base_url=server.base, timeout=args.timeout) as client:
        solo = []
        for ids in shorts:
            solo.append(await stream_request(client, args.model, ids, args.short_max_tokens, args.timeout))
        long_ids = prompts.take(args.doc_tokens)
        long_task = asyncio.create_task(
            stream_request(client, args.model, long_ids, args.short_max_tokens, args.long_timeout))
        await asyncio.sleep(args.doc_head_start)  # the document is admitted and prefilling
        # open loop: one short request every `short_gap` seconds while the document is in
        # flight (sequential sends would let only the first overlap a stalled prefill)
        tasks = []
        for ids in shorts:
            if long_task.done():
                break
            tasks.append(asyncio.create_task(
                stream_request(client, args.model, ids, args.short_max_tokens, args.timeout)))
            try:
                await asyncio.wait_for(asyncio.shield(long_task), args.short_gap)
            except TimeoutError:
                pass
        during = list(await asyncio.gather(*tasks))
        long = await long_task
    long_first = long["sent"] + long["ttft"] if long["ttft"] is not None else long["end"]
    # only short requests sent before the document's first token overlapped its prefill
    overlapped = [r for r in during if r["sent"] < long_first]
    solo_ttft = [r["ttft"] for r in solo if r["ttft"] is not None]
    during_ttft = [r["ttft"] for r in overlapped if r["ttft"] is not None]
    s, d = stats(solo_ttft), stats(during_ttft)
    ratio = d["p99"] / s["p99"] if s["p99"] and d["p99"] is not None else None
    res = {"max_num_batched_tokens": chunk, "doc_tokens": args.doc_tokens, "short_tokens": args.short_tokens,
           "short_max_tokens": args.short_max_tokens, "solo_ttft_s": s, "during_ttft_s": d,
           "during_all_ttft_s": stats([r["ttft"] for r in during if r["ttft"] is not None]),
           "p99_ratio": ratio, "target_ratio": 3.0, "meets_target": ratio is not None and ratio <= 3.0,
           "doc_ttft_s": long["ttft"], "doc_latency_s": long["latency"],
           "errors": sum(1 for r in solo + during + [long] if r["error"]),
           "first_errors": [r["error"] for r in solo + during + [long] if r["error"]][:3]}
    print(f"  interference chunk {chunk}: solo p99 {s['p99']}, during p99 {d['p99']} (n={d['n']}), "
          f"ratio {ratio}, doc TTFT {long['ttft']}", file=sys.stderr, flush=True)
    return res


# ---------------------------------------------------------------- driver

def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def summarize(report: dict) -> list[str]:
    rows = [f"{'concurrency':>11} {'reqs':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
            f" {'req/s':>6} {'out tok/s':>9} {'errors':>6}"]
    for r in report["load"]:
        rows.append(f"{r['concurrency']:>11} {r['requests']:>4} {fmt(r['ttft_s']['p50']):>9}"
                    f" {fmt(r['ttft_s']['p99']):>9} {fmt(r['itl_s']['p50']):>8} {fmt(r['itl_s']['p99']):>8}"
                    f" {fmt(r['requests_per_s'], '.2f'):>6} {fmt(r['output_tokens_per_s'], '.1f'):>9}"
                    f" {r['errors']:>6}")
    rows.append(f"{'chunk':>11} {'solo TTFT p50/p99':>18} {'during p50/p99 (n)':>22} {'p99 ratio':>9}"
                f" {'<=3x':>5} {'doc TTFT':>8}")
    for r in report["interference"]:
        s, d = r["solo_ttft_s"], r["during_ttft_s"]
        solo = f"{fmt(s['p50'])}/{fmt(s['p99'])}"
        during = f"{fmt(d['p50'])}/{fmt(d['p99'])} ({d['n']})"
        rows.append(f"{r['max_num_batched_tokens']:>11} {solo:>18} {during:>22}"
                    f" {fmt(r['p99_ratio'], '.1f'):>9} {'yes' if r['meets_target'] else 'no':>5}"
                    f" {fmt(r['doc_ttft_s'], '.1f'):>8}")
    rows.append("times in seconds; TTFT = request sent -> first text chunk; ITL = gaps between text chunks")
    return rows


async def run_all(args, prompts: Prompts) -> dict:
    report = {"load": [], "interference": [], "server_start_s": {}}
    default_chunk = args.interference_chunks[0] if args.interference_chunks else None
    chunk_flag = "--max-num-batched-tokens"
    user_chunk = chunk_flag in args.server_flags or any(f.startswith(chunk_flag + "=") for f in args.server_flags)
    # first server: the load levels, then the first interference chunk size on the same process
    first_flags = list(args.server_flags)
    if default_chunk is not None and not user_chunk:
        first_flags += [chunk_flag, str(default_chunk)]
    server = Server(args.model, args.dtype, first_flags, args.start_timeout)
    try:
        report["server_start_s"][" ".join(first_flags) or "default"] = server.start_s
        await warm_up(server, args, prompts)
        for c, n in zip(args.concurrency, args.requests):
            report["load"].append(await load_level(server, args, prompts, c, n))
        if default_chunk is not None and not user_chunk:
            report["interference"].append(await interference(server, args, prompts, default_chunk))
    finally:
        rc = server.stop()
        print(f"  server stopped (exit code {rc})", file=sys.stderr, flush=True)
    for chunk in (args.interference_chunks[1:] if not user_chunk else []):
        flags = list(args.server_flags) + [chunk_flag, str(chunk)]
        server = Server(args.model, args.dtype, flags, args.start_timeout)
        try:
            report["server_start_s"][" ".join(flags)] = server.start_s
            await warm_up(server, args, prompts)
            report["interference"].append(await interference(server, args, prompts, chunk))
        finally:
            rc = server.stop()
            print(f"  server stopped (exit code {rc})", file=sys.stderr, flush=True)
    return report


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> None:
    argv = sys.argv[1:]
    server_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", default="4,8,16", help="requests per concurrency level")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--short-tokens", type=int, default=50)
    p.add_argument("--long-every", type=int, default=4, help="every N-th request is a long one")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--interference-chunks", default="2048,256",
                   help="--max-num-batched-tokens values for the interference scenario (empty: skip)")
    p.add_argument("--doc-tokens", type=int, default=8000)
    p.add_argument("--short-max-tokens", type=int, default=4)
    p.add_argument("--interference-shorts", type=int, default=8, help="short requests per phase")
    p.add_argument("--doc-head-start", type=float, default=0.5, help="seconds between the document and the shorts")
    p.add_argument("--short-gap", type=float, default=2.0,
                   help="seconds between short requests sent during the document's prefill")
    p.add_argument("--timeout", type=float, default=180.0, help="per request, seconds")
    p.add_argument("--long-timeout", type=float, default=400.0, help="the 8K document request, seconds")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = p.parse_args(argv)
    args.server_flags = server_flags
    args.concurrency, args.requests = ints(args.concurrency), ints(args.requests)
    args.interference_chunks = ints(args.interference_chunks)
    if args.quick:
        args.concurrency, args.requests = [1, 4], [2, 4]
        args.long_tokens, args.doc_tokens, args.max_tokens = 256, 1024, 4
        args.interference_shorts, args.interference_chunks, args.short_gap = 3, [512, 128], 0.4
    if len(args.requests) != len(args.concurrency):
        p.error("--requests needs one count per --concurrency level")
    prompts = Prompts(args.model)
    t0 = time.perf_counter()
    report = asyncio.run(run_all(args, prompts))
    report["total_s"] = time.perf_counter() - t0
    report = {"machine": machine_info(httpx=httpx.__version__),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
              **report}
    save_result(args.out, report)
    print(f"total {report['total_s']:.0f}s")
    for row in summarize(report):
        print(row)


if __name__ == "__main__":
    main()

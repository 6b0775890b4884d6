"""GGUF weights kept as stored (``gguf_weights="blocks"``) against the same file expanded to
float32 at load (``"float"``) and against llama.cpp on the same file, on the default model
(SmolLM2-135M-Instruct, Q4_1 matrices and a Q8_0 embedding) or a 1B-shaped model with random
weights quantized by llama.cpp to Q8_0 or Q4_K_M (``--model``, ``benchmarks/quant_model.py``).

Each engine runs in a fresh process of its own, one after the other (``--engines``, default
blocks, fast (the blocks with ``block_numerics="fast"``; ``fast2``: ``"fast2"``, not in the
default list), float, llama.cpp where
llama-cpp-python is installed): load, an untimed 64-token
warm-up, then one greedy request of a ``--ctx``-token prompt (the GPL's text, repeated) and
``--new-tokens`` new tokens. A ``--ctx`` past the model's trained window (the default model's
8,192 positions) runs there on both engines (longctx with ``allow_long_context=True``,
llama.cpp as it does by default): the speed is what is measured; the tokens degrade on both.
longctx: prefix caching and lookahead off, the request stepped
by hand (``engine.step()`` under ``perf_counter``); prefill_s is ``add_request`` to the step
that returns the first token, decode ms/token the mean of the following steps. llama.cpp
(llama-cpp-python): ``n_threads`` as ``--threads``, flash attention on, f16 KV (``llama.cpp-q8kv``:
q8_0 KV, against longctx's int8 pages in ``blocks-int8kv``; its f16 KV has the bytes of
longctx's bfloat16 pages in ``blocks-bf16kv``), ``n_batch``
and ``n_ubatch`` 512; prefill_s is ``eval`` of the prompt, decode the mean of
``eval([token])`` after a greedy pick from the last logits. peak_rss_gib: the process's
VmHWM at the end (its own high-water mark; mapped file pages it touched count in it). Tokens: blocks and float
must agree (the bar: the same tokens); llama.cpp's are reported as the count of leading tokens
equal to blocks'.

``--rounds R`` runs the engines R times in the same order (each in a fresh process) and reports
each engine's median and every round's figures: on these shared machines one engine's decode
moved by up to ~60% between runs of an hour.

Usage:  python benchmarks/run.py quant -- [--ctx 4096] [--new-tokens 32] [--threads 2] [--rounds R]
        (or python benchmarks/bench_quant.py ... [--out FILE])
Writes its JSON only to ``--out FILE`` (benchmarks/run.py quant records it as
benchmarks/results/quant/<machine>/<git rev>.json); without ``--out`` it writes nothing.
Prints a table.

``int8``, ``int4``, ``int4-g128``: an HF folder of the same weights (``hf_folder.write_hf_folder``:
the file expanded by transformers' GGUF loader and saved as fp32 safetensors; for the 1B model
from its F32 file, for the default model from its Q4_1 file) quantized at load
(``quantization=...``).

``vllm-bf16``, ``vllm-fp32``: vLLM's CPU build on the same HF folder, in its own venv
(``--vllm-python``, or env ``LONGCTX_VLLM_PYTHON``; set up as ../shared/BENCHMARKS.md says):
its OpenMP threads bound to cores 0..threads-1, prefix caching off, its KV pool sized to the
request (+512 tokens, +10%, in its 128-token blocks; 64 MiB at least), the same prompt ids as
longctx. After the same 64-token warm-up, prefill_s is the wall time of a one-token generate
of the prompt; decode ms/token is (last token's engine timestamp - first's) / (new tokens - 1)
of a second generate of the prompt with ``--new-tokens`` tokens (the wall-time form, less the
first request's time, where vLLM gives no timestamps); peak_rss_gib is its largest process
(the engine core runs in a child), VmHWM.

``--model 1b-f32``: the 1B-shaped model's F32 file (needs no llama-cpp-python), for the engines
that read its HF folder (int8, int4, vllm-*) or the float weights. ``--model 8b-q4_k_m``: the
8B-shaped model (Llama-3.1-8B's layers), quantized from an F16 file; it has no HF folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_worker import peer_env  # noqa: E402
from machine import machine_info, save_result  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")

# Each engine's own peak: /proc/self/status's VmHWM (the high-water mark of this process's own
# memory). ru_maxrss is not it: Linux carries a parent's high-water mark into a child through
# fork and exec, so a run that built the 1B model in the parent (~4.5 GiB) reported that for
# every engine (d520a75).
PEAK_RSS = r'''
import resource
def peak_rss_gib():
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
'''

LONGCTX = PEAK_RSS + r'''
import json, resource, sys, time, torch
from longctx import LLM, SamplingParams
mode, ctx, n_new, threads, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
kv_gb_per_4k = float(sys.argv[7])  # the pool's bound (allocated empty: only the pages used become resident)
torch.set_num_threads(threads)
t0 = time.perf_counter()
extra = {"fast": {"gguf_weights": "blocks", "block_numerics": "fast"},
         "fast2": {"gguf_weights": "blocks", "block_numerics": "fast2"},
         "fast-bf16kv": {"gguf_weights": "blocks", "block_numerics": "fast", "kv_cache_dtype": "bfloat16"},
         "fast2-bf16kv": {"gguf_weights": "blocks", "block_numerics": "fast2", "kv_cache_dtype": "bfloat16"},
         "blocks-int8kv": {"gguf_weights": "blocks", "kv_cache_dtype": "int8"},
         "blocks-bf16kv": {"gguf_weights": "blocks", "kv_cache_dtype": "bfloat16"},
         "blocks-bf16": {"gguf_weights": "blocks", "dtype": "bfloat16"},
         "bf16": {"dtype": "bfloat16", "gguf_weights": "float"},  # the weights expanded to bfloat16
         "int8": {"quantization": "int8"},
         "int8-fast": {"quantization": "int8", "block_numerics": "fast"},
         "int8-fast-bf16kv": {"quantization": "int8", "block_numerics": "fast", "kv_cache_dtype": "bfloat16"},
         "int8-bf16": {"quantization": "int8", "dtype": "bfloat16"},
         "int8-fast-bf16": {"quantization": "int8", "block_numerics": "fast", "dtype": "bfloat16"},
         "int4": {"quantization": "int4"},
         "int4-g128": {"quantization": "int4", "quantization_group_size": 128}}.get(mode, {"gguf_weights": mode})
llm = LLM(model, **extra, enable_prefix_caching=False, lookahead=False, max_num_seqs=1,
          max_model_len=ctx + n_new + 8, kv_cache_gb=kv_gb_per_4k * -(-ctx // 4096),
          allow_long_context=True)  # past a model's window (the default model's 8K at --ctx 16384), as llama.cpp runs
load_s = time.perf_counter() - t0
text = open(sys.argv[5]).read()
ids = llm.get_tokenizer().encode(text * (1 + 4 * ctx // len(text)), add_special_tokens=False)[:ctx]
greedy = dict(temperature=0.0, ignore_eos=True)
llm.generate({"prompt_token_ids": ids[:64]}, SamplingParams(max_tokens=2, **greedy))
eng, tokens, steps = llm.engine, [], []
t0 = time.perf_counter()
rid = eng.add_request(ids, SamplingParams(max_tokens=n_new, **greedy))
prefill_s = None
while eng.has_unfinished():
    t = time.perf_counter()
    out = eng.step()
    dt = time.perf_counter() - t
    tokens += [tok for u in out if u.request_id == rid for tok in u.new_token_ids]
    if prefill_s is None:
        if tokens:
            prefill_s = time.perf_counter() - t0
    else:
        steps.append(dt)
from longctx.kernels import cpu_tune  # (which way this process took bfloat16 products: None, not loaded)
print(json.dumps({"engine": "longctx " + mode, "cpu_matmul": eng.cpu_matmul, "load_s": load_s,
                  "prefill_s": prefill_s, "decode_ms": 1e3 * sum(steps) / len(steps), "tokens": tokens,
                  "peak_rss_gib": peak_rss_gib(),
                  "bf16_dot": cpu_tune.bf16_dot_ways()}))
'''

LLAMA_CPP = PEAK_RSS + r'''
import json, resource, sys, time
import numpy as np
from llama_cpp import Llama
path, ctx, n_new, threads, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
kv = sys.argv[6]  # f16 or q8_0
t0 = time.perf_counter()
llm = Llama(path, n_ctx=ctx + n_new + 8, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512,
            flash_attn=True, verbose=False, logits_all=False,
            **({"type_k": 8, "type_v": 8} if kv == "q8_0" else {}))  # GGML_TYPE_Q8_0
load_s = time.perf_counter() - t0
llm.eval(ids[:64]); llm.reset()
t0 = time.perf_counter()
llm.eval(ids)
prefill_s = time.perf_counter() - t0
tokens, steps = [], []
for i in range(n_new):
    tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))  # the last token's
    tokens.append(tok)
    if i == n_new - 1:
        break
    t = time.perf_counter()
    llm.eval([tok])
    steps.append(time.perf_counter() - t)
print(json.dumps({"engine": "llama.cpp" + ("" if kv == "f16" else " q8_0 KV"), "load_s": load_s, "prefill_s": prefill_s,
                  "decode_ms": 1e3 * sum(steps) / len(steps), "tokens": tokens,
                  "peak_rss_gib": peak_rss_gib()}))
'''

VLLM = PEAK_RSS + r'''
import json, os, sys, time
dtype, ctx, n_new, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids, folder, bench_dir = json.loads(sys.argv[5]), sys.argv[6], sys.argv[7]
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"  # its default keeps a core for itself
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, bench_dir)
from bench_e2e import _process_tree_hwm  # stdlib only
import torch, vllm
from vllm import LLM, SamplingParams
torch.set_num_threads(threads)
cfg = json.load(open(os.path.join(folder, "config.json")))
head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
max_len = ctx + n_new + 8
per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (2 if dtype == "bfloat16" else 4)
# the request in 128-token blocks, +512 tokens and +10%: at 272 tokens, 1.1x its 3 blocks was refused as
# room for 256 (its pool holds whole blocks of every layer); 64 MiB at least
kv_bytes = max(int(1.1 * 128 * -(-(max_len + 512) // 128) * per_token), 64 << 20)
t0 = time.perf_counter()
llm = LLM(model=folder, dtype=dtype, max_model_len=max_len, enable_prefix_caching=False, seed=0,
          kv_cache_memory_bytes=kv_bytes, disable_log_stats=False)  # metrics are None without stats
load_s = time.perf_counter() - t0

def gen(prompt, n):
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    return time.perf_counter() - t, out

gen(ids[:64], 2)
prefill_s, _ = gen(ids, 1)
wall_s, out = gen(ids, n_new)
m = out.metrics
if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "last_token_ts", 0):
    decode_ms, how = 1e3 * (m.last_token_ts - m.first_token_ts) / (n_new - 1), "engine timestamps"
else:
    decode_ms, how = 1e3 * (wall_s - prefill_s) / (n_new - 1), "wall time less the one-token request's"
procs = _process_tree_hwm()
peak = max([peak_rss_gib(), *(p["peak_rss_gib"] for p in procs.values() if p["peak_rss_gib"] is not None)])
print(json.dumps({"engine": "vllm " + dtype, "vllm": vllm.__version__, "load_s": load_s, "prefill_s": prefill_s,
                  "decode_ms": decode_ms, "decode_from": how, "tokens": list(out.outputs[0].token_ids),
                  "peak_rss_gib": peak, "processes": procs, "kv_cache_gib": kv_bytes / 2**30}), flush=True)
try:
    llm.llm_engine.engine_core.shutdown()
except Exception:
    pass
'''

KV_GB_PER_4K = {"8b": 1.5}  # float32 KV of 4K tokens: 1 GiB for the 8B shape (0.25 for the 1B, ~0.35 the 135M)
QUANTIZED = ("int8", "int8-fast", "int8-fast-bf16kv", "int8-bf16", "int8-fast-bf16", "int4", "int4-g128")  # HF folder engines, quantized at load
VLLM_ENGINES = {"vllm-bf16": "bfloat16", "vllm-fp32": "float32"}
PEERS = ("llama.cpp", "llama.cpp-q8kv", *VLLM_ENGINES)  # engines that take longctx's prompt ids


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["blocks", "fast", "float", "llama.cpp"],
                    help="blocks (exact numerics), blocks-int8kv (and int8 KV pages), blocks-bf16kv (and bfloat16 "
                         "KV pages), blocks-bf16 (dtype='bfloat16': bfloat16 pages, prefill on bfloat16 slices where "
                         "the CPU has AMX tiles or faster vdpbf16ps), fast "
                         "(block_numerics='fast'), fast2 (block_numerics='fast2'), fast-bf16kv and fast2-bf16kv (with "
                         "bfloat16 KV pages), float, bf16 (dtype='bfloat16': the weights as bfloat16), "
                         "llama.cpp (f16 KV), llama.cpp-q8kv (q8_0 KV); "
                         "int8, int8-fast (and block_numerics='fast'), int8-fast-bf16kv (and bfloat16 KV pages), "
                         "int8-bf16 and int8-fast-bf16 (dtype='bfloat16'), int4, "
                         "int4-g128: the model's HF folder "
                         "(hf_folder.py) quantized "
                         "at load (quantization=...); vllm-bf16, vllm-fp32: vLLM's CPU build on that folder "
                         "(needs --vllm-python)")
    ap.add_argument("--model", default="default", choices=["default", "1b-f32", "1b-q8_0", "1b-q4_k_m", "8b-q4_k_m"],
                    help="the default model's Q4_1 file, the 1B-shaped model (quant_model.py) as written "
                         "(F32) or quantized by llama.cpp to Q8_0 or Q4_K_M, or the 8B-shaped model's Q4_K_M "
                         "(quantized from an F16 file; its GGUF's engines only)")
    ap.add_argument("--vllm-python", default=os.environ.get("LONGCTX_VLLM_PYTHON"),
                    help="the python of vLLM's CPU venv (env LONGCTX_VLLM_PYTHON), for the vllm-* engines")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times, in the same order each round (a shared machine's "
                         "speed drifts: each row then reports the median prefill and decode of its rounds, "
                         "and every round's figures)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if any(e in VLLM_ENGINES for e in args.engines) and not (
            args.vllm_python and os.access(args.vllm_python, os.X_OK)):
        ap.error(f"the vllm-* engines need --vllm-python (or LONGCTX_VLLM_PYTHON): the python of vLLM's "
                 f"venv; got {args.vllm_python!r}")
    if args.engines[0] in PEERS:
        ap.error(f"the first engine must be a longctx one (its prompt ids are the peers' too), got {args.engines[0]!r}")
    sys.path.insert(0, str(ROOT))
    from longctx.model.loader import resolve_model

    import quant_model

    if args.model == "default":
        gguf = resolve_model("smollm2-135m")
    else:
        size, kind = args.model.split("-", 1)
        if size != "1b" and any(e in QUANTIZED or e in VLLM_ENGINES for e in args.engines):
            ap.error(f"--model {args.model} has no HF folder (its source is F16, not F32): run its GGUF's engines")
        gguf = quant_model.ensure(() if kind == "f32" else (kind,), size)[kind]
    rows, common = [], [str(args.ctx), str(args.new_tokens), str(args.threads)]
    for engine in [e for _ in range(args.rounds) for e in args.engines]:
        if engine in ("llama.cpp", "llama.cpp-q8kv"):  # (PEERS: the first engine is longctx's)
            if importlib.util.find_spec("llama_cpp") is None:
                print("llama.cpp: llama-cpp-python is not installed; skipped")
                continue
            ids = rows[0]["prompt_ids"]
            proc = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(gguf), *common, json.dumps(ids),
                                   "q8_0" if engine.endswith("q8kv") else "f16"], capture_output=True, text=True,
                                  env=peer_env())
        elif engine in VLLM_ENGINES:
            ids = rows[0]["prompt_ids"]
            proc = subprocess.run([args.vllm_python, "-c", VLLM, VLLM_ENGINES[engine], *common, json.dumps(ids),
                                   str(hf_folder_of(args.model)), str(ROOT / "benchmarks")],
                                  capture_output=True, text=True, cwd="/", env=peer_env())
        else:
            model = gguf
            if engine in QUANTIZED:  # an HF folder of the same weights (the F32 file's, for the 1B model)
                model = hf_folder_of(args.model)
            proc = subprocess.run([sys.executable, "-c", LONGCTX, engine, *common, str(TEXT), str(model),
                                   str(KV_GB_PER_4K.get(args.model.split("-")[0], 0.5))],
                                  capture_output=True, text=True, cwd=ROOT)
            if proc.returncode == 0 and not rows:  # the prompt's ids, for llama.cpp
                from longctx.model.tokenizer import load_tokenizer

                text = TEXT.read_text()
                ids = load_tokenizer(gguf).encode(text * (1 + 4 * args.ctx // len(text)),
                                                  add_special_tokens=False)[:args.ctx]
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"{engine} failed")
        row = _last_json(proc.stdout)
        if not rows:
            row["prompt_ids"] = ids
        rows.append(row)
    if args.rounds > 1:  # one row per engine: the medians, and each round's figures
        merged = {}
        for row in rows:
            merged.setdefault(row["engine"], []).append(row)
        rows = []
        for runs in merged.values():
            row = dict(runs[0])
            for key in ("load_s", "prefill_s", "decode_ms", "peak_rss_gib"):
                row[key] = statistics.median(r[key] for r in runs)
                row[key + "_rounds"] = [r[key] for r in runs]
            row["tokens_same_every_round"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
            rows.append(row)
    base = rows[0]
    for row in rows:
        row["same_tokens_as_first"] = sum(1 for _ in iter_equal(row["tokens"], base["tokens"]))
    print(f"{'engine':<16}{'load s':>8}{'prefill s':>11}{'decode ms':>11}{'peak RSS GiB':>14}  tokens equal to {base['engine']}")
    for row in rows:
        print(f"{row['engine']:<16}{row['load_s']:8.2f}{row['prefill_s']:11.2f}{row['decode_ms']:11.1f}"
              f"{row['peak_rss_gib']:14.2f}  {row['same_tokens_as_first']}/{len(row['tokens'])}")
    by = {r["engine"]: r for r in rows}
    checks = {}
    if "longctx blocks" in by and "longctx float" in by:
        checks["blocks_tokens_equal_float"] = by["longctx blocks"]["tokens"] == by["longctx float"]["tokens"]
        print(f"blocks and float give the same tokens: {checks['blocks_tokens_equal_float']}")
    if "vllm bfloat16" in by:  # issue 42's bar: int8 weights' decode <= 0.6x vLLM-CPU bf16's
        vllm = by["vllm bfloat16"]
        for row in rows:
            if row["engine"].startswith("longctx "):
                name = row["engine"].removeprefix("longctx ")
                checks[f"{name}_over_vllm_bf16"] = {k: row[k] / vllm[k] for k in ("prefill_s", "decode_ms")}
                print(f"longctx {name} / vLLM bf16: prefill {row['prefill_s'] / vllm['prefill_s']:.2f}x, "
                      f"decode {row['decode_ms'] / vllm['decode_ms']:.2f}x")
    for row in rows:
        row.pop("prompt_ids", None)
    save_result(args.out, {"machine": machine_info(), "args": vars(args), "gguf": gguf.name,
                           "gguf_gib": gguf.stat().st_size / 2**30, "rows": rows,
                           "checks": checks})
    return 0


def hf_folder_of(model: str) -> Path:
    """The HF folder of ``--model``'s weights, written where missing: the default model's from its
    Q4_1 file (dequantized), the 1B-shaped model's from its F32 file."""
    import hf_folder
    import quant_model

    return hf_folder.write_hf_folder(gguf=quant_model.ensure(())["f32"] if model != "default" else None)


def iter_equal(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU benchmark: decode at long contexts against HBM bandwidth, prefill against tensor-core
peak, and CUDA graphs on/off. Needs CUDA (results of the runs so far: docs/benchmarks.md).

    python benchmarks/run.py gpu -- [--model smollm2-135m] [--contexts 32768 131072]
                                   [--decode-tokens 64] [--repeats 3]
                                   [--configs graphs eager int8]
    (or python benchmarks/bench_gpu.py ... [--out FILE])

Method (as shared/BENCHMARKS.md): each figure is the median of ``--repeats`` runs in this one
process; random prompt ids of exactly the context length; greedy; lookahead and prefix caching
off (so every run is cold); bfloat16 (the GPU default).
- prefill: time to the first token of a ``context``-token prompt (chunked by
  ``--max-num-batched-tokens``); achieved FLOP/s = (2 x parameters x tokens + attention's
  2 x 2 x L x H x D x tokens^2 / 2) / time, against this run's measured bf16 matmul rate.
- decode: (t(1 + N) - t(1)) / N ms/token with graphs on (default) and off (``enforce_eager``),
  and with int8 KV pages (graphs on);
  the floor is (weight bytes + KV bytes at that context) / this run's measured copy bandwidth.
The default model has an 8K window: past it (until RoPE scaling lands, issue 24) tokens are
meaningless but every byte and FLOP is the same, so the timings stand; ``--model`` takes any
Llama-family folder with a longer window.
Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py gpu, which records it
as benchmarks/results/gpu/<GPU>/<git rev>.json); without ``--out`` it writes nothing.
Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, save_result  # noqa: E402


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def copy_gbps(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9  # read + write


def timed(llm, prompt: list[int], max_tokens: int) -> float:
    from longctx import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_context(args, context: int, eager: bool, kv_cache_dtype: str = "auto") -> dict:
    from longctx import LLM

    llm = LLM(args.model, device="cuda", max_model_len=context + args.decode_tokens + 8,
              max_num_batched_tokens=args.max_num_batched_tokens, lookahead=False,
              enable_prefix_caching=False, enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)
    cfg = llm.engine.model_config
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(10, cfg.vocab_size - 10, (context,), generator=gen).tolist()
    timed(llm, prompt, 2)  # warm-up: every kernel shape of this context compiled before timing
    first = [timed(llm, prompt, 1) for _ in range(args.repeats)]
    full = [timed(llm, prompt, 1 + args.decode_tokens) for _ in range(args.repeats)]
    prefill_s = statistics.median(first)
    decode_ms = (statistics.median(full) - prefill_s) / args.decode_tokens * 1e3
    params = sum(p.numel() for p in llm.engine.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())

    kv_per_token = llm.engine.kv_format.page_bytes(llm.engine.kv.block_size) / llm.engine.kv.block_size
    attn_flops = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context ** 2 / 2
    llm.close()
    return {"context": context, "graphs": not eager, "kv_cache_dtype": kv_cache_dtype, "prefill_s": prefill_s, "decode_ms_per_token": decode_ms,
            "prefill_flops": 2 * params * context + attn_flops,
            "decode_bytes_per_token": weight_bytes + kv_per_token * context}


CONFIGS = {"graphs": (False, "auto"), "eager": (True, "auto"), "int8": (False, "int8")}  # (eager, KV dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS),
                        help="which rows per context: graphs (bf16 pages), eager, int8 (int8 pages, graphs)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs CUDA: no GPU on this machine")
    device = torch.device("cuda")
    peak_tflops, bandwidth = matmul_tflops(device), copy_gbps(device)
    rows = []
    for context in args.contexts:
        for eager, kv_dtype in (CONFIGS[name] for name in args.configs):
            row = bench_context(args, context, eager, kv_dtype)
            row["prefill_tflops"] = row["prefill_flops"] / row["prefill_s"] / 1e12
            row["prefill_share_of_matmul_peak"] = row["prefill_tflops"] / peak_tflops
            row["decode_floor_ms"] = row["decode_bytes_per_token"] / (bandwidth * 1e9) * 1e3
            row["decode_share_of_bandwidth"] = row["decode_floor_ms"] / row["decode_ms_per_token"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    save_result(args.out, {"machine": machine_info(gpu=torch.cuda.get_device_name(device)),
                           "ceilings": {"bf16_matmul_tflops": peak_tflops, "copy_gbps": bandwidth},
                           "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()

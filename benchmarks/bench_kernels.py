"""Benchmark the paged attention kernels: decode bandwidth and prefill-chunk throughput.

On CUDA it times ``longctx.kernels.triton_attention.paged_attention`` and, when flash-attn is
installed, ``flash_attn_with_kvcache`` on the same shapes:

* decode, batch 1 and batch 8, each sequence at ``--context`` tokens: achieved GB/s, the bytes
  of K and V the step must read divided by its time;
* one prefill chunk of ``--chunk`` tokens after ``--context - --chunk`` cached tokens:
  TFLOP/s, 4 * D * H * (visible query-key pairs) divided by the time.

On a machine without CUDA there are no Triton numbers (the Triton interpreter is a test tool,
not a kernel): the script says so and times the CPU path (``torch_paged`` with its compiled
decode kernel, and with the kernel off) against the baseline a user would write (gather the
pages, then SDPA), on SmolLM2's geometry at 8K context and Llama-3-8B's at 2K.

Writes its JSON only to ``--out FILE`` (run through benchmarks/run.py kernels, which records it
as benchmarks/results/kernels/<machine or GPU>/<git rev>.json); without ``--out`` it writes nothing.
The result has the machine's description; the table is printed last.
Usage: ``python benchmarks/run.py kernels -- [--context 32768] [--reps 20]`` (or
``python benchmarks/bench_kernels.py ... [--out FILE]``)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from longctx.kernels import reference
from machine import machine_info as shared_machine_info
from machine import save_result

FLASH_ATTN_BLOCK = 256  # flash-attn's paged KV needs block sizes that are multiples of 256


@dataclass(frozen=True)
class Shape:
    """One benchmark case: ``batch`` sequences of ``context`` tokens, ``q_len`` of them new."""

    name: str
    batch: int
    context: int
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def kv_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem

    def flops(self) -> int:
        cached = self.context - self.q_len
        pairs = self.q_len * cached + self.q_len * (self.q_len + 1) // 2  # causal, per sequence
        return 4 * self.batch * self.num_heads * self.head_dim * pairs


@dataclass
class Result:
    impl: str
    case: str
    batch: int
    context: int
    q_len: int
    block_size: int
    dtype: str
    ms: float
    gb_per_s: float | None
    tflop_per_s: float | None


def build_inputs(shape: Shape, device: torch.device):
    """Random paged batch: shuffled block table, the new tokens already in the cache."""
    bs = shape.block_size
    blocks_per_seq = math.ceil(shape.context / bs)
    num_blocks = shape.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_table = perm.view(shape.batch, blocks_per_seq).to(torch.int32)  # (B, max_blocks)
    q = torch.randn(shape.batch * shape.q_len, shape.num_heads, shape.head_dim, generator=gen,
                    device=device).to(shape.dtype)  # (T, H, D)
    context_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    cu_seqlens = torch.arange(0, shape.batch + 1, dtype=torch.int32, device=device) * shape.q_len
    return q, k_cache, v_cache, block_table, context_lens, cu_seqlens


def time_call(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_result(impl: str, shape: Shape, ms: float) -> Result:
    decode = shape.q_len == 1
    return Result(impl, shape.name, shape.batch, shape.context, shape.q_len, shape.block_size,
                  str(shape.dtype).removeprefix("torch."), round(ms, 4),
                  round(shape.kv_bytes() / ms / 1e6, 1) if decode else None,
                  None if decode else round(shape.flops() / ms / 1e9, 2))


def flash_attn_call(shape: Shape, inputs):
    from flash_attn import flash_attn_with_kvcache

    q, k_cache, v_cache, block_table, context_lens, _ = inputs
    q4 = q.view(shape.batch, shape.q_len, shape.num_heads, shape.head_dim)  # (B, L, H, D)
    return lambda: flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=context_lens,
                                           block_table=block_table, causal=True)


def bench_cuda(shapes: list[Shape], args) -> tuple[list[Result], list[str]]:
    from longctx.kernels import triton_attention

    device = torch.device("cuda")
    have_flash = importlib.util.find_spec("flash_attn") is not None
    notes = [] if have_flash else ["flash-attn is not installed: no flash-attn rows"]
    results = []
    for shape in shapes:
        inputs = build_inputs(shape, device)
        ms = time_call(lambda: triton_attention.paged_attention(*inputs), device, args.warmup,
                       args.reps)
        results.append(make_result("triton", shape, ms))
        if have_flash and shape.block_size % FLASH_ATTN_BLOCK == 0:
            ms = time_call(flash_attn_call(shape, inputs), device, args.warmup, args.reps)
            results.append(make_result("flash-attn", shape, ms))
        del inputs
        torch.cuda.empty_cache()
    return results, notes


def gather_sdpa_call(shape: Shape, inputs):
    """The baseline a CPU user would write: gather each sequence's pages, then SDPA with a
    bottom-right causal mask (enable_gqa)."""
    q, k_cache, v_cache, block_table, context_lens, cu = inputs

    def run():
        outs = []
        for b in range(shape.batch):
            k = reference.gather_pages(k_cache, block_table[b], shape.context).transpose(0, 1)[None]
            v = reference.gather_pages(v_cache, block_table[b], shape.context).transpose(0, 1)[None]
            qb = q[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]  # (1, H, L, D)
            mask = torch.ones(shape.q_len, shape.context, dtype=torch.bool).tril(shape.context - shape.q_len)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, attn_mask=None if shape.q_len == 1 else mask, enable_gqa=True))
        return outs

    return run


def bench_cpu(shapes: list[Shape], args) -> tuple[list[Result], list[str]]:
    """The CPU path as the engine runs it (the compiled decode kernel for short steps, the
    compiled flash kernel for longer ones), the torch forms alone (the kernels switched off),
    and gather + SDPA as the baseline."""
    from longctx.kernels import cpu_decode, cpu_flash, torch_paged

    device = torch.device("cpu")
    results = []

    def path(inputs, kernel: bool, max_runs: int | None = None):
        """torch_paged.paged_attention on ``inputs`` with the kernels on or off."""
        def run():
            saved = torch_paged.USE_CPU_KERNEL, torch_paged.MAX_RUNS
            torch_paged.USE_CPU_KERNEL = kernel
            torch_paged.MAX_RUNS = saved[1] if max_runs is None else max_runs
            try:
                torch_paged.paged_attention(*inputs)
            finally:
                torch_paged.USE_CPU_KERNEL, torch_paged.MAX_RUNS = saved
        return run

    for shape in shapes:
        inputs = build_inputs(shape, device)
        consecutive = torch.arange(inputs[3].numel(), dtype=torch.int32).view_as(inputs[3])
        inputs_c = (*inputs[:3], consecutive, *inputs[4:])
        # a prefix-cache hit then fresh pages: each sequence's table in two runs of consecutive
        # ids, attended run by run (default) or gathered (MAX_RUNS 0, the path before runs)
        per_seq = inputs[3].shape[1]
        half = per_seq // 2
        two_runs = torch.tensor([[b * per_seq + i if i < half else consecutive.numel() + b * per_seq + i
                                  for i in range(per_seq)] for b in range(shape.batch)], dtype=torch.int32)
        spare = torch.zeros((consecutive.numel(), *inputs[1].shape[1:]), dtype=inputs[1].dtype)
        k2, v2 = torch.cat([inputs[1], spare]), torch.cat([inputs[2], spare])
        k2[two_runs.long()], v2[two_runs.long()] = inputs[1][inputs[3].long()], inputs[2][inputs[3].long()]
        inputs_r = (inputs[0], k2, v2, two_runs, *inputs[4:])
        impls = {}
        if cpu_decode.available():
            impls["engine-shuf"] = path(inputs, True)
            impls["engine-consec"] = path(inputs_c, True)
        impls["torch-shuf"] = path(inputs, False)
        impls["torch-consec"] = path(inputs_c, False)
        impls["torch-2runs"] = path(inputs_r, False)
        impls["torch-2runs-gather"] = path(inputs_r, False, max_runs=0)
        impls["gather+sdpa"] = gather_sdpa_call(shape, inputs)
        # round-robin over the implementations, so that a slow spell of this shared machine
        # falls on all of them rather than on whichever ran during it
        times: dict[str, list[float]] = {name: [] for name in impls}
        for fn in impls.values():
            fn()
        for _ in range(args.reps):
            for name, fn in impls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        results += [make_result(name, shape, statistics.median(t)) for name, t in times.items()]
    notes = ["No CUDA device: Triton numbers need a GPU and none were measured. Rows: engine-*, "
             "longctx.kernels.torch_paged as the engine runs it (steps of at most "
             f"{torch_paged.CPU_KERNEL_MAX_ROWS} query rows per KV head go to the compiled decode "
             f"kernel, {cpu_decode.status()}; longer ones to the compiled flash kernel, "
             f"{cpu_flash.status()}), with a shuffled and a consecutive block table; "
             "torch-*, the same with the compiled kernels switched off: shuffled, consecutive, each "
             "table in two runs of consecutive ids (a prefix-cache hit then fresh pages) attended "
             "run by run and, as before runs, gathered; and gather + SDPA as the baseline. Every "
             "row reruns one layer's inputs, so K/V may sit partly in cache: the end-to-end decode "
             f"figures are in bench_e2e.py. Per shape the implementations run round-robin, "
             f"{args.reps} rounds, medians."]
    return results, notes


def smollm_shapes(context: int, chunk: int, block_size: int) -> list[Shape]:
    """SmolLM2-135M attention geometry (9 query heads, 3 KV heads, head dim 64), fp32."""
    common = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size, dtype=torch.float32)
    return [Shape(f"smollm-decode-b1-{context}", 1, context, 1, **common),
            Shape(f"smollm-decode-b8-{context // 4}", 8, context // 4, 1, **common),
            Shape(f"smollm-verify8-b1-{context}", 1, context, 8, **common),
            Shape(f"smollm-verify16-b1-{context}", 1, context, 16, **common),
            Shape(f"smollm-prefill-chunk{chunk}-at-{context}", 1, context, chunk, **common)]


def model_shapes(context: int, chunk: int, dtype: torch.dtype, block_sizes: list[int]):
    """Llama-3-8B attention geometry: 32 query heads, 8 KV heads, head dim 128."""
    shapes = []
    for bs in block_sizes:
        common = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=bs, dtype=dtype)
        shapes += [
            Shape(f"decode-b1-{context}", 1, context, 1, **common),
            Shape(f"decode-b8-{context}", 8, context, 1, **common),
            Shape(f"prefill-chunk{chunk}-at-{context}", 1, context, chunk, **common),
        ]
    return shapes


def machine_info() -> dict:
    info = shared_machine_info(gpu=None, triton=None, flash_attn=None)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for name in ("triton", "flash_attn"):
        if importlib.util.find_spec(name) is not None:
            info[name] = getattr(importlib.import_module(name), "__version__", "unknown")
    return info


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def print_table(results: list[Result]) -> None:
    header = (f"{'impl':<18} {'case':<32} {'BS':>4} {'dtype':<9} {'ms':>10} {'GB/s':>8} "
              f"{'TFLOP/s':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        gbs = f"{r.gb_per_s:.1f}" if r.gb_per_s is not None else "-"
        tfl = f"{r.tflop_per_s:.2f}" if r.tflop_per_s is not None else "-"
        print(f"{r.impl:<18} {r.case:<32} {r.block_size:>4} {r.dtype:<9} {r.ms:>10.3f} "
              f"{gbs:>8} {tfl:>8}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per sequence (default 32768 on CUDA, 8192 on the CPU)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill chunk tokens (default 2048 on CUDA and the CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls (CUDA 20; CPU 7 rounds)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file for the result (benchmarks/run.py passes one); none: write nothing")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    on_cuda = torch.cuda.is_available()
    context = args.context or (32768 if on_cuda else 8192)
    chunk = args.chunk or 2048
    args.reps = args.reps or (20 if on_cuda else 7)
    if on_cuda:
        shapes = model_shapes(context, chunk, torch.bfloat16, [16, FLASH_ATTN_BLOCK])
        results, notes = bench_cuda(shapes, args)
    else:
        print("No CUDA device: Triton kernels need a GPU, so no Triton number is measured here. "
              "Timing the torch CPU path against gather + SDPA.")
        shapes = smollm_shapes(context, chunk, 64) + model_shapes(context // 4, chunk // 4, torch.float32, [16])
        results, notes = bench_cpu(shapes, args)
    report = {"machine": machine_info(), "device": device_slug(),
              "shapes": [{**asdict(s), "dtype": str(s.dtype)} for s in shapes],
              "results": [asdict(r) for r in results], "notes": notes}
    save_result(args.out, report, indent=2)
    for note in notes:
        print(note)
    print_table(results)


if __name__ == "__main__":
    main()

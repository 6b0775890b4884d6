"""Compile the Triton kernels for real NVIDIA targets without a GPU (Triton's bundled ptxas).

The interpreter runs kernel bodies through numpy and so misses what only the compiler checks:
globals that are not constexpr, dot operand shapes and dtypes, types that change across a loop.
This script compiles every tile configuration ``plan_launch`` can pick on CUDA (head dims 64,
128 and 256; decode, lookahead verify with a tree and prefill chunks; fp16 and bf16, plus the
fp32 path), with the argument specialisations a real launch gets (unit strides as constants,
16-divisible pointers and strides), reads each kernel's register count and local memory (spills)
from its cubin with the bundled cuobjdump, and prints one line per kernel. Run it without TRITON_INTERPRET:

    python tests/kernels/compile_triton_offline.py [--all] [sm ...]      (default: 80 90)

Without ``--all`` one case of each kind (decode, verify, prefill, fp32) is compiled: what the
default test run checks; ``--all`` is the whole table (the ``slow`` test, and docs/kernels.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longctx.kernels import triton_attention as ta

TL_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def is_unit_stride(name: str) -> bool:
    """Strides along head_dim (``stride_*d``) and the lse head stride are 1 in every launch."""
    return name.startswith("stride") and name.endswith("d") or name == "stride_lh"


def compile_kernel(kernel, types: dict[str, str], constants: dict, arch: int, num_warps: int,
                   num_stages: int = 2, **options):
    """Compile as a launch would specialise: unit strides constant, the rest 16-divisible."""
    constants = dict(constants)
    constants.update({name: 1 for name in kernel.arg_names if is_unit_stride(name)})
    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in kernel.arg_names}
    aligned = [i for i, name in enumerate(kernel.arg_names)
               if name not in constants and (name.endswith("_ptr") or name.startswith("stride"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def registers_and_spills(compiled) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread: spills and stack) of a compiled
    kernel, read from its cubin with the bundled cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        done = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
                              capture_output=True, text=True, check=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", done.stdout)
    return int(usage.group(1)), int(usage.group(2)) + int(usage.group(3))


QUICK = {(torch.float16, 128, 1), (torch.bfloat16, 64, 9), (torch.bfloat16, 128, 2048),
         (torch.float32, 128, 1)}  # one of each kind, for the default test run


def attention_configs(everything: bool = True):
    """(dtype, group, head_dim, max_q_len, tree): every variant the planner can pick. Decode
    (q_len 1), lookahead verify (q_len up to 63 with a tree) and prefill chunks (2,048), for
    head dims 64, 128 and 256, in fp16 and bf16; fp32 (no tensor cores) for decode and verify.
    Group sizes follow common models (Llama-3 8B: 4; SmolLM2-135M: 3; 8)."""
    cases = []
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim, group in ((64, 3), (128, 4), (256, 8)):
            cases += [(dtype, group, head_dim, 1, False), (dtype, group, head_dim, 9, True),
                      (dtype, group, head_dim, 63, True), (dtype, group, head_dim, 2048, False)]
    cases += [(torch.float32, 4, 128, 1, False), (torch.float32, 3, 64, 9, True)]
    return [c for c in cases if everything or (c[0], c[2], c[3]) in QUICK]


def compile_attention(arch: int, everything: bool) -> None:
    for dtype, group, head_dim, max_q_len, tree in attention_configs(everything):
        plan = ta.plan_launch(num_tokens=max_q_len, num_seqs=1, num_kv_heads=2, group=group,
                              head_dim=head_dim, max_q_len=max_q_len, max_ctx_len=4096,
                              dtype=dtype, device=torch.device("cuda"), num_splits=1)
        elem = TL_NAMES[dtype]
        types = {"q_ptr": f"*{elem}", "k_ptr": f"*{elem}", "v_ptr": f"*{elem}",
                 "block_table_ptr": "*i32", "context_lens_ptr": "*i32", "cu_seqlens_ptr": "*i32",
                 "tree_ptr": "*i64" if tree else "*i32", "out_ptr": f"*{elem}",
                 "lse_ptr": "*fp32", "qk_scale": "fp32"}
        dot_dtype, precision = ta._dot_config(dtype)
        constants = dict(GROUP=group, HEAD_DIM=head_dim,
                         BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                         BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
                         PAGE_SIZE=16, HAS_TREE=tree, DOT_DTYPE=dot_dtype,
                         DOT_PRECISION=precision)
        compiled = compile_kernel(ta._paged_attention_kernel, types, constants, arch, plan.num_warps,
                                  plan.num_stages)
        regs, spills = registers_and_spills(compiled)
        print(f"sm_{arch} paged_attention {elem} G={group} D={head_dim} q_len={max_q_len} "
              f"tree={tree} BLOCK_M={plan.block_m} BLOCK_N={plan.block_n} warps={plan.num_warps} "
              f"registers={regs} local_bytes={spills}: ok")


def compile_small_kernels(arch: int) -> None:
    compile_kernel(ta._merge_splits_kernel,
                   {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                    "lse_ptr": "*fp32"}, dict(HEAD_DIM=128, BLOCK_R=16, BLOCK_D=128), arch, 4)
    compile_kernel(ta._merge_states_kernel,
                   {"out_a_ptr": "*fp16", "lse_a_ptr": "*fp32", "out_b_ptr": "*fp16",
                    "lse_b_ptr": "*fp32", "out_ptr": "*fp16", "lse_ptr": "*fp32"},
                   dict(HEAD_DIM=96, BLOCK_R=16, BLOCK_D=128), arch, 4)
    compile_kernel(ta._write_kv_kernel,
                   {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16",
                    "v_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
                   dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128), arch, 4)
    print(f"sm_{arch} merge_splits, merge_states, write_kv: ok")


def main(archs: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels being compiled")
    assert isinstance(ta._paged_attention_kernel, triton.JITFunction)
    everything = "--all" in archs
    for arch in [int(a) for a in archs if a != "--all"] or [80, 90]:
        compile_attention(arch, everything)
        compile_small_kernels(arch)


if __name__ == "__main__":
    main(sys.argv[1:])

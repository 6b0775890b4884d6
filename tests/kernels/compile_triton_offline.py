"""Compile the Triton kernels for real NVIDIA targets without a GPU (Triton's bundled ptxas).

The interpreter runs kernel bodies through numpy and so misses what only the compiler checks:
globals that are not constexpr, dot operand shapes and dtypes, types that change across a loop.
This script compiles the tile configurations ``plan_launch`` picks on CUDA, with the argument
specialisations a real launch gets (unit strides as constants, 16-divisible pointers and
strides), and prints one line per kernel. Run it without TRITON_INTERPRET:

    python tests/kernels/compile_triton_offline.py [sm ...]      (default: 80 90)
"""

from __future__ import annotations

import os
import sys

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
                   num_stages: int = 2):
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
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def attention_configs():
    """(dtype, group, head_dim, max_q_len, tree) cases: decode, verify with a tree, prefill."""
    yield torch.float16, 4, 128, 1, False
    yield torch.bfloat16, 3, 96, 7, True
    yield torch.bfloat16, 8, 128, 2048, False
    yield torch.float32, 4, 128, 1, False


def compile_attention(arch: int) -> None:
    for dtype, group, head_dim, max_q_len, tree in attention_configs():
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
        compile_kernel(ta._paged_attention_kernel, types, constants, arch, plan.num_warps,
                       plan.num_stages)
        print(f"sm_{arch} paged_attention {elem} G={group} D={head_dim} q_len={max_q_len} "
              f"tree={tree} BLOCK_M={plan.block_m} BLOCK_N={plan.block_n}: ok")


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


def main(archs: list[int]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels being compiled")
    assert isinstance(ta._paged_attention_kernel, triton.JITFunction)
    for arch in archs:
        compile_attention(arch)
        compile_small_kernels(arch)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [80, 90])

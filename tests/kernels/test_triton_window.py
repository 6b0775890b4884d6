"""Sliding windows and score caps in the Triton paged attention kernel
(``triton_attention.paged_attention(window=, softcap=)``) against
``reference.paged_attention`` with the same arguments, under the Triton interpreter on the CPU
(or on CUDA when there is one).

Tolerances: those of ``paged_cases.py`` against the reference run on the same inputs (fp32:
out and lse atol = rtol = 1e-5; fp16: out 2e-3 / 2e-3, lse atol 2e-3 rtol 1e-3), for float and
int8 pages alike (as ``test_int8_triton.py``).

Shapes are small but awkward: pages of 16 and (interpreted) key tiles of 32, so tiles straddle
pages; contexts end mid-page; batches mix decode (q_len 1), verification (q_len 5) and a 37-token
prefill chunk over a cached prefix (two query blocks). Windows: 1, below a page (5), one page
(16), across pages (23), past some sequences' contexts (70), all but the first key of the longest
context (160) and past every context (the launch then runs the plain kernel, see
``test_a_window_past_every_context_runs_the_plain_kernel``). Draft trees need a window of >= 64
in the kernel (ValueError below that). ``make_batch`` puts NaN in every slot no sequence owns,
and ``test_keys_below_the_window_are_never_read`` puts NaN in the owned keys a window skips, so
a load the window should have saved poisons the output. The interpreter misses what only the
compiler checks, so ``test_window_kernel_compiles_for_ampere_and_hopper`` also compiles the
window kernel for real targets (as test_triton_compile.py does for the others).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from paged_cases import DEVICE, LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, make_batch
from test_int8_triton import make_int8_batch

from longctx.kernels import reference

triton_attention = pytest.importorskip("longctx.kernels.triton_attention")

F32, F16 = torch.float32, torch.float16
CASES = {
    "decode": Case((1, 1, 1), (75, 161, 9), num_kv_heads=2, group=3, seed=61),
    "verify-q5": Case((5, 1), (90, 41), num_kv_heads=2, group=3, seed=62),
    "chunk": Case((37, 1), (100, 130), num_kv_heads=2, group=2, seed=63),
}
WINDOWS = [1, 5, 16, 23, 70, 160]  # 160: the window kernel for "decode" only (past the others)
# a deeper tree than TWO_BRANCH_TREE: branches of depth 1 to 6, nodes out of depth order
WIDE_TREE = [-1, 0, 1, 2, 0, 4, 0, 6, 7, 8, 9, 3, 1, 12, 5, 10]


def _check(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[dtype])


def _run(batch, window=None, softcap=None, num_splits=None, **scales):
    """(kernel out, kernel lse, reference out, reference lse)."""
    out, lse = triton_attention.launch_paged_attention(
        *batch.args(), tree_mask=batch.tree_mask, window=window, softcap=softcap,
        num_splits=num_splits, **scales)
    ref = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask, window=window,
                                    softcap=softcap, **scales)
    return out, lse, *ref


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
def test_window_matches_reference(name, window):
    _check(*_run(make_batch(CASES[name]), window), F32)


@pytest.mark.parametrize("window", [64, 90])
def test_draft_trees_under_a_window(window):
    """Trees beside a causal verify step and a decode, over contexts long enough that the
    window cuts the cached prefix (rows of depth 0 to 6 start their windows at different
    keys, inside one key tile and across two)."""
    case = Case((7, 16, 5, 1), (150, 230, 40, 120), num_kv_heads=2, group=2,
                trees=(TWO_BRANCH_TREE, WIDE_TREE, None, None), seed=64 + window)
    _check(*_run(make_batch(case), window), F32)


@pytest.mark.parametrize("window", [1, 63])
def test_draft_trees_under_a_window_below_64_are_refused(window):
    case = Case((7, 1), (150, 20), trees=(TWO_BRANCH_TREE, None), seed=65)
    batch = make_batch(case)
    with pytest.raises(ValueError, match="at least 64"):
        triton_attention.paged_attention(*batch.args(), tree_mask=batch.tree_mask,
                                         window=window)


@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("name", [*CASES, "tree"])
def test_softcap_matches_reference(name, window):
    if name == "tree":
        case = Case((7, 1), (150, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None),
                    seed=66)
        window = window and 64
    else:
        case = CASES[name]
    batch = make_batch(case)
    batch = dataclasses.replace(batch, q=batch.q * 4)  # scores up to ~30: the cap of 5 bites
    _check(*_run(batch, window, 5.0), F32)


def test_softcap_saturates_without_overflow():
    """Scores in the thousands (natural log units) capped at 30: tanh's exp form must not
    overflow, and every score sits at the cap (within fp32 rounding)."""
    batch = make_batch(CASES["verify-q5"])
    batch = dataclasses.replace(batch, q=batch.q * 500)
    _check(*_run(batch, 23, 30.0), F32)
    _check(*_run(batch, None, 30.0), F32)


def test_fp16_window_and_cap():
    case = dataclasses.replace(CASES["chunk"], dtype=F16, seed=67)
    _check(*_run(make_batch(case), 23, 5.0), F16)
    _check(*_run(make_batch(case), 5), F16)


@pytest.mark.parametrize("num_splits", [2, 7])
@pytest.mark.parametrize("window", [16, 300])
def test_forced_splits_include_empty_ones(monkeypatch, window, num_splits):
    """Splits over a long context: with a window they cut only the keys in reach (from the
    tile of the block's lowest visible position); the ones past a sequence's last key (its
    window is shorter than the span, or its context is) are empty, and stage 2 must give them
    no weight. Checks that empty partials (lse -inf) reach the merge, and the result."""
    case = Case((1, 9, 1), (700, 650, 20), num_kv_heads=2, group=2, seed=68)
    batch = make_batch(case)
    partial_lse = []
    merge = triton_attention._launch_merge_splits

    def spy(part_out, part_lse, out, lse):
        partial_lse.append(part_lse.clone())
        merge(part_out, part_lse, out, lse)

    monkeypatch.setattr(triton_attention, "_launch_merge_splits", spy)
    _check(*_run(batch, window, num_splits=num_splits), F32)
    assert len(partial_lse) == 1, "the launch should have run stage 2"
    empty = partial_lse[0] == float("-inf")  # (splits, T, H)
    assert empty.any(dim=0).all(dim=-1).any(), "no query had an empty split"


def test_window_plan_splits_the_reach_not_the_context():
    """Decode of one 128K context under a 4K window: the splits cut about window keys."""
    kwargs = dict(num_tokens=1, num_seqs=1, num_kv_heads=1, group=8, head_dim=128,
                  max_q_len=1, max_ctx_len=131072, dtype=torch.float16, device=DEVICE)
    plan = triton_attention.plan_launch(**kwargs, window=4096)
    full = triton_attention.plan_launch(**kwargs)
    assert plan.num_splits > 1
    reach = 4096 + plan.block_n - 1
    assert (plan.num_splits - 1) * plan.split_size < reach <= plan.num_splits * plan.split_size
    assert plan.split_size < full.split_size


@pytest.mark.parametrize("window", [5, 23, 70])
def test_keys_below_the_window_are_never_read(window):
    """NaN in every key and value below the first key tile a sequence's window reaches: the
    kernel must not load them (a masked NaN value would still poison P.V)."""
    case = Case((1, 5, 37, 1), (161, 90, 130, 75), num_kv_heads=2, group=2, seed=69)
    batch = make_batch(case)
    ref_out, ref_lse = reference.paged_attention(*batch.args(), window=window)
    plan = triton_attention.plan_launch(
        num_tokens=batch.q.shape[0], num_seqs=4, num_kv_heads=2, group=2, head_dim=64,
        max_q_len=37, max_ctx_len=161, dtype=F32, device=batch.q.device)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = k_cache.shape[1]
    poisoned = 0
    for b, (q_len, ctx_len) in enumerate(zip(case.q_lens, case.ctx_lens)):
        first_key = ctx_len - q_len - window + 1  # of the block's first (lowest) query
        for pos in range(max(0, first_key) // plan.block_n * plan.block_n):
            page = batch.block_table[b, pos // block_size]
            k_cache[page, pos % block_size] = float("nan")
            v_cache[page, pos % block_size] = float("nan")
            poisoned += 1
    assert poisoned >= 64
    out, lse = triton_attention.paged_attention(batch.q, k_cache, v_cache,
                                                *batch.args()[3:], window=window)
    _check(out, lse, ref_out, ref_lse, F32)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["mixed", "tree"])
def test_int8_pages_under_window_and_cap(kind, dtype):
    """int8 pages (per-page scales; pages written in pieces, see test_int8_triton.py)."""
    if kind == "tree":
        batch = make_int8_batch((7, 1), (150, 23), group=3, dtype=dtype,
                                trees=(TWO_BRANCH_TREE, None), seed=70)
        window = 64
    else:
        batch = make_int8_batch((1, 5, 37), (161, 41, 100), group=2, dtype=dtype, seed=71)
        window = 23
    _check(*_run(batch, window, 5.0, **batch.scales()), dtype)
    if dtype == F32:
        _check(*_run(batch, window, None, **batch.scales()), dtype)


def test_int8_pages_with_forced_splits():
    batch = make_int8_batch((1, 9, 1), (300, 250, 20), group=2, seed=72)
    _check(*_run(batch, 40, 5.0, num_splits=3, **batch.scales()), F32)


def test_window_and_cap_change_the_answer():
    """The comparisons above can fail: a window of 23, a cap of 0.5 and neither differ."""
    batch = make_batch(CASES["verify-q5"])
    full, _ = triton_attention.paged_attention(*batch.args())
    windowed, _ = triton_attention.paged_attention(*batch.args(), window=23)
    capped, _ = triton_attention.paged_attention(*batch.args(), softcap=0.5)
    assert not torch.allclose(windowed, full, **OUT_TOL[F32])
    assert not torch.allclose(capped, full, **OUT_TOL[F32])


def test_a_window_past_every_context_runs_the_plain_kernel(monkeypatch):
    """A window of at least the longest context hides nothing: the launch drops it."""
    batch = make_batch(CASES["decode"])
    expected, expected_lse = triton_attention.paged_attention(*batch.args())
    _check(expected, expected_lse, *reference.paged_attention(*batch.args(), window=1000), F32)

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the window kernel ran")

    monkeypatch.setattr(triton_attention, "_paged_attention_window_kernel", Refuse())
    out, lse = triton_attention.paged_attention(*batch.args(), window=161)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="window kernel"):
        triton_attention.paged_attention(*batch.args(), window=160)


@pytest.mark.parametrize("window,softcap", [(0, None), (-3, None), (2.5, None), (True, None),
                                            (None, 0.0), (None, -1.0), (None, float("nan")),
                                            (None, True)])
def test_bad_window_or_cap_is_refused(window, softcap):
    batch = make_batch(CASES["decode"])
    with pytest.raises(ValueError, match="window|softcap"):
        triton_attention.paged_attention(*batch.args(), window=window, softcap=softcap)


COMPILE_SCRIPT = textwrap.dedent("""
    import torch, triton
    from compile_triton_offline import compile_kernel, registers_and_spills
    from longctx.kernels import triton_attention as ta
    # (arch, int8 pages, tree, head dim, q_len, group): fp16 decode with float pages on Ampere,
    # a lookahead verify step with a tree over int8 pages on Hopper; both with window and cap
    for arch, int8, tree, head_dim, q_len, group in ((80, False, False, 128, 1, 4),
                                                     (90, True, True, 64, 9, 3)):
        plan = ta.plan_launch(num_tokens=q_len, num_seqs=1, num_kv_heads=2, group=group,
                              head_dim=head_dim, max_q_len=q_len, max_ctx_len=4096,
                              dtype=torch.float16, device=torch.device("cuda"), num_splits=1,
                              window=1024)
        kv, scales = ("i8", "*fp32") if int8 else ("fp16", "*fp16")
        types = {"q_ptr": "*fp16", "k_ptr": "*" + kv, "v_ptr": "*" + kv, "block_table_ptr": "*i32",
                 "context_lens_ptr": "*i32", "cu_seqlens_ptr": "*i32",
                 "tree_ptr": "*i64" if tree else "*i32", "out_ptr": "*fp16", "lse_ptr": "*fp32",
                 "k_scale_ptr": scales, "v_scale_ptr": scales, "qk_scale": "fp32",
                 "softcap": "fp32"}
        dot_dtype, precision = ta._dot_config(torch.float16)
        constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=plan.block_m,
                         BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, PAGE_SIZE=16, HAS_TREE=tree,
                         DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, INT8_KV=int8,
                         HAS_WINDOW=True, HAS_SOFTCAP=True)
        compiled = compile_kernel(ta._paged_attention_window_kernel, types, constants, arch,
                                  plan.num_warps, plan.num_stages)
        regs, spills = registers_and_spills(compiled)
        print(f"sm_{arch} int8={int8} tree={tree} registers={regs} local_bytes={spills}: ok")
""")


def test_window_kernel_compiles_for_ampere_and_hopper():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no NVIDIA ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if line.endswith(": ok")]
    assert len(compiled) == 2, done.stdout

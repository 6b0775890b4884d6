"""The C kernels as torch operators (``torch.ops.longctx.*``): a step's varlen batch in one call
against the reference, only the chosen sequences' rows written, the thread count taken from the
caller, bad metadata refused before anything is read or written, fake implementations that let
``torch.compile`` trace through them, and the profiler seeing them by name."""

from __future__ import annotations

import threading

import pytest
import torch
from paged_cases import LSE_TOL, OUT_TOL, TWO_BRANCH_TREE, Case, make_batch

from longctx.kernels import cpu_build, cpu_decode, cpu_flash, cpu_linear, reference, torch_paged

needs_kernels = pytest.mark.skipif(not (cpu_decode.available() and cpu_flash.available()),
                                   reason=f"kernels {cpu_decode.status()} / {cpu_flash.status()}")

# decode-sized (1, 3, 5 new tokens) and flash-sized (40, 9 x group 3) sequences in one step
MIXED = Case((1, 40, 3, 9, 5), (97, 140, 33, 300, 5), num_kv_heads=3, group=3, block_size=7, seed=21)


def _ones_like_batch(batch):
    return (torch.full(batch.q.shape, 7.0), torch.full(batch.q.shape[:2], 7.0))


def _seqs(*ids):
    return torch.tensor(ids, dtype=torch.int32)


@pytest.fixture(scope="module")
def mixed():
    batch = make_batch(MIXED)
    ref = reference.paged_attention(*batch.args())
    return batch, ref


def test_every_kernel_is_an_operator():
    for name in ("paged_decode", "paged_flash", "linear_rows", "rope_", "int8_write_kv", "write_kv", "swiglu_rows",
                 "rms_rows"):
        op = getattr(torch.ops.longctx, name).default
        assert isinstance(op, torch._ops.OpOverload), name
    schema = str(torch.ops.longctx.paged_decode.default._schema)
    assert "int num_threads" in schema and "Tensor(a!) out" in schema


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_varlen_batch_in_one_call_matches_reference(mixed, threads):
    """The decode kernel takes sequences 0, 2, 4 and the flash kernel 1, 3, each in one call;
    together they give the reference's out and lse for the whole step."""
    batch, (ref_out, ref_lse) = mixed
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    out, lse = _ones_like_batch(batch)
    scale = batch.q.shape[-1] ** -0.5
    cpu_decode.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0, 2, 4), scale,
                            out=out, lse=lse, num_threads=threads)
    flash = _seqs(1, 3)
    splits = torch.tensor([1, 3], dtype=torch.int32)  # one sequence merges splits, one does not
    cpu_flash.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, flash, scale, out=out, lse=lse,
                           splits=splits, num_threads=threads)
    torch.testing.assert_close(out, ref_out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[torch.float32])


@needs_kernels
def test_only_the_chosen_sequences_rows_are_written(mixed):
    batch, (ref_out, _) = mixed
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    out, lse = _ones_like_batch(batch)
    cpu_decode.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(2), 0.125, out=out, lse=lse)
    cu = batch.cu_seqlens_q.tolist()
    mine = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    mine[cu[2]:cu[3]] = True
    assert (out[~mine] == 7.0).all() and (lse[~mine] == 7.0).all()
    assert not (out[mine] == 7.0).any()


@needs_kernels
def test_tree_words_per_row_of_the_step():
    """Words index the step's rows: a tree sequence and a causal one in one call each."""
    case = Case((7, 5), (70, 20), num_kv_heads=2, group=3, trees=(TWO_BRANCH_TREE, None), seed=22)
    batch = make_batch(case)
    ref_out, ref_lse = reference.paged_attention(*batch.args(), tree_mask=batch.tree_mask)
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    for kernel, extra in ((cpu_decode, {}), (cpu_flash, {"splits": torch.tensor([2, 1], dtype=torch.int32)})):
        out, lse = _ones_like_batch(batch)
        kernel.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0, 1), 64 ** -0.5,
                            batch.tree_mask, out=out, lse=lse, **extra)
        torch.testing.assert_close(out, ref_out, **OUT_TOL[torch.float32])
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL[torch.float32])


@needs_kernels
def test_thread_count_comes_from_the_caller_not_openmp():
    """A fresh Python thread has OpenMP's default count, not torch's; the kernels use what the
    caller passes, and the result does not depend on it (each item's arithmetic is fixed)."""
    batch = make_batch(MIXED)
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    results = {}

    def run(threads, key):
        out, lse = _ones_like_batch(batch)
        cpu_decode.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0, 2, 4), 0.1,
                                out=out, lse=lse, num_threads=threads)
        results[key] = out

    run(1, "main-1")
    worker = threading.Thread(target=run, args=(2, "worker-2"))
    worker.start()
    worker.join()
    torch.testing.assert_close(results["main-1"], results["worker-2"], rtol=0, atol=0)
    out, lse = _ones_like_batch(batch)
    with pytest.raises(ValueError, match="code -3"):
        cpu_decode.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0), 0.1, out=out, lse=lse,
                                num_threads=0)


@needs_kernels
@pytest.mark.parametrize("kernel", ["decode", "flash"])
def test_bad_metadata_is_refused_and_nothing_written(kernel):
    batch = make_batch(MIXED)
    nb = batch.k_cache.shape[0]
    mod = cpu_decode if kernel == "decode" else cpu_flash
    extra = {} if kernel == "decode" else {"splits": torch.tensor([1], dtype=torch.int32)}
    cases = {
        "block id past the cache": lambda t: t.block_table.__setitem__((0, 0), nb),
        "negative block id": lambda t: t.block_table.__setitem__((0, 1), -1),
        "query rows past q": lambda t: t.cu_q.__setitem__(1, batch.q.shape[0] + 1),
        "context longer than the table row": lambda t: t.ctx_lens.__setitem__(0, 7 * t.block_table.shape[1] + 1),
    }
    for what, spoil in cases.items():
        tables = cpu_decode.batch_tables(batch.block_table.clone(), batch.context_lens.clone(),
                                         batch.cu_seqlens_q.clone())
        spoil(tables)
        out, lse = _ones_like_batch(batch)
        with pytest.raises(ValueError, match="code -5|code -3"):
            mod.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0), 0.1, out=out, lse=lse, **extra)
        assert (out == 7.0).all() and (lse == 7.0).all(), what
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    out, lse = _ones_like_batch(batch)
    with pytest.raises(ValueError, match="code -5"):  # a sequence index past the table
        mod.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(5), 0.1, out=out, lse=lse, **extra)
    with pytest.raises(ValueError, match="seqs must be a contiguous torch.int32"):
        mod.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, torch.tensor([0]), 0.1, out=out,
                         lse=lse, **extra)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        mod.attend_batch(batch.q, batch.k_cache, batch.v_cache, tables, _seqs(0), 0.1, out=out[:-1],
                         lse=lse, **extra)


@needs_kernels
def test_torch_compile_traces_through_the_operators(mixed):
    """The fake implementations let torch.compile capture paged_attention's kernel calls in one
    graph (fullgraph: no break at the C calls); the compiled function gives eager's result."""
    batch, (ref_out, _) = mixed
    tables = cpu_decode.batch_tables(batch.block_table, batch.context_lens, batch.cu_seqlens_q)
    decode, flash, splits = _seqs(0, 2, 4), _seqs(1, 3), torch.tensor([1, 2], dtype=torch.int32)

    def step(q, k_cache, v_cache):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2])
        torch.ops.longctx.paged_decode(q, k_cache, v_cache, None, None, tables.block_table, tables.ctx_lens,
                                       tables.cu_q, decode, None, 0.125, 512, 2, out, lse)
        torch.ops.longctx.paged_flash(q, k_cache, v_cache, None, None, tables.block_table, tables.ctx_lens,
                                      tables.cu_q, flash, splits, None, 0.125, 2, out, lse)
        return out * 2.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got_out, got_lse = compiled(batch.q, batch.k_cache, batch.v_cache)
    want_out, want_lse = step(batch.q, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    torch.testing.assert_close(want_out / 2.0, ref_out, **OUT_TOL[torch.float32])


@needs_kernels
def test_fake_tensors_pass_through():
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = make_batch(MIXED)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        q = mode.from_tensor(batch.q)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        torch.ops.longctx.paged_decode(q, batch.k_cache, batch.v_cache, None, None, batch.block_table,
                                       batch.context_lens, batch.cu_seqlens_q, _seqs(0), None, 0.1, 512, 1,
                                       out, lse)
        x, w = torch.empty(3, 16), torch.empty(8, 16)
        y = torch.empty(3, 8)
        torch.ops.longctx.linear_rows(x, w, None, None, 1e-6, False, None, 1, y)
        assert y.shape == (3, 8)


@needs_kernels
def test_profiler_sees_the_operators_by_name():
    if not cpu_build.vectorized():
        pytest.skip("without the kernels' vector paths the engine keeps the torch forms (cpu_build.vectorized)")
    batch = make_batch(MIXED)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch_paged.paged_attention(*batch.args())
    names = {e.name for e in prof.events()}
    assert {"longctx::paged_decode", "longctx::paged_flash"} <= names, sorted(n for n in names if "longctx" in n)


@pytest.mark.skipif(not cpu_linear.available(), reason=f"kernel {cpu_linear.status()}")
def test_linear_operator_threads_and_checks():
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(5, 48, generator=gen), torch.randn(40, 48, generator=gen), torch.randn(40, generator=gen)
    want = torch.nn.functional.linear(x, w, b)
    for threads in (1, 2, 5):
        torch.testing.assert_close(cpu_linear.linear(x, w, b, num_threads=threads), want, rtol=1e-5, atol=1e-5)
    out = torch.empty(5, 40)
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        torch.ops.longctx.linear_rows(x, w, b, None, 1e-6, False, None, 0, out)
    with pytest.raises(ValueError, match="x needs contiguous rows"):  # the operator checks, not only linear()
        torch.ops.longctx.linear_rows(x.t().contiguous().t(), w, b, None, 1e-6, False, None, 1, out)

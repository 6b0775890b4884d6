"""The exact tail of int8 pages (longctx/kv/exact_tail.py): through the runner's own step
preparation and the attention backend, every query sees the keys of its own page (by position,
the ones it can see) as the model computed them and every other key as its int8 page holds it.

The reference attends in float64 over, per query, its visible keys: the exact row where the
key's position lies in the query's page, else the int8 row read back from the pages after the
step's writes (turned back by the rotation the pages are stored under). Sequences go through
prefill chunks that start and end inside pages, decode steps across page boundaries, lookahead
verify steps with a draft tree (accepted branches moved, rejected drafts that reached into the
next page), several sequences per step and GQA ratios 1, 3 and 8.

Tolerance: atol 2e-5 (float32 against float64; the exchange subtracts the int8 rows' share of
the softmax sum, ~1e-7 of it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longctx.attention import PagedAttentionBackend
from longctx.kernels import kv_quant, reference, torch_paged
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv import exact_tail
from longctx.kv.exact_tail import TailStore
from longctx.kv.formats import FloatPages, Int8Pages
from longctx.lookahead.tree import tree_ancestor_words, tree_depths
from longctx.engine.runner import ModelRunner
from longctx.engine.outputs import DraftMove, ScheduledSeq, SchedulerOutput

BS, D, TOL = 8, 16, 2e-5


class Seq:
    """One sequence's state in the test: its pages, its exact rows by position."""

    def __init__(self, rid: str, slot: int, blocks: list[int]) -> None:
        self.rid, self.slot, self.blocks, self.pos = rid, slot, blocks, 0
        self.exact_k: dict[int, torch.Tensor] = {}
        self.exact_v: dict[int, torch.Tensor] = {}


def make(hq: int, hkv: int, kernels=torch_paged):
    cfg = SimpleNamespace(num_key_value_heads=hkv, head_dim=D, num_hidden_layers=1, vocab_size=11)
    pool = DeviceKVPool(Int8Pages(cfg, torch.float32), 40, BS, "cpu", tail_slots=2)
    backend = PagedAttentionBackend(D, kernels, "test")
    runner = ModelRunner(SimpleNamespace(config=cfg), pool, backend, torch.device("cpu"))
    return pool, backend, runner


def run_step(pool, backend, runner, work, gen, hq, hkv):
    """``work``: [(Seq, new tokens, draft parents or ())]. Runs one step; checks every query."""
    assert all(not parents or n == 1 + len(parents) for _, n, parents in work)
    seqs = [ScheduledSeq(s.rid, [0] * n, s.pos, s.blocks, True, tuple(parents), tail_slot=s.slot)
            for s, n, parents in work]
    _, _, meta, _ = runner.prepare(SchedulerOutput(seqs))
    t = sum(n for _, n, _ in work)
    q = torch.randn(t, hq, D, generator=gen)
    k = torch.randn(t, hkv, D, generator=gen) * 2 + 0.5
    v = torch.randn(t, hkv, D, generator=gen)
    out = backend.run(0, q, k, v, backend.plan(meta))
    rot = kv_quant.rotation(D) if pool.format.rotate else torch.eye(D)
    k_cache, v_cache, ks, vs = pool.caches[0]
    row = 0
    for s, n, parents in work:
        for i in range(n):  # the step's rows are exact at their memory positions
            s.exact_k[s.pos + i], s.exact_v[s.pos + i] = k[row + i], v[row + i]
        depths = tree_depths(list(parents)) if parents else list(range(n))
        words = tree_ancestor_words(list(parents)) if parents else [(1 << (i + 1)) - 1 for i in range(n)]
        for i in range(n):
            where = s.pos + depths[i]  # the query's position
            page0 = where // BS * BS
            keys = [(p, p) for p in range(s.pos)] + [(s.pos + j, s.pos + depths[j]) for j in range(n)
                                                     if words[i] >> j & 1]
            rows_k, rows_v = [], []
            for mem, p in keys:
                if p >= page0 or p < BS:  # its own page, and the first page
                    rows_k.append(s.exact_k[mem])
                    rows_v.append(s.exact_v[mem])
                else:
                    slot = torch.tensor([s.blocks[mem // BS] * BS + mem % BS])
                    rows_k.append(kv_quant.dequantize_rows(k_cache, ks, slot)[0] @ rot.T)
                    rows_v.append(kv_quant.dequantize_rows(v_cache, vs, slot)[0] @ rot.T)
            kk = torch.stack(rows_k).double().repeat_interleave(hq // hkv, 1)
            vv = torch.stack(rows_v).double().repeat_interleave(hq // hkv, 1)
            p = torch.softmax(torch.einsum("hd,mhd->hm", q[row + i].double(), kk) * backend.scale, -1)
            want = torch.einsum("hm,mhd->hd", p, vv)
            err = (out[row + i].double() - want).abs().max().item()
            assert err < TOL, f"{s.rid} query {i} of {n} at position {where}: off by {err}"
        row += n
    return out


@pytest.mark.parametrize("c_kernel", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (6, 2), (8, 1)])
def test_each_query_sees_its_own_page_exact(hq, hkv, c_kernel, monkeypatch):
    """Through the CPU's C kernel (``tail_exchange``) and the torch form (CUDA's, and the CPU's
    without a compiler)."""
    if c_kernel:
        assert exact_tail._c_kernel() is not None, "the C kernels do not build here"
    else:
        monkeypatch.setattr(exact_tail, "_c_kernel", lambda: None)
    gen = torch.Generator().manual_seed(hq + 7 * hkv)
    pool, backend, runner = make(hq, hkv)
    a = Seq("a", 0, [5, 2, 9, 30, 11, 7, 3])
    b = Seq("b", 3, [20, 21, 4, 14, 15])  # a slot past the store's first two: it grows
    for work in ([(a, 13, ()), (b, 3, ())],  # chunks ending inside pages
                 [(a, 9, ()), (b, 21, ())],  # b: a chunk over three pages
                 [(a, 1, ()), (b, 1, ())],  # decodes
                 [(a, 1, ())]):
        run_step(pool, backend, runner, work, gen, hq, hkv)
        for s, n, _ in work:
            s.pos += n
    assert (a.pos, b.pos) == (24, 25)
    # a verify step whose drafts reach into the next page: a tree of 6 nodes
    parents = (-1, 0, 0, 1, 3, 2)
    run_step(pool, backend, runner, [(a, 7, parents), (b, 1, ())], gen, hq, hkv)
    b.pos += 1
    accepted = [0, 1, 3]  # the branch 0 -> 1 -> 3 (node 3 sits at memory position pos + 4)
    runner.move_draft_kv(DraftMove(a.blocks, a.pos, accepted, a.slot))
    for j, node in enumerate(accepted):
        a.exact_k[a.pos + 1 + j] = a.exact_k[a.pos + 1 + node]
        a.exact_v[a.pos + 1 + j] = a.exact_v[a.pos + 1 + node]
    a.pos += 1 + len(accepted)
    run_step(pool, backend, runner, [(a, 1, ()), (b, 5, ())], gen, hq, hkv)
    a.pos += 1
    b.pos += 5
    assert a.pos == 29
    run_step(pool, backend, runner, [(a, 8, ())], gen, hq, hkv)  # 29 .. 36
    a.pos += 8
    # drafts that reach into the next page (root 37, nodes 38 .. 42; page 5 starts at 40),
    # all rejected: page 4's rows must still be there for the next queries
    run_step(pool, backend, runner, [(a, 6, (-1, 0, 1, 2, 3))], gen, hq, hkv)
    a.pos += 1
    run_step(pool, backend, runner, [(a, 1, ())], gen, hq, hkv)  # 38
    a.pos += 1
    run_step(pool, backend, runner, [(a, 3, ()), (b, 2, ())], gen, hq, hkv)  # 39 .. 41


def test_the_int8_error_without_the_tail_would_fail_the_check():
    """The check above can fail: with the store's rows ignored (every key as int8), the
    reference's exact own-page rows differ by more than the tolerance."""
    gen = torch.Generator().manual_seed(3)
    pool, backend, runner = make(6, 2)
    a = Seq("a", 0, [5, 2, 9])
    run_step(pool, backend, runner, [(a, 11, ())], gen, 6, 2)
    a.pos = 11
    original = PagedAttentionBackend.run

    def without_tail(self, layer, q, k, v, plan):
        plan.meta.tail = None
        return original(self, layer, q, k, v, plan)

    PagedAttentionBackend.run = without_tail
    try:
        with pytest.raises(AssertionError, match="off by"):
            run_step(pool, backend, runner, [(a, 1, ())], gen, 6, 2)
    finally:
        PagedAttentionBackend.run = original


def test_the_budget_the_engine_takes_off_on_cuda_is_the_stores_size():
    """On CUDA the profiled KV budget loses what the store of ``max_num_seqs`` slots takes."""
    cfg = SimpleNamespace(num_key_value_heads=3, head_dim=D, num_hidden_layers=4)
    for dtype in (torch.float32, torch.bfloat16):
        store = TailStore(4, 6, BS, 3, D, dtype, "cpu")
        assert Int8Pages(cfg, dtype).tail_bytes(6, BS) == store.nbytes
    assert Int8Pages(cfg, torch.float32, exact_tail=False).tail_bytes(6, BS) == 0


def test_a_bf16_model_on_the_cpu_keeps_float32_rows():
    """The CPU computes a bf16 model in float32 and the C exchange reads float32: the store is
    float32 there whatever the model's dtype (an int8 pool only)."""
    cfg = SimpleNamespace(num_key_value_heads=2, head_dim=D, num_hidden_layers=1)
    pool = DeviceKVPool(Int8Pages(cfg, torch.bfloat16), 4, BS, "cpu")
    assert pool.tail.layers[0][0].dtype == torch.float32
    assert DeviceKVPool(FloatPages(cfg, torch.bfloat16), 4, BS, "cpu").tail is None


def test_the_store_grows_and_keeps_its_rows():
    store = TailStore(2, 1, BS, 2, D, torch.float32, "cpu")
    store.layers[1][0][store.row(0, 13)] = 4.0
    store.reserve(5)
    assert store.num_slots == 5
    assert bool((store.layers[1][0][store.row(0, 13)] == 4.0).all())
    assert bool((store.layers[0][1][0] == 0).all())  # row 0: what absent keys read
    assert store.layers[0][0].shape[0] == 1 + 6 * 3 * BS
    # each slot: its first page and two more, no row shared (positions 0-7 never share with 16-23)
    assert len({store.row(s, p) for s in range(-1, 5) for p in range(3 * BS)}) == 6 * 3 * BS


@pytest.mark.parametrize("which", ["reference", "triton"])
def test_other_kernel_modules_agree(which):
    """The same through the reference kernels and the Triton kernels (the CUDA path; here under
    the interpreter, float32): prefill chunk, a verify step with drafts, a decode."""
    if which == "triton":
        kernels = pytest.importorskip("longctx.kernels.triton_attention")
    else:
        kernels = reference
    gen = torch.Generator().manual_seed(5)
    pool, backend, runner = make(6, 2, kernels)
    a = Seq("a", 1, [3, 1, 4, 6])
    run_step(pool, backend, runner, [(a, 19, ())], gen, 6, 2)
    a.pos = 19
    run_step(pool, backend, runner, [(a, 4, (-1, 0, 0))], gen, 6, 2)
    a.pos = 20
    run_step(pool, backend, runner, [(a, 1, ())], gen, 6, 2)


def test_the_c_tail_call_refuses_what_it_does_not_take():
    """``cpu_decode.tail_exchange`` (the operator) and the per-layer call the step uses: a
    step tensor of the wrong dtype, a layer tensor that is not contiguous float32, q with
    another row count and a malformed scale are each refused with a ValueError naming it, and
    nothing is written."""
    from longctx.kernels import cpu_decode

    if exact_tail._c_kernel() is None:
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(3)
    pool, backend, runner = make(6, 2)
    a = Seq("a", 0, [5, 2, 9, 30])
    run_step(pool, backend, runner, [(a, 11, ())], gen, 6, 2)
    seqs = [ScheduledSeq("a", [0], 11, a.blocks, True, (), tail_slot=0)]
    _, _, meta, _ = runner.prepare(SchedulerOutput(seqs))
    tail = meta.tail
    tail.ready()
    q, k, v = torch.randn(1, 6, D), torch.randn(1, 2, D), torch.randn(1, 2, D)
    out, lse = torch.randn(1, 6, D), torch.randn(1, 6)
    kc, vc, ks, vs = pool.caches[0]
    sk, sv = pool.tail.layers[0]
    steps = [tail.pool_slots, tail.store_rows, tail.new_rows, tail.cached, tail.q_rows, tail.visible, tail.src,
             tail.dst, tail.write_rows]
    args = [q, out, lse, kc, vc, ks, vs, None, None, sk, sv, k, v, *steps, tail.num_groups, tail.qw, tail.kw, 0.25, 1]
    before = (out.clone(), lse.clone(), sk.clone())
    bad = {13: tail.pool_slots.int(), 0: torch.randn(1, 6, 2 * D)[..., ::2], 11: torch.randn(2, 2, D),
           5: ks[:, :1]}
    for at, value in bad.items():
        wrong = list(args)
        wrong[at] = value
        with pytest.raises(ValueError, match="pool_slots|must be a contiguous float32|rows|k_scale"):
            cpu_decode.tail_exchange(*wrong)
    step = cpu_decode.tail_step_args(*steps, tail.num_groups, tail.qw, tail.kw, 1)
    with pytest.raises(ValueError, match="must be a contiguous float32"):
        cpu_decode.tail_exchange_layer(step, q, out, lse, kc, vc, ks, vs, None, None, sk, sv, k.double(), v, 0.25, 1)
    # (the store's untouched rows are uninitialised memory, NaN at times: compared bit for bit)
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])
    assert torch.equal(sk.view(torch.int32), before[2].view(torch.int32))
    cpu_decode.tail_exchange(*args)  # the same call, well formed, runs and writes
    assert not torch.equal(out, before[0])

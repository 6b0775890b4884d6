"""Scheduler: chunked prefill under the token budget, decodes first, admission limits, preemption
and recompute, request checks, and page accounting. Exact ids and orders throughout.

The tests drive the engine's loop by hand: ``schedule()``, ``advance(batch)``, append a fake
sampled token for every seq with ``sample=True``, then ``finish(req, "length")`` for requests
that reached ``max_tokens``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx.cache.block_pool import BlockPool
from longctx.config import SchedulerConfig
from longctx.sampling_params import SamplingParams
from longctx.engine.outputs import RunnerOutput, SampledSeq, ScheduledSeq, SchedulerOutput
from longctx.engine.scheduler import Request, RequestStatus, RequestTooLongError, Scheduler, chunk_cost, tokens_for_cost


def make_scheduler(budget: int, num_blocks: int, block_size: int, max_model_len: int = 64,
                   max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    return Scheduler(config, BlockPool(num_blocks), block_size, max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int, base: int = 0) -> Request:
    prompt = list(range(base, base + prompt_len))
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def fake_token(req: Request) -> int:
    """A token that tells outputs apart from prompt ids and from each other."""
    return 10_000 + len(req.output_token_ids)


def finish_step(sched: Scheduler, batch: SchedulerOutput) -> list[str]:
    """The rest of a step: a runner that samples ``fake_token``s, then ``update``; returns the
    ids finished by it."""
    sampled = {s.request_id: SampledSeq([fake_token(sched.requests[s.request_id])])
               for s in batch.seqs if s.sample}
    return [u.request_id for u in sched.update(batch, RunnerOutput(sampled)) if u.finish_reason]


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    batch = sched.schedule()
    return batch, finish_step(sched, batch)


def summary(batch: SchedulerOutput) -> list[tuple[str, int, int, list[int], bool]]:
    """(id, start_pos, number of tokens, block ids, sample) per seq, in batch order."""
    return [(s.request_id, s.start_pos, len(s.token_ids), s.block_ids, s.sample)
            for s in batch.seqs]


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> int:
    for num_steps in range(1, max_steps + 1):
        batch, _ = step(sched)
        assert batch.seqs, "a step scheduled nothing while requests were unfinished"
        if not sched.has_unfinished():
            return num_steps
    raise AssertionError(f"not finished after {max_steps} steps")


# ---------------------------------------------------------------------------- no torch


def test_scheduler_module_does_not_import_torch():
    code = "import sys, longctx.engine.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------- plain data


def test_request_counts_and_token_slice():
    req = make_request("r", 4, 8, base=100)
    assert (req.num_tokens, req.num_pending, req.status) == (4, 4, RequestStatus.WAITING)
    req.output_token_ids += [7, 8]
    req.num_computed_tokens = 3
    assert (req.num_tokens, req.num_pending) == (6, 3)
    assert req.token_slice(0, 4) == [100, 101, 102, 103]
    assert req.token_slice(1, 3) == [101, 102]
    assert req.token_slice(3, 6) == [103, 7, 8]
    assert req.token_slice(4, 6) == [7, 8]
    assert req.token_slice(5, 6) == [8]


def test_batch_num_tokens_sums_seqs():
    batch = SchedulerOutput(seqs=[ScheduledSeq("a", [1, 2, 3], 0, [0], False),
                                 ScheduledSeq("b", [4], 7, [1, 2], True)], preempted=[])
    assert batch.num_tokens == 4
    assert SchedulerOutput(seqs=[], preempted=["x"]).num_tokens == 0


def test_blocks_for_rounds_up():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    assert [sched.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


# ---------------------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked_under_the_budget():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    sched.add(make_request("a", 20, 2, base=100))

    b1, done = step(sched)
    assert summary(b1) == [("a", 0, 8, [0, 1], False)]
    assert b1.seqs[0].token_ids == list(range(100, 108))
    assert (b1.preempted, done, b1.num_tokens) == ([], [], 8)

    b2, done = step(sched)
    assert summary(b2) == [("a", 8, 8, [0, 1, 2, 3], False)]
    assert b2.seqs[0].token_ids == list(range(108, 116))
    assert done == []

    b3, done = step(sched)
    assert summary(b3) == [("a", 16, 4, [0, 1, 2, 3, 4], True)]
    assert b3.seqs[0].token_ids == list(range(116, 120))
    assert done == []
    req = sched.requests["a"]
    assert (req.num_computed_tokens, req.output_token_ids) == (20, [10_000])

    b4, done = step(sched)
    assert summary(b4) == [("a", 20, 1, [0, 1, 2, 3, 4, 5], True)]
    assert b4.seqs[0].token_ids == [10_000]
    assert done == ["a"]
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
    assert req.output_token_ids == [10_000, 10_001]
    assert sched.pool.num_free == 8
    assert not sched.has_unfinished()
    assert sched.requests == {}


def test_sample_only_on_the_chunk_reaching_the_end():
    sched = make_scheduler(budget=5, num_blocks=16, block_size=2)
    sched.add(make_request("a", 12, 3))
    samples = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        samples.append([(s.start_pos, len(s.token_ids), s.sample) for s in batch.seqs])
    assert samples == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)],
                       [(12, 1, True)], [(13, 1, True)]]


def test_prompt_exactly_the_budget_samples_in_one_step():
    sched = make_scheduler(budget=8, num_blocks=4, block_size=4)
    sched.add(make_request("a", 8, 1))
    batch, done = step(sched)
    assert summary(batch) == [("a", 0, 8, [0, 1], True)]
    assert done == ["a"]
    assert sched.pool.num_free == 4


def test_leftover_budget_goes_to_the_next_waiting_request():
    sched = make_scheduler(budget=10, num_blocks=16, block_size=4)
    sched.add(make_request("a", 6, 2, base=0))
    sched.add(make_request("b", 7, 2, base=50))
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 6, [0, 1], True), ("b", 0, 4, [2], False)]
    assert batch.seqs[1].token_ids == [50, 51, 52, 53]
    batch, _ = step(sched)
    # a decodes (1 pending) before b's remaining 3 prompt tokens.
    assert summary(batch) == [("a", 6, 1, [0, 1], True), ("b", 4, 3, [2, 3], True)]
    assert batch.num_tokens == 4


# ---------------------------------------------------------------------------- ordering and limits


def test_decodes_are_scheduled_before_a_partial_prefill():
    sched = make_scheduler(budget=8, num_blocks=16, block_size=4)
    sched.add(make_request("d", 2, 5, base=0))
    sched.add(make_request("p", 20, 1, base=100))

    b1, _ = step(sched)
    assert summary(b1) == [("d", 0, 2, [0], True), ("p", 0, 6, [1, 2], False)]
    b2, _ = step(sched)
    assert summary(b2) == [("d", 2, 1, [0], True), ("p", 6, 7, [1, 2, 3, 4], False)]
    b3, _ = step(sched)
    assert summary(b3) == [("d", 3, 1, [0], True), ("p", 13, 7, [1, 2, 3, 4, 5], True)]
    assert b3.seqs[1].token_ids == list(range(113, 120))


def test_a_decode_goes_before_an_older_request_with_more_pending_tokens():
    # Fewest pending first, arrival order only breaks ties: the newer b (1 pending) runs before
    # the older a (3 pending), and a is cut to the budget left.
    sched = make_scheduler(budget=3, num_blocks=16, block_size=1)
    a, b = make_request("a", 2, 9, base=0), make_request("b", 1, 9, base=50)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 2, [0, 1], True), ("b", 0, 1, [2], True)]
    a.output_token_ids += [77, 78]  # a now has 3 tokens to compute, b has 1
    batch = sched.schedule()
    assert summary(batch) == [("b", 1, 1, [2, 3], True), ("a", 2, 2, [0, 1, 4, 5], False)]


def test_equal_pending_runs_in_arrival_order():
    sched = make_scheduler(budget=16, num_blocks=16, block_size=2)
    for rid in ("x", "y", "z"):
        sched.add(make_request(rid, 3, 4))
    batch, _ = step(sched)
    assert [s.request_id for s in batch.seqs] == ["x", "y", "z"]
    batch, _ = step(sched)
    assert summary(batch) == [("x", 3, 1, [0, 1], True), ("y", 3, 1, [2, 3], True),
                              ("z", 3, 1, [4, 5], True)]


def test_budget_exhausted_by_running_requests_admits_nobody():
    sched = make_scheduler(budget=4, num_blocks=16, block_size=4)
    sched.add(make_request("a", 9, 1))
    sched.add(make_request("b", 5, 1))  # longer than the budget: waits its turn
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 4, [0], False)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    batch, _ = step(sched)
    assert summary(batch) == [("a", 4, 4, [0, 1], False)]
    batch, _ = step(sched)
    assert summary(batch) == [("a", 8, 1, [0, 1, 2], True), ("b", 0, 3, [3], False)]


def test_a_prefill_beside_other_requests_tokens_takes_small_chunks():
    config = SchedulerConfig(max_num_batched_tokens=16, busy_prefill_chunk=4)
    sched = Scheduler(config, BlockPool(64), 4, 128)
    sched.add(make_request("doc", 40, 1))
    batch, _ = step(sched)
    assert summary(batch) == [("doc", 0, 16, [0, 1, 2, 3], False)]  # alone: whole chunks
    sched.add(make_request("q", 2, 3, base=500))
    batch, _ = step(sched)  # q's first token: the document's chunk shrinks to 4
    assert summary(batch) == [("q", 0, 2, [4], True), ("doc", 16, 4, [0, 1, 2, 3, 5], False)]
    batch, _ = step(sched)  # q decodes: still 4
    assert summary(batch) == [("q", 2, 1, [4], True), ("doc", 20, 4, [0, 1, 2, 3, 5, 6], False)]
    batch, _ = step(sched)  # q's last token; 16 pending would fit the budget q leaves 15 of
    assert summary(batch) == [("q", 3, 1, [4], True), ("doc", 24, 4, [0, 1, 2, 3, 5, 6, 7], False)]
    batch, _ = step(sched)  # alone again, and q's page is free for reuse
    assert summary(batch) == [("doc", 28, 12, [0, 1, 2, 3, 5, 6, 7, 4, 8, 9], True)]


def test_short_prompt_goes_ahead_of_a_long_prefills_next_chunk():
    """A newcomer whose whole prompt fits the budget is admitted before the running prefill's
    next chunk, which then takes the rest of the budget."""
    sched = make_scheduler(budget=4, num_blocks=16, block_size=4)
    sched.add(make_request("a", 9, 1))
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 4, [0], False)]
    sched.add(make_request("b", 1, 1))
    batch, _ = step(sched)
    assert summary(batch) == [("b", 0, 1, [1], True), ("a", 4, 3, [0, 2], False)]
    batch, _ = step(sched)
    assert summary(batch) == [("a", 7, 2, [0, 2, 1], True)]  # b finished: its page is reused


# ---------------------------------------------------------------------------- latency mode


@pytest.mark.parametrize("context_cost", [0.0, 7.0, 100.0, 3072.0])
def test_tokens_for_cost_is_the_most_tokens_within_the_cost(context_cost):
    for start in (0, 1, 5, 63, 1000, 8000):
        for cost in (0.5, 1.0, 3.0, 17.5, 256.0):
            n = tokens_for_cost(cost, start, context_cost)
            assert n >= 1
            if n > 1:  # n = 1 is the floor even when one token costs more
                assert chunk_cost(n, start, context_cost) <= cost + 1e-9
            assert chunk_cost(n + 1, start, context_cost) > cost


def test_chunk_cost_counts_attention_to_the_context():
    assert chunk_cost(10, 0, 0.0) == 10  # off: tokens only
    assert chunk_cost(1, 100, 100.0) == 2.0  # one token seeing 100 earlier ones: 1 + 100/100
    # n tokens from start s see s, s+1, ..., s+n-1 earlier tokens
    assert chunk_cost(4, 10, 2.0) == pytest.approx(4 + (10 + 11 + 12 + 13) / 2.0)


def latency_scheduler(cost: int, context_cost: float, budget: int = 64, busy: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, busy_prefill_chunk=busy,
                             prefill_step_cost=cost)
    return Scheduler(config, BlockPool(256), 4, 1024, context_cost=context_cost)


def test_latency_mode_shrinks_a_long_prefills_chunks_as_its_context_grows():
    sched = latency_scheduler(cost=32, context_cost=32.0)
    sched.add(make_request("doc", 300, 1))
    sizes = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        (seq,) = batch.seqs
        sizes.append(len(seq.token_ids))
        assert len(seq.token_ids) == 1 or chunk_cost(len(seq.token_ids), seq.start_pos, 32.0) <= 32
    assert sum(sizes) == 300
    assert sizes[0] == tokens_for_cost(32, 0, 32.0) and sizes[0] > 2 * sizes[-2]
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)
    # off, the same prompt takes whole budget-sized chunks
    plain = latency_scheduler(cost=0, context_cost=32.0)
    plain.add(make_request("doc", 300, 1))
    assert [len(step(plain)[0].seqs[0].token_ids) for _ in range(5)] == [64, 64, 64, 64, 44]


def test_latency_mode_gives_a_newcomer_a_step_without_other_prefill_chunks():
    sched = latency_scheduler(cost=40, context_cost=1000.0)
    sched.add(make_request("doc", 400, 1))
    assert summary(step(sched)[0])[0][:3] == ("doc", 0, 39)
    sched.add(make_request("q", 5, 3, base=900))
    batch, _ = step(sched)  # q's first token, alone: the document waits one step
    assert [(s.request_id, len(s.token_ids), s.sample) for s in batch.seqs] == [("q", 5, True)]
    batch, _ = step(sched)  # q decodes (not capped), the document prefills again
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in batch.seqs] == [
        ("q", 5, 1), ("doc", 39, tokens_for_cost(40, 39, 1000.0))]


def test_latency_mode_newcomer_goes_before_a_prefills_last_chunk():
    sched = latency_scheduler(cost=40, context_cost=1000.0, budget=64)
    sched.add(make_request("doc", 70, 1))
    step(sched)  # 39 tokens: 31 left, less than the budget
    sched.add(make_request("q", 5, 3, base=900))
    batch, _ = step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("q", 5)]
    batch, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in batch.seqs] == [
        ("q", 1, True), ("doc", 31, True)]


def test_latency_mode_decodes_never_wait_for_the_cost_budget():
    """Decodes are not counted: many decoding requests still all decode every step, and a
    prefill chunk beside them still gets the whole cost budget."""
    sched = latency_scheduler(cost=8, context_cost=4.0)
    for i in range(6):
        sched.add(make_request(f"r{i}", 3, 5, base=100 * i))
    while sched.waiting or any(r.num_pending > 1 for r in sched.running):
        step(sched)  # the prompts (3 tokens each) are prefilled, a few per step
    sched.add(make_request("doc", 200, 1, base=5000))
    batch, _ = step(sched)
    decodes = [s for s in batch.seqs if s.request_id.startswith("r")]
    assert len(decodes) == len([r for r in sched.requests.values() if r.request_id.startswith("r")])
    assert all(len(s.token_ids) == 1 for s in decodes)
    doc = [s for s in batch.seqs if s.request_id == "doc"]
    assert doc and chunk_cost(len(doc[0].token_ids), 0, 4.0) <= 8


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(budget=100, num_blocks=32, block_size=2, max_num_seqs=2)
    sched.add(make_request("a", 3, 2))
    sched.add(make_request("b", 3, 3))
    sched.add(make_request("c", 3, 1))
    b1, _ = step(sched)
    assert summary(b1) == [("a", 0, 3, [0, 1], True), ("b", 0, 3, [2, 3], True)]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    b2, done = step(sched)
    assert summary(b2) == [("a", 3, 1, [0, 1], True), ("b", 3, 1, [2, 3], True)]
    assert done == ["a"]
    b3, done = step(sched)
    # a's pages 0 and 1 are free again and go out lowest first: b's new page is 0, c gets 1, 4.
    assert summary(b3) == [("b", 4, 1, [2, 3, 0], True), ("c", 0, 3, [1, 4], True)]
    assert done == ["b", "c"]
    assert sched.pool.num_free == 32


def test_waiting_request_that_does_not_fit_blocks_the_queue():
    # Admission is FIFO: a head that lacks pages stops later (smaller) requests too.
    sched = make_scheduler(budget=100, num_blocks=4, block_size=2)
    sched.add(make_request("a", 5, 3))  # 3 pages, grows to 4
    sched.add(make_request("b", 3, 1))  # 2 pages: 1 free
    sched.add(make_request("c", 1, 1))  # 1 page: would fit
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 5, [0, 1, 2], True)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.pool.num_free == 1


# ---------------------------------------------------------------------------- preemption


def test_preemption_frees_pages_and_recomputes_prompt_and_output():
    sched = make_scheduler(budget=16, num_blocks=4, block_size=2, max_num_seqs=2)
    a = make_request("a", 3, 4, base=0)
    b = make_request("b", 3, 4, base=50)
    c = make_request("c", 1, 1, base=90)
    for r in (a, b, c):
        sched.add(r)

    b1, _ = step(sched)
    assert summary(b1) == [("a", 0, 3, [0, 1], True), ("b", 0, 3, [2, 3], True)]
    b2, _ = step(sched)
    assert summary(b2) == [("a", 3, 1, [0, 1], True), ("b", 3, 1, [2, 3], True)]
    assert sched.pool.num_free == 0

    # a needs a third page; b (admitted later, not yet scheduled) gives up its pages.
    b3 = sched.schedule()
    assert summary(b3) == [("a", 4, 1, [0, 1, 2], True)]
    assert b3.preempted == ["b"]
    assert (b.status, b.num_computed_tokens, b.block_ids) == (RequestStatus.WAITING, 0, [])
    assert (b.num_preemptions, sched.num_preemptions) == (1, 1)
    assert b.output_token_ids == [10_000, 10_001]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b at the front
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.pool.num_free == 1
    assert [sched.pool.refcount(i) for i in range(4)] == [1, 1, 1, 0]
    finish_step(sched, b3)

    # b needs 3 pages for its 5 tokens, only 1 is free: it waits, and c waits behind it.
    b4, done = step(sched)
    assert summary(b4) == [("a", 5, 1, [0, 1, 2], True)]
    assert (b4.preempted, done) == ([], ["a"])
    assert [r.request_id for r in sched.waiting] == ["b", "c"]

    # b is recomputed in one chunk: its prompt, then the two outputs it had already sampled.
    b5, done = step(sched)
    assert summary(b5) == [("b", 0, 5, [0, 1, 2], True), ("c", 0, 1, [3], True)]
    assert b5.seqs[0].token_ids == [50, 51, 52, 10_000, 10_001]
    assert done == ["c"]
    b6, done = step(sched)
    assert summary(b6) == [("b", 5, 1, [0, 1, 2], True)]
    assert done == ["b"]
    assert b.output_token_ids == [10_000, 10_001, 10_002, 10_003]
    assert b.num_preemptions == 1
    assert sched.pool.num_free == 4
    assert not sched.has_unfinished()


def test_victim_is_most_recently_admitted_not_yet_scheduled():
    # c (newest) is scheduled first because it has the fewest pending tokens; when a then runs
    # out of pages, the victim is b, the newest request not scheduled in this step.
    sched = make_scheduler(budget=100, num_blocks=8, block_size=1)
    a, b, c = (make_request(rid, 2, 3, base=10 * i) for i, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add(r)
    b1, _ = step(sched)
    assert summary(b1) == [("a", 0, 2, [0, 1], True), ("b", 0, 2, [2, 3], True),
                           ("c", 0, 2, [4, 5], True)]
    a.output_token_ids.append(55)  # a and b have 2 tokens to compute, c has 1
    b.output_token_ids.append(56)
    batch = sched.schedule()
    assert summary(batch) == [("c", 2, 1, [4, 5, 6], True), ("a", 2, 2, [0, 1, 2, 3], True)]
    assert batch.preempted == ["b"]
    assert (b.status, b.block_ids, b.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert sched.pool.num_free == 1


def test_request_preempts_itself_when_it_is_the_newest_unscheduled():
    sched = make_scheduler(budget=100, num_blocks=4, block_size=2)
    a, b = make_request("a", 3, 4, base=0), make_request("b", 4, 4, base=50)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 3, [0, 1], True), ("b", 0, 4, [2, 3], True)]
    a.output_token_ids.append(55)  # a: 2 pending, b: 1 pending; both need a third page
    batch = sched.schedule()
    # b goes first (fewer pending) and finds no free page; b itself is the newest unscheduled
    # request, so it preempts itself. a then grows into b's freed pages.
    assert summary(batch) == [("a", 3, 2, [0, 1, 2], True)]
    assert batch.seqs[0].token_ids == [10_000, 55]
    assert batch.preempted == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.pool.num_free == 1


def test_several_preemptions_keep_waiting_in_arrival_order():
    sched = make_scheduler(budget=100, num_blocks=6, block_size=1)
    reqs = [make_request(rid, 2, 4, base=10 * i) for i, rid in enumerate("abc")]
    for r in reqs:
        sched.add(r)
    step(sched)  # 6 pages used, none free
    reqs[0].output_token_ids += [1, 2]  # a: 3 pending -> needs 2 more pages
    batch = sched.schedule()
    # b and c (1 pending each) go before a, and each needs a page while none is free: b evicts
    # c, the newest unscheduled request, and runs; c is skipped; a needs 3 pages, 1 is free,
    # and the only unscheduled request left is a itself.
    assert summary(batch) == [("b", 2, 1, [2, 3, 4], True)]
    assert batch.preempted == ["c", "a"]
    assert [r.request_id for r in sched.waiting] == ["a", "c"]
    assert sched.pool.num_free == 3


def test_preempted_step_admits_no_waiting_request():
    sched = make_scheduler(budget=3, num_blocks=6, block_size=1)
    a, b = make_request("a", 2, 4, base=0), make_request("b", 2, 4, base=50)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert summary(batch) == [("a", 0, 2, [0, 1], True), ("b", 0, 1, [2], False)]
    batch, _ = step(sched)
    assert summary(batch) == [("a", 2, 1, [0, 1, 3], True), ("b", 1, 1, [2, 4], True)]
    batch = sched.schedule()
    assert summary(batch) == [("a", 3, 1, [0, 1, 3, 5], True)]
    assert batch.preempted == ["b"]
    # b's recompute chunk (min(3 pending, 2 budget left) = 2 tokens) would fit the 2 free
    # pages, but nobody is admitted in a step that preempted.
    assert sched.pool.num_free == 2
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.running == [a]
    finish_step(sched, batch)
    run_to_completion(sched)
    assert b.output_token_ids == [10_000, 10_001, 10_002, 10_003]
    assert sched.pool.num_free == 6


# ---------------------------------------------------------------------------- checks and finish


def test_empty_prompt_is_rejected():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    with pytest.raises(RequestTooLongError, match="the prompt is empty"):
        sched.add(make_request("a", 0, 1))
    assert not sched.has_unfinished()


@pytest.mark.parametrize("prompt_len", [32, 33])
def test_prompt_at_or_over_context_window_is_rejected(prompt_len):
    sched = make_scheduler(budget=8, num_blocks=64, block_size=4, max_model_len=32)
    msg = rf"the prompt has {prompt_len} tokens but the model's context window is 32 tokens"
    with pytest.raises(RequestTooLongError, match=msg):
        sched.add(make_request("a", prompt_len, 1))
    assert sched.requests == {} and not sched.waiting


def test_prompt_one_below_context_window_is_accepted():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4, max_model_len=32)
    sched.check_fits(31, 1)
    sched.check_fits(31, 1000)  # capped at the context window: 8 pages


def test_request_needing_more_pages_than_the_pool_is_rejected():
    sched = make_scheduler(budget=8, num_blocks=3, block_size=4, max_model_len=64)
    sched.check_fits(10, 2)  # 12 tokens: 3 pages
    msg = (r"a request of 10 prompt \+ 3 new tokens needs 4 KV pages of 4 tokens, "
           r"but the cache holds only 3: raise kv_cache_gb or lower max_tokens")
    with pytest.raises(RequestTooLongError, match=msg):
        sched.check_fits(10, 3)
    with pytest.raises(RequestTooLongError, match=msg):
        sched.add(make_request("a", 10, 3))
    assert sched.requests == {}


def test_page_check_caps_at_the_context_window():
    sched = make_scheduler(budget=8, num_blocks=4, block_size=4, max_model_len=16)
    sched.check_fits(15, 100)  # min(115, 16) = 16 tokens = 4 pages
    sched = make_scheduler(budget=8, num_blocks=4, block_size=4, max_model_len=17)
    with pytest.raises(RequestTooLongError, match="needs 5 KV pages of 4 tokens"):
        sched.check_fits(15, 100)


def test_request_too_long_error_is_a_value_error():
    assert issubclass(RequestTooLongError, ValueError)


def test_duplicate_request_id_is_rejected_until_finished():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    first = make_request("a", 2, 1)
    sched.add(first)
    with pytest.raises(ValueError, match=r"request id 'a' is already in use"):
        sched.add(make_request("a", 3, 1))
    assert list(sched.waiting) == [first]
    run_to_completion(sched)
    again = make_request("a", 3, 1)
    sched.add(again)  # a finished id may be reused
    assert list(sched.waiting) == [again]


def test_arrival_order_counts_up():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    reqs = [make_request(rid, 1, 1) for rid in "xyz"]
    for r in reqs:
        sched.add(r)
    assert [r.arrival_order for r in reqs] == [0, 1, 2]


def test_finish_running_request_frees_its_pages():
    sched = make_scheduler(budget=100, num_blocks=8, block_size=2)
    a, b = make_request("a", 5, 9), make_request("b", 3, 9)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.block_ids, b.block_ids, sched.pool.num_free) == ([0, 1, 2], [3, 4], 3)
    sched.finish(a, "abort")
    assert (a.status, a.finish_reason, a.block_ids) == (RequestStatus.FINISHED, "abort", [])
    assert sched.pool.num_free == 6
    assert [sched.pool.refcount(i) for i in range(8)] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert sched.running == [b] and "a" not in sched.requests
    batch, _ = step(sched)
    assert summary(batch) == [("b", 3, 1, [3, 4], True)]


def test_finish_waiting_request_removes_it_from_the_queue():
    sched = make_scheduler(budget=8, num_blocks=8, block_size=4)
    a, b = make_request("a", 2, 1), make_request("b", 2, 1)
    sched.add(a)
    sched.add(b)
    sched.finish(a, "abort")
    assert list(sched.waiting) == [b]
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED, "abort")
    assert sched.pool.num_free == 8
    batch, _ = step(sched)
    assert summary(batch) == [("b", 0, 2, [0], True)]


def test_finish_preempted_request_frees_nothing_more():
    sched = make_scheduler(budget=100, num_blocks=4, block_size=2)
    a, b = make_request("a", 3, 4), make_request("b", 3, 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    batch = sched.schedule()
    assert batch.preempted == ["b"]
    sched.finish(b, "abort")
    assert not sched.waiting
    assert sched.pool.num_free == 1
    assert [sched.pool.refcount(i) for i in range(4)] == [1, 1, 1, 0]


def test_all_pages_free_after_a_mixed_workload():
    sched = make_scheduler(budget=6, num_blocks=10, block_size=2, max_num_seqs=3)
    lengths = [(7, 3), (1, 5), (12, 2), (4, 4), (2, 1), (9, 6)]
    reqs = [make_request(f"r{i}", p, m, base=100 * i) for i, (p, m) in enumerate(lengths)]
    for r in reqs:
        sched.add(r)
    run_to_completion(sched)
    assert [len(r.output_token_ids) for r in reqs] == [m for _, m in lengths]
    assert all(r.status == RequestStatus.FINISHED and r.block_ids == [] for r in reqs)
    assert sched.pool.num_free == 10
    assert [sched.pool.refcount(i) for i in range(10)] == [0] * 10
    assert sched.requests == {} and not sched.running and not sched.waiting


# ---------------------------------------------------------------------------- random workloads


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    budget = draw(st.integers(1, 24))
    max_num_seqs = draw(st.integers(1, 6))
    shapes = draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8)), min_size=1,
                           max_size=7))
    arrivals = draw(st.lists(st.integers(0, 6), min_size=len(shapes), max_size=len(shapes)))
    max_model_len = max(p + m for p, m in shapes) + draw(st.integers(0, 4))
    need = max(-(-(p + m) // block_size) for p, m in shapes)
    num_blocks = need + draw(st.integers(0, need))  # small pools force preemption
    return block_size, budget, max_num_seqs, max_model_len, num_blocks, shapes, arrivals


def check_step(sched: Scheduler, batch: SchedulerOutput, budget: int, block_size: int) -> None:
    assert 0 < batch.num_tokens <= budget
    ids = [s.request_id for s in batch.seqs]
    assert len(ids) == len(set(ids))
    assert not set(ids) & set(batch.preempted)
    for seq in batch.seqs:
        req = sched.requests[seq.request_id]
        assert req.status == RequestStatus.RUNNING
        assert seq.start_pos == req.num_computed_tokens
        end = seq.start_pos + len(seq.token_ids)
        assert len(seq.token_ids) >= 1 and end <= req.num_tokens
        assert seq.token_ids == (req.prompt_token_ids + req.output_token_ids)[seq.start_pos:end]
        assert seq.block_ids == req.block_ids
        assert len(seq.block_ids) == -(-end // block_size)
        assert seq.sample == (end == req.num_tokens)
    for rid in batch.preempted:
        req = sched.requests[rid]
        assert (req.status, req.num_computed_tokens, req.block_ids) == (
            RequestStatus.WAITING, 0, [])
        assert req in sched.waiting


def check_state(sched: Scheduler, max_num_seqs: int) -> None:
    pool = sched.pool
    assert len(sched.running) <= max_num_seqs
    held = [i for r in sched.running for i in r.block_ids]
    assert len(held) == len(set(held)), "running requests share a block"
    assert pool.num_free + len(held) == pool.num_blocks
    assert all(pool.refcount(i) == 1 for i in held)
    for req in sched.waiting:
        assert (req.status, req.num_computed_tokens, req.block_ids) == (
            RequestStatus.WAITING, 0, [])
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        assert len(req.block_ids) == -(-req.num_computed_tokens // sched.block_size)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([(0, 0.0), (6, 5.0), (1, 0.0), (20, 2.0)]))
def test_random_workloads_finish_without_leaks(workload, latency):
    """Also in latency mode (prefill_step_cost, context_cost)."""
    block_size, budget, max_num_seqs, max_model_len, num_blocks, shapes, arrivals = workload
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             prefill_step_cost=latency[0])
    sched = Scheduler(config, BlockPool(num_blocks), block_size, max_model_len, context_cost=latency[1])
    reqs = [make_request(f"r{i}", p, m, base=100 * i) for i, (p, m) in enumerate(shapes)]
    pending = sorted(zip(arrivals, range(len(reqs))))
    total = sum(p + m for p, m in shapes)
    for step_no in range(10 * total + 20):
        while pending and pending[0][0] <= step_no:
            sched.add(reqs[pending.pop(0)[1]])
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        batch = sched.schedule()
        check_step(sched, batch, budget, block_size)
        finish_step(sched, batch)
        check_state(sched, max_num_seqs)
    else:
        raise AssertionError("workload did not finish")
    for req, (_, max_tokens) in zip(reqs, shapes):
        assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
        assert req.output_token_ids == [10_000 + k for k in range(max_tokens)]
        assert req.block_ids == []
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.requests == {} and not sched.running and not sched.waiting

"""Decode and lookahead-verify steps through the CUDA-graph runner's padded static-buffer path,
run eagerly on the CPU (``capture=False``): the same logits as the plain runner for padded
batch sizes and widths, nothing read from the scratch page or from unwritten slots by a real
row, and greedy generation through the engine (lookahead on and off) identical with and
without it. The capture itself needs CUDA (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.engine.cuda_graphs import MAX_GRAPH_TOKENS, graph_batch_sizes, graph_shapes

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_engine_folder):
    return tiny_engine_folder


def prompts(n, repeat=1):
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(3, 150, (10 + 7 * i,), generator=gen).tolist() * repeat for i in range(n)]


def test_shapes_cover_every_batch_and_width():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64)[:5] == [1, 2, 4, 8, 16] and graph_batch_sizes(64)[-1] == 64
    assert all(any(s >= b for s in graph_batch_sizes(20)) for b in range(1, 21))
    shapes = graph_shapes(64, max_draft=8)
    assert {w for _, w in shapes} == {1, 2, 4, 8, 16}  # 1 + 8 tokens fit a width of 16
    assert all(s * w <= MAX_GRAPH_TOKENS for s, w in shapes if w > 1)
    assert graph_shapes(4, max_draft=0) == [(1, 1), (2, 1), (4, 1)]


def poison(engine, block):
    for k, v in engine.runner.kv.layers:
        k[block], v[block] = float("nan"), float("nan")


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_decode_logits_equal_the_plain_runner(folder, num_seqs):
    engine = LLM(folder, block_size=16, lookahead=False).engine
    for p in prompts(num_seqs):
        engine.add_request(p, GREEDY)
    engine.step()  # the prefills
    graphs = engine.capture_step_graphs(8, capture=False)
    batch = engine.scheduler.schedule()
    assert graphs.shape_for(batch)[1] == 1 and graphs.shape_for(batch)[0] >= num_seqs
    engine.runner.graphs = None
    plain = engine.runner.forward(batch)
    poison(engine, graphs.scratch_block)  # no real row may read it
    engine.runner.graphs = graphs
    padded = engine.runner.forward(batch)
    assert padded.shape == plain.shape == (num_seqs, engine.model_config.vocab_size)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_padded_verify_logits_equal_the_plain_runner(folder):
    """Two sequences with drafts of 3 and 1 nodes and one without: width 4 (pads in the
    sequences' own next slots and on the scratch page), batch padded from 3 to 4."""
    engine = LLM(folder, block_size=16, lookahead=False).engine
    ids = [engine.add_request(p, GREEDY) for p in prompts(3)]
    engine.step()
    graphs = engine.capture_step_graphs(8, capture=False, max_draft=3)
    drafts = {ids[0]: ([5, 6, 7], [-1, 0, -1]), ids[1]: ([9], [-1])}
    for req in engine.scheduler.running:
        req.draft_token_ids, req.draft_parents = drafts.get(req.request_id, ([], []))
    batch = engine.scheduler.schedule()
    assert sorted(s.num_draft for s in batch.seqs) == [0, 1, 3]
    assert graphs.shape_for(batch) == (4, 4)
    engine.runner.graphs = None
    plain = engine.runner.forward(batch)
    poison(engine, graphs.scratch_block)
    for seq in batch.seqs:  # and every slot past the step's own tokens in the seqs' pages
        for k, v in engine.runner.kv.layers:
            last = seq.block_ids[-1]
            used = (seq.start_pos + len(seq.token_ids) - 1) % 16 + 1
            k[last, used:], v[last, used:] = float("nan"), float("nan")
    engine.runner.graphs = graphs
    padded = engine.runner.forward(batch)
    assert padded.shape == plain.shape == ((1 + 3) + (1 + 1) + 1, engine.model_config.vocab_size)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lookahead", [False, True])
def test_greedy_generation_with_the_graph_path_is_identical(folder, lookahead):
    batch = [{"prompt_token_ids": p} for p in prompts(3, repeat=3)]  # repeats: drafts get accepted
    plain = LLM(folder, block_size=16, lookahead=lookahead)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY)]
    llm = LLM(folder, block_size=16, lookahead=lookahead)
    graphs = llm.engine.capture_step_graphs(4, capture=False, max_draft=8 if lookahead else 0)
    shapes = []
    original = graphs.run
    graphs.run = lambda b: shapes.append(graphs.shape_for(b)) or original(b)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == expected
    assert len(shapes) >= 5  # decode / verify steps went through it
    if lookahead:
        assert any(w > 1 for _, w in shapes), "no verify step took a graph"


def test_steps_that_do_not_qualify_run_eagerly(folder):
    engine = LLM(folder, block_size=16, lookahead=False, max_num_batched_tokens=64).engine
    graphs = engine.capture_step_graphs(2, capture=False)
    for p in prompts(3):
        engine.add_request(p, GREEDY)
    batch = engine.scheduler.schedule()  # prefill chunks
    assert not graphs.can_run(batch)


def test_a_step_whose_padding_would_pass_the_window_runs_eagerly(folder):
    engine = LLM(folder, block_size=16, lookahead=False).engine
    rid = engine.add_request(prompts(1)[0], GREEDY)
    engine.step()
    graphs = engine.capture_step_graphs(2, capture=False, max_draft=3)
    req = engine.scheduler.requests[rid]
    req.draft_token_ids, req.draft_parents = [5, 6], [-1, 0]  # 3 tokens: width 4
    batch = engine.scheduler.schedule()
    assert graphs.shape_for(batch) == (1, 4)
    graphs.max_model_len = batch.seqs[0].start_pos + 3  # the window ends before the padding does
    assert graphs.shape_for(batch) is None

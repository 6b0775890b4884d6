"""Decode steps through the CUDA-graph runner's padded static-buffer path, run eagerly on the
CPU (``capture=False``): the same logits as the plain runner for every batch size (padded to
1, 2, 4, 8, ...), the dummy rows confined to the scratch page, and greedy generation through
the engine identical with and without it. The capture itself needs CUDA (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.cuda_graphs import graph_batch_sizes

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_engine_folder):
    return tiny_engine_folder


def prompts(n):
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(3, 150, (10 + 7 * i,), generator=gen).tolist() for i in range(n)]


def test_batch_sizes_cover_every_batch():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64)[:5] == [1, 2, 4, 8, 16] and graph_batch_sizes(64)[-1] == 64
    assert all(any(s >= b for s in graph_batch_sizes(20)) for b in range(1, 21))


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_decode_logits_equal_the_plain_runner(folder, num_seqs):
    engine = LLM(folder, block_size=16, lookahead=False).engine
    for p in prompts(num_seqs):
        engine.add_request(p, GREEDY)
    engine.step()  # the prefills
    graphs = engine.capture_decode_graphs(8, capture=False)
    scratch = graphs.scratch_block
    batch = engine.scheduler.schedule()
    assert graphs.can_run(batch) and graphs.padded_size(num_seqs) >= num_seqs
    engine.runner.graphs = None
    plain = engine.runner.execute(batch)
    for k, v in engine.runner.kv.layers:  # poison the scratch page: no real row may read it
        k[scratch], v[scratch] = float("nan"), float("nan")
    engine.runner.graphs = graphs
    padded = engine.runner.execute(batch)
    assert padded.shape == plain.shape == (num_seqs, engine.model_config.vocab_size)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    k_scratch = engine.runner.kv.layers[0][0][scratch]
    if graphs.padded_size(num_seqs) > num_seqs:  # the dummy rows wrote slot 0 of the scratch page
        assert not k_scratch[0].isnan().any()
    else:
        assert k_scratch[0].isnan().all()
    assert k_scratch[1:].isnan().all()


def test_greedy_generation_with_the_graph_path_is_identical(folder):
    plain = LLM(folder, block_size=16, lookahead=False)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts(3)], GREEDY)]
    llm = LLM(folder, block_size=16, lookahead=False)
    graphs = llm.engine.capture_decode_graphs(4, capture=False)
    calls = []
    original = graphs.run
    graphs.run = lambda batch: calls.append(len(batch.seqs)) or original(batch)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts(3)], GREEDY)]
    assert got == expected
    assert len(calls) >= 10 and max(calls) == 3  # decode steps went through it


def test_steps_that_do_not_qualify_run_eagerly(folder):
    engine = LLM(folder, block_size=16, lookahead=False, max_num_batched_tokens=64).engine
    graphs = engine.capture_decode_graphs(2, capture=False)
    for p in prompts(3):
        engine.add_request(p, GREEDY)
    batch = engine.scheduler.schedule()  # prefill chunks
    assert not graphs.can_run(batch)

"""The sequence-parallel generator on a tiny random Llama in real gloo processes: tokens
equal the single-process engine's (greedy, seeded sampling, stop tokens), over several
prefill rounds, both shardings, odd lengths and prompts shorter than the ranks' chunks; no
rank holds the whole KV."""

from __future__ import annotations

import pytest
import torch
from sp_cases import Request, run_requests
from tiny_models import hf_greedy, make_engine_checkpoint

from longctx import LLM, SamplingParams
from longctx.parallel import generate_sp, spawn_ranks

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sp")
    hf = make_engine_checkpoint(folder)
    # lookahead off: SP decodes one token per step, and speculative acceptance draws random
    # numbers differently, so seeded sampling matches only the plain decode path
    # cpu_matmul blas: the ranks share the engine's weights, which oneDNN-packed ones cannot be
    return str(folder), hf, LLM(str(folder), max_num_batched_tokens=64, block_size=16, lookahead=False,
                                cpu_matmul="blas")


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 160, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(llm, prompt, params):
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    return out.token_ids, out.finish_reason


def _requests(llm, world: int) -> list[tuple[Request, list[int], str]]:
    """(request, expected tokens, expected finish reason), the engine's answers."""
    long_prompt, odd_prompt = _prompt(300, 1), _prompt(301, 2)
    greedy_tokens, _ = _engine(llm, odd_prompt, GREEDY)
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(greedy_tokens[4],))
    cases = [
        Request(tuple(long_prompt), GREEDY, chunk_size=32),  # 5 rounds of 64 (zigzag)
        Request(tuple(odd_prompt), GREEDY, chunk_size=20, mode="contiguous"),
        Request(tuple(long_prompt), SAMPLED, chunk_size=50),
        Request(tuple(odd_prompt), stop, chunk_size=128),  # one round
        Request(tuple(long_prompt[:2]), GREEDY, chunk_size=8),  # fewer tokens than 2N chunks
    ]
    return [(req, *_engine(llm, list(req.prompt), req.params)) for req in cases]


@pytest.mark.parametrize("world", [2, 3])
def test_generator_equals_single_process_engine(tiny, world):
    _, _, llm = tiny
    cases = _requests(llm, world)
    per_rank = spawn_ranks(run_requests, world, (llm.engine.model, [c[0] for c in cases]),
                           timeout_s=300, group_timeout_s=60)
    for i, (req, tokens, reason) in enumerate(cases):
        got = [rank[i] for rank in per_rank]
        assert all(g[0] == tokens for g in got), f"request {i}: {[g[0] for g in got]} != {tokens}"
        assert all(g[1] == reason for g in got)
        held = [g[2] for g in got]
        assert sum(held) == len(req.prompt) + len(tokens) - 1  # the last token's KV is never computed
        if len(req.prompt) > world:
            assert max(held) < sum(held), "one rank held the whole KV"
    assert cases[3][2] == "stop" and len(cases[3][1]) == 5


def test_generate_sp_from_a_model_path_matches_transformers(tiny):
    folder, hf, _ = tiny
    prompt = _prompt(200, 3)
    out = generate_sp(folder, prompt, GREEDY, sequence_parallel_size=2, chunk_size=40, block_size=16,
                      num_threads=1, timeout_s=300, group_timeout_s=60)
    assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert out.finish_reason == "length" and out.num_prompt_tokens == 200
    assert [r.tokens_held for r in out.ranks] == [100 + 6, 100 + 5]  # decode positions 200..210 alternate
    assert all(r.prefill.bytes_sent > 0 and r.decode.bytes_sent > 0 for r in out.ranks)


def test_bad_requests_fail_before_any_process_starts(tiny):
    _, _, llm = tiny
    model = llm.engine.model
    with pytest.raises(ValueError, match=r"integers in \[0, 160\)"):
        generate_sp(model, [1, 999], GREEDY, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="context window is 1024"):
        generate_sp(model, [5] * 1024, GREEDY, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size must be >= 1"):
        generate_sp(model, [5], GREEDY, sequence_parallel_size=0)

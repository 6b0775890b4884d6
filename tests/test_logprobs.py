"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) and output log-probabilities
on a tiny random Llama, against HF transformers' logits for the same checkpoint: every prompt
position, chunked prefill, a document already in the prefix cache (the request computes its
whole prompt anyway), and the SP refusal."""

from __future__ import annotations

import pytest
import torch

from longctx import LLM, SamplingParams
from tiny_models import random_tokens


@pytest.fixture(scope="module")
def hf_logprobs(tiny_engine_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_engine_folder, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


PROMPT = random_tokens(150, seed=3)


@pytest.mark.parametrize("chunk", [2048, 32])  # one step, or five chunks
def test_prompt_logprobs_equal_hf_at_every_position(tiny_engine_folder, hf_logprobs, chunk):
    llm = LLM(tiny_engine_folder, block_size=16, max_num_batched_tokens=chunk)
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=2))  # cached now
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    ref = hf_logprobs(PROMPT)
    got = out.prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    for pos in range(1, len(PROMPT)):
        entry, token = got[pos], PROMPT[pos]
        assert token in entry and len(entry) <= 4
        assert entry[token] == pytest.approx(float(ref[pos - 1, token]), abs=1e-4)
        top = torch.topk(ref[pos - 1], 3)
        for i, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[i] == pytest.approx(v, abs=1e-4)
    assert out.outputs[0].logprobs is None  # not asked


def test_output_logprobs_are_the_raw_distribution(tiny_engine_folder, hf_logprobs):
    llm = LLM(tiny_engine_folder, block_size=16)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    ids = out.outputs[0].token_ids
    ref = hf_logprobs(PROMPT + ids)
    for i, (token, entry) in enumerate(zip(ids, out.outputs[0].logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert token == int(row.argmax())
        assert entry[token] == pytest.approx(float(row[token]), abs=1e-4)
        assert set(entry) == set(torch.topk(row, 2).indices.tolist()) | {token}


def test_prompt_logprobs_are_refused_under_sequence_parallelism(tiny_engine_folder):
    from longctx.engine.llm_engine import LLMEngine  # noqa: F401 - the check is in add_request

    llm = LLM(tiny_engine_folder, block_size=16)
    llm.engine.sequence_parallel_size = 2  # what an SP engine reports (no ranks needed for the check)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with sequence_parallel_size"):
        llm.engine.add_request(PROMPT, SamplingParams(prompt_logprobs=1))

"""Lookahead decoding on the real model: greedy output identical with and without it for
extraction, summarization and free-form prompts, batch 1 and batch 4, prefix store on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams

pytestmark = pytest.mark.model

LICENSE = Path("/usr/share/common-licenses/GPL-3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def prompts():
    torch.set_num_threads(2)
    llm = LLM("smollm2-135m", lookahead=False)
    tok = llm.get_tokenizer()
    section = tok.decode(tok.encode(LICENSE.read_text(), add_special_tokens=False)[:1000])

    def chat(text):
        return {"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": text}])}

    return llm, [
        chat(section + "\n\nQuote the first paragraph of the preamble above, word for word."),
        chat(section + "\n\nSummarize the text above in three sentences."),
        chat("Write a short poem about a lighthouse keeper who collects seashells."),
        chat(section + "\n\nWhat does the license say about warranties?"),
    ]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_lookahead_greedy_equals_plain_greedy_batch_1_and_4(prompts):
    plain_llm, items = prompts
    expected = [_tokens(plain_llm, [p])[0] for p in items]
    llm = LLM("smollm2-135m")  # lookahead and the prefix store are on by default
    solo = [_tokens(llm, [p])[0] for p in items]
    assert solo == expected
    assert _tokens(llm, items) == expected  # batch of 4, now with prefix hits too
    stats = llm.engine.lookahead.stats.overall
    assert stats.num_accepted > 0
    assert llm.cache_stats().hit_tokens["device"] > 0

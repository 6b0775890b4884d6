"""The real default model (SmolLM2-135M, fp32) with ``--sp 2``: two gloo processes generate
the same greedy tokens as the single-process engine for a 6,500-token document, with the
same prefill chunking (2 ranks x 1,024 tokens per round = the engine's 2,048-token chunks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.parallel import generate_sp

pytestmark = pytest.mark.model

LICENSE = Path("/usr/share/common-licenses/GPL-3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_sp2_greedy_tokens_equal_the_single_process_engine():
    torch.set_num_threads(2)
    # cpu_matmul blas: the ranks share this engine's weights (oneDNN-packed ones cannot be shared)
    llm = LLM("smollm2-135m", block_size=64, max_num_batched_tokens=2048, lookahead=False,
              cpu_matmul="blas")
    text = LICENSE.read_text()
    ids = llm.get_tokenizer().encode(text + "\n\n" + text, add_special_tokens=False)[:6500]
    expected = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    out = generate_sp(llm.engine.model, ids, GREEDY, sequence_parallel_size=2, chunk_size=1024,
                      block_size=64, num_threads=1, timeout_s=600, group_timeout_s=300)
    assert out.token_ids == expected
    held = [r.tokens_held for r in out.ranks]
    assert sum(held) == 6500 + 24 - 1 and max(held) < 3300  # neither rank holds the whole KV

"""``LLM(sequence_parallel_size=2)`` and ``longctx generate --sp 2`` on a tiny random Llama:
the same greedy text as the single-process engine, streamed or not."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_models import make_engine_checkpoint

from longctx import LLM, SamplingParams
from longctx.engine.sp import SequenceParallelError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sp-cli")
    make_engine_checkpoint(path)
    return str(path)


def test_llm_with_sequence_parallel_size_equals_single_process(folder):
    plain = LLM(folder, block_size=16, max_num_batched_tokens=64)
    expected = plain.generate(PROMPT, GREEDY)[0].outputs[0]
    sp = LLM(folder, block_size=16, max_num_batched_tokens=64, sequence_parallel_size=2)
    got = sp.generate(PROMPT, GREEDY)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "length")
    streamed = list(sp.stream(PROMPT, GREEDY))
    assert "".join(d.text for d in streamed) == expected.text
    assert [t for d in streamed for t in d.token_ids] == expected.token_ids
    sp.close()
    with pytest.raises(SequenceParallelError, match="shut down"):  # after close: a clear error
        sp.generate(PROMPT, GREEDY)
    with pytest.raises(ValueError, match="sequence_parallel_size must be"):
        LLM(folder, sequence_parallel_size=0)


def test_cli_generate_sp2_prints_the_single_process_text(folder):
    def run(*extra):
        cmd = [sys.executable, "-m", "longctx.entrypoints.cli", "generate", PROMPT, "--model", folder,
               "--block-size", "16", "--max-num-batched-tokens", "64", "--max-tokens", "10",
               "--ignore-eos", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run("--sp", "2") == run()

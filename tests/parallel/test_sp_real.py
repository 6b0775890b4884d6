"""The real default model with sequence parallelism inside the engine: greedy tokens identical
to one process (fp32) for long real-text prompts, batched, across chunk sizes, lookahead on and
off, prefix-store hits on every tier (the disk tier from a fresh process) and streaming.

The default run checks N = 2 on a batch of a 1,500- and a 400-token prompt in chunks of 1,024
plus a device-tier hit (2,500 and 700, and 6,000 and 1,500, in chunks of 2,048 under ``-m slow``); ``-m slow`` also runs the whole matrix (N = 1, 2, 3;
four prompts of 6,000-7,333 tokens; chunks of 256 and 2,048; host and disk tiers), which takes
~15 minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from longctx import LLM, SamplingParams

pytestmark = pytest.mark.model

LICENSES = Path("/usr/share/common-licenses")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def corpus_ids(tokenizer) -> list[int]:
    texts = [(LICENSES / n).read_text() for n in ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0")]
    return tokenizer.encode("\n\n".join(texts * 2), add_special_tokens=False)


def prompts(tokenizer, spans: list[tuple[int, int]]) -> list[dict]:
    ids = corpus_ids(tokenizer)
    return [{"prompt_token_ids": ids[start:start + n]} for start, n in spans]


def token_ids(llm: LLM, batch: list[dict], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params)]


@pytest.mark.parametrize("spans, chunk", [([(0, 1500), (9000, 400)], 1024),
                                          pytest.param([(0, 2500), (9000, 700)], 2048, marks=pytest.mark.slow),
                                          pytest.param([(0, 6000), (9000, 1500)], 2048, marks=pytest.mark.slow)])
def test_two_ranks_match_one_process_on_a_long_batch_and_a_device_hit(spans, chunk):
    with LLM(max_num_batched_tokens=chunk) as one:
        batch = prompts(one.get_tokenizer(), spans)
        expected = token_ids(one, batch)
    with LLM(max_num_batched_tokens=chunk, sequence_parallel_size=2) as two:
        assert token_ids(two, batch) == expected
        again = token_ids(two, batch[:1])  # the document's pages are on the device tier now
        assert again == expected[:1]
        assert two.cache_stats().hit_tokens["device"] >= spans[0][1] - 100


SLOW_SPANS = [(0, 6000), (9000, 6400), (17000, 6901), (3000, 7333)]


@pytest.fixture(scope="module")
def reference():
    """One process, lookahead off, chunks of 2,048: the tokens every configuration must give."""
    with LLM(max_num_batched_tokens=2048, lookahead=False) as one:
        batch = prompts(one.get_tokenizer(), SLOW_SPANS)
        return batch, token_ids(one, batch)


@pytest.mark.slow
@pytest.mark.parametrize("world, chunk, lookahead", [(1, 256, True), (2, 2048, True), (2, 256, False),
                                                     (3, 2048, False), (3, 256, True)])
def test_batch_of_four_long_prompts_matches_across_ranks(reference, world, chunk, lookahead):
    batch, expected = reference
    with LLM(max_num_batched_tokens=chunk, lookahead=lookahead, sequence_parallel_size=world) as llm:
        assert token_ids(llm, batch) == expected


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_prefix_hits_on_host_and_disk_tiers_and_streaming(reference, world, tmp_path):
    batch, expected = reference
    first, second = batch[0], batch[1]
    # 150 pages of 64 tokens in all hold one ~6K-token document, not two
    pages = 150 // world
    with LLM(num_blocks=pages, host_cache_gb=2.0, disk_cache_dir=str(tmp_path),
             sequence_parallel_size=world) as llm:
        assert token_ids(llm, [first]) == expected[:1]
        assert token_ids(llm, [second]) == expected[1:2]  # evicts pages of the first to the host tier
        assert token_ids(llm, [first]) == expected[:1]
        hits = llm.cache_stats().hit_tokens
        # the first document's 93 full pages (5,952 tokens) come back from the device and host
        assert hits["host"] > 0 and hits["device"] + hits["host"] == 5952, hits
        streamed = list(llm.stream(first, GREEDY))
        assert [t for d in streamed for t in d.token_ids] == expected[0]
        assert "".join(d.text for d in streamed) == llm.get_tokenizer().decode(expected[0], skip_special_tokens=True)
    # close() persisted the pages: a fresh process (one rank) reads them from disk
    script = (f"import json; from longctx import LLM, SamplingParams\n"
              f"llm = LLM(disk_cache_dir={str(tmp_path)!r})\n"
              f"out = llm.generate({json.dumps(first)}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))\n"
              f"print(json.dumps([out[0].outputs[0].token_ids, llm.cache_stats().hit_tokens['disk']]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens, disk_hits = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens == expected[0] and disk_hits >= 5900

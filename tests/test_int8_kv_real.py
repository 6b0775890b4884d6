"""int8 KV pages on the real default model (slow, ~6 min on 2 cores): five real-text prompts
of 6,000 tokens (license texts from /usr/share/common-licenses, each led by another one),
greedy, lookahead off, chunked prefill of 512 tokens.

* The first 32 greedy tokens with int8 pages against float32 pages; the test prints which
  prompts differ and at which token, and checks that each difference is a near-tie for float32.
* Top-1 agreement over 256 tokens: float32 pages decode 256 greedy tokens; the int8 engine
  reads prompt + those tokens (``prompt_logprobs=1``, so every position is scored over int8
  pages of the preceding ones) and its top-1 at each of the 256 positions is compared with
  float32's token. Reported per prompt; asserted >= 95% overall (a floor, not the figure:
  the figure is printed and recorded in docs/benchmarks.md).
* The issue's bar (4 of 5): with the exact tail (longctx/kv/exact_tail.py) 5 of 5 on an
  AVX-512 machine at both its own and its AVX2 level (the figures in docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longctx import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

LICENSES = Path("/usr/share/common-licenses")
LEADS = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-2.0")
FILL = ("Apache-2.0", "Artistic", "CC0-1.0", "LGPL-3")
PROMPT_TOKENS = 6000
QUESTION = "\n\nWhat does the first license above require of someone who distributes the software?"


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for lead in LEADS:
        names = (lead, *(n for n in (*LEADS, *FILL) if n != lead))
        text = "\n\n".join((LICENSES / name).read_text() for name in names)
        body = tokenizer.encode(text, add_special_tokens=False)
        tail = tokenizer.encode(QUESTION, add_special_tokens=False)
        out.append(body[:PROMPT_TOKENS - len(tail)] + tail)
    return out


def engine(kv_cache_dtype: str) -> LLM:
    torch.set_num_threads(2)
    return LLM("smollm2-135m", kv_cache_dtype=kv_cache_dtype, lookahead=False, max_num_batched_tokens=512,
               enable_prefix_caching=False, kv_cache_gb=2)


@pytest.fixture(scope="module")
def runs():
    """float32 pages: 256 greedy tokens per prompt with the top 5 log-probabilities of each
    step; int8 pages: 32 greedy tokens, and every position of prompt + float32's tokens scored
    (its top-1 there)."""
    fp32 = engine("auto")
    ids = prompts(fp32.get_tokenizer())
    assert all(len(p) == PROMPT_TOKENS for p in ids)
    long_params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, logprobs=5)
    outs = fp32.generate([{"prompt_token_ids": p} for p in ids], long_params)
    reference = [o.outputs[0].token_ids for o in outs]
    ref_logprobs = [o.outputs[0].logprobs for o in outs]
    fp32.close()
    int8 = engine("int8")
    short = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in int8.generate([{"prompt_token_ids": p} for p in ids], short)]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    tops = []
    for p, want in zip(ids, reference):
        out = int8.generate({"prompt_token_ids": p + want}, scored)[0].prompt_logprobs
        tops.append([max(entry, key=entry.get) for entry in out[len(p):len(p) + len(want)]])
    int8.close()
    lines, firsts, agree = [], [], 0
    for lead, want, mine, top, logprobs in zip(LEADS, reference, got, tops, ref_logprobs):
        first = next((i for i, (a, b) in enumerate(zip(want[:32], mine)) if a != b), None)
        firsts.append(first)
        hits = sum(a == b for a, b in zip(top, want))
        agree += hits
        gaps = [top2_gap(step) for step in logprobs[:32]]
        tightest = min(range(len(gaps)), key=gaps.__getitem__)
        lines.append(f"{lead}: " + ("first 32 tokens equal" if first is None else
                                    f"differs at token {first} (float32's top-2 gap there {gaps[first]:.4f} nats)")
                     + f"; float32's tightest top-2 gap in the first 32: {gaps[tightest]:.4f} nats at token "
                     f"{tightest}; top-1 agreement {hits}/{len(want)}")
    report = "\n".join(lines + [f"equal first 32: {firsts.count(None)}/5; top-1 agreement "
                                f"{agree}/{5 * 256} = {agree / (5 * 256):.3f}"])
    print(report)
    return reference, ref_logprobs, got, firsts, agree / (5 * 256), report


def top2_gap(step: dict[int, float]) -> float:
    """float32's margin at one step: its top log-probability minus the runner-up's (nats)."""
    first, second = sorted(step.values(), reverse=True)[:2]
    return first - second


def test_int8_keeps_the_first_32_tokens_on_4_of_5_prompts(runs):
    """Issue 24's bar. With the exact tail: 5 of 5 at an AVX-512 machine's own kernel level and
    at its AVX2 level (before it: 4 and 3 of 5; docs/benchmarks.md, int8 KV pages). Which
    prompts pass follows the near-ties that a last-bit change of the float32 or int8 path flips,
    so this test can still fail on another CPU. (this model's next-token distribution has a
    top-2 gap under 0.05 nats at ~4% of positions; four of these prompts have one in their
    first 32 steps, GPL-2 0.009 nats at token 20. benchmarks/int8_error_study.py: over 11 noise
    draws, 4 of 5 or better in 10 with every KV row rounded to bf16, 9 with int8 and the first
    and last page exact, the study's form of the exact tail, 3 with int8 as stored)"""
    *_, firsts, _, report = runs
    assert firsts.count(None) >= 4, report


def test_int8_parts_from_float32_only_at_near_ties(runs):
    """Where int8's greedy run first differs, float32 pages rated int8's token among their top 5
    within 0.5 nats of their own choice; top-1 agreement over 256 tokens at least 95%."""
    reference, ref_logprobs, got, firsts, agreement, report = runs
    for want, logprobs, mine, first in zip(reference, ref_logprobs, got, firsts):
        if first is None:
            continue
        step = logprobs[first]
        assert mine[first] in step, report
        assert step[want[first]] - step[mine[first]] < 0.5, (step, report)
    assert agreement >= 0.95, report

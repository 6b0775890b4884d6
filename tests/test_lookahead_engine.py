"""Lookahead decoding in the engine, on a tiny random Llama: greedy output identical with and
without it (batch 1 and 4, pages of 16, prefix cache on), accepted branches that are not first
in memory order are compacted correctly, and sampled output follows the model's distribution
(chi-square against exact probabilities)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.attention import AttentionMetadata
from longctx.lookahead.tree import DraftTree
from longctx.sampling import filtered_probs
from tiny_models import make_engine_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-lookahead")
    make_engine_checkpoint(path)
    return str(path)


def _prompts():
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(3, 160, (40,), generator=gen).tolist()
    return [base * 3, torch.randint(3, 160, (50,), generator=gen).tolist(), base[:20] * 4, base * 2]


def _outputs(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_with_lookahead_equals_without(folder, batch):
    prompts = _prompts()[:batch]
    plain = LLM(folder, block_size=16, lookahead=False)
    expected = [o.outputs[0].token_ids for o in _outputs(plain, prompts)]
    llm = LLM(folder, block_size=16, max_num_batched_tokens=64)
    outs = _outputs(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # drafts were really used
    again = _outputs(llm, prompts)  # prefix-cache hits and the shared pool of outputs
    assert [o.outputs[0].token_ids for o in again] == expected
    stats = llm.engine.lookahead.stats.overall
    assert stats.num_accepted > 0 and stats.mean_tokens_per_step > 1


def _forced_tree(engine, reference, wrong_first):
    """A propose() that drafts, for each step, a wrong branch first and then the true
    continuation (from ``reference``) as the second branch of the root."""
    def propose(request_id, max_tokens):
        done = len(engine.output(request_id).outputs[0].token_ids)
        truth = reference[done:done + 3]
        if max_tokens < 5 or len(truth) < 3:
            return DraftTree.empty()
        decoy = (truth[0] + 1) % 160 if wrong_first else truth[0]
        if wrong_first:  # node 0 decoy, node 1 its child, nodes 2-4 the truth
            return DraftTree([decoy, truth[1], truth[0], truth[1], truth[2]], [-1, 0, -1, 2, 3])
        return DraftTree.chain(truth)
    return propose


@pytest.mark.parametrize("wrong_first", [False, True])
def test_accepted_branch_is_compacted_next_to_the_last_token(folder, wrong_first):
    prompt = _prompts()[1]
    reference = _outputs(LLM(folder, block_size=16, lookahead=False), [prompt])[0].outputs[0].token_ids
    llm = LLM(folder, block_size=16)
    llm.engine.lookahead.propose = _forced_tree(llm.engine, reference, wrong_first)
    out = _outputs(llm, [prompt])[0]
    assert out.outputs[0].token_ids == reference  # later tokens read the moved KV
    assert out.metrics.num_accepted_tokens >= 3 * 10  # every verify step accepted its 3 truths


# ---------------------------------------------------------------------- sampling is lossless

def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square with ``dof`` degrees of freedom > x), from the gamma series."""
    a, half = dof / 2, x / 2
    term = total = 1 / a
    for n in range(1, 1000):
        term *= half / (a + n)
        total += term
    return max(0.0, 1 - math.exp(a * math.log(half) - half - math.lgamma(a)) * total)


def test_sampled_tokens_follow_the_models_distribution(folder):
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm = LLM(folder, block_size=16)
    model, backend = llm.engine.model, llm.engine.runner.backend
    prompt = _prompts()[1][:20]

    @torch.inference_mode()
    def probs(ids):
        meta = AttentionMetadata.dense([len(ids)])
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), backend, meta)
        p = filtered_probs(model.compute_logits(hidden[-1:])[0], params)
        return {int(t): float(p[t]) for t in torch.nonzero(p).flatten()}

    # exact distribution of (token 2, token 3), summed over token 1 (sampled before any draft)
    p1 = probs(prompt)
    p2 = {t1: probs(prompt + [t1]) for t1 in p1}
    p3 = {(t1, t2): probs(prompt + [t1, t2]) for t1 in p1 for t2 in p2[t1]}
    exact = Counter()
    for t1, a in p1.items():
        for t2, b in p2[t1].items():
            for t3, c in p3[(t1, t2)].items():
                exact[(t2, t3)] += a * b * c

    def propose(request_id, max_tokens):  # two branches at depth 1, a child under the first
        t1 = llm.engine.output(request_id).outputs[0].token_ids[0]
        second = sorted(p2[t1], key=p2[t1].get, reverse=True)
        child = max(p3[(t1, second[0])], key=p3[(t1, second[0])].get)
        return DraftTree([second[0], second[1], child], [-1, -1, 0])

    llm.engine.lookahead.propose = propose
    runs = 900
    outs = llm.generate([{"prompt_token_ids": prompt}] * runs,
                        [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s)
                         for s in range(runs)])
    assert sum(o.metrics.num_accepted_tokens for o in outs) > runs // 4
    seen = Counter(tuple(o.outputs[0].token_ids[1:]) for o in outs)
    assert set(seen) <= set(exact)
    stat = sum((seen[k] - runs * p) ** 2 / (runs * p) for k, p in exact.items())
    assert chi2_sf(stat, len(exact) - 1) > 1e-3, (stat, seen, exact)

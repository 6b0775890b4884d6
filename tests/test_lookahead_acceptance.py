"""Acceptance: greedy exact cases and equality with plain greedy decoding; the sampled rule (one
seeded pick per verify row, then a walk down the tree) giving exactly plain sampling's tokens at
the same output positions; and chi-square tests, over many seeds on a tiny vocabulary, that the
first two tokens of lookahead sampling follow plain sampling's joint distribution, with the same
test failing deliberately wrong rules. Plus LookaheadStats.

The "model" is a trigram table: the logits after a prefix depend on its last two tokens, so a
row computed for the wrong path (e.g. the parent's) gives a different distribution.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.lookahead.acceptance import Acceptance, accept_draft, accept_tokens
from longctx.lookahead.drafter import Drafter, DrafterConfig
from longctx.lookahead.stats import LookaheadStats, LookaheadStatsTracker
from longctx.lookahead.tree import ROOT, DraftTree
from longctx.sampling import filtered_probs, sample
from longctx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
V = 6


class TrigramModel:
    """Next-token logits [V] as a fixed random function of the last two tokens."""

    def __init__(self, seed: int, spread: float = 2.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, V, V, generator=gen) * spread  # (previous, last, next)

    def logits(self, prefix: list[int]) -> torch.Tensor:
        return self.table[prefix[-2], prefix[-1]]

    def verify_logits(self, prefix: list[int], tree: DraftTree) -> torch.Tensor:
        """[len(tree) + 1, V]: row 0 after ``prefix``, row i + 1 after prefix + path to node i."""
        paths = [[]] + [[tree.token_ids[n] for n in tree.path(node)] for node in range(len(tree))]
        return torch.stack([self.logits(prefix + path) for path in paths])


def one_hot_rows(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# ---------------------------------------------------------------------------- greedy: exact

#       root ── 3(0) ── 4(1)        queries: root=0, node i = i + 1
#            ├─ 5(2) ── 6(3) ── 7(4)
#            └─ 2(5)
TREE = DraftTree([3, 4, 5, 6, 7, 2], [ROOT, 0, ROOT, 2, 3, ROOT])


@pytest.mark.parametrize("argmaxes,accepted,tokens", [
    ([5, 0, 0, 6, 7, 1, 0], [2, 3, 4], [5, 6, 7, 1]),  # the whole middle branch, bonus 1
    ([5, 0, 0, 6, 0, 1, 0], [2, 3], [5, 6, 0]),  # stops inside the branch
    ([3, 4, 2, 0, 0, 0, 0], [0, 1], [3, 4, 2]),  # first branch to its leaf, bonus from its row
    ([2, 0, 0, 0, 0, 0, 6], [5], [2, 6]),  # last child of the root
    ([1, 4, 4, 4, 4, 4, 4], [], [1]),  # nothing matches: plain decoding's token
])
def test_greedy_follows_the_argmax(argmaxes, accepted, tokens):
    result = accept_draft(one_hot_rows(argmaxes), TREE, GREEDY)
    assert result == Acceptance(accepted, tokens)
    assert result.bonus_token == tokens[-1] and result.num_accepted == len(accepted)
    assert result.kept_queries == [0] + [n + 1 for n in accepted]


def test_greedy_ties_take_the_first_maximum_like_plain_sampling():
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert accept_draft(logits, DraftTree([2], [ROOT]), GREEDY).tokens == [1]
    assert accept_draft(logits, DraftTree([1], [ROOT]), GREEDY).tokens == [1, 0]
    assert sample(logits[:1], [GREEDY]) == [1]


def test_empty_draft_is_plain_decoding():
    logits = one_hot_rows([4])
    assert accept_draft(logits, DraftTree.empty(), GREEDY) == Acceptance([], [4])
    sampled = accept_draft(logits, DraftTree.empty(), SamplingParams(top_k=1, seed=0), position=9)
    assert sampled == Acceptance([], [4])
    flat = SamplingParams(seed=5)
    for position in range(20):
        assert accept_draft(torch.zeros(1, 8), DraftTree.empty(), flat, position).tokens == sample(
            torch.zeros(1, 8), [flat], [position])


@pytest.mark.parametrize("logits,message", [
    (torch.zeros(3, 8), r"\[len\(tree\) \+ 1, V\] = \[7, V\], got \[3, 8\]"),
    (torch.zeros(7), r"got \[7\]"),
    (torch.zeros(7, 6), "draft token 7 is outside the vocabulary of 6 logits"),
])
def test_bad_verify_logits_are_rejected(logits, message):
    with pytest.raises(ValueError, match=message):
        accept_draft(logits, TREE, GREEDY)


# ---------------------------------------------------------------------------- the walk


@pytest.mark.parametrize("row_tokens,accepted,tokens", [
    ([5, 0, 0, 6, 7, 1, 0], [2, 3, 4], [5, 6, 7, 1]),
    ([3, 4, 2, 0, 0, 0, 0], [0, 1], [3, 4, 2]),
    ([2, 0, 0, 0, 0, 0, 6], [5], [2, 6]),
    ([1, 4, 4, 4, 4, 4, 4], [], [1]),
    ([3, 7, 2, 6, 7, 1, 0], [0], [3, 7]),  # row 1 picks 7: not a child of node 0
])
def test_accept_tokens_walks_the_picks(row_tokens, accepted, tokens):
    assert accept_tokens(TREE, row_tokens) == Acceptance(accepted, tokens)


def test_accept_tokens_needs_one_pick_per_row():
    with pytest.raises(ValueError, match=r"one picked token per verify row \(7\), got 6"):
        accept_tokens(TREE, [0] * 6)
    assert accept_tokens(DraftTree.empty(), [3]) == Acceptance([], [3])


def plain_tokens(model: TrigramModel, prompt: list[int], params: SamplingParams,
                 num_tokens: int) -> list[int]:
    """Plain decoding: output position ``i`` sampled alone from its row."""
    tokens = list(prompt)
    for position in range(num_tokens):
        tokens += sample(model.logits(tokens)[None], [params], [position])
    return tokens[len(prompt):]


def lookahead_tokens(model: TrigramModel, prompt: list[int], params: SamplingParams,
                     num_tokens: int, draft_for, accept=accept_draft) -> list[int]:
    """Generate with drafts from ``draft_for(prefix)`` judged by ``accept`` (given the output
    position of the root's token); the first ``num_tokens`` emitted."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + num_tokens:
        tree = draft_for(tokens)
        tokens += accept(model.verify_logits(tokens, tree), tree, params, len(tokens) - len(prompt)).tokens
    return tokens[len(prompt):len(prompt) + num_tokens]


@st.composite
def draft_policies(draw):
    """A function prefix -> DraftTree: random trees over the tiny vocabulary, or the Drafter."""
    if draw(st.booleans()):
        config = DrafterConfig(max_context=draw(st.integers(1, 3)))
        size, branches = draw(st.integers(0, 10)), draw(st.integers(1, 3))
        return lambda prefix: Drafter(config, prefix).propose(size, branches)
    seed = draw(st.integers(0, 2**31))

    def random_tree(prefix: list[int]) -> DraftTree:
        gen = torch.Generator().manual_seed(seed + len(prefix))
        token_ids, parents = [], []
        for _ in range(int(torch.randint(0, 12, (), generator=gen))):
            parent = int(torch.randint(-1, len(token_ids), (), generator=gen))
            token = int(torch.randint(0, V, (), generator=gen))
            if (parent, token) not in zip(parents, token_ids):
                token_ids.append(token)
                parents.append(parent)
        return DraftTree(token_ids, parents)
    return random_tree


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, V - 1), min_size=2, max_size=8),
       draft_policies())
def test_greedy_lookahead_equals_plain_greedy(model_seed, prompt, draft_for):
    model = TrigramModel(model_seed)
    assert lookahead_tokens(model, prompt, GREEDY, 16, draft_for) == plain_tokens(
        model, prompt, GREEDY, 16)


# ---------------------------------------------------------------------------- sampled: exact

SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.7), SamplingParams(temperature=1.1, min_p=0.1)]
SAMPLING_IDS = ["t1", "t0.8-k4", "t1.3-p0.7", "t1.1-minp0.1"]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, V - 1), min_size=2, max_size=8),
       draft_policies(), st.sampled_from(SAMPLING), st.integers(-2**40, 2**40))
def test_seeded_lookahead_emits_plain_samplings_tokens(model_seed, prompt, draft_for, params, seed):
    # Not just the same distribution: the same tokens, since row by row the verify pass draws
    # with the noise of (seed, output position), as plain decoding does at that position.
    model = TrigramModel(model_seed, spread=1.0)  # flatter: drafts are often rejected
    params = dataclasses.replace(params, seed=seed)
    assert lookahead_tokens(model, prompt, params, 16, draft_for) == plain_tokens(
        model, prompt, params, 16)


def test_each_verify_row_draws_plain_samplings_token_at_its_position():
    # A chain of 5 draft tokens: row d is output position ``position + d``; its pick is plain
    # sampling's token for that row alone at that position, whatever the draft says.
    model, params = TrigramModel(3, spread=0.5), SamplingParams(seed=21, temperature=1.5)
    prefix = [0, 1, 2]
    for position in (0, 7, 123):
        tree = DraftTree.chain([1, 2, 3, 4, 5])
        logits = model.verify_logits(prefix, tree)
        picks = sample(logits, [params] * 6, [position + d for d in range(6)])
        alone = [sample(logits[d:d + 1], [params], [position + d])[0] for d in range(6)]
        assert picks == alone
        assert accept_draft(logits, tree, params, position) == accept_tokens(tree, picks)


P = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)


def test_zero_probability_children_are_never_accepted_and_certain_ones_always():
    logits = P.log().float()[None]  # token 3 has probability exactly 0
    certain = torch.tensor([[-math.inf, 0.0, -math.inf]])
    for seed in range(150):
        params = SamplingParams(seed=seed)
        assert accept_draft(logits.expand(2, -1), DraftTree([3], [ROOT]), params).accepted_nodes == []
        result = accept_draft(logits.expand(5, -1), DraftTree([3, 2, 1, 0], [ROOT] * 4), params, seed)
        assert len(result.accepted_nodes) == 1 and result.accepted_nodes[0] in (1, 2, 3)
        assert accept_draft(certain.expand(4, -1), DraftTree([2, 0, 1], [ROOT] * 3), params,
                            seed).accepted_nodes == [2]


def test_filtered_out_children_are_never_accepted():
    # top_k=2 leaves tokens 0 and 1 of P: a child carrying token 2 (p = 0.2 before the filter)
    # is never accepted, and the bonus is never token 2 either.
    logits = P.log().float()[None].expand(2, -1)
    results = [accept_draft(logits, DraftTree([2], [ROOT]), SamplingParams(seed=s, top_k=2))
               for s in range(300)]
    assert all(r.accepted_nodes == [] for r in results)
    assert {r.bonus_token for r in results} == {0, 1}


def test_children_are_accepted_with_their_probability():
    # Children 1 and 0 of P: the root's pick is 1 with p 0.3, 0 with p 0.5, else 2 (the
    # bonus). Over 1500 seeds each frequency is within 4 standard deviations.
    logits = P.log().float()[None].expand(3, -1)
    tree = DraftTree([1, 0], [ROOT, ROOT])
    outcomes = [accept_draft(logits, tree, SamplingParams(seed=s)) for s in range(1500)]
    for nodes, p in (([0], 0.3), ([1], 0.5), ([], 0.2)):
        count = sum(r.accepted_nodes == nodes for r in outcomes)
        assert abs(count - 1500 * p) < 4 * math.sqrt(1500 * p * (1 - p)), (nodes, count)
    assert {r.bonus_token for r in outcomes if not r.accepted_nodes} == {2}


def test_bonus_never_repeats_a_rejected_sibling():
    logits = torch.tensor([[0.0, 0.0, 0.0, -30.0]])  # p ~ 1/3, 1/3, 1/3, 0
    tree = DraftTree([0, 1], [ROOT, ROOT])
    results = [accept_draft(logits.expand(3, 4), tree, SamplingParams(seed=s), 4) for s in range(300)]
    rejected_both = [r for r in results if not r.accepted_nodes]
    assert len(rejected_both) > 50
    assert {r.bonus_token for r in rejected_both} == {2}


def test_sampled_walk_uses_each_nodes_own_row():
    # top_k=1 turns each row into a certainty: the chain matching every row's argmax is
    # accepted whole, and the bonus is the last row's argmax; shifting rows would break it.
    argmaxes = [3, 1, 4, 1, 5]
    tree = DraftTree.chain(argmaxes[:4])
    params = SamplingParams(top_k=1, temperature=0.9, seed=0)
    assert accept_draft(one_hot_rows(argmaxes), tree, params) == Acceptance([0, 1, 2, 3], argmaxes)


# ---------------------------------------------------------------------------- chi-square


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): closed forms for integer dof."""
    half = statistic / 2
    if dof % 2 == 0:
        term = total = math.exp(-half)
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return total
    total = math.erfc(math.sqrt(half))
    term = math.exp(-half) * math.sqrt(half) / math.gamma(1.5)
    for i in range(1, (dof + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return total


@pytest.mark.parametrize("statistic,dof,p_value", [
    (10.828, 1, 0.001), (13.816, 2, 0.001), (16.266, 3, 0.001), (18.467, 4, 0.001),
    (3.841, 1, 0.05), (11.070, 5, 0.05), (49.802, 35, 0.05), (66.619, 35, 0.001),
    (0.0, 7, 1.0),
])
def test_chi2_sf_matches_published_critical_values(statistic, dof, p_value):
    assert chi2_sf(statistic, dof) == pytest.approx(p_value, rel=2e-3)


def joint_target(model: TrigramModel, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] float64: plain sampling's probability of emitting (x1, x2) first."""
    first = filtered_probs(model.logits(prompt), params).double()
    second = torch.stack([filtered_probs(model.logits(prompt + [x]), params).double()
                          for x in range(V)])
    return first[:, None] * second


def goodness_of_fit(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``expected_probs`` (same shape). Cells expected
    under 5 draws are pooled into one; a draw in a cell of probability 0 gives 0.0."""
    counts, expected_probs = counts.flatten().double(), expected_probs.flatten()
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs * counts.sum()
    small = (expected > 0) & (expected < 5)
    observed = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    expected = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2_sf(statistic, int(keep.sum()) - 1)


def first_two_counts(model: TrigramModel, prompt: list[int], params: SamplingParams,
                     draft_for, num_seeds: int, accept=accept_draft) -> torch.Tensor:
    counts = torch.zeros(V, V)
    for seed in range(num_seeds):
        seeded = dataclasses.replace(params, seed=seed)
        x1, x2 = lookahead_tokens(model, prompt, seeded, 2, draft_for, accept)
        counts[x1, x2] += 1
    return counts


MODEL = TrigramModel(seed=7)
PROMPT = [0, 1, 2, 0, 1, 3, 0, 1]


def ranked_tokens(prefix: list[int]) -> list[int]:
    """Tokens by decreasing probability after ``prefix`` (temperature 1, no filter)."""
    return torch.argsort(MODEL.logits(prefix), descending=True).tolist()


def likely_chain(prefix: list[int]) -> DraftTree:
    """The greedy continuation: mostly accepted."""
    chain = []
    for _ in range(4):
        chain.append(ranked_tokens(prefix + chain)[0])
    return DraftTree.chain(chain)


def unlikely_first(prefix: list[int]) -> DraftTree:
    """Root children least likely, most likely, second least likely (filtered out by top-k),
    each with a likely child: sibling order, residuals and rows of deeper nodes all matter."""
    ranked = ranked_tokens(prefix)
    roots = [ranked[-1], ranked[0], ranked[-2]]
    children = [ranked_tokens(prefix + [token])[0] for token in roots]
    return DraftTree(roots + children, [ROOT, ROOT, ROOT, 0, 1, 2])


def every_token(prefix: list[int]) -> DraftTree:
    """All V tokens as root children: the bonus can only follow an accepted child."""
    ranked = ranked_tokens(prefix)
    return DraftTree(ranked[::-1], [ROOT] * V)


def from_drafter(prefix: list[int]) -> DraftTree:
    return Drafter(DrafterConfig(max_context=2), prefix).propose(6, 3)


NUM_SEEDS = 1500


@pytest.mark.parametrize("draft_for", [likely_chain, unlikely_first, every_token, from_drafter])
@pytest.mark.parametrize("params", SAMPLING, ids=SAMPLING_IDS)
def test_first_two_tokens_follow_plain_sampling(params, draft_for):
    counts = first_two_counts(MODEL, PROMPT, params, draft_for, NUM_SEEDS)
    assert goodness_of_fit(counts, joint_target(MODEL, PROMPT, params)) > 1e-3


def test_plain_sampling_passes_the_same_check():
    counts = torch.zeros(V, V)
    for seed in range(NUM_SEEDS):
        x1, x2 = plain_tokens(MODEL, PROMPT, dataclasses.replace(SAMPLING[1], seed=seed), 2)
        counts[x1, x2] += 1
    assert goodness_of_fit(counts, joint_target(MODEL, PROMPT, SAMPLING[1])) > 1e-3


def _generator(params: SamplingParams, position: int) -> torch.Generator:
    return torch.Generator().manual_seed(params.seed * 1000 + position)


def accept_always(logits, tree, params, position) -> Acceptance:
    """Wrong: trusts the first child at every node."""
    gen = _generator(params, position)
    node, accepted = ROOT, []
    while tree.children(node):
        node = tree.children(node)[0]
        accepted.append(node)
    bonus = int(torch.multinomial(filtered_probs(logits[node + 1], params), 1, generator=gen))
    return Acceptance(accepted, [tree.token_ids[n] for n in accepted] + [bonus])


def resample_from_p(logits, tree, params, position) -> Acceptance:
    """Wrong, the classic slip: accept each child with p(x) and, all rejected, sample the
    bonus from p itself instead of the residual."""
    gen = _generator(params, position)
    node, accepted = ROOT, []
    while True:
        probs = filtered_probs(logits[node + 1], params)
        chosen = [c for c in tree.children(node)
                  if float(torch.rand((), generator=gen)) < probs[tree.token_ids[c]]][:1]
        if not chosen:
            bonus = int(torch.multinomial(probs, 1, generator=gen))
            return Acceptance(accepted, [tree.token_ids[n] for n in accepted] + [bonus])
        node = chosen[0]
        accepted.append(node)


def parents_row(logits, tree, params, position) -> Acceptance:
    """Wrong: every node's pick drawn from its parent's row (one row late)."""
    rows = torch.cat([logits[:1], logits[[p + 1 for p in tree.parents]]])
    return accept_draft(rows, tree, params, position)


def one_noise_for_all_rows(logits, tree, params, position) -> Acceptance:
    """Wrong: every row drawn at the root's position, so a node and its parent share noise."""
    picks = sample(logits, [params] * logits.shape[0], [position] * logits.shape[0])
    return accept_tokens(tree, picks)


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_p, parents_row])
def test_the_check_detects_a_wrong_rule(wrong_rule):
    params = SAMPLING[0]
    counts = first_two_counts(MODEL, PROMPT, params, unlikely_first, NUM_SEEDS, wrong_rule)
    assert goodness_of_fit(counts, joint_target(MODEL, PROMPT, params)) < 1e-6


def likely_chain_of(model: TrigramModel):
    def draft(prefix: list[int]) -> DraftTree:
        chain = []
        for _ in range(4):
            chain.append(int(torch.argmax(model.logits(prefix + chain))))
        return DraftTree.chain(chain)
    return draft


def test_exact_equality_detects_rows_sharing_noise():
    # Drawing every row of a verify at the root's position keeps each token's distribution
    # given its prefix, but not plain sampling's tokens: the exact test above catches it.
    params = SamplingParams(seed=8)
    model = TrigramModel(5, spread=0.5)
    plain = plain_tokens(model, PROMPT, params, 32)
    assert lookahead_tokens(model, PROMPT, params, 32, likely_chain_of(model)) == plain
    assert lookahead_tokens(model, PROMPT, params, 32, likely_chain_of(model),
                            one_noise_for_all_rows) != plain


# ---------------------------------------------------------------------------- stats


def test_stats_per_request_and_overall():
    tracker = LookaheadStatsTracker()
    tracker.record("a", num_drafted=8, num_accepted=3)
    tracker.record("a", num_drafted=8, num_accepted=0)
    tracker.record("b", num_drafted=4, num_accepted=4)
    a = tracker.of("a")
    assert (a.num_steps, a.num_drafted, a.num_accepted) == (2, 16, 3)
    assert (a.mean_accepted_per_step, a.mean_tokens_per_step, a.acceptance_rate) == (
        1.5, 2.5, 3 / 16)
    assert tracker.overall.as_dict() == {
        "num_steps": 3, "num_drafted": 20, "num_accepted": 7, "mean_accepted_per_step": 7 / 3,
        "mean_tokens_per_step": 10 / 3, "acceptance_rate": 7 / 20}
    assert tracker.finish("b").num_accepted == 4
    assert tracker.of("b") == LookaheadStats()
    assert tracker.overall.num_steps == 3


def test_empty_stats_and_bad_counts():
    stats = LookaheadStats()
    assert (stats.mean_accepted_per_step, stats.mean_tokens_per_step, stats.acceptance_rate) == (
        0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="between 0 and the 2 drafted tokens, got 3"):
        stats.record(num_drafted=2, num_accepted=3)
    assert stats == LookaheadStats()

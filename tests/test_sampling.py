"""SamplingParams validation, and sampling: filtered probabilities computed by hand, greedy rows,
seeded reproducibility (a seeded row's token depends only on its seed, its output position and
its distribution, never on the rest of the batch), sampled frequencies against the filtered
distribution (and the check's power against a wrong one), and the log-probabilities returned.
Penalties and min-p against hand-computed values are in test_penalties.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from longctx.sampling import (Sampler, SamplingRows, exponential_noise, filtered_probs,
                              penalty_rows, position_seed, sample)
from longctx.sampling_params import MAX_LOGPROBS, SamplingParams

# ---------------------------------------------------------------------------- SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, 0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output) == (
        (), (), False, False)
    assert p.greedy is False
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) == (1.0, 0.0, 0.0, 0.0)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert p.has_penalties is False


@pytest.mark.parametrize("kwargs,penalised", [
    (dict(repetition_penalty=1.0), False), (dict(repetition_penalty=1.1), True),
    (dict(repetition_penalty=0.9), True), (dict(presence_penalty=0.5), True),
    (dict(frequency_penalty=-0.5), True), (dict(min_p=0.2), False), (dict(logprobs=3), False),
])
def test_has_penalties(kwargs, penalised):
    assert SamplingParams(**kwargs).has_penalties is penalised


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).greedy is True
    assert SamplingParams(temperature=0.0).greedy is True
    assert SamplingParams(temperature=1e-6).greedy is True  # below TEMPERATURE_FLOOR (1e-5)
    assert SamplingParams(temperature=1e-4).greedy is False


def test_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_stop_string_becomes_a_one_element_tuple():
    assert SamplingParams(stop="###").stop == ("###",)


def test_stop_list_and_token_ids_become_tuples():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, 7])
    assert p.stop == ("a", "bc")
    assert p.stop_token_ids == (5, 7)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=["3"])


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=0), dict(top_k=1),
    dict(max_tokens=1), dict(seed=0), dict(seed=-5), dict(stop=("x",)),
    dict(repetition_penalty=1e-3), dict(repetition_penalty=1), dict(repetition_penalty=5.0),
    dict(presence_penalty=-2), dict(presence_penalty=2.0), dict(presence_penalty=0.5),
    dict(frequency_penalty=-2.0), dict(frequency_penalty=2), dict(min_p=0), dict(min_p=1.0),
    dict(min_p=0.05), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(prompt_logprobs=0),
    dict(prompt_logprobs=MAX_LOGPROBS),
])
def test_boundary_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(p, key) == value


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", -1), ("temperature", "hot"), ("temperature", None),
    ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", "0.9"),
    ("top_k", -2), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", None),
    ("seed", 1.5), ("seed", "7"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.2), ("repetition_penalty", "1.2"),
    ("repetition_penalty", None), ("repetition_penalty", True), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", "0.5"),
    ("presence_penalty", None), ("presence_penalty", float("nan")),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01), ("frequency_penalty", False),
    ("frequency_penalty", float("nan")),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"), ("min_p", None), ("min_p", float("nan")),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True),
    ("logprobs", "3"),
    ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", 1.0),
    ("prompt_logprobs", False),
])
def test_bad_number_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be ") as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("stop", ["", ("a", ""), ["ok", ""], ("a", 3)])
def test_bad_stop_raises_value_error_naming_the_field(stop):
    with pytest.raises(ValueError, match=r"^stop must be non-empty strings"):
        SamplingParams(stop=stop)


def test_first_bad_field_is_reported():
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0, got -1$"):
        SamplingParams(temperature=-1, top_p=2.0)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), True])
def test_temperature_must_be_finite(value):
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [1e-39, 1e-30, 9e-6])
def test_temperature_below_the_floor_is_greedy(value):
    params = SamplingParams(temperature=value)
    assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=2e-5).greedy


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).stop == ()


def test_stop_token_ids_none_means_none():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_bad_stop_token_id_names_the_field():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=("a",))


# ---------------------------------------------------------------------------- filtered_probs


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == (len(expected),)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32),
                               atol=1e-6, rtol=0)
    # Filtered-out tokens are exactly zero, not merely small.
    assert [i for i, p in enumerate(actual.tolist()) if p == 0.0] == [
        i for i, p in enumerate(expected) if p == 0.0]


FIVE = [0.1, 0.4, 0.05, 0.3, 0.15]  # sorted: 0.4 (1), 0.3 (3), 0.15 (4), 0.1 (0), 0.05 (2)


def test_no_filter_is_softmax():
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams()), FIVE)
    logits = torch.tensor([1.0, 2.0, 3.0])
    e = [math.exp(x) for x in (1.0, 2.0, 3.0)]
    assert_probs(filtered_probs(logits, SamplingParams()), [x / sum(e) for x in e])


@pytest.mark.parametrize("temperature,weights", [
    (1.0, [1, 2, 4]),
    (0.5, [1, 4, 16]),  # logits doubled
    (2.0, [1, math.sqrt(2), 2]),  # logits halved
])
def test_temperature_divides_the_logits(temperature, weights):
    logits = torch.tensor([0.0, math.log(2), 2 * math.log(2)])
    expected = [w / sum(weights) for w in weights]
    assert_probs(filtered_probs(logits, SamplingParams(temperature=temperature)), expected)


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    probs = filtered_probs(logits, SamplingParams(top_k=2))
    z = math.exp(3.0) + math.exp(2.0)
    assert_probs(probs, [0.0, math.exp(3.0) / z, math.exp(2.0) / z, 0.0])
    assert int((probs > 0).sum()) == 2


def test_top_k_one_is_one_hot_at_the_argmax():
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams(top_k=1)), [0, 1, 0, 0, 0])


@pytest.mark.parametrize("top_k", [0, -1, 5, 6, 100])
def test_top_k_off_or_at_least_vocab_keeps_everything(top_k):
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams(top_k=top_k)), FIVE)


@pytest.mark.parametrize("top_p,expected", [
    # Keep the smallest prefix (by probability) whose mass reaches top_p.
    (0.3, [0, 1, 0, 0, 0]),  # 0.4 >= 0.3
    (0.45, [0, 4 / 7, 0, 3 / 7, 0]),  # 0.4 < 0.45 <= 0.7
    (0.65, [0, 4 / 7, 0, 3 / 7, 0]),
    (0.8, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85]),  # 0.7 < 0.8 <= 0.85
    (0.9, [0.1 / 0.95, 0.4 / 0.95, 0, 0.3 / 0.95, 0.15 / 0.95]),  # 0.85 < 0.9 <= 0.95
    (0.96, FIVE),  # 0.95 < 0.96: all five
    (1.0, FIVE),
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected):
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams(top_p=top_p)), expected)


def test_top_p_prefix_with_mass_exactly_p_is_enough():
    # Uniform over 4 tokens: every cumulative mass is exact in fp32 (0.25, 0.5, 0.75). Two
    # tokens reach top_p=0.5 exactly, so the third is dropped. Which two is unspecified (ties).
    probs = filtered_probs(torch.zeros(4), SamplingParams(top_p=0.5))
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_top_p_applies_after_top_k():
    # top_k=3 leaves 0.4, 0.3, 0.15 -> renormalised 0.4706, 0.3529, 0.1765; top_p=0.75 then
    # stops after two tokens (0.8235 >= 0.75). On the unfiltered distribution top_p=0.75 would
    # have kept three (0.7 < 0.75).
    probs = filtered_probs(logits_of(FIVE), SamplingParams(top_k=3, top_p=0.75))
    assert_probs(probs, [0, 4 / 7, 0, 3 / 7, 0])
    probs = filtered_probs(logits_of(FIVE), SamplingParams(top_k=3, top_p=0.85))
    assert_probs(probs, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])


def test_top_p_applies_after_temperature():
    # T=0.5 squares the probabilities: 0.25, 0.09, 0.04 -> 0.6579, 0.2368, 0.1053, so top_p=0.6
    # keeps one token; at T=1 (0.5, 0.3, 0.2) it keeps two.
    logits = logits_of([0.5, 0.3, 0.2])
    assert_probs(filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.6)), [1, 0, 0])
    assert_probs(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.6)),
                 [0.625, 0.375, 0])
    assert_probs(filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.7)),
                 [0.25 / 0.34, 0.09 / 0.34, 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_filtered_probs_are_fp32_for_any_logit_dtype(dtype):
    logits = torch.tensor([0.0, 1.0, 2.0], dtype=dtype)
    probs = filtered_probs(logits, SamplingParams(top_p=0.9))
    assert probs.dtype == torch.float32
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)


def test_min_p_applies_after_top_p():
    # FIVE under top_p=0.8 keeps 0.4, 0.3, 0.15 (renormalised /0.85); min_p=0.5 then drops what
    # is under half the most likely token's probability: 0.15 < 0.2. min_p is a ratio to the
    # maximum, so renormalising first does not move the cut.
    probs = filtered_probs(logits_of(FIVE), SamplingParams(top_p=0.8, min_p=0.5))
    assert_probs(probs, [0, 4 / 7, 0, 3 / 7, 0])
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams(min_p=0.2)),  # floor 0.08
                 [0.1 / 0.95, 0.4 / 0.95, 0, 0.3 / 0.95, 0.15 / 0.95])
    assert_probs(filtered_probs(logits_of(FIVE), SamplingParams(min_p=0.3)),  # floor 0.12
                 [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])


# ---------------------------------------------------------------------------- sample

GREEDY = SamplingParams(temperature=0.0)


def test_all_greedy_batch_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9],
                           [5.0, 4.0, 3.0, 2.0],
                           [0.0, 0.0, 0.0, 7.0],
                           [1.0, 3.0, 3.0, 0.0]])  # a tie: the first maximum
    tokens = sample(logits, [GREEDY] * 4)
    assert tokens == [1, 0, 3, 1]
    assert all(type(t) is int for t in tokens)


def test_greedy_ignores_seed_and_position():
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0]])
    for position in (0, 1, 17):
        assert sample(logits, [SamplingParams(temperature=0.0, seed=position)], [position]) == [1]


def test_mixed_batch_greedy_rows_use_argmax():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0],
                           [3.0, 0.0, 1.0, 9.0],
                           [0.0, 0.0, 0.0, 0.0]])
    top1 = SamplingParams(top_k=1, temperature=1e3, seed=0)  # only the argmax survives
    assert sample(logits, [GREEDY, top1, GREEDY]) == [2, 3, 0]


def test_mixed_batch_samples_the_non_greedy_rows():
    # Row 0 is greedy (argmax 3); row 1 keeps only token 0 under top_p (it holds > 0.99 of the
    # mass); row 2 is flat and seeded, sampled at a new position every time.
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0],
                           [20.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0]])
    peaked = SamplingParams(top_p=0.5, seed=1)
    flat = SamplingParams(seed=4)
    rows = [sample(logits, [GREEDY, peaked, flat], [i, i, i]) for i in range(40)]
    assert all(r[:2] == [3, 0] for r in rows)
    assert {r[2] for r in rows} == {0, 1, 2, 3}


def test_rows_and_params_must_agree():
    with pytest.raises(ValueError, match="3 logits rows for 2 sampling rows"):
        Sampler().sample(torch.zeros(3, 4), SamplingRows.of([GREEDY, GREEDY]))


def draw(params: SamplingParams, logits: torch.Tensor, n: int, start: int = 0) -> list[int]:
    """``n`` tokens from ``logits``: one row per output position ``start .. start + n - 1``."""
    return sample(logits.expand(n, -1), [params] * n, list(range(start, start + n)))


FLAT = torch.zeros(50)


def test_position_seed_is_a_fixed_63_bit_mix():
    seeds = {position_seed(s, i) for s in range(-3, 30) for i in range(30)}
    assert len(seeds) == 33 * 30  # distinct for distinct (seed, position) pairs
    assert all(0 <= x < 1 << 63 for x in seeds)
    assert position_seed(7, 3) == position_seed(7, 3)
    assert position_seed(7, 3) != position_seed(3, 7)
    assert 0 <= position_seed(2**64 - 1, 10**9) < 1 << 63  # huge seeds are fine too


def test_same_seed_reproduces_tokens():
    p = SamplingParams(seed=1234)
    first, second = draw(p, FLAT, 200), draw(p, FLAT, 200)
    assert first == second
    assert len(set(first)) > 20  # really random, not a constant


def test_different_seeds_differ():
    a = draw(SamplingParams(seed=1), FLAT, 200)
    b = draw(SamplingParams(seed=2), FLAT, 200)
    assert a != b
    assert sum(x == y for x, y in zip(a, b)) < 20  # ~4 expected at 1/50 per draw


def test_positions_of_one_seed_are_independent_draws():
    # Position i + 1 is not position i's draw shifted or repeated.
    p = SamplingParams(seed=77)
    a, b = draw(p, FLAT, 200, start=0), draw(p, FLAT, 200, start=1)
    assert a[1:] == b[:-1]
    assert sum(x == y for x, y in zip(a, b)) < 20
    assert sum(x == y for x, y in zip(a, a[1:])) < 20


def test_unseeded_draws_differ():
    p = SamplingParams()
    assert draw(p, FLAT, 200) != draw(p, FLAT, 200)


def test_sampler_generator_makes_unseeded_rows_reproducible():
    rows = SamplingRows.of([SamplingParams()] * 200)
    a = Sampler(torch.Generator().manual_seed(5)).sample(FLAT.expand(200, -1), rows).tokens
    b = Sampler(torch.Generator().manual_seed(5)).sample(FLAT.expand(200, -1), rows).tokens
    assert torch.equal(a, b) and len(set(a.tolist())) > 20


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    seeded = SamplingParams(seed=99, top_p=0.9)
    alone = [sample(FLAT[None], [seeded], [i])[0] for i in range(50)]
    assert len(set(alone)) > 10
    other = SamplingParams(seed=5, top_k=3, temperature=0.5)
    unseeded = SamplingParams(min_p=0.5)
    penalised = SamplingParams(seed=5, repetition_penalty=1.5)
    mixed = []
    for i in range(50):
        batch = torch.stack([FLAT, FLAT, torch.arange(50.0), torch.randn(50), FLAT])
        params = [other, seeded, GREEDY, unseeded, penalised]
        positions = [i + 3, i, 0, 7, i]
        order = [1, 0, 2, 4, 3] if i % 2 else [0, 1, 2, 3, 4]  # the seeded row moves around
        tokens = sample(batch[order], [params[j] for j in order], [positions[j] for j in order])
        assert tokens[order.index(2)] == 49
        mixed.append(tokens[order.index(1)])
    assert mixed == alone


def test_exponential_noise_of_a_seeded_row_depends_on_seed_and_position_only():
    p = SamplingParams(seed=3)
    rows = SamplingRows.of([SamplingParams(), p, p], [9, 4, 5])
    noise = exponential_noise(rows, (3, 8), torch.device("cpu"))
    alone = exponential_noise(SamplingRows.of([p], [4]), (1, 8), torch.device("cpu"))
    assert torch.equal(noise[1], alone[0])
    assert not torch.equal(noise[1], noise[2])
    assert bool((noise > 0).all())


# Chi-square critical values at significance 0.001, by degrees of freedom (no scipy needed).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


def assert_frequencies(tokens: list[int], expected: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    assert int(counts.sum()) == len(tokens)
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "sampled a filtered-out token"
    exp_counts = expected[allowed] * len(tokens)
    chi2 = float(((counts[allowed] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < CHI2_999[int(allowed.sum()) - 1], (chi2, counts.tolist(), exp_counts.tolist())


FREQUENCY_CASES = [
    (SamplingParams(seed=11, top_p=0.8), 20_000),
    (SamplingParams(seed=12, temperature=0.7), 10_000),
    (SamplingParams(seed=13, top_k=3, temperature=1.5), 10_000),
    (SamplingParams(seed=14, min_p=0.3, temperature=1.2), 10_000),
]


@pytest.mark.parametrize("params,num_draws", FREQUENCY_CASES)
def test_sampled_frequencies_match_filtered_probs(params, num_draws):
    # One seed, num_draws output positions: each position's draw is an exact sample.
    logits = logits_of(FIVE)
    assert_frequencies(draw(params, logits, num_draws), filtered_probs(logits, params).double())


@pytest.mark.parametrize("params,num_draws", FREQUENCY_CASES)
def test_seed_by_seed_frequencies_match_filtered_probs(params, num_draws):
    # One position, num_draws seeds: what a run of many seeded requests sees.
    logits = logits_of(FIVE)
    tokens = [sample(logits[None], [dataclasses.replace(params, seed=s)], [3])[0]
              for s in range(num_draws // 4)]
    assert_frequencies(tokens, filtered_probs(logits, params).double())


@pytest.mark.parametrize("params,num_draws", FREQUENCY_CASES)
def test_unseeded_batched_frequencies_match_filtered_probs(params, num_draws):
    logits = logits_of(FIVE)
    unseeded = dataclasses.replace(params, seed=None)
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = sampler.sample(logits.expand(num_draws, -1), SamplingRows.of([unseeded] * num_draws)).tokens
    assert_frequencies(tokens.tolist(), filtered_probs(logits, params).double())


def test_frequency_check_rejects_the_wrong_distribution():
    # The check above has power: unfiltered draws fail it against top_p=0.8's probabilities.
    logits = logits_of(FIVE)
    counts = torch.bincount(torch.tensor(draw(SamplingParams(seed=11), logits, 20_000)),
                            minlength=5).double()
    assert counts[0] > 0 and counts[2] > 0  # filtered-out tokens under top_p=0.8
    wrong = filtered_probs(logits, SamplingParams(top_p=0.8)).double()
    kept = wrong > 0
    exp_counts = wrong[kept] * 20_000
    chi2 = float(((counts[kept] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 > CHI2_999[2]
    # ... and a distribution off by a temperature of 0.8 instead of 0.7 fails it too.
    tokens = draw(SamplingParams(seed=12, temperature=0.8), logits, 10_000)
    with pytest.raises(AssertionError):
        assert_frequencies(tokens, filtered_probs(logits, SamplingParams(temperature=0.7)).double())


# ---------------------------------------------------------------------------- logprobs


def test_no_logprobs_unless_asked():
    result = Sampler().sample(torch.randn(2, 6), SamplingRows.of([GREEDY, SamplingParams(seed=1)]))
    assert result.logprobs is None and result.top_ids is None
    assert set(result.to_host().host) == {"tokens"}


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5],
                           [3.0, 0.0, 0.0, 0.0, 0.0]])
    # Row 0 greedy with a penalty on token 1 (which was the argmax): the chosen token is 2,
    # but the reported log-probabilities are the model's, before the penalty.
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=4.0),
              SamplingParams(temperature=0.0, logprobs=1)]
    rows = SamplingRows.of(params, [0, 0], penalty_rows([[1], []], [[], []], 5, "cpu"))
    result = Sampler().sample(logits, rows).to_host()
    raw = torch.log_softmax(logits, dim=-1)
    assert result.host["tokens"] == [2, 0]
    assert rows.num_logprobs == 3 and rows.want_logprobs
    torch.testing.assert_close(torch.tensor(result.host["logprobs"]), raw[[0, 1], [2, 0]])
    assert result.host["top_ids"][0] == [1, 2, 4]
    assert result.host["top_ids"][1][0] == 0  # then three tied tokens, in any order
    torch.testing.assert_close(torch.tensor(result.host["top_logprobs"][0]), raw[0, [1, 2, 4]])
    assert all(lp <= 0 for row in result.host["top_logprobs"] for lp in row)


def test_zero_logprobs_gives_only_the_chosen_token():
    rows = SamplingRows.of([SamplingParams(temperature=0.0, logprobs=0), GREEDY])
    assert rows.want_logprobs and rows.num_logprobs == 0
    result = Sampler().sample(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), rows)
    assert result.top_ids.shape == (2, 0)
    torch.testing.assert_close(result.logprobs, torch.log_softmax(torch.tensor([1.0, 0.0]), 0)[[0, 0]])

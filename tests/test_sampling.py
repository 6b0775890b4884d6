"""SamplingParams validation, and sampling: filtered probabilities computed by hand, greedy rows,
seeded reproducibility, and sampled frequencies against the filtered distribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from longctx.sampling import filtered_probs, make_generator, sample
from longctx.sampling_params import SamplingParams

# ---------------------------------------------------------------------------- SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, 0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output) == (
        (), (), False, False)
    assert p.greedy is False


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).greedy is True
    assert SamplingParams(temperature=0.0).greedy is True
    assert SamplingParams(temperature=1e-6).greedy is False


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
    with pytest.raises(ValueError, match=r"^temperature must be a number >= 0, got -1$"):
        SamplingParams(temperature=-1, top_p=2.0)


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


# ---------------------------------------------------------------------------- sample


def test_make_generator_is_none_for_greedy():
    assert make_generator(SamplingParams(temperature=0.0, seed=3)) is None


def test_all_greedy_batch_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9],
                           [5.0, 4.0, 3.0, 2.0],
                           [0.0, 0.0, 0.0, 7.0],
                           [1.0, 3.0, 3.0, 0.0]])  # a tie: the first maximum
    greedy = SamplingParams(temperature=0.0)
    tokens = sample(logits, [greedy] * 4, [None] * 4)
    assert tokens == [1, 0, 3, 1]
    assert all(type(t) is int for t in tokens)


def test_mixed_batch_greedy_rows_use_argmax():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0],
                           [3.0, 0.0, 1.0, 9.0],
                           [0.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    top1 = SamplingParams(top_k=1, temperature=1e3, seed=0)  # only the argmax survives
    params = [greedy, top1, greedy]
    gens = [make_generator(p) for p in params]
    assert gens[0] is None and gens[2] is None
    assert sample(logits, params, gens) == [2, 3, 0]


def test_mixed_batch_samples_the_non_greedy_rows():
    # Row 0 is greedy (argmax 3); row 1 keeps only token 0 under top_p (it holds > 0.99 of the
    # mass); row 2 is flat and seeded, so the batch takes the per-row path.
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0],
                           [20.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    peaked = SamplingParams(top_p=0.5, seed=1)
    flat = SamplingParams(seed=4)
    gens = [None, make_generator(peaked), make_generator(flat)]
    rows = [sample(logits, [greedy, peaked, flat], gens) for _ in range(40)]
    assert all(r[:2] == [3, 0] for r in rows)
    assert {r[2] for r in rows} == {0, 1, 2, 3}


def draw(params: SamplingParams, logits: torch.Tensor, n: int,
         gen: torch.Generator | None = None) -> list[int]:
    gen = gen if gen is not None else make_generator(params)
    return sample(logits.expand(n, -1), [params] * n, [gen] * n)


FLAT = torch.zeros(50)


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


def test_unseeded_generators_differ():
    p = SamplingParams()
    assert draw(p, FLAT, 200) != draw(p, FLAT, 200)


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    seeded = SamplingParams(seed=99, top_p=0.9)
    other = SamplingParams(seed=5)
    alone, gen_alone = [], make_generator(seeded)
    for _ in range(50):
        alone += sample(FLAT[None], [seeded], [gen_alone])
    mixed = []
    gen_seeded, gen_other = make_generator(seeded), make_generator(other)
    greedy = SamplingParams(temperature=0.0)
    for i in range(50):
        batch = torch.stack([FLAT, FLAT, torch.arange(50.0)])
        params = [other, seeded, greedy] if i % 2 else [seeded, other, greedy]
        gens = [gen_other, gen_seeded, None] if i % 2 else [gen_seeded, gen_other, None]
        tokens = sample(batch, params, gens)
        assert tokens[2] == 49
        mixed.append(tokens[1] if i % 2 else tokens[0])
    assert mixed == alone


# Chi-square critical values at significance 0.001, by degrees of freedom (no scipy needed).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


@pytest.mark.parametrize("params,num_draws", [
    (SamplingParams(seed=11, top_p=0.8), 20_000),
    (SamplingParams(seed=12, temperature=0.7), 10_000),
    (SamplingParams(seed=13, top_k=3, temperature=1.5), 10_000),
])
def test_sampled_frequencies_match_filtered_probs(params, num_draws):
    logits = logits_of(FIVE)
    expected = filtered_probs(logits, params).double()
    counts = torch.bincount(torch.tensor(draw(params, logits, num_draws)), minlength=5).double()
    assert int(counts.sum()) == num_draws
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "sampled a filtered-out token"
    exp_counts = expected[allowed] * num_draws
    chi2 = float(((counts[allowed] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < CHI2_999[int(allowed.sum()) - 1], (chi2, counts.tolist(), exp_counts.tolist())


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

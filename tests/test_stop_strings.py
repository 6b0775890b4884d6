"""Stop strings: ``StopMatcher`` (Aho-Corasick over the request's strings, fed the new text
only) against brute force, its cost per character independent of how many strings there are,
the engine's limits (``max_stop_strings``, ``max_stop_length``) in the API and the server, and
stops across token boundaries through the real engine."""

from __future__ import annotations

import random

import pytest

from longctx import LLM, SamplingParams
from longctx.engine.output_processor import partial_stop_len
from longctx.engine.stop_matcher import StopMatcher


def brute_first_match(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(index, end) of the stop ending earliest in ``text`` (of those ending at one place the
    longest; of equal ones the first given)."""
    best = None
    for end in range(1, len(text) + 1):
        for i, s in sorted(enumerate(stops), key=lambda x: (-len(x[1]), x[0])):
            if text[:end].endswith(s):
                return i, end
    return best


@pytest.mark.parametrize("seed", range(30))
def test_matcher_equals_brute_force(seed):
    rng = random.Random(seed)
    alphabet = "abc"
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 8))})
    text = "".join(rng.choice(alphabet) for _ in range(40))
    matcher = StopMatcher(stops)
    fed = 0
    found = None
    while fed < len(text):  # fed in random pieces, as tokens add text
        piece = text[fed:fed + rng.randint(1, 4)]
        hit = matcher.feed(piece)
        if hit is not None:
            found = (hit[0], fed + hit[1])
            break
        fed += len(piece)
        assert matcher.pending == partial_stop_len(text[:fed], stops)
    want = brute_first_match(text, stops)
    if want is None:
        assert found is None
    else:
        assert found is not None and found[1] == want[1] and len(stops[found[0]]) == len(stops[want[0]])


@pytest.mark.parametrize("length", [400, pytest.param(4000, marks=pytest.mark.slow)])
def test_cost_per_character_does_not_grow_with_the_strings(monkeypatch, length):
    """2,000 strings of 4,000 characters (the issue's case; `slow`, ~35 s to build the automaton)
    or of 400: one automaton step per character fed, as for 2 strings (today's loop compared
    every string at every token)."""
    rng = random.Random(1)
    many = tuple("".join(rng.choice("xyz") for _ in range(length)) for _ in range(2000))
    calls = {"n": 0}
    real = StopMatcher._step

    def counting(self, node, ch):
        calls["n"] += 1
        return real(self, node, ch)

    monkeypatch.setattr(StopMatcher, "_step", counting)
    for stops in (many, many[:2]):
        matcher = StopMatcher(stops)
        calls["n"] = 0
        assert matcher.feed("the answer is 42. " * 50) is None
        assert calls["n"] == 900


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2-135m", lookahead=False, max_stop_strings=4, max_stop_length=10) as engine:
        yield engine


def test_limits_are_enforced_with_a_clear_error(llm):
    with pytest.raises(ValueError, match="stop has 5 strings; at most 4 are allowed"):
        llm.generate("Hello", SamplingParams(max_tokens=2, stop=["a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match="a stop string has 11 characters; at most 10"):
        llm.generate("Hello", SamplingParams(max_tokens=2, stop=["x" * 11]))


def test_stop_string_across_tokens_cuts_the_text(llm):
    """The text up to a stop string the greedy output reaches, whichever tokens carry it."""
    prompt = "Count from one to ten: one, two, three,"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    cut = full.find("six")
    assert cut > 0, full
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=["zzz", "six"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full[:cut]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=["six"],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[:cut + 3]

"""LookaheadController's adaptive draft size, exactly: the size after each kind of step, when
drafting pauses and for how long, and how it probes again. No torch, no model."""

from __future__ import annotations

from longctx.config import LookaheadConfig
from longctx.lookahead.controller import (MAX_PAUSE, MISSES_BEFORE_PAUSE, PROBE_SIZE,
                                          LookaheadController)

# A prompt that repeats, so the drafter always has a continuation to propose.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 8


def controller(max_tokens: int = 8) -> LookaheadController:
    ctl = LookaheadController(LookaheadConfig(lookahead_max_tokens=max_tokens))
    ctl.add("r", PROMPT, shared=False)
    return ctl


def size_of(ctl: LookaheadController) -> int:
    return ctl._requests["r"].size


def pause_of(ctl: LookaheadController) -> int:
    return ctl._requests["r"].pause


def drafts(ctl: LookaheadController) -> bool:
    return len(ctl.propose("r", 62)) > 0


def step(ctl: LookaheadController, accepted: int, drafted: int = 8) -> None:
    """A verify step that drafted ``drafted`` and accepted ``accepted`` (plus the bonus token)."""
    ctl.commit("r", [1] * (accepted + 1), drafted, accepted)


def test_size_is_twice_the_accepted_within_bounds():
    ctl = controller(max_tokens=8)
    assert size_of(ctl) == 8
    step(ctl, accepted=3)
    assert size_of(ctl) == 6
    step(ctl, accepted=2)
    assert size_of(ctl) == 4
    step(ctl, accepted=7)
    assert size_of(ctl) == 8  # capped at the maximum
    step(ctl, accepted=1)
    assert size_of(ctl) == PROBE_SIZE == 2  # at least the probe size


def test_fruitless_steps_halve_the_size():
    ctl = controller(max_tokens=8)
    step(ctl, accepted=0)
    assert size_of(ctl) == 4
    step(ctl, accepted=0)
    assert size_of(ctl) == 2


def test_three_misses_pause_then_probe_small():
    ctl = controller()
    for _ in range(MISSES_BEFORE_PAUSE):
        assert drafts(ctl)
        step(ctl, accepted=0)
    assert pause_of(ctl) == 4 and size_of(ctl) == PROBE_SIZE
    assert [drafts(ctl) for _ in range(5)] == [False, False, False, False, True]
    assert len(ctl.propose("r", 62)) <= PROBE_SIZE


def test_any_accept_resets_the_misses():
    ctl = controller()
    for accepted in (0, 0, 1, 0, 0):
        step(ctl, accepted=accepted)
    assert pause_of(ctl) == 0
    step(ctl, accepted=0)
    assert pause_of(ctl) == 4


def test_pauses_double_up_to_the_cap_and_reset_after_an_accept():
    ctl = controller()
    pauses = []
    for _ in range(7):
        for _ in range(MISSES_BEFORE_PAUSE):
            step(ctl, accepted=0)
        pauses.append(pause_of(ctl))
        ctl._requests["r"].pause = 0  # skip the wait
    assert pauses == [4, 8, 16, 32, 64, 64, 64] and MAX_PAUSE == 64
    step(ctl, accepted=2)
    for _ in range(MISSES_BEFORE_PAUSE):
        step(ctl, accepted=0)
    assert pause_of(ctl) == 4


def test_plain_steps_do_not_adapt_or_count():
    ctl = controller()
    ctl.commit("r", [9], 0, 0)
    assert size_of(ctl) == 8 and ctl._requests["r"].misses == 0
    assert ctl.request_stats("r").num_steps == 0


def test_draft_is_cut_to_the_room_left():
    ctl = controller(max_tokens=8)
    assert len(ctl.propose("r", 3)) <= 3
    assert len(ctl.propose("r", 0)) == 0
    assert len(ctl.propose("unknown", 8)) == 0

"""A rank that dies, hangs or raises ends the run with a clear error in bounded time: the
surviving ranks notice by themselves (a failed transfer, or the group timeout) and report
it, and the launcher names every rank's fate."""

from __future__ import annotations

import time

import pytest
from sp_cases import die_during_ring, hang_during_ring, raise_on_rank

from longctx.parallel import WorkerError, spawn_ranks


def test_a_dead_rank_makes_the_others_fail_fast():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn_ranks(die_during_ring, 3, (1,), timeout_s=120, group_timeout_s=60)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert "exited with code 7" in failures[1]
    for survivor in (0, 2):  # their own errors, well before the 60 s group timeout
        assert failures[survivor].startswith("RuntimeError") and "killed" not in failures[survivor]
    assert elapsed < 45, f"took {elapsed:.0f} s"


def test_a_hung_rank_trips_the_group_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn_ranks(hang_during_ring, 2, (1,), timeout_s=120, group_timeout_s=3, grace_s=2)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert failures[0].startswith("RuntimeError")  # rank 0's transfer timed out
    assert "killed" in failures[1]  # the sleeper never returns: the launcher kills it
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_an_exception_on_one_rank_is_reported_with_its_message():
    with pytest.raises(WorkerError, match="rank 1: ValueError: a deliberate failure") as info:
        spawn_ranks(raise_on_rank, 2, (1,), timeout_s=120, group_timeout_s=60)
    assert "Traceback" in info.value.tracebacks[1]

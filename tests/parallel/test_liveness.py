"""``longctx.parallel.liveness`` in one process: a worker whose counter stops changing is named
once ``stale_s`` has passed and forgiven once it beats again; a watch whose reads fail or
hang says so instead of vouching for the ranks; a child's stderr is passed on and its last
traceback quoted; the error line of a traceback is found as Python prints it; beats and
watches stop when told and at exit (a beat left running aborted the process as it ended)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from longctx.parallel.liveness import RankWatch, SharedBeats, StderrTap, last_error, start_heartbeat

STALE_S, INTERVAL_S = 0.6, 0.05


def _until(check, timeout: float) -> float | None:
    """Seconds until ``check()`` held, or None past ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def test_a_silent_rank_is_named_after_stale_s_and_forgiven_when_it_beats():
    beats = SharedBeats(3)
    beating = [start_heartbeat(beats, 1, INTERVAL_S)]  # rank 1 beats, rank 2 never does
    watch = RankWatch(3, beats, stale_s=STALE_S, interval_s=INTERVAL_S)
    try:
        assert watch.problem() is None
        took = _until(lambda: watch.problem() is not None, 5)
        assert took is not None and STALE_S - 0.1 < took < STALE_S + 1.0, took
        assert re.fullmatch(r"rank 2 has sent no heartbeat for \d+ s \(stopped, frozen, or its machine is "
                            r"unreachable\)", watch.problem()), watch.problem()
        beating.append(start_heartbeat(beats, 2, INTERVAL_S))
        assert _until(lambda: watch.problem() is None, 2) is not None
        time.sleep(2 * STALE_S)  # both beat: nothing to report, however long
        assert watch.problem() is None
    finally:
        watch.close()
        for beat in beating:
            beat.stop()
    assert watch.problem() is None  # closed: no opinion


class _Procs:
    """A stand-in for ``multiprocessing.Process``: only ``exitcode``."""

    def __init__(self, exitcode: int | None = None) -> None:
        self.exitcode = exitcode


def test_a_stopped_heartbeat_no_longer_beats():
    beats = SharedBeats(2)
    beat = start_heartbeat(beats, 1, 0.01)
    assert _until(lambda: beats.read(1) > 2, 5) is not None
    beat.stop()
    assert not beat.thread.is_alive()
    count = beats.read(1)
    time.sleep(0.1)
    assert beats.read(1) == count


EXITING = r"""
import time
from longctx.parallel.liveness import RankWatch, SharedBeats, start_heartbeat
beats = SharedBeats(4)
for rank in range(1, 4):
    start_heartbeat(beats, rank, 0.0)  # bump without pause: a tensor op under way at exit
watch = RankWatch(4, beats, stale_s=5.0, interval_s=0.001)
time.sleep(0.3)
print(beats.read(1) > 0)
"""


def test_a_process_with_beats_and_a_watch_running_exits_cleanly():
    """The beat and watch threads are daemons busy in tensor ops; at exit they used to be cut
    off inside torch's C++ (pthread_exit's unwind reaching std::terminate: exit 134, after
    a whole test run had passed). Without the stop at exit, about 4 processes in 10 aborted
    here; 8 of them at once, so one is all but sure to."""
    procs = [subprocess.Popen([sys.executable, "-c", EXITING], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip() == "True", (proc.returncode, err[-2000:])


def test_an_exited_local_worker_is_named_at_once():
    beats = SharedBeats(3)
    beating = [start_heartbeat(beats, rank, INTERVAL_S) for rank in (1, 2)]
    procs = [_Procs(), _Procs()]
    watch = RankWatch(3, beats, procs, lambda rank, code: f"rank {rank} is gone ({code})",
                      stale_s=STALE_S, interval_s=INTERVAL_S)
    try:
        assert watch.problem() is None
        procs[1].exitcode = -9
        assert watch.problem() == "rank 2 is gone (-9)"
    finally:
        watch.close()
        for beat in beating:
            beat.stop()


class _FlakyBeats:
    """Reads that fail, or hang until released."""

    def __init__(self) -> None:
        self.mode = "fail"
        self.release = threading.Event()

    def bump(self, rank: int) -> None:
        pass

    def read(self, rank: int) -> int:
        if self.mode == "fail":
            raise ConnectionError("store gone")
        self.release.wait()
        return 0


def test_a_watch_that_cannot_read_says_so():
    beats = _FlakyBeats()
    watch = RankWatch(2, beats, stale_s=STALE_S, interval_s=INTERVAL_S)
    try:
        assert _until(lambda: watch.problem() is not None, 2) is not None
        assert watch.problem() == "the ranks' heartbeats cannot be read (ConnectionError: store gone)"
        beats.mode = "hang"
        assert _until(lambda: "could not be read for" in (watch.problem() or ""), STALE_S + 2) is not None
    finally:
        beats.release.set()
        watch.close()


CHILD = r"""
import sys
print("a warning first", file=sys.stderr, flush=True)
def load():
    raise MemoryError("no room for the pages\n    (second line of the message)")
load()
"""


def test_stderr_tap_passes_on_and_quotes_the_last_traceback(capfd):
    tap = StderrTap()
    with tap.as_stderr():
        child = subprocess.Popen([sys.executable, "-c", CHILD])
    assert child.wait(60) == 1
    assert tap.last_error(10) == "MemoryError: no room for the pages (second line of the message)"
    err = capfd.readouterr().err
    assert "a warning first" in err and "Traceback (most recent call last)" in err and "in load" in err


def test_last_error_finds_the_final_exception():
    chained = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    f()\n"
               "KeyError: 'x'\n\nThe above exception was the direct cause of the following exception:\n\n"
               "Traceback (most recent call last):\n  File \"b.py\", line 2, in g\n    raise RuntimeError(m)\n"
               "RuntimeError: \n        An attempt has been made to start a new process\n"
               "        before the current process has finished.\n")
    assert last_error(chained) == ("RuntimeError: An attempt has been made to start a new process before the "
                                   "current process has finished.")
    assert last_error("loading...\nKilled\n\n") == "Killed"
    assert last_error("") == ""
    assert last_error("x" * 50, limit=10) == "xxxxxxx..."

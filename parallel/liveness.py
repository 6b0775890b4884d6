"""Whether every rank is still there, as rank 0 sees it between exchanges: what ``/health``
reads, and how a start-up names a rank that died instead of waiting for the rendezvous's
timeout.

Owns: heartbeats (``start_heartbeat`` / ``Heartbeat``: a worker's thread bumps its counter every
``BEAT_INTERVAL_S``, in shared memory for ranks rank 0 spawned on its host (``SharedBeats``),
or in the process group's store, which torchrun's ranks on other machines reach too
(``StoreBeats``)); ``RankWatch`` (rank 0: local workers' exit codes, looked up when asked, and
every worker's heartbeat age, sampled by a thread so that asking never blocks); and
``StderrTap`` (a spawned worker's stderr through a pipe, passed on to ours as it comes, its
tail kept so that an error can quote the rank's own last words).
Never: deciding what a failure does to requests (the engine and the server do), or any
exchange of the ranks' work.

Why a counter, not a time: ranks on other machines have other clocks. Rank 0 notes when it
last saw each counter change; a rank is stale when that is more than ``BEAT_STALE_S`` ago.
The beat is a thread of its own, so a rank deep in a long step still beats: torch's kernels,
the C kernels (through ctypes) and gloo's waits release the GIL, and Python hands it over
every few milliseconds anyway. What stops the beat is a stopped or frozen process, or a
machine (or its network) gone.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
import time
from typing import Any, Callable, Protocol, Sequence

import torch

BEAT_INTERVAL_S = 1.0  # a worker bumps its counter this often; rank 0 samples as often
BEAT_STALE_S = 10.0  # no change for this long: the rank is reported (far below sp_timeout_s)
STORE_PREFIX = "longctx/heartbeat/"
TAIL_BYTES = 16384  # of a worker's stderr, kept for error messages
ERROR_CHARS = 1000  # the most of it an error message quotes
EXIT_JOIN_S = 2.0  # at exit, how long each beat or watch thread is waited for


class Beats(Protocol):
    def bump(self, rank: int) -> None: ...

    def read(self, rank: int) -> int: ...


class SharedBeats:
    """One counter per rank in shared memory: made by rank 0 before it spawns the workers,
    handed to them with their arguments."""

    def __init__(self, world: int) -> None:
        self.counts = torch.zeros(world, dtype=torch.int64).share_memory_()

    def bump(self, rank: int) -> None:
        self.counts[rank] += 1  # one writer per counter

    def read(self, rank: int) -> int:
        return int(self.counts[rank])


class StoreBeats:
    """One counter per rank in a torch.distributed store (torchrun's TCP store): any machine."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def bump(self, rank: int) -> None:
        self.store.add(f"{STORE_PREFIX}{rank}", 1)

    def read(self, rank: int) -> int:
        return int(self.store.add(f"{STORE_PREFIX}{rank}", 0))  # (add never waits for the key)


class Heartbeat:
    """A daemon thread bumping ``rank``'s counter every ``interval_s`` until ``stop()`` (or the
    process's exit). A failed bump (the store is gone) ends the beat: rank 0's watch then
    reports the silence."""

    def __init__(self, beats: Beats, rank: int, interval_s: float = BEAT_INTERVAL_S) -> None:
        self.beats, self.rank, self.interval_s = beats, rank, interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"longctx-sp-heartbeat-{rank}", daemon=True)
        _stop_at_exit(self)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.beats.bump(self.rank)
            except Exception:  # noqa: BLE001 - nobody to tell but the silence
                return
            self._stop.wait(self.interval_s)


def start_heartbeat(beats: Beats, rank: int, interval_s: float = BEAT_INTERVAL_S) -> Heartbeat:
    """Bump ``rank``'s counter every ``interval_s`` from a daemon thread, until stopped or the
    process exits."""
    return Heartbeat(beats, rank, interval_s)


# The threads above touch tensors (``counts[rank] += 1``, ``int(counts[rank])``), which
# releases the GIL inside torch's C++. A daemon thread still running at interpreter exit is
# ended by pthread_exit when it next takes the GIL, and that unwind through torch's C++
# frames calls std::terminate: the process aborts (exit 134) after its work is done (seen at
# the end of a test run). So every beat and watch of the process is stopped and joined by
# atexit, which runs before the daemon threads are cut off.
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _stop_at_exit(owner: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.add(owner)


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        owners = list(_LIVE)
    for owner in owners:  # a thread stuck in a store call is left after EXIT_JOIN_S
        owner.stop(EXIT_JOIN_S) if isinstance(owner, Heartbeat) else owner.close(EXIT_JOIN_S)


class RankWatch:
    """Rank 0's view of workers ``1..world-1``: ``problem()`` names the first one that exited
    (``procs``: the ones this process spawned, by rank order) or whose heartbeat is stale.
    A sampling thread reads the counters; ``problem()`` only reads what it found, so it
    answers at once even when the store does not."""

    def __init__(self, world: int, beats: Beats, procs: Sequence[Any] = (),
                 describe_exit: Callable[[int, int], str] | None = None,
                 stale_s: float = BEAT_STALE_S, interval_s: float = BEAT_INTERVAL_S) -> None:
        self.world, self.beats, self.procs = world, beats, list(procs)
        self.describe_exit = describe_exit or (lambda rank, code: f"rank {rank} exited with code {code}")
        self.stale_s, self.interval_s = stale_s, interval_s
        now = time.monotonic()
        self._seen = {rank: (None, now) for rank in range(1, world)}  # rank -> (count, when it changed)
        self._reading_since: float | None = None  # a sample in progress (a store read may hang)
        self._verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_forever, name="longctx-sp-rank-watch", daemon=True)
        _stop_at_exit(self)
        self._thread.start()

    def problem(self) -> str | None:
        """None while every worker lives and beats; else what is wrong, naming the rank."""
        if self._stop.is_set():
            return None
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return self.describe_exit(rank, proc.exitcode)
        since = self._reading_since
        if since is not None and time.monotonic() - since > self.stale_s:
            return f"the ranks' heartbeats could not be read for {time.monotonic() - since:.0f} s"
        return self._verdict

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 5.0 if timeout is None else timeout)

    def _sample_forever(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._reading_since = time.monotonic()
            try:
                self._verdict = self._sample(self._reading_since)
            except Exception as err:  # noqa: BLE001 - e.g. the store's host is gone
                self._verdict = f"the ranks' heartbeats cannot be read ({type(err).__name__}: {err})"
            self._reading_since = None

    def _sample(self, now: float) -> str | None:
        stale = []
        for rank, (count, changed) in self._seen.items():
            latest = self.beats.read(rank)
            if latest != count:
                self._seen[rank] = (latest, now)
            elif now - changed > self.stale_s:
                stale.append((rank, now - changed))
        if not stale:
            return None
        rank, age = stale[0]
        return (f"rank {rank} has sent no heartbeat for {age:.0f} s (stopped, frozen, or its machine "
                f"is unreachable)")


class StderrTap:
    """A child process's stderr through a pipe. Start the child inside ``as_stderr()`` (the
    child inherits this process's fd 2 at that moment); a thread passes everything it writes
    on to this process's stderr and keeps the last ``TAIL_BYTES`` for ``last_error``."""

    def __init__(self) -> None:
        self._out = os.dup(2)  # where the child's lines go on to: our stderr as it is now
        self._read, self._write = os.pipe()
        self._tail = b""
        self._thread = threading.Thread(target=self._forward, name="longctx-sp-stderr", daemon=True)

    def as_stderr(self) -> "_Redirect":
        return _Redirect(self)

    def last_error(self, wait_s: float = 2.0) -> str:
        """The child's last words: the final exception of its last traceback (joined into one
        line), else its last line; call once it has exited (waits up to ``wait_s`` for the
        rest of its output)."""
        self._thread.join(wait_s)
        return last_error(self._tail.decode(errors="replace"))

    def _forward(self) -> None:
        try:
            while chunk := os.read(self._read, 65536):
                self._tail = (self._tail + chunk)[-TAIL_BYTES:]
                try:
                    _write_all(self._out, chunk)
                except OSError:  # our stderr is closed: keep the tail anyway
                    pass
        finally:
            os.close(self._read)
            os.close(self._out)


class _Redirect:
    """``with tap.as_stderr(): child.start()``: fd 2 is the tap's pipe within."""

    _lock = threading.Lock()  # one redirection of this process's fd 2 at a time

    def __init__(self, tap: StderrTap) -> None:
        self.tap = tap

    def __enter__(self) -> None:
        self._lock.acquire()
        self.saved = os.dup(2)
        os.dup2(self.tap._write, 2)

    def __exit__(self, *exc: Any) -> None:
        os.dup2(self.saved, 2)
        os.close(self.saved)
        os.close(self.tap._write)  # the child holds the only write end now: EOF when it exits
        self._lock.release()
        self.tap._thread.start()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def last_error(text: str, limit: int = ERROR_CHARS) -> str:
    """The final exception of the last traceback in ``text``, its lines joined (an exception's
    message may go on over indented lines), else the last non-empty line; at most ``limit``
    characters."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    header = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                 default=None)
    if header is not None:
        for i in range(header + 1, len(lines)):
            if not lines[i].startswith((" ", "\t")):
                found = " ".join(part.strip() for part in lines[i:])
                return found if len(found) <= limit else found[:limit - 3] + "..."
    found = lines[-1] if lines else ""
    return found if len(found) <= limit else found[:limit - 3] + "..."

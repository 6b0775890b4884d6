"""Exchanges between ranks on one host through shared memory: the low-latency path for the
per-layer all-gather and all-to-all of sequence-parallel steps on the CPU.

Owns: ``ShmBoard`` (the shared buffers, made once before the ranks start and handed to them),
``ShmComm`` (``RingComm``'s ``all_gather``/``all_to_all`` over the board, counted in the same
``CommStats``) and ``ShmControl`` (rank 0's one-to-all message per step).
Never: attention math, or anything across hosts (that is ``RingComm`` over torch.distributed).

Why: gloo over loopback TCP took ~1 ms per all-gather and ~0.4 ms per all-to-all between two
processes on the 2-core VM (thread and process wake-ups), 60 collectives per decoded token,
about 60 ms a token. Here a collective is a copy in, a flag, a wait and a copy out.

The board, for N ranks: ``data[2][N][slot_bytes]`` and ``flags[N]`` (the generation each rank
last wrote). Collective number g (every rank makes the same calls in the same order):

    wait until every flag >= g - 1     (all ranks have read what generation g - 2 left in
                                        buffer g % 2: they read it before writing g - 1)
    write my part into data[g % 2][me]; flags[me] = g
    wait until every flag >= g; copy out what I need from data[g % 2]

Waits spin for a while, then yield the core in short sleeps (two ranks may share a core), and
give up with ``ExchangeError`` when ``timeout_s`` passes or ``alive()`` says a peer is gone.
Stores become visible in program order on x86-64 (the writer's copy is done before its flag
is set); ``supported()`` keeps the board to that architecture.
"""

from __future__ import annotations

import pickle
import platform
import time
from typing import Callable

import numpy as np
import torch

from .comm import tensor_bytes

SPIN_S = 300e-6  # busy-wait this long before sleeping in steps: a peer doing the same work is that close
IDLE_SLEEP_S = 1e-3  # longest sleep between looks, reached after ~10 ms of waiting
LONG_IDLE_SLEEP_S = 20e-3  # ... and after a second (an idle worker waiting for a command)


class ExchangeError(RuntimeError):
    """A peer did not take part in an exchange in time, or is gone."""


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _wait_until(ready: Callable[[], bool], timeout_s: float, alive: Callable[[], bool], what: str) -> None:
    """Wait for ``ready()``: spin for ``SPIN_S``, then sleep in growing steps."""
    if ready():
        return
    start = time.perf_counter()
    spin_until = start + SPIN_S
    while time.perf_counter() < spin_until:
        if ready():
            return
    sleep = 20e-6
    last_check = start
    while not ready():
        time.sleep(sleep)
        now = time.perf_counter()
        if now - start > 0.01:  # a peer is computing, or nothing is asked of us: look less often
            sleep = min(IDLE_SLEEP_S if now - start < 1.0 else LONG_IDLE_SLEEP_S, sleep * 1.25)
        if now - last_check > 0.05:
            last_check = now
            if not alive():
                raise ExchangeError(f"a peer rank is gone (waiting for {what})")
            if now - start > timeout_s:
                raise ExchangeError(f"no answer from a peer rank within {timeout_s:.0f} s (waiting for {what})")


class ShmBoard:
    """Shared buffers for ``world`` ranks: made on rank 0 before the workers start and passed
    to them (torch shares the storage)."""

    def __init__(self, world: int, slot_bytes: int, control_bytes: int = 1 << 22) -> None:
        self.world, self.slot_bytes = world, slot_bytes
        # share_memory_() moves the storage into a new shared segment: the whole board is
        # allocated (and written) once, here
        self.data = torch.empty(2, world, slot_bytes, dtype=torch.uint8).share_memory_()
        self.flags = torch.zeros(world, dtype=torch.int64).share_memory_()
        self.control = torch.empty(control_bytes, dtype=torch.uint8).share_memory_()
        self.control_seq = torch.zeros(world, dtype=torch.int64).share_memory_()  # [seq, ack of ranks 1..N-1]


class ShmComm:
    """``RingComm``'s collectives for ranks on one host, over a ``ShmBoard``. Messages larger
    than a slot go to ``fallback`` (a ``RingComm``), decided from sizes every rank shares."""

    def __init__(self, board: ShmBoard, rank: int, fallback, timeout_s: float,
                 alive: Callable[[], bool]) -> None:
        self.board, self.rank, self.world_size = board, rank, board.world
        self.fallback, self.timeout_s, self.alive = fallback, timeout_s, alive
        self.stats = fallback.stats  # one count for both paths
        self.flags = board.flags.numpy()
        self.buffers = (board.data[0], board.data[1])
        self.gen = 0

    def _exchange(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """Post ``x`` (same shape on every rank); returns the board's buffer as [N, nbytes], a
        view valid until this rank's next exchange (copy what you keep)."""
        g, flags = self.gen + 1, self.flags
        nbytes = tensor_bytes(x)
        start = time.perf_counter()
        if flags.min() < g - 1:  # (checked first: closures cost more than the usual no-wait)
            _wait_until(lambda: flags.min() >= g - 1, self.timeout_s, self.alive, kind)
        buf = self.buffers[g % 2]
        buf[self.rank, :nbytes].copy_(x.reshape(-1).view(torch.uint8))
        flags[self.rank] = g
        if flags.min() < g:
            _wait_until(lambda: flags.min() >= g, self.timeout_s, self.alive, kind)
        self.stats.timed(kind, start)
        self.gen = g
        return buf[:, :nbytes]

    def all_gather(self, x: torch.Tensor, async_op: bool = False) -> torch.Tensor:
        if async_op or tensor_bytes(x) > self.board.slot_bytes:
            return self.fallback.all_gather(x, async_op)
        self.stats.add((self.world_size - 1) * tensor_bytes(x), ("all_gather", tensor_bytes(x)))
        raw = self._exchange(x, "all_gather")  # (N, nbytes)
        return raw.clone().view(x.dtype).view(self.world_size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...]: row j goes to rank j; returns [N, ...] with row j from rank j."""
        if tensor_bytes(x) > self.board.slot_bytes:
            return self.fallback.all_to_all(x)
        self.stats.add((self.world_size - 1) * tensor_bytes(x) // self.world_size, ("all_to_all", tensor_bytes(x)))
        row = tensor_bytes(x) // self.world_size
        raw = self._exchange(x, "all_to_all")  # (N, N * row)
        mine = raw[:, self.rank * row:(self.rank + 1) * row].clone()  # (N, row)
        return mine.view(x.dtype).view(x.shape)


class ShmControl:
    """Rank 0's message to every worker (a pickled command), one at a time: rank 0 waits
    until every worker has taken the previous one."""

    def __init__(self, board: ShmBoard, rank: int, timeout_s: float, alive: Callable[[], bool]) -> None:
        self.board, self.rank, self.timeout_s, self.alive = board, rank, timeout_s, alive
        self.seq = board.control_seq.numpy()
        self.buffer = board.control
        self.taken = 0

    def send(self, message) -> bool:
        """Rank 0: publish ``message``; False (nothing sent) when it does not fit the board."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if 8 + len(payload) > self.buffer.numel():
            return False
        n = int(self.seq[0])
        _wait_until(lambda: self.seq[1:].min() >= n, self.timeout_s, self.alive, "a worker to take a command")
        head = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        self.buffer[:8].copy_(torch.from_numpy(head.copy()))
        self.buffer[8:8 + len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.seq[0] = n + 1
        return True

    def receive(self, timeout_s: float = float("inf")):
        """A worker: the next message (waits as long as it takes, while ``alive()``)."""
        want = self.taken + 1
        _wait_until(lambda: self.seq[0] >= want, timeout_s, self.alive, "the next command")
        size = int.from_bytes(bytes(self.buffer[:8].numpy()), "little")
        message = pickle.loads(bytes(self.buffer[8:8 + size].numpy()))
        self.taken = want
        self.seq[self.rank] = want  # workers are ranks 1..N-1: their acks follow the sequence number
        return message

"""Running one function on N fresh ranks: how the tests and benchmarks of the communication
and attention primitives start their process groups.

Owns: ``spawn_ranks`` (N fresh processes, one process group over a rendezvous file, a
function run on each, results or a clear error back).
Never: the engine's ranks (``longctx.engine.sp`` starts those once, for an engine's lifetime).

Failure handling, so nothing hangs:

* a rank that raises reports the error and exits; its peers' next transfer fails at once
  (gloo sees the closed connection) or after ``group_timeout_s`` (a peer that hangs), and
  they report that and exit too;
* the parent watches every process: once one has failed it waits ``grace_s`` for the others
  to finish on their own, then kills whatever is left, and raises ``WorkerError`` naming each
  rank's fate (its exception, its exit code or signal, or "killed");
* ``timeout_s`` bounds the whole run the same way.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


from .comm import RingComm, init_distributed

RankFn = Callable[..., Any]  # fn(comm: RingComm, device: torch.device, *args) -> picklable


class WorkerError(RuntimeError):
    """A sequence-parallel run failed. ``failures[rank]`` says how each failed rank ended;
    ``tracebacks[rank]`` holds the traceback of each rank that raised."""

    def __init__(self, message: str, failures: dict[int, str], tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.failures, self.tracebacks = failures, tracebacks


def _rank_entry(rank: int, world_size: int, init_method: str, backend: str | None,
                group_timeout_s: float, num_threads: int, fn: RankFn, args: tuple,
                results: Any) -> None:
    """The body of one spawned rank: join the group, run ``fn``, report, exit."""
    torch.set_num_threads(num_threads)
    try:
        device = init_distributed(rank, world_size, init_method, backend, group_timeout_s)
        results.put((rank, "ok", fn(RingComm(), device, *args)))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure is reported, then the rank exits
        results.put((rank, "error", (f"{type(err).__name__}: {err}", traceback.format_exc())))
        results.close()
        results.join_thread()
        sys.exit(1)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"died from signal {signal.Signals(-code).name}"
    return (f"exited with code {code} before reporting (see its stderr; a script that starts "
            f"ranks needs an `if __name__ == \"__main__\":` guard)")


def _collect(procs: list, results: Any, timeout_s: float | None, grace_s: float) -> tuple[dict[int, tuple], bool]:
    """Outcomes per rank: ("ok", value), ("error", (message, traceback)) or ("died", text);
    and whether ``timeout_s`` ran out first."""
    outcomes: dict[int, tuple] = {}
    exited_at: dict[int, float] = {}
    start = time.monotonic()
    failed_at: float | None = None
    while len(outcomes) < len(procs):
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            return outcomes, True
        if failed_at is not None and now - failed_at > grace_s:
            break
        try:
            rank, status, payload = results.get(timeout=0.1)
            outcomes[rank] = (status, payload)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in outcomes and proc.exitcode is not None:
                    # a report sent just before exiting may still be in the pipe: give it a second
                    if now - exited_at.setdefault(rank, now) > 1.0:
                        outcomes[rank] = ("died", _describe_exit(proc.exitcode))
        if failed_at is None and any(status != "ok" for status, _ in outcomes.values()):
            failed_at = time.monotonic()
    return outcomes, False


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _raise_for(outcomes: dict[int, tuple], world_size: int, timed_out: bool) -> None:
    failures: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    for rank in range(world_size):
        status, payload = outcomes.get(rank, ("killed", "still running: killed"))
        if status == "error":
            failures[rank], tracebacks[rank] = payload
        elif status != "ok":
            failures[rank] = payload
    if failures:
        what = "did not finish within its timeout" if timed_out else "failed"
        lines = "\n".join(f"  rank {rank}: {text}" for rank, text in failures.items())
        raise WorkerError(f"sequence-parallel run over {world_size} processes {what}:\n{lines}",
                          failures, tracebacks)


def spawn_ranks(fn: RankFn, world_size: int, args: tuple = (), *, backend: str | None = None,
                num_threads: int = 1, timeout_s: float | None = None, group_timeout_s: float = 600.0,
                grace_s: float = 15.0) -> list[Any]:
    """Run ``fn(comm, device, *args)`` on ``world_size`` new processes joined in one process
    group (gloo on the CPU, NCCL with one GPU each when CUDA exists); returns each rank's
    result in rank order, or raises ``WorkerError``. ``fn`` and ``args`` must pickle (``fn``
    at module level); tensors in ``args`` travel through shared memory. Results must hold no
    tensors (a rank exits right after reporting, taking its shared memory with it)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="longctx-sp-") as folder:
        init_method = f"file://{os.path.join(folder, 'rendezvous')}"
        procs = [ctx.Process(target=_rank_entry, name=f"longctx-sp-rank{rank}", daemon=True,
                             args=(rank, world_size, init_method, backend, group_timeout_s,
                                   num_threads, fn, args, results))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            outcomes, timed_out = _collect(procs, results, timeout_s, grace_s)
        finally:
            _stop(procs)
    _raise_for(outcomes, world_size, timed_out)
    return [outcomes[rank][1] for rank in range(world_size)]

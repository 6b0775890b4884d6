"""Sequence parallelism inside the engine: N ranks that live as long as the engine.

Owns: starting the ranks once (``start``: N-1 worker processes beside this one, one gloo or
NCCL process group, the model shared with them through shared memory on the CPU), the worker
loop, ``RankExecutor`` (what every rank runs for a step or a page move),
``SequenceParallelRunner`` (rank 0's runner: ``ModelRunner``'s interface, so the engine,
scheduler, prefix store, lookahead and everything above them are the same with 1 or N ranks)
and ``ShardedKVPool`` (rank 0's view of the pages of every rank: the interface the host and
disk tiers use), failures and shutdown.
Never: scheduling, sampling or the attention math (``longctx.parallel.paged_sp``).

One engine, one scheduler (rank 0)::

    rank 0: scheduler -> SchedulerOutput --control broadcast--> every rank
    every rank: its tokens of the step through the model; each layer's attention exchanges
                q/k/v and partial results with the other ranks (paged_sp)
    rank 0: hidden states of the tokens that sample -> logits -> sampling (engine)

Pages: global block id ``b`` lives on rank ``b % N`` as local block ``b // N``. The block pool
hands out the lowest free ids, so a lone sequence's pages alternate over the ranks; the radix
tree, the scheduler and the host/disk tiers keep speaking global ids. Page moves between
tiers (``read_pages``/``write_pages``) travel between the owner and rank 0, where the host
tier and the disk files live.

Failures: every exchange inside a step runs under ``sp_timeout_s``; a rank that dies (its
peers see the closed connection) or hangs (the timeout) makes the step raise
``SequenceParallelError`` on rank 0, which the engine's callers turn into an error for the
requests in flight (``serve`` answers 503 and reports unhealthy). Between steps rank 0 watches
the workers (``longctx.parallel.liveness``): their exit codes and heartbeats, read by
``rank_health()`` for ``/health``. A worker builds its model and pages before the rendezvous,
while rank 0 watches its exit code: one that dies starting is reported at once, with the
last words of its stderr (which passes through a pipe to rank 0's). Workers exit when rank 0
closes the engine, when its process exits (daemon processes, plus a watchdog on the parent's
pid) or when the group breaks.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longctx.config import CacheConfig, ConfigError, ModelLoadConfig, ParallelConfig
from longctx.kv.device_pool import DeviceKVPool, num_blocks_for
from longctx.kv.formats import kv_format
from longctx.model.llama import LlamaForCausalLM
from longctx.model.loader import TORCH_DTYPES
from longctx.parallel.comm import RingComm, device_for, init_distributed, init_from_env
from longctx.parallel.liveness import RankWatch, SharedBeats, StderrTap, StoreBeats, start_heartbeat
from longctx.kernels import cpu_linear
from longctx.kernels.cpu_build import keep_large_blocks, set_cpu_threads
from longctx.parallel.paged_sp import (ColumnSplit, PagedSPAttention, ShardedStep, StepSeq, assign_tokens,
                                        local_slot, slot_owner)
from longctx.parallel.shm_comm import ShmBoard, ShmComm, ShmControl, supported as board_supported
from longctx.kv.exact_tail import TailPlan, TailStep, fill_first_pages, first_pages_to_fill, tail_seqs
from longctx.engine.outputs import DraftMove, SchedulerOutput
from longctx.engine.runner import SamplingRunner, draft_position_moves, draft_slot_moves
from longctx.engine.step_inputs import flatten_batch

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)  # without the board, a worker waits this long for a command
TORCHRUN_ENV = "LONGCTX_SP_TORCHRUN"  # set by ``python -m longctx.entrypoints.torchrun`` on rank 0
MAX_BOARD_TOKENS = 8192  # the shared-memory board holds steps up to this size; larger go over gloo
START_POLL_S = 0.2  # while the workers start, rank 0 looks at their exit codes this often


class SequenceParallelError(RuntimeError):
    """A rank failed or stopped answering: the engine cannot run steps any more."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_threads(world: int, num_threads: int) -> int:
    return num_threads or max(1, usable_cores() // world)


class RankExecutor:
    """One rank's share of every command: the same code on rank 0 and on the workers."""

    def __init__(self, model: LlamaForCausalLM, kv: DeviceKVPool, kernels: Any, rank: int,
                 world: int, device: torch.device, threads: int, comm: Any, cpu_group: Any) -> None:
        """``cpu_group``: a gloo group for moving pages, which travel as CPU tensors (the
        default group is NCCL between GPUs)."""
        self.model, self.kv, self.rank, self.world, self.device = model, kv, rank, world, device
        self.comm, self.cpu_group = comm, cpu_group
        self.threads = threads
        self.alone_threads = min(usable_cores(), threads * world) if device.type == "cpu" else threads
        self.config = model.config
        self.attention = PagedSPAttention(kv.caches, self.comm, kernels, model.config.head_dim,
                                          kv.format.rotation(device) is not None)
        # small steps split every product by output features where the model multiplies with
        # the row kernel (its [out, in] matrices slice without a copy); else they run on rank 0
        self.column_split = (ColumnSplit(self.comm, cpu_linear.linear)
                             if world > 1 and model.uses_row_kernel() else None)

    # ------------------------------------------------------------------ a step

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Run this rank's tokens of ``batch``; on rank 0 return the logits (fp32) of the
        tokens that sample, like ``ModelRunner.execute``."""
        bs = self.kv.block_size
        flat = flatten_batch(batch, bs)
        owned = assign_tokens(flat.query_lens, self.world)
        small = len(owned[0]) == len(flat.token_ids)
        if small and self.column_split is not None:
            return self._execute_columns(batch, flat)
        # a small step on rank 0 alone leaves the other ranks idle through its linear layers:
        # take their cores for those (attention, which they share, runs on ours)
        linear_threads = self.alone_threads if small and self.rank == 0 else self.threads
        set_cpu_threads(linear_threads)  # per calling thread for the C kernels (the server steps in its own)
        step = ShardedStep(self._seqs(batch, flat), owned, flat.slots, self.rank, self.world, bs,
                           self.device, threads=(linear_threads, self.threads))
        step.tail = self._tail(batch, flat, owned[self.rank])
        mine = owned[self.rank]
        c = self.config
        long = flat.rope_long(c, self.device)
        step.rope_long = None if long is None else long[torch.tensor(mine, dtype=torch.long, device=self.device)]
        if mine:
            ids = torch.tensor([flat.token_ids[t] for t in mine], dtype=torch.long, device=self.device)
            pos = torch.tensor([flat.positions[t] for t in mine], dtype=torch.long, device=self.device)
            hidden = self.model(ids, pos, self.attention, step)  # (T_r, E)
        else:
            act = self.model.act_dtype or self.kv.dtype  # fp32 for a bf16 model on the row kernel
            self.attention.idle(c.num_hidden_layers, step, self.kv.layers[0][0],
                                c.num_attention_heads, c.num_key_value_heads, act)
            hidden = torch.empty((0, c.hidden_size), dtype=act, device=self.device)
        return self._logits(hidden, mine, owned, flat.sample_rows)

    def _tail(self, batch: SchedulerOutput, flat: Any, own: list[int] | None) -> TailStep | None:
        """A format with an exact tail: the step's exact tail (``longctx.kv.exact_tail``), the same plan on every
        rank; each keeps every row (its store is a full copy) and exchanges its own queries'.
        Prefix hits' first pages are recomputed on every rank first."""
        store = self.kv.tail
        if store is None:
            return None
        fill_first_pages(self.model, store, first_pages_to_fill(batch.seqs), self.kv.format.rotation(self.device))
        plan = TailPlan(tail_seqs(batch.seqs, flat.query_lens), store, len(flat.token_ids))
        dev = self.device
        width = max(len(s.block_ids) for s in batch.seqs)
        table = torch.tensor([list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in batch.seqs],
                             dtype=torch.int32, device=dev)
        tree = None if flat.tree_words is None else torch.tensor(flat.tree_words, dtype=torch.int64, device=dev)
        return TailStep(plan, torch.tensor(plan.ints, dtype=torch.long, device=dev), store,
                        torch.tensor(flat.positions, dtype=torch.long, device=dev), tree, table, own)

    def _seqs(self, batch: SchedulerOutput, flat: Any) -> list[StepSeq]:
        seqs, start = [], 0
        for seq, n in zip(batch.seqs, flat.query_lens):
            words = tuple(flat.tree_words[start:start + n]) if seq.num_draft else ()
            seqs.append(StepSeq(start, n, seq.start_pos, tuple(seq.block_ids), words))
            start += n
        return seqs

    def _execute_columns(self, batch: SchedulerOutput, flat: Any) -> torch.Tensor | None:
        """A small step (decode, verification) with every product split by output features
        over the ranks (``ColumnSplit``): every rank holds every token, reads 1/N of the
        weights and 1/N of the KV, on its own cores."""
        set_cpu_threads(self.threads)
        step = ShardedStep(self._seqs(batch, flat), None, flat.slots, self.rank, self.world,
                           self.kv.block_size, self.device, split_linear=self.column_split)
        step.tail = self._tail(batch, flat, None)
        step.rope_long = flat.rope_long(self.config, self.device)
        ids = torch.tensor(flat.token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(flat.positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.attention, step)  # (T, E), the same on every rank
        if not flat.sample_rows:
            return torch.empty(0, self.config.vocab_size) if self.rank == 0 else None
        rows = hidden[torch.tensor(flat.sample_rows, device=self.device)]
        logits = self.column_split(rows, self.model.lm_head.weight)  # (rows, V)
        return self.model.cap_logits(logits.float()) if self.rank == 0 else None

    def _logits(self, hidden: torch.Tensor, mine: list[int], owned: list[list[int]],
                rows: list[int]) -> torch.Tensor | None:
        """Bring the sampling rows' hidden states to rank 0 (one gather, skipped when they are
        all there already) and compute their logits there."""
        if not rows:  # no token of the step samples (a prefill chunk mid-prompt)
            return torch.empty(0, self.config.vocab_size) if self.rank == 0 else None
        where = {t: (r, i) for r, own in enumerate(owned) for i, t in enumerate(own)}
        if all(where[t][0] == 0 for t in rows):
            if self.rank != 0:
                return None
            picked = hidden[torch.tensor([where[t][1] for t in rows], dtype=torch.long, device=self.device)]
        else:
            wanted = set(rows)
            counts = [sum(1 for t in own if t in wanted) for own in owned]
            width = max(counts)
            local = [i for i, t in enumerate(mine) if t in wanted]
            send = hidden.new_zeros((width, hidden.shape[1]))
            if local:
                send[:len(local)] = hidden[torch.tensor(local, device=self.device)]
            gathered = self.comm.all_gather(send)  # (N, width, E)
            if self.rank != 0:
                return None
            slot = {}
            for r, own in enumerate(owned):
                for i, t in enumerate(t for t in own if t in wanted):
                    slot[t] = r * width + i
            picked = gathered.flatten(0, 1)[torch.tensor([slot[t] for t in rows], device=self.device)]
        return self.model.compute_logits(picked)

    def report(self, reset: bool = False) -> dict:
        """This rank's traffic so far: bytes sent, seconds blocked in exchanges, calls."""
        stats = self.comm.stats
        out = {"rank": self.rank, "bytes_sent": stats.bytes_sent, "blocked_s": stats.blocked_s,
               "blocked_by_kind": dict(stats.blocked), "num_calls": len(stats.ops)}
        if reset:
            stats.__init__()  # in place: the shared-memory and fallback paths share it
        return out

    # ------------------------------------------------------------------ page moves

    def _mine(self, block_ids: list[int], rank: int) -> list[tuple[int, int]]:
        """(index in ``block_ids``, local id) of the pages rank ``rank`` holds."""
        return [(i, b // self.world) for i, b in enumerate(block_ids) if b % self.world == rank]

    def read_pages(self, block_ids: list[int]) -> torch.Tensor | None:
        """Every rank sends rank 0 its pages among ``block_ids``; rank 0 returns them all,
        ``[P, L, 2, BS, Hkv, D]`` on the CPU, in order."""
        if self.rank != 0:
            local = self._mine(block_ids, self.rank)
            if local:
                dist.send(self.kv.read_pages([b for _, b in local]), 0, group=self.cpu_group)
            return None
        pages = torch.empty((len(block_ids), *self.kv.page_shape), dtype=self.kv.page_dtype)
        for r in range(self.world):
            part = self._mine(block_ids, r)
            if not part:
                continue
            if r == 0:
                got = self.kv.read_pages([b for _, b in part])
            else:
                got = torch.empty((len(part), *self.kv.page_shape), dtype=self.kv.page_dtype)
                dist.recv(got, r, group=self.cpu_group)
            pages[torch.tensor([i for i, _ in part])] = got
        return pages

    def write_pages(self, block_ids: list[int], pages: torch.Tensor | None = None) -> None:
        """Rank 0 sends each rank its pages among ``block_ids`` (``pages`` on rank 0 only)."""
        if self.rank != 0:
            local = self._mine(block_ids, self.rank)
            if local:
                got = torch.empty((len(local), *self.kv.page_shape), dtype=self.kv.page_dtype)
                dist.recv(got, 0, group=self.cpu_group)
                self.kv.write_pages([b for _, b in local], got)
            return
        for r in range(self.world):
            part = self._mine(block_ids, r)
            if not part:
                continue
            chunk = pages[torch.tensor([i for i, _ in part])].contiguous()
            if r == 0:
                self.kv.write_pages([b for _, b in part], chunk)
            else:
                dist.send(chunk, r, group=self.cpu_group)

    def move_slots(self, src: list[int], dst: list[int], tail: tuple | None = None) -> None:
        """``tail``: (slot, source positions, target positions) of the exact tail's rows, which
        every rank keeps a copy of (moved alike). Copy token slots ``src`` to ``dst`` (global
        slots) in every layer, across ranks:
        the owners of the sources contribute their rows to one all-reduce (every other row is
        zero, so the sum is exact), and the owners of the destinations write them, through the
        KV format's row read and write (a quantized format's rows travel dequantised and are
        written again under the destination pages' scales, as in one process)."""
        if tail is not None and self.kv.tail is not None:
            self.kv.tail.move(*tail)
        bs, world, fmt = self.kv.block_size, self.world, self.kv.format
        c = self.config
        rows = torch.zeros((len(src), c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim),
                           dtype=fmt.row_dtype, device=self.device)
        have = [i for i, s in enumerate(src) if slot_owner(s, bs, world) == self.rank]
        if have:
            idx = torch.tensor([local_slot(src[i], bs, world) for i in have], device=self.device)
            at = torch.tensor(have, device=self.device)
            for layer, caches in enumerate(self.kv.caches):
                for j in range(2):
                    rows[at, layer, j] = fmt.read_rows(caches, j, idx)
        dist.all_reduce(rows)
        put = [i for i, s in enumerate(dst) if slot_owner(s, bs, world) == self.rank]
        if put:
            local = [local_slot(dst[i], bs, world) for i in put]
            idx, at = torch.tensor(local, device=self.device), torch.tensor(put, device=self.device)
            for layer, caches in enumerate(self.kv.caches):
                for j in range(2):
                    fmt.write_rows(caches, j, rows[at, layer, j], idx, local)


# ---------------------------------------------------------------------- rank 0's side


class _Ranks:
    """Rank 0's handle on the workers: the control channel, the processes (those it spawned,
    with their stderr taps), the watch on their liveness, the failure."""

    def __init__(self, procs: list, control: Any, folder: tempfile.TemporaryDirectory,
                 shm_control: ShmControl | None, watch: RankWatch, taps: list | None = None) -> None:
        self.procs, self.control, self.folder, self.shm_control = procs, control, folder, shm_control
        self.watch, self.taps = watch, taps or [None] * len(procs)
        self.error: str | None = None
        self.closed = False
        # one command at a time, from any thread (the server's engine thread, close() on exit)
        self.lock = threading.Lock()

    def run(self, command: str, args: tuple, local: Callable[[], Any]) -> Any:
        """Send ``command`` to every worker and run rank 0's share (``local``). Any failure,
        an interrupt included, leaves the ranks unusable: they may be mid-exchange."""
        with self.lock:
            self.call(command, *args)
            try:
                return local()
            except BaseException as err:
                raise self.fail(err) from err

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, command: str, *args: Any) -> None:
        """Send every worker the next command (they run their share of it right away)."""
        self.check()
        try:
            _broadcast_command((command, args), self.shm_control, self.control)
        except Exception as err:  # noqa: BLE001 - a worker is gone
            raise self.fail(err) from err

    def gather_reports(self, executor: "RankExecutor", reset: bool) -> list[dict]:
        reports: list = [None] * (len(self.procs) + 1)
        self.run("report", (reset,), lambda: dist.gather_object(executor.report(reset), reports, dst=0,
                                                                 group=self.control))
        return reports

    def check(self) -> None:
        if self.error is not None:
            raise SequenceParallelError(self.error)
        if self.closed:
            raise SequenceParallelError("the sequence-parallel ranks were shut down (LLM closed)")

    def health(self) -> str | None:
        """None while every rank can take part in a step; else why not, naming the rank. Never
        blocks: the server's ``/health`` asks."""
        if self.closed:
            return None
        if self.error is not None:
            return self.error
        problem = self.watch.problem()
        return None if problem is None else f"sequence-parallel {problem}"

    def exit_text(self, rank: int, code: int, wait_s: float = 0.0) -> str:
        return rank_exit_text(rank, code, self.taps[rank - 1], wait_s)

    def fail(self, err: BaseException) -> SequenceParallelError:
        """Describe a failed exchange (naming ranks that died) and mark the ranks unusable."""
        if isinstance(err, SequenceParallelError):
            return err
        time.sleep(0.2)  # a dead peer's exit code shows up a moment after its socket closes
        dead = [self.exit_text(i + 1, p.exitcode, wait_s=1.0) for i, p in enumerate(self.procs)
                if p.exitcode is not None]
        what = "; ".join(dead) if dead else f"{type(err).__name__}: {err}".rstrip(": ")
        self.error = f"a sequence-parallel rank failed during a step ({what}); restart the engine"
        return SequenceParallelError(self.error)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self.lock:
            self._shutdown(timeout_s)

    def _shutdown(self, timeout_s: float) -> None:
        if self.closed:
            return
        self.closed = True
        self.watch.close()
        if self.error is None:
            try:
                _broadcast_command(("stop", ()), self.shm_control, self.control)
            except Exception:  # noqa: BLE001 - the workers may be gone already
                pass
        # after a failure the survivors may sit in an exchange until their timeout: stop them now
        deadline = time.monotonic() + (timeout_s if self.error is None else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        self.folder.cleanup()


class ShardedKVPool:
    """Rank 0's view of the KV pages of every rank: ``DeviceKVPool``'s page interface over
    global block ids (``read_pages``, ``write_pages``, ``move_slots``)."""

    spans_ranks = True

    def __init__(self, local: DeviceKVPool, world: int, executor: RankExecutor, ranks: _Ranks) -> None:
        self.local, self.world, self.executor, self.ranks = local, world, executor, ranks
        self.num_blocks = local.num_blocks * world
        self.block_size, self.dtype, self.device = local.block_size, local.dtype, local.device
        self.page_dtype, self.format = local.page_dtype, local.format
        self.page_shape = local.page_shape

    def _run(self, command: str, *args: Any) -> Any:
        plain = tuple(a for a in args if not isinstance(a, torch.Tensor))  # tensors stay on rank 0
        return self.ranks.run(command, plain, lambda: getattr(self.executor, command)(*args))

    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        return self._run("read_pages", list(block_ids))

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        self._run("write_pages", list(block_ids), pages)

    def move_slots(self, src: list[int], dst: list[int], tail: tuple | None = None) -> None:
        self._run("move_slots", list(src), list(dst), tail)

    def release(self) -> None:
        self.local.release()


class SequenceParallelRunner(SamplingRunner):
    """Rank 0's runner: ``execute(output) -> RunnerOutput`` like ``ModelRunner``, with every
    forward shared by the ranks (each executes the same ``SchedulerOutput``; rank 0 holds the
    logits and samples them) and accepted drafts compacted on the ranks that own their slots."""

    def __init__(self, executor: RankExecutor, kv: ShardedKVPool, ranks: _Ranks) -> None:
        self.executor, self.kv, self.ranks = executor, kv, ranks
        self._init_sampling(executor.model.config.vocab_size, kv.device)
        self.block_size = kv.block_size
        self.world_size = kv.world
        self.backend = executor.attention

    def worker_pids(self) -> list[int]:
        return self.ranks.pids()

    @property
    def failed(self) -> bool:
        return self.ranks.error is not None

    def rank_health(self) -> str | None:
        """None while every rank is alive and answering; else what is wrong (``_Ranks.health``)."""
        return self.ranks.health()

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        return self.ranks.run("execute", (batch,), lambda: self.executor.execute(batch))

    def move_draft_kv(self, move: DraftMove) -> None:
        src, dst = draft_slot_moves(move.block_ids, move.start_pos, move.accepted, self.block_size)
        if src:
            self.kv.move_slots(src, dst, (move.tail_slot, *draft_position_moves(move.start_pos, move.accepted)))

    def comm_reports(self, reset: bool = False) -> list[dict]:
        """Every rank's traffic (``RankExecutor.report``), in rank order."""
        return self.ranks.gather_reports(self.executor, reset)

    def shutdown(self) -> None:
        self.ranks.shutdown()


# ---------------------------------------------------------------------- start-up


def _watch_parent(parent: int) -> None:
    """Exit this worker when the engine's process is gone (no orphan ranks)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _broadcast_command(message: tuple, shm: ShmControl | None, group: Any) -> None:
    """Rank 0: the next command to every worker, through shared memory when it fits, else
    (a marker there, then) over the control process group."""
    if shm is not None:
        if shm.send(message):
            return
        shm.send(("via-group", ()))
    dist.broadcast_object_list([message], src=0, group=group)


def _receive_command(shm: ShmControl | None, group: Any) -> tuple:
    message = shm.receive() if shm is not None else None
    if message is None or message[0] == "via-group":
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        message = box[0]
    return message


def rank_pool(model: LlamaForCausalLM, num_blocks: int, cache: CacheConfig, load: ModelLoadConfig,
              device: torch.device) -> DeviceKVPool:
    """One rank's pages, in the format ``cache`` asks for."""
    return DeviceKVPool(kv_format(cache, model.config, TORCH_DTYPES[load.dtype]), num_blocks, cache.block_size,
                        device)


def _worker_main(rank: int, world: int, init_method: str, backend: str, model: Any, load: ModelLoadConfig,
                 num_blocks: int, cache: CacheConfig, timeout_s: float, threads: int, parent: int,
                 board: ShmBoard | None, beats: SharedBeats, ready: Any, start_timeout_s: float) -> None:
    """A worker rank: build its model and pages, join the group, then run rank 0's commands
    until told to stop. What may fail (the model, the pages) comes before the rendezvous,
    while rank 0 waits for the "loaded" message watching this process's exit code."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0's to handle (serve drains first); the
        signal.signal(sig, signal.SIG_IGN)      # workers end on its "stop" or when it is gone
    set_cpu_threads(threads)
    device = device_for(backend, rank)
    if isinstance(model, str):  # on CUDA every rank loads its own copy onto its GPU
        from longctx.model.loader import load_model
        from longctx.model.prepare import weight_cache_bytes

        model = load_model(model, dtype=TORCH_DTYPES[load.dtype], device=device,
                           rope_scaling=load.rope_scaling, cache_bytes=weight_cache_bytes(load))
    from longctx.attention import select_backend

    kernels = select_backend(device, model.config.head_dim, load.attention_backend).kernels
    kv = rank_pool(model, num_blocks, cache, load, device)
    if device.type == "cpu":  # as rank 0's engine does: later large blocks reuse the heap
        keep_large_blocks()
    ready.put(("loaded", rank))
    start = timedelta(seconds=start_timeout_s)  # joining: the start-up's deadline
    init_distributed(rank, world, init_method, backend, start.total_seconds())
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as the engine does
    # with the board a worker waits for commands there; the group carries only large ones, which
    # rank 0 sends right after its marker, so the step's timeout applies (once started)
    control = dist.new_group(backend="gloo", timeout=start if board is not None else CONTROL_TIMEOUT)
    if board is not None:
        step_deadlines(timeout_s, control)
    else:  # (the control group waits for commands as long as it must; the exchanges do not)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))

    def alive() -> bool:
        return os.getppid() == parent

    comm = ShmComm(board, rank, RingComm(), timeout_s, alive) if board is not None else RingComm()
    shm_control = ShmControl(board, rank, timeout_s, alive) if board is not None else None
    executor = RankExecutor(model, kv, kernels, rank, world, device, threads, comm, control)
    start_heartbeat(beats, rank)
    ready.put(("ready", rank))
    serve_commands(executor, shm_control, control)


def serve_commands(executor: RankExecutor, shm_control: ShmControl | None, control: Any) -> None:
    """A worker's life after start-up: run rank 0's commands until "stop" (or rank 0 is gone),
    then leave the process group."""
    while True:
        try:
            command, args = _receive_command(shm_control, control)
        except Exception:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
            os._exit(1)
        if command == "stop":
            break
        if command == "report":
            dist.gather_object(executor.report(*args), None, dst=0, group=control)
            continue
        getattr(executor, command)(*args)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def board_slot_bytes(config: Any, world: int, max_tokens: int, itemsize: int) -> int:
    """The largest message one rank posts in a step of ``max_tokens`` tokens: the all-gather of
    q, k, v, the all-to-all of fp32 partials (N rows of the busiest rank's tokens, at most
    about T / N + 2N of them), or hidden states. Larger messages go over torch.distributed."""
    rows = max_tokens + 2 * world * world
    gather = rows * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim * itemsize
    partials = rows * config.num_attention_heads * (config.head_dim + 1) * 4
    return max(gather, partials, rows * config.hidden_size * itemsize)


def _check_start(model: LlamaForCausalLM, world: int, device: torch.device) -> None:
    if dist.is_initialized():
        raise ConfigError("sequence_parallel_size > 1 needs its own process group, but this process "
                          "already has one (one sequence-parallel LLM per process)")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(f"sequence_parallel_size {world} needs as many GPUs; this machine has "
                          f"{torch.cuda.device_count()}")
    if device.type == "cpu" and model.has_packed_linears():
        raise ConfigError("cpu_matmul='onednn' packs weights into opaque tensors that the ranks cannot "
                          "share: use cpu_matmul='kernel' or 'blas' with sequence_parallel_size > 1")


def step_deadlines(timeout_s: float, control: Any) -> None:
    """Once the ranks have started: the default group and ``control`` time out as a step does
    (``sp_timeout_s``), no longer as the start-up (``sp_start_timeout_s``)."""
    step = timedelta(seconds=timeout_s)
    dist.distributed_c10d._set_pg_timeout(step)
    dist.distributed_c10d._set_pg_timeout(step, control)


def rank_exit_text(rank: int, code: int, tap: StderrTap | None, wait_s: float = 0.0, when: str = "") -> str:
    """"rank R exited with code C[ when]", and its stderr's last words when it exited by itself
    (a killed one's stderr says nothing about its end)."""
    text = f"rank {rank} exited with code {code}{when}"
    words = tap.last_error(wait_s) if tap is not None and code > 0 else ""
    return f"{text}: {words}" if words else text


def _start_tapped(procs: list) -> list[StderrTap | None]:
    """Start the workers, each with its stderr through a ``StderrTap`` (passed on to ours; its
    tail names a failed rank's error), or plainly where this process has no stderr to copy."""
    taps: list[StderrTap | None] = []
    for proc in procs:
        try:
            tap = StderrTap()
        except OSError:
            tap = None
        if tap is None:
            proc.start()
        else:
            with tap.as_stderr():
                proc.start()
        taps.append(tap)
    return taps


def _await_workers(procs: list, taps: list, ready: Any, stage: str, deadline: float) -> None:
    """Wait for every worker's ``stage`` message ("loaded", "ready"); a worker that exits first
    is reported at once, with its last words. Raises ``queue.Empty`` past ``deadline``."""
    pending = set(range(1, len(procs) + 1))
    while pending:
        try:
            got, rank = ready.get(timeout=START_POLL_S)
        except queue.Empty:
            for rank in sorted(pending):
                code = procs[rank - 1].exitcode
                if code is not None:
                    text = rank_exit_text(rank, code, taps[rank - 1], 2.0, " while starting")
                    raise SequenceParallelError(f"sequence-parallel {text}") from None
            if time.monotonic() > deadline:
                raise
            continue
        assert got == stage, (got, stage)
        pending.discard(rank)


def _wait_for_ranks(procs: list, taps: list, ready: Any, folder: tempfile.TemporaryDirectory, world: int,
                    init_method: str, backend: str, timeout_s: float, step_timeout_s: float) -> Any:
    """Wait until every worker has its model and pages, join the process group as rank 0, and
    wait for every worker's ready message, all within ``timeout_s`` (the start-up's); returns
    the gloo control group, with the step's deadline from then on. On any failure the workers
    are killed and the error says which lived."""
    deadline = time.monotonic() + timeout_s
    try:
        _await_workers(procs, taps, ready, "loaded", deadline)
        init_distributed(0, world, init_method, backend, timeout_s)
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _await_workers(procs, taps, ready, "ready", deadline)
        step_deadlines(step_timeout_s, control)
        return control
    except BaseException as err:
        for proc in procs:
            proc.kill()
            proc.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        folder.cleanup()
        if isinstance(err, queue.Empty):
            fates = ", ".join(f"rank {i + 1}: " + ("running" if p.exitcode == -9 else f"exit code {p.exitcode}")
                              for i, p in enumerate(procs))
            raise SequenceParallelError(f"the sequence-parallel ranks did not start within "
                                        f"{timeout_s:.0f} s ({fates}; see their stderr)") from None
        raise


def start(model: LlamaForCausalLM, load: ModelLoadConfig, cache: CacheConfig, parallel: ParallelConfig,
          num_blocks: int, kernels: Any, device: torch.device, max_step_tokens: int) -> SequenceParallelRunner:
    """Start ``parallel.sequence_parallel_size - 1`` workers beside this process (rank 0),
    each with ``num_blocks`` KV pages; returns rank 0's runner (its ``kv`` is the pool of all
    ranks' pages)."""
    world = parallel.sequence_parallel_size
    if os.environ.get(TORCHRUN_ENV):
        return _join_torchrun(model, load, cache, parallel, num_blocks, kernels, device)
    _check_start(model, world, device)
    shared: Any = model if device.type == "cpu" else load.model
    threads = rank_threads(world, load.num_threads)
    backend = "nccl" if device.type == "cuda" else "gloo"  # a CPU engine on a GPU machine too
    board = None
    if device.type == "cpu" and board_supported():
        act = model.act_dtype or TORCH_DTYPES[load.dtype]  # the messages carry activations
        slot = board_slot_bytes(model.config, world, min(max_step_tokens, MAX_BOARD_TOKENS), act.itemsize)
        board = ShmBoard(world, slot)
    beats = SharedBeats(world)
    folder = tempfile.TemporaryDirectory(prefix="longctx-sp-")
    init_method = f"file://{os.path.join(folder.name, 'rendezvous')}"
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, name=f"longctx-sp-rank{rank}", daemon=True,
                         args=(rank, world, init_method, backend, shared, load, num_blocks, cache,
                               parallel.sp_timeout_s, threads, os.getpid(), board, beats, ready,
                               parallel.sp_start_timeout_s))
             for rank in range(1, world)]
    taps = _start_tapped(procs)
    control = _wait_for_ranks(procs, taps, ready, folder, world, init_method, backend, parallel.sp_start_timeout_s,
                              parallel.sp_timeout_s)
    set_cpu_threads(threads)
    def alive() -> bool:
        return all(p.exitcode is None for p in procs)

    shm_control = ShmControl(board, 0, parallel.sp_timeout_s, alive) if board is not None else None
    watch = RankWatch(world, beats, procs, lambda rank, code: rank_exit_text(rank, code, taps[rank - 1]))
    ranks = _Ranks(procs, control, folder, shm_control, watch, taps)
    local = rank_pool(model, num_blocks, cache, load, device)
    comm = ShmComm(board, 0, RingComm(), parallel.sp_timeout_s, alive) if board is not None else RingComm()
    executor = RankExecutor(model, local, kernels, 0, world, device, threads, comm, control)
    log.info("sequence parallelism: %d ranks (workers %s), %d threads each, exchanges over %s", world,
             ranks.pids(), threads, "shared memory" if board is not None else "torch.distributed")
    return SequenceParallelRunner(executor, ShardedKVPool(local, world, executor, ranks), ranks)


def _join_torchrun(model: LlamaForCausalLM, load: ModelLoadConfig, cache: CacheConfig,
                   parallel: ParallelConfig, num_blocks: int, kernels: Any,
                   device: torch.device) -> SequenceParallelRunner:
    """Rank 0 under ``torchrun`` (``longctx.entrypoints.torchrun``): the other ranks were started by torchrun,
    possibly on other machines, and build their model themselves; join their group, wait until
    they are ready, and run as usual over torch.distributed (no shared-memory board)."""
    saved = dict(item.split("=", 1) for item in os.environ[TORCHRUN_ENV].split(","))
    world = int(saved["WORLD_SIZE"])
    if world != parallel.sequence_parallel_size:
        raise ConfigError(f"under torchrun, sequence_parallel_size must be the world size ({world})")
    os.environ.update(saved)  # longctx.entrypoints.torchrun hid torchrun's RANK/WORLD_SIZE from the command
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_from_env(backend, parallel.sp_start_timeout_s)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=parallel.sp_start_timeout_s))
    dist.barrier(group=control)  # every worker has its model and pages
    step_deadlines(parallel.sp_timeout_s, control)
    threads = rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), load.num_threads)
    set_cpu_threads(threads)
    watch = RankWatch(world, StoreBeats(dist.distributed_c10d._get_default_store()))
    ranks = _Ranks([], control, tempfile.TemporaryDirectory(prefix="longctx-sp-"), None, watch)
    local = rank_pool(model, num_blocks, cache, load, device)
    executor = RankExecutor(model, local, kernels, 0, world, device, threads, RingComm(), control)
    log.info("sequence parallelism under torchrun: %d ranks over torch.distributed (%s)", world, backend)
    return SequenceParallelRunner(executor, ShardedKVPool(local, world, executor, ranks), ranks)


def torchrun_worker(load: ModelLoadConfig, cache: CacheConfig, parallel: ParallelConfig,
                    model: LlamaForCausalLM, device: torch.device, rank: int, world: int) -> None:
    """A rank other than 0 under ``torchrun``: join the group, serve rank 0's commands."""
    from longctx.attention import select_backend

    backend = "nccl" if device.type == "cuda" else "gloo"
    init_from_env(backend, parallel.sp_start_timeout_s)
    start_heartbeat(StoreBeats(dist.distributed_c10d._get_default_store()), rank)  # (the store spans machines)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    threads = rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), load.num_threads)
    set_cpu_threads(threads)
    kernels = select_backend(device, model.config.head_dim, load.attention_backend).kernels
    kv = rank_pool(model, num_blocks_for(cache, kv_format(cache, model.config, TORCH_DTYPES[load.dtype])),
                   cache, load, device)
    executor = RankExecutor(model, kv, kernels, rank, world, device, threads, RingComm(), control)
    dist.barrier(group=control)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=parallel.sp_timeout_s))  # started: steps' deadline
    serve_commands(executor, None, control)

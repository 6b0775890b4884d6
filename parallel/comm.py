"""Process groups and the one communicator every sequence-parallel path talks through.

Owns: starting a process group on the right backend (NCCL with one CUDA device per rank when
CUDA exists, gloo on the CPU otherwise; ``torchrun``'s environment or an explicit address),
and ``RingComm``: ring transfers (send to the next rank, receive from the previous, started
before a block's compute and awaited after it) plus the few collectives sharded-KV attention
needs, with counters of bytes sent and of time spent blocked.
Never: attention math, or a transport of its own: every byte moves through torch.distributed.

Byte counts are logical: what a direct exchange would put on the wire from this rank
(an all-gather sends its part to N-1 peers, an all-to-all the N-1 parts meant for others).
Blocked time is host time inside ``wait`` and inside synchronous collectives; with NCCL, whose
calls return before the GPU finishes, it is not a measure of exposed communication.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """NCCL ranks own ``cuda:local_rank``; gloo ranks compute on the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {local_rank} has no GPU: this node has "
                           f"{torch.cuda.device_count()} (start at most that many ranks per node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None,
                     timeout_s: float = 600.0, local_rank: int | None = None) -> torch.device:
    """Join the default process group; returns this rank's device. ``timeout_s`` bounds every
    collective and transfer, so a peer that hangs turns into an error, not a hang."""
    backend = backend or default_backend()
    device = device_for(backend, rank if local_rank is None else local_rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return device


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Join the group ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} unset")
    return init_distributed(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://",
                            backend, timeout_s, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


@dataclass
class CommStats:
    """What one rank sent and how long it was blocked, per kind of call ("ring",
    "all_gather", "all_to_all", "broadcast"). ``ops`` lists every call, so a benchmark can
    replay the same traffic without compute: ("ring", send bytes, receive bytes),
    ("all_gather", bytes), ("all_to_all", bytes), ("broadcast", bytes, source)."""

    bytes_sent: int = 0
    blocked: dict[str, float] = field(default_factory=dict)
    ops: list[tuple] = field(default_factory=list)

    @property
    def blocked_s(self) -> float:
        return sum(self.blocked.values())

    def add(self, sent: int, op: tuple) -> None:
        self.bytes_sent += sent
        self.ops.append(op)

    def timed(self, kind: str, start: float) -> None:
        """Count the time since ``start`` (``time.perf_counter``) as blocked in ``kind``."""
        self.blocked[kind] = self.blocked.get(kind, 0.0) + time.perf_counter() - start


# torch 2.13 renamed all_gather_into_tensor; gloo takes only the concatenated output form
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Pending:
    """An async collective: ``wait()`` blocks (counted) and returns its result."""

    def __init__(self, work, result: torch.Tensor, stats: CommStats, kind: str) -> None:
        self.work, self.result, self.stats, self.kind = work, result, stats, kind

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        self.work.wait()
        self.stats.timed(self.kind, start)
        return self.result


class RingComm:
    """The ring over a process group: ``send_recv`` starts one step (this rank's block to
    the next rank, the previous rank's block into ``recv``), ``wait`` finishes it. Ranks are
    group ranks. ``batched=False`` uses plain isend/irecv instead of ``batch_isend_irecv``
    (some gloo builds have hung in the batched call)."""

    def __init__(self, group: dist.ProcessGroup | None = None, batched: bool = True) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.batched = batched
        self.stats = CommStats()
        self._works: list = []

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Start sending ``send`` to the next rank and receiving into ``recv`` from the previous.
        Empty tensors are skipped (both ends know the sizes, so they skip together)."""
        if self._works:
            raise RuntimeError("send_recv called twice without wait()")
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self._global(self.next_rank), self.group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self._global(self.prev_rank), self.group))
        if self.batched and ops:
            self._works = dist.batch_isend_irecv(ops)
        else:
            self._works = [op.op(op.tensor, op.peer, op.group) for op in ops]
        self.stats.add(tensor_bytes(send), ("ring", tensor_bytes(send), tensor_bytes(recv)))

    def wait(self) -> None:
        start = time.perf_counter()
        for work in self._works:
            work.wait()
        self._works = []
        self.stats.timed("ring", start)

    def all_gather(self, x: torch.Tensor, async_op: bool = False) -> torch.Tensor | Pending:
        """Every rank's ``x`` stacked in rank order: [N, *x.shape] (same shape on every rank)."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self.stats.add((self.world_size - 1) * tensor_bytes(x), ("all_gather", tensor_bytes(x)))
        start = time.perf_counter()
        work = _all_gather_single(out, x[None], group=self.group, async_op=True)  # (1, ...) -> (N, ...)
        pending = Pending(work, out, self.stats, "all_gather")
        self.stats.timed("all_gather", start)
        return pending if async_op else pending.wait()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...]: row j goes to rank j; returns [N, ...] with row j from rank j."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.stats.add((self.world_size - 1) * tensor_bytes(x) // self.world_size, ("all_to_all", tensor_bytes(x)))
        start = time.perf_counter()
        dist.all_to_all_single(out, x, group=self.group)
        self.stats.timed("all_to_all", start)
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """``x`` from group rank ``src`` to every rank (in place; returned for convenience)."""
        sent = (self.world_size - 1) * tensor_bytes(x) if self.rank == src else 0
        self.stats.add(sent, ("broadcast", tensor_bytes(x), src))
        start = time.perf_counter()
        dist.broadcast(x, self._global(src), group=self.group)
        self.stats.timed("broadcast", start)
        return x

    def barrier(self) -> None:
        """Wait until every rank gets here (not counted: it starts a timed phase)."""
        dist.barrier(group=self.group)

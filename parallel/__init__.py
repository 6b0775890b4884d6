"""Sequence parallelism primitives: ring attention, sequence sharding, attention over KV that
stays sharded (whole sequences or paged, for the engine), and the log-sum-exp merge.

    from longctx.parallel import ring_attention, SequenceSharding   # inside a process group
    from longctx.parallel.paged_sp import PagedSPAttention          # the engine's SP backend

These need only torch, torch.distributed and ``longctx.kernels``; the engine's ranks live in
``longctx.engine.sp``. ``spawn_ranks`` starts fresh ranks for the primitives' tests and benchmarks.
See docs/parallel.md.
"""

from .comm import CommStats, RingComm, init_distributed, init_from_env
from .ring_attention import ring_attention
from .sharded_kv import merge_decode_partials, sharded_prefix_attention
from .sharding import SequenceSharding

__all__ = ["CommStats", "RingComm", "SequenceSharding", "init_distributed", "init_from_env",
           "merge_decode_partials", "ring_attention", "sharded_prefix_attention", "spawn_ranks",
           "WorkerError"]

_LAZY = {"spawn_ranks": "launch", "WorkerError": "launch"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'longctx.parallel' has no attribute {name!r}")

"""Sequence parallelism: ring attention, sequence sharding and sharded-KV decode.

    from longctx.parallel import ring_attention, SequenceSharding   # inside a process group
    from longctx.parallel import generate_sp                         # one request, N processes

The attention pieces (``comm``, ``sharding``, ``local_attention``, ``ring_attention``,
``sharded_kv``, ``ulysses``) need only torch, torch.distributed and ``longctx.kernels``.
The generator (``sp_engine``, ``sp_generate``, ``launch``, ``worker``) runs the model and is
imported on first use, so ``import longctx.parallel`` stays light. See docs/parallel.md.
"""

from .comm import CommStats, RingComm, init_distributed, init_from_env
from .ring_attention import ring_attention
from .sharded_kv import merge_decode_partials, sharded_prefix_attention
from .sharding import SequenceSharding
from .ulysses import ulysses_attention

__all__ = ["CommStats", "RingComm", "SequenceSharding", "init_distributed", "init_from_env",
           "merge_decode_partials", "ring_attention", "sharded_prefix_attention", "ulysses_attention",
           "generate_sp", "spawn_ranks", "SPOutput", "WorkerError", "SequenceParallelConfig"]

_LAZY = {"generate_sp": "launch", "spawn_ranks": "launch", "SPOutput": "launch",
         "WorkerError": "launch", "SequenceParallelConfig": "sp_engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'longctx.parallel' has no attribute {name!r}")

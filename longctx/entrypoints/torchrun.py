"""Sequence parallelism across machines: any ``longctx`` command under ``torchrun``.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m longctx.entrypoints.torchrun serve --model /models/llama --dtype bfloat16
    torchrun --standalone --nproc-per-node 2 -m longctx.entrypoints.torchrun generate --prompt-file doc.txt

Owns: what each rank of such a run does. Rank 0 runs the command (``longctx.entrypoints.cli``) with
``sequence_parallel_size`` set to the world size; its engine joins torchrun's process group
instead of starting workers (``longctx.engine.sp``). Every other rank reads the same engine flags,
builds its own model as the engine does (``prepare_model``; on CUDA onto its own GPU) and
serves rank 0's commands (``longctx.engine.sp.torchrun_worker``) until rank 0 stops it.
Never: anything a command does (that is the CLI), or exchanges of its own.

Rank 0 hides torchrun's RANK and WORLD_SIZE from the command (``longctx batch`` reads them as
its own data-parallel mode) and hands them to the engine in ``LONGCTX_SP_TORCHRUN``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from longctx.engine import sp

HIDDEN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    missing = [k for k in HIDDEN[:2] + ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"longctx.entrypoints.torchrun: error: not started by torchrun ({', '.join(missing)} unset); "
              "run: torchrun --nproc-per-node N -m longctx.entrypoints.torchrun COMMAND ...", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        from longctx.entrypoints import cli

        os.environ[sp.TORCHRUN_ENV] = ",".join(f"{k}={os.environ.pop(k)}" for k in HIDDEN if k in os.environ)
        return cli.main([*argv, "--sequence-parallel-size", str(world)])
    return _worker(argv, rank, world)


def _worker(argv: list[str], rank: int, world: int) -> int:
    import torch

    from longctx.entrypoints import cli
    from longctx.attention import flash_attn_available
    from longctx.config import DEFAULT_KV_CACHE_GB, resolve_auto, split_engine_kwargs
    from longctx.model.prepare import prepare_model

    args, _ = cli.build_parser().parse_known_args(argv)
    load, cache, _, _, parallel = split_engine_kwargs({**cli.config_kwargs(args), "sequence_parallel_size": world})
    device = torch.device(load.device)
    load, cache = resolve_auto(load, cache, device.type, flash_attn_available())  # as rank 0's engine
    if cache.kv_cache_gb is None:
        cache = dataclasses.replace(cache, kv_cache_gb=DEFAULT_KV_CACHE_GB)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        load = dataclasses.replace(load, device=str(device))
    model, _ = prepare_model(load, parallel, device)
    sp.torchrun_worker(load, cache, parallel, model, device, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())

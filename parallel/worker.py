"""The ``torchrun`` entry point: one rank of a sequence-parallel generation, on any number of
nodes.

Owns: reading the run's flags and torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), building the prompt on rank 0 and broadcasting its token ids,
running ``generate_on_rank``, and printing rank 0's text (and, with ``--report-dir``, one JSON
report per rank).
Never: starting processes (torchrun does), or anything ``generate_sp`` does differently.

    torchrun --nproc-per-node 2 -m longctx.parallel.worker --prompt-file doc.txt --max-tokens 64
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m longctx.parallel.worker --model /models/llama --prompt-file doc.txt --dtype bfloat16

A failure prints ``longctx.parallel.worker: rank R: <error>`` and exits 1; torchrun then
stops the other ranks, which also fail on their next transfer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from longctx.sampling_params import SamplingParams

from .comm import RingComm, init_from_env
from .launch import generate_on_rank
from .sharding import MODES
from .sp_engine import DTYPES, SequenceParallelConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m longctx.parallel.worker",
                                description="One rank of sequence-parallel generation (run under torchrun).")
    p.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf file")
    p.add_argument("--prompt-file", type=Path, required=True, help="the document")
    p.add_argument("--instruction", default=None, help="text placed after the document")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="keep the first N document tokens (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chunk-size", type=int, default=2048, help="prompt tokens per rank per prefill round")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--sharding", choices=MODES, default="zigzag")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads per rank (0: leave as is)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any transfer may wait for a peer")
    p.add_argument("--report-dir", type=Path, default=None, help="write rank<R>.json reports here")
    return p


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    doc_ids = tokenizer.encode(args.prompt_file.read_text(encoding="utf-8"), add_special_tokens=False)
    if args.max_prompt_tokens:
        doc_ids = doc_ids[:args.max_prompt_tokens]
    body = tokenizer.decode(doc_ids)
    if args.instruction:
        body = f"{body}\n\n{args.instruction}"
    if not args.chat:
        return tokenizer.encode(body, add_special_tokens=False)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _share_prompt(ids: list[int] | None, comm: RingComm, device: torch.device) -> list[int]:
    """Rank 0's prompt token ids on every rank."""
    length = torch.tensor([len(ids) if ids is not None else 0], device=device)
    comm.broadcast(length, 0)
    tensor = torch.tensor(ids, device=device) if ids is not None else torch.empty(int(length), dtype=torch.long,
                                                                                   device=device)
    return comm.broadcast(tensor, 0).tolist()


def run(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = init_from_env(None if args.backend == "auto" else args.backend, args.timeout)
    comm = RingComm()
    tokenizer, ids, eos = None, None, None
    if comm.rank == 0:
        from longctx.model.loader import resolve_model
        from longctx.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(args.model))
        ids = _prompt_ids(args, tokenizer)
        eos = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    prompt = _share_prompt(ids, comm, device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    config = SequenceParallelConfig(comm.world_size, args.chunk_size, args.block_size, args.sharding, args.dtype)
    report = generate_on_rank(comm, device, args.model, prompt, params, config, eos, 0)
    if args.report_dir is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / f"rank{comm.rank}.json").write_text(json.dumps(asdict(report)))
    if comm.rank == 0:
        print(tokenizer.decode(report.token_ids, skip_special_tokens=True))
        print(f"[{len(prompt)} prompt tokens over {comm.world_size} ranks: prefill "
              f"{report.prefill.seconds:.2f} s, {len(report.token_ids)} tokens in "
              f"{report.decode.seconds:.2f} s, finish: {report.finish_reason}]", file=sys.stderr)
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except Exception as err:  # noqa: BLE001 - one line per rank, then torchrun stops the rest
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        print(f"longctx.parallel.worker: rank {rank}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

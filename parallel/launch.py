"""Starting the ranks of a sequence-parallel run on one machine, and ``generate_sp``.

Owns: ``spawn_ranks`` (N fresh processes, one process group over a rendezvous file, a
function run on each, results or a clear error back) and ``generate_sp``, the call the API
and CLI make for ``sequence_parallel_size=N``.
Never: the generation loop itself (``sp_generate``), multi-node start-up (that is
``torchrun`` with ``longctx.parallel.worker``).

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
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longctx.model.llama import LlamaForCausalLM
from longctx.sampling_params import SamplingParams

from .comm import RingComm, default_backend, init_distributed
from .sp_engine import DTYPES, SequenceParallelConfig
from .sp_generate import RankReport, SequenceParallelGenerator

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


# ---------------------------------------------------------------------- generate_sp

@dataclass
class SPOutput:
    """A finished sequence-parallel request: rank 0's tokens and every rank's report."""

    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    ranks: list[RankReport]

    @property
    def prefill_s(self) -> float:
        return max(r.prefill.seconds for r in self.ranks)

    @property
    def decode_s(self) -> float:
        return max(r.decode.seconds for r in self.ranks)


def check_request(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ``ValueError`` for a request the model cannot take."""
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the context window is "
                         f"{max_model_len}, which leaves no room to generate")


def _materialize(model: str | LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    if isinstance(model, str):
        from longctx.model.loader import load_model

        return load_model(model, dtype=dtype, device=device)
    return model.to(device=device, dtype=dtype)


def generate_on_rank(comm: RingComm, device: torch.device, model: str | LlamaForCausalLM,
                     prompt_token_ids: list[int], params: SamplingParams,
                     config: SequenceParallelConfig, eos_token_ids: tuple[int, ...] | None,
                     max_model_len: int) -> RankReport:
    """One rank of ``generate_sp`` (also what ``worker`` runs under torchrun)."""
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as the engine: denormal SiLU outputs slow matmuls down
    model = _materialize(model, DTYPES[config.dtype], device)
    max_len = max_model_len or model.config.max_position_embeddings
    check_request(prompt_token_ids, model.config.vocab_size, max_len)
    eos = frozenset(model.config.eos_token_ids) | frozenset(eos_token_ids or ())
    generator = SequenceParallelGenerator(model, comm, config, device)
    return generator.generate(prompt_token_ids, params, eos, max_len)


def generate_sp(model: str | LlamaForCausalLM, prompt_token_ids: list[int],
                sampling_params: SamplingParams | None = None, *, sequence_parallel_size: int,
                chunk_size: int = 2048, block_size: int = 64, sharding: str = "zigzag",
                dtype: str = "float32", eos_token_ids: tuple[int, ...] | None = None,
                max_model_len: int = 0, num_threads: int = 0, backend: str | None = None,
                timeout_s: float | None = None, group_timeout_s: float = 600.0) -> SPOutput:
    """Generate for one prompt with ``sequence_parallel_size`` processes on this machine.

    model: a name (alias, HF folder, .gguf: every rank loads it; use this on CUDA) or a loaded
        CPU ``LlamaForCausalLM`` (shared with the ranks through shared memory, not copied).
    chunk_size: prompt tokens per rank per prefill round (a round is N * chunk_size tokens).
    block_size, dtype ("float32" | "bfloat16" | "float16"), sharding ("zigzag" | "contiguous").
    eos_token_ids: stop tokens besides the model config's EOS ids (e.g. the tokenizer's).
    max_model_len: the context window (0: the model's).
    num_threads: torch threads per rank (0: the machine's cores divided among the ranks).
    backend: "gloo" | "nccl" (None: NCCL when CUDA exists).
    timeout_s: bound on the whole run (None: none); group_timeout_s: on any one transfer.

    Token-level stop rules apply (stop tokens, max_tokens, the window); ``sampling_params.stop``
    strings do not (apply them to the decoded text). Raises ``ValueError`` for a bad request
    and ``WorkerError`` when a rank fails.
    """
    config = SequenceParallelConfig(sequence_parallel_size, chunk_size, block_size, sharding, dtype)
    if (backend or default_backend()) == "nccl" and config.world_size > torch.cuda.device_count():
        raise ValueError(f"sequence_parallel_size {config.world_size} needs as many GPUs; this machine has "
                         f"{torch.cuda.device_count()} (use torchrun across nodes for more)")
    params = sampling_params or SamplingParams()
    prompt = list(prompt_token_ids)
    if isinstance(model, LlamaForCausalLM):
        if model.has_packed_linears():
            raise ValueError("a model with oneDNN-packed weights cannot be shared with the ranks "
                             "(opaque tensors have no shared storage): load it with "
                             "cpu_matmul='blas', or pass the model's name so each rank loads it")
        check_request(prompt, model.config.vocab_size, max_model_len or model.config.max_position_embeddings)
    threads = num_threads or max(1, (os.cpu_count() or 1) // config.world_size)
    reports = spawn_ranks(generate_on_rank, config.world_size,
                          (model, prompt, params, config, eos_token_ids, max_model_len),
                          backend=backend, num_threads=threads, timeout_s=timeout_s,
                          group_timeout_s=group_timeout_s)
    return SPOutput(reports[0].token_ids, reports[0].finish_reason, len(prompt), reports)

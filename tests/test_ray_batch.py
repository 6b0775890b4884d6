"""Batch jobs on Ray (longctx.entrypoints.ray_batch): one local Ray cluster for the module (4 logical
CPUs), two actors with one torch thread each, a tiny random Llama, 8 records over 2 documents
plus bad lines. Every record once, results equal to the local path's (greedy), each document's
records on one actor, a SIGKILLed ``longctx batch --ray`` resumed without losses or duplicates,
and ``LongctxPredictor`` under Ray Data's ``map_batches``. Skipped when Ray is not installed."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.entrypoints import batch, cli
from longctx.entrypoints.batch import BatchJob
from longctx.config import ConfigError
from tiny_models import results_by_key, strip_timings

ROOT = Path(__file__).resolve().parent.parent
HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed: pip install 'longctx[ray]' "
                                                    "(the dev extra has it)")
ENGINE = ["--block-size", "16", "--max-in-flight", "1"]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tiny_engine_folder):
    return tiny_engine_folder


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster shared by the module's tests; its GCS address for other drivers."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _lines() -> list:
    lines: list = []
    for doc in ("a", "b"):
        lines += [{"id": f"{doc}{i}", "task": "generate", "document_path": f"{doc}.txt",
                   "prompt": f"Question {i} about {doc}?", "max_tokens": 40, "ignore_eos": True}
                  for i in range(3)]
        lines.append({"id": f"{doc}-ask", "task": "ask", "document_path": f"{doc}.txt",
                      "questions": ["Who?", "Why?"], "max_tokens": 16, "ignore_eos": True})
    lines[2:2] = ["{this is not json", {"id": "no-task", "prompt": "x"}]
    lines.append({"id": "missing", "task": "summarize", "document_path": "missing.txt"})
    return lines


DOC_IDS = {"a": ["a0", "a1", "a2", "a-ask"], "b": ["b0", "b1", "b2", "b-ask"]}


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-job")
    (folder / "a.txt").write_text("Document A. " + "The apple tree grows near the river. " * 8)
    (folder / "b.txt").write_text("Document B. " + "Blue boats sail before the storm. " * 9)
    path = folder / "in.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in _lines()))
    return path


def _job(inp: Path, out: Path, tiny: str, *extra: str) -> BatchJob:
    """The job ``longctx batch`` builds from these flags."""
    args = cli.build_parser().parse_args(["batch", str(inp), "-o", str(out), "--model", tiny,
                                          *ENGINE, "--progress", "off", *extra])
    return BatchJob(args.input, args.output, batch.BatchConfig(**cli.config_kwargs(args, (batch.BatchConfig,))),
                    cli.config_kwargs(args), cli._sampling_defaults(args))


@pytest.fixture(scope="module")
def expected(tiny, job_input, tmp_path_factory):
    """The local (non-Ray) path's results for the same input."""
    out = tmp_path_factory.mktemp("ray-ref") / "out.jsonl"
    batch.run_batch(_job(job_input, out, tiny))
    return _by_key(out)


_by_key = results_by_key  # the local batch tests' reading of a result file, timings stripped


def _num_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


# ---------------------------------------------------------------- without a cluster


def test_without_ray_the_error_says_what_to_install(tmp_path, monkeypatch, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "task": "generate", "prompt": "p"}) + "\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    from longctx.entrypoints.ray_batch import require_ray

    with pytest.raises(ConfigError, match=r"install longctx\[ray\]"):
        require_ray()
    assert cli.main(["batch", str(inp), "-o", str(tmp_path / "out.jsonl"), "--ray"]) == 2
    assert r"install longctx[ray]" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_ray_flag_errors(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "task": "generate", "prompt": "p"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    for argv, message in [(["--ray-actors", "2"], "--ray-actors needs --ray"),
                          (["--num-workers", "2", "--ray"], "leave --num-workers at 1"),
                          (["--ray-actors", "-1", "--ray"], "--ray-actors must be >= 0")]:
        assert cli.main(["batch", str(inp), "-o", out, *argv]) == 2
        assert message in capsys.readouterr().err


def test_batch_rows_of_every_ray_data_format():
    np = pytest.importorskip("numpy")
    from longctx.entrypoints.ray_batch import _batch_rows

    text = {"text": np.array(['{"id": 1}', "oops"], dtype=object)}
    assert list(_batch_rows(text)) == [(None, '{"id": 1}'), (None, "oops")]
    columns = {"id": np.array(["q", "g"], dtype=object), "task": np.array(["ask", "generate"], dtype=object),
               "questions": np.array([np.array(["Who?", "Why?"], dtype=object), None], dtype=object),
               "max_tokens": np.array([8.0, float("nan")]), "line": np.array([3, 4])}
    assert list(_batch_rows(columns)) == [
        (3, {"id": "q", "task": "ask", "questions": ["Who?", "Why?"], "max_tokens": 8}),
        (4, {"id": "g", "task": "generate"})]


# ---------------------------------------------------------------- on a cluster


@needs_ray
def test_ray_job_equals_local_one_actor_per_document(cluster, tiny, job_input, expected, tmp_path):
    from longctx.entrypoints.ray_batch import run_ray_batch

    out = tmp_path / "out.jsonl"
    job = _job(job_input, out, tiny, "--num-threads", "1")
    report = run_ray_batch(job, num_actors=2)
    got = _by_key(out)
    assert got == expected  # every record once, same texts and counts as the local path
    assert len(got) == 8 + 3
    assert got["line:3"]["error"].startswith("not valid JSON")
    assert got["id:no-task"]["error"].startswith("'task' must be one of")
    assert got["id:missing"]["error"].startswith("cannot read the document")
    assert report.actors == 2 and len({info["pid"] for info in report.actor_info}) == 2
    for doc, ids in DOC_IDS.items():  # a document's records all ran on one actor
        assert len({report.actor_of[f"id:{i}"] for i in ids}) == 1, (doc, report.actor_of)
    again = run_ray_batch(job, num_actors=2)  # a finished job: nothing to do, no actors
    assert (again.actors, again.written) == (0, 0)
    assert _by_key(out) == expected


@pytest.mark.slow  # a killed job resuming: test_batch.py (local workers); ray's job: test_ray_job_equals_local_one_actor_per_document
@needs_ray
def test_killed_ray_cli_resumes_without_losses_or_duplicates(cluster, tiny, job_input, expected, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "longctx", "batch", str(job_input), "--output", str(out), "--model", tiny,
           *ENGINE, "--num-threads", "1", "--ray", cluster, "--ray-actors", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # Ray's start-up on a loaded machine took more than 120 s
    try:  # the two bad lines come first, then results from the actors
        while _num_lines(out) < 2 + 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done_before = _num_lines(out)
    assert 3 <= done_before < len(expected), (f"the job was not killed mid-run: {done_before} of "
                                              f"{len(expected)} lines written when it was killed")
    with open(out, "a") as f:  # as if killed in the middle of writing a line
        f.write('{"id": "b2", "task": "gen')
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{out}: {len(expected)} records done (3 errors)" in resumed.stderr
    assert _by_key(out) == expected


@needs_ray
def test_map_batches_entry_on_ray_data(cluster, tiny, job_input, expected):
    import ray

    from longctx.entrypoints.ray_batch import LongctxPredictor

    engine = {"model": tiny, "block_size": 16, "num_threads": 1}
    ds = ray.data.read_text(str(job_input)).map_batches(
        LongctxPredictor, fn_constructor_kwargs={"engine_kwargs": engine, "base_dir": str(job_input.parent),
                                                 "max_in_flight": 1},
        compute=ray.data.ActorPoolStrategy(size=2), batch_size=4, num_cpus=1)
    rows = ds.take_all()
    got = {row["key"]: strip_timings(json.loads(row["result"])) for row in rows}
    assert len(rows) == len(got) == len(expected)
    for key, result in expected.items():
        if "error" not in result:
            assert got[key] == result, key
    # read_text rows carry no line numbers: error lines say "line": null
    assert got["line:None"]["error"].startswith("not valid JSON")
    assert got["id:no-task"]["error"] == expected["id:no-task"]["error"]
    assert got["id:missing"]["error"].startswith("cannot read the document")

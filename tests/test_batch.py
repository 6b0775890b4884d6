"""``longctx batch`` (longctx.entrypoints.batch): records and their error lines, grouping and sharding,
result files (partial lines, parts, merging), and whole jobs on a tiny random Llama in real
subprocesses: killed with SIGKILL mid-run and resumed, ``--num-workers 2`` and torchrun with
two ranks, each compared with an uninterrupted single-worker run (greedy)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.entrypoints import batch
from longctx.entrypoints.batch import BatchConfig, ProgressBar, ResultLog, read_records
from longctx.config import ConfigError
from tiny_models import make_engine_checkpoint, results_by_key

ROOT = Path(__file__).resolve().parent.parent


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _bad(path: Path, lines: list) -> dict[int, str]:
    records, bad = read_records(_write_jsonl(path, lines))
    assert not records
    return {b.line: b.error for b in bad}


# ---------------------------------------------------------------- records


def test_good_records_parse_with_defaults_and_overrides(tmp_path):
    (tmp_path / "doc.txt").write_text("A document.")
    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "g", "task": "generate", "prompt": "Hi", "temperature": 0.5},
        "",
        {"id": 7, "task": "ask", "document_path": "doc.txt", "questions": ["Why?"], "stop": ["\n"]},
        {"id": "s", "task": "summarize", "document": "Text.", "instructions": "Be brief."},
    ])
    records, bad = read_records(path, {"temperature": 0.0, "max_tokens": None, "seed": None})
    assert not bad
    assert [(r.line, r.id, r.task) for r in records] == [(1, "g", "generate"), (3, 7, "ask"),
                                                         (4, "s", "summarize")]
    g, a, s = (r.params for r in records)
    assert (g.temperature, g.max_tokens) == (0.5, 256)
    assert (a.temperature, a.max_tokens, a.stop) == (0.0, 128, ("\n",))
    assert s.max_tokens == 256
    assert records[1].document_path == tmp_path / "doc.txt"
    assert records[1].document_key == f"path:{(tmp_path / 'doc.txt').resolve()}"
    assert records[0].document_key == ""


def test_a_document_field_is_text_even_when_it_names_a_file(tmp_path):
    """A job's ``document`` is never read as a file (it was, when the string named one: a job
    could read any file the worker can); ``document_path`` must name a regular file."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the private text")
    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "t", "task": "summarize", "document": str(secret)},
        {"id": "f", "task": "summarize", "document_path": "fifo"},
    ])
    os.mkfifo(tmp_path / "fifo")
    (text_record, fifo_record), bad = read_records(path)
    assert not bad
    assert batch._document(text_record) == str(secret)
    started = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        batch._document(fifo_record)  # at once: opening a FIFO to read would wait for a writer
    assert time.monotonic() - started < 60  # (a hang would block for good; 60 s: a busy machine)


def test_malformed_lines_get_reasons(tmp_path):
    errors = _bad(tmp_path / "in.jsonl", [
        "{not json",
        "[1, 2]",
        {"task": "generate", "prompt": "no id"},
        {"id": True, "task": "generate", "prompt": "bool id"},
        {"id": "a", "task": "translate"},
        {"id": "b", "task": "generate", "prompt": "x", "temprature": 0.1},
        {"id": "c", "task": "generate"},
        {"id": "d", "task": "ask", "document": "doc", "questions": "one string"},
        {"id": "e", "task": "ask", "document": "doc", "document_path": "doc.txt", "questions": ["q"]},
        {"id": "f", "task": "summarize"},
        {"id": "g", "task": "generate", "prompt": "x", "top_p": 2},
        {"id": "h", "task": "generate", "prompt": "x", "chat": "yes"},
        {"id": "a", "task": "generate", "prompt": "repeated id"},
    ])
    assert errors[1].startswith("not valid JSON")
    assert errors[2] == "a record must be a JSON object, got list"
    assert errors[3] == "'id' must be a non-empty string or an integer, got None"
    assert errors[4] == "'id' must be a non-empty string or an integer, got True"
    assert errors[5] == "'task' must be one of generate, summarize, ask, got 'translate'"
    assert errors[6].startswith("unknown field(s) 'temprature' for task 'generate'; known: id, task")
    assert errors[7] == "a generate record needs 'prompt': a non-empty string"
    assert errors[8] == "'questions' must be a non-empty list of non-empty strings"
    assert errors[9] == "give 'document' or 'document_path', not both"
    assert errors[10] == "a summarize record needs 'document' (the text) or 'document_path'"
    assert errors[11] == "top_p must be in (0, 1], got 2"
    assert errors[12] == "'chat' must be true or false, got 'yes'"
    assert errors[13] == "duplicate id 'a' (first on line 5); record skipped"


def test_error_lines_and_resume_keys(tmp_path):
    _, bad = read_records(_write_jsonl(tmp_path / "in.jsonl", [
        "oops", {"id": "x", "task": "nope"}]))
    lines = [batch.error_line(b, b.error) for b in bad]
    assert lines[0] == {"id": None, "line": 1, "task": None, "error": bad[0].error}
    assert lines[1] == {"id": "x", "line": 2, "task": "nope", "error": bad[1].error}
    assert [batch.result_key(x) for x in lines] == ["line:1", "id:x"] == [b.key for b in bad]


def test_unreadable_input_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the input .*missing.jsonl"):
        read_records(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- grouping and sharding


def test_records_sharing_a_document_are_grouped_in_first_appearance_order(tmp_path):
    (tmp_path / "a.txt").write_text("A" * 100)
    (tmp_path / "b.txt").write_text("B" * 10)
    records, _ = read_records(_write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "task": "summarize", "document_path": "a.txt"},
        {"id": 2, "task": "generate", "prompt": "p"},
        {"id": 3, "task": "ask", "document_path": "b.txt", "questions": ["q"]},
        {"id": 4, "task": "ask", "document_path": "./a.txt", "questions": ["q"]},
        {"id": 5, "task": "generate", "document": "inline", "prompt": "p"},
        {"id": 6, "task": "generate", "prompt": "p"},
        {"id": 7, "task": "ask", "document": "inline", "questions": ["q"]},
    ]))
    groups = batch.group_records(records)
    assert [[r.id for r in g] for g in groups] == [[1, 4], [2], [3], [5, 7], [6]]


def test_shard_is_disjoint_complete_and_balanced(tmp_path):
    lines = [{"id": i, "task": "generate", "document": "x" * (1000 * (i + 1)), "prompt": "p",
              "max_tokens": 1} for i in range(6)]
    records, _ = read_records(_write_jsonl(tmp_path / "in.jsonl", lines))
    groups = batch.group_records(records)
    shards = [[g[0].id for g in batch.shard(groups, rank, 2)] for rank in range(2)]
    # heaviest first to the least loaded: 5 -> w0, 4 -> w1, 3 -> w1, 2 -> w0, 1 -> w0, 0 -> w1
    assert shards == [[1, 2, 5], [0, 3, 4]]
    assert [g[0].id for g in batch.shard(groups, 0, 1)] == list(range(6))


def test_runs_batch_consecutive_generates(tmp_path):
    lines = [{"id": i, "task": t, "document": "d", "prompt": "p", "questions": ["q"]}
             for i, t in enumerate(["generate"] * 3 + ["ask"] + ["generate"] * 2)]
    for line in lines:
        del line["questions" if line["task"] == "generate" else "prompt"]
    records, _ = read_records(_write_jsonl(tmp_path / "in.jsonl", lines))
    runs = [[r.id for r in run] for run in batch._runs(records, 2)]
    assert runs == [[0, 1], [2], [3], [4, 5]]


# ---------------------------------------------------------------- result files


def test_result_log_cuts_an_unfinished_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x"}\n{"id": "b", "te')
    assert [r["id"] for r in batch.read_results(out)] == ["a"]
    log = ResultLog(out)
    log.write({"id": "c", "text": "y"})
    log.close()
    assert out.read_text() == '{"id": "a", "text": "x"}\n{"id": "c", "text": "y"}\n'


def test_a_line_that_is_not_a_result_stops_the_job(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not a result line"):
        batch.read_results(out)


def test_done_keys_and_merge_parts_never_duplicate(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\n')
    batch.part_path(out, 0).write_text('{"id": "a"}\n{"id": "b"}\n{"id": null, "line": 9, "error": "e"}\n')
    batch.part_path(out, 1).write_text('{"id": "c"}\n{"id": "d", "tex')
    assert batch.done_keys(out) == {"id:a", "id:b", "line:9", "id:c"}
    assert batch.merge_parts(out) == 3
    assert [batch.result_key(r) for r in batch.read_results(out)] == ["id:a", "id:b", "line:9", "id:c"]
    assert batch.part_paths(out) == []
    assert batch.merge_parts(out) == 0


def test_progress_bar_draws_records_rate_and_eta():
    stream = io.StringIO()
    bar = ProgressBar(4, True, stream)
    bar.update(tokens=10)
    bar.close()
    assert "1/4 records" in stream.getvalue() and "tok/s" in stream.getvalue()
    assert "batch:  25%" in stream.getvalue() and "[00:00<00:0" in stream.getvalue()  # elapsed<left
    quiet = io.StringIO()
    bar = ProgressBar(4, False, quiet)
    bar.update()
    bar.close()
    assert quiet.getvalue() == ""


def test_batch_config_checks_values():
    with pytest.raises(ConfigError, match="num_workers must be >= 1, got 0"):
        BatchConfig(num_workers=0)
    with pytest.raises(ConfigError, match="progress must be one of auto, on, off, got 'loud'"):
        BatchConfig(progress="loud")


# ---------------------------------------------------------------- whole jobs in subprocesses


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-batch")
    make_engine_checkpoint(folder)
    return str(folder)


def _job_lines() -> list:
    lines: list = [{"id": f"g{i}", "task": "generate", "prompt": f"Continue item {i}.",
                    "document": f"Doc {i}: " + f"the {i}th thing is blue. " * 6,
                    "max_tokens": 32, "ignore_eos": True} for i in range(12)]
    lines[3:3] = ["{this is not json", {"id": "no-task", "prompt": "x"}]
    lines.append({"id": "ask", "task": "ask", "document": "Ask doc. " + "fact here. " * 30,
                  "questions": ["What?", "Why?", "How?"], "max_tokens": 12})
    lines.append({"id": "sum", "task": "summarize", "max_tokens": 16,
                  "document": "\n\n".join(f"Part {i}. " + "words " * 40 for i in range(12))})
    lines.append({"id": "too-long", "task": "generate", "prompt": "p", "document": "z" * 1100})
    return lines


def _batch_cmd(inp: Path, out: Path, tiny: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "longctx", "batch", str(inp), "--output", str(out), "--model", tiny,
            "--block-size", "16", "--max-in-flight", "1", *extra]


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


_by_key = results_by_key


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch-ref")
    inp = _write_jsonl(folder / "in.jsonl", _job_lines())
    out = folder / "out.jsonl"
    _run(_batch_cmd(inp, out, tiny))
    return inp, _by_key(out)


def test_uninterrupted_run_has_every_record_once_and_errors(uninterrupted):
    _, results = uninterrupted
    assert len(results) == len(_job_lines())
    assert results["line:4"]["error"].startswith("not valid JSON")
    assert results["id:no-task"]["error"].startswith("'task' must be one of")
    assert "context window is 1024 tokens" in results["id:too-long"]["error"]
    assert all(len(results[f"id:g{i}"]["text"]) > 0 for i in range(12))
    assert results["id:g0"]["completion_tokens"] == 32
    assert len(results["id:ask"]["answers"]) == 3
    assert results["id:sum"]["map_reduce"] and results["id:sum"]["num_pieces"] >= 2


def test_killed_job_resumes_without_duplicates_and_equals_uninterrupted(tiny, uninterrupted, tmp_path):
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_batch_cmd(inp, out, tiny), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while _num_lines(out) < 2 + 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done_before = _num_lines(out)
    assert 5 <= done_before < len(expected), "the job was not killed mid-run"
    with open(out, "a") as f:  # as if killed in the middle of writing a line
        f.write('{"id": "g11", "task": "gen')
    _run(_batch_cmd(inp, out, tiny))
    assert _by_key(out) == expected
    _run(_batch_cmd(inp, out, tiny))  # a finished job re-run changes nothing
    assert _by_key(out) == expected


def _num_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_two_spawned_workers_equal_one(tiny, uninterrupted, tmp_path):
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    _run(_batch_cmd(inp, out, tiny, "--num-workers", "2"))
    assert _by_key(out) == expected
    assert batch.part_paths(out) == []


def test_sequence_parallel_job_equals_one(tiny, uninterrupted, tmp_path):
    """``--sp 2``: one engine over two ranks runs the whole job (generate, ask, map-reduce
    summaries, error rows) with the same results as one rank."""
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    _run(_batch_cmd(inp, out, tiny, "--sp", "2"))
    assert _by_key(out) == expected


@pytest.mark.slow  # torchrun's ranks: tests/parallel/test_sp_torchrun.py; a job on two ranks: test_sequence_parallel_job_equals_one
@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed next to this Python")
def test_torchrun_two_ranks_equal_one(tiny, uninterrupted, tmp_path):
    inp, expected = uninterrupted
    out = tmp_path / "out.jsonl"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = _batch_cmd(inp, out, tiny)
    _run([torchrun, "--standalone", "--nproc-per-node", "2", *cmd[1:]])
    assert _by_key(out) == expected
    assert batch.part_paths(out) == []


def test_cli_errors_are_one_line(tmp_path):
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "task": "generate", "prompt": "p"}])
    for args, message in [([str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")],
                           "cannot read the input"),
                          ([str(inp), "-o", str(inp)], "--output must not be the input file"),
                          ([str(inp), "-o", str(tmp_path / "o.jsonl"), "--progress", "loud"],
                           "progress must be one of")]:
        proc = subprocess.run([sys.executable, "-m", "longctx", "batch", *args], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 2
        assert proc.stderr.startswith("longctx: error: ") and message in proc.stderr
        assert proc.stderr.count("\n") == 1

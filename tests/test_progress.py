"""Progress bars (tqdm on stderr): on when stderr is a terminal or with ``--progress on``,
silent with ``--no-progress``/``--progress off`` or a stderr that is not a terminal; they
never change what a command prints on stdout or writes to its output. Commands run in this
process on a tiny random Llama, stderr captured by pytest (not a terminal)."""

from __future__ import annotations

import io
import json
import re

import pytest

from longctx.entrypoints import batch, cli
from longctx.entrypoints.batch import ProgressBar, progress_bar, progress_enabled
from tiny_models import make_engine_checkpoint

ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "32"]
TIMING_FIELDS = {"time_to_first_token", "latency_s", "elapsed_s"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-progress")
    make_engine_checkpoint(folder)
    return str(folder)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _main(capsys, *argv: str) -> tuple[str, str]:
    assert cli.main(list(argv)) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def _totals(err: str, desc: str) -> list[tuple[int, int]]:
    """(done, total) of each drawing of the bar named ``desc``."""
    return [(int(a), int(b)) for a, b in re.findall(rf"{re.escape(desc)}:\s+\d+%\|[^|]*\| (\d+)/(\d+)", err)]


# ---------------------------------------------------------------- the pieces


def test_progress_modes_follow_the_terminal():
    assert progress_enabled("auto", _Terminal()) and progress_enabled("on", io.StringIO())
    assert not progress_enabled("auto", io.StringIO()) and not progress_enabled("off", _Terminal())


def test_records_bar_shows_totals_rate_and_time_left():
    stream = io.StringIO()
    bar = ProgressBar(3, True, stream)
    for tokens in (5, 7, 9):
        bar.update(tokens=tokens)
    bar.close()
    out = stream.getvalue()
    assert "batch: 100%" in out and "3/3 records" in out and "tok/s" in out
    assert out.endswith("\n") and "\r" in out  # tqdm redraws one line and leaves it
    assert (bar.done, bar.tokens) == (3, 21)
    for enabled, total in ((False, 3), (True, 0)):  # off, or nothing to do: silent
        quiet = io.StringIO()
        bar = ProgressBar(total, enabled, quiet)
        bar.update(tokens=4)
        bar.close()
        assert quiet.getvalue() == ""


def test_progress_bar_helper_is_silent_when_disabled():
    quiet = io.StringIO()
    bar = progress_bar("prefill", 10, "tok", False, quiet)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("command", ["generate", "summarize", "batch"])
def test_no_progress_is_progress_off(command, tmp_path):
    args = {"generate": ["generate", "x"], "summarize": ["summarize", "doc.txt"],
            "batch": ["batch", "in.jsonl", "-o", "out.jsonl"]}[command]
    parser = cli.build_parser()
    assert parser.parse_args(args).progress == "auto"
    assert parser.parse_args([*args, "--no-progress"]).progress == "off"
    assert parser.parse_args([*args, "--progress", "on"]).progress == "on"


# ---------------------------------------------------------------- commands


def test_generate_prefill_bar(tiny, capsys):
    prompt = "The prefill of this prompt takes a few chunks of thirty-two tokens each."
    base = ["generate", prompt, "--model", tiny, *ENGINE, "--max-tokens", "4", "--ignore-eos"]
    out_on, err_on = _main(capsys, *base, "--progress", "on")
    assert _totals(err_on, "prefill")[-1] == (len(prompt), len(prompt))  # one token per character
    assert "prefill: 100%" in err_on and "tok/s" in err_on
    out_off, err_off = _main(capsys, *base, "--no-progress")
    out_auto, err_auto = _main(capsys, *base)  # captured stderr is not a terminal
    for err in (err_off, err_auto):
        assert "prefill" not in err and "\r" not in err
    assert out_on == out_off == out_auto and len(out_on.strip()) > 0


def test_summarize_stage_bars(tiny, tmp_path, capsys):
    doc = tmp_path / "long.txt"  # longer than the 1K window: pieces, then combining
    doc.write_text("\n\n".join(f"Part {i}. " + "some words here " * 20 for i in range(6)))
    base = ["summarize", str(doc), "--model", tiny, "--block-size", "16", "--max-tokens", "8"]
    out_on, err_on = _main(capsys, *base, "--progress", "on")
    pieces = _totals(err_on, "pieces")
    assert pieces[0][0] == 0 and pieces[-1][0] == pieces[-1][1] >= 2
    combine = _totals(err_on, "combine level 1")
    assert combine and combine[-1][0] == combine[-1][1] >= 1
    out_off, err_off = _main(capsys, *base, "--no-progress")
    assert "pieces:" not in err_off and "combine" not in err_off and "\r" not in err_off
    assert out_on == out_off


def test_batch_records_bar_and_unchanged_results(tiny, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "task": "generate", "prompt": f"Item {i}.", "max_tokens": 6,
                         "ignore_eos": True}) for i in range(3)]
    inp.write_text("\n".join([*lines, "{bad json"]) + "\n")

    def run(name: str, *flags: str) -> tuple[str, list[dict]]:
        out = tmp_path / name
        _, err = _main(capsys, "batch", str(inp), "-o", str(out), "--model", tiny, *ENGINE,
                       "--max-in-flight", "2", *flags)
        results = sorted((_strip(r) for r in batch.read_results(out)), key=batch.result_key)
        return err, results

    err_on, on = run("on.jsonl", "--progress", "on")
    assert _totals(err_on, "batch")[-1] == (3, 3)  # records to run (the bad line is written first)
    assert "3/3 records" in err_on and "tok/s" in err_on
    for name, flags in (("off.jsonl", ["--no-progress"]), ("progress-off.jsonl", ["--progress", "off"]),
                        ("auto.jsonl", [])):
        err, results = run(name, *flags)
        assert err.startswith(str(tmp_path / name)) and err.count("\n") == 1  # the summary line only
        assert results == on
    assert len(on) == 4 and sum("error" in r for r in on) == 1


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in TIMING_FIELDS}

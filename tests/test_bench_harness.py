"""The benchmark harness (``benchmarks/run.py``): results land as records with a schema version,
the machine and the revision, under ``results/<bench>/<machine>/<rev>.json``; a tree with
changes is refused unless allowed, and then recorded as dirty; a failing script records nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(BENCH))  # run.py imports its neighbour machine.py
    try:
        spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_bench.py"
    script.write_text("import argparse, json, sys\n"
                      "p = argparse.ArgumentParser(); p.add_argument('--n', type=int); p.add_argument('--out')\n"
                      "a = p.parse_args()\n" + body)
    return script


def test_machine_folder_names(harness):
    assert harness.machine_slug("Intel(R) Xeon(R) Processor", 2) == "intel-xeon-processor-2c"
    assert harness.machine_slug("AMD EPYC 9R14 96-Core Processor", 2) == "amd-epyc-9r14-96-core-processor-2c"


def test_a_run_is_recorded_with_its_machine_and_revision(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({'tokens_s': a.n * 2}, open(a.out, 'w'))\n")
    rc, path = harness.run("e2e", ["--n", "21"], script=script, root=tmp_path / "results")
    assert rc == 0
    rev = harness.git("rev-parse", "--short", "HEAD")
    machine = harness.machine_slug(harness.cpu_model(), harness.machine_info()["cores"])
    assert path == tmp_path / "results" / "e2e" / machine / f"{rev}.json"
    record = json.loads(path.read_text())
    assert record["schema_version"] == harness.SCHEMA_VERSION == 1
    assert record["bench"] == "e2e" and record["result"] == {"tokens_s": 42}
    assert record["git"] == {"rev": rev, "dirty": False}
    assert record["machine"]["cpu"] == harness.cpu_model() and record["command"] == ["fake_bench.py", "--n", "21"]


def test_a_dirty_tree_is_refused_unless_allowed(harness, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: True)
    script = _script(tmp_path, "json.dump({}, open(a.out, 'w'))\n")
    rc, path = harness.run("e2e", [], script=script, root=tmp_path / "results")
    assert (rc, path) == (2, None) and "--allow-dirty" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
    rc, path = harness.run("e2e", [], allow_dirty=True, script=script, root=tmp_path / "results")
    assert rc == 0 and path.name.endswith("-dirty.json")
    assert json.loads(path.read_text())["git"]["dirty"] is True


def test_a_failing_script_records_nothing(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "sys.exit(3)\n")
    assert harness.run("e2e", [], script=script, root=tmp_path / "results") == (3, None)
    assert not (tmp_path / "results").exists()


def test_every_listed_script_takes_out(harness):
    for name, script in harness.BENCHES.items():
        assert '"--out"' in (BENCH / script).read_text(), name

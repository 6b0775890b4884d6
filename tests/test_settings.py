"""``longctx.settings`` lists every environment variable the code reads, and the cache folder
is resolved one way for the weights and the C kernels."""

from __future__ import annotations

import re
from pathlib import Path

from longctx import settings
from longctx.kernels import cpu_build

ROOT = Path(__file__).resolve().parent.parent
# os.environ.get("X"), os.environ["X"], os.getenv("X"), "X" in os.environ, setenv-style writes
READ = re.compile(r"""(?:os\.environ(?:\.get|\.pop|\.setdefault)?\s*[\(\[]|os\.getenv\s*\()\s*["']([A-Z0-9_]+)["']""")
NAMED = re.compile(r"""([A-Z][A-Z0-9_]{2,})\s*=\s*["']([A-Z][A-Z0-9_]+)["']""")  # ENV_NAME = "VAR" constants


def _variables_read() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in ("longctx", "kernels", "parallel"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            names = set(READ.findall(text))
            # a variable named through a constant (os.environ.get(API_KEY_ENV)) or a tuple of names
            constants = dict(NAMED.findall(text))
            for const, value in constants.items():
                if re.search(rf"os\.environ(?:\.get|\.pop)?\s*[\(\[]\s*{const}\b", text):
                    names.add(value)
            for var in names:
                found.setdefault(var, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_every_variable_read_is_listed():
    found = _variables_read()
    assert {"LONGCTX_CACHE_DIR", "LONGCTX_CPU_ISA", "LONGCTX_API_KEY", "WORLD_SIZE"} <= set(found)  # it sees them
    missing = {var: where for var, where in found.items() if var not in settings.ENV_VARS}
    assert missing == {}


def test_the_cache_folder_is_one(monkeypatch, tmp_path):
    monkeypatch.delenv("LONGCTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "longctx"
    assert cpu_build.cache_dir() == tmp_path / "xdg" / "longctx" / "cpu_kernels"
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "mine"))
    assert settings.cache_dir() == tmp_path / "mine"
    assert cpu_build.cache_dir() == tmp_path / "mine" / "cpu_kernels"
    monkeypatch.delenv("LONGCTX_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert settings.cache_dir() == Path.home() / ".cache" / "longctx"

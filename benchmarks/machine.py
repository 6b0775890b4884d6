"""What every benchmark records about where it ran: CPU, cores, threads, versions, git revision;
and the one rule of where a benchmark script's result goes (``save_result``).

Only the standard library at module level: bench_e2e.py imports this and is also run by the
python of vLLM's venv.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_rev() -> str:
    """Short revision, with ``-dirty`` when the working tree has changes."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    rev = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return rev + ("-dirty" if git("status", "--porcelain").strip() else "")


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


# the vector extensions the CPU kernels dispatch on (lscpu's flag names)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve")


def cpu_id() -> dict:
    """Vendor, family, model and the dispatched vector extensions: what tells two CPUs with the
    same model name apart (an AMD EPYC Zen 3 with AVX2 only from a Zen 4 with AVX-512)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}

    def field(name: str) -> str | None:
        match = re.search(rf"^{name}\s*:\s*(.*)$", text, re.MULTILINE)
        return match.group(1).strip() if match else None

    flags = set((field("flags") or field("Features") or "").split())
    return {"vendor": field("vendor_id"), "family": field("cpu family"), "model": field("model"),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def machine_info(**extra: object) -> dict:
    import torch

    return {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "git_rev": git_rev(),
            **extra}


def save_result(out: Path | str | None, report: dict, **dump: object) -> None:
    """Every benchmark script's output rule: its JSON result goes to ``--out FILE`` only, and
    without ``--out`` it writes nothing (it prints its table either way). ``benchmarks/run.py
    NAME`` passes ``--out`` and records the result, with the machine, the revision and a schema
    version, as ``benchmarks/results/NAME/<machine>/<rev>.json``. ``dump``: ``json.dumps``
    options (default ``indent=1``)."""
    if out is None:
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, **{"indent": 1, **dump}) + "\n")
    print(f"wrote {out}")

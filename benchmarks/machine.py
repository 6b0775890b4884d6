"""What every benchmark records about where it ran: CPU, cores, threads, versions, git revision."""

from __future__ import annotations

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


def machine_info(**extra: object) -> dict:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "git_rev": git_rev(),
            **extra}

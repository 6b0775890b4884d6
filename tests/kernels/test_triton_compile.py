"""The Triton kernels compile for sm_80 and sm_90 on any machine, GPU or not.

Runs compile_triton_offline.py in a fresh process without TRITON_INTERPRET (the interpreter
replaces @triton.jit functions at import, and this process imported them interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("compile_triton_offline.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no NVIDIA ptxas")
def test_kernels_compile_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "80", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if line.endswith(": ok")]
    assert len(compiled) == 10, done.stdout
    assert all("registers=" in line for line in compiled if "paged_attention" in line)


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no NVIDIA ptxas")
def test_every_planner_variant_compiles_for_ampere_and_hopper():
    """Head dims 64/128/256 x decode/verify/prefill x fp16/bf16, plus fp32: 26 kernels per
    target, each with its registers and local memory (spills) reported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--all", "80", "90"], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    attention = [line for line in done.stdout.splitlines()
                 if "paged_attention" in line and line.endswith(": ok")]
    assert len(attention) == 2 * 26, done.stdout

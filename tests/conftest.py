"""Test-wide setup: the Triton interpreter must be chosen before triton is imported; the disk
tier's per-user key goes to a temporary config folder, never the real one."""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The kernel-or-BLAS choice for long steps is measured per machine (kernels/cpu_tune.py): off here,
# so that a run's numerics do not hang on a timing; tests/kernels/test_cpu_tune.py and the forced
# row counts in tests/test_engine.py cover the tuned path.
os.environ.setdefault("LONGCTX_CPU_TUNE", "off")

# The disk KV tier makes its HMAC key under $XDG_CONFIG_HOME/longctx/ (server subprocesses inherit it).
_CONFIG_HOME = tempfile.mkdtemp(prefix="longctx-test-config-")
os.environ["XDG_CONFIG_HOME"] = _CONFIG_HOME
atexit.register(shutil.rmtree, _CONFIG_HOME, True)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_engine_folder(tmp_path_factory):
    """One tiny random Llama checkpoint (``tiny_models.make_engine_checkpoint``) for the whole
    run, for tests that only need some engine to drive."""
    from tiny_models import make_engine_checkpoint

    path = tmp_path_factory.mktemp("tiny-engine")
    make_engine_checkpoint(path)
    return str(path)

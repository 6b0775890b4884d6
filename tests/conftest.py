"""Test-wide setup: the Triton interpreter must be chosen before triton is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_engine_folder(tmp_path_factory):
    """One tiny random Llama checkpoint (``tiny_models.make_engine_checkpoint``) for the whole
    run, for tests that only need some engine to drive."""
    from tiny_models import make_engine_checkpoint

    path = tmp_path_factory.mktemp("tiny-engine")
    make_engine_checkpoint(path)
    return str(path)

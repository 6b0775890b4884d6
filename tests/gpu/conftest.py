"""The GPU tier: every test here is marked ``gpu`` and skipped, with the reason, where CUDA is
absent (this project's CI and development machines). Run on a CUDA machine with
``python -m pytest tests/gpu`` (see README: "GPU")."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)

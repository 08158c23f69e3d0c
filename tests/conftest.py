"""Test setup: CPU runs use the Triton interpreter; `-m gpu` runs the contract on CUDA."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

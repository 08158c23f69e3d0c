"""Test setup: CPU runs use the Triton interpreter; `-m gpu` runs the contract on CUDA."""
from areal_tik.runtime import use_interpreter_without_gpu

# Must run before any kernel module is imported (triton.jit reads it at decoration).
use_interpreter_without_gpu()

import os  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from areal_tik.qualify import CACHE_ENV  # noqa: E402

# One device-qualification cache per test session (the actor and `check` consult it;
# server and launcher subprocesses inherit it): the probe runs once, not once per test,
# and never writes to the user's cache.
os.environ.setdefault(CACHE_ENV, str(Path(tempfile.mkdtemp(prefix="areal-tik-qualify-")) / "verdicts.json"))

# Under pytest-xdist (README's `-n 2`) each worker owns one core: one intra-op thread per
# worker, else two workers' thread pools oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def spmd_env(monkeypatch):
    """The environment of a one-process AReaL SPMD run on gloo, as the launcher sets it
    (a free rendezvous port each time), offline."""
    from areal_tik.adapter.launch import spmd_environment

    for key, value in {**spmd_environment({}), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}.items():
        monkeypatch.setenv(key, value)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

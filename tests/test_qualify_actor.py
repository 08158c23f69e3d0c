"""The actor's reaction to a failed device qualification: reuse refused naming the op, and
linear pinned to its one fixed tile when linear's geometry is what failed."""
from __future__ import annotations

import importlib
import types

import torch

import areal_tik.qualify as qualify_pkg
from areal_tik.adapter.actor import qualification_refusals

linear_kernels = importlib.import_module("areal_tik.unified_kernels.linear")  # the module, not the function


def verdict(failing: list[str]):
    return types.SimpleNamespace(
        passed=not failing, failing_ops=failing, cached=True, seconds=0.0,
        pin_linear=any(op.startswith("linear") for op in failing),
        message=lambda: "device qualification " + ("passed" if not failing else "FAILED") + " on a test device")


def test_a_failed_linear_refuses_reuse_and_pins_the_tile(monkeypatch):
    model = types.SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(linear_kernels, "FIXED_TILE", False)
    monkeypatch.setattr(qualify_pkg, "qualify", lambda device: verdict(["linear variants"]))
    (reason,) = qualification_refusals(model)
    assert "failing: linear variants" in reason and "linear pinned" in reason
    assert linear_kernels.FIXED_TILE is True
    monkeypatch.setattr(linear_kernels, "FIXED_TILE", False)
    monkeypatch.setattr(qualify_pkg, "qualify", lambda device: verdict(["attention CUDA graph"]))
    (reason,) = qualification_refusals(model)
    assert "failing: attention CUDA graph" in reason and "pinned" not in reason
    assert linear_kernels.FIXED_TILE is False
    monkeypatch.setattr(qualify_pkg, "qualify", lambda device: verdict([]))
    assert qualification_refusals(model) == []

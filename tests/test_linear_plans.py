"""The unified linear's launch-plan cache (on with ``_common.HOST_FAST_PATH``): a plan is served only
to a call with the same shapes, strides, dtypes, alignment, bias and K groups, and every
call gives the bits of a plan built afresh."""
from __future__ import annotations

import importlib

import pytest
import torch

from ._bits import assert_bitwise

L = importlib.import_module("areal_tik.unified_kernels.linear")
C = importlib.import_module("areal_tik.unified_kernels._common")


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _fresh(x, w, b, monkeypatch):
    """The result with no plan cache (a plan and the generic checks per call)."""
    monkeypatch.setattr(C, "HOST_FAST_PATH", False)
    try:
        return L.linear(x, w, b)
    finally:
        monkeypatch.setattr(C, "HOST_FAST_PATH", True)


def test_plans_follow_shape_stride_dtype_and_alignment(monkeypatch):
    monkeypatch.setattr(L, "_PLANS", {})
    x, w, b = _randn(5, 48, dtype=torch.bfloat16, seed=1), _randn(40, 48, dtype=torch.bfloat16, seed=2,
                                                                   scale=48 ** -0.5), _randn(40, dtype=torch.bfloat16,
                                                                                             seed=3)
    buf = torch.zeros(5, 49, dtype=torch.bfloat16)
    buf[:, 1:] = x
    calls = {
        "plain": (x, w, b),
        "more rows (another tile)": (torch.cat([x] * 8), w, b),
        "column-major x": (x.t().contiguous().t(), w, b),
        "unaligned base": (buf[:, 1:], w, b),
        "transposed weight view": (x, w.t().contiguous().t(), b),
        "no bias": (x, w, None),
        "fp32": (x.float(), w.float(), b.float()),
        "3-D x": (x.view(1, 5, 48), w, b),
    }
    for what, (xv, wv, bv) in calls.items():
        before = len(L._PLANS)
        out = L.linear(xv, wv, bv)
        assert len(L._PLANS) == before + (what != "3-D x"), f"{what}: no plan of its own"
        assert_bitwise(out, _fresh(xv, wv, bv, monkeypatch), what)
        assert_bitwise(L.linear(xv, wv, bv), out, f"{what}, served from the cache")


def test_negative_control_a_planted_plan_is_served(monkeypatch):
    """The cache is really used (so the test above can fail): a plan planted under a call's
    key that reduces K in two groups (the K-group tree: other bits) changes that call's result."""
    monkeypatch.setattr(L, "_PLANS", {})
    x, w = _randn(16, 128, dtype=torch.float32, seed=4), _randn(64, 128, dtype=torch.float32, seed=5, scale=0.1)
    base = L.linear(x, w)
    out = torch.empty(16, 64)
    cfg = L.linear_config(16, 64, 128, torch.float32)
    planted = L._make_plan(x, w, out, False, cfg, 2)
    monkeypatch.setitem(L._PLANS, L._plan_key(x, w, out, False, 1), planted)
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(L.linear(x, w), base, "planted plan")
    assert_bitwise(_fresh(x, w, None, monkeypatch), base, "without the cache")

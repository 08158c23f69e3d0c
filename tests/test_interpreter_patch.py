"""The interpreter's faster ``_patch_builtin`` (``unified_kernels/_interpreter.py``) patches
exactly what triton's own does, change for change, inside and outside a launch, and a
kernel with nested ``@triton.jit`` calls gives the same bits either way."""
import os

import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from areal_tik.unified_kernels import _interpreter, rms_norm
from areal_tik.unified_kernels._common import bits, interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the patch is for the CPU interpreter")


def changes(patch, pkg):
    """(object, name) of every attribute ``patch`` sets on ``pkg``, in order; restored after."""
    scope = interpreter._LangPatchScope()
    patch(pkg, interpreter.interpreter_builder, scope)
    out = [(id(obj), name) for obj, name, _ in scope._changes]
    scope.restore()
    return out


def test_installed_under_the_interpreter():
    assert os.environ.get("AREAL_TIK_INTERPRETER_PATCH", "1") != "0"
    assert interpreter._patch_builtin.original is not interpreter._patch_builtin


@pytest.mark.parametrize("pkg", [tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base], ids=repr)
def test_the_same_attributes_are_patched_as_triton_patches(pkg):
    fast, original = interpreter._patch_builtin, interpreter._patch_builtin.original
    first = changes(fast, pkg)
    assert first == changes(original, pkg) and len(first) > 0
    # inside a launch (the language already patched) both patch the same, here nothing new
    outer = interpreter._LangPatchScope()
    original(pkg, interpreter.interpreter_builder, outer)
    try:
        assert changes(fast, pkg) == changes(original, pkg) == []
    finally:
        outer.restore()
    assert changes(fast, pkg) == first  # restore put the builtins back


def test_a_package_not_listed_takes_the_original_path():
    class Unlisted:
        f = tl.core.builtin(lambda x, _semantic=None: x)

    fast, original = interpreter._patch_builtin, interpreter._patch_builtin.original
    assert changes(fast, Unlisted) == changes(original, Unlisted) == [(id(Unlisted), "f")]
    assert _interpreter.builtin_names(Unlisted) == ("f",)


def test_a_kernel_with_nested_jit_calls_gives_the_same_bits_either_way(monkeypatch):
    x = torch.randn(37, 96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    w = torch.randn(96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    fast = rms_norm(x, w, 1e-6)
    monkeypatch.setattr(interpreter, "_patch_builtin", interpreter._patch_builtin.original)
    slow = rms_norm(x, w, 1e-6)
    assert torch.equal(bits(fast), bits(slow))

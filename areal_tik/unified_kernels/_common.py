"""Shared plumbing for the unified kernels: input validation, interpreter detection, bit views.

Every launcher validates its inputs with these helpers so that bad input raises a
``TypeError``/``ValueError`` naming the offending value, never a wrong result.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable, Sequence

import torch

def env_switch(name: str, default: bool) -> bool:
    """An on/off switch read from the environment: unset -> ``default``, "1" on, "0" off;
    any other value raises ValueError naming the variable (a typo never flips a switch)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def measured_file() -> dict:
    """The JSON named by ``AREAL_TIK_LINEAR_TILES``: launch geometries a GPU run measured and
    bit-checked ("linear", "logprob": eval/probe_block_k.py; "tuned": a linear search run's
    promoted groups, eval/optimize_gpu.py); {} when the variable is unset. A missing file or
    bad JSON raises (never a silent default)."""
    path = os.environ.get("AREAL_TIK_LINEAR_TILES")
    if not path:
        return {}
    with open(path) as f:
        return json.load(f)


def measured_overrides(section: str) -> dict:
    """One section of ``measured_file`` ({} when absent)."""
    return measured_file().get(section, {})


# Dtypes the kernels accept for activations and weights.
FLOAT_DTYPES = (torch.bfloat16, torch.float32)

# The launchers' host shortcuts: cached launch plans (linear) and cheap argument tests tried
# before the generic checks (linear, attention). Read at call time; False gives the earlier
# host path (a plan and the generic checks per call), for side-by-side timing
# (eval/probe_host.py, eval/probe_mixed.py). The same kernels and arguments either way.
# AREAL_TIK_HOST_FAST_PATH=0 starts a process with it off.
HOST_FAST_PATH = env_switch("AREAL_TIK_HOST_FAST_PATH", True)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if interpreting() and env_switch("AREAL_TIK_INTERPRETER_PATCH", True):
    # The interpreter's per-call re-patching of triton.language, listed once (_interpreter.py;
    # AREAL_TIK_INTERPRETER_PATCH=0 keeps triton's own, for side-by-side timing).
    from ._interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    contiguous: bool = False,
    allow_empty: bool = False,
) -> torch.Tensor:
    """Validate one kernel argument; raise TypeError/ValueError naming the value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {tuple(dtypes)}, got {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have rank in {allowed}, got shape {tuple(t.shape)}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    check_device(name, t)
    return t


def on_fast_device(first, *others) -> bool:
    """Every argument a tensor on ``first``'s CUDA device, or all on the CPU under the
    interpreter: the devices the launchers' cheap argument tests accept (so CPU tests run
    them too). Anything else is False: the caller's generic checks then name it."""
    if not (isinstance(first, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in others)):
        return False
    if first.is_cuda:
        dev = first.get_device()
        return all(t.is_cuda and t.get_device() == dev for t in others)
    return first.is_cpu and all(t.is_cpu for t in others) and interpreting()


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreting():
        return
    hint = "" if t.device.type != "cpu" else " (CPU tensors need TRITON_INTERPRET=1 set before import)"
    raise ValueError(f"{name} must be on a CUDA device, got device {t.device}{hint}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


@contextlib.contextmanager
def fp32_reductions():
    """cuBLAS bf16/fp16 GEMMs inside this block reduce in fp32 (their compute type).

    cuBLAS accumulates bf16 products in fp32, but by default torch lets it reduce split-K
    partial sums in the output type; backward GEMMs over the token dimension (dW, K = T
    in the thousands) are exactly the shapes that split K. The setting is read at each
    GEMM call, so it is switched off for the block and restored (also on error).
    """
    matmul = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = [_reduction_setting(matmul, name) for name in names]
    for name in names:
        setattr(matmul, name, False)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(matmul, name, value)


def _reduction_setting(matmul, name: str):
    """The setting as torch takes it back: (allow, allow_split_k) where this torch has the
    split-K half (2.9+), else the bool."""
    try:
        return getattr(matmul, name), getattr(matmul, name + "_split_k")
    except AttributeError:
        return getattr(matmul, name)


def grad_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for backward passes: fp32 accumulation, one rounding to ``a.dtype``.

    CUDA bf16: a cuBLAS bf16 GEMM on the tensor cores with fp32 reductions
    (``fp32_reductions``); deterministic for fixed shapes on one GPU model (cuBLAS's
    reproducibility guarantee; no atomics). fp32 operands use torch's fp32 matmul (TF32
    only if the user turned it on globally). On CPU (interpreter tests) bf16 operands are
    upcast: their products are exact in fp32, so that is the same fp32-accumulated sum.
    """
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        with fp32_reductions():
            return a @ b
    return (a.float() @ b.float()).to(a.dtype)


_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor's bits, for bitwise comparison with ``torch.equal``."""
    if t.dtype not in _INT_VIEW:
        return t
    return t.contiguous().view(_INT_VIEW[t.dtype])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff ``a`` and ``b`` have the same shape, dtype and bits (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))

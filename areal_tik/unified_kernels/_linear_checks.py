"""Argument checks of the unified linear (``linear.linear`` and ``linear.linear_partial``).

``validate`` raises a ``TypeError``/``ValueError`` naming the bad value; ``valid_fast_call``
is the cheap test the launcher tries first (about 7 attribute reads instead of two generic
tensor checks and a device set: a prefill step validates 7 linears per layer).
"""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, check_same_device, check_tensor, on_fast_device


def valid_fast_call(x, weight, bias) -> bool:
    """A cheap test that implies every check of ``validate`` (CUDA tensors on one device, or
    CPU tensors under the interpreter): the common case skips the generic validators,
    anything else takes them and gets their message. Reads no device memory."""
    if not on_fast_device(x, weight, *(() if bias is None else (bias,))):
        return False
    dtype = x.dtype
    ok = ((dtype is torch.bfloat16 or dtype is torch.float32) and weight.dtype is dtype and x.dim() >= 1
          and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and x.numel() > 0 and weight.numel() > 0)
    if ok and bias is not None:
        ok = bias.dtype is dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0]
    return ok


def validate(x, weight, bias) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {tuple(x.shape)}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype must equal x dtype {x.dtype}, got {weight.dtype}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype must equal x dtype {x.dtype}, got {bias.dtype}")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)

"""The fixed K-group reduction tree of a row-parallel linear: validation and the host side.

With ``k_groups`` G (a power of two, 1 <= G <= 8), K is split into G contiguous groups of
K / G columns. Each group is an fp32 chain from zero over its own BLOCK_K blocks (the
kernel's chain, anchored at the group's start); the G group sums are combined by the
balanced binary tree, left + right in fp32: level 1 adds (0+1), (2+3), ..., level 2
(01+23), ... The bias is added after the tree, in fp32, and the result is rounded once.

A tensor-parallel rank of a group of t ranks (t | G) holds K / t contiguous columns, i.e.
G / t whole groups: one subtree. So the roots of the t subtrees, combined by the same
tree (``combine_partials``), give the bits of the whole tree on one device. The adds
here are IEEE fp32 adds (round to nearest even), the same operation the kernel performs,
so a tree finished on the host has the kernel's bits.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ._common import FLOAT_DTYPES, check_device, check_same_device

MAX_K_GROUPS = 8  # the kernels' tree holds at most 8 groups (G = 8: four live accumulators)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_k_groups(k_groups, k: int) -> None:
    """``k_groups`` must be a power of two in 1..8 that divides the reduction length ``k``."""
    if isinstance(k_groups, bool) or not isinstance(k_groups, int):
        raise TypeError(f"k_groups must be an int (1, 2, 4 or 8), got {k_groups!r}")
    if not _is_power_of_two(k_groups) or k_groups > MAX_K_GROUPS:
        raise ValueError(f"k_groups must be a power of two in 1..{MAX_K_GROUPS} (1, 2, 4 or 8), got {k_groups}")
    if k % k_groups:
        raise ValueError(f"K = {k} (x.shape[-1]) must be divisible by k_groups = {k_groups}")


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The balanced binary tree over ``parts`` (a power of two of them), left + right."""
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def _check(name: str, t, dtype: torch.dtype, ndim: int | None = None) -> None:
    # Device-agnostic (the standard kernel set runs on CPU without the interpreter).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")


def _check_parts(parts) -> None:
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence):
        raise TypeError(f"parts must be a sequence (list or tuple) of fp32 tensors, got {type(parts).__name__}")
    if not _is_power_of_two(len(parts)) or len(parts) > MAX_K_GROUPS:
        raise ValueError(f"the number of partials must be a power of two in 1..{MAX_K_GROUPS} "
                         f"(one per tensor-parallel rank), got {len(parts)}")
    for i, part in enumerate(parts):
        _check(f"parts[{i}]", part, torch.float32)
        if part.shape != parts[0].shape:
            raise ValueError(f"every partial must have the shape of parts[0] {tuple(parts[0].shape)}, "
                             f"parts[{i}] has {tuple(part.shape)}")
    check_same_device(**{f"parts[{i}]": part for i, part in enumerate(parts)})


def combine_partials(parts: Sequence[torch.Tensor], bias: torch.Tensor | None,
                     dtype: torch.dtype, *, kernel_device: bool = True) -> torch.Tensor:
    """Finish the tree: ``parts`` are the fp32 subtree roots in rank order (``linear_partial``
    of each rank's K slice); the balanced tree over them, + bias in fp32, one rounding to
    ``dtype``. Returns ``[..., N]`` in ``dtype``. ``kernel_device``: require the unified
    kernels' devices (CUDA, or CPU under the interpreter); the standard set passes False."""
    _check_parts(parts)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    if kernel_device:
        check_device("parts[0]", parts[0])
    root = tree_sum(parts)
    if bias is not None:
        _check("bias", bias, dtype, ndim=1)
        if bias.shape[0] != root.shape[-1]:
            raise ValueError(f"bias must have shape ({root.shape[-1]},), got {tuple(bias.shape)}")
        check_same_device(partials=parts[0], bias=bias)
        root = root + bias.float()
    return root.to(dtype)

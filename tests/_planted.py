"""Planted faults: unified op tables with one op made deliberately row-count dependent."""
from __future__ import annotations

import types

import torch

from areal_tik.model.ops import OP_NAMES, UnifiedOps


def planted_ops(op: str, threshold: int = 4):
    """Unified ops where ``op`` flips the lowest bit of its output for more than ``threshold`` rows."""
    unified = UnifiedOps()
    ops = types.SimpleNamespace(kind="planted", **{name: getattr(unified, name) for name in OP_NAMES})
    inner = getattr(unified, op)

    def row_count_dependent(x, *args, **kwargs):
        out = inner(x, *args, **kwargs)
        if x.reshape(-1, x.shape[-1]).shape[0] > threshold:
            ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
            out = (out.detach().view(ints) ^ 1).view(out.dtype)
        return out
    setattr(ops, op, row_count_dependent)
    return ops

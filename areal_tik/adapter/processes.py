"""What the training processes decide together: reductions over the trainer's process
group, so every rank takes the same branch and issues the same FSDP collectives.

Torch only (no AReaL, no kernels): the process-group tests import it in each spawned
process.
"""
from __future__ import annotations

import torch
from torch import distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _single(group) -> bool:
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def all_reduce(values: list[float], op: str, group=None) -> list[float]:
    """``values`` reduced (``"sum"`` or ``"max"``) over ``group``, in float64."""
    if _single(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=_REDUCE_OPS[op], group=group)
    return t.tolist()


def refusals_of_every_process(reasons: list[str], group=None) -> list[str]:
    """Every process's refusals of ``group``, in rank order without repeats. Reuse is one
    decision for all: a process refusing alone (its device failed qualification, its
    server runs other kernels) would run AReaL's recompute pass, with its FSDP
    collectives, while the others skip it."""
    if _single(group):
        return list(reasons)
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(reasons), group=group)
    return list(dict.fromkeys(r for rank in gathered for r in rank))

"""In-place weight updates: check every tensor first, then copy (CUDA-graph pointers stay valid).

A source is a ``{name: tensor}`` mapping (Hugging Face state-dict names) or a module
whose ``state_dict()`` gives one. Unknown names, shape or dtype mismatches and, with
``strict``, names missing from the source raise before any parameter is touched. Tied
parameters (one storage under two names, e.g. embed_tokens / lm_head) count as covered
when any of their names is present.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def as_state_dict(weights) -> Mapping[str, torch.Tensor]:
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict()
    if isinstance(weights, Mapping):
        return weights
    raise TypeError(f"weights must be a mapping of name -> tensor or a torch.nn.Module, "
                    f"got {type(weights).__name__}")


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def plan_update(target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor],
                strict: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validated ``(destination, source)`` pairs; raises TypeError/ValueError, copies nothing."""
    unknown = sorted(set(source) - set(target))
    if unknown:
        raise ValueError(f"weights has {len(unknown)} names the model does not have, e.g. {unknown[:3]}")
    pairs = []
    for name, src in source.items():
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"weights[{name!r}] must be a torch.Tensor, got {type(src).__name__}")
        dst = target[name]
        if src.shape != dst.shape:
            raise ValueError(f"weights[{name!r}] has shape {tuple(src.shape)}, the model's is {tuple(dst.shape)}")
        if src.dtype != dst.dtype:
            raise TypeError(f"weights[{name!r}] has dtype {src.dtype}, the model's is {dst.dtype}")
        pairs.append((dst, src))
    if strict:
        missing = missing_names(target, source)
        if missing:
            raise ValueError(f"weights lacks {len(missing)} of the model's tensors, e.g. {missing[:3]} "
                             "(pass strict=False for a partial update)")
    return pairs


def missing_names(target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor]) -> list[str]:
    """The target's names that ``source`` leaves unchanged (a tied tensor counts as covered
    when any of its names is in ``source``)."""
    covered = {_storage_key(target[name]) for name in source if name in target}
    return sorted(n for n, t in target.items() if _storage_key(t) not in covered)


@torch.no_grad()
def apply_update(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)

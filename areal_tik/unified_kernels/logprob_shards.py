"""The fused LM head (``logprob.py``) over vocabulary shards, for tensor parallelism.

``logprob.py``'s first launch walks the vocabulary in fixed splits of ``split_v`` columns
(anchored at 0) and its second merges the splits' states in index order 0, 1, ... A
shard that starts at a split boundary sees, in the first launch, the same programs,
chunks and K order as the one-device launch, so its logits columns and its splits'
states are those of the full launch, bitwise; laying the shards' states end to end (a
copy) and merging them with the same combine kernel gives the one-device lse.
"""
from __future__ import annotations

import torch

from ._common import check_positive_float, check_same_device, check_tensor
from .logprob import _check_head, _combine, _partial, logprob_config


def vocab_splits(V: int, H: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(split_v, n_splits)``: the fixed vocabulary splits of the forward for (V, H, dtype).
    Split i covers columns ``[i * split_v, min((i + 1) * split_v, V))``."""
    split_v = logprob_config(V, H, dtype).split_v
    return split_v, -(-V // split_v)


def check_vocab_shards(V: int, H: int, dtype: torch.dtype, size: int) -> None:
    """ValueError naming both numbers unless ``size`` shards can each take a run of whole splits."""
    split_v, n_splits = vocab_splits(V, H, dtype)
    if n_splits < size:
        raise ValueError(f"vocab_parallel: tensor_parallel_size={size} exceeds the LM head's "
                         f"vocabulary splits ({n_splits} splits of {split_v} for vocab {V})")


def lm_head_logits_lse_partial(hidden, weight_shard, vocab: int, temperature=1.0):
    """One vocabulary shard's part of ``lm_head_logits_lse``: ``(logits [T, V_r], state)``.

    ``weight_shard`` holds whole splits of ``vocab_splits(vocab, H, dtype)`` (rows
    ``[i * split_v, ...)`` of the full weight, starting at a split boundary; only the last
    shard may end inside a split, at ``vocab``). Every program sees the columns, chunks and
    K order it sees in the one-device launch (splits are anchored at their own start), so
    the logits are those columns of the full logits and ``state`` ``[2, n_r, T]`` fp32 holds
    the full launch's (max, sum-exp) of those splits, bitwise. No autograd (sampling).
    """
    _check_head(hidden, weight_shard)
    check_same_device(hidden=hidden, weight=weight_shard)
    temperature = check_positive_float("temperature", temperature)
    tiles = logprob_config(vocab, hidden.shape[1], weight_shard.dtype)  # the full model's schedule
    if weight_shard.shape[0] > vocab:
        raise ValueError(f"weight_shard has {weight_shard.shape[0]} rows, more than vocab={vocab}")
    with torch.no_grad():
        state, _, logits = _partial(hidden, weight_shard, None, temperature, False, True, tiles)
    return logits, state


def combine_lse_partials(states) -> torch.Tensor:
    """``lse`` [T] fp32 from the shards' states in vocabulary order: their splits laid end to
    end (a copy) and merged 0, 1, ... by the one-device combine kernel, so the result equals
    ``lm_head_logits_lse``'s ``lse`` bit for bit."""
    states = list(states)
    if not states:
        raise ValueError("combine_lse_partials needs at least one state")
    for i, st in enumerate(states):
        check_tensor(f"states[{i}]", st, dtypes=(torch.float32,), ndim=3)
        if st.shape[0] != 2 or st.shape[2] != states[0].shape[2]:
            raise ValueError(f"states[{i}] must be [2, n_splits, {states[0].shape[2]}], got {tuple(st.shape)}")
    state = torch.cat(states, dim=1)
    return _combine(state, state, None, 1, False)[2]

"""Vocabulary parallelism of the embedding and LM head on a tensor-parallel rank.

The unified log-prob kernel walks the vocabulary in fixed splits of ``split_v`` columns
(``unified_kernels.logprob.vocab_splits``, anchored at 0) and merges the splits' softmax
states in index order. A rank r of t holds the r-th of t contiguous runs of whole splits
(t must divide the split count): rows ``[r * width, min((r + 1) * width, V))`` of the
embedding and of the LM head, ``width = n_splits / t * split_v`` (one tensor when tied).
- LM head: ``lm_head_logits_lse_partial`` on the rank's rows gives its logits columns and
  its splits' (max, sum-exp) states, bitwise those of the one-device launch (same
  programs, chunks and K order). An all_gather puts the t logits slices and the t states
  in rank order (= vocabulary order) on every rank, a copy; ``combine_lse_partials`` then
  merges the splits 0, 1, ... as the one-device combine does. So every rank holds the
  TP = 1 logits and lse, and the sampler (which reads those logits) draws the TP = 1 token
  with the TP = 1 tie-breaking (first maximal index over the full row).
- Embedding: each rank looks up the ids it owns (others read row 0 of its slice, a
  placeholder), the [T, H] results are all_gathered and each id takes its owner's row: a
  select, no sum (``x + 0.0`` would turn a -0.0 into +0.0).
Only the unified kernel set has the fixed splits; the standard set is refused.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .spec import ModelSpec

EMBED_NAME = "model.embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


def vocab_split_count(spec: ModelSpec, dtype: torch.dtype) -> tuple[int, int]:
    """``(split_v, n_splits)`` of the unified LM-head kernel for ``spec`` in ``dtype``."""
    from areal_tik.unified_kernels.logprob import vocab_splits
    return vocab_splits(spec.vocab, spec.hidden, dtype)


def check_vocab_split(spec: ModelSpec, dtype: torch.dtype, size: int) -> None:
    """ValueError naming both numbers unless ``size`` divides the LM head's vocabulary splits."""
    from areal_tik.unified_kernels.logprob import check_vocab_shards
    check_vocab_shards(spec.vocab, spec.hidden, dtype, size)


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, stop)`` of a ``vocab``-row embedding / LM head; every rank's slot is
    ``width`` rows (the last rank's slice may be shorter, padded in the gathers)."""

    start: int
    stop: int
    width: int
    vocab: int
    saved_bytes: int  # embedding + LM head bytes this rank does not hold (tied: counted once)

    @classmethod
    def of(cls, spec: ModelSpec, dtype: torch.dtype, rank: int, size: int, saved_bytes: int = 0):
        split_v, n_splits = vocab_split_count(spec, dtype)
        width = n_splits // size * split_v
        return cls(rank * width, min((rank + 1) * width, spec.vocab), width, spec.vocab, saved_bytes)

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor, gather) -> torch.Tensor:
        """``F.embedding(input_ids, full_weight)`` from this rank's ``weight`` rows; ``gather``
        is ``gather_partials`` bound to the group (rank-ordered copies)."""
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
        stacked = torch.stack(gather(rows))  # [t, T, H]
        owner = torch.div(input_ids, self.width, rounding_mode="floor").clamp_(0, stacked.shape[0] - 1)
        return stacked[owner, torch.arange(input_ids.shape[0], device=input_ids.device)]

    def local_logits_lse(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, gather):
        """``(this rank's logits columns [T, stop - start], the full lse [T])``: only the
        split states are gathered (``2 * n_splits / t`` fp32 per row and rank)."""
        from areal_tik.unified_kernels.logprob import combine_lse_partials, lm_head_logits_lse_partial

        logits, state = lm_head_logits_lse_partial(hidden, weight, self.vocab, temperature)
        return logits, combine_lse_partials(gather(state))

    def logits_lse(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, gather):
        """The full ``(logits [T, V], lse [T])`` of ``lm_head_logits_lse``, bitwise, from this
        rank's rows (see the module docstring)."""
        logits, lse = self.local_logits_lse(hidden, weight, temperature, gather)
        # The last rank's slice may be shorter: padded to the slot width for the gather.
        pad = self.width - logits.shape[1]
        full = torch.cat(gather(F.pad(logits, (0, pad)) if pad else logits), dim=1)
        return (full[:, :self.vocab].contiguous() if pad else full), lse

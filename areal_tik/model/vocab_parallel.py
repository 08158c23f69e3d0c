"""Vocabulary parallelism of the embedding and LM head on a tensor-parallel rank.

The unified log-prob kernel walks the vocabulary in fixed splits of ``split_v`` columns
(``unified_kernels.logprob_shards.vocab_splits``, anchored at 0) and merges the splits' softmax
states in index order. A rank r of t holds the r-th of t contiguous runs of whole splits,
splits ``[floor(r n / t), floor((r + 1) n / t))`` of the n (the runs differ by at most one
split when t does not divide n: Qwen3's 151936 tokens are 297 splits of 512, Llama 3's
128256 are 251), i.e. those rows of the embedding and of the LM head (one tensor when tied).
- LM head: ``lm_head_logits_lse_partial`` on the rank's rows gives its logits columns and
  its splits' (max, sum-exp) states, bitwise those of the one-device launch (same
  programs, chunks and K order). The states are all_gathered in rank order (= vocabulary
  order; padded to the longest run for the collective, the padding dropped after it, a
  copy), laid end to end and merged 0, 1, ..., n - 1 by the one-device combine kernel
  (``combine_lse_partials``): the TP = 1 lse on every rank. Sampling gathers per-rank
  candidates (``engine.sampler.sample_sharded``), or, for top-k / top-p rows, the logits.
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
    from areal_tik.unified_kernels.logprob_shards import vocab_splits
    return vocab_splits(spec.vocab, spec.hidden, dtype)


def check_vocab_split(spec: ModelSpec, dtype: torch.dtype, size: int) -> None:
    """ValueError naming both numbers unless each of ``size`` ranks gets a vocabulary split."""
    from areal_tik.unified_kernels.logprob_shards import check_vocab_shards
    check_vocab_shards(spec.vocab, spec.hidden, dtype, size)


def split_runs(n_splits: int, size: int) -> list[int]:
    """The first split of each rank's run, and n_splits: ``floor(r * n / t)`` for r <= t."""
    return [r * n_splits // size for r in range(size + 1)]


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[start, stop)`` of a ``vocab``-row embedding / LM head; ``starts``:
    every rank's first row, then ``vocab``; ``runs``: every rank's split count."""

    rank: int
    starts: tuple[int, ...]
    runs: tuple[int, ...]
    split_v: int
    saved_bytes: int = 0  # embedding + LM head bytes this rank does not hold (tied: counted once)

    @classmethod
    def of(cls, spec: ModelSpec, dtype: torch.dtype, rank: int, size: int):
        split_v, n_splits = vocab_split_count(spec, dtype)
        firsts = split_runs(n_splits, size)
        starts = tuple(min(f * split_v, spec.vocab) for f in firsts)
        return cls(rank, starts, tuple(b - a for a, b in zip(firsts, firsts[1:])), split_v)

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def stop(self) -> int:
        return self.starts[self.rank + 1]

    @property
    def vocab(self) -> int:
        return self.starts[-1]

    def _gather_padded(self, part: torch.Tensor, dim: int, counts, gather) -> list[torch.Tensor]:
        """Every rank's ``part`` in rank order, its ``dim`` padded to the longest for the
        collective and cut back to that rank's ``counts[r]`` after it (copies only)."""
        pad = max(counts) - part.shape[dim]
        if pad:
            part = F.pad(part, [0, 0] * (part.dim() - 1 - dim) + [0, pad])
        return [p.narrow(dim, 0, n) for p, n in zip(gather(part), counts)]

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor, gather) -> torch.Tensor:
        """``F.embedding(input_ids, full_weight)`` from this rank's ``weight`` rows; ``gather``
        is ``gather_partials`` bound to the group (rank-ordered copies)."""
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
        stacked = torch.stack(gather(rows))  # [t, T, H]
        owner = torch.zeros_like(input_ids)
        for first in self.starts[1:-1]:  # t - 1 compares with host ints: capturable in a CUDA graph
            owner += input_ids >= first
        return stacked[owner, torch.arange(input_ids.shape[0], device=input_ids.device)]

    def local_logits_lse(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, gather):
        """``(this rank's logits columns [T, stop - start], the full lse [T])``: only the
        split states are gathered (``2 * n_splits / t`` fp32 per row and rank)."""
        from areal_tik.unified_kernels.logprob_shards import combine_lse_partials, lm_head_logits_lse_partial

        logits, state = lm_head_logits_lse_partial(hidden, weight, self.vocab, temperature)
        return logits, combine_lse_partials(self._gather_padded(state, 1, self.runs, gather))

    def logits_lse(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, gather):
        """The full ``(logits [T, V], lse [T])`` of ``lm_head_logits_lse``, bitwise, from this
        rank's rows (see the module docstring)."""
        logits, lse = self.local_logits_lse(hidden, weight, temperature, gather)
        rows = [b - a for a, b in zip(self.starts, self.starts[1:])]
        return torch.cat(self._gather_padded(logits, 1, rows, gather), dim=1), lse

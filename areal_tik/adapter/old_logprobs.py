"""The old/proximal log-probs of one step's rollout batch: reuse, audit, fallback.

For each batch (AReaL trajectory dicts, before ``compute_advantages``):

1. plan: every scored token sampled by the current weights reuses its rollout log-prob;
   sequences holding older ("stale") tokens are listed for recompute (``reuse.py``), and
   so are the rows whose reuse ``exactness.row_refusals`` refuses (log-prob temperature
   not the actor's, or a trajectory without the exactness fields), counted in ``tik/*``;
2. recompute, in one pass, the stale sequences (only where AReaL's loss reads
   ``prox_logp``: in its default mode, recompute off and no decoupled loss, the rollout
   log-probs are the old log-probs and nothing is recomputed to be thrown away) and, on
   audit steps, a sample of sequences with fresh tokens;
3. compare the sample's rollout log-probs with the recomputed ones bit for bit
   (``areal_tik.bitwise``), summed over the training processes: one verdict for all;
4. merge the recomputed values in at the stale positions;
5. account the tokens reused and recomputed and the recompute time saved;
6. react to a failed audit as ``RunState.on_mismatch`` says; with ``recompute`` the
   whole batch is recomputed and the run recomputes from then on (``RunState.fall_back``
   says so loudly).

``OldLogprobs`` takes its recompute (trajectory dicts -> per-row log-probs, AReaL's
``compute_logp`` in a run) and its all-reduce over processes as arguments, so it runs
and is tested without FSDP or a process group.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from areal_tik.bitwise import BitComparison, compare_bits

from . import exactness, reuse
from .audit import RunState
from .log import logger

Recompute = Callable[[list[dict]], list[torch.Tensor]]
AllReduce = Callable[[list[float], str], list[float]]  # (values, "sum" | "max") -> reduced values
Rows = list[tuple[int, int]]


def single_process(values: list[float], op: str) -> list[float]:
    """The all-reduce of a run with one training process."""
    return list(values)


class OldLogprobs:
    """Reuse, audit and fallback of one run (its ``state`` is the run's ``RunState``)."""

    def __init__(self, state: RunState, recompute: Recompute, all_reduce: AllReduce = single_process,
                 audit_sequences: int = 4, temperature: float = 1.0):
        self.state = state
        self.recompute = recompute
        self.all_reduce = all_reduce
        self.audit_sequences = audit_sequences
        self.temperature = temperature  # the actor's: the trainer's log-probs are at this one
        self._missing_logged = False

    @property
    def reuse_active(self) -> bool:
        return self.state.reuse_active

    def prepare(self, batch: list[dict], version: int, needs_prox: bool) -> tuple[dict[str, float], bool]:
        """Set ``prox_logp`` of ``batch`` for weights ``version``; returns ``(tik/* stats,
        recompute_from_now_on)``. ``needs_prox``: AReaL's loss reads ``prox_logp`` (stock
        AReaL would have run its recompute pass)."""
        state = self.state
        trainer_recomputed = all(t.get("prox_logp") is not None for t in batch)
        stats: dict[str, float] = {}
        if state.reuse_active:
            stats.update(self._reuse(batch, version, needs_prox))
        fell_back = state.fallback_reason is not None and not trainer_recomputed
        if fell_back:
            # Fell back at this step's audit: this batch is recomputed now, and the caller
            # makes AReaL recompute every later step.
            for traj, logp in zip(batch, self.recompute(batch)):
                traj["prox_logp"] = logp
            stats.update(tokens_recomputed=float(sum(int(reuse.scored_mask(t).sum()) for t in batch)))
        stats.update(reuse_active=float(state.reuse_active), fallback=float(state.fallback_reason is not None))
        return stats, fell_back

    def _reuse(self, batch: list[dict], version: int, needs_prox: bool) -> dict[str, float]:
        state = self.state
        refused, stats = self._refusals(batch)
        plan = reuse.plan_reuse(batch, version, refused)
        audit_due = state.audit_due(version)
        audit_rows = self._audit_rows(batch, version, refused) if audit_due else []
        stale_rows = plan.stale_rows() if needs_prox else []  # default mode: nothing to replace
        rows = list(dict.fromkeys(audit_rows + stale_rows))
        if self.all_reduce([float(len(rows))], "max")[0] > 0 and not rows:
            rows = [(0, 0)]  # another process recomputes: join its collectives with one sequence
        recomputed = self._recompute_rows(batch, rows)
        if audit_due:
            audit = self._audit(batch, audit_rows, recomputed, version)
            state.record_audit(audit, version)
            if audit.conclusive:
                stats.update(bitwise_fraction=audit.fraction_identical, max_abs_delta=audit.max_abs_delta,
                             audit_passed=float(audit.identical), audited_tokens=float(audit.num_tokens))
        if state.reuse_active:
            reuse.merge_recomputed(plan, stale_rows, [recomputed[r] for r in stale_rows])
            stats.update(self._account(batch, plan, stale_rows, needs_prox))
        return stats

    def _refusals(self, batch: list[dict]) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Per trajectory the rows whose reuse is refused, and their counts for ``tik/*``."""
        refused, counts = [], []
        for traj in batch:
            missing, other = exactness.row_refusals(traj, self.temperature)
            refused.append(missing | other)
            counts.append(torch.stack([missing.sum(), other.sum(), exactness.truncated_rows(traj).sum()]))
        # one host transfer for the whole batch (the masks live on the batch's device)
        missing_rows, temperature_rows, truncated = (
            torch.stack(counts).sum(0).tolist() if counts else (0, 0, 0))
        if missing_rows and not self._missing_logged:
            self._missing_logged = True
            logger.warning("areal-tik: %d rollout rows carry no %s: they come from a workflow or engine that "
                           "does not record the log-prob temperature, so their reuse is refused and they are "
                           "recomputed (counted in tik/rows_refused_no_exactness; said once)",
                           missing_rows, "/".join(exactness.KEYS))
        return refused, dict(rows_refused_no_exactness=float(missing_rows),
                             rows_refused_temperature=float(temperature_rows),
                             rows_truncated_sampling=float(truncated))

    def _audit_rows(self, batch: list[dict], version: int, refused: list[torch.Tensor]) -> Rows:
        fresh = [(i, r) for i, t in enumerate(batch)
                 for r in (reuse.fresh_mask(t, version).any(dim=-1) & ~refused[i]).nonzero().flatten().tolist()]
        return reuse.select_rows(batch, self.audit_sequences, fresh)

    def _recompute_rows(self, batch: list[dict], rows: Rows) -> dict:
        """One recompute over the sequences ``rows``; times it for the savings estimate."""
        if not rows:
            return {}
        sample = reuse.row_batch(batch, rows)
        start = time.perf_counter()
        out = self.recompute(sample)
        tokens = sum(int(t["attention_mask"].sum()) for t in sample)
        self.state.recompute_timing = (time.perf_counter() - start, tokens)
        return {(i, r): reuse.fit_row(values, batch[i], r) for (i, r), values in zip(rows, out)}

    def _audit(self, batch: list[dict], rows: Rows, recomputed: dict, version: int) -> BitComparison:
        """Bit comparison on this process's sample, summed over all processes."""
        sample = reuse.row_batch(batch, rows)
        local = compare_bits([reuse.reused_logprobs(t)[0] for t in sample], [recomputed[r][0] for r in rows],
                             [reuse.fresh_mask(t, version)[0] for t in sample])
        n_tokens, n_equal = self.all_reduce([local.num_tokens, local.num_identical], "sum")
        (max_delta,) = self.all_reduce([local.max_abs_delta], "max")
        return BitComparison(int(n_tokens), int(n_equal), max_delta, local.first_mismatch, local.first_values)

    def _account(self, batch: list[dict], plan: reuse.ReusePlan, stale_rows: Rows,
                 needs_prox: bool) -> dict[str, float]:
        if needs_prox:
            for traj, prox in zip(batch, plan.prox):
                traj["prox_logp"] = prox
        tokens = sum(int(t["attention_mask"].sum()) for t in batch)
        stale_tokens = sum(int(batch[i]["attention_mask"][r].sum()) for i, r in stale_rows)
        skipped = tokens - stale_tokens if needs_prox else 0  # forward tokens not recomputed
        recomputed = plan.n_stale if needs_prox else 0  # default mode: stale rows keep the rollout's
        saved = self.state.note_reuse(plan.n_reused, recomputed, skipped)
        return dict(tokens_reused=float(plan.n_reused), tokens_recomputed=float(recomputed),
                    recompute_seconds_saved=saved)

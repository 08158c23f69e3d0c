"""The old/proximal log-prob orchestration (``adapter/old_logprobs.py``) without FSDP.

Its recompute is a slow, obviously right function of the trajectory (the rollout
log-probs themselves, the value a bitwise-exact trainer returns, optionally with one bit
flipped), and its all-reduce the identity or a two-process sum, so every branch (reuse,
stale recompute, audit pass and failure, fallback, another process's recompute) is
checked on plain tensors.
"""
from __future__ import annotations

import pytest
import torch

from areal_tik.adapter import reuse
from areal_tik.adapter.audit import RunState
from areal_tik.adapter.old_logprobs import OldLogprobs

from .test_areal_reuse import group, trajectory


def exact_recompute(calls: list, flip: bool = False):
    """A trainer whose forward reproduces every rollout log-prob (recompute alignment,
    unpadded like AReaL's ``compute_logp``), optionally one ulp off everywhere."""
    def recompute(batch: list[dict]) -> list[torch.Tensor]:
        calls.append(batch)
        out = []
        for traj in batch:
            for row in range(traj["input_ids"].shape[0]):
                values = reuse.reused_logprobs(traj)[row][: int(traj["attention_mask"][row].sum())]
                out.append((values.view(torch.int32) ^ 1).view(torch.float32) if flip else values)
        return out
    return recompute


def test_fresh_tokens_are_reused_and_audited_bitwise():
    calls = []
    batch = [group(trajectory(2, [3, 3, 3], seed=1), trajectory(2, [3, 3, 3], seed=2))]
    old = OldLogprobs(RunState(audit_every=2), exact_recompute(calls), audit_sequences=1)
    stats, fell_back = old.prepare(batch, version=3, needs_prox=True)
    assert not fell_back and old.reuse_active
    assert stats["audit_passed"] == 1.0 and stats["bitwise_fraction"] == 1.0 and stats["audited_tokens"] == 3
    assert stats["tokens_reused"] == 6 and stats["tokens_recomputed"] == 0
    assert len(calls) == 1 and len(calls[0]) == 1  # one audit sequence, nothing stale
    assert torch.equal(batch[0]["prox_logp"], reuse.reused_logprobs(batch[0]))
    # after the first audit: audited when version % audit_every == 0 (4), not otherwise (5)
    stats, _ = old.prepare([group(trajectory(2, [4, 4], seed=3))], version=4, needs_prox=False)
    assert "audit_passed" in stats
    stats, _ = old.prepare([group(trajectory(2, [5, 5], seed=4))], version=5, needs_prox=False)
    assert "audit_passed" not in stats and len(calls) == 2


def test_stale_tokens_take_the_recomputed_values():
    calls = []
    batch = [group(trajectory(2, [1, 0, 1], seed=5), trajectory(2, [1, 1, 1], seed=6))]
    state = RunState(audit_every=0)
    state.audit_pending = False  # no audit this step: only the stale sequence is recomputed
    old = OldLogprobs(state, exact_recompute(calls))
    stats, _ = old.prepare(batch, version=1, needs_prox=True)
    assert [t["input_ids"].shape[0] for t in calls[0]] == [1]  # row 0 only
    assert torch.equal(calls[0][0]["input_ids"], batch[0]["input_ids"][:1])
    assert (stats["tokens_reused"], stats["tokens_recomputed"]) == (5, 1)
    assert torch.equal(batch[0]["prox_logp"], reuse.reused_logprobs(batch[0]))  # exact trainer: same bits


def test_one_flipped_bit_falls_back_and_recomputes_the_batch():
    calls = []
    batch = [group(trajectory(2, [0, 0], seed=7), trajectory(2, [0, 0], seed=8))]
    old = OldLogprobs(RunState(), exact_recompute(calls, flip=True), audit_sequences=0)
    with pytest.warns(RuntimeWarning, match="bitwise audit failed at step 1"):
        stats, fell_back = old.prepare(batch, version=0, needs_prox=False)
    assert fell_back and not old.reuse_active
    assert stats["audit_passed"] == 0.0 and stats["bitwise_fraction"] == 0.0 and stats["fallback"] == 1.0
    assert 0 < stats["max_abs_delta"] < 1e-5
    assert "sampled row 0, scored token 0" in old.state.fallback_reason
    assert len(calls) == 2 and calls[1] is batch  # the whole batch, as AReaL's recompute pass
    # later steps: AReaL recomputes itself (prox_logp set), nothing is done here
    later = [group(trajectory(2, [1], seed=9))]
    later[0]["prox_logp"] = torch.zeros_like(later[0]["logprobs"])
    stats, fell_back = old.prepare(later, version=1, needs_prox=True)
    assert not fell_back and len(calls) == 2 and stats == {"reuse_active": 0.0, "fallback": 1.0}


def test_verdict_and_recompute_rows_are_shared_across_processes():
    # This process has nothing to recompute, another one has (the max is 1): it joins the
    # collective recompute with one sequence; the audit counts are summed.
    calls = []

    def two_processes(values, op):
        return [v + 1 for v in values] if op == "max" else [2 * v for v in values]

    batch = [group(trajectory(2, [2, 2], seed=10))]
    state = RunState()
    state.audit_pending = False
    old = OldLogprobs(state, exact_recompute(calls), all_reduce=two_processes)
    old.prepare(batch, version=2, needs_prox=False)
    assert len(calls) == 1 and len(calls[0]) == 1  # the one joining sequence
    old.state.audit_pending = True
    stats, _ = old.prepare(batch, version=2, needs_prox=False)
    assert stats["audited_tokens"] == 4  # 2 here + 2 on the other process


def test_the_reaction_to_a_failed_audit_is_the_configured_one():
    from areal_tik.adapter.audit import ExactnessError

    def batch():
        return [group(trajectory(2, [0, 0], seed=7))]

    warn = OldLogprobs(RunState(on_mismatch="warn"), exact_recompute([], flip=True), audit_sequences=0)
    with pytest.warns(RuntimeWarning, match="Reuse continues"):
        stats, fell_back = warn.prepare(batch(), version=0, needs_prox=True)
    assert not fell_back and warn.reuse_active and warn.state.mismatches == 1
    assert stats["audit_passed"] == 0.0 and stats["tokens_reused"] == 2
    assert "1 audits found differing bits" in warn.state.verdict()
    stop = OldLogprobs(RunState(on_mismatch="stop"), exact_recompute([], flip=True), audit_sequences=0)
    with pytest.raises(ExactnessError, match="tik_on_mismatch=stop.*bitwise audit failed at step 1"):
        stop.prepare(batch(), version=0, needs_prox=True)
    with pytest.raises(ValueError, match="on_mismatch must be one of"):
        RunState(on_mismatch="ignore")


def test_default_mode_recomputes_no_stale_row_to_throw_it_away():
    # AReaL's default mode (needs_prox False): the rollout log-probs are the old log-probs,
    # so a stale row is not recomputed; only the audit sample is.
    calls = []
    batch = [group(trajectory(2, [1, 0, 1], seed=5), trajectory(2, [1, 1, 1], seed=6))]
    state = RunState(audit_every=0)
    state.audit_pending = False
    old = OldLogprobs(state, exact_recompute(calls))
    stats, _ = old.prepare(batch, version=1, needs_prox=False)
    assert calls == [] and stats["tokens_recomputed"] == 0 and "prox_logp" not in batch[0]

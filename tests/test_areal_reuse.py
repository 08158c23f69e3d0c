"""Reuse planning, the bit comparison, the run state, the swap machinery and the launcher env."""
from __future__ import annotations

import types

import pytest
import torch


from areal_tik import patches
from areal_tik.adapter import exactness, patch_list, reuse
from areal_tik.adapter.audit import RunState
from areal_tik.adapter.launch import spmd_environment
from areal_tik.bitwise import compare_bits


def trajectory(prompt_len: int, versions: list[int], pad: int = 0, seed: int = 0, exact: bool = True) -> dict:
    """An RLVRWorkflow-shaped [1, L] trajectory: prompt, then one token per version;
    ``exact``: stamped as the areal-tik executor does (temperature 1.0, full softmax)."""
    g = torch.Generator().manual_seed(seed)
    n = prompt_len + len(versions)
    logprobs = torch.cat([torch.zeros(prompt_len), -torch.rand(len(versions), generator=g) * 5])
    t = dict(
        input_ids=torch.randint(3, 90, (n,), generator=g, dtype=torch.int32),
        loss_mask=torch.tensor([0] * prompt_len + [1] * len(versions), dtype=torch.int32),
        logprobs=logprobs.float(),
        versions=torch.tensor([-1] * prompt_len + versions, dtype=torch.int32),
        attention_mask=torch.ones(n, dtype=torch.bool),
    )
    if pad:
        t = {k: torch.cat([v, torch.zeros(pad, dtype=v.dtype)]) for k, v in t.items()}
    t = {k: v.unsqueeze(0) for k, v in t.items()}
    if exact:
        exactness.stamp(t, [(1.0, True)])
    return t


def group(*trajs) -> dict:
    """Several [1, L] trajectories of one length stacked into a [B, L] group."""
    return {k: torch.cat([t[k] for t in trajs]) for k in trajs[0]}


def test_reused_logprobs_take_the_recompute_alignment():
    t = trajectory(3, [5, 5, 5])
    prox = reuse.reused_logprobs(t)
    # position t of the recompute scores token t + 1
    assert torch.equal(prox[0, 2:5], t["logprobs"][0, 3:6])
    assert torch.equal(reuse.scored_mask(t)[0], torch.tensor([False, False, True, True, True, False]))


def test_plan_counts_fresh_and_stale_tokens():
    batch = [group(trajectory(2, [4, 4, 3], seed=1), trajectory(2, [4, 3, 3], seed=2)),
             trajectory(4, [4, 4], pad=1, seed=3)]
    plan = reuse.plan_reuse(batch, current_version=4)
    assert (plan.n_reused, plan.n_stale) == (5, 3)
    assert plan.stale_rows() == [(0, 0), (0, 1)]
    assert torch.equal(plan.stale[0][0], torch.tensor([False, False, False, True, False]))


def test_merge_takes_recomputed_values_at_stale_positions_only():
    batch = [group(trajectory(2, [1, 0, 1], seed=4), trajectory(2, [1, 1, 1], seed=5))]
    plan = reuse.plan_reuse(batch, current_version=1)
    rows = plan.stale_rows()
    assert rows == [(0, 0)]
    recomputed = [torch.full((1, 5), -9.0)]
    prox = reuse.merge_recomputed(plan, rows, recomputed)[0]
    rollout = reuse.reused_logprobs(batch[0])
    stale = plan.stale[0]
    assert torch.equal(prox[stale], torch.full((1,), -9.0))
    assert torch.equal(prox[~stale], rollout[~stale])
    assert torch.equal(prox[1], rollout[1])  # a row without stale tokens is untouched


def test_row_batch_and_row_selection():
    batch = [group(trajectory(2, [0, 0], seed=6), trajectory(2, [0, 0], seed=7)), trajectory(3, [0], seed=8)]
    rows = reuse.select_rows(batch, 2)
    assert rows == [(0, 0), (0, 1)]
    assert reuse.select_rows(batch, 0) == [(0, 0), (0, 1), (1, 0)]
    sub = reuse.row_batch(batch, [(0, 1)])
    assert torch.equal(sub[0]["input_ids"], batch[0]["input_ids"][1:2])


def test_bad_trajectories_are_named():
    t = trajectory(2, [0])
    del t["versions"]
    with pytest.raises(ValueError, match=r"trajectory 0 lacks \['versions'\]"):
        reuse.plan_reuse([t], 0)
    with pytest.raises(ValueError, match="non-empty list"):
        reuse.plan_reuse([], 0)


def test_compare_bits_passes_on_equal_bits_and_catches_one_ulp():
    a = -torch.rand(7) * 4
    mask = torch.ones(7, dtype=torch.bool)
    assert compare_bits([a], [a.clone()], [mask]).identical
    flipped = (a.view(torch.int32) ^ 1).view(torch.float32)  # lowest mantissa bit of every value
    b = a.clone()
    b[3] = flipped[3]
    result = compare_bits([a], [b], [mask])
    assert not result.identical
    assert (result.num_tokens, result.num_identical) == (7, 6)
    assert 0 < result.max_abs_delta < 1e-6
    assert result.first_mismatch == (0, 3) and result.first_values == (a[3].item(), b[3].item())
    # masked-out positions are not compared
    assert compare_bits([a], [b], [mask & (torch.arange(7) != 3)]).identical
    assert compare_bits([a], [b]).num_tokens == 7  # no masks: every position


def test_compare_bits_sees_negative_zero():
    # -0.0 == 0.0 numerically but not bitwise: the audit must not call them equal.
    assert not compare_bits([torch.tensor([0.0])], [torch.tensor([-0.0])], [torch.tensor([True])]).identical


def test_run_state_audits_and_falls_back_loudly():
    state = RunState(audit_every=3)
    assert state.audit_due(0)
    passed = compare_bits([torch.ones(2)], [torch.ones(2)], [torch.ones(2, dtype=torch.bool)])
    state.record_audit(passed, step=0)
    assert state.reuse_active and not state.audit_due(1) and state.audit_due(3)
    failed = compare_bits([torch.ones(2)], [torch.zeros(2)], [torch.ones(2, dtype=torch.bool)])
    with pytest.warns(RuntimeWarning, match="bitwise audit failed at step 4"):
        state.record_audit(failed, step=3)
    assert not state.reuse_active and "FELL BACK" in state.verdict()
    empty = compare_bits([torch.ones(2)], [torch.ones(2)], [torch.zeros(2, dtype=torch.bool)])
    fresh = RunState()
    fresh.record_audit(empty, step=0)
    assert fresh.audit_pending and fresh.reuse_active  # inconclusive: audit again next step
    assert fresh.verdict() == "no conclusive audit yet"
    fresh.record_audit(passed, step=1)
    fresh.record_audit(empty, step=2)
    assert fresh.verdict() == "all 1 audits bitwise equal; 2 more found no fresh tokens to compare"
    assert (fresh.summary()["audits"], fresh.summary()["audits_inconclusive"]) == (3, 2)


def test_time_saved_is_a_lower_bound_from_the_audit_recompute():
    state = RunState()
    assert state.note_reuse(10, 0, tokens_skipped=1000) == 0.0  # nothing timed yet
    state.recompute_timing = (0.5, 200)  # the audit's forward: 200 tokens in 0.5 s
    assert state.note_reuse(10, 0, tokens_skipped=1000) == 0.5  # more tokens: at least as long
    assert state.note_reuse(10, 0, tokens_skipped=50) == 0.125  # fewer: scaled down
    assert state.note_reuse(10, 0, tokens_skipped=0) == 0.0
    assert state.seconds_saved == 0.625 and state.tokens_reused == 40


def test_patch_list_applies_reverts_and_nests():
    import areal.engine
    from areal.trainer.rl_trainer import PPOTrainer

    original_actor, original_init = areal.engine.FSDPPPOActor, PPOTrainer.__dict__["_init_rollout"]
    outer = patch_list.apply()
    assert areal.engine.FSDPPPOActor.__name__ == "TikFSDPPPOActor"
    inner = patch_list.apply()
    assert patches.active() == ["areal", "areal"]
    with pytest.raises(RuntimeError, match="out of order"):
        outer.revert()
    inner.revert()
    assert areal.engine.FSDPPPOActor.__name__ == "TikFSDPPPOActor"
    outer.revert()
    outer.revert()  # idempotent
    assert areal.engine.FSDPPPOActor is original_actor
    assert PPOTrainer.__dict__["_init_rollout"] is original_init
    assert patches.active() == []


def test_failed_apply_leaves_nothing_behind():
    target = types.SimpleNamespace(a=1)

    class Frozen:
        __slots__ = ()

    swaps = [patches.Swap(target, "a", 2), patches.Swap(Frozen(), "b", 3)]
    with pytest.raises(AttributeError):
        patches.apply_swaps(swaps)
    assert target.a == 1 and patches.active() == []
    with pytest.raises(TypeError, match="expected a Swap"):
        patches.apply_swaps([patches.Swap(target, "a", 2), ("a", 3)])
    assert target.a == 1 and patches.active() == []


def test_spmd_environment_defaults_without_overriding():
    env = spmd_environment({"RANK": "3", "WORLD_SIZE": "8"})
    assert env["AREAL_SPMD_MODE"] == "1" and env["LOCAL_RANK"] == "3" and env["WORLD_SIZE"] == "8"
    assert int(env["MASTER_PORT"]) > 0
    assert spmd_environment({"MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"

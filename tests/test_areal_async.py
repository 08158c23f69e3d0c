"""Asynchronous (decoupled) PPO: reuse fresh tokens, recompute exactly the stale ones.

The smallest real AReaL path: TikFSDPPPOActor (FSDP2 on gloo) and the in-process engine
behind AReaL's WorkflowExecutor running RLVRWorkflow; a weight update lands while one
rollout is mid-generation, so that trajectory holds tokens of two versions.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch


from areal_tik.adapter import apply_patches, demo, reuse
from areal_tik.model.checkpoints import make_tiny_checkpoint
from areal_tik.unified_kernels import bits

WORKFLOW = "areal.workflow.rlvr.RLVRWorkflow"


@pytest.fixture
def setup(tmp_path, spmd_env):
    from areal.api import FinetuneSpec, WeightUpdateMeta

    from areal_tik.adapter.actor import TikFSDPPPOActor
    from areal_tik.adapter.inference import TikInferenceEngine
    from areal_tik.adapter.tasks import rl_dataset

    model = str(make_tiny_checkpoint(tmp_path / "llama", num_hidden_layers=1))
    base = demo.demo_overrides(model, str(tmp_path), steps=3, batch_size=2, n_samples=1, max_new_tokens=8,
                               task="basic_arithmetic", instruction="")
    with apply_patches():
        config = demo.load_config(demo.recipe_path(demo.CPU_RECIPE), base + [
            "actor.use_decoupled_loss=true", "actor.tik_audit_sequences=0",
            "rollout.max_head_offpolicyness=4"])
        actor = TikFSDPPPOActor(config.actor)
        actor.create_process_group()
        actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=2))
        engine = TikInferenceEngine(config.rollout, model_path=model, device="cpu", engine_config=config.tik)
        engine.initialize(train_data_parallel_size=1)
        actor.connect_engine(engine, WeightUpdateMeta(type="disk"))
        kwargs = dict(reward_fn=config.task.reward, gconfig=config.gconfig, tokenizer=model)
        try:
            yield actor, engine, list(rl_dataset(config.task, "train"))[:3], kwargs
        finally:
            engine.destroy()
            actor.destroy()


def new_weights(actor, engine, version: int) -> None:
    """Change the actor's weights, then sync them to the engine as AReaL's trainer does."""
    from areal.api import WeightUpdateMeta

    with torch.no_grad():
        for p in actor.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn_like(local) * 0.05)
    actor.update_weights(WeightUpdateMeta(type="disk", version=version))
    actor.set_version(version)
    engine.set_version(version)


@pytest.mark.slow
def test_stale_tokens_are_recomputed_and_fresh_ones_reused(setup):
    actor, engine, items, kwargs = setup
    old = engine.rollout_batch([items[0]], workflow=WORKFLOW, workflow_kwargs=kwargs)[0]

    # A rollout in flight while the weights change: its later tokens carry version 1. It
    # asks for more tokens than the others, and generation is paused around the update (as
    # AReaL's trainer does), so the update lands mid-request however slow the machine is.
    long_kwargs = dict(kwargs, gconfig=dataclasses.replace(kwargs["gconfig"], max_new_tokens=16))
    steps = engine.llm.num_steps
    engine.submit(items[1], workflow=WORKFLOW, workflow_kwargs=long_kwargs)
    deadline = time.monotonic() + 120
    while engine.llm.num_steps < steps + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.pause_generation()
    new_weights(actor, engine, version=1)
    engine.continue_generation()
    mixed = engine.wait(1, timeout=300)[0]
    fresh = engine.rollout_batch([items[2]], workflow=WORKFLOW, workflow_kwargs=kwargs)[0]

    versions = mixed["versions"][0][mixed["loss_mask"][0].bool()].tolist()
    assert 0 in versions and 1 in versions, versions
    assert set(old["versions"][0][old["loss_mask"][0].bool()].tolist()) == {0}

    batch = [old, mixed, fresh]
    rollout = [reuse.reused_logprobs(t) for t in batch]
    stale = [reuse.stale_mask(t, 1) for t in batch]
    fresh_masks = [reuse.fresh_mask(t, 1) for t in batch]
    n_stale = sum(int(m.sum()) for m in stale)
    assert n_stale == int(old["loss_mask"].sum()) + versions.count(0)

    actor.compute_advantages(batch)  # the trainer skipped compute_logp: reuse is active
    stats = actor.export_stats()
    assert stats["tik/tokens_recomputed"] == n_stale
    assert stats["tik/tokens_reused"] == sum(int(m.sum()) for m in fresh_masks)
    assert stats["tik/audit_passed"] == 1.0 and stats["tik/bitwise_fraction"] == 1.0

    reference = actor.actor.compute_logp([{k: t[k] for k in ("input_ids", "attention_mask")} for t in batch])
    for t, r, ref, s, f in zip(batch, rollout, reference, stale, fresh_masks):
        prox = t["prox_logp"]
        # compute_advantages multiplies by the loss mask in place; compare scored positions
        assert torch.equal(bits(prox[s]), bits(ref[s]))      # stale: the recompute's bits
        assert torch.equal(bits(prox[f]), bits(r[f]))        # fresh: the rollout's bits...
        assert torch.equal(bits(r[f]), bits(ref[f]))         # ...which are the recompute's too
    assert not torch.equal(rollout[0][stale[0]], reference[0][stale[0]])  # the weights did change


def test_unsupported_model_keeps_the_stock_forward(tmp_path, spmd_env):
    from areal.api import FinetuneSpec
    from transformers import MistralConfig, MistralForCausalLM

    from areal_tik.adapter.actor import TikFSDPPPOActor
    from areal_tik.model.checkpoints import char_tokenizer

    path = tmp_path / "mistral"
    MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     sliding_window=32)).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    base = demo.demo_overrides(str(path), str(tmp_path), steps=1, batch_size=2, n_samples=2, max_new_tokens=4)
    with apply_patches():
        config = demo.load_config(demo.recipe_path(demo.CPU_RECIPE), base + ["++actor.attn_impl=sdpa"])
    actor = TikFSDPPPOActor(config.actor)
    actor.create_process_group()
    try:
        actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=2, train_batch_size=2))
        assert actor.tik_flag and not actor.tik_enabled
        assert any("do not support this model" in r for r in actor.tik_state.refusals)
        assert config.actor.should_compute_prox_logp() is True  # AReaL's recompute stays
    finally:
        actor.destroy()


@pytest.mark.slow
def test_right_padded_rows_are_recomputed_to_the_trajectory_length(setup):
    """A group's shorter sequences are right-padded; AReaL's compute_logp returns them
    unpadded. The audit and the stale-token merge must see them at the group's length."""
    actor, engine, items, kwargs = setup
    traj = engine.rollout_batch([items[0]], workflow=WORKFLOW, workflow_kwargs=kwargs)[0]
    length = traj["input_ids"].shape[-1]
    padded = {k: torch.cat([v, torch.zeros((1, 5), dtype=v.dtype)], dim=-1)
              if isinstance(v, torch.Tensor) and v.shape == traj["input_ids"].shape else v
              for k, v in traj.items()}
    recomputed = actor.old_logprobs._recompute_rows([padded], [(0, 0)])[(0, 0)]
    assert recomputed.shape == (1, length + 5)
    alone = actor.old_logprobs._recompute_rows([traj], [(0, 0)])[(0, 0)]
    assert torch.equal(bits(recomputed[:, :length]), bits(alone))
    assert torch.equal(recomputed[:, length:], torch.zeros(1, 5))

    actor.compute_advantages([padded])  # audit on step 1 over the padded row
    stats = actor.export_stats()
    assert stats["tik/audit_passed"] == 1.0 and stats["tik/bitwise_fraction"] == 1.0
    with pytest.raises(ValueError, match="has 3 positions"):
        reuse.fit_row(torch.zeros(3), padded, 0)

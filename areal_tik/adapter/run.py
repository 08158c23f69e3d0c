"""``areal-tik run``: a shipped recipe with the flag on, on the stock path, or both.

    areal-tik run --list
    areal-tik run --recipe basic_arithmetic_grpo_smollm2 --mode both --out runs/ [key=value ...]

Overrides come last (after the options).

- ``tik``: ``actor.unified_kernels`` with the unified kernels; rollout log-probs are the
  old log-probs (no recompute pass for tokens of the current weights), bitwise audits.
- ``stock``: the strongest stock path: the same trainer, rollout engine and model code on
  standard torch kernels (``tik_kernels: standard``; the engine's elementwise ops compiled,
  its decode on FlashAttention), AReaL's recompute pass on
  (``recompute_logprob: true``, no reuse). AReaL's own SGLang/vLLM backends are not used.
  ``--stock-training hf`` trains and recomputes with AReaL's own FSDP forward over the
  Hugging Face model instead (``actor.tik_training_model: hf``: transformers' modules, AReaL's
  compiled ``gather_logprobs``, attention by torch's FlashAttention varlen), the engine unchanged.
- ``both``: ``tik`` then ``stock``, each in its own process, same seeds, data and
  overrides, one W&B group.

Each run writes ``<out>/<recipe>/<mode>/run.json`` (``run_file``: also the seconds of
the whole process and of writing a missing checkpoint) and logs to W&B through
AReaL's stats logger (offline unless ``stats_logger.wandb.mode=online``), with the run's
metadata in the W&B config under ``areal_tik`` (a stock run after its tik run also logs
``tik_run/reward_ratio`` per step). A missing checkpoint directory
(``actor.path``) is written first (SmolLM2 from its GGUF, random weights for published
configs, the tiny CPU model).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from . import recipes
from .run_file import RUN_FILE, config_digest, config_fields, derived_metrics, run_metadata, write_run_file

MODES = {
    "tik": {"unified_kernels": True, "tik_kernels": "unified", "tik_reuse_logprobs": True},
    "stock": {"unified_kernels": True, "tik_kernels": "standard", "tik_reuse_logprobs": False,
              "recompute_logprob": True},
}


def engine_overrides(mode: str, max_model_len: int, max_num_seqs: int) -> dict:
    """The engine options a mode sets. The stock mode's engine keeps each sequence's K/V in
    one block (a static per-sequence cache) so that its decode runs FlashAttention over the
    rows a sequence holds, as a stock engine's FlashAttention backend reads them (torch's
    FlashAttention takes no block table), with one block for each of ``max_num_seqs``
    sequences plus the scratch block: every sequence of a step fits at once, as in a paged
    cache, whatever memory the static layout wastes; and its norms, rope and SiLU-mul run
    under torch.compile (``compile_standard_ops``), as vLLM compiles its model (on the H200
    1.5-2.0x the eager standard engine's tokens/s). The trainer's standard ops stay eager,
    as in AReaL's FSDP actor. The unified kernels' bits do not depend on the block size;
    the tik mode keeps the default."""
    from areal_tik.model.ops import one_block_per_sequence

    if mode != "stock":
        return {}
    return {"kv_block_size": one_block_per_sequence(max_model_len), "num_kv_blocks": max_num_seqs + 1,
            "compile_standard_ops": True}


def override_value(value) -> str:
    """``value`` as a YAML override writes it (booleans lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def mode_overrides(mode: str, max_model_len: int, max_num_seqs: int, stock_training: str = "areal_tik") -> list[str]:
    """The overrides a mode adds to the recipe as asked; ``stock_training`` is the stock
    mode's trainer (``actor.tik_training_model``: this project's model code or AReaL's over
    the Hugging Face model)."""
    from .config import TRAINING_MODELS  # AReaL's config classes: not loaded for --list

    if mode not in MODES:
        raise ValueError(f"mode must be one of {[*MODES, 'both']}, got {mode!r}")
    if stock_training not in TRAINING_MODELS:
        raise ValueError(f"--stock-training must be one of {list(TRAINING_MODELS)}, got {stock_training!r}")
    actor = dict(MODES[mode], **({"tik_training_model": stock_training}
                                 if mode == "stock" and stock_training != "areal_tik" else {}))
    return ([f"++actor.{k}={override_value(v)}" for k, v in actor.items()]
            + [f"++tik.{k}={override_value(v)}"
               for k, v in engine_overrides(mode, max_model_len, max_num_seqs).items()])


def run_overrides(recipe: str, mode: str, folder: Path, group: str) -> list[str]:
    """Where this run writes (its own folder) and its W&B names; the group is shared."""
    return [f"++trial_name={mode}", f"++cluster.fileroot={folder}/areal",
            f"++cluster.name_resolve.nfs_record_root={folder}/name_resolve",
            f"++stats_logger.wandb.group={group}", f"++stats_logger.wandb.name={recipe}-{mode}",
            f"++stats_logger.wandb.job_type={mode}", f"++stats_logger.wandb.tags=[{recipe},{mode}]"]


def ensure_model(card: recipes.RecipeCard, path: str) -> float:
    """Write the checkpoint directory ``path`` of ``card``'s model if it has none; the
    seconds that took (0.0 when it existed)."""
    if (Path(path) / "config.json").is_file():
        return 0.0
    start = time.perf_counter()
    from areal_tik.model import checkpoints, published_config, smollm2_path

    if card.model == recipes.SMOLLM2:
        checkpoints.smollm2_checkpoint(path)
    elif card.model == "tiny":
        checkpoints.make_tiny_checkpoint(path, num_hidden_layers=1)
    else:
        tokenizer = checkpoints.gguf_tokenizer(smollm2_path())
        shape = published_config(card.model, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        import torch

        # drawn where the run trains: the tik run writes it, its stock run reads the same file
        checkpoints.random_checkpoint(path, shape, tokenizer, seed=0,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
    return time.perf_counter() - start


def decode_attention_path(model_path: str, kernels: str, block_size: int, max_model_len: int, dtype: str) -> str:
    """The paged decode attention the run's engine takes (what ``UnifiedCausalLM``'s
    ``decode_attention_path`` says for the checkpoint's attention shape and this device):
    the report shows it beside the stock runs, whose baseline it changes."""
    if kernels == "unified":
        return "unified"
    import torch
    from transformers import AutoConfig

    from areal_tik.model.ops import standard_decode_path

    hf = AutoConfig.from_pretrained(model_path)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return standard_decode_path(heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                                block_size, max_model_len, getattr(torch, dtype), device)


def paired_rewards(folder: Path, mode: str, digest: str) -> list[float]:
    """The per-step rewards of the tik run beside a stock run (same recipe as asked), so
    the stock run can log the reward ratio per step; [] when there is none."""
    import json

    tik_file = folder.parent / "tik" / RUN_FILE
    if mode != "stock" or not tik_file.is_file():
        return []
    tik = json.loads(tik_file.read_text())
    return [s["reward"] for s in tik["per_step"]] if tik.get("config_digest") == digest else []


def tracked_trainer_class(metadata: dict, tik_rewards: list[float] = ()):
    """The recording PPOTrainer that also puts ``metadata`` into the W&B config and the
    ``tik_run/*`` rates into each step's stats before AReaL's logger commits them (and,
    in a stock run with its tik run done, ``tik_run/reward_ratio``: tik/stock reward)."""
    from .demo import recording_trainer_class

    class TrackedPPOTrainer(recording_trainer_class()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import wandb

            if wandb.run is not None:
                wandb.config.update({"areal_tik": metadata}, allow_val_change=True)
            commit = self.stats_logger.commit

            def commit_with_rates(epoch, step, global_step, data):
                for item in data if isinstance(data, list) else [data]:
                    item.update(derived_metrics(item))
                    reward = item.get("ppo_actor/task_reward/avg")
                    if global_step < len(tik_rewards) and reward:
                        item["tik_run/reward_ratio"] = tik_rewards[global_step] / reward
                return commit(epoch, step, global_step, data)
            self.stats_logger.commit = commit_with_rates

    return TrackedPPOTrainer


def train_tracked(config, metadata: dict, tik_rewards: list[float] = ()):
    from areal.utils import perf_tracer

    from .tasks import rl_dataset

    workflow_kwargs = dict(reward_fn=config.task.reward, gconfig=config.gconfig,
                           tokenizer=config.tokenizer_path, enable_thinking=False)
    try:
        with tracked_trainer_class(metadata, tik_rewards)(config, train_dataset=rl_dataset(config.task, "train"),
                                             valid_dataset=None) as trainer:
            trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)
            return trainer.history, trainer.actor.tik_state
    finally:
        perf_tracer.reset()  # process-global in AReaL


def run_one(name: str, mode: str, out: Path, group: str, overrides: list[str],
            stock_training: str = "areal_tik") -> Path:
    """One mode of recipe ``name`` in this process; returns its run file (with the
    process's seconds from here to just before writing it, and the checkpoint's)."""
    start = time.perf_counter()
    from . import patch_list
    from areal_tik.model.ops import engine_compiled_ops
    from .run_file import training_attention_path

    from .demo import load_config
    from .launch import spmd_environment
    from .tasks import check_task

    spmd_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path, card = recipes.recipe_file(name), recipes.card(name)
    folder = out / name / mode
    with patch_list.apply():
        asked = load_config(path, overrides)  # the recipe as asked: what both modes share
        config = load_config(path, overrides + mode_overrides(mode, asked.tik.max_model_len, asked.tik.max_num_seqs,
                                                              stock_training)
                             + run_overrides(name, mode, folder, group))
        check_task(config.task)  # a verifier that cannot import or score stops the run here
        checkpoint_seconds = ensure_model(card, config.actor.path)
        metadata = run_metadata(name, mode, config.actor.tik_kernels,
                                decode_attention_path(config.actor.path, config.actor.tik_kernels,
                                                      config.tik.kv_block_size, config.tik.max_model_len,
                                                      config.actor.dtype),
                                engine_compiled_ops(config.actor.tik_kernels, config.tik.compile_standard_ops),
                                training_model=config.actor.tik_training_model)
        digest = config_digest(asked)
        history, state = train_tracked(config, metadata, paired_rewards(folder, mode, digest))
    metadata["training_attention"] = training_attention_path(config.actor.tik_kernels)
    summary = state.summary()
    return write_run_file(folder, recipe=name, mode=mode, config=config, digest=digest, group=group,
                          metadata=metadata, history=history, summary=summary,
                          process_seconds=time.perf_counter() - start, checkpoint_seconds=checkpoint_seconds,
                          asked_fields=config_fields(asked))


def add_arguments(parser) -> None:
    parser.add_argument("--recipe", default=None, help="a recipe of recipes/ (see --list)")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--mode", default="both", help="tik, stock or both (default)")
    parser.add_argument("--out", default="runs", help="runs go to OUT/<recipe>/<mode>/")
    parser.add_argument("--group", default=None, help="W&B group (default: <recipe>-seed<seed>)")
    parser.add_argument("--stock-training", default="areal_tik",
                        help="the stock mode's trainer: this project's model code on standard kernels "
                             "(areal_tik, default) or AReaL's own FSDP forward over the Hugging Face model (hf)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value, Hydra syntax; after the options), both modes")


def _seed_of(overrides: list[str]) -> str:
    found = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == "seed"]
    return found[-1] if found else "1"


def validate(args) -> None:
    """The options before anything runs (the CLI reports a ValueError here as a usage error)."""
    if args.list:
        return
    if args.recipe is None:
        raise ValueError(f"name a recipe; the recipes are: {', '.join(recipes.recipe_names())}")
    recipes.recipe_file(args.recipe)
    if args.mode not in (*MODES, "both"):
        raise ValueError(f"--mode must be one of {[*MODES, 'both']}, got {args.mode!r}")
    mode_overrides("stock", 1, 1, args.stock_training)  # a bad --stock-training fails here, naming the choices
    if args.mode == "tik" and args.stock_training != "areal_tik":
        raise ValueError(f"--stock-training {args.stock_training} names the stock run's trainer; a tik run "
                         "trains on the unified kernels (use --mode stock or both)")


def main(args) -> int:
    if args.list:
        for c in recipes.CARDS:
            print(f"{c.name:45} {c.model:22} {c.algorithm:10} {c.measures}")
        return 0
    validate(args)  # also when called without the CLI
    group = args.group or f"{args.recipe}-seed{_seed_of(args.overrides)}"
    out = Path(args.out).resolve()
    if args.mode != "both":
        print(f"wrote {run_one(args.recipe, args.mode, out, group, list(args.overrides), args.stock_training)}")
        return 0
    from areal_tik.runtime import use_interpreter_without_gpu

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(recipes.RECIPES_DIR.parent), env.get("PYTHONPATH")]))
    use_interpreter_without_gpu(env)
    codes = []
    for mode in MODES:  # each mode in its own process: AReaL keeps process-global state
        cmd = [sys.executable, "-m", "areal_tik.cli", "run", "--recipe", args.recipe, "--mode", mode, "--out", str(out),
               "--group", group, *(["--stock-training", args.stock_training] if mode == "stock" else []),
               *args.overrides]
        codes.append(subprocess.run(cmd, env=env).returncode)
        print(f"{args.recipe} {mode}: exit code {codes[-1]}", flush=True)
    return max(codes)

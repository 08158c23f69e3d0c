"""What a recipe run records: its metadata, per-step metrics and the local run file.

``run.json`` (one per run folder) is what ``areal-tik report`` reads::

    {"format": 1, "recipe": ..., "mode": "tik"|"stock", "seeds": {"seed", "task_seed"},
     "steps": N, "config_digest": sha256 of the recipe as asked (mode and run folders left
     out, so both runs of a comparison share it), "group": the W&B group,
     "metadata": {commit, gpu, driver, torch, triton, cuda, transformers, areal,
                  kernel_set, decode_attention, compiled_ops, logprob, training_model,
                  recipe, mode, date, and training_attention: set after the steps, since
                  the standard set's varlen attention can fall back at run time},
     "summary": the audit/reuse summary, "per_step": [{"step", "reward", "tokens",
     "generated_tokens", "step_seconds", "tokens_per_s", "phases": {...}, "tik": {...}}],
     "process_seconds": wall time of the run from the start of ``run_one`` (before config
     loading and the checkpoint check) to just before this file is written,
     "checkpoint_seconds": of it, writing a missing checkpoint (0 when it existed: a
     one-time preparation only the first run of a pair pays),
     "startup_seconds": process_seconds - checkpoint_seconds - the steps' step_seconds
     (start-up and teardown outside the steps: AReaL init, model load, the kernels'
     device qualification, compilation warm-up, CUDA graph capture)}

Files written before the three timing keys existed lack them (same format); the report
shows "n/a" for what needs them.

``derived_metrics`` adds ``tik_run/*`` rates to each step's stats before AReaL's stats
logger commits them, so W&B carries the same tokens/s the run file does.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import subprocess
from pathlib import Path

RUN_FILE = "run.json"
FORMAT = 1
PHASES = ("rollout", "recompute_logp", "compute_advantage", "train_step", "update_weights")
REPO = Path(__file__).resolve().parents[2]


def _command_output(cmd: list[str], cwd=None) -> str | None:
    try:
        return subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, check=True,
                              timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(recipe: str, mode: str, kernel_set: str, decode_attention: str = "unknown",
                 compiled_ops=(), training_model: str = "areal_tik") -> dict:
    """Commit, device, driver and library versions of this process, the run's names, the
    paged decode attention its engine runs (``decode_attention_path``), the standard ops
    its engine runs under torch.compile (``EngineConfig.compile_standard_ops``) and the
    trainer's token log-prob (``model.ops.standard_logprob_path`` for the standard set) and
    whose model code trains (``actor.tik_training_model``)."""
    import areal
    import torch
    import transformers
    import triton

    from areal_tik.model.ops import areal_gather_label, standard_logprob_path

    on_gpu = torch.cuda.is_available()
    logprob = "unified" if kernel_set == "unified" else standard_logprob_path("cuda" if on_gpu else "cpu")
    if training_model == "hf":  # AReaL's own _compute_logprobs_and_loss: its gather_logprobs_entropy
        logprob = areal_gather_label()
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "commit": os.environ.get("AREAL_TIK_COMMIT") or _command_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO) or "unknown",
        "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
        "driver": driver.splitlines()[0] if driver else "none",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "areal": getattr(areal, "__version__", "unknown"),
        "kernel_set": kernel_set, "decode_attention": decode_attention, "compiled_ops": list(compiled_ops),
        "logprob": logprob, "training_model": training_model,
        "recipe": recipe, "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def training_attention_path(kernel_set: str) -> str:
    """The packed attention this process's trainer ran, read after the run (a fallback to
    SDPA per sequence happens at run time): ``metadata.training_attention``."""
    import torch

    from areal_tik.model.ops import standard_attention_path

    if kernel_set == "unified":
        return "unified"
    return standard_attention_path("cuda" if torch.cuda.is_available() else "cpu")


def config_digest(config) -> str:
    """sha256 of a typed config's fields (JSON, keys sorted)."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def config_fields(config) -> dict[str, str]:
    """A typed config's fields flattened to dotted keys, each value as JSON: what the run file
    keeps of the recipe as asked, so that a report refusing two runs whose digests differ can
    name the fields that differ."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    walk("", dataclasses.asdict(config))
    return flat


def _number(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return value


def derived_metrics(stats: dict) -> dict:
    """``tik_run/*`` of one step's stats: wall step time and the token rates over it."""
    seconds = _number(stats.get("bench/step_seconds"))
    tokens = _number(stats.get("ppo_actor/n_tokens"))
    generated = _number(stats.get("ppo_actor/n_valid_tokens"))
    ok = seconds > 0 and not math.isnan(seconds)
    return {"tik_run/step_seconds": seconds,
            "tik_run/tokens_per_s": tokens / seconds if ok else float("nan"),
            "tik_run/generated_tokens_per_s": generated / seconds if ok else float("nan")}


def step_record(step: int, stats: dict) -> dict:
    """One step of the run file from that step's stats."""
    derived = derived_metrics(stats)
    reward = stats.get("ppo_actor/task_reward/avg", stats.get("rollout/reward"))
    return {
        "step": step, "reward": _number(reward),
        "tokens": _number(stats.get("ppo_actor/n_tokens")),
        "generated_tokens": _number(stats.get("ppo_actor/n_valid_tokens")),
        "step_seconds": derived["tik_run/step_seconds"], "tokens_per_s": derived["tik_run/tokens_per_s"],
        "phases": {p: _number(stats.get(f"timeperf/{p}", 0.0)) for p in PHASES},
        "tik": {k.split("/", 1)[1]: _number(v) for k, v in stats.items()
                if k.startswith("tik/") and not k.endswith("__count")},
    }


def write_run_file(folder: Path, *, recipe: str, mode: str, config, digest: str, group: str,
                   metadata: dict, history: list[dict], summary: dict, process_seconds: float,
                   checkpoint_seconds: float, asked_fields: dict[str, str] | None = None) -> Path:
    """``config``: the config the run ran; ``digest`` and ``asked_fields`` (``config_fields``):
    the recipe as asked, which the two modes of a comparison share."""
    folder.mkdir(parents=True, exist_ok=True)
    per_step = [step_record(i, h) for i, h in enumerate(history, start=1)]
    record = {
        "format": FORMAT, "recipe": recipe, "mode": mode,
        "seeds": {"seed": config.seed, "task_seed": config.task.seed},
        "steps": len(history), "config_digest": digest, "config_asked": asked_fields or {},
        "group": group, "metadata": metadata,
        "summary": summary, "per_step": per_step,
        "process_seconds": process_seconds, "checkpoint_seconds": checkpoint_seconds,
        "startup_seconds": process_seconds - checkpoint_seconds - sum(s["step_seconds"] for s in per_step),
    }
    path = folder / RUN_FILE
    path.write_text(json.dumps(record, indent=1, default=str, allow_nan=True))
    return path

"""Two of AReaL 1.0.4's log lines, corrected for a run with ``actor.unified_kernels`` on
(swaps of the patch list, so reverted with it):

- ``PPOActor._log_configuration`` prints ``old_logp (π_old): RECOMPUTED from current
  policy`` (or ``Proximal policy (π_prox): RECOMPUTED via forward pass`` when decoupled)
  from ``recompute_logprob``; with the flag on, the run reuses the rollout's log-probs
  instead, so one note follows the banner saying so (not when the config itself turns
  reuse off: ``tik_reuse_logprobs`` false or ``tik_kernels`` standard, as in a recipe's
  stock mode, where the recompute the banner names does run).
- ``StatsLogger.commit`` prints ``Epoch 1/1 Step 1/32 Train step 1/32 done.`` for a run of
  ``total_train_steps=3``: both 32s are the batches of the dataset's epoch (its
  ``FinetuneSpec``), not the run's length. The line is rewritten to lead with the train
  step out of ``total_train_steps`` (read from the trainer's config when ``train`` starts)
  and to name the 32 for what it is.
"""
from __future__ import annotations

import functools
import re

from areal_tik.patches import Swap

REUSE_NOTE = ("  areal-tik: actor.unified_kernels is on, so the line above does not hold while reuse does: "
              "old_logp is the rollout's log-prob (bit-identical to the training forward), audited on step 1 "
              "and every tik_audit_every steps; a refusal or an audit difference (logged) brings the recompute back")
_COMMIT = re.compile(r"^Epoch (\d+)/(\d+) Step (\d+)/(\d+) Train step (\d+)/(\S+) done\.$")


def step_line(message: str, total_steps: int | None = None) -> str:
    """AReaL's per-step line with the run's step first, out of ``total_steps`` when known
    (other messages unchanged)."""
    m = _COMMIT.match(message) if isinstance(message, str) else None
    if m is None:
        return message
    epoch, epochs, step, per_epoch, train_step, total = m.groups()
    total = total_steps or total
    return (f"Train step {train_step}/{total} done (epoch {epoch}/{epochs}, batch {step} of the "
            f"{per_epoch} in an epoch of the dataset)")


class StepLineLogger:
    """AReaL's StatsLogger logger, with ``step_line`` applied to what ``info`` logs."""

    def __init__(self, logger):
        self._logger = logger
        self.total_steps: int | None = None  # the running trainer's config.total_train_steps

    def info(self, msg, *args, **kwargs):
        return self._logger.info(step_line(msg, self.total_steps), *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._logger, name)


def wrap_log_configuration(original):
    @functools.wraps(original)
    def _log_configuration(self):
        original(self)
        c = self.config  # the recipes' stock mode keeps the flag on with reuse off
        if (getattr(c, "unified_kernels", False) and getattr(c, "tik_reuse_logprobs", True)
                and getattr(c, "tik_kernels", "unified") == "unified"):
            from areal.trainer.ppo import actor as ppo_actor

            ppo_actor.logger.info(REUSE_NOTE)
    return _log_configuration


def wrap_train(original, step_logger: StepLineLogger):
    @functools.wraps(original)
    def train(trainer, *args, **kwargs):
        step_logger.total_steps = getattr(trainer.config, "total_train_steps", None)
        return original(trainer, *args, **kwargs)
    return train


def swaps() -> list[Swap]:
    from areal.trainer.ppo.actor import PPOActor
    from areal.trainer.rl_trainer import PPOTrainer
    from areal.utils import stats_logger

    step_logger = StepLineLogger(stats_logger.logger)
    return [
        Swap(PPOActor, "_log_configuration", wrap_log_configuration(PPOActor._log_configuration)),
        Swap(stats_logger, "logger", step_logger),
        Swap(PPOTrainer, "train", wrap_train(PPOTrainer.train, step_logger)),
    ]

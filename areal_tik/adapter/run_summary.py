"""The end-of-run summary of a GRPO run, printed by ``areal-tik demo`` and by
``areal-tik launch`` (``summary_lines``), the latter from what the run's ``PPOTrainer``
committed.

``RunRecorder.swaps()`` wraps ``PPOTrainer.train`` (to know the trainer) and
``StatsLogger.commit`` (to keep each step's stats; rank 0 prints the summary); both
are reverted with the rest of the patches.
"""
from __future__ import annotations

import functools
import time

from areal_tik.patches import Swap


def summary_lines(history: list[dict], state, seconds: float, title: str = "areal-tik demo") -> list[str]:
    rewards = [h.get("rollout/reward", h.get("ppo_actor/task_reward/avg", float("nan"))) for h in history]
    info = state.summary()
    lines = [f"{title}: {len(history)} GRPO steps in {seconds:.0f} s (AReaL PPOTrainer, flag on)"]
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


class RunRecorder:
    def __init__(self):
        self.trainer = None
        self.history: list[dict] = []
        self.start = time.perf_counter()

    def swaps(self) -> list[Swap]:
        from areal.trainer.rl_trainer import PPOTrainer
        from areal.utils.stats_logger import StatsLogger

        recorder = self
        train, commit = PPOTrainer.train, StatsLogger.commit

        @functools.wraps(train)
        def recording_train(trainer, *args, **kwargs):
            recorder.trainer = trainer
            return train(trainer, *args, **kwargs)

        @functools.wraps(commit)
        def recording_commit(logger, epoch, step, global_step, data):
            commit(logger, epoch, step, global_step, data)
            recorder.history += [dict(d) for d in ([data] if isinstance(data, dict) else data)]

        return [Swap(PPOTrainer, "train", recording_train), Swap(StatsLogger, "commit", recording_commit)]

    def lines(self, title: str) -> list[str]:
        seconds = time.perf_counter() - self.start
        state = getattr(getattr(self.trainer, "actor", None), "tik_state", None)
        if self.trainer is None or not self.history:
            return [f"{title}: no PPOTrainer step was committed ({seconds:.0f} s)"]
        if state is None:
            return [f"{title}: {len(self.history)} steps in {seconds:.0f} s (actor.unified_kernels off: "
                    "no reuse summary)"]
        return summary_lines(self.history, state, seconds, title=title)

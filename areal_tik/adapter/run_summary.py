"""The end-of-run summary for a script run by ``areal-tik launch``: the same lines the
demo prints (``demo.summary_lines``), from what the run's ``PPOTrainer`` committed.

``RunRecorder.swaps()`` wraps ``PPOTrainer.train`` (to know the trainer) and
``StatsLogger.commit`` (to keep each step's stats, on the rank that logs them); both
are reverted with the rest of the patches.
"""
from __future__ import annotations

import functools
import time

from areal_tik.patches import Swap


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
        from .demo import summary_lines

        seconds = time.perf_counter() - self.start
        state = getattr(getattr(self.trainer, "actor", None), "tik_state", None)
        if self.trainer is None or not self.history:
            return [f"{title}: no PPOTrainer step was committed ({seconds:.0f} s)"]
        if state is None:
            return [f"{title}: {len(self.history)} steps in {seconds:.0f} s (actor.unified_kernels off: "
                    "no reuse summary)"]
        return summary_lines(self.history, state, seconds, title=title)

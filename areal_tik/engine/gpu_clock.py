"""The GPU's own clock around decode steps: how long a step keeps it busy, and how long it
waits on the host between two decode steps.

Host phases (``StepLoop.step_seconds``) say what the engine thread does, not whether the
GPU sits idle meanwhile. ``GpuClock`` records a CUDA event right before a decode step
enqueues its forward (after its inputs are staged) and one after its results are copied
back. An event recorded while the GPU is idle completes at once, so its timestamp is the
host's moment, and for two consecutive decode steps

    span = end(n) - start(n)        the step on the GPU: launch latency, kernels, copy back
    idle = start(n + 1) - end(n)    the host between them: postprocess, schedule, staging

``idle`` is the host overhead a step adds beyond the GPU time (what overlapping the next
step's host work with this step's kernels would hide). The gap after a prefill or mixed
step is not counted: ``break_chain`` drops the previous end. With overlapped steps
(``EngineConfig.overlap_steps``) step n + 1 is enqueued before step n's results are read;
its start event then completes when the GPU reaches it, after step n, so ``idle`` stays
the GPU's wait. Off unless a caller installs one (``ModelRunner.gpu_clock``): two event
records and two ``elapsed_time`` reads a step.
"""
from __future__ import annotations

from typing import Callable


class GpuClock:
    def __init__(self, event_factory: Callable | None = None):
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)
        self._new = event_factory
        self._prev_end = None
        self.steps = 0          # decode steps with a span
        self.span_ms = 0.0
        self.gaps = 0           # pairs of consecutive decode steps
        self.idle_ms = 0.0

    def mark(self):
        """An event recorded now on the current stream: a step's start (its inputs staged,
        before its forward is enqueued) or end (after its results' copy back is enqueued)."""
        event = self._new()
        event.record()
        return event

    def account(self, start, end) -> None:
        """Add one decode step (its ``mark`` events), once its results are read; steps are
        accounted in launch order, so the gap is from the previous step's end."""
        end.synchronize()
        self.steps += 1
        self.span_ms += start.elapsed_time(end)
        if self._prev_end is not None:
            self.gaps += 1
            self.idle_ms += self._prev_end.elapsed_time(start)
        self._prev_end = end

    def break_chain(self) -> None:
        """A step that is not timed runs next: the next gap would include it."""
        self._prev_end = None

    def summary(self) -> dict:
        return {"steps": self.steps, "span_ms": self.span_ms / max(self.steps, 1),
                "gaps": self.gaps, "idle_ms": self.idle_ms / max(self.gaps, 1)}

"""Paired timing: candidate, incumbent and root on the same fresh inputs, in random order.

GPU: each impl's call is captured once per workload in a CUDA graph (``calls`` calls
when one is short, so launch gaps do not dominate a 10 us decode) and timed by CUDA
events around ``reps`` replays; kernel time only, no host launch cost, reported per call
(a replay's time / ``calls``). Runs recorded before this was fixed (2026-12-07) carry a
replay's time: ``calls`` (1-32, from a one-call estimate that includes the host launch)
times the call. Their ratios hold (every impl of a workload is timed on the same
``calls``); their absolute us do not, and a workload could move between runs by a whole
factor of calls (decode b1 x 1K: 45 vs 65 us for a 21.5 us kernel,
``eval/probe_decode_latency.py``). Before each round the inputs are rewritten in place
(new random contents, same pointers: the graphs read them), the impls run in a random
order, and every impl's outputs are then compared bit for bit with the reference impl's
(an impl timed on less work, or on stale data, fails here). With ``l2_flush`` each
replay is preceded by a 256 MiB write, outside the events.
CPU (tests only): wall clock around eager calls; the numbers carry no meaning.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import torch

from .checks import CheckFailed, expect_bits

_FLUSH_BYTES = 256 * 2 ** 20


class _Runner:
    """One impl on one workload's inputs: ``run()`` then ``outputs``."""

    def __init__(self, op, impl, w, inputs, device, calls: int):
        self.device = device
        self.calls = calls if device.type == "cuda" else 1
        if device.type != "cuda":
            self.outputs = op.call(impl, w, inputs)
            self.run = lambda: setattr(self, "outputs", op.call(impl, w, inputs))
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            op.call(impl, w, inputs)  # warm-up: compiles, allocator
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for _ in range(calls):
                self.outputs = op.call(impl, w, inputs)
        self.run = self.graph.replay


def _elapsed_us(runner: _Runner, reps: int, flush) -> float:
    if runner.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            runner.run()
        return (time.perf_counter() - start) * 1e6 / reps
    total = 0.0
    for chunk in ([1] * reps if flush is not None else [reps]):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(chunk):
            runner.run()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end) * 1e3
    return total / (reps * runner.calls)


def _estimate_us(op, impl, w, inputs, device) -> float:
    if device.type != "cuda":
        return 1.0
    op.call(impl, w, inputs)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op.call(impl, w, inputs)
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end) * 1e3, 1.0)


def paired(op, impls: dict, workloads, device, *, reference: str, rounds: int = 3, seed: int = 0,
           l2_flush: bool = False, target_us: float = 2000.0) -> tuple[dict, list]:
    """Median us per call of every impl on every workload (a CUDA graph replay of several
    calls, divided by their number), and the bit mismatches.

    Returns ({workload: {impl name: us}}, [failure messages]); an impl whose outputs
    differ from ``reference``'s (or that crashes) is reported and not timed further."""
    order_rng = random.Random(seed)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device) if (
        l2_flush and device.type == "cuda") else None
    times, failures = {}, []
    for wi, w in enumerate(workloads):
        inputs = op.make_inputs(w, seed * 1_000_003 + wi, device)
        est = _estimate_us(op, impls[reference], w, inputs, device)
        calls = max(1, min(32, math.ceil(300.0 / est)))
        reps = max(1, min(20, math.ceil(target_us / (est * calls)))) if device.type == "cuda" else 1
        runners, samples = {}, {}
        for name, impl in impls.items():
            try:
                runners[name] = _Runner(op, impl, w, inputs, device, calls)
                samples[name] = []
            except Exception as e:
                failures.append(f"{w.name}: {name} crashed: {type(e).__name__}: {str(e)[:300]}")
        for r in range(rounds):
            op.refill(w, inputs, seed * 7919 + wi * 104729 + r + 1)  # fresh contents, same pointers
            names = list(runners)
            order_rng.shuffle(names)
            for name in names:
                samples[name].append(_elapsed_us(runners[name], reps, flush))
            for name in list(runners):
                if name == reference or reference not in runners:
                    continue
                try:
                    expect_bits(f"{w.name} round {r}: {name} vs {reference}",
                                tuple(runners[name].outputs), tuple(runners[reference].outputs))
                except CheckFailed as e:
                    failures.append(str(e))
                    del runners[name]
        times[w.name] = {name: statistics.median(s) for name, s in samples.items() if s}
        del runners
    return times, failures

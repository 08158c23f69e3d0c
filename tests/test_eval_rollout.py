"""eval/bench_rollout.py's host-phase line: per-step host seconds of one timed run, from the
step loop's own counters, on a tiny engine under the interpreter."""
import re
import time

from areal_tik.engine import SamplingParams
from eval.bench_rollout import decode_phases, gpu_clock_line, host_phases
from tests._engine_utils import hf_small, prompts_of, small_engine, unified  # noqa: F401  (fixtures)


def test_host_phases_count_the_run_steps_and_fit_in_its_wall_time(unified):  # noqa: F811
    with small_engine(unified) as llm:
        llm.generate(prompts_of([3, 5]), SamplingParams(max_new_tokens=2, ignore_eos=True))  # earlier steps
        steps, seconds = llm.num_steps, dict(llm.step_seconds)
        start = time.perf_counter()
        llm.generate(prompts_of([4, 6]), SamplingParams(max_new_tokens=5, ignore_eos=True))
        wall = time.perf_counter() - start
        line = host_phases(llm, steps, seconds, wall)
    # one prefill step (it samples the first token) and four decode steps: the earlier run's left out
    assert line.startswith("host phases over 5 steps"), line
    per = {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", line)}
    assert set(per) == {"schedule", "launch", "wait", "postprocess", "waiting", "wall"}, per
    parts = per["schedule"] + per["launch"] + per["wait"] + per["postprocess"]
    assert 0 < parts <= per["wall"] + 1e-3, line
    assert abs(per["waiting"] - (parts - per["wait"])) < 2e-3, line


def test_decode_phases_count_only_the_decode_steps(unified):  # noqa: F811
    with small_engine(unified) as llm:
        llm.generate(prompts_of([3]), SamplingParams(max_new_tokens=2, ignore_eos=True))  # earlier steps
        steps, seconds = llm.decode_step_seconds
        seconds = dict(seconds)
        all_steps, all_seconds = llm.num_steps, dict(llm.step_seconds)
        llm.generate(prompts_of([4, 6]), SamplingParams(max_new_tokens=5, ignore_eos=True))
        line = decode_phases(llm, steps, seconds)
        total_line = host_phases(llm, all_steps, all_seconds, 1e9)
    # one prefill step (it samples the first token), then four steps that only decode
    assert line.startswith("decode steps only (4)"), line
    per = {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", line)}
    assert set(per) == {"schedule", "launch", "wait", "postprocess", "waiting", "sum"}, per
    assert abs(per["sum"] - (per["schedule"] + per["launch"] + per["wait"] + per["postprocess"])) < 2e-3, line
    total = {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", total_line)}
    # the decode steps' seconds are part of all five steps' (per step: 4 x decode <= 5 x all)
    assert 4 * per["launch"] <= 5 * total["launch"] + 1e-6, (line, total_line)


class _HostEvent:
    """A CUDA event's interface on the host clock: on CPU every "stream" is idle, so an event
    completes when recorded, as ``GpuClock`` expects of an idle GPU."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_gpu_clock_times_decode_steps_and_the_gaps_between_them(unified):  # noqa: F811
    from areal_tik.engine.gpu_clock import GpuClock
    with small_engine(unified) as llm:
        llm.generate(prompts_of([3]), SamplingParams(max_new_tokens=2, ignore_eos=True))
        clock = llm.runner.gpu_clock = GpuClock(_HostEvent)
        steps, seconds = llm.decode_step_seconds
        seconds = dict(seconds)
        llm.generate(prompts_of([4, 6]), SamplingParams(max_new_tokens=5, ignore_eos=True))
        llm.runner.gpu_clock = None
        decode = {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", decode_phases(llm, steps, seconds))}
        llm.generate(prompts_of([4]), SamplingParams(max_new_tokens=3, ignore_eos=True))  # not timed
    c = clock.summary()
    # the prefill step breaks the chain: 4 decode steps, 3 gaps between consecutive ones
    assert (c["steps"], c["gaps"]) == (4, 3), c
    # a span lies inside its step's launch + wait; a gap covers postprocess + schedule at least
    assert 0 < c["span_ms"] <= decode["launch"] + decode["wait"] + 1e-3, (c, decode)
    assert c["idle_ms"] >= 0.5 * (decode["postprocess"] + decode["schedule"]), (c, decode)
    assert "4 decode steps" in gpu_clock_line(clock) and "3 gaps" in gpu_clock_line(clock)


def test_the_bytes_bound_counts_weights_once_and_the_kv_at_the_mean_context():
    from types import SimpleNamespace

    from eval.bench_rollout import PROMPT_LEN, bound_line, kv_bytes_per_step
    # Qwen3-0.6B's attention shape: 28 layers, 8 KV heads of 128
    cfg = SimpleNamespace(head_dim=128, hidden_size=1024, num_attention_heads=16, num_hidden_layers=28,
                          num_key_value_heads=8)
    kv = kv_bytes_per_step(cfg, 64, 257)
    contexts = [PROMPT_LEN + i for i in range(257)]  # the context each of the 257 steps reads
    assert kv == 64 * 28 * 2 * 8 * 128 * 2 * sum(contexts) / len(contexts)
    # 2 GB read in 1 ms a step is 2 TB/s: at an H100's 3.35 TB/s the bound is 0.597 ms, so 1.68x
    line = bound_line(64, 100, 0.1, 1_000_000_000, 1e9, "NVIDIA H100 80GB HBM3")
    assert "1.000 ms a step for 2.00 GB" in line and "2.00 TB/s" in line and "1.68x the bytes bound at 3.35" in line
    assert "bytes bound" not in bound_line(1, 10, 1.0, 10, 0.0, "cpu")  # no ceiling known: no ratio

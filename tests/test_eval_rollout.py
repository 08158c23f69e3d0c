"""eval/bench_rollout.py's host-phase line: per-step host seconds of one timed run, from the
step loop's own counters, on a tiny engine under the interpreter."""
import re
import time

from areal_tik.engine import SamplingParams
from eval.bench_rollout import decode_phases, host_phases
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

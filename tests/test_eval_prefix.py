"""The prefix-cache benchmark (eval/bench_prefix.py): its ratios and step statistics, and a
CPU plumbing run of the GRPO and recipe parts under the protocol (first run, then warm
run, per mode, bitwise checks)."""
from __future__ import annotations

from eval.bench_prefix import RECIPE_PROMPT_TOKENS, StepLog, main, recipe_lengths, time_ratios


def test_time_ratios_divide_each_phase_by_the_nocache_mode():
    results = {"nocache": {"warm": 2.0, "whole": 5.0}, "cache": {"warm": 1.0, "whole": 6.0}}
    assert time_ratios(results) == {"cache": {"warm": 0.5, "whole": 1.2}}


def test_cpu_smoke_run_is_bitwise_and_reports_every_phase(tmp_path, capsys):
    # one group of 2 samples of 20 tokens (one full 16-token block shared), 2 new tokens
    argv = ["--device", "cpu", "--skip-latency", "--groups", "1", "--prompt-len", "20", "--new-tokens", "2"]
    assert main(argv + ["--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert "bitwise: nocache == cache == cache+chunked: True" in out
    assert "prompt-heavy: 1 groups x n = 2" in out and "speed-up warm" in out
    for mode in ("nocache", "cache", "cache+chunked"):  # a row of the side-by-side table per mode and setting
        assert out.count(f"\n    {mode} ") >= 2
    assert out.count("time / nocache: warm") == 2 * 2  # the prompt-heavy and the recipe setting
    assert "recipe setting n = 2" in out and out.count("bitwise: nocache == cache == cache+chunked: True") == 2
    text = (tmp_path / "p.csv").read_text()
    assert "warm_time_vs_nocache" in text and "first_seconds" in text and "warm_speedup_vs_nocache" in text
    assert "recipe_n2" in text


def test_decode_step_statistics_separate_decode_only_from_mixed_steps():
    # (start, end, kind, replayed): a mixed admission phase, decode-only steps, then the
    # long prompt (a prefill-only step without chunks) at t = 10. The median decode-only
    # gap counts adjacent decode-only steps only, never the mixed ones before them.
    log = StepLog.__new__(StepLog)
    log.steps = [(0.0, 1.0, "prefill", False), (1.0, 3.0, "mixed", True), (3.0, 5.0, "mixed", True),
                 (5.0, 5.5, "decode", True), (5.5, 6.0, "decode", True), (6.0, 6.75, "decode", False),
                 (10.0, 14.0, "prefill", False), (14.0, 14.5, "decode", True)]
    assert log.decode_only_gaps(until=10.0) == [0.5, 0.75]
    assert log.longest_decode_gap(since=5.0) == 14.5 - 6.75
    assert log.durations("mixed") == [2.0, 2.0] and log.durations("prefill", since=5.0) == [4.0]
    assert log.replayed_fraction("decode") == 0.75 and log.replayed_fraction("mixed") == 1.0


def test_recipe_prompt_lengths_stay_in_each_task_range():
    lengths = recipe_lengths(10)
    for g, n in enumerate(lengths):
        lo, hi = RECIPE_PROMPT_TOKENS[g % len(RECIPE_PROMPT_TOKENS)]
        assert lo <= n <= hi
    assert recipe_lengths(10) == lengths and len(set(lengths)) > 1

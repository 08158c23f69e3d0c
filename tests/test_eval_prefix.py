"""The prefix-cache benchmark (eval/bench_prefix.py): its ratios, and a CPU plumbing run
of the GRPO part under the protocol (first run, then warm run, per mode, bitwise checks)."""
from __future__ import annotations

from eval.bench_prefix import main, time_ratios


def test_time_ratios_divide_each_phase_by_the_nocache_mode():
    results = {"nocache": {"warm": 2.0, "whole": 5.0}, "cache": {"warm": 1.0, "whole": 6.0}}
    assert time_ratios(results) == {"cache": {"warm": 0.5, "whole": 1.2}}


def test_cpu_smoke_run_is_bitwise_and_reports_every_phase(tmp_path, capsys):
    # one group of 2 samples of 20 tokens (one full 16-token block shared), 2 new tokens
    argv = ["--device", "cpu", "--skip-latency", "--groups", "1", "--prompt-len", "20", "--new-tokens", "2"]
    assert main(argv + ["--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert "bitwise: nocache == cache == cache+chunked: True" in out
    for mode in ("nocache", "cache", "cache+chunked"):
        assert f"grpo {mode}" in out
    assert out.count("time / nocache: warm") == 2
    text = (tmp_path / "p.csv").read_text()
    assert "warm_time_vs_nocache" in text and "first_seconds" in text

"""eval/bench_layers.py: the layer configs keep their family's features, the summed
phase-time ratio is the hand-computed one, and a tiny CPU run times every phase of both
kernel sets (the Triton interpreter; its times say nothing about a GPU)."""
from __future__ import annotations

import csv

import pytest

from eval.bench_layers import KERNEL_SETS, MODELS, PHASES, layer_config, main, summarize


def test_layer_configs_are_one_layer_of_each_family():
    configs = {m: layer_config(m, tiny=False) for m in MODELS}
    assert all(c.num_hidden_layers == 1 for c in configs.values())
    assert configs["qwen3-1.7b"].hidden_size == 2048 and configs["qwen3-1.7b"].model_type == "qwen3"
    assert configs["qwen2.5-1.5b"].model_type == "qwen2" and configs["llama-3.2-1b"].head_dim == 64
    assert configs["smollm2-135m"].hidden_size == 576 and configs["smollm2-135m"].num_attention_heads == 9
    assert layer_config("llama-3.2-1b", tiny=True).hidden_size == 32


def test_summed_ratio_is_stock_sum_over_unified_sum():
    rows = [{"model": "m", "kernels": k, "phase": p, "seconds": (i + 1) * (3.0 if k == "standard" else 1.0)}
            for k in KERNEL_SETS for i, p in enumerate(PHASES)]
    rows[-1]["seconds"] = 1.0  # standard train_backward: 1 s instead of 18 s
    lines, ratios = summarize(rows)
    assert ratios["m"] == pytest.approx((3.0 * 15 + 1.0) / 21.0)
    assert "train_backward 0.17x" in lines[0]


def test_unknown_model_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["--models", "gpt-5"])
    assert "unknown model" in capsys.readouterr().err


def test_tiny_cpu_run_times_every_phase_of_both_sets(tmp_path, capsys):
    """The stock rollout phases on the compiled standard ops by default, its training phases and
    every unified phase eager (the interpreter)."""
    assert main(["--tiny", "--models", "qwen3-0.6b", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "bench_layers.csv").open()))
    assert sorted((r["kernels"], r["phase"]) for r in rows) == sorted((k, p) for k in KERNEL_SETS for p in PHASES)
    assert all(float(r["seconds"]) > 0 for r in rows)
    compiled = {(r["kernels"], r["phase"]) for r in rows if r["ops"] == "compiled"}
    assert compiled == {("standard", p) for p in PHASES if p.startswith(("prefill", "decode"))}
    assert "stock rollout ops compiled" in capsys.readouterr().out

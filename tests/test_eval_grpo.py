"""The end-to-end benchmark's arithmetic (eval/bench_grpo.py): the ratios it reports are
what the issue notes quote, so they are checked against hand-computed values."""
from __future__ import annotations

import pytest

from eval.bench_grpo import PHASES, step_rows, summarize


def history(step_seconds, recompute, tokens, reward):
    out = []
    for s, r, t, w in zip(step_seconds, recompute, tokens, reward):
        h = {"bench/step_seconds": s, "timeperf/rollout": s / 2, "timeperf/train_step": s / 4,
             "ppo_actor/n_tokens": t, "ppo_actor/n_valid_tokens": t / 2, "ppo_actor/task_reward/avg": w}
        if r:
            h["timeperf/recompute_logp"] = r
        out.append(h)
    return out


def test_summary_ratios_leave_out_the_warmup_steps():
    tik = step_rows("m", "tik", history([50.0, 2.0, 2.0], [0, 0, 0], [1000, 1000, 3000], [0.1, 0.2, 0.3]), {})
    stock = step_rows("m", "stock", history([9.0, 4.0, 6.0], [1.0, 1.0, 2.0], [1000, 1000, 1000],
                                            [0.1, 0.1, 0.1]), {})
    assert [r["step"] for r in tik] == [1, 2, 3] and tik[0]["recompute_logp_s"] == 0.0
    assert set(f"{p}_s" for p in PHASES) <= set(tik[0])
    lines = summarize(tik + stock, warmup=1)
    # steps 2-3: tik 4000 tokens in 4 s = 1000/s; stock 2000 tokens in 10 s = 200/s
    ratio_line = next(line for line in lines if line.startswith("throughput ratio"))
    assert "(tokens/s): 5.000x" in ratio_line and "step time ratio stock/tik: 2.500x" in ratio_line
    # skipping stock's recompute alone: 5.0 s -> 3.5 s per step
    assert any("3.500 s (ratio 1.429x" in line for line in lines)
    assert any(line.startswith("tik") and " 1000 " in line for line in lines)


def test_each_stock_path_gets_its_own_ratio():
    tik = step_rows("m", "tik", history([9.0, 2.0], [0, 0], [1000, 1000], [0.1, 0.1]), {})
    stock = step_rows("m", "stock", history([9.0, 4.0], [1.0, 1.0], [1000, 1000], [0.1, 0.1]), {})
    hf = step_rows("m", "stock_hf", history([9.0, 5.0], [2.0, 2.0], [1000, 1000], [0.1, 0.1]), {})
    lines = summarize(tik + stock + hf, warmup=1)
    ratios = [line for line in lines if line.startswith("throughput ratio")]
    assert ratios == ["throughput ratio tik/stock (tokens/s): 2.000x; step time ratio stock/tik: 2.000x",
                      "throughput ratio tik/stock_hf (tokens/s): 2.500x; step time ratio stock_hf/tik: 2.500x"]
    assert any("stock_hf step without recompute_logp 3.000 s (ratio 1.667x" in line for line in lines)


def test_summary_of_one_mode_has_no_ratio():
    rows = step_rows("m", "tik", history([3.0, 2.0], [0, 0], [10, 10], [0.0, 0.5]), {})
    lines = summarize(rows, warmup=1)
    assert not any(line.startswith("throughput ratio") for line in lines)
    assert summarize(rows, warmup=5)[2:] == []  # nothing left after the warm-up


@pytest.mark.parametrize("bad", ["tik,nope", "fast"])
def test_unknown_mode_is_named(bad, capsys):
    from eval.bench_grpo import main

    with pytest.raises(SystemExit):
        main(["--modes", bad])
    assert "unknown mode" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["tik", "stock", "stock_hf"])
def test_each_mode_is_the_shipped_recipe_plus_overrides(mode, tmp_path):
    # The benchmark loads recipes/*.yaml through AReaL's loader: the engine sizes land in
    # the tik: block and the mode's actor options in actor, nothing else is copied.
    from areal_tik.adapter import apply_patches
    from areal_tik.adapter.demo import load_config
    from eval.bench_grpo import MODES, build_parser, mode_overrides, recipe_for

    args = build_parser().parse_args(["--model", "tiny", "--batch-size", "3", "--n-samples", "2",
                                      "--max-model-len", "192", "--steps", "2", "--workdir", str(tmp_path)])
    with apply_patches():
        config = load_config(recipe_for("tiny"), mode_overrides(args, mode, str(tmp_path / "m"), tmp_path))
    assert (config.tik.max_num_seqs, config.tik.max_model_len) == (6, 192)
    assert config.actor.path == str(tmp_path / "m") and config.total_train_steps == 2
    assert config.actor.tik_kernels == MODES[mode]["tik_kernels"]
    assert config.actor.tik_reuse_logprobs is MODES[mode]["tik_reuse_logprobs"]
    assert config.experiment_name == f"grpo-bench-tiny-{mode}"
    # as the recipes' stock mode: one block holds a 192-token sequence, one block per sequence
    stock = mode.startswith("stock")  # both stock trainers run the stock engine
    assert (config.tik.kv_block_size, config.tik.num_kv_blocks) == ((256, 7) if stock else (64, None))
    assert config.tik.compile_standard_ops is stock  # a bool, not the string "True"
    assert config.actor.tik_training_model == ("hf" if mode == "stock_hf" else "areal_tik")

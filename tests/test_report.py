"""``areal-tik report``: pairing, refusals and the summary table against hand-computed
values from run files (old ones without the process timing too), the reward-ratio panel,
the process timing ``run_one`` writes, then (slow) the offline report built from two real
tiny CPU runs of ``areal-tik run`` (flag on and off) with its table checked against their
run files."""
from __future__ import annotations

import json
import shutil
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_tik.model.ops import COMPILED_STANDARD_OPS
from areal_tik.report.cli import add_arguments, main
from areal_tik.report.runs import load_runs, pair_runs, summary_table

REPO = Path(__file__).resolve().parents[1]


def step(i, reward, tokens, seconds):
    return {"step": i, "reward": reward, "tokens": tokens, "generated_tokens": tokens / 2,
            "step_seconds": seconds, "tokens_per_s": tokens / seconds,
            "phases": {"rollout": seconds / 2, "train_step": seconds / 2}, "tik": {"audit_passed": 1.0}}


def write_run(root: Path, mode: str, steps: list[dict], recipe="r", seed=1, digest="d", decode=None,
              compiled=(), asked=None, logprob=None, gpu="cpu", date=None, commit="abc") -> Path:
    folder = root / recipe / mode
    folder.mkdir(parents=True)
    metadata = {"commit": commit, "gpu": gpu, "kernel_set": mode, **({} if date is None else {"date": date})}
    if decode is not None:
        metadata["decode_attention"] = decode
    if compiled:
        metadata["compiled_ops"] = list(compiled)
    if logprob is not None:
        metadata["logprob"] = logprob
    (folder / "run.json").write_text(json.dumps({
        "format": 1, "recipe": recipe, "mode": mode, "seeds": {"seed": seed, "task_seed": 1},
        "steps": len(steps), "config_digest": digest, "group": f"{recipe}-seed{seed}",
        **({} if asked is None else {"config_asked": asked}),
        "metadata": metadata, "per_step": steps,
        "summary": {"verdict": "all 1 audits bitwise equal", "audited_tokens": 8}}))
    return folder


def report_args(runs, out, warmup=1):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*map(str, runs), "--out", str(out), "--warmup", str(warmup)])


def test_summary_ratios_are_the_hand_computed_ones(tmp_path):
    # tik: 100 tokens in 10 s, then 300 in 1 s + 300 in 2 s; stock: 100/10, 100/1, 100/1
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 10.0), step(2, 0.6, 300, 1.0), step(3, 0.9, 300, 2.0)])
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 10.0), step(2, 0.4, 100, 1.0), step(3, 0.0, 100, 1.0)])
    (row,), means = summary_table(pair_runs(load_runs([tmp_path])), warmup=1)
    assert row["throughput_whole"] == pytest.approx((700 / 13) / (300 / 12))
    assert row["throughput_steady"] == pytest.approx((600 / 3) / (200 / 2))
    # step 3's stock reward is 0: left out; ratios 1.0 and 1.5
    assert row["reward_ratio_steps"] == 2
    assert row["reward_ratio_mean"] == pytest.approx(1.25) and row["reward_ratio_spread"] == pytest.approx(0.25)
    # the ratio of the mean rewards (every step: (0.5 + 0.6 + 0.9) / 3 over (0.5 + 0.4 + 0) / 3); the stock
    # mean 0.3 has a standard error sqrt(0.07 / 3) = 0.153, within 3 of them of 0: no error is quoted
    assert row["reward_ratio_of_means"] == pytest.approx((2 / 3) / 0.3)
    assert math.isnan(row["reward_ratio_of_means_se"]) and math.isnan(row["reward_ratio_of_means_se_unpaired"])
    assert means["throughput_whole"] == row["throughput_whole"] and means["paper_throughput"] == 1.10


def test_paired_steps_narrow_the_error_when_the_runs_move_together():
    """Two runs that share each step's prompts: the step-to-step swing both runs see cancels in
    the paired error, not in the unpaired one; identical runs have ratio 1 with zero paired
    error; a step without a reward in either run drops out of both means; and the pooled
    ratio over recipes weights each by its inverse variance."""
    from areal_tik.report.runs import pooled_ratio, reward_ratio_of_means

    # by hand: the delta method's terms, unpaired and paired (here the rewards move against each
    # other, a negative covariance, so pairing widens the error)
    a, b = [0.5, 0.6, 0.9, 0.8], [0.5, 0.4, 0.3, 0.4]
    ma, mb = 0.7, 0.4
    va = (0.04 + 0.01 + 0.04 + 0.01) / 3
    vb = (0.01 + 0.0 + 0.01 + 0.0) / 3
    cov = (-0.2 * 0.1 + -0.1 * 0.0 + 0.2 * -0.1 + 0.1 * 0.0) / 3
    got = reward_ratio_of_means({"per_step": [{"reward": x} for x in a]}, {"per_step": [{"reward": x} for x in b]})
    assert got.ratio == pytest.approx(ma / mb)
    assert got.se_unpaired == pytest.approx(ma / mb * math.sqrt((va / ma ** 2 + vb / mb ** 2) / 4))
    assert got.se == pytest.approx(ma / mb * math.sqrt((va / ma ** 2 + vb / mb ** 2 - 2 * cov / (ma * mb)) / 4))
    assert got.se > got.se_unpaired and got.step_correlation == pytest.approx(cov / math.sqrt(va * vb))
    swing = [0.1, 0.5, 0.2, 0.6, 0.3]  # easy and hard batches
    tik = {"per_step": [{"reward": r + 0.01 * (i % 2)} for i, r in enumerate(swing)]}
    stock = {"per_step": [{"reward": r} for r in swing]}
    got = reward_ratio_of_means(tik, stock)
    assert got.step_correlation > 0.99 and got.se < got.se_unpaired / 10
    same = reward_ratio_of_means(stock, stock)
    assert same.ratio == 1.0 and same.se == 0.0 and same.se_unpaired > 0
    holed = {"per_step": [{"reward": float("nan")}, *stock["per_step"][1:]]}
    assert reward_ratio_of_means(tik, holed).ratio == pytest.approx(sum(r + 0.01 * (i % 2) for i, r in enumerate(swing) if i)
                                                                      / sum(swing[1:]))
    assert math.isnan(reward_ratio_of_means({"per_step": [{"reward": 0.0}] * 3}, stock).ratio)
    # one lucky sample in each run, at the same step: a ratio, but no error to quote (not a zero one)
    lucky = lambda r: {"per_step": [{"reward": 0.0}] * 9 + [{"reward": r}]}  # noqa: E731
    one = reward_ratio_of_means(lucky(0.02), lucky(0.01))
    assert one.ratio == pytest.approx(2.0) and math.isnan(one.se) and math.isnan(one.se_unpaired)
    # a mean 1.4 of its standard errors from 0 gets none, one 5 of them away does
    edge = {"per_step": [{"reward": r} for r in (0.0, 0.0, 3.0, 1.0)]}  # mean 1, sample var 2, n 4: se 0.707
    assert math.isnan(reward_ratio_of_means(edge, edge).se)
    steady = {"per_step": [{"reward": r} for r in (1.0, 1.0, 1.0, 2.0)]}  # se/m = 0.25/1.25 = 0.2
    assert reward_ratio_of_means(steady, steady).se == 0.0
    rows = [{"reward_ratio_of_means": 1.1, "reward_ratio_of_means_se": 0.1},
            {"reward_ratio_of_means": 0.9, "reward_ratio_of_means_se": 0.05},
            {"reward_ratio_of_means": 5.0, "reward_ratio_of_means_se": float("nan")}]
    pooled, se, count = pooled_ratio(rows)  # weights 100 and 400; the row without an error left out
    assert pooled == pytest.approx((100 * 1.1 + 400 * 0.9) / 500) and se == pytest.approx(1 / math.sqrt(500))
    assert count == 2
    nothing = pooled_ratio(rows[2:])
    assert math.isnan(nothing[0]) and math.isnan(nothing[1]) and nothing[2] == 0


@pytest.mark.parametrize("field, tik_kw, stock_kw, named", [
    ("recipe", {"recipe": "a"}, {"recipe": "b"}, "has no stock run of the same recipe"),
    ("seeds", {"seed": 1}, {"seed": 2}, "different seeds"),
    ("digest", {"digest": "x"}, {"digest": "y"}, "different config"),
])
def test_an_incomparable_pair_is_refused_naming_the_difference(tmp_path, field, tik_kw, stock_kw, named):
    tik = write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], **tik_kw)
    stock = write_run(tmp_path, "stock", [step(1, 0.5, 100, 1.0)], **stock_kw)
    with pytest.raises(ValueError, match=named) as info:
        main(report_args([tik, stock], tmp_path / "out"))
    if field == "recipe":
        assert "recipe a" in str(info.value) and "recipe b" in str(info.value)


def test_a_config_refusal_names_the_fields_that_differ_when_the_run_files_keep_them(tmp_path):
    """A field one run's code had and the other's did not shows as '-' on the other side; run
    files that keep no fields (written before they did) are named instead."""
    asked = {"actor.lr": "1e-06", "tik.max_num_seqs": "64"}
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], digest="x", asked=asked)
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 1.0)], digest="y",
              asked={**asked, "actor.lr": "2e-06", "tik.compile_standard_ops": "false"})
    with pytest.raises(ValueError, match=r"different config .*fields that differ .*: actor\.lr \(tik 1e-06, "
                                         r"stock 2e-06\), tik\.compile_standard_ops \(tik -, stock false\)$"):
        main(report_args([tmp_path], tmp_path / "out"))
    write_run(tmp_path / "old", "tik", [step(1, 0.5, 100, 1.0)], digest="x")
    write_run(tmp_path / "old", "stock", [step(1, 0.5, 100, 1.0)], digest="y", asked=asked)
    with pytest.raises(ValueError, match="no fields of the recipe as asked in the tik run file"):
        main(report_args([tmp_path / "old"], tmp_path / "out"))


def test_different_steps_are_refused(tmp_path):
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0), step(2, 0.5, 100, 1.0)])
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 1.0)])
    with pytest.raises(ValueError, match="different steps: tik 2 .* vs stock 1"):
        main(report_args([tmp_path], tmp_path / "out"))


def table_cells(page: str) -> list[list[str]]:
    table = re.search(r"<table id='summary'>(.*?)</table>", page).group(1)
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table)[1:]]


def expected_ratio(tik: dict, stock: dict, first: int) -> float:
    rate = lambda run: (sum(s["tokens"] for s in run["per_step"][first:])  # noqa: E731
                        / sum(s["step_seconds"] for s in run["per_step"][first:]))
    return rate(tik) / rate(stock)


@pytest.mark.slow
def test_offline_report_of_two_tiny_cpu_runs(tmp_path):
    # ~3.5 min on the shared 2-core CPU machine (user time 70 s): the tik run's training
    # step on the Triton interpreter is most of it; one step of 2x2 samples of 2 tokens.
    # The checkpoint is missing: the tik run (first) writes it, the stock run finds it.
    model = tmp_path / "tiny"
    overrides = [f"++actor.path={model}", "++total_train_steps=1", "++train_dataset.batch_size=2",
                 "++gconfig.n_samples=2", "++gconfig.max_new_tokens=2", "++task.size=16",
                 "++task.instruction=", "++task.reward=areal_tik.adapter.tasks.shaped_reward_fn"]
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "areal_tik.cli", "run", "--recipe", "chain_sum_grpo_tiny_cpu",
                           "--mode", "both", "--out", str(runs), *overrides], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tik, stock = (json.loads((runs / "chain_sum_grpo_tiny_cpu" / m / "run.json").read_text())
                  for m in ("tik", "stock"))
    assert tik["group"] == stock["group"] and tik["config_digest"] == stock["config_digest"]
    assert tik["config_asked"] == stock["config_asked"] and tik["config_asked"]["total_train_steps"] == "1"
    assert tik["metadata"]["kernel_set"] == "unified" and stock["metadata"]["kernel_set"] == "standard"
    assert tik["summary"]["reuse_active"] and not stock["summary"]["reuse_active"]
    assert tik["per_step"][0]["phases"]["recompute_logp"] == 0.0 < stock["per_step"][0]["phases"]["recompute_logp"]
    assert tik["per_step"][0]["tik"]["audit_passed"] == 1.0
    assert tik["checkpoint_seconds"] > 0 and stock["checkpoint_seconds"] == 0.0
    for run in (tik, stock):  # the process outside its steps: AReaL init, model load, warm-up
        steps = sum(s["step_seconds"] for s in run["per_step"])
        assert run["process_seconds"] > run["checkpoint_seconds"] + steps > 0
        assert run["startup_seconds"] == pytest.approx(
            run["process_seconds"] - run["checkpoint_seconds"] - steps, rel=0, abs=1e-9)
    for mode, run in (("tik", tik), ("stock", stock)):  # the offline W&B run of each mode
        (wandb_file,) = (runs / "chain_sum_grpo_tiny_cpu" / mode).rglob("*.wandb")
        logged = wandb_file.read_bytes()
        for needle in ("areal_tik", run["group"], f"chain_sum_grpo_tiny_cpu-{mode}", "tik_run/tokens_per_s",
                       "timeperf/rollout", "ppo_actor/task_reward/avg", "tik/reuse_active",
                       run["metadata"]["commit"], run["metadata"]["kernel_set"]):
            assert needle.encode() in logged, (mode, needle)

    out = tmp_path / "report"
    assert main(report_args([runs], out, warmup=0)) == 0
    page = (out / "index.html").read_text()
    (row, mean, real_mean, paper) = table_cells(page)
    assert real_mean[5] == "n/a"  # no real-weight recipe among the tiny CPU runs
    assert row[0] == "chain_sum_grpo_tiny_cpu" and row[1] == "1"
    assert row[2] == f"{expected_ratio(tik, stock, 0):.3f}x" == row[3] == mean[2]
    rate = lambda run: (sum(s["tokens"] for s in run["per_step"])  # noqa: E731
                        / (run["process_seconds"] - run["checkpoint_seconds"]))
    process = rate(tik) / rate(stock)
    assert row[4] == f"{process:.3f}x" == mean[4]
    rewards = (tik["per_step"][0]["reward"], stock["per_step"][0]["reward"])
    assert row[5] == (f"{rewards[0] / rewards[1]:.3f}x" if rewards[1] else "n/a")
    assert row[7] == tik["summary"]["verdict"] and paper[2] == "1.100x" and paper[5] == "1.000x"
    assert tik["metadata"]["decode_attention"] == "unified"
    assert stock["metadata"]["decode_attention"] == "gather-sdpa (not on a GPU)"
    assert stock["metadata"]["compiled_ops"] == list(COMPILED_STANDARD_OPS) and tik["metadata"]["compiled_ops"] == []
    assert tik["metadata"]["logprob"] == "unified" and stock["metadata"]["logprob"] == "chunked-eager (1024 rows)"
    assert row[8] == "gather-sdpa (not on a GPU) + torch.compile; log-prob chunked-eager"
    assert row[9] == "n/a +/- n/a (n/a)"  # one step: no spread to give an error, paired or not
    assert "These means mix" not in page
    assert (out / "chain_sum_grpo_tiny_cpu.png").stat().st_size > 10_000
    assert "Runs on a CPU" in page  # the interpreted kernels' throughput is flagged
    summary = json.loads((out / "summary.json").read_text())
    assert math.isclose(summary["rows"][0]["throughput_whole"], expected_ratio(tik, stock, 0))


def test_the_cpu_note_follows_the_runs_device(tmp_path):
    steps = [step(1, 0.5, 100, 1.0), step(2, 0.5, 100, 1.0)]
    for gpu, expected in (("cpu", True), ("NVIDIA H200", False)):
        root = tmp_path / gpu
        for mode in ("tik", "stock"):
            run = json.loads((write_run(root, mode, steps) / "run.json").read_text())
            run["metadata"]["gpu"] = gpu
            (root / "r" / mode / "run.json").write_text(json.dumps(run))
        assert main(report_args([root], root / "report")) == 0
        assert ("Runs on a CPU" in (root / "report" / "index.html").read_text()) == expected, gpu


def test_a_stock_run_reads_the_rewards_of_its_tik_run(tmp_path):
    from areal_tik.adapter.run import paired_rewards

    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0), step(2, 0.75, 100, 1.0)], digest="same")
    stock_folder = tmp_path / "r" / "stock"
    assert paired_rewards(stock_folder, "stock", "same") == [0.5, 0.75]
    assert paired_rewards(stock_folder, "stock", "other") == []  # another config: no ratio
    assert paired_rewards(tmp_path / "r" / "tik", "tik", "same") == []


def timed_run(root: Path, mode: str, steps: list[dict], process: float, checkpoint: float, **kw) -> Path:
    folder = write_run(root, mode, steps, **kw)
    run = json.loads((folder / "run.json").read_text())
    run.update(process_seconds=process, checkpoint_seconds=checkpoint,
               startup_seconds=process - checkpoint - sum(s["step_seconds"] for s in steps))
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_whole_process_ratio_is_the_hand_computed_one_and_old_files_give_na(tmp_path):
    # recipe a: tik 700 tokens, 20 s of process of which 5 s wrote the checkpoint; stock
    # 300 tokens in 14 s. recipe b: run files written before the process timing existed.
    timed_run(tmp_path, "tik", [step(1, 0.5, 100, 10.0), step(2, 0.6, 600, 3.0)], 20.0, 5.0, recipe="a")
    timed_run(tmp_path, "stock", [step(1, 0.5, 100, 10.0), step(2, 0.4, 200, 2.0)], 14.0, 0.0, recipe="a")
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], recipe="b")
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 2.0)], recipe="b")
    (a, b), means = summary_table(pair_runs(load_runs([tmp_path])), warmup=1)
    assert a["throughput_process"] == pytest.approx((700 / 15) / (300 / 14))
    assert a["throughput_whole"] == pytest.approx((700 / 13) / (300 / 12))  # unchanged beside it
    assert (a["startup_seconds_tik"], a["startup_seconds_stock"]) == (2.0, 2.0)
    assert math.isnan(b["throughput_process"]) and math.isnan(b["startup_seconds_tik"])
    assert b["throughput_whole"] == pytest.approx(2.0)  # old files still report the rest
    assert means["throughput_process"] == a["throughput_process"] and means["throughput_process_configurations"] == 1

    out = tmp_path / "out"
    assert main(report_args([tmp_path], out)) == 0
    page = (out / "index.html").read_text()
    row_a, row_b, mean, real_mean, paper = table_cells(page)
    assert real_mean[0].startswith("mean over the 0 real-weight configurations")
    assert row_a[4] == f"{(700 / 15) / (300 / 14):.3f}x" and row_b[4] == "n/a"
    assert mean[4] == f"{(700 / 15) / (300 / 14):.3f}x (over 1)" and paper[4] == "" and paper[5] == "1.000x"
    assert "tik 2.0 s of 20.0 s (and 5.0 s writing the checkpoint, not counted); stock 2.0 s of 14.0 s" in page
    assert "tik n/a (no process timing in its run file)" in page
    assert "whole process: all tokens over the process's wall time" in page
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"][0]["throughput_process"] == pytest.approx((700 / 15) / (300 / 14))
    assert math.isnan(summary["rows"][1]["throughput_process"])
    assert summary["means"]["throughput_process"] == pytest.approx((700 / 15) / (300 / 14))


def test_the_ratio_panel_says_so_when_no_stock_reward_is_non_zero(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from areal_tik.report.page import NO_RATIO, draw_reward_ratio, plot_pair
    from areal_tik.report.runs import Pair

    def pair(stock_rewards):
        tik = {"mode": "tik", "per_step": [step(i, 0.5, 100, 1.0) for i in (1, 2, 3)]}
        stock = {"mode": "stock", "per_step": [step(i, r, 100, 1.0) for i, r in enumerate(stock_rewards, start=1)]}
        return Pair("r", tik, stock)

    fig, (empty, drawn) = plt.subplots(1, 2)
    draw_reward_ratio(empty, pair([0.0, 0.0, 0.0]))
    draw_reward_ratio(drawn, pair([0.0, 0.25, 0.5]))
    assert [t.get_text() for t in empty.texts] == [NO_RATIO] and not empty.lines
    assert list(drawn.texts) == []
    ratio_line = drawn.lines[0]
    assert list(ratio_line.get_xdata()) == [1, 2, 3]
    assert math.isnan(ratio_line.get_ydata()[0]) and list(ratio_line.get_ydata()[1:]) == [2.0, 1.0]
    plt.close(fig)
    assert plot_pair(pair([0.0, 0.0, 0.0]), tmp_path / "r.png").stat().st_size > 10_000


def test_run_one_writes_the_process_and_checkpoint_seconds(tmp_path, spmd_env, monkeypatch):
    # The training is a stand-in (0.3 s, two steps of 0.1 s and 0.15 s); config loading and
    # writing the checkpoint are the real ones, each made 0.2 s slower so the test sees
    # which part of the process each number covers.
    import time

    from areal_tik.adapter import demo, run
    from areal_tik.model import checkpoints

    def slower(fn):
        def wrapped(*args, **kwargs):
            time.sleep(0.2)
            return fn(*args, **kwargs)
        return wrapped

    class State:
        def summary(self):
            return {"verdict": "none"}

    def train(config, metadata, tik_rewards=()):
        time.sleep(0.3)
        return [{"bench/step_seconds": 0.1, "ppo_actor/n_tokens": 10.0},
                {"bench/step_seconds": 0.15, "ppo_actor/n_tokens": 20.0}], State()

    monkeypatch.setattr(demo, "load_config", slower(demo.load_config))
    monkeypatch.setattr(checkpoints, "make_tiny_checkpoint", slower(checkpoints.make_tiny_checkpoint))
    monkeypatch.setattr(run, "train_tracked", train)
    model = tmp_path / "tiny"
    overrides = [f"++actor.path={model}"]
    recipe = "chain_sum_grpo_tiny_cpu"
    first = json.loads(run.run_one(recipe, "tik", tmp_path / "runs", "g", overrides).read_text())
    assert (model / "config.json").is_file()  # the first run wrote the missing checkpoint
    second = json.loads(run.run_one(recipe, "stock", tmp_path / "runs", "g", overrides).read_text())
    assert first["checkpoint_seconds"] >= 0.2 and second["checkpoint_seconds"] == 0.0
    for record in (first, second):
        # two config loads (0.4 s) and the training (0.3 s) besides the checkpoint
        assert record["process_seconds"] - record["checkpoint_seconds"] >= 0.7
        assert record["startup_seconds"] == pytest.approx(
            record["process_seconds"] - record["checkpoint_seconds"] - 0.25, rel=0, abs=1e-12)


def test_the_reward_ratio_target_is_averaged_over_the_real_weight_recipes_only(tmp_path):
    # a random-weight recipe whose stock run got one lucky reward: ratio 0 there
    write_run(tmp_path, "tik", [step(1, 0.0, 100, 1.0)], recipe="basic_arithmetic_drgrpo_qwen2_5_1_5b")
    write_run(tmp_path, "stock", [step(1, 0.1, 100, 1.0)], recipe="basic_arithmetic_drgrpo_qwen2_5_1_5b")
    write_run(tmp_path, "tik", [step(1, 0.6, 100, 1.0)], recipe="basic_arithmetic_grpo_smollm2")
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 1.0)], recipe="basic_arithmetic_grpo_smollm2")
    rows, means = summary_table(pair_runs(load_runs([tmp_path])), warmup=0)
    assert {r["recipe"]: r["real_weights"] for r in rows} == {
        "basic_arithmetic_drgrpo_qwen2_5_1_5b": False, "basic_arithmetic_grpo_smollm2": True}
    assert means["reward_ratio_mean"] == pytest.approx(0.6)  # (0 + 1.2) / 2
    assert means["reward_ratio_mean_real"] == pytest.approx(1.2)
    assert means["reward_ratio_real_configurations"] == 1


def test_a_mean_over_stock_runs_on_different_paths_says_so(tmp_path):
    """Each row names its stock run's path: decode attention and training log-prob (a run
    file without a field ran what the standard set then had: the gather decode, the log-prob
    materialised in fp32); means over rows on different paths carry a note on the page,
    since the stock baseline differs between them."""
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], recipe="a", decode="unified")
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 2.0)], recipe="a", decode="flash-seqused")
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], recipe="b")
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 3.0)], recipe="b")
    write_run(tmp_path, "tik", [step(1, 0.5, 100, 1.0)], recipe="c", decode="unified")
    write_run(tmp_path, "stock", [step(1, 0.5, 100, 1.5)], recipe="c", decode="flash-seqused", compiled=["rms_norm"],
              logprob="areal-gather-chunked (torch.compile, 1024 rows)")
    rows, means = summary_table(pair_runs(load_runs([tmp_path])), warmup=0)
    assert {r["recipe"]: r["stock_decode"] for r in rows} == {
        "a": "flash-seqused; log-prob materialised-fp32", "b": "gather-sdpa; log-prob materialised-fp32",
        "c": "flash-seqused + torch.compile; log-prob areal-gather-chunked"}
    assert means["stock_decode_paths"] == ["flash-seqused + torch.compile; log-prob areal-gather-chunked",
                                           "flash-seqused; log-prob materialised-fp32",
                                           "gather-sdpa; log-prob materialised-fp32"]
    by_path = means["by_stock_path"]  # tik 1 s a step against stock 2.0 (a), 3.0 (b), 1.5 (c)
    assert {p: (m["configurations"], m["throughput_whole"]) for p, m in by_path.items()} == {
        "flash-seqused + torch.compile; log-prob areal-gather-chunked": (1, 1.5),
        "flash-seqused; log-prob materialised-fp32": (1, 2.0), "gather-sdpa; log-prob materialised-fp32": (1, 3.0)}
    out = tmp_path / "report"
    assert main(report_args([tmp_path], out, warmup=0)) == 0
    page = (out / "index.html").read_text()
    mean_rows = [cells for cells in table_cells(page) if cells[0].startswith("mean over the 1 with stock path")]
    assert [(r[0].split("path ")[1], r[2]) for r in mean_rows] == [
        ("flash-seqused + torch.compile; log-prob areal-gather-chunked", "1.500x"),
        ("flash-seqused; log-prob materialised-fp32", "2.000x"), ("gather-sdpa; log-prob materialised-fp32", "3.000x")]
    assert ("These means mix stock runs on different paths (flash-seqused + torch.compile; log-prob "
            "areal-gather-chunked, flash-seqused; log-prob materialised-fp32, gather-sdpa; log-prob "
            "materialised-fp32;") in page
    only_a = tmp_path / "only_a"
    shutil.copytree(tmp_path / "a", only_a / "a")
    assert main(report_args([only_a], tmp_path / "report_a", warmup=0)) == 0
    assert "These means mix" not in (tmp_path / "report_a" / "index.html").read_text()
    assert "by_stock_path" not in json.loads((tmp_path / "report_a" / "summary.json").read_text())["means"]


def test_latest_keeps_the_newest_comparable_pair_of_each_recipe_and_names_the_rest(tmp_path, capsys):
    """``--latest`` over folders of several sessions: one row per recipe, its newest pair (by
    the tik run's date); older pairs, a run without its partner and a pair whose configs differ
    are left out with the reason; the end-to-end recipes with no pair are named; the GPU and
    commit of each row are shown, and a note says when the means mix GPUs."""
    steps = lambda seconds: [step(1, 0.5, 100, seconds)]  # noqa: E731
    recipe = "basic_arithmetic_grpo_smollm2"
    old, new, lone, odd = (tmp_path / f"session{i}" / "runs" for i in range(4))
    write_run(old, "tik", steps(1.0), recipe=recipe, gpu="NVIDIA H200", date="2026-12-02T10:00:00+00:00")
    write_run(old, "stock", steps(4.0), recipe=recipe, gpu="NVIDIA H200", date="2026-12-02T10:05:00+00:00")
    write_run(new, "tik", steps(1.0), recipe=recipe, gpu="NVIDIA H100", date="2026-12-07T00:31:00+00:00", commit="new")
    write_run(new, "stock", steps(2.0), recipe=recipe, gpu="NVIDIA H100", date="2026-12-07T00:36:00+00:00", commit="new")
    write_run(lone, "tik", steps(1.0), recipe="gsm_symbolic_grpo_qwen3_0_6b", gpu="NVIDIA H200")
    write_run(odd, "tik", steps(1.0), recipe="chain_sum_async_dapo_qwen3_1_7b", gpu="NVIDIA H200", digest="x")
    write_run(odd, "stock", steps(3.0), recipe="chain_sum_async_dapo_qwen3_1_7b", gpu="NVIDIA H200", digest="y")
    write_run(old, "tik", steps(1.0), recipe="basic_arithmetic_grpo_llama3_2_1b", gpu="NVIDIA H200")
    write_run(old, "stock", steps(3.0), recipe="basic_arithmetic_grpo_llama3_2_1b", gpu="NVIDIA H200")
    refusal = "two (tik|stock) runs of recipe basic_arithmetic_grpo_smollm2: .*; pass one of each mode per recipe, or --latest"
    with pytest.raises(ValueError, match=refusal):
        main(report_args([tmp_path], tmp_path / "plain", warmup=0))  # without --latest: refused
    out = tmp_path / "report"
    assert main(_latest_args(tmp_path, out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["recipe"]: r for r in summary["rows"]}
    assert sorted(rows) == ["basic_arithmetic_grpo_llama3_2_1b", recipe]
    assert rows[recipe]["throughput_whole"] == pytest.approx(2.0)  # the newest pair's, not 4.0
    assert rows[recipe]["run"] == "NVIDIA H100, new"
    assert rows["basic_arithmetic_grpo_llama3_2_1b"]["run"] == "NVIDIA H200, abc"
    left = summary["means"]["left_out"]
    assert len(left) == 3
    assert any(str(old / recipe) in line and "an older pair" in line for line in left)
    assert any("gsm_symbolic_grpo_qwen3_0_6b: only a tik run" in line for line in left)
    assert any("chain_sum_async_dapo_qwen3_1_7b: not a comparable pair: different config" in line for line in left)
    from areal_tik.adapter.recipes import END_TO_END
    missing = summary["means"]["recipes_without_pair"]
    assert missing == [n for n in END_TO_END if n not in rows] and len(missing) == len(END_TO_END) - 2
    assert summary["means"]["gpus"] == ["NVIDIA H100", "NVIDIA H200"]
    page = (out / "index.html").read_text()
    assert "These means mix pairs measured on different GPUs (NVIDIA H100, NVIDIA H200)" in page
    assert f"{len(missing)} of the end-to-end recipes have no comparable pair here" in page
    assert page.count("<li class='note'>") == 3 and "only a tik run</li>" in page
    assert "<td>NVIDIA H100, new</td>" in page
    printed = capsys.readouterr().out
    assert printed.count("left out: ") == 3 and "no pair of: " in printed


def test_latest_pools_the_reward_ratio_over_every_replicate_too(tmp_path, capsys):
    """``--latest`` keeps the newest pair of a recipe for its rows (throughput moves with the
    code), but a superseded comparable pair of a real-weight recipe is one more replicate of
    its reward ratio: the replicates line pools both, by hand; a non-comparable pair is not one."""
    from areal_tik.report.runs import pooled_ratio, reward_ratio_of_means

    recipe = "basic_arithmetic_grpo_smollm2"
    rewards = {"old": ([0.2, 0.4, 0.3, 0.5], [0.2, 0.3, 0.3, 0.4]), "new": ([0.3, 0.5, 0.4, 0.6], [0.3, 0.5, 0.3, 0.5])}
    runs = {}
    for i, (name, (tik, stock)) in enumerate(rewards.items()):
        root = tmp_path / name / "runs"
        date = f"2026-12-0{i + 2}T10:00:00+00:00"
        runs[name] = [json.loads((write_run(root, mode, [step(j, r, 100, 1.0) for j, r in enumerate(values)],
                                            recipe=recipe, date=date) / "run.json").read_text())
                      for mode, values in (("tik", tik), ("stock", stock))]
    odd = tmp_path / "odd" / "runs"
    write_run(odd, "tik", [step(j, 0.9, 100, 1.0) for j in range(4)], recipe=recipe, digest="x")
    write_run(odd, "stock", [step(j, 0.1, 100, 1.0) for j in range(4)], recipe=recipe, digest="y")
    out = tmp_path / "report"
    assert main(_latest_args(tmp_path, out)) == 0
    means = json.loads((out / "summary.json").read_text())["means"]
    each = [reward_ratio_of_means(*runs[name]) for name in ("old", "new")]
    want = pooled_ratio([{"reward_ratio_of_means": e.ratio, "reward_ratio_of_means_se": e.se} for e in each])
    assert want[2] == 2 and means["reward_ratio_of_means_real_replicates_configurations"] == 2
    assert means["reward_ratio_of_means_real_replicates"] == pytest.approx(want[0])
    assert means["reward_ratio_of_means_real_replicates_se"] == pytest.approx(want[1])
    assert means["reward_ratio_of_means_real_pooled"] == pytest.approx(each[1].ratio)  # the newest alone
    assert means["reward_ratio_of_means_real_pooled_configurations"] == 1
    assert "superseded ones included: 2 pooled" in capsys.readouterr().out
    assert "replicates of the reward ratio" in (out / "index.html").read_text()


def _latest_args(runs, out):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([str(runs), "--out", str(out), "--warmup", "0", "--latest"])

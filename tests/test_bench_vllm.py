"""eval/bench_vllm.py without vLLM: arguments, the bit comparison, the table from a results
file, and the vLLM process answering for a site without vLLM (a real subprocess)."""
import json

import pytest
import torch

from areal_tik import consistency
from areal_tik.engine import GenerationOutput
from eval import bench_vllm
from tests._engine_utils import hf_small, prompts_of, unified  # noqa: F401  (fixtures)


def test_defaults_are_the_issue_grid_cheapest_first():
    args = bench_vllm.parse_args([])
    assert args.shapes == [(1, 256), (16, 256), (64, 256), (256, 256),
                           (1, 1024), (16, 1024), (64, 1024), (256, 1024)]
    assert args.compare_shape == (64, 256) and args.modes == ["default", "batch_invariant"]


@pytest.mark.parametrize("text", ["64", "64x", "x256", "0x256", "64x-1", "ax2"])
def test_bad_shape_is_named(text):
    with pytest.raises(ValueError, match=repr(text)):
        bench_vllm.parse_shape(text)


def test_compare_shape_must_be_run(capsys):
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--shapes", "1x8", "--compare-shape", "2x8"])
    assert "--compare-shape (2, 8) is not among --shapes" in capsys.readouterr().err


def test_comparison_counts_the_bits_against_the_packed_forward(unified):  # noqa: F811
    prompts, tokens = prompts_of([5, 3], seed=1), prompts_of([3, 4], seed=2)
    outputs = [GenerationOutput(prompt_ids=p, token_ids=t, logprobs=[0.0] * len(t), versions=[0] * len(t),
                                finish_reason="length") for p, t in zip(prompts, tokens)]
    reference = [row.float().tolist() for row in consistency.packed_logprobs(unified, outputs)]
    # the "vLLM" log-probs: the training forward's own, but one value one ulp off
    recorded = [list(row) for row in reference]
    value = torch.tensor(recorded[1][2], dtype=torch.float32)
    recorded[1][2] = torch.nextafter(value, torch.zeros_like(value)).item()  # one fp32 ulp
    assert recorded[1][2] != reference[1][2]
    bits = bench_vllm.compare_sample(unified, {"prompts": prompts, "token_ids": tokens, "logprobs": recorded})
    assert (bits["tokens"], bits["identical"]) == (7, 6)
    assert bits["fraction"] == pytest.approx(6 / 7) and 0 < bits["max_abs_delta"] < 1e-5


def fake_report():
    runs = lambda *sec: [{"batch": b, "new_tokens": n, "seconds": s}  # noqa: E731
                         for (b, n), s in zip([(1, 256), (64, 256)], sec)]
    return {"model": "qwen3-0.6b", "device": "NVIDIA H200", "prompt_len": 128, "shapes": [[1, 256], [64, 256]],
            "results": {
                "vllm": {"mode": "default", "startup_s": 61.5, "warmup_s": 1.0, "runs": runs(2.0, 4.0),
                         "skipped": [], "bits": {"tokens": 16384, "identical": 164, "fraction": 0.01,
                                                 "max_abs_delta": 0.03}},
                "vllm_bi": {"mode": "batch_invariant", "error": "ModuleNotFoundError: No module named 'vllm'"},
                "areal_tik": {"mode": "areal_tik", "startup_s": 20.0, "warmup_s": 9.0, "runs": runs(1.0),
                              "skipped": [[64, 256]], "bits": {"tokens": 16384, "identical": 16384,
                                                              "fraction": 1.0, "max_abs_delta": 0.0}}}}


def test_table_from_a_results_file(tmp_path, capsys):
    path = tmp_path / "bench_vllm.json"
    path.write_text(json.dumps(fake_report()))
    bench_vllm.main(["--from-json", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert "vLLM batch-inv.: not available (ModuleNotFoundError: No module named 'vllm'); column skipped" in lines
    row1 = next(line for line in lines if line.split()[:2] == ["1", "256"]).split()
    assert row1 == ["1", "256", "128", "256", "2.00"]            # 256/2 s, 256/1 s, tik 2x vLLM
    row64 = next(line for line in lines if line.split()[:2] == ["64", "256"]).split()
    assert row64 == ["64", "256", "4096", "skipped", "-"]        # no made-up areal-tik number
    assert any("vLLM: 164/16384 sampled-token log-probs equal" in line and "(1.00%)" in line for line in lines)
    assert any(line.startswith("areal-tik: start-up 20.0 s, warm-up 9.0 s; shapes left out") for line in lines)
    rows = bench_vllm.csv_rows(fake_report(), {"device": "NVIDIA H200"})
    assert {r["backend"] for r in rows} == {"vLLM", "areal-tik"}
    assert [r["value"] for r in rows if r["metric"] == "logprobs_bit_identical"] == [0.01, 1.0]


def test_missing_vllm_site_skips_the_column(tmp_path):
    args = bench_vllm.parse_args(["--vllm-site", str(tmp_path / "absent"), "--workdir", str(tmp_path)])
    result = bench_vllm.run_vllm("default", {}, args)
    assert "error" in result and "not found" in result["error"]


def test_site_without_vllm_answers_with_the_import_error(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    args = bench_vllm.parse_args(["--vllm-site", str(site), "--workdir", str(tmp_path)])
    spec = {"model_dir": str(tmp_path), "shapes": [[1, 4]], "prompts": [[5, 6]], "seed": 0,
            "compare_shape": [1, 4], "budget_s": 10.0}
    result = bench_vllm.run_vllm("batch_invariant", spec, args)
    assert result["mode"] == "batch_invariant"
    assert result["error"] == "ModuleNotFoundError: No module named 'vllm'"


def test_bytes_bound_sums_every_decode_step():
    config = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 1024,
              "num_hidden_layers": 28}
    read = bench_vllm.read_bytes(config, weight_bytes=10**9)
    assert read["kv_per_token"] == 2 * 28 * 8 * 128 * 2          # K and V, bf16, every layer
    batch, new, prompt = 3, 5, 7
    # step i reads all weights and the K/V of each sequence's prompt + i earlier tokens
    slow = sum(10**9 + batch * (prompt + i) * read["kv_per_token"] for i in range(new))
    assert bench_vllm.bound_seconds(read, batch, new, prompt) == slow / (bench_vllm.PEAK_TBPS * 1e12)


def test_table_reports_each_backend_against_the_bound(tmp_path, capsys):
    report = fake_report()
    report["read_bytes"] = {"weights": 2 * 10**9, "kv_per_token": 0, "peak_tbps": 2.0}  # 1 ms a step
    path = tmp_path / "bench_vllm.json"
    path.write_text(json.dumps(report))
    bench_vllm.main(["--from-json", str(path)])
    row1 = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["1", "256"]).split()
    assert row1 == ["1", "256", "128", "256", "2.00", "1.000", "7.81", "3.91"]  # 2 s and 1 s vs 0.256 s
    rows = bench_vllm.csv_rows(report, {"device": "NVIDIA H200"})
    assert [r["value"] for r in rows if r["metric"] == "x_bytes_bound" and r["batch"] == 1] == [7.812, 3.906]


def test_separate_projections_column_and_ratio(tmp_path, capsys):
    report = fake_report()
    report["results"]["areal_tik_separate"] = {
        "mode": "areal_tik_separate", "startup_s": 25.0, "warmup_s": 9.0, "skipped": [],
        "runs": [{"batch": 1, "new_tokens": 256, "seconds": 1.5}, {"batch": 64, "new_tokens": 256, "seconds": 3.0}]}
    path = tmp_path / "bench_vllm.json"
    path.write_text(json.dumps(report))
    bench_vllm.main(["--from-json", str(path)])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["batch", "new"])
    assert "tik/separate" in header
    row1 = next(line for line in lines if line.split()[:2] == ["1", "256"]).split()
    assert row1[-1] == "1.50"  # separate 1.5 s over fused 1.0 s
    assert bench_vllm.parse_args(["--engine-separate"]).engine_separate


def whole_run_report():
    """Three shapes; areal-tik skipped 64x256, so every mode's whole run covers 1x256 and 4x512
    (256 + 2048 = 2304 tokens); vLLM batch-inv. failed and is no compared mode."""
    runs = lambda **sec: [{"batch": int(k[1:].split("_")[0]), "new_tokens": int(k.split("_")[1]),  # noqa: E731
                           "seconds": s} for k, s in sec.items()]
    return {"model": "qwen3-0.6b", "device": "NVIDIA H200", "prompt_len": 128,
            "shapes": [[1, 256], [64, 256], [4, 512]],
            "results": {
                "vllm": {"mode": "default", "startup_s": 60.0, "warmup_s": 4.0, "skipped": [],
                         "runs": runs(b1_256=2.0, b64_256=4.0, b4_512=6.0)},
                "vllm_bi": {"mode": "batch_invariant", "error": "no result (exit status 1)"},
                "areal_tik": {"mode": "areal_tik", "startup_s": 6.0, "warmup_s": 2.0, "skipped": [[64, 256]],
                              "runs": runs(b1_256=1.0, b4_512=3.0)},
                "areal_tik_separate": {"mode": "areal_tik_separate", "startup_s": 9.0, "warmup_s": 4.0,
                                       "skipped": [], "runs": runs(b1_256=1.5, b64_256=2.0, b4_512=3.5)}}}


def test_whole_run_sums_start_up_and_the_shapes_every_mode_completed():
    summary = bench_vllm.whole_run(whole_run_report())
    assert summary["shapes"] == [[1, 256], [4, 512]] and summary["left_out"] == [[64, 256]]
    assert summary["tokens"] == 256 + 4 * 512
    assert list(summary["modes"]) == ["vllm", "areal_tik", "areal_tik_separate"]  # not the failed vllm_bi
    vllm, tik, sep = (summary["modes"][k] for k in ("vllm", "areal_tik", "areal_tik_separate"))
    assert (vllm["run_s"], vllm["whole_s"]) == (8.0, 72.0)    # 2 + 6 (not 64x256's 4), + 60 + 4
    assert (tik["run_s"], tik["whole_s"]) == (4.0, 12.0)      # 1 + 3, + 6 + 2
    assert (sep["run_s"], sep["whole_s"]) == (5.0, 18.0)      # 1.5 + 3.5, + 9 + 4
    assert (vllm["whole_tokens_per_s"], vllm["steady_tokens_per_s"]) == (2304 / 72, 2304 / 8)
    assert (tik["whole_tokens_per_s"], tik["steady_tokens_per_s"]) == (2304 / 12, 2304 / 4)
    assert set(summary["ratios"]) == {"tik/vllm", "tik/separate"}
    assert summary["ratios"]["tik/vllm"] == pytest.approx({"whole": 72 / 12, "steady": 8 / 4})
    assert summary["ratios"]["tik/separate"] == pytest.approx({"whole": 18 / 12, "steady": 5 / 4})
    # no shape completed by every mode: nothing to sum, no ratio made up
    report = whole_run_report()
    report["results"]["areal_tik"]["runs"] = [{"batch": 64, "new_tokens": 256, "seconds": 1.0}]
    report["results"]["vllm"]["runs"] = report["results"]["vllm"]["runs"][:1]
    empty = bench_vllm.whole_run(report)
    assert (empty["shapes"], empty["tokens"], empty["modes"], empty["ratios"]) == ([], 0, {}, {})


def test_whole_run_table_from_a_results_file(tmp_path, capsys):
    path = tmp_path / "bench_vllm.json"
    path.write_text(json.dumps(whole_run_report()))
    bench_vllm.main(["--from-json", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert ("Whole run over the shapes every compared mode completed: 1x256, 4x512 (2304 tokens); "
            "left out: 64x256") in lines
    assert "| vLLM | 60.0 | 4.0 | 8.0 | 72.0 | 32 | 288 |" in lines
    assert "| areal-tik | 6.0 | 2.0 | 4.0 | 12.0 | 192 | 576 |" in lines
    assert "| areal-tik separate | 9.0 | 4.0 | 5.0 | 18.0 | 128 | 461 |" in lines
    assert "| tik/vllm | 6.00 | 2.00 |" in lines and "| tik/separate | 1.50 | 1.25 |" in lines
    assert not any(line.startswith("| vLLM batch-inv.") or "vllm_bi |" in line for line in lines)

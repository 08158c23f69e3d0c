"""The stock-step baselines of eval/bench_train.py: the kernels site goes after the
image's own packages, which combinations run, the fastest of them, and a baseline that
fails is named with its error instead of a number."""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys

import pytest
import torch

from eval import train_baselines as tb
from eval.bench_train import _time_path
from eval.train_baselines import headline


def _fake_site(root):
    """A kernels site holding a decoy ``torch``, a kernel package and a DSL-folder module."""
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("raise ImportError('decoy torch was imported')\n")
    (root / "tik_fake_kernel").mkdir()
    (root / "tik_fake_kernel" / "__init__.py").write_text("WHERE = 'site'\n")
    dsl = root / "nvidia_cutlass_dsl" / "dsl_packages"
    dsl.mkdir(parents=True)
    (dsl / "tik_fake_dsl.py").write_text("WHERE = 'dsl'\n")
    return dsl


def test_kernels_site_is_appended_after_site_packages_and_never_shadows_torch(tmp_path, monkeypatch):
    dsl = _fake_site(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    added = tb.add_kernels_site({tb.KERNELS_SITE_ENV: str(tmp_path)})
    assert added == [str(tmp_path), str(dsl)]
    assert sys.path == before + added  # at the end: every site-packages entry comes first
    assert not importlib.util.find_spec("torch").origin.startswith(str(tmp_path))
    try:
        assert importlib.import_module("tik_fake_kernel").WHERE == "site"
        assert importlib.import_module("tik_fake_dsl").WHERE == "dsl"
    finally:
        sys.modules.pop("tik_fake_kernel", None)
        sys.modules.pop("tik_fake_dsl", None)
    assert tb.add_kernels_site({tb.KERNELS_SITE_ENV: str(tmp_path)}) == []  # once only
    assert sys.path == before + added


def test_no_kernels_site_adds_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    assert tb.add_kernels_site({}) == []
    assert tb.add_kernels_site({tb.KERNELS_SITE_ENV: str(tmp_path / "absent")}) == []
    assert sys.path == before


def test_fastest_ignores_failed_cells():
    times = {("flash_varlen", "chunked"): 30.0, ("cudnn", "chunked"): None,
             ("fa4", "chunked"): math.nan, ("flash_varlen", "liger"): 25.0}
    assert tb.fastest(times) == (("flash_varlen", "liger"), 25.0)
    assert tb.fastest({("cudnn", "chunked"): None, ("fa4", "chunked"): math.nan}) is None
    assert tb.fastest({}) is None


def test_rounds_time_every_backend_then_every_logprob_with_the_fastest_backend():
    attentions, logprobs = ["flash_varlen", "cudnn", "fa4"], ["chunked", "areal", "liger"]
    first = tb.first_round(attentions, logprobs)
    assert first == [("flash_varlen", "chunked"), ("cudnn", "chunked"), ("fa4", "chunked")]
    times = dict(zip(first, [30.0, 28.0, None]))
    assert tb.second_round(attentions, logprobs, times) == [("cudnn", "areal"), ("cudnn", "liger")]
    # nothing ran in the first round: the reference backend tries the other paths
    failed = dict.fromkeys(first)
    assert tb.second_round(attentions, logprobs, failed) == [("flash_varlen", "areal"), ("flash_varlen", "liger")]
    assert tb.first_round(attentions, []) == [] and tb.second_round([], logprobs, {}) == []


def test_rounds_reach_every_backend_with_the_fastest_logprob_and_read_times_lazily():
    attentions, logprobs = ["flash_varlen", "cudnn", "fa4"], ["chunked", "areal", "liger"]
    cost = {"flash_varlen": 10.0, "cudnn": 9.0, "fa4": 12.0, "chunked": 5.0, "areal": 6.0, "liger": 1.0}
    times, order = {}, []
    for combos in tb.rounds(attentions, logprobs, times):
        for a, p in combos:  # the generator reads times only after the previous round is in
            order.append((a, p))
            times[(a, p)] = None if a == "fa4" else cost[a] + cost[p]
    assert order == [("flash_varlen", "chunked"), ("cudnn", "chunked"), ("fa4", "chunked"),
                     ("cudnn", "areal"), ("cudnn", "liger"), ("flash_varlen", "liger"), ("fa4", "liger")]
    assert tb.fastest(times) == (("cudnn", "liger"), 10.0)
    assert tb.third_round(attentions, logprobs, {}) == []


def test_select_and_restrict_keep_the_exact_errors_of_skipped_baselines(monkeypatch):
    def broken():
        import tik_no_such_kernel_module  # noqa: F401
    monkeypatch.setattr(tb, "_liger_loss", broken)
    paths = tb.logprob_paths()
    assert paths["liger"] == (None, "ModuleNotFoundError: No module named 'tik_no_such_kernel_module'")
    assert paths["chunked"][0] is tb.chunked_gather_logprobs
    status = {"flash_varlen": tb.AVAILABLE, "cudnn": "RuntimeError: no cuDNN", "fa4": tb.AVAILABLE}
    b = tb.select_baselines(status, paths)
    assert b.attentions == ["flash_varlen", "fa4"]
    assert "liger" not in b.logprobs and b.logprobs[0] == "chunked"
    assert b.skipped["attention:cudnn"] == "RuntimeError: no cuDNN"
    assert b.skipped["logprob:liger"] == paths["liger"][1]
    r = tb.restrict(b, ["fa4"], ["chunked"])
    assert r.attentions == ["fa4"] and r.logprobs == ["chunked"]
    assert r.skipped["attention:flash_varlen"] == "not asked for (--attention)"
    assert r.skipped["attention:cudnn"] == "RuntimeError: no cuDNN"


def test_attention_status_on_cpu_names_why_each_gpu_backend_is_skipped():
    assert tb.attention_status("cpu") == {"flash_varlen": tb.AVAILABLE, "cudnn": "needs a CUDA device",
                                          "fa4": "needs a CUDA device"}
    with __import__("pytest").raises(ValueError, match="attention backend must be one of"):
        tb.use_attention("flash")


def test_pad_index_places_each_row_in_a_right_padded_batch():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert tb.pad_index(cu, 8, 4).tolist() == [0, 1, 2, 4, 8, 9, 10, 11]


def test_a_failing_path_records_its_error_and_no_number(capsys):
    w = torch.nn.Parameter(torch.ones(3))
    args = argparse.Namespace(steps=2, warmup=0)

    def boom():
        raise RuntimeError("cute compile failed\nsecond line")
    assert _time_path(boom, [w], "cpu", args, 1e9) == {"error": "RuntimeError: cute compile failed"}

    def ok():
        (w * 2).sum().backward()
    m = _time_path(ok, [w], "cpu", args, 1e9)
    assert "error" not in m and m["mfu"] == m["tflops"] / 790.0 > 0
    capsys.readouterr()
    rows = [{"model": "m", "packing": "p", "path": p, "metric": k, "value": v} for p, k, v in (
        ("ours", "median_ms", 10.0), ("ours", "mfu", 0.5), ("stock:fa4+liger", "median_ms", 12.0),
        ("stock:fa4+liger", "mfu", 0.4), ("compare", "fastest_stock", "stock:fa4+liger"),
        ("compare", "fastest_stock_over_ours", 1.2))]
    rows.append({"model": "m", "packing": "q", "path": "ours", "metric": "error", "value": "x"})
    headline(rows)
    out = capsys.readouterr().out
    assert "headline m p: fastest stock stock:fa4+liger 12.0 ms (MFU 40.0%) vs ours 10.0 ms (MFU 50.0%)" in out
    assert "fastest-stock/ours 1.20x" in out and "headline m q: no ratio" in out


def test_bench_attention_fa4_cell_is_a_time_or_its_error(capsys, monkeypatch):
    from eval import bench_attention as ba
    monkeypatch.setitem(ba.FA4, "fn", None)
    monkeypatch.setitem(ba.FA4, "why", "not importable: ModuleNotFoundError: No module named 'flash_attn'")
    assert ba._time_fa4(lambda fn: fn, torch.ones(2), 10, graph=False) == ba.FA4["why"]
    info, ours = {"device": "x"}, ((10.0, 9.0, 11.0), 8.0)
    sdpa = {"cudnn": ((12.0, 11.0, 13.0), "enable_gqa", 9.0)}
    fa4 = ((20.0, 19.0, 21.0), 1e-3, 16.0)
    rows = ba._ratio_rows("prefill", "1K", ours, sdpa, 1e9, "tflops", info, "cfg", fa4)
    unified, cudnn, flash4 = rows
    assert unified["vs_fa4"] == 2.0 and unified["vs_fa4_graph"] == 2.0 and unified["vs_best_sdpa"] == 1.2
    assert flash4["impl"] == "flash_attn_4" and flash4["us"] == 20.0 and flash4["us_graph"] == 16.0
    skipped = ba._ratio_rows("backward", "1K", ours, sdpa, 1e9, "tflops", info, "cfg", ba.FA4["why"])
    assert "vs_fa4" not in skipped[0] and "us" not in skipped[2]
    assert skipped[2] == {"op": "attention", "kind": "backward", "case": "1K", "impl": "flash_attn_4",
                          "error": ba.FA4["why"], "device": "x"}
    ba.summarize(rows + skipped)
    out = capsys.readouterr().out
    assert "prefill: vs flash-attn-4 (eager) min 2.00 max 2.00" in out
    assert f"backward: flash-attn-4 skipped: {ba.FA4['why']}" in out


def test_a_stock_step_far_from_ours_is_suspect_and_reported_not_counted():
    assert not tb.suspect(0.17, 0.17) and not tb.suspect(0.6, 0.17) and tb.suspect(0.7, 0.17)
    assert not tb.suspect(0.25, 0.01) and tb.suspect(0.26, 0.01)  # the floor
    assert tb.suspect(float("nan"), 0.1) and not tb.suspect(0.2, None)
    m = {"median_ms": 5.0, "first_ms": 9.0, "mfu": 0.3, "compiles_first": 0, "compiles_after_first": 0,
         "lp_max_abs_diff_vs_ours": 0.9, "error": "log-probs off from ours by 0.9 (reference 0.1): not counted"}
    line = tb.fmt_path(m)
    assert line.startswith("5.0 ms (first 9 ms, MFU 30.0%") and "max |lp - ours| 0.9" in line
    assert line.endswith("NOT COUNTED: log-probs off from ours by 0.9 (reference 0.1): not counted")
    assert tb.fmt_path({"error": "RuntimeError: x"}) == "ERROR RuntimeError: x"


def test_check_logprobs_counts_close_steps_and_drops_far_or_failing_ones():
    from eval.bench_train import _check_logprobs
    w = torch.nn.Parameter(torch.ones(2))
    ours, reference = torch.zeros(4), []
    first = {"median_ms": 3.0}
    assert _check_logprobs(first, lambda: torch.full((4,), 0.1), [w], ours, reference) == 3.0
    assert reference == [first["lp_max_abs_diff_vs_ours"]] and abs(reference[0] - 0.1) < 1e-6
    close, far, broken = {"median_ms": 2.0}, {"median_ms": 1.0}, {"median_ms": 0.5}
    assert _check_logprobs(close, lambda: torch.full((4,), -0.3), [w], ours, reference) == 2.0
    assert _check_logprobs(far, lambda: torch.full((4,), 2.0), [w], ours, reference) is None
    assert far["error"].startswith("log-probs off from ours by 2 (reference 0.1")

    def fails():
        raise RuntimeError("illegal layout")
    assert _check_logprobs(broken, fails, [w], ours, reference) is None
    assert broken["error"] == "its log-prob check step failed: RuntimeError: illegal layout"
    assert tb.fastest({("a", "p"): 3.0, ("b", "p"): 2.0, ("c", "p"): None}) == (("b", "p"), 2.0)


def test_fa4_probe_runs_in_a_child_and_names_its_error(monkeypatch):
    # No flash-attn-4 here: the child's import error comes back as the baseline's status,
    # and this process is untouched (on the H200 the child is what a sticky CUDA fault kills).
    monkeypatch.delenv(tb.KERNELS_SITE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"flash-attn-4 probe \(forward \+ backward\) failed: .*flash_attn"):
        tb.probe_fa4(timeout_s=120)

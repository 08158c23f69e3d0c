"""The start-up benchmark (eval/bench_startup.py): each mode's environment (its own caches,
the serial mode's 8 threads), its table and ratios from the children's results, a failed
child named. The children need a GPU; here they are stood in for."""
from __future__ import annotations

import json
import subprocess
import types

import pytest

from eval import bench_startup as B


def _child_result(qualify, warm, engine):
    return {"seconds": {"qualify": qualify, "train_warmup": warm, "engine_start": engine}, "passed": True,
            "compile_seconds": 0.0, "train_launches": 64, "engine_launches": 73}


def test_modes_get_their_caches_and_threads_and_the_summary_divides_serial_by_threaded(tmp_path, monkeypatch,
                                                                                       capsys):
    seen = []
    results = {"serial": _child_result(29.0, 6.0, 5.0), "threaded": _child_result(14.5, 4.0, 2.5),
               "warm": _child_result(9.0, 1.0, 1.0)}

    def fake_run(cmd, env, **kwargs):
        mode = cmd[-1]
        seen.append((mode, env["TRITON_CACHE_DIR"], env.get("AREAL_TIK_COMPILE_THREADS"),
                     env["AREAL_TIK_QUALIFY_CACHE"]))
        return types.SimpleNamespace(returncode=0, stdout="noise\n" + B._MARK + json.dumps(results[mode]), stderr="")
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("AREAL_TIK_COMPILE_THREADS", "3")  # the caller's setting never reaches a child
    monkeypatch.setenv("AREAL_TIK_COMMIT", "abc1234")  # the CSV's commit column, without git
    assert B.main(["--out", str(tmp_path / "s.csv")]) == 0
    out = capsys.readouterr().out
    (serial, s_cache, s_threads, s_q), (threaded, t_cache, t_threads, t_q), (warm, w_cache, w_threads, w_q) = seen
    assert (serial, threaded, warm) == B.MODES and s_threads == "8" and t_threads is w_threads is None
    assert s_cache != t_cache == w_cache and len({s_q, t_q, w_q}) == 3  # warm: the threaded Triton cache
    assert "qualify 2.00x, train warm-up 1.50x, engine start 2.00x; three phases 40.0 -> 21.0 s" in out
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 5 and "qwen3-0.6b,serial,sum,40.0" in rows[4]


def test_a_failed_child_is_named_with_its_output(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda cmd, env, **kw: types.SimpleNamespace(
        returncode=1, stdout="", stderr="RuntimeError: no CUDA device"))
    with pytest.raises(RuntimeError, match="qwen3-0.6b serial: child failed .exit 1.:\nRuntimeError: no CUDA"):
        B.run_case("qwen3-0.6b", "serial", "/tmp/none")

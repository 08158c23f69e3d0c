"""Device qualification: the probe passes on this device, its verdict is cached per device
key, a planted row-count-dependent op is reported by name, linear can be pinned.

CPU: the interpreter's tiny shapes (the full probe takes about 15 s on 2 cores).
"""
from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
import triton

import areal_tik
from areal_tik import qualify
from areal_tik.model.ops import UnifiedOps

from ._planted import planted_ops

L = importlib.import_module("areal_tik.unified_kernels.linear")


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "qualification.json"
    monkeypatch.setenv(qualify.CACHE_ENV, str(path))
    return path


def counting(monkeypatch, fake=None) -> list:
    """Count ``run_probe`` calls made by ``qualify`` (optionally answering with ``fake``)."""
    calls = []
    real = qualify.run_probe

    def probe(device, *args, **kwargs):
        calls.append(device)
        return fake(device) if fake else real(device, *args, **kwargs)
    monkeypatch.setattr(qualify, "run_probe", probe)
    return calls


def test_probe_passes_and_its_verdict_is_cached(cache_file, monkeypatch):
    calls = counting(monkeypatch)
    first = qualify.qualify("cpu")
    assert first.passed and not first.cached and first.failing_ops == [] and len(calls) == 1, first.message()
    ops = {c.op: c.passed for c in first.checks}
    assert ops == {"linear": True, "linear variants": True, "attention prefill vs decode": True,
                   "attention CUDA graph": None, "model rollout vs training": True}
    stored = json.loads(cache_file.read_text())
    assert list(stored["verdicts"]) == [first.key.id]
    second = qualify.qualify("cpu")
    assert len(calls) == 1 and second.cached and second.passed
    assert second.checks == first.checks and second.key == first.key


def _fake_verdict(device):
    return qualify.Verdict(qualify.DeviceKey.of(device), [qualify.Check("linear", True, "stand-in")], 0.0)


def test_the_key_names_the_device_and_versions_and_a_new_one_probes_again(cache_file, monkeypatch):
    calls = counting(monkeypatch, _fake_verdict)
    key = qualify.DeviceKey.of(torch.device("cpu"))
    assert (key.torch, key.sm_count, key.gpu) == (torch.__version__, 0, "cpu (Triton interpreter)")
    assert key.triton == triton.__version__ and key.areal_tik.startswith(areal_tik.__version__ + "+")
    assert key.id == qualify.DeviceKey.of(torch.device("cpu")).id
    qualify.qualify("cpu")
    newer = dataclasses.replace(key, triton="9.9.9")
    assert newer.id != key.id
    monkeypatch.setattr(qualify.DeviceKey, "of", classmethod(lambda cls, device: newer))
    qualify.qualify("cpu")
    qualify.qualify("cpu")
    assert len(calls) == 2
    assert sorted(json.loads(cache_file.read_text())["verdicts"]) == sorted([key.id, newer.id])
    cache_file.write_text("{not json")  # a corrupt cache is probed again and rewritten
    assert not qualify.qualify("cpu").cached and len(calls) == 3
    assert qualify.qualify("cpu", refresh=True) and len(calls) == 4
    stored = json.loads(cache_file.read_text())
    stored["verdicts"][newer.id] = {"key": {"gpu": "x"}}  # a malformed entry is probed again
    cache_file.write_text(json.dumps(stored))
    assert not qualify.qualify("cpu").cached and len(calls) == 5
    assert qualify.qualify("cpu").cached and len(calls) == 5


def test_the_cache_path_defaults_to_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(qualify.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert qualify.cache_path() == tmp_path / "areal-tik" / "qualification.json"


def test_a_planted_row_count_dependent_linear_is_named():
    # A decode batch (2 rows) differs from prefill and the packed forward (more than 4).
    verdict = qualify.run_probe("cpu", ops=planted_ops("linear"), probes=("linear", "model"))
    assert not verdict.passed and verdict.pin_linear
    assert verdict.failing_ops == ["linear", "linear (pinned tile)", "model rollout vs training"]
    checks = {c.op: c for c in verdict.checks}
    assert "rows 4 vs 40" in checks["linear"].detail and "rows 5 vs 40" not in checks["linear"].detail
    assert checks["linear variants"].passed  # the kernel itself, outside the planted op table
    assert "first divergence" in checks["model rollout vs training"].detail
    assert "layer 0 linear" in checks["model rollout vs training"].detail
    assert "linear" in verdict.message() and "FAILED" in verdict.message()


def test_a_tile_dependent_fault_is_repaired_by_pinning_linear():
    ops = planted_ops("linear")
    planted, unified = ops.linear, UnifiedOps().linear
    ops.linear = lambda x, *args, **kwargs: (unified if L.FIXED_TILE else planted)(x, *args, **kwargs)
    verdict = qualify.run_probe("cpu", ops=ops, probes=("linear",))
    assert verdict.failing_ops == ["linear"] and verdict.pin_linear and not L.FIXED_TILE
    pinned = next(c for c in verdict.checks if c.op == "linear (pinned tile)")
    assert pinned.passed and "fixed tile" in pinned.detail


def test_pinning_linear_to_one_tile_is_reversible_and_nests():
    shapes = [(m, n) for m in (1, 5, 33, 4000) for n in (16, 1000)]
    before = [L.linear_config(m, n, 32, torch.bfloat16) for m, n in shapes]
    assert len(set(before)) > 1
    with qualify.pin_linear_tile():
        inner = qualify.pin_linear_tile()
        assert len({L.linear_config(m, n, 32, torch.bfloat16) for m, n in shapes}) == 1
        inner.revert()
        assert len({L.linear_config(m, n, 32, torch.bfloat16) for m, n in shapes}) == 1
    assert [L.linear_config(m, n, 32, torch.bfloat16) for m, n in shapes] == before


def test_bad_probe_requests_raise():
    with pytest.raises(ValueError, match="probes"):
        qualify.run_probe("cpu", probes=("lineaar",))
    with pytest.raises(ValueError, match="device"):
        qualify.run_probe("meta")


def test_main_prints_the_verdict_and_exits_non_zero_on_failure(cache_file, monkeypatch, capsys):
    failing = qualify.Check("attention prefill vs decode", False, "3/10 rows differ, first [15]")
    calls = counting(monkeypatch, lambda device: qualify.Verdict(qualify.DeviceKey.of(device), [failing], 1.5))
    assert qualify.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL attention prefill vs decode: 3/10 rows differ" in out and "probe 1.50 s" in out
    assert qualify.main(["--device", "cpu"]) == 1 and len(calls) == 1
    assert "cached verdict" in capsys.readouterr().out


@pytest.fixture
def recorded_launches(monkeypatch):
    """A list that receives the Triton key of every unified kernel launch; the launches run."""
    from .test_compile_keys import _kernels, launch_key

    seen = []
    for kernel in set(_kernels()):
        def run(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kwargs):
            seen.append(launch_key(_kernel, args, kwargs))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(kernel, "run", run)
    return seen


def test_the_probes_kernels_are_compiled_ahead_of_them(recorded_launches):
    """``compile_tasks`` launches every kernel key the probes launch (on a GPU they run on
    threads first, so no probe compiles one by one); without the model's part they do not
    (the model probe's own kernels are needed: the check can fail)."""
    from areal_tik.qualify import probes as P
    from areal_tik.unified_kernels.warmup import run_tasks

    cpu, sizes, ops = torch.device("cpu"), qualify.ProbeSizes.for_device(torch.device("cpu")), UnifiedOps()
    run_tasks(P.compile_tasks(ops, cpu, sizes, ("linear", "attention")), cpu, workers=1)
    without_model = set(recorded_launches)
    run_tasks(P.compile_tasks(ops, cpu, sizes, ("model",)), cpu, workers=1)
    ahead = set(recorded_launches)
    recorded_launches.clear()
    verdict = qualify.run_probe("cpu", sizes=sizes, precompile_workers=1)
    assert verdict.passed and verdict.compile_seconds == 0.0, verdict.message()
    assert recorded_launches and set(recorded_launches) <= ahead, set(recorded_launches) - ahead
    assert not set(recorded_launches) <= without_model


def test_verdict_json_keeps_the_compile_seconds():
    verdict = qualify.Verdict(qualify.DeviceKey.of(torch.device("cpu")), [qualify.Check("linear", True, "x")], 3.5,
                              compile_seconds=2.4)
    again = qualify.Verdict.from_json(json.loads(json.dumps(verdict.to_json())))
    assert again.cached and again.compile_seconds == 2.4 and again.seconds == 3.5
    assert "in 3.5 s, 2.4 s of it compiling" in again.message()
    old = verdict.to_json()
    del old["compile_seconds"]  # a verdict cached before the field existed
    assert qualify.Verdict.from_json(old).compile_seconds == 0.0


@pytest.mark.gpu
def test_gpu_probe_compiles_nothing_after_its_precompile(tmp_path, monkeypatch):
    """On the GPU the probes, after ``precompile`` on threads, launch only compiled kernels
    (Triton's post-compile hook sees every new key, disk-cached or not), and pass."""
    from areal_tik.qualify import probes as P

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # cold: every kernel compiles here
    dev, sizes, ops = torch.device("cuda", torch.cuda.current_device()), None, UnifiedOps()
    sizes = qualify.ProbeSizes.for_device(dev)
    seconds = P.precompile(ops, dev, sizes, tuple(qualify.PROBES))
    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        verdict = qualify.run_probe(dev, sizes=sizes, ops=ops, precompile_workers=1)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert seconds > 0 and verdict.passed, verdict.message()
    assert compiled == [], compiled

"""The host-path probe (eval/probe_host.py): a CPU run with the kernels stubbed reports both
step kinds before and after the launch plans, and puts every kernel's launch back."""
from __future__ import annotations

from eval.probe_host import _kernels, main, stubbed


def test_stubs_are_removed_again():
    # What was there before is put back: nothing, or an instance ``run`` another test's
    # monkeypatch left (its undo sets the bound method back as an instance attribute).
    before = [vars(kernel).get("run") for kernel in _kernels()]
    with stubbed(front=True):
        stubs = [vars(kernel).get("run") for kernel in _kernels()]
        assert all(stub is not None and stub is not old for stub, old in zip(stubs, before))
    assert [vars(kernel).get("run") for kernel in _kernels()] == before


def test_cpu_run_reports_both_step_kinds(capsys):
    assert main(["--layers", "2", "--reps", "2", "--rows", "20", "--start", "16"]) == 0
    out = capsys.readouterr().out
    for label in ("contiguous prefill of 20", "paged chunk of 20 @16"):
        assert f"{label}: host ms per layer, HOST_FAST_PATH off -> on: no launch" in out
    assert out.count("Ordered by: internal time") == 2 and "JIT front alone" in out

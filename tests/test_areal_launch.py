"""The launcher: a stock-style entry script runs unchanged with the areal-tik patches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


from areal_tik import patches
from areal_tik.adapter import apply_patches, launch
from areal_tik.cli import main
from areal_tik.model.checkpoints import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_launcher_usage_and_bad_script(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--help"])
    assert exc.value.code == 0 and "script_args" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["launch"])
    assert exc.value.code == 2
    with pytest.raises(FileNotFoundError, match="entry script not found"):
        launch.run_script(str(tmp_path / "missing.py"), [])
    assert patches.active() == []


def test_activate_applies_the_patch_list_once(monkeypatch):
    """An entry script's ``activate()`` under AReaL's launchers (RANK set by them): the
    patch list for the process; a no-op where ``areal-tik launch`` has applied it."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)  # the launchers set it; not activate()
    with apply_patches():
        assert launch.activate() is None and patches.active() == ["areal"]
    assert patches.active() == []
    handle = launch.activate()
    try:
        assert patches.active() == ["areal"] and launch.activate() is None
        assert "AREAL_SPMD_MODE" not in os.environ
    finally:
        handle.revert()
    assert patches.active() == []


def test_inprocess_engine_needs_spmd_mode(tmp_path, monkeypatch):
    from areal import PPOTrainer

    from areal_tik.adapter import demo

    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)
    with apply_patches():
        overrides = demo.demo_overrides(str(tmp_path / "none"), str(tmp_path), steps=1, batch_size=2,
                                        n_samples=2, max_new_tokens=4)
        config = demo.load_config(demo.recipe_path(demo.CPU_RECIPE), overrides)
        with pytest.raises(ValueError, match="SPMD mode.*areal-tik launch"):
            PPOTrainer(config, train_dataset=None)


@pytest.mark.slow
def test_launcher_runs_the_recipe_script(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=1)
    env = {k: v for k, v in os.environ.items()
           if k not in ("AREAL_SPMD_MODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "areal_tik.cli", "launch", "recipes/reasoning_gym_grpo.py",
           "--config", "recipes/chain_sum_grpo_tiny_cpu.yaml", f"actor.path={model}",
           f"cluster.fileroot={tmp_path}/exp", f"cluster.name_resolve.nfs_record_root={tmp_path}/nr",
           "total_train_steps=1", "train_dataset.batch_size=2", "gconfig.max_new_tokens=4",
           "task.name=basic_arithmetic", "++task.instruction=''"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Train step 1/" in out and "tik/audit_passed" in out
    # The run ends with the demo's summary (reward, reuse, audit verdict).
    summary = proc.stdout[proc.stdout.index("areal-tik launch reasoning_gym_grpo.py: 1 GRPO steps in "):]
    assert "reward per step: " in summary and "audit: " in summary and "tokens reused: " in summary
    runs = list((tmp_path / "exp" / "logs").glob("*/*/*/wandb/offline-run-*"))
    assert runs, "no offline W&B run was written"

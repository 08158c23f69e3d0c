"""Two FSDP ranks with the flag on, started by AReaL's own local launcher (no wrapper).

One run (``_dp_trainer.py`` under ``areal.infra.launcher.local``: torchrun, 2 processes,
gloo, the Triton interpreter, a tiny model, 2 GRPO steps) shows at once:

- the launcher path: every trainer process has the areal-tik patches from the entry
  script's ``activate()`` and builds the areal-tik actor;
- uneven work and one verdict across ranks: at step 1 rank 0's rows are all refused (no
  exactness fields), so only rank 1 has an audit sample; rank 0 joins rank 1's recompute
  (its FSDP collectives) with one sequence, the audit's counts are rank 1's, and both
  ranks hold the same audits and the same verdict;
- a fallback on every rank together: only rank 1's training forward (with gradients)
  differs, so step 1's audit passes and its first minibatch differs on rank 1 alone; the
  first minibatch is judged over both ranks, both fall back, and at step 2 both run
  AReaL's recompute pass (a rank falling back alone would leave the other out of the
  recompute's FSDP collectives: the run would hang).

AReaL's default mode (``recompute_logprob`` off, no decoupled loss): the rollout
log-probs are the old log-probs, so only the audit recomputes while reuse holds.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch.multiprocessing as mp
from areal.infra.utils.launcher import THREAD_ENV_VARS

from areal_tik.adapter.processes import refusals_of_every_process
from areal_tik.adapter.launch import _free_port
from areal_tik.model.checkpoints import make_tiny_checkpoint

from ._gloo import refusals_worker

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 540


def launch(tmp_path: Path, overrides: list[str]) -> str:
    """``python3 -m areal.infra.launcher.local tests/_dp_trainer.py --config ...`` (through
    ``_local_launcher.py`` on CPU); returns the launcher's output. Its exit status is not
    the run's: AReaL's local launcher raises JobException whenever the trainer job ends."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("AREAL_SPMD_MODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    # One thread a rank (the launcher keeps a value set here; its default, 8 each, oversubscribes
    # a 2-core machine with 2 ranks).
    env.update({var: "1" for var in THREAD_ENV_VARS})
    cmd = [sys.executable, "tests/_local_launcher.py", "tests/_dp_trainer.py",
           "--config", "recipes/chain_sum_grpo_tiny_cpu.yaml", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # the launcher, its shell, torchrun and the ranks (torchrun gives each its own session)
        for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the two-rank run did not end in {TIMEOUT_S} s (a rank waiting in a collective "
                    f"the other never joins?):\n{out[-4000:]}")
    return out


@pytest.mark.slow
def test_two_fsdp_ranks_through_areals_local_launcher(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=1)
    (tmp_path / "exp").mkdir()
    (tmp_path / "nr").mkdir()
    out = launch(tmp_path, [
        "actor.backend=fsdp:d2", f"actor.path={model}",  # the recipe's allocation_mode follows backend
        f"cluster.fileroot={tmp_path}/exp", f"cluster.name_resolve.nfs_record_root={tmp_path}/nr",
        "total_train_steps=2", "train_dataset.batch_size=2", "gconfig.max_new_tokens=4",
        "task.name=basic_arithmetic", "++task.instruction=''", "actor.tik_audit_every=2",
        "actor.recompute_logprob=false"])
    assert "torchrun --nnodes 1 --nproc-per-node 2" in out and "AREAL_SPMD_MODE=1" in out, out[-4000:]
    files = [tmp_path / "exp" / f"rank{r}.json" for r in (0, 1)]
    assert all(f.is_file() for f in files), f"a rank did not finish:\n{out[-6000:]}"
    ranks = [json.loads(f.read_text()) for f in files]

    for rank in ranks:  # the launcher path: patches from the entry script, the areal-tik actor
        assert rank["patches"] == ["areal"] and rank["actor_class"] == "TikFSDPPPOActor"
        assert [b["version"] for b in rank["batches"]] == [0, 1]
    tokens = [[b["scored_tokens"] for b in rank["batches"]] for rank in ranks]
    # uneven work: rank 0 had no audit sample and joined rank 1's recompute with one sequence
    assert ranks[0]["tik_recomputes"] == [[0, 1]] and ranks[1]["tik_recomputes"] == [[0, 2]]

    first, second = (rank["summary"] for rank in ranks)
    # one verdict: the same audit (step 1: rank 1's sample), the same reason on both ranks
    assert first == {**second, "recompute_seconds_saved": first["recompute_seconds_saved"],
                     "tokens_reused": first["tokens_reused"]}, (first, second)
    assert first["tokens_reused"] == 0 and second["tokens_reused"] == tokens[1][0]  # rank 0's refused
    assert first["audits"] == 1 and first["audited_tokens"] == tokens[1][0] > 0
    assert first["audited_bitwise_fraction"] == 1.0
    # fallback together: rank 1's first minibatch differs in every token, rank 0's was not judged
    # (its rows were refused), yet rank 0 falls back with rank 1
    assert not first["reuse_active"] and first["mismatches"] == 1
    assert first["fallback_reason"].startswith(
        f"first minibatch at weights version 0: {tokens[1][0]} of {tokens[1][0]} log-probs"), first
    for rank in ranks:
        assert rank["areal_recompute_versions"] == [1]  # AReaL's recompute pass: step 2, every rank
        step1, step2 = rank["history"]
        assert step1["tik/audit_passed"] == 1.0 and step1["tik/reuse_active"] == 1.0
        # exported stats are means over both ranks: rank 0's first minibatch matched, rank 1's did not
        assert step1["tik/first_minibatch_exact_fraction"] == 0.5
        assert step2["tik/mismatches"] == 1.0 and step2["tik/fallback"] == 1.0
        assert "timeperf/recompute_logp" not in step1 and "timeperf/recompute_logp" in step2


def test_refusals_are_one_decision_over_processes(tmp_path):
    """Three gloo processes, refusals on two of them: every process ends with all of them,
    in rank order, once each (the actor takes these when it connects its engine)."""
    reasons = [[], ["server on 'standard' kernels", "device qualification failed"],
               ["device qualification failed", "top-p sampling"]]
    mp.spawn(refusals_worker, args=(3, _free_port(), reasons, str(tmp_path)), nprocs=3, join=True)
    every = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    assert every == [["server on 'standard' kernels", "device qualification failed", "top-p sampling"]] * 3
    assert refusals_of_every_process(["one process"]) == ["one process"]  # no process group

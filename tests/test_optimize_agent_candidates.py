"""The agent's attention candidates (issue 15's agent-driven path) on the interpreter's tiny
grid: the config deltas in eval/agent/ pass the search's gate against the root (bits equal to
the root's on every workload, prefill == decode, paged == contiguous, the anti-hacking checks),
and eval/agent/round.sh proposes, audits and records a round of sources and deltas. The GPU
gate (the H200 grid) is what decides them; this keeps a candidate from reaching a device call
broken."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_tik.optimize import checks, evaluator
from areal_tik.optimize.op_attention import AttentionOp

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
DELTAS = sorted((REPO / "eval" / "agent").rglob("attention_*.json"))  # this round's and earlier rounds'

# A source candidate as an agent writes one: its docstring's first paragraph is the note. It
# launches the root's kernels with two heads a program and chunks of 2 position blocks.
SOURCE = '''"""Agent candidate (test fixture): the root's prefill with two query heads of a KV group per
program, in chunks of 2 position blocks.

Hypothesis: none; it exercises the source path of a round."""
import dataclasses
import importlib

import torch

F = importlib.import_module("areal_tik.unified_kernels._attention_fwd")
A = importlib.import_module("areal_tik.unified_kernels.attention")
CONFIG = dataclasses.replace(F.attention_config(), prefill_pack_heads=2, prefill_order_chunk=2)


def prefill(q, k, v, cu_seqlens, max_seqlen, store_lse=False):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if store_lse else None
    F.launch_prefill(q, k, v, cu_seqlens, out, lse, cu_seqlens.shape[0] - 1, max_seqlen, q.shape[-1] ** -0.5,
                     CONFIG)
    return out, lse


def decode(q, k_cache, v_cache, block_tables, context_lens):
    return A.attention_decode(q, k_cache, v_cache, block_tables, context_lens, validate=False, config=CONFIG)
'''


def write_source(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "attention_fixture.py"
    path.write_text(SOURCE)
    return path


@pytest.mark.parametrize("path", DELTAS, ids=lambda p: p.stem)
def test_the_rounds_config_deltas_pass_the_gate(tmp_path, path):
    candidate = json.loads(path.read_text())
    assert set(candidate) == {"note", "delta"} and candidate["note"].startswith("Agent candidate")
    op = AttentionOp("tiny")
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    config = op.apply(op.root_config(), candidate["delta"])
    results = checks.run_gate(op, op.config_impl(config), op.config_impl(op.root_config()), config, CPU,
                              run.config, seed=7)
    assert set(results.values()) == {"ok"}, results


def test_the_agent_round_records_every_candidate(tmp_path):
    """eval/agent/round.sh on the interpreter's tiny grid over a folder with a source and a
    config delta: the run is initialised, the prompt written, each candidate proposed as the
    agent's (the source with its docstring's first paragraph as the note, the delta with its
    note, on the root), audited (it passes the gate), and the run directory, status and next
    prompt come back."""
    import os
    import shutil
    import subprocess
    import tarfile

    folder = tmp_path / "candidates"
    write_source(folder)
    shutil.copy(REPO / "eval" / "agent" / "rounds" / "round3" / "attention_pack2_chunk8.json", folder)
    out = tmp_path / "out"
    env = dict(os.environ, AGENT_GRID="tiny", AGENT_DEVICE="cpu", TRITON_INTERPRET="1", AGENT_DIR=str(folder))
    proc = subprocess.run(["bash", "eval/agent/round.sh", str(out), "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    audits = sorted(out.glob("audit_*.json"))
    assert len(audits) == 2 and all(json.loads(a.read_text())["passed"] for a in audits)
    status = json.loads((out / "status.json").read_text())
    assert status["by_proposer"] == {"agent": 2}, status["by_proposer"]
    assert (out / "prompt_round_start.md").stat().st_size > 0 and (out / "prompt_next_round.md").exists()
    with tarfile.open(out / "attention_run.tgz") as tar:
        actions = [json.loads(tar.extractfile(n).read()) for n in tar.getnames() if "/actions/" in n]
        records = [json.loads(tar.extractfile(n).read())
                   for n in tar.getnames() if "/candidates/" in n and n.endswith(".json")]
    assert all(a["proposer"] == "agent" for a in actions)
    assert sorted(a["note"].split(":")[0] for a in actions) == ["attention_fixture.py", "attention_pack2_chunk8.json"]
    assert all(a["note"].split(": ", 1)[1].startswith("Agent candidate") for a in actions)
    assert {r["kind"] for r in records} == {"root", "source", "config"}
    (delta,) = [r for r in records if r["kind"] == "config"]
    assert delta["delta"] == {"prefill_pack_heads": 2, "prefill_order_chunk": 8} and delta["parent"] == "root"


def test_a_config_delta_needs_a_config_parent(tmp_path):
    """A source candidate has no config to move (its code is the change): a delta on it is
    refused, naming --parent; the same delta on the root is recorded (round.sh proposes its
    .json candidates on the root, since a source may have been promoted earlier in the round)."""
    from areal_tik.optimize.records import RunError

    op = AttentionOp("tiny")
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    source = evaluator.propose(run, op, source_path=write_source(tmp_path / "src"), proposer="agent")
    delta = {"prefill_pack_heads": 2, "prefill_order_chunk": 4}
    with pytest.raises(RunError, match=f"needs a config parent, and {source.id} is a source candidate.*--parent"):
        evaluator.propose(run, op, delta=delta, parent=source.id)
    cand = evaluator.propose(run, op, delta=delta, parent="root")
    assert cand.kind == "config" and cand.config["prefill_order_chunk"] == 4 and cand.parent == "root"


def test_a_round_without_candidates_is_refused_before_it_starts(tmp_path):
    """round.sh over a folder with no candidate stops with a message naming the folder, before
    it initialises a run (which would spend device time timing the root alone)."""
    import os
    import subprocess

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    env = dict(os.environ, AGENT_GRID="tiny", AGENT_DEVICE="cpu", TRITON_INTERPRET="1", AGENT_DIR=str(empty))
    proc = subprocess.run(["bash", "eval/agent/round.sh", str(out), "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"no candidate in {empty}" in proc.stderr, proc.stderr
    assert not (out / "attention_run").exists()

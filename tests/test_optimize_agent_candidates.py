"""The agent's attention candidates in eval/agent/ (issue 15's agent-driven path) pass the
search's gate against the root on the interpreter's tiny grid: bits equal to the root's on
every workload, prefill == decode, paged == contiguous, the anti-hacking checks. The GPU gate
(the H200 grid) is what decides them; this keeps a candidate from reaching a device call
broken."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_tik.optimize import checks, evaluator
from areal_tik.optimize.op_attention import AttentionOp
from areal_tik.optimize.ops import load_source

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["attention_gqa_pack_chunked"])
def test_gqa_packed_prefill_passes_the_gate_and_zeroes_padding_rows(tmp_path, name):
    op = AttentionOp("tiny")
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    impl = load_source(op, REPO / "eval" / "agent" / f"{name}.py", f"{name}_{tmp_path.name}")
    results = checks.run_gate(op, impl, op.config_impl(op.root_config()), None, CPU, run.config, seed=7)
    assert set(results.values()) == {"ok"}, results
    # sequences of 19 and 5 rows packed into 30 (5 padding rows), LSE included
    g = torch.Generator().manual_seed(3)
    q = torch.randn(30, 2, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(30, 1, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 19, 24], dtype=torch.int32)
    root = op.config_impl(op.root_config())
    got, got_lse = impl.prefill(q, k, v, cu, 19, True)
    want, want_lse = root.prefill(q, k, v, cu, 19, True)
    checks.expect_bits("packed prefill", (got, got_lse[:, :24]), (want, want_lse[:, :24]))
    assert torch.equal(got[24:].view(torch.int16), torch.zeros(6, 2, 16, dtype=torch.int16))
    # more position blocks than one chunk holds, and a last chunk part full: 11 blocks of 64
    # (sequences of 700 and 130 rows, 10 padding rows), every program's rows the root's bits
    q = torch.randn(840, 2, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(840, 1, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 700, 830], dtype=torch.int32)
    got, got_lse = impl.prefill(q, k, v, cu, 700, True)
    want, want_lse = root.prefill(q, k, v, cu, 700, True)
    checks.expect_bits("long packed prefill", (got, got_lse[:, :830]), (want, want_lse[:, :830]))
    assert torch.equal(got[830:].view(torch.int16), torch.zeros(10, 2, 16, dtype=torch.int16))


def test_the_agent_round_records_every_candidate(tmp_path):
    """eval/agent/round.sh on the interpreter's tiny grid: the run is initialised, the prompt
    written, each candidate proposed as the agent's (a source with its docstring's first
    paragraph as the note, a .json config delta with its note), audited (it passes the gate),
    and the run directory, status and next prompt come back."""
    import json
    import os
    import subprocess
    import tarfile

    env = dict(os.environ, AGENT_GRID="tiny", AGENT_DEVICE="cpu", TRITON_INTERPRET="1")
    proc = subprocess.run(["bash", "eval/agent/round.sh", str(tmp_path), "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    candidates = sorted((REPO / "eval" / "agent").glob("attention_*.py")) + sorted(
        (REPO / "eval" / "agent").glob("attention_*.json"))
    audits = sorted(tmp_path.glob("audit_*.json"))
    assert len(audits) == len(candidates) >= 2  # a source and config deltas
    assert all(json.loads(a.read_text())["passed"] for a in audits)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["by_proposer"] == {"agent": len(candidates)}, status["by_proposer"]
    assert (tmp_path / "prompt_round_start.md").stat().st_size > 0 and (tmp_path / "prompt_next_round.md").exists()
    with tarfile.open(tmp_path / "attention_run.tgz") as tar:
        actions = [json.loads(tar.extractfile(n).read()) for n in tar.getnames() if "/actions/" in n]
        records = {n.rsplit("/", 1)[1]: json.loads(tar.extractfile(n).read())
                   for n in tar.getnames() if "/candidates/" in n and n.endswith(".json")}
    assert all(a["proposer"] == "agent" for a in actions)
    assert sorted(a["note"].split(":")[0] for a in actions) == sorted(c.name for c in candidates)
    assert all(a["note"].split(": ", 1)[1].startswith("Agent candidate") for a in actions)
    # a .json candidate is recorded as a config delta on the incumbent
    deltas = [r["delta"] for r in records.values() if r.get("kind") == "config"]
    assert {"prefill_pack_heads": 2, "prefill_order_chunk": 8} in deltas


def test_a_config_delta_needs_a_config_parent(tmp_path):
    """A source candidate has no config to move (its code is the change): a delta on it is
    refused, naming --parent; the same delta on the root is recorded (round.sh proposes its
    .json candidates on the root, since a source may have been promoted earlier in the round)."""
    from areal_tik.optimize.records import RunError

    op = AttentionOp("tiny")
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    source = evaluator.propose(run, op, source_path=REPO / "eval" / "agent" / "attention_gqa_pack_chunked.py",
                               proposer="agent")
    delta = {"prefill_pack_heads": 2, "prefill_order_chunk": 4}
    with pytest.raises(RunError, match=f"needs a config parent, and {source.id} is a source candidate.*--parent"):
        evaluator.propose(run, op, delta=delta, parent=source.id)
    cand = evaluator.propose(run, op, delta=delta, parent="root")
    assert cand.kind == "config" and cand.config["prefill_order_chunk"] == 4 and cand.parent == "root"

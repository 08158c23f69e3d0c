"""The optimize commands end to end on CPU (tiny grids, interpreter): init -> propose ->
audit -> promote -> status -> prompt, the mechanical proposer producing a run directory,
and the attention contract deciding which knobs are free."""
import argparse
import dataclasses
import json

import pytest
import torch

from areal_tik.optimize import cli, evaluator, prompt
from areal_tik.optimize.records import RunDir


def _main(*argv) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(list(argv)))


def test_the_areal_tik_entry_point_takes_the_run_directory(tmp_path, capsys):
    """``areal-tik optimize ... --run RUN`` as the README writes it: the top-level parser keeps
    its command's entry point in ``args.run``, which a ``--run`` option must not overwrite
    (it did: 'str' object is not callable)."""
    from areal_tik.cli import main as areal_tik

    run_dir = str(tmp_path / "run")
    assert areal_tik(["optimize", "init", "--run", run_dir, "--op", "linear", "--grid", "tiny",
                      "--device", "cpu", "--coefficients", "uniform"]) == 0
    assert areal_tik(["optimize", "status", "--run", run_dir, "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n"):])["op"] == "linear"


def test_commands_drive_a_run_and_refuse_a_second_init(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert _main("init", "--run", run_dir, "--op", "linear", "--grid", "tiny", "--device", "cpu",
                 "--coefficients", "uniform") == 0
    assert _main("init", "--run", run_dir, "--op", "linear", "--grid", "tiny", "--device", "cpu") == 2
    assert "already holds an optimisation run" in capsys.readouterr().err
    delta = {"b4:24x32": {"block_m": 16, "block_n": 32, "block_k": 16}}
    assert _main("propose", "--run", run_dir, "--delta", json.dumps(delta), "--proposer", "agent",
                 "--tokens", "321", "--note", "wider tile at decode") == 0
    cand = capsys.readouterr().out.strip()
    assert _main("propose", "--run", run_dir, "--delta", json.dumps(delta)) == 2  # tried already
    assert f"is candidate {cand}" in capsys.readouterr().err
    assert _main("audit", "--run", run_dir, cand, "--rounds", "1") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"], result
    code = _main("promote", "--run", run_dir, result["audit"])
    run = RunDir(run_dir)
    assert (code == 0) == result["promotable"]
    assert run.state().best == (cand if result["promotable"] else "root")
    assert _main("propose", "--run", run_dir, "--opportunity", "m=1 streams the weight twice",
                 "--workloads", "tiny.a.m1") == 0
    capsys.readouterr()
    assert _main("status", "--run", run_dir, "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["candidates"] == 1 and status["passing"] == 1 and status["budget"]["tokens_used"] == 321
    assert status["opportunities"][0]["workloads"] == ["tiny.a.m1"]
    assert [e["kind"] for e in run.events()][:3] == ["init", "propose", "audit"]
    assert run.get("actions", "x0002").proposer == "agent"  # one action per proposal


def test_mechanical_proposer_end_to_end_writes_a_consistent_run(tmp_path):
    from areal_tik.optimize.proposers import Mechanical, SearchConfig

    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform", cap=1.5)
    ev = evaluator.Evaluator(run, rounds=1)
    Mechanical(run, ev, SearchConfig(budget_s=120, generations=1, rungs=2, finalists=2),
               log=lambda *a: None).search()
    state, cands = run.state(), run.all("candidates")
    moves = evaluator.make_op("linear", "tiny").moves({})
    assert len(cands) >= 1 + len(moves)  # root, every move (and possibly a merge)
    for cand in cands:
        lineage = run.get("lineage", cand.id)
        assert lineage.parent == cand.parent and state.graph[cand.id] == cand.parent
        assert lineage.status in ("eliminated", "survivor", "failed", "passed", "promoted", "archived")
    audits = run.all("audits")
    assert audits and all(a.evaluator_hash == run.config.evaluator_hash for a in audits)
    promotes = [e for e in run.events() if e["kind"] == "promote"]
    if state.best != "root":  # a promotion is recorded with the audit that allowed it
        best = run.best()
        assert run.get("audits", best.audit).promotable and best.speedup > 1.0 and promotes
    else:
        assert not promotes and not any(a.promotable for a in audits)
    text = prompt.build_prompt(run, ev.op, seed=1)
    assert "Row-invariant bits" in text or "row-invariant bits" in text
    assert "| tiny.b.m40 |" in text and "## Earlier variants" in text
    assert "forward(x2d [M, K] bf16, weight [N, K] bf16, bias None)" in text
    shown = [a for a in prompt.sample_variants(run, seed=1)]
    speeds = [a.t_incumbent / a.t_candidate for a in shown]
    buckets = [next(b[2] for b in prompt.BUCKETS if b[0] <= s < b[1]) for s in speeds]
    assert len(set(buckets)) == len(buckets)  # from distinct performance buckets


def test_prompt_variants_say_where_they_won_and_lost():
    """A variant in the prompt carries its audit's verdict, candidate/root per workload kind and
    the workloads it lost (the H100's round 2: one order lost at batch 16, the other at batch 1)."""
    from areal_tik.optimize.records import Audit

    w = lambda name, cand, root: {"name": name, "coefficient": 1.0, "candidate_us": cand,
                                  "incumbent_us": root, "root_us": root}
    audit = Audit(id="a0006", candidate="c0004", incumbent="root", passed=True, promotable=False,
                  reasons=["prefill.b16.4k: 1.057x the root's latency (cap 1.05x)"], checks={},
                  workloads=[w("prefill.b1.4k", 92.0, 100.0), w("prefill.b16.4k", 105.7, 100.0),
                             w("train.b1.4k+128", 91.0, 100.0), w("decode.b1.c128", 50.0, 50.0)],
                  t_candidate=1.0, t_incumbent=1.0, t_root=1.0)
    text = prompt.workload_evidence(audit)
    assert "not promoted: prefill.b16.4k: 1.057x the root's latency (cap 1.05x)" in text
    assert "prefill 0.920-1.057x; train 0.910-0.910x; decode 1.000-1.000x" in text
    assert "slower than the root: prefill.b16.4k 1.057x" in text and "prefill.b1.4k 0.920x" not in text
    promoted = dataclasses.replace(audit, promotable=True, reasons=[],
                                   workloads=[w("prefill.b1.4k", 92.0, 100.0)])
    assert "promotable" in prompt.workload_evidence(promoted) and "slower than the root: none" in \
        prompt.workload_evidence(promoted)


def test_attention_contract_passes_a_scheduling_knob_and_refuses_a_numerics_knob():
    op = evaluator.make_op("attention", "tiny")
    root = op.config_impl(op.root_config())
    free = op.config_impl({**op.root_config(), "stages_decode": 2, "prefill_subtiles": 1})
    for name, check in op.contract(torch.device("cpu")):
        check(free, root)  # raises CheckFailed on any differing bit
    tile = op.config_impl({**op.root_config(), "block_n": 8})
    with pytest.raises(AssertionError, match="differ in bits"):
        dict(op.contract(torch.device("cpu")))["root_bits"](tile, root)


def test_attention_moves_reach_the_packed_heads_and_the_chunked_order():
    """The knobs the agent's rounds found (two heads of a KV group per prefill program; the
    chunked launch order) are moves of the mechanical search; they touch prefill and training
    workloads only."""
    op = evaluator.make_op("attention", "h200")
    root = op.root_config()
    moves = op.moves(root)
    assert {"prefill_pack_heads": 2} in moves and {"prefill_order_chunk": 8} in moves
    assert {"prefill_pack_heads": 0} not in moves and not any(m.get("prefill_order_chunk") == 0 for m in moves)
    at_8 = op.moves({**root, "prefill_order_chunk": 8})
    assert {"prefill_order_chunk": 16} in at_8 and {"prefill_order_chunk": 4} in at_8
    assert {"prefill_order_chunk": 0} in op.moves({**root, "prefill_order_chunk": 1})
    # packing more heads than the program has sub-tiles is refused by the config, so not a move
    assert {"prefill_pack_heads": 4} not in op.moves({**root, "prefill_pack_heads": 2})
    workloads = {w.kind: w for w in op.workloads("h200")}
    delta = {"prefill_pack_heads": 2, "prefill_order_chunk": 8}
    assert op.affects(delta, workloads["prefill"]) and op.affects(delta, workloads["train"])
    assert not op.affects(delta, workloads["decode"])


def test_attention_moves_reach_the_decode_head_split():
    """Decode's head-group split threshold is a move (x2 / /2, down to 0: never split, and
    from 0 back to 1) that touches decode workloads only."""
    op = evaluator.make_op("attention", "h200")
    root = op.root_config()
    assert root["decode_programs_per_sm"] == 2
    moves = op.moves(root)
    assert {"decode_programs_per_sm": 4} in moves and {"decode_programs_per_sm": 1} in moves
    assert {"decode_programs_per_sm": 0} in op.moves({**root, "decode_programs_per_sm": 1})
    assert op.moves({**root, "decode_programs_per_sm": 0}).count({"decode_programs_per_sm": 1}) == 1
    workloads = {w.kind: w for w in op.workloads("h200")}
    delta = {"decode_programs_per_sm": 4}
    assert op.affects(delta, workloads["decode"])
    assert not op.affects(delta, workloads["prefill"]) and not op.affects(delta, workloads["train"])


def test_the_attention_grid_is_the_48_workloads():
    ws = evaluator.make_op("attention", "h200").workloads("h200")
    assert len(ws) == 48 and len({w.name for w in ws}) == 48
    kinds = {k: [w for w in ws if w.kind == k] for k in ("prefill", "train", "decode")}
    assert all(len(v) == 16 for v in kinds.values())
    assert {(w.params["batch"], w.params["seqlen"]) for w in kinds["train"]} == {
        (b, n + 128) for b in (1, 4, 8, 16) for n in (1024, 4096, 8192, 16384)}
    assert {w.params["context"] for w in kinds["decode"]} == {128, 1024, 4096, 8192}

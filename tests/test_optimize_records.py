"""The optimisation IR: record round trips, refusing re-initialisation, immutability, the
serialised append-only event log, the promotion rule and the hash binding."""
import json
import multiprocessing
import shutil

import pytest

from areal_tik.optimize import binding, records
from areal_tik.optimize.evaluator import decide, promote
from areal_tik.optimize.ops import Workload
from areal_tik.optimize.records import (Action, Audit, Best, Candidate, Lineage, RunConfig, RunDir,
                                        RunError, State)


def _config(**kw):
    base = dict(op="linear", grid="tiny", device="cpu", cap=1.05, seed=0, workloads=[],
                workloads_hash="w", evaluator_hash="e", evaluator_files={}, root_hash="r",
                root_files={}, root_config={})
    return RunConfig(**{**base, **kw})


def _run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run", _config(), Candidate("root", None, "root", {}, {}, proposer="root"))


SAMPLES = [
    _config(workloads=[{"name": "a", "kind": "linear", "params": {"m": 1}, "coefficient": 0.5}]),
    Candidate("c0001", "root", "config", {"x": 1}, {"x": 1}, proposer="mechanical", note="n"),
    Action("x0001", "c0001", "agent", "why", tokens=123),
    Audit("a0001", "c0001", "root", True, False, ["slow"], {"root_bits": "ok"},
          [{"name": "a", "coefficient": 1.0, "candidate_us": 2.0, "incumbent_us": 1.0, "root_us": 1.0}],
          2.0, 1.0, 1.0, 3, 0.5, "e", "w"),
    Lineage("c0001", "root", 1, ["root"], "passed", ["a0001"], ["rung 0: 0.9"]),
    State("root", "root", {"root": None}, [], [], [{"note": "idea"}], {"candidates_used": 0}, 5),
    Best("root", None, 1.0, 1.0, 1.0),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_records_round_trip_through_json(record):
    data = json.loads(json.dumps(record.to_json()))
    assert data["schema_version"] == records.SCHEMA_VERSION
    assert type(record).from_json(data) == record


def test_records_refuse_other_schema_versions_and_unknown_fields():
    data = SAMPLES[1].to_json()
    with pytest.raises(RunError, match="schema_version 99"):
        Candidate.from_json({**data, "schema_version": 99})
    with pytest.raises(RunError, match="unknown fields"):
        Candidate.from_json({**data, "surprise": 1})


def test_a_run_is_never_initialised_twice_and_resumes(tmp_path):
    run = _run(tmp_path)
    run.put(Candidate("c0001", "root", "config", {"x": 1}, {"x": 1}))
    with pytest.raises(RunError, match="already holds an optimisation run"):
        RunDir.create(tmp_path / "run", _config(op="attention"), Candidate("root", None, "root", {}, {}))
    again = RunDir(tmp_path / "run")  # resumed: nothing lost, config untouched
    assert again.config.op == "linear"
    assert [c.id for c in again.all("candidates")] == ["c0001", "root"]
    with pytest.raises(RunError, match="no optimisation run"):
        RunDir(tmp_path / "elsewhere")


def test_candidates_and_audits_are_immutable_and_ids_unique(tmp_path):
    run = _run(tmp_path)
    cand = Candidate("c0001", "root", "config", {"x": 1}, {"x": 1})
    run.put(cand)
    with pytest.raises(RunError, match="immutable"):
        run.put(Candidate("c0001", "root", "config", {"x": 2}, {"x": 2}))
    assert run.get("candidates", "c0001") == cand
    ids = [run.new_id("c") for _ in range(3)]
    assert len(set(ids)) == 3
    assert not list((tmp_path / "run").rglob("*.tmp"))  # atomic writes leave no temporaries


def _append_events(path, n):
    run = RunDir(path)
    for i in range(n):
        run.event("tick", i=i)


def test_event_log_is_append_only_and_serialised_across_processes(tmp_path):
    run = _run(tmp_path)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_events, args=(run.path, 25)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    events = run.events()
    assert [e["seq"] for e in events] == list(range(len(events)))  # one writer at a time
    assert events[0]["kind"] == "init" and sum(e["kind"] == "tick" for e in events) == 50


W = [Workload("a", "x", {}, 1.0), Workload("b", "x", {}, 2.0)]


def test_promotion_rule_needs_every_workload_within_the_cap_and_strictly_lower_t():
    root = {"a": 10.0, "b": 10.0}
    ok, reasons, t_c, t_i, t_r = decide(W, {"a": 9.0, "b": 10.4}, root, root, 1.05)
    assert ok and not reasons and (t_c, t_i, t_r) == (9.0 + 20.8, 30.0, 30.0)
    # b at 1.06x the root breaks the cap even though T falls
    ok, reasons, *_ = decide(W, {"a": 5.0, "b": 10.6}, root, root, 1.05)
    assert not ok and reasons == ["b: 1.060x the root's latency (cap 1.05x)"]
    # equal T is not an improvement (strictly lower is required)
    ok, reasons, *_ = decide(W, {"a": 10.0, "b": 10.0}, root, root, 1.05)
    assert not ok and "not below the incumbent" in reasons[0]
    # against an incumbent faster than the root: must beat the incumbent, not the root
    ok, reasons, *_ = decide(W, {"a": 9.0, "b": 9.0}, {"a": 8.0, "b": 9.0}, root, 1.05)
    assert not ok and "not below the incumbent's 26" in reasons[0]


def test_cap_skips_only_workloads_running_the_roots_own_launch():
    root = {"a": 10.0, "b": 10.0}
    # b over the cap: blocks promotion unless b runs the root's launch
    ok, reasons, *_ = decide(W, {"a": 5.0, "b": 10.6}, root, root, 1.05, frozenset({"b"}))
    assert ok and not reasons
    ok, reasons, *_ = decide(W, {"a": 5.0, "b": 10.6}, root, root, 1.05, frozenset({"a"}))
    assert not ok and reasons == ["b: 1.060x the root's latency (cap 1.05x)"]
    # the exempt workload's time still counts in T
    ok, reasons, t_c, *_ = decide(W, {"a": 9.0, "b": 11.0}, root, root, 1.05, frozenset({"b"}))
    assert not ok and t_c == 9.0 + 22.0 and "not below the incumbent" in reasons[0]


def test_same_launch_workloads_follow_the_ops_table_and_fields():
    from areal_tik.optimize.evaluator import same_launch_workloads
    from areal_tik.optimize.op_attention import AttentionOp
    from areal_tik.optimize.op_linear import LinearOp, group_key
    from areal_tik.optimize.records import Candidate

    lin = LinearOp("tiny")
    ws = lin.workloads("tiny")
    w0 = ws[0]
    key = group_key(w0.params["m"], w0.params["n"], w0.params["k"])
    cand = Candidate("c1", "root", "config", {}, {key: {}}, proposer="manual")
    same = same_launch_workloads(lin, cand, {}, ws)
    changed = {w.name for w in ws if group_key(w.params["m"], w.params["n"], w.params["k"]) == key}
    assert w0.name in changed and same == {w.name for w in ws} - changed
    # a source candidate is new code everywhere
    src = Candidate("c2", "root", "source", {}, {}, proposer="agent")
    assert same_launch_workloads(lin, src, {}, ws) == frozenset()

    att = AttentionOp("tiny")
    aws = att.workloads("tiny")
    root = att.normalise(att.root_config())
    kinds = {w.name: w.kind for w in aws}
    assert {"decode", "prefill"} <= set(kinds.values())

    def cand_of(**delta):
        return Candidate("c3", "root", "config", delta, att.apply(root, delta), proposer="manual")
    same = same_launch_workloads(att, cand_of(stages_decode=root["stages_decode"] + 1), root, aws)
    assert same == {n for n, k in kinds.items() if k != "decode"}
    same = same_launch_workloads(att, cand_of(stages_prefill=root["stages_prefill"] + 1), root, aws)
    assert same == {n for n, k in kinds.items() if k == "decode"}
    assert same_launch_workloads(att, cand_of(unmasked_loop=not root["unmasked_loop"]), root, aws) == frozenset()
    same_as_root = Candidate("c4", "root", "config", {}, dict(root), proposer="manual")
    assert same_launch_workloads(att, same_as_root, root, aws) == set(kinds)  # affects({}) is False


def _audit(run, key, cand, incumbent, promotable):
    audit = Audit(key, cand, incumbent, True, promotable, [] if promotable else ["slow"], {}, [],
                  8.0, 10.0, 10.0, 3, 0.1, run.config.evaluator_hash, run.config.workloads_hash)
    run.put(audit)
    return audit


def test_promote_takes_only_a_promotable_audit_against_the_current_incumbent(tmp_path):
    run = _run(tmp_path)
    for key in ("c0001", "c0002"):
        run.put(Candidate(key, "root", "config", {"x": key}, {"x": key}))
        run.put(Lineage(key, "root", 1, ["root"]))
    _audit(run, "a0001", "c0001", "root", False)
    with pytest.raises(RunError, match="not promotable"):
        promote(run, "a0001")
    _audit(run, "a0002", "c0001", "root", True)
    _audit(run, "a0003", "c0002", "root", True)
    best = promote(run, "a0002")
    assert best.speedup == pytest.approx(10.0 / 8.0)
    state = run.state()
    assert state.best == "c0001" and state.archive == ["root"]
    assert run.get("lineage", "c0001").status == "promoted"
    with pytest.raises(RunError, match="incumbent is now c0001"):
        promote(run, "a0003")  # measured against root: stale


def test_a_changed_evaluator_source_breaks_the_hash_binding(tmp_path):
    copy = tmp_path / "evaluator"
    shutil.copytree(binding.PACKAGE, copy)
    ev_hash, ev_files = binding.evaluator_digest(copy)
    root_hash, root_files = binding.root_digest(("linear.py",), {})
    cfg = _config(evaluator_hash=ev_hash, evaluator_files=ev_files, root_hash=root_hash,
                  root_files=root_files)
    binding.check_binding(cfg, ("linear.py",), evaluator_base=copy)  # unchanged: bound
    checks = copy / "checks.py"
    checks.write_text(checks.read_text().replace("torch.equal", "torch.allclose", 1))
    with pytest.raises(binding.BindingError, match="evaluator checks.py"):
        binding.check_binding(cfg, ("linear.py",), evaluator_base=copy)
    # the root's config is part of its hash
    with pytest.raises(binding.BindingError, match="root hash"):
        binding.check_binding(_config(**{**cfg.__dict__, "root_config": {"x": 1}}), ("linear.py",))

"""The mechanical proposer's search logic on CPU: a bit-changing knob is closed and never
moved again, a generation without a promotion moves on from its survivors, and an audit
blocked by the per-workload cap yields a candidate restricted to the table entries where
it won. The timing source in the last two tests is a fake (``FakeTimingEvaluator``: a
table of latencies by config, no kernel timed); the gate and the bits are real."""

from areal_tik.optimize import evaluator
from areal_tik.optimize.op_linear import LinearOp, group_key
from areal_tik.optimize.proposers import Mechanical, SearchConfig

WIN, LOSE = "24x32", "40x48"  # the tiny linear grid's two weight shapes (N x K)


class FakeTimingEvaluator(evaluator.Evaluator):
    """Latency by config, for the proposer's logic only: 10 us where an impl runs the
    kernel's own table, ``factor[N x K]`` x 10 us where its config sets the group."""

    def __init__(self, run, factor: dict, spread: dict | None = None):
        super().__init__(run, rounds=1)
        self.factor, self.spread = factor, spread or {}  # spread: workload -> candidate's factor

    def time(self, impls, workloads, seed, rounds=None):
        out = {}
        for w in workloads:
            key = group_key(w.params["m"], w.params["n"], w.params["k"])
            shape = key.split(":")[1]
            out[w.name] = {name: 10.0 * (self.factor[shape] if key in impl.config else 1.0)
                           for name, impl in impls.items()}
            out[w.name]["candidate"] *= self.spread.get(w.name, 1.0)
        return out, []


def _quiet(*args):
    pass


def test_a_bit_changing_attention_knob_is_closed_and_not_proposed_again(tmp_path):
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    ev = evaluator.Evaluator(run, rounds=1)
    search = Mechanical(run, ev, SearchConfig(budget_s=60), log=_quiet)
    root = run.get("candidates", "root")
    # doubled: the tiny contract case's 40-token rows cross the root's split, not this one
    # (halving it is refused outright now: prefill rows per program must divide kv_split)
    split = root.config["kv_split"] * 2
    cand = evaluator.propose(run, ev.op, delta={"kv_split": split}, proposer="mechanical")
    decode = [w for w in ev.workloads if w.name == "decode.b1.c40"]
    assert search._screen(cand, root, decode, 0) is None
    closed = [o for o in run.state().opportunities if o["kind"] == "closed knob"]
    assert [(o["knob"], o["value"], o["source"]) for o in closed] == [("kv_split", split, cand.id)]
    assert "differ in bits" in closed[0]["note"]
    assert run.get("lineage", cand.id).status == "failed"
    moved = [set(c.delta) for c in search._propose([root], root, 1)]
    assert moved and all("kv_split" not in knobs for knobs in moved)


def test_a_generation_without_a_promotion_moves_on_from_its_survivors(tmp_path):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    ev = FakeTimingEvaluator(run, {WIN: 1.01, LOSE: 1.02})  # every move a little slower
    Mechanical(run, ev, SearchConfig(budget_s=60, generations=2, parents=2), log=_quiet).search()
    first = {c.id for c in run.all("candidates") if c.parent == "root"}
    second = [c for c in run.all("candidates") if c.parent not in (None, "root")]
    assert second and {c.parent for c in second} <= first and len({c.parent for c in second}) == 2
    for c in second:  # a move on the survivor's config, not the root's
        assert c.config == ev.op.apply(run.get("candidates", c.parent).config, c.delta)
    assert any(len(c.config) == 2 for c in second)  # the survivor's group and the other one
    assert run.state().best == "root" and not run.all("audits")


def test_a_cap_blocked_audit_yields_a_promotable_restricted_delta(tmp_path):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    ev = FakeTimingEvaluator(run, {WIN: 0.8, LOSE: 1.06})  # wins on one group, breaks the cap on the other
    search = Mechanical(run, ev, SearchConfig(budget_s=120), log=_quiet)
    moves = ev.op.moves({})
    rows = moves[0][next(iter(moves[0]))]  # one geometry for every group
    delta = {key: rows for key in {k for m in moves for k in m}}
    both = evaluator.propose(run, ev.op, delta=delta, proposer="mechanical")
    assert search._finish([(both, 0.9)], run.get("candidates", "root"), 0)
    first, second = run.all("audits")
    assert first.candidate == both.id and first.passed and not first.promotable
    assert any("cap 1.05x" in r for r in first.reasons)
    best = run.get("candidates", run.state().best)
    assert second.promotable and best.id == second.candidate and best.config == {k: v for k, v in delta.items() if k.endswith(WIN)}
    assert f"{both.id} restricted" in best.note and run.best().speedup > 1.0


def _win_candidate(run, ev):
    rows = ev.op.moves({})[0][next(iter(ev.op.moves({})[0]))]
    delta = {key: rows for key in {k for m in ev.op.moves({}) for k in m} if key.endswith(WIN)}
    return evaluator.propose(run, ev.op, delta=delta, proposer="mechanical")


def test_a_cap_broken_only_where_the_candidate_runs_the_roots_launch_does_not_block(tmp_path):
    # tiny.b.m5 (shape 40x48) is a group the candidate does not set: the root's own launch,
    # timed 1.06x the root (the timing's spread); every group it sets won.
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    ev = FakeTimingEvaluator(run, {WIN: 0.8, LOSE: 1.0}, spread={"tiny.b.m5": 1.06})
    cand = _win_candidate(run, ev)
    assert Mechanical(run, ev, SearchConfig(budget_s=120), log=_quiet)._finish(
        [(cand, 0.9)], run.get("candidates", "root"), 0)
    (audit,) = run.all("audits")
    assert audit.promotable and run.state().best == cand.id
    rows = {r["name"]: r for r in audit.workloads}
    assert rows["tiny.b.m5"]["candidate_us"] == 1.06 * rows["tiny.b.m5"]["root_us"]
    assert {n for n, r in rows.items() if r["same_launch"]} == {n for n in rows if n.startswith("tiny.b.")}


def test_a_cap_broken_where_the_candidate_changes_the_launch_blocks(tmp_path):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    ev = FakeTimingEvaluator(run, {WIN: 0.8, LOSE: 1.0}, spread={"tiny.a.m5": 1.4})  # 1.12x there
    cand = _win_candidate(run, ev)
    search = Mechanical(run, ev, SearchConfig(budget_s=120), log=_quiet)
    assert not search._finish([(cand, 0.9)], run.get("candidates", "root"), 0)
    first = run.all("audits")[0]
    assert first.passed and not first.promotable and first.reasons[0].startswith("tiny.a.m5: 1.120x")
    assert run.state().best == "root"


class CrashingEvaluator(FakeTimingEvaluator):
    """As FakeTimingEvaluator, but a candidate whose config sets ``group`` to ``bad``
    crashes on that group's workloads (as an out-of-shared-memory compile does)."""

    def __init__(self, run, factor, group, bad):
        super().__init__(run, factor)
        self.group, self.bad = group, bad

    def time(self, impls, workloads, seed, rounds=None):
        cand = impls["candidate"]
        hit = [w.name for w in workloads if cand.config.get(self.group) == self.bad
               and group_key(w.params["m"], w.params["n"], w.params["k"]) == self.group]
        if hit:
            return {}, [f"{hit[0]}: candidate crashed: OutOfResources: out of resource: shared memory"]
        return super().time(impls, workloads, seed, rounds)


def test_a_crashed_move_is_not_proposed_again_where_it_would_launch_the_same_kernel(tmp_path):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    moves = LinearOp("tiny").moves({})
    (group, bad), = moves[0].items()
    other = next(m for m in moves if group not in m)  # a move of another group
    ev = CrashingEvaluator(run, {WIN: 1.0, LOSE: 1.0}, group, bad)
    search = Mechanical(run, ev, SearchConfig(budget_s=60), log=_quiet)
    root = run.get("candidates", "root")
    crash = evaluator.propose(run, ev.op, delta={group: bad}, proposer="mechanical")
    assert search._screen(crash, root, ev.workloads, 0) is None
    (opp,) = [o for o in run.state().opportunities if o["kind"] == "infeasible"]
    assert opp["source"] == crash.id and opp["config"] == crash.config
    # the same entry on a parent that differs only in another group: not proposed again
    parent = evaluator.propose(run, ev.op, delta=other, proposer="mechanical")
    moved = search._propose([parent], root, 1)
    assert moved and not any(c.config.get(group) == bad for c in moved)
    # that entry with a different geometry of the same group is still proposed
    assert any(group in c.config and c.config[group] != bad for c in moved)
    assert not search.infeasible(parent.config) and search.infeasible(ev.op.apply(parent.config, {group: bad}))

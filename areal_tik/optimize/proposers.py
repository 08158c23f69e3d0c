"""The mechanical proposer: one-knob moves from the incumbent, successive halving, audits.

A generation: every move of ``op.moves(incumbent)`` not tried before becomes a candidate.
Successive halving then spends little time on many candidates and more on few: rung r
times the survivors (paired with the incumbent and root, bits compared with the root's
on every workload) on a growing share of the workloads (1/4, 1/2, all for three rungs)
with r + 1 rounds, and within each group of competing moves (moves of the same knob, or
of the same linear row bucket and shape) keeps the better half of those faster than the
incumbent. A move whose bits differ is a failed audit at once. The survivors' best move
per group are merged into one candidate when they touch different knobs; the merged
candidate and the best survivors get full audits (gate + paired timing on all
workloads) and the fastest promotable one is promoted. Generations repeat from the new
incumbent until the generation count, the time budget or a lack of new moves ends it.

A generation that promotes nothing does not end the search: the next one moves on from
its best timed candidates (the "survivors", faster or not: two knobs that are each a
little slower alone may be faster together). A move whose bits differ from the root's
closes its knob (``op.closed_knobs``): a "closed knob" opportunity is recorded in the
state and no later move touches that knob (the contract fixes it; the attention run at
8443ba9 found kv_split so). An audit that passes the gate but breaks the per-workload
cap yields a restricted candidate (``op.restrict``): the delta cut down to the table
entries whose every workload was faster than the root in that audit, audited next.
A move that crashes (at the H200 at 796df79: out of shared memory, ten times, the same three
moves from different parents) records an "infeasible" opportunity, and a later move whose
config would launch that same kernel on the crashed workload is not proposed.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time

from .evaluator import Evaluator, deadline, promote, propose
from .ops import changed_entries
from .records import RunDir, RunError


@dataclasses.dataclass
class SearchConfig:
    budget_s: float = 300.0  # wall-clock budget of the whole search
    generations: int = 8
    rungs: int = 3
    finalists: int = 3  # full audits per generation (the merged candidate first)
    parents: int = 3  # survivors a generation without a promotion moves on from
    max_candidates: int = 4096  # the time budget usually ends a search first

    def __post_init__(self):
        for name in ("budget_s", "generations", "rungs", "finalists", "parents", "max_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")


def _key(delta: dict) -> tuple:
    return tuple(sorted(delta))


def _diff(base: dict, config: dict) -> dict:
    """The delta that turns ``base`` into ``config`` (both full, normalised configs)."""
    return {k: v for k, v in config.items() if base.get(k) != v}


def _weighted(workloads, times, name) -> float:
    return sum(w.coefficient * times[w.name][name] for w in workloads)


class Mechanical:
    def __init__(self, run: RunDir, evaluator: Evaluator, cfg: SearchConfig, log=print):
        self.run, self.ev, self.cfg, self.log = run, evaluator, cfg, log
        self.op = evaluator.op
        self.end = time.time() + cfg.budget_s
        self.rng = random.Random(run.config.seed)
        self.timed: dict = {}
        with run.locked():
            state = run.state()
            state.budget["candidates_max"] = cfg.max_candidates
            run.save_state(state)

    def left(self) -> float:
        return self.end - time.time()

    def search(self) -> None:
        parents = None  # None: move from the incumbent
        for gen in range(self.cfg.generations):
            if self.left() <= 0:
                break
            incumbent = self.run.get("candidates", self.run.state().best)
            self.timed = {}  # candidate id -> (candidate, rung-0 score) of this generation
            cands = self._propose(parents or [incumbent], incumbent, gen)
            self.log(f"generation {gen}: incumbent {incumbent.id}, from {[p.id for p in parents or [incumbent]]}"
                     f", {len(cands)} new candidates")
            if not cands:
                if parents is None:
                    break
                parents = None  # the survivors' moves are spent: back to the incumbent's
                continue
            survivors = self._halve(cands, incumbent)
            if self._finish(survivors, incumbent, gen):
                parents = None
            else:
                ranked = sorted(self.timed.values(), key=lambda cs: cs[1])
                parents = [c for c, _ in ranked[:self.cfg.parents]] or None

    def closed(self) -> set:
        return {o["knob"] for o in self.run.state().opportunities if o.get("kind") == "closed knob"}

    def crashed(self) -> list:
        return [o for o in self.run.state().opportunities if o.get("kind") == "infeasible"]

    def infeasible(self, config: dict, crashed=None) -> bool:
        """Would ``config`` launch, on a workload where an earlier candidate crashed (out of
        shared memory, say), exactly that candidate's kernel? Then it crashes there too:
        its config differs from the crashed one only in fields or entries that do not
        reach that workload's launch (``op.affects``)."""
        names = {w.name: w for w in self.ev.workloads}
        for o in self.crashed() if crashed is None else crashed:
            diff = changed_entries(o["config"], config)
            if any(n in names and not self.op.affects(diff, names[n]) for n in o["workloads"]):
                return True
        return False

    def _propose(self, parents, incumbent, gen) -> list:
        tried = {str(c.config) for c in self.run.all("candidates") if c.kind != "source"}
        closed, crashed, out = self.closed(), self.crashed(), []
        for parent in parents:
            for delta in self.op.moves(parent.config):
                if self.run.state().budget["candidates_used"] >= self.cfg.max_candidates:
                    return out
                config = self.op.apply(parent.config, delta)
                if str(config) in tried or closed & set(self.op.closed_knobs(delta)) or self.infeasible(config, crashed):
                    continue
                out.append(propose(self.run, self.op, delta=delta, parent=parent.id, proposer="mechanical",
                                   note=f"generation {gen}: move {delta} from {parent.id}",
                                   check_duplicates=False))
                tried.add(str(config))
        return out

    def _impls(self, incumbent, cand) -> dict:
        impls = {"root": self.ev.root, "candidate": self.ev.impl(cand)}
        if incumbent.id != "root":
            impls["incumbent"] = self.ev.impl(incumbent)
        return impls

    def _halve(self, cands, incumbent) -> list:
        # Rung 0 (many candidates, each compiled once) may use half of the time left, the
        # later rungs another quarter; the last quarter is kept for the final audits. A rung
        # cut short keeps what it timed.
        order = list(self.ev.workloads)
        self.rng.shuffle(order)
        alive = [(c, 0.0) for c in cands]
        start, span, rungs = time.time(), self.left(), self.cfg.rungs
        for r in range(rungs):
            share = order[:math.ceil(len(order) * 2 ** (r - rungs + 1))]
            until = start + span * (0.5 + (0.25 * r / (rungs - 1) if rungs > 1 else 0.0))
            scored = []
            for cand, previous in alive:
                if time.time() > until:
                    if r == 0:
                        self._note(cand.id, "not timed (budget)", "eliminated")
                    else:  # keep its score from the rung before
                        scored.append((cand, previous))
                    continue
                score = self._screen(cand, incumbent, share, r)
                if score is not None:
                    scored.append((cand, score))
            alive = self._keep(scored, r)
            self.log(f"  rung {r}: {len(share)} workloads, {len(scored)} timed, {len(alive)} kept")
        return alive

    def _screen(self, cand, incumbent, share, rung):
        delta = _diff(incumbent.config, cand.config)
        ws = [w for w in share if self.op.affects(delta, w)]
        if not ws:
            ws = [w for w in self.ev.workloads if self.op.affects(delta, w)][:max(1, len(share))]
        start = time.time()
        try:
            with deadline(self.ev.timeout_s):
                impls = self._impls(incumbent, cand)
                times, failures = self.ev.time(impls, ws, seed=self.ev._seed() + 101 * rung, rounds=rung + 1)
        except Exception as e:
            times, failures = {}, [f"build: {type(e).__name__}: {str(e)[:400]}"]
        if failures:  # changed bits or crashed: a failed audit with its reason
            self.ev._record(cand, incumbent.id, False, False, failures,
                            {f"screen[rung {rung}]": failures[0]}, [], (0.0, 0.0, 0.0),
                            time.time() - start)
            if any("differ in bits" in f for f in failures):
                self._close(cand, failures[0])
            crashed = [f.split(":", 1)[0] for f in failures if ": candidate crashed: " in f]
            if crashed:
                self._infeasible(cand, crashed, failures[0])
            return None
        self.ev.spend(time.time() - start)
        ref = "incumbent" if "incumbent" in impls else "root"
        score = _weighted(ws, times, "candidate") / _weighted(ws, times, ref)
        self._note(cand.id, f"rung {rung}: T ratio {score:.4f} vs {incumbent.id} on {len(ws)} workloads")
        if rung == 0:
            self.timed[cand.id] = (cand, score)
        return score

    def _close(self, cand, reason: str) -> None:
        """Record the knobs a bit-changing one-knob move touched as closed (the contract fixes them)."""
        knobs = self.op.closed_knobs(cand.delta)
        with self.run.locked():
            state = self.run.state()
            known = {o["knob"] for o in state.opportunities if o.get("kind") == "closed knob"}
            for knob in knobs:
                if knob not in known:
                    state.opportunities.append({
                        "kind": "closed knob", "knob": knob, "value": cand.delta[knob], "source": cand.id,
                        "note": f"moving {knob} to {cand.delta[knob]!r} changed bits: {reason[:200]}",
                        "workloads": []})
                    self.run.event("opportunity", note=state.opportunities[-1]["note"], kind="closed knob")
                    self.log(f"  closed knob {knob} ({cand.id}: {reason[:120]})")
            self.run.save_state(state)

    def _infeasible(self, cand, workloads: list, reason: str) -> None:
        """Record a config that crashed on ``workloads``: later moves that would launch the
        same kernel there are not proposed (``infeasible``)."""
        with self.run.locked():
            state = self.run.state()
            state.opportunities.append({
                "kind": "infeasible", "config": cand.config, "source": cand.id, "workloads": workloads,
                "note": f"{cand.id} {cand.delta} crashed: {reason[:200]}"})
            self.run.event("opportunity", note=state.opportunities[-1]["note"], kind="infeasible")
            self.run.save_state(state)
        self.log(f"  infeasible {cand.id} {str(cand.delta)[:120]} on {workloads[:3]}")

    def _note(self, cand_id, note, status=None) -> None:
        with self.run.locked():
            lineage = self.run.get("lineage", cand_id)
            lineage.notes.append(note)
            lineage.status = status or lineage.status
            self.run.put(lineage)

    def _keep(self, scored, rung) -> list:
        groups: dict = {}
        for cand, score in scored:
            groups.setdefault(_key(cand.delta), []).append((cand, score))
        kept = []
        for members in groups.values():
            members.sort(key=lambda cs: cs[1])
            faster = [cs for cs in members if cs[1] < 1.0]
            keep = faster[:max(1, math.ceil(len(members) / 2))]
            kept += keep
            for cand, score in members:
                if (cand, score) not in keep:
                    self._note(cand.id, f"eliminated at rung {rung} (T ratio {score:.4f})", "eliminated")
        return kept

    def _finish(self, survivors, incumbent, gen) -> bool:
        """Audit the merged best moves and the best survivors; promote the fastest promotable."""
        best_per_key: dict = {}
        for cand, score in sorted(survivors, key=lambda cs: cs[1]):
            best_per_key.setdefault(_key(_diff(incumbent.config, cand.config)), cand)
        finalists = [c for c, _ in sorted(survivors, key=lambda cs: cs[1])]
        if len(best_per_key) > 1 and len({k for key in best_per_key for k in key}) == sum(
                len(key) for key in best_per_key):
            delta = {k: v for c in best_per_key.values() for k, v in _diff(incumbent.config, c.config).items()}
            try:
                merged = propose(self.run, self.op, delta=delta, parent=incumbent.id, proposer="mechanical",
                                 note=f"generation {gen}: merge of {[c.id for c in best_per_key.values()]}")
                finalists.insert(0, merged)
            except RunError:
                pass  # this merge was tried before
        audits = []
        for i, cand in enumerate(finalists):
            if i >= self.cfg.finalists or (i > 0 and self.left() <= 0):
                self._note(cand.id, "survived halving; not audited (finalist limit or budget)", "survivor")
                continue
            audit = self._audit(cand)
            if audit.promotable:
                audits.append(audit)
            elif audit.passed and self.left() > 0:
                restricted = self._restricted(audit, cand, incumbent, gen)
                if restricted is not None:
                    audit = self._audit(restricted)
                    audits += [audit] if audit.promotable else []
        if not audits:
            return False
        best = min(audits, key=lambda a: a.t_candidate)
        result = promote(self.run, best.id)
        self.log(f"  promoted {best.candidate}: T(root)/T = {result.speedup:.4f}")
        return True

    def _audit(self, cand):
        audit = self.ev.audit(cand.id)
        self.log(f"  audit {audit.id} of {cand.id} {str(cand.delta)[:160]}: passed={audit.passed} "
                 f"promotable={audit.promotable} {[r[:160] for r in audit.reasons[:2]]}")
        return audit

    def _restricted(self, audit, cand, incumbent, gen):
        """The candidate's delta cut to the entries where it won: a promotable candidate
        when its losses (the per-workload cap) lie on other entries than its wins."""
        winners = {r["name"] for r in audit.workloads if r["candidate_us"] < r["root_us"]}
        full = _diff(incumbent.config, cand.config)
        over = [r["name"] for r in audit.workloads if r["candidate_us"] > self.run.config.cap * r["root_us"]
                and not r.get("same_launch")]  # the cap was not applied there (``decide``)
        untouched = [w.name for w in self.ev.workloads if w.name in over and not self.op.affects(full, w)]
        if untouched:  # the incumbent's launch there (the root's were exempted): the timing's spread
            self._note(cand.id, f"{audit.id}: over the cap on workloads it does not change {untouched}")
            self.log(f"  {cand.id}: over the cap only through the timing spread on {untouched}"
                     if len(untouched) == len(over) else f"  {cand.id}: over the cap also on {untouched}, "
                     "which it does not change")
        delta = self.op.restrict(full, winners, self.ev.workloads)
        if not delta:
            return None
        try:
            return propose(self.run, self.op, delta=delta, parent=incumbent.id, proposer="mechanical",
                           note=f"generation {gen}: {cand.id} restricted to the entries whose every "
                                f"workload was faster than the root in {audit.id}")
        except RunError:
            return None  # tried before

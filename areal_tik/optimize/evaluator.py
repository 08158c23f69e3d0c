"""The evaluator: initialise a run, record proposals, audit candidates, promote.

An audit (``audit``) checks the hash binding (evaluator and root sources unchanged since
``init``), builds the candidate (a failure to compile or import is a failed audit with
its reason), runs the gate (``checks.run_gate``: contract suite and anti-hacking checks),
then times candidate, incumbent and root in one paired run over the run's workloads and
applies the promotion rule (``decide``). Every attempt is recorded, failed or not; the
incumbent changes only through ``promote`` of a promotable audit made against it.
"""
from __future__ import annotations

import contextlib
import json
import signal
import time
import traceback
from pathlib import Path

import torch

from . import binding, timing
from .checks import CheckFailed, run_gate
from .ops import OPS, changed_entries, load_source, workloads_from_json, workloads_hash
from .records import Action, Audit, Best, Candidate, Lineage, RunConfig, RunDir, RunError



def make_op(name: str, grid: str):
    if name == "attention":
        from .op_attention import AttentionOp
        return AttentionOp(grid)
    if name == "linear":
        from .op_linear import LinearOp
        return LinearOp(grid)
    if name == "logprob":
        from .op_logprob import LogprobOp
        return LogprobOp(grid)
    if name in ("norm", "rope", "swiglu"):
        from . import op_rows
        return {"norm": op_rows.NormOp, "rope": op_rows.RopeOp, "swiglu": op_rows.SwigluOp}[name](grid)
    raise ValueError(f"op must be one of {OPS}, got {name!r}")


def decide(workloads, cand: dict, inc: dict, root: dict, cap: float,
           same_launch=frozenset()) -> tuple[bool, list, float, float, float]:
    """The promotion rule on one paired run: every workload within ``cap`` x the root's
    latency, and T = sum c_w * latency_w strictly below the incumbent's T.

    ``same_launch`` names the workloads where the candidate launches exactly the root's
    kernel with the root's options (``same_launch_workloads``): there the code timed is the
    root's, a ratio over the cap is the timing's spread, and the cap is not applied
    (their times still count in T). Returns (promotable, reasons, T_candidate,
    T_incumbent, T_root)."""
    reasons = []
    t_c = sum(w.coefficient * cand[w.name] for w in workloads)
    t_i = sum(w.coefficient * inc[w.name] for w in workloads)
    t_r = sum(w.coefficient * root[w.name] for w in workloads)
    for w in workloads:
        if w.name not in same_launch and cand[w.name] > cap * root[w.name]:
            reasons.append(f"{w.name}: {cand[w.name] / root[w.name]:.3f}x the root's latency "
                           f"(cap {cap:.2f}x)")
    if not t_c < t_i:
        reasons.append(f"T = {t_c:.6g} is not below the incumbent's {t_i:.6g}")
    return not reasons, reasons, t_c, t_i, t_r


def same_launch_workloads(op, cand, root_config: dict, workloads) -> frozenset:
    """The workloads a config candidate cannot change: its config differs from the root's
    only in fields or table entries that ``op.affects`` says do not reach the workload's
    launch (a linear group of another row bucket or shape; decode stages on a prefill).
    The gate's dispatch check has already shown that the candidate's launches carry its
    config. A source candidate changes code, so it has none."""
    if cand.kind == "source":
        return frozenset()
    diff = changed_entries(root_config, cand.config)
    return frozenset(w.name for w in workloads if not op.affects(diff, w))


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Raise TimeoutError in the main thread after ``seconds`` (a hung candidate)."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise TimeoutError(f"ran past its {seconds:.0f} s timeout")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


def init_run(path, op_name: str, grid: str, device: str = "cpu", cap: float = 1.05, seed: int = 0,
             coefficients: str = "normalized") -> RunDir:
    """Create a run: freeze the workloads (with coefficients), hashes and root config.

    ``coefficients``: "normalized" sets c_w = 1 / (root latency of w), measured now, so
    every workload weighs the same in T(root) (= the number of workloads); "uniform" sets 1."""
    if coefficients not in ("normalized", "uniform"):
        raise ValueError(f"coefficients must be 'normalized' or 'uniform', got {coefficients!r}")
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1.0, got {cap!r}")
    if (Path(path) / "config.json").exists():
        raise RunError(f"{str(path)!r} already holds an optimisation run; resume it instead")
    op, dev = make_op(op_name, grid), _device(device)
    workloads = op.workloads(grid)
    root_config = op.normalise(op.root_config())
    if coefficients == "normalized":
        times, failures = timing.paired(op, {"root": op.config_impl(root_config)}, workloads, dev,
                                        reference="root", rounds=1, seed=seed)
        if failures:
            raise RuntimeError(f"the root failed while measuring coefficients: {failures[:3]}")
        workloads = [type(w)(w.name, w.kind, w.params, float(f"{1.0 / times[w.name]['root']:.6g}"))
                     for w in workloads]
    rows = [w.to_json() for w in workloads]
    ev_hash, ev_files = binding.evaluator_digest()
    root_hash, root_files = binding.root_digest(op.kernel_files, root_config)
    config = RunConfig(op=op_name, grid=grid, device=str(dev), cap=cap, seed=seed, workloads=rows,
                       workloads_hash=workloads_hash(rows), evaluator_hash=ev_hash,
                       evaluator_files=ev_files, root_hash=root_hash, root_files=root_files,
                       root_config=root_config)
    root = Candidate("root", None, "root", {}, root_config, proposer="root", note="the kernel default")
    return RunDir.create(path, config, root)


def propose(run: RunDir, op, *, delta: dict | None = None, source_path=None, parent: str | None = None,
            proposer: str = "manual", note: str = "", tokens: int = 0,
            check_duplicates: bool = True) -> Candidate:
    """Record a candidate (a config delta on ``parent``, default the incumbent, or a source
    file) with its action and lineage. A config already tried is refused, naming it."""
    if (delta is None) == (source_path is None):
        raise ValueError("give exactly one of a config delta or a source file")
    with run.locked():
        state = run.state()
        parent = parent or state.best
        base = run.get("candidates", parent)
        if delta is not None:
            if not isinstance(delta, dict) or not delta:
                raise ValueError(f"delta must be a non-empty dict of config fields, got {delta!r}")
            if base.kind == "source":  # its code, not a config, is what it changed
                raise RunError(f"a config delta needs a config parent, and {parent} is a source candidate"
                               + (" (the incumbent)" if parent == state.best else "")
                               + "; name one with --parent (root, or a config candidate)")
            config = op.apply(base.config, delta)
            for other in run.all("candidates") if check_duplicates else ():
                if other.kind != "source" and other.config == config:
                    raise RunError(f"config {json.dumps(delta)} on {parent} is candidate {other.id}")
            source, kind = None, "config"
        else:
            source, kind, config = Path(source_path).read_text(), "source", {}
        cand = Candidate(run.new_id("c"), parent, kind, delta or {}, config,
                         source_hash=binding.sha256(source) if source else "", proposer=proposer,
                         note=note)
        run.put(cand, source=source)
        parent_lineage = run.get("lineage", parent)
        run.put(Lineage(cand.id, parent, parent_lineage.depth + 1, [*parent_lineage.ancestors, parent]))
        run.put(Action(run.new_id("x"), cand.id, proposer, note, tokens))
        state = run.state()
        state.graph[cand.id] = parent
        state.budget["candidates_used"] += 1
        state.budget["tokens_used"] += tokens
        run.save_state(state)
        run.event("propose", candidate=cand.id, parent=parent, candidate_kind=kind, delta=delta or {},
                  proposer=proposer)
    return cand


class Evaluator:
    """Audits candidates of one run on one device."""

    def __init__(self, run: RunDir, *, rounds: int = 3, timeout_s: float | None = 600.0,
                 l2_flush: bool = False):
        self.run, self.rounds, self.timeout_s, self.l2_flush = run, rounds, timeout_s, l2_flush
        cfg = run.config
        self.op = make_op(cfg.op, cfg.grid)
        self.device = _device(cfg.device)
        self.workloads = workloads_from_json(cfg.workloads)
        self.root = self.op.config_impl(cfg.root_config)

    def impl(self, cand: Candidate):
        if cand.kind == "source":
            path = self.run.path / "candidates" / f"{cand.id}.py"
            if binding.sha256(path.read_text()) != cand.source_hash:
                raise CheckFailed(f"source of {cand.id} changed after it was recorded")
            return load_source(self.op, path, f"areal_tik_candidate_{cand.id}")
        return self.op.config_impl(cand.config)

    def gate(self, cand: Candidate, impl) -> dict:
        config = None if cand.kind == "source" else cand.config
        return run_gate(self.op, impl, self.root, config, self.device, self.run.config,
                        seed=self.run.config.seed + 17)

    def time(self, impls: dict, workloads, seed: int, rounds: int | None = None):
        return timing.paired(self.op, impls, workloads, self.device, reference="root",
                             rounds=rounds or self.rounds, seed=seed, l2_flush=self.l2_flush)

    def audit(self, cand_id: str) -> Audit:
        """Gate + paired timing against the current incumbent; recorded whatever happens."""
        start = time.time()
        state = self.run.state()
        cand = self.run.get("candidates", cand_id)
        incumbent = self.run.get("candidates", state.best)
        checks, reasons, rows, totals = {}, [], [], (0.0, 0.0, 0.0)
        promotable = passed = False
        try:
            with deadline(self.timeout_s):
                binding.check_binding(self.run.config, self.op.kernel_files)
                impl = self.impl(cand)
                checks = self.gate(cand, impl)
                reasons = [v for v in checks.values() if v not in ("ok", "not run")]
                if not reasons:
                    impls = {"root": self.root, "incumbent": self.impl(incumbent), "candidate": impl}
                    times, failures = self.time(impls, self.workloads, seed=self._seed())
                    if workloads_hash([w.to_json() for w in self.workloads]) != self.run.config.workloads_hash:
                        failures.append("workloads: the timed workload list changed during the audit")
                    checks["paired_bits"] = "ok" if not failures else failures[0]
                    reasons = failures
                    if not failures:
                        passed = True
                        same = same_launch_workloads(self.op, cand, self.run.config.root_config,
                                                     self.workloads)
                        rows = [{"name": w.name, "coefficient": w.coefficient,
                                 "candidate_us": times[w.name]["candidate"],
                                 "incumbent_us": times[w.name]["incumbent"],
                                 "root_us": times[w.name]["root"],
                                 "same_launch": w.name in same} for w in self.workloads]
                        cand_t = {n: t["candidate"] for n, t in times.items()}
                        inc_t = {n: t["incumbent"] for n, t in times.items()}
                        root_t = {n: t["root"] for n, t in times.items()}
                        promotable, reasons, *totals = decide(self.workloads, cand_t, inc_t, root_t,
                                                              self.run.config.cap, same)
        except Exception as e:  # binding, build, crash, timeout: a failed audit with its reason
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            reasons = [f"{type(e).__name__}: {tail[:500]}"]
        return self._record(cand, incumbent.id, passed, promotable, reasons, checks, rows, totals,
                            time.time() - start)

    def spend(self, seconds: float) -> None:
        """Add device seconds spent outside an audit (successive-halving screens)."""
        with self.run.locked():
            state = self.run.state()
            state.budget["device_s_used"] += seconds
            self.run.save_state(state)

    def _seed(self) -> int:
        return self.run.config.seed + 1 + sum(1 for _ in (self.run.path / "audits").glob("*.json"))

    def _record(self, cand, incumbent, passed, promotable, reasons, checks, rows, totals, seconds):
        t_c, t_i, t_r = totals
        audit = Audit(self.run.new_id("a"), cand.id, incumbent, passed, promotable, reasons, checks,
                      rows, t_c, t_i, t_r, self.rounds, seconds, self.run.config.evaluator_hash,
                      self.run.config.workloads_hash)
        with self.run.locked():
            self.run.put(audit)
            lineage = self.run.get("lineage", cand.id)
            lineage.audits.append(audit.id)
            if lineage.status in ("proposed", "failed", "passed", "eliminated", "survivor"):
                lineage.status = "passed" if passed else "failed"
            self.run.put(lineage)
            state = self.run.state()
            if passed and cand.id not in state.frontier and cand.id != state.best:
                state.frontier.append(cand.id)
            state.budget["device_s_used"] += seconds
            self.run.save_state(state)
            self.run.event("audit", audit=audit.id, candidate=cand.id, passed=passed,
                           promotable=promotable, reasons=reasons[:3])
        return audit


def promote(run: RunDir, audit_id: str) -> Best:
    """Make the audited candidate the incumbent; only a promotable audit made against the
    current incumbent qualifies (otherwise re-audit: the comparison is stale)."""
    with run.locked():
        audit, state = run.get("audits", audit_id), run.state()
        if not audit.promotable:
            raise RunError(f"audit {audit_id} is not promotable: {audit.reasons[:3]}")
        if audit.incumbent != state.best:
            raise RunError(f"audit {audit_id} compared against {audit.incumbent}, but the incumbent "
                           f"is now {state.best}; audit the candidate again")
        if audit.evaluator_hash != run.config.evaluator_hash:
            raise RunError(f"audit {audit_id} was made by another evaluator")
        old = state.best
        state.archive.append(old)
        state.best = audit.candidate
        state.frontier = [c for c in state.frontier if c != audit.candidate]
        run.save_state(state)
        for key, status in ((old, "archived"), (audit.candidate, "promoted")):
            lineage = run.get("lineage", key)
            lineage.status = status
            run.put(lineage)
        best = Best(audit.candidate, audit_id, audit.t_candidate, audit.t_root,
                    audit.t_root / audit.t_candidate if audit.t_candidate else 0.0)
        run.save_best(best)
        run.event("promote", candidate=audit.candidate, audit=audit_id, replaced=old,
                  speedup=best.speedup)
    return best

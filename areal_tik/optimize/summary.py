"""What a run has found: counts, failure reasons, the best audit's per-workload ratios."""
from __future__ import annotations

import collections

from .records import RunDir


def failure_kind(audit) -> str:
    """The first failing check of an audit (or the reason's head when no check ran)."""
    for name, value in audit.checks.items():
        if value not in ("ok", "not run"):
            return _kind(name, value)
    if audit.passed:
        return "not faster" if any("not below" in r for r in audit.reasons) else "cap"
    return audit.reasons[0].split(":")[0] if audit.reasons else "unknown"


def _kind(name: str, value: str) -> str:
    # A screen failure is named by what happened: bits, a crash or a build error.
    if not name.startswith("screen"):
        return name.split("[")[0]
    for key, label in (("differ in bits", "bits"), ("crashed", "crash"), ("build", "build")):
        if key in value:
            return f"{label} (screen)"
    return "screen"


def summarize(run: RunDir) -> dict:
    state, best = run.state(), run.best()
    cands = [c for c in run.all("candidates") if c.kind != "root"]
    audits = run.all("audits")
    lineage = {l.candidate: l for l in run.all("lineage")}
    passing = {a.candidate for a in audits if a.passed}
    timed = [a for a in audits if a.passed and a.t_root]
    last_t_root = timed[-1].t_root if timed else 0.0  # no promotion yet: the root's latest T
    failures = collections.Counter(failure_kind(a) for a in audits if not a.promotable)
    eliminated = sum(1 for l in lineage.values() if l.status == "eliminated")
    promoted = [e for e in run.events() if e["kind"] == "promote"]
    out = {"op": run.config.op, "grid": run.config.grid, "device": run.config.device,
           "root": state.root, "best": state.best, "best_config": run.get("candidates", state.best).config,
           "speedup": best.speedup, "t_root": best.t_root or last_t_root, "t_best": best.t_best or last_t_root,
           "candidates": len(cands), "audited": len({a.candidate for a in audits}),
           "passing": len(passing), "eliminated_by_halving": eliminated, "promoted": len(promoted),
           "failure_reasons": dict(failures), "frontier": list(state.frontier),
           "opportunities": list(state.opportunities), "budget": dict(state.budget),
           "by_proposer": dict(collections.Counter(c.proposer for c in cands)), "workloads": []}
    # Per-workload ratios of the promoting audit, else of the fastest passing audit.
    shown = run.get("audits", best.audit) if best.audit else (
        min(timed, key=lambda a: a.t_candidate / a.t_root) if timed else None)
    if shown is not None:
        audit = shown
        out["shown_audit"] = {"id": audit.id, "candidate": audit.candidate,
                              "t_root_over_t": audit.t_root / audit.t_candidate}
        out["workloads"] = [{"name": r["name"], "over_root": r["candidate_us"] / r["root_us"],
                             "root_us": r["root_us"], "candidate_us": r["candidate_us"],
                             "same_launch": r.get("same_launch", False)} for r in audit.workloads]
    return out


def format_summary(s: dict) -> str:
    lines = [f"{s['op']} on {s['device']} (grid {s['grid']}): best {s['best']} {s['best_config']}",
             f"  T(root)/T(best) = {s['speedup']:.4f} (T root {s['t_root']:.6g}, best {s['t_best']:.6g})",
             f"  candidates {s['candidates']} (by proposer {s['by_proposer']}), audited {s['audited']}, "
             f"passing {s['passing']}, eliminated by halving {s['eliminated_by_halving']}, "
             f"promoted {s['promoted']}",
             f"  failure reasons: {s['failure_reasons']}",
             f"  frontier: {s['frontier']}; device s used {s['budget'].get('device_s_used', 0):.1f}, "
             f"tokens {s['budget'].get('tokens_used', 0)}"]
    if s.get("shown_audit"):
        a = s["shown_audit"]
        lines.append(f"  per workload, audit {a['id']} of {a['candidate']} "
                     f"(T(root)/T = {a['t_root_over_t']:.4f}):")
    for row in s["workloads"]:
        lines.append(f"    {row['name']:<28} candidate/root {row['over_root']:.3f}  "
                     f"({row['root_us']:.1f} -> {row['candidate_us']:.1f} us)"
                     f"{'  [root launch]' if row.get('same_launch') else ''}")
    return "\n".join(lines)

"""The contrastive prompt for an agent-driven step, and an optional OpenAI-compatible client.

The prompt holds the op's contract (its kernel's numerics and the search op's notes), the
workload table (coefficients, root and best latency), two earlier variants with their
measured speedups sampled from different performance buckets (so the contrast shows what
helped and what did not), the frontier, the recorded opportunities, and how to answer.
"""
from __future__ import annotations

import inspect
import json
import random
import urllib.request

from .records import RunDir
from .summary import summarize

BUCKETS = ((0.0, 0.95, "slower"), (0.95, 1.0, "slightly slower"), (1.0, 1.05, "slightly faster"),
           (1.05, float("inf"), "faster"))


def workload_evidence(audit) -> str:
    """Where a variant won and lost, from its audit: the verdict (the cap's or the rule's
    reasons when not promotable), the range of candidate/root latency per workload kind, and
    every workload where the candidate was slower than the root. A search learns from which
    shapes a change helps, not only from T."""
    ratios = [(w["name"], w["candidate_us"] / w["root_us"]) for w in audit.workloads
              if w.get("root_us") and w.get("candidate_us") is not None]
    kinds: dict = {}
    for name, r in ratios:
        kinds.setdefault(name.split(".")[0], []).append(r)
    ranges = "; ".join(f"{k} {min(v):.3f}-{max(v):.3f}x" for k, v in kinds.items())
    slower = ", ".join(f"{n} {r:.3f}x" for n, r in ratios if r > 1.0) or "none"
    verdict = "promotable" if audit.promotable else "not promoted: " + ("; ".join(audit.reasons) or "?")
    return (f"  audit {audit.id}, {verdict}\n  candidate/root latency by kind: {ranges or 'n/a'}\n"
            f"  slower than the root: {slower}")


def _variant_text(run: RunDir, audit) -> str:
    cand = run.get("candidates", audit.candidate)
    speed = audit.t_incumbent / audit.t_candidate
    body = (f"config delta {json.dumps(cand.delta)} on {cand.parent}" if cand.kind != "source"
            else "source:\n```python\n" + run.source(cand.id) + "\n```")
    return (f"- {cand.id} ({cand.proposer}): T(incumbent)/T = {speed:.4f}, T(root)/T = "
            f"{audit.t_root / audit.t_candidate:.4f}\n{workload_evidence(audit)}\n  {body}")


def sample_variants(run: RunDir, seed: int, k: int = 2) -> list:
    """Up to ``k`` passing audits from distinct speed buckets (random within a bucket)."""
    rng = random.Random(seed)
    passed = [a for a in run.all("audits") if a.passed and a.t_candidate > 0]
    by_bucket = {}
    for a in passed:
        speed = a.t_incumbent / a.t_candidate
        label = next(b[2] for b in BUCKETS if b[0] <= speed < b[1])
        by_bucket.setdefault(label, []).append(a)
    labels = list(by_bucket)
    rng.shuffle(labels)
    return [rng.choice(by_bucket[label]) for label in labels[:k]]


def build_prompt(run: RunDir, op, seed: int = 0) -> str:
    s = summarize(run)
    kernel = inspect.getmodule(op.kernel_modules[0])
    rows = {r["name"]: r for r in s["workloads"]}
    table = ["| workload | params | c_w | root us | best audited us |", "|---|---|---|---|---|"]
    for w in run.config.workloads:
        r = rows.get(w["name"], {})
        table.append(f"| {w['name']} | {json.dumps(w['params'])} | {w['coefficient']:.4g} | "
                     f"{r.get('root_us', float('nan')):.1f} | {r.get('candidate_us', float('nan')):.1f} |")
    variants = [_variant_text(run, a) for a in sample_variants(run, seed)] or ["- none audited yet"]
    opportunities = [f"- {o['note']} (workloads: {o.get('workloads') or 'all'})"
                     for o in s["opportunities"]] or ["- none recorded"]
    return "\n".join([
        f"# Make the unified {s['op']} kernel faster without changing one output bit",
        "", "## The contract (every candidate passes it bit for bit, or is rejected)",
        inspect.getdoc(kernel) or "", "", inspect.getdoc(inspect.getmodule(type(op))) or "",
        "", f"## Workloads (T = sum c_w x latency_w; cap {run.config.cap}x the root on each)",
        *table, "", f"Incumbent {s['best']}: {json.dumps(s['best_config'])}; "
        f"T(root)/T(best) = {s['speedup']:.4f}",
        "", "## Earlier variants and their measured speedups", *variants,
        "", f"## Frontier (passing, not promoted): {s['frontier'] or 'empty'}",
        "", "## Recorded opportunities", *opportunities,
        "", "## Answer with one of",
        "- a JSON config delta on the incumbent, e.g. {\"stages_decode\": 4}",
        f"- a Python module defining {list(op.entry_points)} (it may define its own Triton kernels, "
        "named *_kernel, launched on the current stream); it is audited as is:",
        *[f"    {sig}" for sig in op.signatures],
    ])


def ask(prompt: str, url: str, model: str, api_key: str | None = None, timeout_s: float = 300.0) -> tuple[str, int]:
    """One chat completion from an OpenAI-compatible endpoint: (reply text, total tokens)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"llm url must start with http:// or https://, got {url!r}")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions", body, headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        data = json.load(response)
    return data["choices"][0]["message"]["content"], int(data.get("usage", {}).get("total_tokens", 0))

"""Run the mechanical proposer on the GPU: attention (the 48-workload grid), linear, and on
request log-prob, norm, rope, swiglu (``--ops logprob norm rope swiglu``).

Usage (GPU, repo root):
    python3 -m eval.optimize_gpu --out DIR [--ops attention linear]
                                 [--budget-s attention=300 linear=100] [--rounds 3] [--l2-flush]
    python3 -m eval.optimize_gpu --out DIR --grid tiny --device cpu    # CPU smoke run (interpreter)
    python3 -m eval.optimize_gpu --out DIR --ops linear --tiles-out FILE   # + the promoted groups

For each op: ``init`` a run on the h200 grid (coefficients c_w = 1 / root latency, so
T(root) = number of workloads), then the mechanical proposer (one-knob moves, successive
halving over the workloads, full audits of the finalists, promotion by the rule: every
workload within 1.05x of the root and T strictly below the incumbent's in the same paired
run) within the op's budget. Prints per op T(root)/T(best), the per-workload ratios,
candidates tried / passing / promoted and the failure reasons; writes each run's
``summary.json`` and packs the run directories into DIR/optimize_runs.tgz. Kernel
defaults are not changed here: a promoted config is applied to the kernel's table by
hand, citing its audit. ``--tiles-out FILE`` writes the linear run's promoted groups into
FILE's "tuned" section (other sections kept): with ``AREAL_TIK_LINEAR_TILES=FILE`` later
processes launch them (``_linear_tiles.load_tuned``), so eval/bench_linear.py can put the
promoted table beside cuBLAS on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    # Before triton is imported (it fixes interpreter vs GPU then), hence before the imports below.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from areal_tik.optimize import evaluator  # noqa: E402
from areal_tik.optimize.proposers import Mechanical, SearchConfig  # noqa: E402
from areal_tik.optimize.records import RunDir  # noqa: E402
from areal_tik.optimize.summary import format_summary, summarize  # noqa: E402

DEFAULT_BUDGET_S = {"attention": 300.0, "linear": 100.0, "logprob": 100.0, "norm": 40.0, "rope": 40.0,
                    "swiglu": 40.0}


def _budgets(items) -> dict:
    budgets = dict(DEFAULT_BUDGET_S)
    for item in items or ():
        op, _, seconds = item.partition("=")
        if op not in DEFAULT_BUDGET_S or not seconds:
            raise SystemExit(f"--budget-s takes OP=SECONDS with OP in {sorted(DEFAULT_BUDGET_S)}, got {item!r}")
        budgets[op] = float(seconds)
    return budgets


def optimise(op: str, budget_s: float, workdir: Path, args) -> dict:
    path = workdir / op
    start = time.time()
    if (path / "config.json").exists():
        run = RunDir(path)  # resume
    else:
        run = evaluator.init_run(path, op, args.grid, args.device, cap=args.cap, seed=args.seed)
    print(f"== {op}: {len(run.config.workloads)} workloads, root {run.config.root_config}, "
          f"init {time.time() - start:.1f} s", flush=True)
    ev = evaluator.Evaluator(run, rounds=args.rounds, timeout_s=args.audit_timeout_s, l2_flush=args.l2_flush)
    try:
        Mechanical(run, ev, SearchConfig(budget_s=budget_s, generations=args.generations),
                   log=lambda *a: print(*a, flush=True)).search()
    finally:  # what was found so far is reported even when the search stopped on an error
        summary = summarize(run)
        summary["wall_s"] = time.time() - start
        (path / "summary.json").write_text(json.dumps(summary, indent=1))
        print(format_summary(summary), flush=True)
    return summary


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: stopping, packing the run directories")


def write_tuned(path: Path, summary: dict) -> int:
    """The linear run's best config (promoted groups; {} when the root stayed best) as FILE's
    "tuned" section, with the row ranges its keys name ("tuned_bounds"), merged into what
    FILE holds; returns how many groups."""
    from areal_tik.unified_kernels import _linear_tiles

    tiles = json.loads(path.read_text()) if path.exists() else {}
    best = summary["best_config"] if summary["best"] != summary["root"] else {}
    tiles["tuned"] = best
    tiles.update(_linear_tiles.search_file_fields())
    path.write_text(json.dumps(tiles, indent=1, sort_keys=True))
    return len(best)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for optimize_runs.tgz")
    parser.add_argument("--ops", nargs="+", default=["attention", "linear"], choices=sorted(DEFAULT_BUDGET_S))
    parser.add_argument("--budget-s", nargs="*", help="OP=SECONDS of search per op")
    parser.add_argument("--workdir", default=None, help="run directories (default: a fresh temporary folder)")
    parser.add_argument("--grid", default="h200", choices=("h200", "tiny"), help="tiny: a CPU smoke run")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--cap", type=float, default=1.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--audit-timeout-s", type=float, default=240.0)
    parser.add_argument("--l2-flush", action="store_true")
    parser.add_argument("--tiles-out", default=None,
                        help="JSON for the linear run's promoted groups (its \"tuned\" section)")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
    budgets = _budgets(args.budget_s)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="optimize-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, code = {}, 0
    signal.signal(signal.SIGTERM, _stop)  # a stage timeout still packs what was found
    for op in args.ops:
        try:
            results[op] = optimise(op, budgets[op], workdir, args)
        except BaseException as e:  # noqa: BLE001 - report, pack, go on
            traceback.print_exc()
            code = 1
            if isinstance(e, KeyboardInterrupt):
                break
    with tarfile.open(out / "optimize_runs.tgz", "w:gz") as tar:
        for op in args.ops:
            if (workdir / op).exists():
                tar.add(workdir / op, arcname=f"optimize_{op}")
    for op, s in results.items():
        print(f"RESULT {op}: T(root)/T(best) = {s['speedup']:.4f}; candidates {s['candidates']}, "
              f"audited {s['audited']}, passing {s['passing']}, promoted {s['promoted']}; "
              f"failures {s['failure_reasons']}; wall {s['wall_s']:.0f} s; best {s['best_config']}")
    if args.tiles_out and "linear" in results:
        count = write_tuned(Path(args.tiles_out), results["linear"])
        print(f"tuned linear groups: {count} written to {args.tiles_out}")
    print(f"run directories: {out / 'optimize_runs.tgz'}")
    return code


if __name__ == "__main__":
    sys.exit(main())

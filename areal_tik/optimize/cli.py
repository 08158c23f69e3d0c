"""``areal-tik optimize``: drive a search run by hand, by a coding agent, or mechanically.

    areal-tik optimize init --run RUN --op attention [--grid h200] [--device cuda]
    areal-tik optimize propose --run RUN --delta '{"stages_decode": 4}' [--note ...]
    areal-tik optimize propose --run RUN --source my_attention.py --proposer agent --tokens 1200
    areal-tik optimize propose --run RUN --mechanical [--budget-s 300]   # proposes, audits, promotes
    areal-tik optimize propose --run RUN --opportunity "decode b1: 8 splits idle half the SMs"
    areal-tik optimize audit --run RUN CANDIDATE
    areal-tik optimize promote --run RUN AUDIT
    areal-tik optimize status --run RUN [--json]
    areal-tik optimize prompt --run RUN [--out FILE] [--llm-url URL --llm-model NAME]

Every step is recorded in the run directory (see ``records``); a run is resumed by
naming it again, and ``init`` refuses a directory that already holds one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .ops import OPS


def _backend(device: str) -> None:
    # The Triton interpreter must be chosen before triton is imported (it fixes the mode).
    if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError("a CPU run needs the Triton interpreter, but triton was imported without "
                         "TRITON_INTERPRET=1; set TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"


def _open(args):
    from .records import RunDir
    run = RunDir(args.run_dir)
    _backend(run.config.device.split(":")[0])
    return run


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def cmd_init(args) -> int:
    device = args.device or ("cuda" if _cuda() else "cpu")
    _backend(device)
    from .evaluator import init_run
    run = init_run(args.run_dir, args.op, args.grid, device, cap=args.cap, seed=args.seed,
                   coefficients=args.coefficients)
    print(f"initialised {args.op} run at {run.path} ({len(run.config.workloads)} workloads, "
          f"root {run.config.root_config})")
    return 0


def cmd_propose(args) -> int:
    run = _open(args)
    from .evaluator import Evaluator, make_op, propose
    if args.opportunity:
        with run.locked():
            state = run.state()
            state.opportunities.append({"note": args.opportunity, "workloads": args.workloads or [],
                                        "source": args.proposer})
            run.save_state(state)
            run.event("opportunity", note=args.opportunity)
        print(f"recorded opportunity {len(state.opportunities)}")
        return 0
    if args.mechanical:
        from .proposers import Mechanical, SearchConfig
        ev = Evaluator(run, rounds=args.rounds, timeout_s=args.timeout_s, l2_flush=args.l2_flush)
        Mechanical(run, ev, SearchConfig(budget_s=args.budget_s, generations=args.generations)).search()
        return cmd_status(args)
    op = make_op(run.config.op, run.config.grid)
    cand = propose(run, op, delta=args.delta, source_path=args.source, parent=args.parent,
                   proposer=args.proposer, note=args.note, tokens=args.tokens)
    print(cand.id)
    return 0


def cmd_audit(args) -> int:
    run = _open(args)
    from .evaluator import Evaluator
    audit = Evaluator(run, rounds=args.rounds, timeout_s=args.timeout_s, l2_flush=args.l2_flush).audit(args.candidate)
    print(json.dumps({"audit": audit.id, "passed": audit.passed, "promotable": audit.promotable,
                      "reasons": audit.reasons, "t_candidate": audit.t_candidate,
                      "t_incumbent": audit.t_incumbent, "t_root": audit.t_root}, indent=1))
    return 0


def cmd_promote(args) -> int:
    run = _open(args)
    from .evaluator import promote
    best = promote(run, args.audit)
    print(f"promoted {best.candidate}: T(root)/T(best) = {best.speedup:.4f}")
    return 0


def cmd_status(args) -> int:
    run = _open(args)
    from .summary import format_summary, summarize
    s = summarize(run)
    print(json.dumps(s, indent=1) if getattr(args, "json", False) else format_summary(s))
    return 0


def cmd_prompt(args) -> int:
    run = _open(args)
    from .evaluator import make_op
    from .prompt import ask, build_prompt
    text = build_prompt(run, make_op(run.config.op, run.config.grid), seed=args.seed)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    url = args.llm_url or os.environ.get("AREAL_TIK_LLM_URL")
    if not url:
        print(text if not args.out else f"prompt written to {args.out}")
        return 0
    reply, tokens = ask(text, url, args.llm_model, os.environ.get("AREAL_TIK_LLM_KEY"))
    with run.locked():
        state = run.state()
        state.budget["tokens_used"] += tokens
        run.save_state(state)
        run.event("llm", tokens=tokens, model=args.llm_model)
    print(reply)
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the optimize sub-subcommands to ``parser`` (the ``optimize`` subcommand's parser)."""
    sub = parser.add_subparsers(dest="optimize_command", required=True)

    def command(name, func, help_text):
        p = sub.add_parser(name, help=help_text)
        # dest run_dir: ``areal-tik``'s top-level parser keeps its command's entry in ``run``
        p.add_argument("--run", dest="run_dir", required=True, help="the run directory")
        p.set_defaults(optimize_func=func)
        return p

    def timing_options(p):
        p.add_argument("--rounds", type=int, default=3, help="paired timing rounds (fresh inputs each)")
        p.add_argument("--timeout-s", type=float, default=600.0, help="per audit")
        p.add_argument("--l2-flush", action="store_true", help="flush the L2 cache before each timed replay")

    p = command("init", cmd_init, "start a run: freeze workloads, hashes and the root")
    p.add_argument("--op", required=True, choices=OPS)
    p.add_argument("--grid", default="h200", choices=("h200", "tiny"))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--cap", type=float, default=1.05, help="per-workload slowdown cap against the root")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coefficients", default="normalized", choices=("normalized", "uniform"))
    p = command("propose", cmd_propose, "record a candidate (or run the mechanical proposer)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--delta", type=_json_arg, help="JSON config delta on the parent")
    what.add_argument("--source", help="a .py file defining the op's entry points")
    what.add_argument("--mechanical", action="store_true", help="enumerate knobs, halve, audit, promote")
    what.add_argument("--opportunity", help="record an idea or a gap for later proposals")
    p.add_argument("--workloads", nargs="*", help="with --opportunity: the workloads it concerns")
    p.add_argument("--parent", default=None, help="default: the incumbent")
    p.add_argument("--proposer", default="manual", choices=("manual", "agent", "mechanical"))
    p.add_argument("--note", default="")
    p.add_argument("--tokens", type=int, default=0, help="LLM tokens spent on this proposal")
    p.add_argument("--budget-s", type=float, default=300.0, help="--mechanical: wall-clock budget")
    p.add_argument("--generations", type=int, default=8, help="--mechanical: at most this many")
    timing_options(p)
    p = command("audit", cmd_audit, "gate + paired timing of a candidate against the incumbent")
    p.add_argument("candidate")
    timing_options(p)
    p = command("promote", cmd_promote, "make a promotable audit's candidate the incumbent")
    p.add_argument("audit")
    p = command("status", cmd_status, "what the run has found")
    p.add_argument("--json", action="store_true")
    p = command("prompt", cmd_prompt, "the contrastive prompt for the next agent-driven proposal")
    p.add_argument("--seed", type=int, default=0, help="which earlier variants are sampled")
    p.add_argument("--out", default=None, help="write the prompt to this file")
    p.add_argument("--llm-url", default=None, help="OpenAI-compatible endpoint (or $AREAL_TIK_LLM_URL)")
    p.add_argument("--llm-model", default="default")


def main(args: argparse.Namespace) -> int:
    """Run a parsed ``optimize`` command; errors of the run or the input exit 2 with the message."""
    from .records import RunError
    try:
        return args.optimize_func(args)
    except (RunError, ValueError, TypeError, FileNotFoundError) as e:
        print(f"areal-tik optimize {args.optimize_command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python3 -m areal_tik.optimize.cli")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

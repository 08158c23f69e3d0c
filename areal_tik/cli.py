"""areal-tik: the one front door. Every runnable of the project is a subcommand.

    areal-tik generate --model tiny-qwen3 --num-prompts 4 --max-new-tokens 16
    areal-tik check --model qwen3-0.6b --num-prompts 64 --max-new-tokens 256
    areal-tik prepare-model tiny /tmp/areal-tik/tiny
    areal-tik demo --steps 3
    areal-tik launch recipes/reasoning_gym_grpo.py --config recipes/chain_sum_grpo_tiny_cpu.yaml
    areal-tik serve --model /tmp/areal-tik/tiny --port 30000

A subcommand is one row of ``COMMANDS``: (name, module, one-line help), where the module
exposes ``add_arguments(parser)``, ``main(args) -> int`` and optionally ``validate(args)``
(the checks that need no model). Only the chosen command's module is imported
(``generate`` never imports AReaL). ``python -m areal_tik.cli`` runs the same front door.
A bad input (``UsageError``) is answered with one line, ``areal-tik: error: ...``, and
exit status 2; ``areal-tik --debug ...`` shows its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from areal_tik.commands.model_args import RANDOM_INIT  # noqa: F401  (eval/bench_rollout.py reads it here)
from areal_tik.errors import UsageError
from areal_tik.runtime import use_interpreter_without_gpu, wants_cpu

COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("generate", "areal_tik.commands.generate", "generate tokens, text and log-probs"),
    ("check", "areal_tik.commands.check", "rollout vs packed training forward: bit-identical log-probs?"),
    ("prepare-model", "areal_tik.commands.prepare_model",
     "write a local model directory (a tiny random model, or SmolLM2 from its GGUF)"),
    ("demo", "areal_tik.adapter.demo", "a short GRPO run through AReaL with the unified kernels"),
    ("launch", "areal_tik.adapter.launch",
     "run an AReaL script with the areal-tik patches applied (<script.py> --config <yaml> [k=v ...])"),
    ("serve", "areal_tik.adapter.serve", "serve the rollout engine over HTTP (SGLang-shaped endpoints)"),
    ("run", "areal_tik.adapter.run", "run a shipped recipe with the flag on, on the stock path, or both"),
    ("report", "areal_tik.report.cli", "compare recipe runs (tik vs stock): HTML page, plots, summary table"),
    ("optimize", "areal_tik.optimize.cli", "search kernel tile tables and check them against the contract"),
)


def _load(name: str, module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise SystemExit(f"areal-tik {name}: not available in this installation ({module} is missing)") \
                from None
        raise


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command``'s module adds its arguments (the others are only listed)."""
    parser = argparse.ArgumentParser(prog="areal-tik", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = _load(name, module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.main, **({"validate": mod.validate} if hasattr(mod, "validate") else {}))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before any kernel is imported (see areal_tik.runtime).
    use_interpreter_without_gpu(force=wants_cpu(argv))
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        # A command's validate(args) runs before any model is built: what it raises as
        # ValueError/TypeError/OSError is the user's input; later, only UsageError is.
        try:
            getattr(args, "validate", lambda _: None)(args)
        except (ValueError, TypeError, OSError) as exc:
            raise UsageError(str(exc)) from exc
        return args.run(args)
    except UsageError as exc:
        if args.debug:
            raise
        print(f"areal-tik: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

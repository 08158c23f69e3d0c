"""The checks of ``demo`` and ``launch`` flags that run before AReaL builds anything:
a bad value is a ``UsageError`` (one line: the value and what is accepted)."""
from __future__ import annotations

import difflib
from pathlib import Path

from areal_tik.errors import UsageError, at_least


def check_file(flag: str, path: str, suffixes: tuple[str, ...]) -> None:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path!r}: no such file (expected a {'/'.join(suffixes)} file)")
    if p.suffix not in suffixes:
        raise UsageError(f"{flag} {path!r}: expected a {'/'.join(suffixes)} file")


def check_model_dir(path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path!r}: not a model directory (no config.json); expected a local "
                         "Hugging Face checkpoint (areal-tik prepare-model tiny DIR writes one)")


def check_task(name: str) -> None:
    """``name`` is a reasoning-gym dataset; else the closest names."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, sorted(DATASETS), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(f"--task {name!r}: not a reasoning-gym dataset; {hint}"
                         f"({len(DATASETS)} known, e.g. basic_arithmetic, chain_sum)")


def config_path(script_args: list[str]) -> str | None:
    """The value of ``--config`` in an AReaL script's arguments (either spelling)."""
    for i, arg in enumerate(script_args):
        if arg == "--config":
            if i + 1 >= len(script_args):
                raise UsageError("--config needs a YAML file after it")
            return script_args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def validate_demo(args) -> None:
    for flag in ("steps", "batch_size", "n_samples", "max_new_tokens"):
        at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    check_task(args.task)
    if args.model is not None:
        check_model_dir(args.model)
    if args.recipe is not None:
        check_file("--recipe", args.recipe, (".yaml", ".yml"))


def validate_launch(args) -> None:
    check_file("launch: entry script", args.script, (".py",))
    config = config_path(list(args.script_args))
    if config is not None:
        check_file("--config", config, (".yaml", ".yml"))


def validate_serve(args) -> None:
    from areal_tik.commands.validate import check_device

    check_device(args.device)
    path = Path(args.model)
    if not (path.is_file() and path.suffix == ".gguf"):
        check_model_dir(args.model)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535 (0: an ephemeral port), got {args.port}")
    # the engine options (and --dtype) are checked by the server's own check_args first

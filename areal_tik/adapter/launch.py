"""``areal-tik launch``: run a stock AReaL entry script with the areal-tik patches installed.

    areal-tik launch examples/math/gsm8k_rl.py --config my.yaml [k=v ...]
    torchrun --nproc-per-node 8 -m areal_tik.cli launch train.py --config my.yaml

The script runs unchanged as ``__main__`` (AReaL is not forked): before it starts, the
AReaL patch list (``patch_list``) swaps in the areal-tik actor, the in-process rollout engine hook
and the config loader, so ``actor.unified_kernels: true`` in the YAML takes effect.
Processes run in AReaL's SPMD mode (``AREAL_SPMD_MODE=1``): one process per GPU, each
with its own in-process engine; a single process gets RANK=0, WORLD_SIZE=1 and a free
local port unless torchrun (or the caller) has set them.

Without the wrapper, AReaL's own launchers start an entry script that calls
``activate()`` (the shipped recipe script does)::

    python3 -m areal.infra.launcher.local recipes/reasoning_gym_grpo.py --config my.yaml

The local and Slurm launchers run the script under torchrun; Ray imports it and calls its
``main(argv)``; all three set RANK/WORLD_SIZE/MASTER_* and ``AREAL_SPMD_MODE=1``, so
the call at the script's import is the one mechanism for all three.
"""
from __future__ import annotations

import argparse
import os
import runpy
import socket
import sys

from areal_tik.runtime import use_interpreter_without_gpu


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spmd_environment(environ=None) -> dict[str, str]:
    """Set (without overriding) what AReaL's SPMD mode and torch.distributed read."""
    env = os.environ if environ is None else environ
    env.setdefault("AREAL_SPMD_MODE", "1")
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", env["RANK"])
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(_free_port())
    return env


def quiet_trackers(environ=None) -> None:
    """W&B without its console chatter (offline runs still write their files); set
    without overriding the caller's choice."""
    env = os.environ if environ is None else environ
    env.setdefault("WANDB_SILENT", "true")


def activate():
    """The areal-tik patches for the rest of this process, for an entry script that AReaL's
    launchers start as the trainer: the patch list (once; a no-op under ``areal-tik
    launch``, which has applied it), the Triton interpreter without a GPU, and a
    one-process SPMD environment when no launcher has set RANK (a bare ``python3
    script.py``). Returns the handle of the patch list applied here, or None."""
    from areal_tik import patches

    from . import patch_list

    if "RANK" not in os.environ:
        spmd_environment()
    quiet_trackers()
    use_interpreter_without_gpu()
    if patch_list.NAME in patches.active():
        return None
    return patch_list.apply()  # never reverted: the process is the trainer


def run_script(script: str, args: list[str]) -> None:
    """``script`` as ``__main__`` with ``sys.argv = [script, *args]``, patches applied."""
    from areal_tik.patches import apply_swaps

    from . import patch_list
    from .run_summary import RunRecorder

    if not script.endswith(".py") or not os.path.isfile(script):
        raise FileNotFoundError(f"entry script not found (expected a .py file): {script!r}")
    spmd_environment()
    quiet_trackers()
    use_interpreter_without_gpu()
    saved_argv = sys.argv
    sys.argv = [script, *args]
    handle = patch_list.apply()
    recorder = RunRecorder()
    recording = apply_swaps(recorder.swaps(), name="launch-summary")
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        recording.revert()
        handle.revert()
        sys.argv = saved_argv
    if os.environ.get("RANK", "0") == "0":
        for line in recorder.lines(f"areal-tik launch {os.path.basename(script)}"):
            print(line)


def add_arguments(parser) -> None:
    parser.add_argument("script", help="the AReaL entry script (.py), run unchanged as __main__")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="its arguments: --config <config.yaml> [key=value ...]")


def validate(args) -> None:
    from .run_checks import validate_launch

    validate_launch(args)


def main(args) -> int:
    run_script(args.script, list(args.script_args))
    return 0

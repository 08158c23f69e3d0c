"""Run a stock AReaL entry script with the areal-tik patches installed.

    python -m areal_tik.integration.launch examples/math/gsm8k_rl.py --config my.yaml [k=v ...]
    torchrun --nproc-per-node 8 -m areal_tik.integration.launch train.py --config my.yaml

The script runs unchanged as ``__main__`` (AReaL is not forked): before it starts, the
``"areal"`` patch set swaps in the areal-tik actor, the in-process rollout engine hook
and the config loader, so ``actor.unified_kernels: true`` in the YAML takes effect.
Processes run in AReaL's SPMD mode (``AREAL_SPMD_MODE=1``): one process per GPU, each
with its own in-process engine; a single process gets RANK=0, WORLD_SIZE=1 and a free
local port unless torchrun (or the caller) has set them.
"""
from __future__ import annotations

import os
import runpy
import socket
import sys

USAGE = "usage: python -m areal_tik.integration.launch <script.py> --config <config.yaml> [key=value ...]"


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


def kernel_environment(environ=None) -> None:
    """Without a GPU the Triton kernels run in the interpreter (set before they import)."""
    env = os.environ if environ is None else environ
    import torch

    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")


def run_script(script: str, args: list[str]) -> None:
    """``script`` as ``__main__`` with ``sys.argv = [script, *args]``, patches applied."""
    from areal_tik import patches

    if not script.endswith(".py") or not os.path.isfile(script):
        raise FileNotFoundError(f"entry script not found (expected a .py file): {script!r}")
    spmd_environment()
    kernel_environment()
    saved_argv = sys.argv
    sys.argv = [script, *args]
    handle = patches.apply("areal")
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        handle.revert()
        sys.argv = saved_argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    run_script(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

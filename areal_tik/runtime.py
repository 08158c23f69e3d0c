"""Which kernels run, and how: the kernel-set names and the Triton-interpreter switch.

Declared here once and imported by the model, the command line, the adapter and the
tests. This module imports nothing from areal_tik (and not triton), because the switch
must be set before any kernel module is imported: ``triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so a process that imports a kernel
first and sets the variable later keeps the GPU path for good.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping

# "unified": the Triton kernels, bitwise identical across rollout and training;
# "standard": stock torch ops on the same code path (the baseline; never reused).
KERNEL_SETS = ("unified", "standard")
DEFAULT_KERNELS = "unified"

INTERPRET_ENV = "TRITON_INTERPRET"


def wants_cpu(argv: Iterable[str]) -> bool:
    """True if a command line asks for ``--device cpu`` (either spelling)."""
    argv = list(argv)
    return any(a == "--device=cpu" or (a == "--device" and argv[i + 1:i + 2] == ["cpu"])
               for i, a in enumerate(argv))


def use_interpreter_without_gpu(environ: MutableMapping[str, str] | None = None,
                                force: bool = False) -> bool:
    """Set ``TRITON_INTERPRET=1`` (without overriding a value already set) when no CUDA
    GPU is available, or when ``force`` (a run asked for the CPU). Returns whether the
    interpreter is selected now. Call it before importing any kernel."""
    env = os.environ if environ is None else environ
    if not force:
        import torch

        force = not torch.cuda.is_available()
    if force:
        env.setdefault(INTERPRET_ENV, "1")
    return env.get(INTERPRET_ENV, "0") == "1"

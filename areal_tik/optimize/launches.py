"""Dispatch evidence: record every Triton kernel launch made through a module's kernels.

``record_launches(modules)`` swaps each Triton kernel entry point (a ``JITFunction``
named ``*_kernel``) of the given modules for a proxy that records the launch (kernel name, constexpr/launch options,
the stream current at launch) and forwards it unchanged; on exit the exact previous
attribute is put back, so recorders nest (an inner one restores the outer's proxy, whose
launches then reach both lists) and an exception inside restores too. Launchers call
their kernels through module globals (``_kernel[grid](...)``), so the swap sees every
launch on the CPU interpreter and on the GPU alike.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from triton.runtime.jit import JITFunction
from triton.runtime.interpreter import InterpretedFunction

_KERNEL_TYPES = (JITFunction, InterpretedFunction)


@dataclasses.dataclass
class Launch:
    kernel: str  # module.name of the kernel
    meta: dict  # scalar keyword arguments: constexprs, num_warps, num_stages
    stream: int  # token of the stream current at launch (see stream_token)


def stream_token(device: torch.device) -> int:
    """Identity of the current stream of ``device``'s type (CUDA handle, or the CPU stream object)."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return id(torch.cpu.current_stream())


def _device_of(args, kwargs) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        base = getattr(value, "base", None)  # TMA descriptors
        if isinstance(base, torch.Tensor):
            return base.device
    return torch.device("cpu")


class _Proxy:
    def __init__(self, kernel, name: str, sink: list):
        self._kernel, self._name, self._sink = kernel, name, sink

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def run(*args, **kwargs):
            meta = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}
            self._sink.append(Launch(self._name, meta, stream_token(_device_of(args, kwargs))))
            return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def _is_launched_kernel(attr: str, value) -> bool:
    # Only launch entry points (named ``*_kernel`` by convention): helpers called from
    # inside kernels stay untouched, since the compiler resolves them through globals.
    return attr.endswith("_kernel") and isinstance(value, (*_KERNEL_TYPES, _Proxy))


@contextlib.contextmanager
def record_launches(modules):
    """Yield a list that fills with a ``Launch`` per kernel launch through ``modules``."""
    sink: list[Launch] = []
    saved = []
    try:
        for module in modules:
            for attr, value in list(vars(module).items()):
                if _is_launched_kernel(attr, value):
                    saved.append((module, attr, value))
                    setattr(module, attr, _Proxy(value, f"{module.__name__}.{attr}", sink))
        yield sink
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)

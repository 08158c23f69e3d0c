"""Probe: the host cost of an eager ``UnifiedCausalLM.prefill`` step, apart from the kernels.

Usage (repo root):
    TRITON_INTERPRET=1 python3 -m eval.probe_host [--rows 64] [--start 64] [--layers 28]   (CPU proxy)
    python3 -m eval.probe_host --rows 2048 --start 8192                                     (GPU)

CPU (Triton interpreter): every unified kernel's launch is replaced by a stub, so the timed
call runs only the host path (validation, shape and tile choices, allocations, torch views
and copies, the per-layer Python), in three variants per layer:
  ``no launch``     the stub returns at once: our code and torch's host work alone;
  ``+ JIT front``   the stub runs what Triton 3.6's ``JITFunction.run`` does on the GPU before
                    the C launcher (binder and specialisation of every argument, cache key,
                    kernel cache lookup, the global-value check): the estimate of its cost;
  ``interpreter``   (``--interpreter``, unstubbed, once) the real interpreted kernels, for scale.
and a cProfile top-25 (tottime) of the ``no launch`` variant, which names what is left.
GPU: the real call, enqueue time per layer and a cProfile top-25 of one eager step.
The tiny model has the Qwen3 layer structure (q/k norm, GQA) at toy widths; host costs do
not depend on widths, only on launches and their arguments.
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import time

import torch

_JIT_OPTIONS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline",
                "repr", "launch_metadata")
_MODULES = ("linear", "rms_norm", "swiglu", "rope", "_attention_fwd", "attention")


def _kernels():
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    for name in _MODULES:
        module = importlib.import_module(f"areal_tik.unified_kernels.{name}")
        for value in vars(module).values():
            if isinstance(value, (InterpretedFunction, JITFunction)):
                yield value


def _jit_front(kernel):
    """A callable doing the GPU JIT's per-launch Python before the C launcher (triton 3.6
    ``JITFunction.run``): binder, ``compute_cache_key``, cache lookup, global check."""
    from triton import knobs
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(
        kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k in _JIT_OPTIONS})
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    key_cache, kernel_cache = {}, {}

    def run(*args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", False) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key(key_cache, specialization, options)
        kernel_cache.setdefault(key, object())
        for (name, _), (val, globals_dict) in jit.used_global_vals.items():
            if globals_dict.get(name) != val:
                raise RuntimeError(f"global {name} changed")
        grid = grid(bound) if callable(grid) else grid
        return tuple(bound.values()), grid
    return run


@contextlib.contextmanager
def stubbed(front: bool):
    """Every unified kernel's ``run`` replaced: a no-op, or the JIT front estimate."""
    saved = []
    for kernel in set(_kernels()):
        saved.append((kernel, kernel.__dict__.get("run")))
        kernel.run = _jit_front(kernel) if front else (lambda *a, grid, warmup, **k: None)
    try:
        yield
    finally:
        for kernel, run in saved:
            if run is None:
                del kernel.run
            else:
                kernel.run = run


def build(rows: int, start: int, layers: int, device: str):
    """(model, {label: step}) for a contiguous prefill of ``rows`` and a paged chunk at ``start``."""
    from areal_tik.model import UnifiedCausalLM, random_model, tiny_config

    hf = random_model(tiny_config("qwen3", num_hidden_layers=layers, max_position_embeddings=start + rows + 64),
                      device=device, seed=0)
    model = UnifiedCausalLM.from_hf(hf, kernels="unified")
    model.fuse_projections()  # as the engine lays out its model: rollout's fused q|k|v and gate|up
    block = 64 if device == "cuda" else 16
    n_blocks = -(-(start + rows) // block)
    cache = model.new_kv_cache(n_blocks + 1, block)
    table = torch.arange(1, n_blocks + 1, dtype=torch.int32, device=device)[None]
    ids = torch.randint(8, model.spec.vocab, (start + rows,), device=device)
    pos = torch.arange(start + rows, device=device)
    slots = table[0].long()[pos // block] * block + pos % block
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    last = torch.tensor([rows - 1], device=device)
    s, e, cu, qs = start, start + rows, i32([0, rows]), i32([start])
    steps = {
        f"contiguous prefill of {rows}": lambda: model.prefill(ids[:rows], pos[:rows], cu, rows, cache,
                                                               slots[:rows], last),
        f"paged chunk of {rows} @{start}": lambda: model.prefill(ids[s:e], pos[s:e], cu, rows, cache, slots[s:e],
                                                                last, block_tables=table, query_starts=qs),
    }
    return model, steps


def timed_ms(step, reps: int, sync) -> float:
    step()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        sync()
    return min(times) * 1e3  # the least disturbed run (shared machines)


def ab_ms(step, reps: int, sync) -> tuple[float, float]:
    """(ms with ``_common.HOST_FAST_PATH`` off, on): the host path before and after the launch
    plans and fast checks, interleaved rep by rep so machine noise hits both alike."""
    from areal_tik.unified_kernels import _common

    saved, off, on = _common.HOST_FAST_PATH, [], []
    try:
        for _ in range(reps):
            for flag, times in ((False, off), (True, on)):
                _common.HOST_FAST_PATH = flag
                times.append(timed_ms(step, 1, sync))
    finally:
        _common.HOST_FAST_PATH = saved
    return min(off), min(on)


def profile_top(step, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    from areal_tik.unified_kernels._common import interpreting

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="rows of the step (CPU 64, GPU 2048)")
    parser.add_argument("--start", type=int, default=None, help="the paged chunk's first position")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpreter", action="store_true", help="CPU: also time one interpreted step")
    args = parser.parse_args(argv)
    cpu = interpreting()
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("probe_host needs TRITON_INTERPRET=1 (CPU proxy) or a CUDA GPU")
    rows = args.rows or (64 if cpu else 2048)
    start = args.start if args.start is not None else (64 if cpu else 8192)
    device = "cpu" if cpu else "cuda"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    model, steps = build(rows, start, args.layers, device)
    per = args.layers
    with torch.inference_mode():
        for label, step in steps.items():
            if cpu:
                with stubbed(front=False):
                    bare_off, bare = ab_ms(step, args.reps, sync)
                with stubbed(front=True):
                    front_off, front = ab_ms(step, args.reps, sync)
                real = ""
                if args.interpreter:
                    t = time.perf_counter()
                    step()
                    real = f"; with the interpreter {(time.perf_counter() - t) * 1e3 / per:.1f}"
                print(f"{label}: host ms per layer, HOST_FAST_PATH off -> on: no launch {bare_off / per:.3f} -> "
                      f"{bare / per:.3f}; + JIT front {front_off / per:.3f} -> {front / per:.3f} "
                      f"(JIT front alone {(front - bare) / per:.3f}){real}", flush=True)
                with stubbed(front=False):
                    print(profile_top(step), flush=True)
            else:
                off, on = ab_ms(step, args.reps, sync)
                print(f"{label}: enqueue ms per layer, HOST_FAST_PATH off -> on: {off / per:.3f} -> {on / per:.3f} "
                      f"({off:.2f} -> {on:.2f} per step)", flush=True)
                sync()
                print(profile_top(step), flush=True)
                sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

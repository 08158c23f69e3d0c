"""Programmatic dependent launch (PDL) for the forward kernels: launch gaps, not numerics.

Why: a decode step is a chain of ~360 small kernels, and inside its CUDA graph the GPU
idles ~1.6 us between two of them (H100, Qwen3-0.6B config, batch 64: 0.57 ms of a 2.73 ms
step, ``eval/results/2026-12-07_h100_eb9edf2/``). With PDL (Hopper and newer) a kernel
launched with ``launch_pdl=True`` may start while the kernel before it on the stream is
still running; its programs block in ``griddepcontrol.wait`` until that kernel has
finished and its memory writes are visible, so the launch latency and the program start-up
overlap the previous kernel's tail.

Why the bits do not move: ``wait`` is the first thing a launched program does, before it
reads or writes any global memory, so every load sees exactly what it saw without PDL
(the wait returns once the whole previous grid has completed and flushed). Nothing in the
arithmetic changes; the compiled kernels differ only by the two instructions at the top.
The dependency is transitive: kernel C waits for B, and B could not finish before its own
wait for A returned. A kernel launched without PDL (a torch op, a backward kernel) waits
for its predecessor as usual, and one launched after it waits for it.

``launch_dependents`` right after the wait lets the next kernel's programs be scheduled as
soon as every program of this one has started: at most two kernels are resident, and the
next one only takes SM slots this one no longer needs (all its programs already run).

Weight prefetch (``PREFETCH``, ``AREAL_TIK_PDL_PREFETCH``, default 0: it did not pay, below;
only with PDL): a small-row linear program asks L2 for its whole weight slice before it waits
(``l2_prefetch_rows_then_wait``), so the weights stream while the previous kernel (a norm,
rope, attention) still runs. ``cp.async.bulk.prefetch.L2`` moves lines into L2 and nothing
into the program; L2 is where every SM's global loads and stores meet, so a line that the
previous kernel writes after the prefetch is updated there and the loads after the wait
read the written value. So even data a predecessor writes could not be read stale; the
weights of a forward are not written by any kernel of it anyway. Its sm_90a code is checked
on the CPU (tests/test_pdl.py: the prefetch, then the wait, then every global access); on an
H100 its bits equal the training forward's (``tests/test_pdl.py -m gpu``) but it gained nothing
(0.99x tokens/s at batch 1, 0.94x at 64, one run of ``eval/bench_rollout.py --backends unified
unified-prefetch``, ``eval/results/2026-12-07_h100_03872f2/``), so it stays off by default.

On: ``AREAL_TIK_PDL`` (default 1) and a CUDA tensor on a device of compute capability 9 or
newer, outside the interpreter (whose inline assembly is not executed; there the flag is
always False, so CPU runs compile and run exactly the kernels they did before).
``ENABLED`` is read at launch time, so a benchmark can time both in one process; a CUDA
graph keeps what it was captured with.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ._common import env_switch, interpreting

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL never switches on
    gdc_launch_dependents = gdc_wait = None

ENABLED = env_switch("AREAL_TIK_PDL", True)
PREFETCH = env_switch("AREAL_TIK_PDL_PREFETCH", False)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    # Fixed for a process: the kernels are compiled or interpreted from import on.
    return gdc_wait is not None and not interpreting() and torch.cuda.get_device_capability(index)[0] >= 9


def pdl(t: torch.Tensor) -> bool:
    """Launch the next forward kernel on ``t``'s device with PDL? (see module doc; called
    once per launch, so a flag and a cached lookup)"""
    return ENABLED and t.is_cuda and _capable(t.get_device())


@contextlib.contextmanager
def enabled(on: bool, weight_prefetch: bool | None = None):
    """``ENABLED`` (and ``PREFETCH`` when given) set inside the block (a benchmark's
    side-by-side runs)."""
    global ENABLED, PREFETCH
    saved = ENABLED, PREFETCH
    ENABLED = on
    PREFETCH = saved[1] if weight_prefetch is None else weight_prefetch
    try:
        yield
    finally:
        ENABLED, PREFETCH = saved


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The first statement of every forward kernel: with PDL, wait for the previous kernel
    on the stream (its writes visible), then let the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch_rows_then_wait(row_ptrs, row_bytes, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """``pdl_wait`` preceded, when PREFETCH (only with PDL), by one L2 bulk prefetch of
    ``row_bytes`` bytes from each of ``row_ptrs`` (16-byte aligned, row_bytes a multiple of
    16): lines into L2, no data into the program (module doc: why this cannot read stale)."""
    if PDL and PREFETCH:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [row_ptrs, tl.full(row_ptrs.shape, row_bytes, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    pdl_wait(PDL)

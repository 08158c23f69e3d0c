"""The gate: an op's contract suite plus the anti-hacking checks, as named checks.

Every check runs the candidate next to the frozen root on inputs built by the evaluator
and compares raw bits (``torch.equal`` on integer views); nothing here has a tolerance.
The anti-hacking checks close the reward hacks a latency search finds:

- ``dispatch``: the candidate's own kernels launch on every call (a cached or lazily
  produced output launches nothing), and a config candidate's launches carry its config's
  options (the knob really reached the kernel), all on the caller's current stream;
- ``side_stream``: called with a non-default stream current, every launch is on it (work
  hidden on another stream escapes the timer's events);
- ``pointer_cache``: the inputs are rewritten in place (same pointers) and the output must
  follow the new contents (an output cached by data pointer or shape does not);
- ``extremes``: zero inputs and large-scale inputs give finite outputs equal to the root's;
- ``graph_replay`` (CUDA): a captured call replayed after its inputs changed in place
  gives the root's bits for the new inputs;
- ``workloads``: the workload table still hashes to the run's record after the candidate
  ran (a candidate that shrinks the workloads it is timed on is caught here, and any
  shrunk computation by the per-workload bit comparison of the paired timing).
"""
from __future__ import annotations

import contextlib
import traceback

import torch

from .launches import record_launches, stream_token
from .ops import workloads_hash


class CheckFailed(AssertionError):
    """A candidate broke the contract or an anti-hacking check; the message says how."""


def bit_view(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}
    return t.contiguous().view(ints[t.dtype]) if t.dtype in ints else t


def expect_bits(what: str, got, want) -> None:
    """Raise CheckFailed unless the tensors (or tuples of tensors) are bit-identical."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(got) != len(want):
        raise CheckFailed(f"{what}: {len(got)} outputs, expected {len(want)}")
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            desc = (a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__
            raise CheckFailed(f"{what}: output {i} is {desc}, expected {b.dtype} {tuple(b.shape)}")
        if not torch.equal(bit_view(a), bit_view(b)):
            diff = (bit_view(a) != bit_view(b)).nonzero()
            raise CheckFailed(f"{what}: output {i}: {diff.shape[0]} of {a.numel()} elements differ "
                              f"in bits, first at {tuple(diff[0].tolist())}")


def root_bits(op, impl, root, device, seed: int) -> None:
    """The contract's first check: on every workload of the op's grid (fresh inputs, seeds
    ``seed``, ``seed + 1``, ...), the candidate's outputs are the root's, bit for bit."""
    for i, w in enumerate(op.workloads(op.grid)):
        inputs = op.make_inputs(w, seed + i, device)
        expect_bits(f"root_bits: {w.name}", op.call(impl, w, inputs), op.call(root, w, inputs))


def _outputs(op, impl, w, inputs) -> tuple:
    return tuple(t.clone() for t in op.call(impl, w, inputs))


@contextlib.contextmanager
def _stream(device: torch.device):
    """Make a fresh non-default stream current (CUDA or the CPU stream API)."""
    if device.type == "cuda":
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            yield s
        torch.cuda.current_stream(device).wait_stream(s)
        s.synchronize()
    else:
        s = torch.cpu.Stream()
        with torch.cpu.stream(s):
            yield s


def check_dispatch(op, impl, w, inputs, device, config) -> None:
    with record_launches(impl.modules) as launches:
        op.call(impl, w, inputs)
    if not launches:
        raise CheckFailed(f"dispatch: {w.name}: no kernel of the candidate launched")
    current = stream_token(device)
    off = [l.kernel for l in launches if l.stream != current]
    if off:
        raise CheckFailed(f"dispatch: {w.name}: launches off the current stream: {off}")
    if config is None:
        return
    for suffix, meta in op.expected_launches(config, w, inputs):
        if not any(l.kernel.endswith(suffix) and all(l.meta.get(k) == v for k, v in meta.items())
                   for l in launches):
            seen = [(l.kernel.rsplit(".", 1)[-1], l.meta) for l in launches]
            raise CheckFailed(f"dispatch: {w.name}: no launch of {suffix} with {meta}; saw {seen}")


def check_side_stream(op, impl, root, w, inputs, device) -> None:
    with _stream(device) as s:
        with record_launches(impl.modules) as launches:
            got = _outputs(op, impl, w, inputs)
        token = s.cuda_stream if device.type == "cuda" else id(s)
        off = [l.kernel for l in launches if l.stream != token]
    if not launches or off:
        raise CheckFailed(f"side_stream: {w.name}: launches not on the caller's stream: "
                          f"{off or 'none launched'}")
    expect_bits(f"side_stream: {w.name}", got, _outputs(op, root, w, inputs))


def check_pointer_cache(op, impl, root, w, inputs, seed) -> None:
    first = _outputs(op, impl, w, inputs)
    before = {k: v.clone() for k, v in inputs.items()}
    for extra in (7919, 7920):  # same tensors, same pointers, new contents
        op.refill(w, inputs, seed + extra)
        if not all(torch.equal(bit_view(v), bit_view(before[k])) for k, v in inputs.items()):
            break
    second = _outputs(op, impl, w, inputs)
    expect_bits(f"pointer_cache: {w.name} after an in-place input change", second,
                _outputs(op, root, w, inputs))
    if all(torch.equal(bit_view(a), bit_view(b)) for a, b in zip(first, second)):
        raise CheckFailed(f"pointer_cache: {w.name}: output unchanged after the inputs changed")


def check_extremes(op, impl, root, w, inputs, seed) -> None:
    for scale, label in ((0.0, "zero"), (64.0, "large-scale")):
        op.refill(w, inputs, seed + 31, scale=scale)
        got = _outputs(op, impl, w, inputs)
        bad = [i for i, t in enumerate(got) if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise CheckFailed(f"extremes: {w.name}: non-finite outputs {bad} on {label} inputs")
        expect_bits(f"extremes: {w.name} on {label} inputs", got, _outputs(op, root, w, inputs))


def check_graph_replay(op, impl, root, w, inputs, device, seed) -> None:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        op.call(impl, w, inputs)  # warm-up (compiles) off the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static = op.call(impl, w, inputs)
    op.refill(w, inputs, seed + 104729)
    graph.replay()
    torch.cuda.synchronize(device)
    expect_bits(f"graph_replay: {w.name} after changing the inputs", tuple(t.clone() for t in static),
                _outputs(op, root, w, inputs))


def check_workloads(op, run_config) -> None:
    live = op.workloads(run_config.grid)
    recorded = [row for row in run_config.workloads]
    live_rows = [{**w.to_json(), "coefficient": r["coefficient"]} for w, r in zip(live, recorded)]
    if len(live) != len(recorded) or workloads_hash(live_rows) != run_config.workloads_hash:
        raise CheckFailed(f"workloads: the op's {run_config.grid!r} workload table "
                          f"({len(live)} workloads) no longer matches the run's record "
                          f"({len(recorded)}, hash {run_config.workloads_hash[:12]})")


def run_gate(op, impl, root, config, device, run_config, seed: int) -> dict:
    """Run the contract and anti-hacking checks in order, stopping at the first failure.

    Returns {check name: "ok" | failure message | "not run"}. ``config`` is the candidate's
    full config (None for a source candidate)."""
    steps = [(name, (lambda fn=fn: fn(impl, root))) for name, fn in op.contract(device)]
    for w in op.check_workloads(device):
        inputs = op.make_inputs(w, seed, device)
        steps += [
            (f"dispatch[{w.name}]", lambda w=w, i=inputs: check_dispatch(op, impl, w, i, device, config)),
            (f"side_stream[{w.name}]", lambda w=w, i=inputs: check_side_stream(op, impl, root, w, i, device)),
            (f"pointer_cache[{w.name}]", lambda w=w, i=inputs: check_pointer_cache(op, impl, root, w, i, seed)),
            (f"extremes[{w.name}]", lambda w=w, i=inputs: check_extremes(op, impl, root, w, i, seed)),
        ]
        if device.type == "cuda":
            steps.append((f"graph_replay[{w.name}]",
                          lambda w=w, i=inputs: check_graph_replay(op, impl, root, w, i, device, seed)))
    steps.append(("workloads", lambda: check_workloads(op, run_config)))
    results, failed = {}, False
    for name, fn in steps:
        if failed:
            results[name] = "not run"
            continue
        try:
            fn()
            results[name] = "ok"
        except CheckFailed as e:
            results[name], failed = str(e), True
        except Exception as e:  # a crash is a failed check, with its reason
            tail = traceback.format_exception_only(type(e), e)[-1].strip()
            results[name], failed = f"{name}: crashed: {tail[:400]}", True
    return results

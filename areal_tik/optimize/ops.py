"""The op interface the evaluator and proposers work through, and candidate loading.

An op (``op_attention.AttentionOp``, ``op_linear.LinearOp``) says what it runs and how:
its workload grids, how to build fresh inputs for a workload (and refill them in place,
at the same pointers), the call that is timed, its contract checks, its root config,
the knobs a config candidate may move, and the launch options that prove a config
candidate's own kernels ran.

An implementation ("impl") is any object with the op's entry points (attention:
``prefill`` and ``decode``; linear: ``forward``) and a ``modules`` attribute listing the
modules whose kernels it launches (for the dispatch evidence). A config candidate's impl
is the op's kernels launched with an explicit config (``op.config_impl``); a source
candidate is a Python module that defines the entry points (``load_source``).
"""
from __future__ import annotations

import dataclasses
import json
import importlib.util
import sys

from .binding import sha256

OPS = ("attention", "linear", "logprob", "norm", "rope", "swiglu")  # the ops the search knows


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # op-specific: "prefill", "train", "decode", "linear"
    params: dict
    coefficient: float = 1.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def workloads_hash(workloads) -> str:
    return sha256(json.dumps([w.to_json() if isinstance(w, Workload) else w for w in workloads],
                             sort_keys=True))


def workloads_from_json(rows) -> list[Workload]:
    return [Workload(r["name"], r["kind"], dict(r["params"]), float(r["coefficient"])) for r in rows]


class Op:
    """Base of an op: subclasses fill in the methods below."""

    name = ""
    entry_points: tuple = ()
    signatures: tuple = ()  # the entry points' signatures, for the prompt
    kernel_files: tuple = ()  # sources of the root, relative to areal_tik/unified_kernels

    @property
    def kernel_modules(self) -> tuple:
        raise NotImplementedError

    def root_config(self) -> dict:
        raise NotImplementedError

    def normalise(self, config: dict) -> dict:
        """Validate a full config (raise ValueError/TypeError naming the value)."""
        raise NotImplementedError

    def config_impl(self, config: dict):
        raise NotImplementedError

    def workloads(self, grid: str) -> list[Workload]:
        raise NotImplementedError

    def make_inputs(self, w: Workload, seed: int, device) -> dict:
        raise NotImplementedError

    def refill(self, w: Workload, inputs: dict, seed: int, scale: float = 1.0) -> None:
        """New contents for ``inputs`` in place (same tensors, same pointers)."""
        raise NotImplementedError

    def call(self, impl, w: Workload, inputs: dict) -> tuple:
        """The timed call: the outputs as a tuple of tensors."""
        raise NotImplementedError

    def check_workloads(self, device) -> list[Workload]:
        """Small workloads the anti-hacking checks run on (one per entry point)."""
        raise NotImplementedError

    def contract(self, device) -> list:
        """[(name, fn(impl, root) -> None, raising CheckFailed)]: the op's contract suite."""
        raise NotImplementedError

    def expected_launches(self, config: dict, w: Workload, inputs: dict) -> list[tuple[str, dict]]:
        """[(kernel name suffix, launch options)] a config impl must show for this call."""
        raise NotImplementedError

    def moves(self, config: dict) -> list[dict]:
        """Config deltas the mechanical proposer tries from ``config`` (one knob each)."""
        raise NotImplementedError

    def closed_knobs(self, delta: dict) -> list[str]:
        """The knobs a move closes when it changes bits ([] when a bit change says nothing
        about a single knob, as for a move of several)."""
        return []

    def restrict(self, delta: dict, winners: set, workloads) -> dict:
        """``delta`` cut to the entries whose every affected workload is in ``winners``
        ({} when the op's config has no such entries)."""
        return {}

    def apply(self, config: dict, delta: dict) -> dict:
        return self.normalise({**config, **delta})

    def affects(self, delta: dict, w: Workload) -> bool:
        """Can ``delta`` change this workload's time? (Successive halving skips the rest.)"""
        return True


def changed_entries(base: dict, config: dict) -> dict:
    """The fields or table entries in which ``config`` differs from ``base`` (both full,
    normalised configs): changed ones with their new value, removed ones as None. What
    ``Op.affects`` is asked about when two configs' launches are compared."""
    return {**{k: v for k, v in config.items() if base.get(k) != v}, **{k: None for k in base if k not in config}}


def restrict_groups(delta: dict, winners: set, workloads, key) -> dict:
    """For table configs: ``delta`` cut to the table keys whose every workload (``key(w)``)
    is in ``winners``; the other keys fall back to the kernel's table (the root's).
    {} when nothing is cut."""
    groups: dict = {}
    for w in workloads:
        groups.setdefault(key(w), []).append(w.name)
    kept = {k: v for k, v in delta.items() if groups.get(k) and all(n in winners for n in groups[k])}
    return kept if kept != delta else {}


def load_source(op: Op, path, name: str):
    """A source candidate (a ``.py`` file) as a fresh module; it must define the op's entry points.

    Loaded from its file (Triton reads kernel sources through ``inspect``), registered in
    ``sys.modules`` under ``name``; gets a ``modules`` attribute (itself plus the op's
    kernel modules) for the dispatch evidence."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    missing = [e for e in op.entry_points if not callable(getattr(module, e, None))]
    if missing:
        raise ValueError(f"candidate source must define {list(op.entry_points)}; missing {missing}")
    module.modules = (module, *op.kernel_modules)
    return module

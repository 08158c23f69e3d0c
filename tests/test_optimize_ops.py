"""The log-prob, RMSNorm, RoPE and SwiGLU ops of the search on CPU (tiny grids, interpreter):
the supported models' shapes in the H200 grid, a table move through the whole gate
(contract + anti-hacking checks), a numerics-fixing log-prob move refused by the root
bits, and planted hacks (a cached output, a shrunk row count) caught."""
import pytest
import torch

from areal_tik.optimize import evaluator
from areal_tik.optimize.checks import CheckFailed, run_gate
from areal_tik.optimize.ops import workloads_hash

CPU = torch.device("cpu")
NEW_OPS = ("logprob", "norm", "rope", "swiglu")


class _RunConfig:  # the fields of a run's config the gate reads
    def __init__(self, op):
        self.grid = "tiny"
        self.workloads = [{**w.to_json(), "coefficient": 1.0} for w in op.workloads("tiny")]
        self.workloads_hash = workloads_hash(self.workloads)


def test_the_h200_grids_are_the_supported_models_shapes():
    names = {name: [w.name for w in evaluator.make_op(name, "h200").workloads("h200")] for name in NEW_OPS}
    assert len(names["logprob"]) == 15 and "llama-3.2-1b.logprob.m8" in names["logprob"]
    assert {w.params["v"] for w in evaluator.make_op("logprob", "h200").workloads("h200")} == {151936, 128256}
    assert "qwen3.qk_norm.m4096" in names["norm"] and "qwen3-1.7b.norm.m1" in names["norm"]
    assert {"qwen3.rope.m1024", "llama-3.2-1b.rope.m1"} <= set(names["rope"])
    assert {w.params["i"] for w in evaluator.make_op("swiglu", "h200").workloads("h200")} == {3072, 6144, 8192}
    with pytest.raises(ValueError, match="grid must be one of"):
        evaluator.make_op("rope", "h100")


@pytest.mark.parametrize("name", NEW_OPS)
def test_a_table_move_passes_the_whole_gate(name):
    op = evaluator.make_op(name, "tiny")
    move = op.moves({})[0]
    config = op.apply({}, move)
    results = run_gate(op, op.config_impl(config), op.config_impl({}), config, CPU, _RunConfig(op), seed=3)
    assert results and all(v == "ok" for v in results.values()), results
    assert {"root_bits", "row_invariance", "workloads"} <= set(results)
    assert any(k.startswith("dispatch[") for k in results) and any(k.startswith("extremes[") for k in results)


def test_a_logprob_split_change_is_refused_by_the_root_bits():
    op = evaluator.make_op("logprob", "tiny")
    move = next(m for m in op.moves({}) if m["100x32"]["split_v"] == 32)  # 4 splits of V = 100, not 2
    impl, root = op.config_impl(op.apply({}, move)), op.config_impl({})
    with pytest.raises(CheckFailed, match="differ in bits"):
        dict(op.contract(CPU))["root_bits"](impl, root)


class _Cached:
    """A planted hack: the first answer for each input shape, whatever the contents."""

    def __init__(self, op):
        self.inner, self.seen, self.modules = op.config_impl({}), {}, (op.module,)

    def forward(self, **inputs):
        key = tuple(tuple(v.shape) for v in inputs.values())
        if key not in self.seen:
            self.seen[key] = tuple(t.clone() for t in self.inner.forward(**inputs))
        return self.seen[key]


class _Shrunk:
    """A planted hack: computes the first row only and leaves the rest uninitialised."""

    def __init__(self, op):
        self.inner, self.modules = op.config_impl({}), (op.module,)

    def forward(self, gate_up):
        out = torch.zeros(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        out[:1] = self.inner.forward(gate_up=gate_up[:1])[0]
        return (out,)


@pytest.mark.parametrize("hack, reason", [(_Cached, "row_invariance"), (_Shrunk, "root_bits")])
def test_planted_hacks_fail_the_swiglu_gate(hack, reason):
    op = evaluator.make_op("swiglu", "tiny")
    results = run_gate(op, hack(op), op.config_impl({}), None, CPU, _RunConfig(op), seed=3)
    failed = [k for k, v in results.items() if v not in ("ok", "not run")]
    assert failed == [reason] and "differ in bits" in results[reason]

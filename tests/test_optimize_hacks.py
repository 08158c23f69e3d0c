"""The evaluator's anti-hacking checks catch planted hacks (tiny linear op, interpreter):
cached root outputs, caching by pointer, side-stream launches, no kernel at all, a config
knob that never reaches the kernel, shrunk work and a shrunk workload table; crashes,
compile errors and hangs are failed audits with their reasons."""
import importlib
import re
import textwrap

import pytest
import torch

from areal_tik.optimize import checks, evaluator, op_linear, timing
from areal_tik.optimize.checks import CheckFailed
from areal_tik.optimize.launches import record_launches
from areal_tik.optimize.ops import load_source

L = importlib.import_module("areal_tik.unified_kernels.linear")
CPU = torch.device("cpu")
HEADER = 'import importlib, time, torch\nL = importlib.import_module("areal_tik.unified_kernels.linear")\n'
HACKS = {
    "honest": "def forward(x2d, weight, bias):\n"
              "    return L.linear_forward(x2d, weight, bias, config=L.TileConfig(16, 32, 16))\n",
    "root_cache": """
        _cache = {}
        def forward(x2d, weight, bias):  # the root's output, computed once per shape
            key = (tuple(x2d.shape), tuple(weight.shape))
            if key not in _cache:
                _cache[key] = L.linear_forward(x2d, weight, bias)
            return _cache[key]
        """,
    "pointer_cache": """
        _cache = {}
        def forward(x2d, weight, bias):  # keyed by the input pointers
            key = (x2d.data_ptr(), weight.data_ptr(), x2d.shape[0])
            if key not in _cache:
                _cache[key] = L.linear_forward(x2d, weight, bias)
            return _cache[key].clone()
        """,
    "side_stream": """
        def forward(x2d, weight, bias):  # work on a stream the caller's timer does not see
            with torch.cpu.stream(torch.cpu.Stream()):
                return L.linear_forward(x2d, weight, bias)
        """,
    "no_kernel": "def forward(x2d, weight, bias):\n"
                 "    return (x2d.float() @ weight.float().T).to(x2d.dtype)\n",
    "shrink_rows": """
        def forward(x2d, weight, bias):  # computes half the rows
            half = max(1, x2d.shape[0] // 2)
            out = torch.zeros(x2d.shape[0], weight.shape[0], dtype=x2d.dtype)
            out[:half] = L.linear_forward(x2d[:half], weight, bias)
            return out
        """,
    "shrink_table": """
        import areal_tik.optimize.op_linear as O
        O.TINY_TOKENS = O.TINY_TOKENS[:1]  # times itself on the smallest workloads only
        def forward(x2d, weight, bias):
            return L.linear_forward(x2d, weight, bias)
        """,
    "crash": "def forward(x2d, weight, bias):\n    raise RuntimeError('boom')\n",
    "syntax": "def forward(x2d, weight, bias)\n    return x2d\n",
    "hang": "def forward(x2d, weight, bias):\n    time.sleep(30)\n",
}


@pytest.fixture
def op():
    return op_linear.LinearOp("tiny")


def _load(op, tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(HACKS[name]))
    return load_source(op, path, f"hack_{name}_{tmp_path.name}")


def _check_input(op):
    w = op.check_workloads(CPU)[0]
    return w, op.make_inputs(w, 3, CPU)


def test_the_gate_passes_an_honest_source_candidate(op, tmp_path):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    impl = _load(op, tmp_path, "honest")
    results = checks.run_gate(op, impl, op.config_impl({}), None, CPU, run.config, seed=5)
    assert set(results.values()) == {"ok"}, results


@pytest.mark.parametrize("name", ["root_cache", "pointer_cache"])
def test_cached_outputs_are_caught_by_changing_inputs_in_place(op, tmp_path, name):
    impl, root = _load(op, tmp_path, name), op.config_impl({})
    w, inputs = _check_input(op)
    with pytest.raises(CheckFailed, match="after an in-place input change"):
        checks.check_pointer_cache(op, impl, root, w, inputs, seed=1)
    checks.check_pointer_cache(op, _load(op, tmp_path, "honest"), root, w, inputs, seed=1)


def test_a_second_cached_call_launches_no_kernel(op, tmp_path):
    impl = _load(op, tmp_path, "root_cache")
    w, inputs = _check_input(op)
    checks.check_dispatch(op, impl, w, inputs, CPU, None)  # first call computes
    with pytest.raises(CheckFailed, match="no kernel of the candidate launched"):
        checks.check_dispatch(op, impl, w, inputs, CPU, None)


def test_side_stream_launches_are_caught(op, tmp_path):
    impl, root = _load(op, tmp_path, "side_stream"), op.config_impl({})
    w, inputs = _check_input(op)
    with pytest.raises(CheckFailed, match="off the current stream"):
        checks.check_dispatch(op, impl, w, inputs, CPU, None)
    with pytest.raises(CheckFailed, match="not on the caller's stream"):
        checks.check_side_stream(op, impl, root, w, inputs, CPU)
    checks.check_side_stream(op, root, root, w, inputs, CPU)  # the root's launches follow the stream


def test_an_output_without_a_kernel_launch_is_caught(op, tmp_path):
    w, inputs = _check_input(op)
    with pytest.raises(CheckFailed, match="no kernel of the candidate launched"):
        checks.check_dispatch(op, _load(op, tmp_path, "no_kernel"), w, inputs, CPU, None)


def test_a_config_knob_that_never_reaches_the_kernel_is_caught(op):
    w, inputs = _check_input(op)
    key = op_linear.group_key(w.params["m"], w.params["n"], w.params["k"])
    config = op.normalise({key: {"block_m": 16, "block_n": 32, "block_k": 16, "num_stages": 2}})

    class Ignoring(op_linear.LinearImpl):
        def forward(self, x2d, weight, bias):
            return L.linear_forward(x2d, weight, bias)  # the table's config, not ours

    checks.check_dispatch(op, op.config_impl(config), w, inputs, CPU, config)
    with pytest.raises(CheckFailed, match="no launch of _linear_fwd_kernel with"):
        checks.check_dispatch(op, Ignoring(config), w, inputs, CPU, config)


def test_an_attention_head_pack_that_never_reaches_the_kernel_is_caught():
    """The prefill launch's head pack and order chunk are part of its dispatch evidence: a
    config asking for two heads a program, served by the root's launch, is caught."""
    from areal_tik.optimize.op_attention import AttentionOp

    att = AttentionOp("tiny")
    config = att.normalise({**att.root_config(), "prefill_pack_heads": 2, "prefill_order_chunk": 2})
    w = next(w for w in att.check_workloads(CPU) if w.kind == "prefill")
    inputs = att.make_inputs(w, 3, CPU)
    checks.check_dispatch(att, att.config_impl(config), w, inputs, CPU, config)
    with pytest.raises(CheckFailed, match="no launch of _prefill_fwd_kernel with"):
        checks.check_dispatch(att, att.config_impl(att.root_config()), w, inputs, CPU, config)


def test_shrunk_work_is_caught_by_the_bits_of_every_timed_workload(op, tmp_path):
    impls = {"root": op.config_impl({}), "candidate": _load(op, tmp_path, "shrink_rows")}
    times, failures = timing.paired(op, impls, op.workloads("tiny"), CPU, reference="root", rounds=1)
    failed = {f.split(" ")[0] for f in failures}
    assert failed == {w.name for w in op.workloads("tiny") if w.params["m"] > 1}, failures


def test_a_shrunk_workload_table_is_caught(op, tmp_path, monkeypatch):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    checks.check_workloads(op, run.config)
    monkeypatch.setattr(op_linear, "TINY_TOKENS", op_linear.TINY_TOKENS)  # restored after the test
    _load(op, tmp_path, "shrink_table")
    with pytest.raises(CheckFailed, match="no longer matches the run's record"):
        checks.check_workloads(op, run.config)


def test_a_numerics_changing_config_fails_the_contract(tmp_path):
    # kv_split sets where the online softmax restarts: the attention contract refuses it
    # (the contract, not a guess, decides which knobs are free).
    run = evaluator.init_run(tmp_path / "run", "attention", "tiny", coefficients="uniform")
    cand = evaluator.propose(run, evaluator.make_op("attention", "tiny"), delta={"kv_split": 64})
    audit = evaluator.Evaluator(run, rounds=1).audit(cand.id)
    assert not audit.passed and audit.checks["root_bits"].startswith("root_bits: packed prefill")
    assert "differ in bits" in audit.reasons[0] and run.state().best == "root"


@pytest.mark.parametrize("name,reason", [("pointer_cache", "none launched|differ|unchanged"), ("crash", "boom"),
                                         ("syntax", "SyntaxError"), ("hang", "TimeoutError")])
def test_bad_candidates_are_failed_audits_and_the_run_goes_on(tmp_path, name, reason):
    run = evaluator.init_run(tmp_path / "run", "linear", "tiny", coefficients="uniform")
    src = tmp_path / f"{name}.py"
    src.write_text(HEADER + textwrap.dedent(HACKS[name]))
    op = op_linear.LinearOp("tiny")
    cand = evaluator.propose(run, op, source_path=src, proposer="agent")
    audit = evaluator.Evaluator(run, rounds=1, timeout_s=2.0 if name == "hang" else 300.0).audit(cand.id)
    assert not audit.passed and not audit.promotable
    assert any(re.search(reason, r) for r in audit.reasons), audit.reasons
    assert run.state().best == "root" and run.get("lineage", cand.id).status == "failed"
    assert run.events()[-1]["kind"] == "audit"


def test_launch_recorder_nests_and_restores_on_error():
    original = L._linear_fwd_kernel
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="inner"):
        with record_launches([L]) as outer:
            with record_launches([L]) as inner:
                L.linear_forward(x, w, None)
                raise RuntimeError("inner")
    assert L._linear_fwd_kernel is original
    assert len(outer) == len(inner) == 1 and inner[0].kernel.endswith("_linear_fwd_kernel")

"""The optimisation gate on the GPU (``-m gpu``): the GPU-only checks (CUDA-graph replay
after the inputs changed in place, launches on the caller's CUDA stream) pass the root
configs and catch a side-stream candidate and a pointer cache inside a captured graph."""
import textwrap

import pytest
import torch

from areal_tik.optimize import checks, evaluator
from areal_tik.optimize.checks import CheckFailed
from areal_tik.optimize.ops import load_source

pytestmark = pytest.mark.gpu
HEADER = 'import importlib, torch\nL = importlib.import_module("areal_tik.unified_kernels.linear")\n'
SIDE_STREAM = """
    def forward(x2d, weight, bias):
        with torch.cuda.stream(torch.cuda.Stream()):
            return L.linear_forward(x2d, weight, bias)
    """
POINTER_CACHE = """
    _cache = {}
    def forward(x2d, weight, bias):
        key = (x2d.data_ptr(), weight.data_ptr(), x2d.shape[0])
        if key not in _cache:
            _cache[key] = L.linear_forward(x2d, weight, bias)
        return _cache[key]
    """


def _load(op, tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return load_source(op, path, f"gpu_hack_{name}_{tmp_path.name}")


@pytest.mark.parametrize("op_name", ["attention", "linear", "logprob", "norm", "rope", "swiglu"])
def test_the_gate_passes_the_root_config_with_the_gpu_checks(tmp_path, op_name):
    run = evaluator.init_run(tmp_path / "run", op_name, "h200", "cuda", coefficients="uniform")
    op = evaluator.make_op(op_name, "h200")
    config = run.config.root_config
    results = checks.run_gate(op, op.config_impl(config), op.config_impl(config), config,
                              torch.device("cuda"), run.config, seed=1)
    assert set(results.values()) == {"ok"}, results
    assert any(name.startswith("graph_replay") for name in results)


def test_gpu_checks_catch_side_streams_and_pointer_caches_in_graphs(tmp_path):
    op = evaluator.make_op("linear", "h200")
    cuda = torch.device("cuda")
    root = op.config_impl({})
    w = op.check_workloads(cuda)[0]
    inputs = op.make_inputs(w, 3, cuda)
    side = _load(op, tmp_path, "side", SIDE_STREAM)
    with pytest.raises(CheckFailed, match="off the current stream"):
        checks.check_dispatch(op, side, w, inputs, cuda, None)
    with pytest.raises(CheckFailed, match="not on the caller's stream"):
        checks.check_side_stream(op, side, root, w, inputs, cuda)
    cached = _load(op, tmp_path, "cached", POINTER_CACHE)
    with pytest.raises(CheckFailed, match="graph_replay"):
        checks.check_graph_replay(op, cached, root, w, inputs, cuda, seed=5)
    checks.check_graph_replay(op, root, root, w, inputs, cuda, seed=5)

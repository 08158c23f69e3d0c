"""Programmatic dependent launch (unified_kernels/_pdl.py): launch gaps only, never bits.

CPU: every kernel that can be launched with PDL waits for its predecessor before anything
else, every PDL launch passes the kernel its PDL flag, and the decode step's kernels all take
part; PDL stays off on the CPU and under the interpreter. GPU (``-m gpu``): decode graphs and
whole engine runs give the same bits with PDL on and off, equal to the packed training
forward, replay after replay.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import areal_tik
from areal_tik.unified_kernels import _pdl

ROOT = pathlib.Path(areal_tik.__file__).parent

# The forward kernels: a decode step (norms, projections, q/k norm + rope + K/V store, paged
# attention and its combine, SwiGLU, the LM head's LSE, the Gumbel draw), prefill and training
# forward (norms, rope, K/V store apart).
PDL_KERNELS = {
    "_rms_norm_fwd_kernel", "_linear_fwd_kernel", "_linear_fwd_persistent_kernel", "_rope_kernel",
    "_qk_norm_rope_kernel", "_store_kv_kernel", "_prefill_fwd_kernel", "_decode_fwd_kernel", "_decode_combine_kernel",
    "_silu_mul_fwd_kernel", "_lse_partial_kernel", "_combine_kernel", "_gumbel_argmax_kernel",
    "_gumbel_combine_kernel",
}


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_jit(node) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _kernels_with_pdl() -> dict[str, tuple[pathlib.Path, ast.FunctionDef]]:
    found = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_jit(node) and any(a.arg == "PDL" for a in node.args.args):
                found[node.name] = (path, node)
    return found


def _body_without_docstring(fn: ast.FunctionDef) -> list:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


# Calls allowed before the wait: index arithmetic, no memory access (the tile order helper is
# integer arithmetic on its arguments).
BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.cdiv", "tl.num_programs", "_tile_coords", "to"}
WAITS = {"pdl_wait", "l2_prefetch_rows_then_wait"}


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute) and not isinstance(func.value, ast.Name):
        return func.attr  # a method such as (x % n).to(...)
    return ast.unparse(func)


def test_every_pdl_kernel_waits_before_any_memory_access():
    kernels = _kernels_with_pdl()
    assert set(kernels) == PDL_KERNELS | {"pdl_wait", "l2_prefetch_rows_then_wait"}
    for name, (path, fn) in kernels.items():
        if name in WAITS:
            continue
        where = f"{path.name}:{fn.lineno} {name}"
        body = _body_without_docstring(fn)
        waits = [i for i, st in enumerate(body) if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                 and _call_name(st.value) in WAITS and "PDL" in ast.unparse(st.value)]
        assert waits, f"{where}: no pdl_wait(PDL) / l2_prefetch_rows_then_wait(..., PDL, ...) at its top level"
        for st in body[:waits[0]]:
            calls = {_call_name(c) for c in ast.walk(st) if isinstance(c, ast.Call)}
            assert calls <= BEFORE_WAIT and not isinstance(st, (ast.If, ast.For, ast.While, ast.Return)), (
                f"{where}: {ast.unparse(st)!r} runs before the wait (a load there may read the previous "
                "kernel's unfinished output)")
        default = fn.args.defaults[-1] if fn.args.args[-1].arg in ("PDL", "PREFETCH_W") else None
        assert default is not None and ast.unparse(default) == "False", f"{where}: PDL must default to False"


def test_generated_ptx_waits_before_every_global_access():
    """Every PDL kernel compiled for sm_90a (tests/_ptx_probe.py: triton's own ptxas, no GPU,
    the GPU's launch configs): griddepcontrol.wait comes before each global load, store,
    atomic and async copy, launch_dependents after the wait, and the small-row linear's L2
    prefetch before it: the order the source promises is the order the hardware gets."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT.parent))
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("_ptx_probe.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert set(found) == PDL_KERNELS
    for name, at in found.items():
        assert len(at["wait"]) >= 1 and at["access"], f"{name}: {at}"
        wait = at["wait"][0]
        assert min(at["access"]) > wait, f"{name}: a global access at PTX line {min(at['access'])}, the wait at {wait}"
        assert at["dependents"] and min(at["dependents"]) > wait, f"{name}: launch_dependents before the wait"
        if name == "_linear_fwd_kernel":
            assert at["prefetch"] and max(at["prefetch"]) < wait, f"{name}: the L2 prefetch must precede the wait"
        else:
            assert not at["prefetch"], name


def test_every_pdl_launch_passes_the_same_flag_to_the_kernel():
    kernels = _kernels_with_pdl()
    launches = 0
    for path, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
            name = ast.unparse(node.func.value)
            if "launch_pdl" not in kw:
                continue
            launches += 1
            where = f"{path.name}:{node.lineno} {name}"
            assert name in kernels, f"{where}: launched with PDL but has no PDL parameter (it would not wait)"
            assert kw.get("PDL") == kw["launch_pdl"], f"{where}: PDL={kw.get('PDL')} but launch_pdl={kw['launch_pdl']}"
    assert launches >= len(PDL_KERNELS)


def test_switches_refuse_values_other_than_0_and_1(monkeypatch):
    from areal_tik.unified_kernels._common import env_switch
    monkeypatch.delenv("AREAL_TIK_TEST_SWITCH", raising=False)
    assert env_switch("AREAL_TIK_TEST_SWITCH", True) and not env_switch("AREAL_TIK_TEST_SWITCH", False)
    monkeypatch.setenv("AREAL_TIK_TEST_SWITCH", "0")
    assert not env_switch("AREAL_TIK_TEST_SWITCH", True)
    monkeypatch.setenv("AREAL_TIK_TEST_SWITCH", "1")
    assert env_switch("AREAL_TIK_TEST_SWITCH", False)
    monkeypatch.setenv("AREAL_TIK_TEST_SWITCH", "true")
    with pytest.raises(ValueError, match="AREAL_TIK_TEST_SWITCH must be 0 or 1, got 'true'"):
        env_switch("AREAL_TIK_TEST_SWITCH", False)


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    with _pdl.enabled(True, weight_prefetch=True):
        assert not _pdl.pdl(torch.zeros(2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with _pdl.enabled(True):
        assert not _pdl.pdl(torch.zeros(2))
    before = _pdl.ENABLED
    with _pdl.enabled(not before):
        assert _pdl.ENABLED is (not before)
    assert _pdl.ENABLED is before


# ---------------------------------------------------------------------------- GPU


def _hopper() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer")


@pytest.mark.gpu
def test_gpu_pdl_decode_graph_replays_to_the_bits_without_pdl():
    """Decode of 5 sequences (one crossing the 2048-position KV split: the split kernel and its
    combine) captured with PDL, replayed 50 times: each replay equals eager decode without
    PDL and the packed training rows."""
    _hopper()
    from .test_model_gpu import GPU_BLOCK, _gpu_model
    from ._bits import assert_bitwise
    from ._model_utils import PagedLayout, make_seqs, packed_rows, prefill_rows

    m = _gpu_model("Qwen3-0.6B")
    seqs = make_seqs((30, 70, 5, 200, 2100), m.spec.vocab, seed=29)
    prompts = [len(s) - 1 for s in seqs]
    ids = list(range(len(seqs)))
    layout = PagedLayout(m, [len(s) for s in seqs], GPU_BLOCK, seed=9)
    with torch.no_grad():
        prefill_rows(m, layout, seqs, ids, prompts)
        inputs = dict(
            input_ids=torch.stack([seqs[i][prompts[i]] for i in ids]).cuda(),
            positions=torch.tensor(prompts, dtype=torch.int64, device="cuda"),
            slot_mapping=torch.cat([layout.slots(i, [prompts[i]]) for i in ids]),
            block_tables=layout.block_tables(ids),
            context_lens=torch.tensor([p + 1 for p in prompts], dtype=torch.int32, device="cuda"),
        )
        with _pdl.enabled(False):
            eager = m.decode(cache=layout.cache, **inputs)
        with _pdl.enabled(True):
            assert _pdl.pdl(eager)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                m.decode(cache=layout.cache, **inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = m.decode(cache=layout.cache, **inputs)
        for replay in range(50):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise(out, eager, f"replay {replay}: PDL graph vs eager decode without PDL")
    packed = packed_rows(m, seqs)
    assert_bitwise(out, torch.stack([packed[(i, prompts[i])] for i in ids]), "PDL graph vs packed training rows")


@pytest.mark.gpu
def test_gpu_pdl_engine_runs_equal_without_pdl_and_training():
    """The engine (CUDA graphs, overlapped steps, batches shrinking as requests end) without
    PDL, with PDL, and with PDL and the linears' L2 weight prefetch: the same tokens and
    log-prob bits, equal to the packed training forward."""
    _hopper()
    from areal_tik.engine import LLM, EngineConfig, SamplingParams
    from .test_model_gpu import _gpu_model
    from ._engine_utils import assert_bitwise_logprobs, assert_same_outputs, prompts_of

    m = _gpu_model("Qwen3-0.6B")
    prompts = prompts_of([5, 40, 130, 9, 300, 64, 17, 2], seed=31, vocab=m.spec.vocab)
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True) for n in (40, 7, 64, 21, 33, 1, 50, 12)]
    outputs = {}
    for on, prefetch in ((False, False), (True, False), (True, True)):
        with _pdl.enabled(on, weight_prefetch=prefetch), LLM(m, EngineConfig(
                max_num_seqs=8, max_model_len=512, kv_block_size=64, cuda_graphs=True, seed=3)) as llm:
            outputs[on, prefetch] = llm.generate(prompts, params)
    assert_same_outputs(outputs[True, False], outputs[False, False])
    assert_same_outputs(outputs[True, True], outputs[False, False])
    assert_bitwise_logprobs(m, outputs[True, True])

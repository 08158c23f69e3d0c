"""The compiled standard set (``compiled_standard_ops``: the standard ops with their elementwise
chains under torch.compile, the recipes' stock engine and bench_rollout's "compiled" backend)
computes what the standard set computes (a baseline, so not a bitwise claim: rounding apart),
leaves the shared standard set and the KV store alone, and reaches the engine only through
``EngineConfig.compile_standard_ops``, which the unified kernels refuse."""
import pytest
import torch

from areal_tik.model import ops as standard_module
from areal_tik.model.ops import COMPILED_STANDARD_OPS, compiled_standard_ops, engine_ops, get_ops


def _is_compiled(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")


def test_compiled_standard_ops_compute_what_the_standard_ops_compute():
    eager, compiled = get_ops("standard"), compiled_standard_ops()
    assert compiled.kind == "standard"
    for name in COMPILED_STANDARD_OPS:  # compiled here, the plain function in every other standard set
        plain = getattr(standard_module, f"_std_{name}")
        assert _is_compiled(getattr(compiled, name)) and getattr(get_ops("standard"), name) is plain
    # the KV store stays the plain op (compiled, its in-place write copied the whole cache)
    assert compiled.store_kv_cache is standard_module._std_store_kv_cache
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    res = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)

    def close(a, b):
        return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)

    assert close(compiled.rms_norm(x, w, 1e-6), eager.rms_norm(x, w, 1e-6))
    for a, b in zip(compiled.add_rms_norm(x, res, w, 1e-6), eager.add_rms_norm(x, res, w, 1e-6)):
        assert close(a, b)
    gate_up = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    assert close(compiled.silu_mul(gate_up), eager.silu_mul(gate_up))
    assert not close(compiled.silu_mul(gate_up), eager.silu_mul(gate_up.flip(0)))  # close() can fail
    cos, sin = eager.rope_cos_sin(32, 16, 10000.0)
    q = torch.randn(6, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 2, 16, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 5, 7, 30, 31])
    for a, b in zip(compiled.apply_rope(q, k, pos, cos, sin), eager.apply_rope(q, k, pos, cos, sin)):
        assert close(a, b)


def test_engine_ops_compiles_only_the_standard_set_when_asked():
    assert engine_ops("standard") == "standard" and engine_ops("unified", True) == "unified"
    ops = engine_ops("standard", True)
    assert ops.kind == "standard" and _is_compiled(ops.rms_norm)


def test_engine_config_refuses_compile_standard_ops_for_the_unified_kernels():
    from areal_tik.engine import EngineConfig

    config = EngineConfig(compile_standard_ops=True)
    config.check_kernels("standard")
    with pytest.raises(ValueError, match="compile_standard_ops"):
        config.check_kernels("unified")
    with pytest.raises(TypeError, match="compile_standard_ops"):
        EngineConfig(compile_standard_ops="yes")


def test_the_stock_engine_built_with_compiled_ops_generates_what_the_eager_one_does(tmp_path):
    """build_llm (the colocated engine of the recipes' stock mode) with compile_standard_ops:
    its model runs the compiled ops, and a greedy generation gives the eager standard engine's
    tokens, log-probs to fp32 rounding (a tiny fp32 model on CPU)."""
    from areal_tik.adapter.config import ColocatedEngineConfig
    from areal_tik.adapter.inference import build_llm
    from areal_tik.engine import SamplingParams
    from areal_tik.model import random_model, tiny_config

    random_model(tiny_config("qwen3"), dtype=torch.float32, seed=0).save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 11, 3], [7, 2, 8, 8, 1, 4, 6]]
    outputs = {}
    for compiled in (False, True):
        config = ColocatedEngineConfig(max_num_seqs=2, max_model_len=32, kv_block_size=32, num_kv_blocks=3,
                                       compile_standard_ops=compiled)
        with build_llm(config, str(tmp_path), torch.float32, "standard", "cpu") as llm:
            assert _is_compiled(llm.model.ops.rms_norm) is compiled
            outputs[compiled] = llm.generate(prompts, params)
    for eager, comp in zip(outputs[False], outputs[True]):
        assert comp.token_ids == eager.token_ids and len(eager.token_ids) == 6
        assert torch.allclose(torch.tensor(comp.logprobs), torch.tensor(eager.logprobs), atol=1e-4)

"""The training warm-up compiles the kernels in the dtype the forward computes in.

AReaL's FSDP engine keeps fp32 master parameters and unshards them in ``actor.dtype``
(bf16) for the forward, so the parameters' own dtype is not the one the kernels see: on
the H200 the Qwen2.5-1.5B recipe stopped in the warm-up, compiling an fp32 attention
backward (head_dim 128) that asks 288 KiB of shared memory and that no step launches."""
import types

import torch

from areal_tik.adapter.actor import TikFSDPPPOActor
from areal_tik.engine.model_runner import warmup_shapes
from areal_tik.model import UnifiedCausalLM, random_model, tiny_config


def _fp32_model():
    return UnifiedCausalLM.from_hf(random_model(tiny_config("qwen2"), dtype=torch.float32, seed=3))


def test_warmup_shapes_take_the_compute_dtype_over_the_parameters():
    model = _fp32_model()
    own, bf16 = warmup_shapes(model), warmup_shapes(model, dtype=torch.bfloat16)
    assert own.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert {k: v for k, v in vars(own).items() if k != "dtype"} == {k: v for k, v in vars(bf16).items() if k != "dtype"}


def test_the_actors_training_warmup_asks_the_configured_dtype(monkeypatch):
    import areal_tik.unified_kernels as uk

    model = _fp32_model()
    seen = []
    monkeypatch.setattr(uk, "warmup", lambda shapes, **kw: seen.append((shapes, kw)) or {})
    # the warm-up runs on CUDA only: the model is shown to it as a CUDA one
    shown = types.SimpleNamespace(config=model.config, hf_model=model.hf_model, device=torch.device("cuda"))
    actor = types.SimpleNamespace(tik_model=shown, config=types.SimpleNamespace(
        tik_kernels="unified", dtype="bfloat16", mb_spec=types.SimpleNamespace(max_tokens_per_mb=64)))
    TikFSDPPPOActor._warm_training_kernels(actor)
    ((shapes, kw),) = seen
    assert shapes.dtype == torch.bfloat16 and kw["training"] and kw["max_rows"] == 64
    assert shapes == warmup_shapes(model, dtype=torch.bfloat16)

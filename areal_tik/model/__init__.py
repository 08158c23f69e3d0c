"""The unified model: one decoder implementation (Qwen2/2.5, Qwen3, Llama 3.x / SmolLM2)
over a wrapped transformers *ForCausalLM, on the "unified" Triton ops or the "standard"
torch ops (see ``ops.py``).

    from areal_tik.model import UnifiedCausalLM, KVCache
    m = UnifiedCausalLM.from_hf(hf_model, kernels="unified")
    h = m.forward_packed(input_ids, positions, cu_seqlens, max_seqlen)
    lp = m.token_logprobs(h, targets, temperature)

Local model directories for runs without a hub (a tiny random model, SmolLM2 from its
GGUF) are written by ``checkpoints.py`` (``areal-tik prepare-model``).
"""
from .fused import fuse_projection_storage
from .kv_cache import KVCache
from .loading import (PUBLISHED_CONFIGS, TINY_FAMILIES, load_hf_model, published_config, random_model,
                      smollm2_path, tiny_config)
from .ops import OP_NAMES, KernelUnavailableError, get_ops, missing_ops
from .spec import SUPPORTED_FAMILIES, ModelSpec, detect_family
from .unified import UnifiedCausalLM

__all__ = [
    "UnifiedCausalLM", "KVCache", "ModelSpec", "detect_family", "SUPPORTED_FAMILIES",
    "get_ops", "missing_ops", "OP_NAMES", "KernelUnavailableError",
    "load_hf_model", "smollm2_path", "tiny_config", "published_config", "PUBLISHED_CONFIGS",
    "random_model", "TINY_FAMILIES", "fuse_projection_storage",
]

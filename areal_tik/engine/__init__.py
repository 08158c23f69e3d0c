"""Rollout engine: paged KV cache, continuous batching, CUDA-graph decode, sync-free sampling.

    from areal_tik.engine import LLM, EngineConfig, SamplingParams
    llm = LLM(model, EngineConfig(max_num_seqs=64, max_model_len=2048))
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=32))
    outs[0].token_ids, outs[0].logprobs, outs[0].versions

Dependencies run one way: engine -> model -> kernels. Each sampled token's log-prob comes
from the unified LM-head pass it was sampled from, so it equals the packed training
forward's log-prob bit for bit (``kernels="unified"``).
"""
from .config import EngineConfig, SamplingParams
from .llm_engine import LLM
from .sequence import GenerationOutput
from .step_loop import EngineBrokenError, EngineClosedError

__all__ = ["LLM", "EngineConfig", "SamplingParams", "GenerationOutput", "EngineBrokenError",
           "EngineClosedError"]

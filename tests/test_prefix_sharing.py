"""AReaL side of the prefix cache: a GRPO group's samples, submitted together as AReaL's
executor submits them, share the cached prompt; the in-process engine exports the hits
as ``tik/*`` metrics; the server reports its counters on /health."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import torch
from areal.api import ModelRequest, RolloutWorkflow

from areal_tik.adapter.inference import TikInferenceEngine, prefix_cache_metrics
from areal_tik.adapter.server import TikServer
from areal_tik.engine import LLM, EngineConfig
from areal_tik.model import UnifiedCausalLM, random_model, tiny_config

from .test_areal_server import SMALL
from .test_exactness import engine_config, gconfig

PROMPT = list(range(3, 3 + 40))  # two full blocks of 16 and a partial one
SAMPLES = 4


def caching_llm() -> LLM:
    model = UnifiedCausalLM.from_hf(random_model(tiny_config("llama", **SMALL), seed=0), kernels="standard")
    return LLM(model, EngineConfig(max_num_seqs=8, max_model_len=64, kv_block_size=16, seed=11,
                                   enable_prefix_caching=True), eos_token_ids=())


class Group(RolloutWorkflow):
    """One prompt's samples generated concurrently, one trajectory each, as a GRPO group."""

    async def arun_episode(self, engine, data):
        resps = await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=list(PROMPT), gconfig=gconfig()))
                                       for _ in range(SAMPLES)])
        return {"input_ids": torch.tensor([r.input_tokens + r.output_tokens for r in resps]),
                "attention_mask": torch.ones(SAMPLES, len(PROMPT) + 3, dtype=torch.bool)}


def test_a_group_shares_its_prompt_and_the_hits_are_exported():
    llm = caching_llm()
    engine = TikInferenceEngine(engine_config(), llm=llm)
    engine.initialize()
    try:
        engine.export_stats()  # the counters before the rollout
        (traj,) = engine.rollout_batch([{"ids": PROMPT}], workflow=Group())
        assert traj["input_ids"].shape[0] == SAMPLES
        stats = engine.export_stats()
        # the first sample computes the prompt; each later one reuses its two full blocks
        assert stats["tik/prefill_tokens_saved"] == (SAMPLES - 1) * 32
        assert stats["tik/prefix_hits"] == SAMPLES - 1 and stats["tik/prefix_queries"] == SAMPLES
        assert stats["tik/prefix_hit_rate"] == (SAMPLES - 1) * 32 / (SAMPLES * len(PROMPT))
        again = engine.export_stats()  # deltas: nothing new since the last export
        assert again["tik/prefill_tokens_saved"] == 0 and again["tik/prefix_queries"] == 0
    finally:
        engine.destroy()
        llm.close()


def test_metrics_are_deltas_of_the_engine_counters():
    before = {"queries": 2, "query_tokens": 80, "hits": 1, "hit_tokens": 32, "evictions": 0, "resets": 1}
    after = {"queries": 6, "query_tokens": 240, "hits": 4, "hit_tokens": 128, "evictions": 3, "resets": 1}
    m = prefix_cache_metrics(after, before)
    assert (m["tik/prefix_queries"], m["tik/prefix_hits"], m["tik/prefill_tokens_saved"]) == (4, 3, 96)
    assert m["tik/prefix_hit_rate"] == 96 / 160 and m["tik/prefix_evictions"] == 3 and m["tik/prefix_resets"] == 0
    assert prefix_cache_metrics(before, {})["tik/prefix_hit_rate"] == 32 / 80


def test_the_server_reports_its_prefix_cache_on_health():
    llm = caching_llm()
    server = TikServer(llm).start()
    try:
        futures = [llm.submit(PROMPT) for _ in range(2)]
        [f.result(timeout=60) for f in futures]
        with urllib.request.urlopen(f"http://{server.address}/health", timeout=30) as resp:
            health = json.load(resp)
        assert health["prefix_cache"]["hit_tokens"] == 32 and health["prefix_cache"]["hits"] == 1
    finally:
        server.stop(close_llm=True)

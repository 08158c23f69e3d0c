"""Prefix cache and chunked prefill under pressure: eviction and preemption with a tiny KV
budget, a weight update between two requests with the same prompt, bad configuration.

Bitwise claims run the unified kernels (Triton interpreter) on the tiny Qwen3 model and
compare against a cold engine (no cache, whole prompts) with integer views of the bits.
"""
from __future__ import annotations

import pytest
from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.block_manager import BlockManager
from areal_tik.engine.sequence import Sequence
from areal_tik.model import UnifiedCausalLM, random_model, tiny_config

from ._model_utils import tiny_hf
from .test_prefix_cache import BLOCK, _params, _prompts, _unified, assert_training_bits


def test_eviction_and_preemption_under_a_small_kv_budget():
    """3 usable blocks of 16: two 10-token prompts growing to 20 tokens cannot both stay,
    so one is preempted and re-admitted over its own cached block; a third prompt then
    evicts cached blocks. Every token's log-prob equals the packed training forward."""
    m = _unified("qwen3")
    prompts = [p[:10] for p in _prompts(seed=2)[2:]]
    config = EngineConfig(max_num_seqs=8, max_model_len=48, kv_block_size=BLOCK, num_kv_blocks=4,
                          enable_prefix_caching=True, prefill_chunk_tokens=BLOCK)
    with LLM(m, config) as llm:
        outputs = llm.generate(prompts, _params(2, tokens=10))
        assert llm.num_preemptions > 0 and llm.prefix_cache_stats["hit_tokens"] > 0
        outputs += llm.generate([_prompts(seed=1)[0][:33]], _params(1))
        stats = llm.prefix_cache_stats
        assert llm.runner.block_manager.num_free_blocks == 3
    assert stats["evictions"] > 0, stats
    assert any(o.num_preemptions for o in outputs)
    assert_training_bits(m, outputs)


def test_weight_update_invalidates_the_cache():
    """The second request with the same prompt, after a weight update, computes its prompt
    with the new weights: no hit, and the bits of the training forward at the new weights."""
    m = UnifiedCausalLM.from_hf(tiny_hf("qwen3", tied=False, fresh=True), kernels="unified")
    new = random_model(tiny_config("qwen3"), seed=9).state_dict()
    prompt, params = _prompts()[0], _params(1)
    with LLM(m, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=BLOCK,
                             enable_prefix_caching=True)) as llm:
        before = llm.generate([prompt], params)
        assert llm.runner.block_manager.num_cached_blocks == 2
        llm.update_weights(new)
        assert llm.runner.block_manager.num_cached_blocks == 0
        after = llm.generate([prompt], params)
        stats = llm.prefix_cache_stats
    assert after[0].num_cached_tokens == 0 and stats["hit_tokens"] == 0 and stats["resets"] == 1
    assert set(after[0].versions) == {1} and after[0].logprobs != before[0].logprobs
    assert_training_bits(m, after)  # m holds the new weights: old K/V would change the bits


def test_stale_sequence_never_registers_blocks():
    """A sequence whose K/V predate a weight update (recompute_running=False) keeps
    decoding but never publishes its blocks."""
    bm = BlockManager(8, 4, prefix_caching=True)
    seq = Sequence(0, list(range(3, 9)), SamplingParams(), 0)
    bm.allocate(seq)
    bm.reset_prefix_cache(1)
    seq.num_computed_tokens = 6
    bm.register(seq)
    assert bm.num_cached_blocks == 0
    fresh = Sequence(1, list(range(3, 9)), SamplingParams(), 0)
    assert bm.match(fresh) == [] and not bm.waits_on_pending(fresh, 0)
    bm.allocate(fresh)
    fresh.num_computed_tokens = 6
    bm.register(fresh)
    assert bm.num_cached_blocks == 1  # one full block of 4; the partial one is never shared
    block = fresh.block_table[0]
    bm.free(seq)
    bm.free(fresh)
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 1
    again = Sequence(2, list(range(3, 8)), SamplingParams(), 0)
    assert bm.match(again) == [block]


def test_lru_evicts_the_tail_of_the_oldest_sequence_first():
    bm = BlockManager(8, 4, prefix_caching=True)
    seqs = [Sequence(i, [10 * i + t for t in range(9)], SamplingParams(), 0) for i in range(2)]
    for s in seqs:
        bm.allocate(s)
        s.num_computed_tokens = 9
        bm.register(s)
    tables = [list(s.block_table) for s in seqs]
    for s in seqs:
        bm.free(s)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 7
    big = Sequence(2, list(range(100, 117)), SamplingParams(), 0)  # 5 blocks: 3 free, 2 evicted
    bm.allocate(big)
    assert bm.stats.evictions == 2 and bm.num_cached_blocks == 2
    assert big.block_table[3:] == [tables[0][1], tables[0][0]]  # oldest sequence, tail first
    assert bm.match(Sequence(3, seqs[1].token_ids, SamplingParams(), 0)) == tables[1][:2]


def test_bad_prefix_and_chunk_config_raises():
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be >= kv_block_size .* got 8"):
        EngineConfig(kv_block_size=16, prefill_chunk_tokens=8)
    with pytest.raises(TypeError, match="prefill_chunk_tokens"):
        EngineConfig(prefill_chunk_tokens=64.0)
    with pytest.raises(ValueError, match="num_kv_blocks must hold one sequence .* got 4"):
        EngineConfig(max_model_len=64, kv_block_size=16, num_kv_blocks=4)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching=1)
    cfg = EngineConfig(kv_block_size=16, prefill_chunk_tokens=16, enable_prefix_caching=True)
    assert cfg.prefill_chunk_tokens == 16 and cfg.enable_prefix_caching


def test_chunked_steps_mix_decode_rows_and_prompt_chunks():
    """A 12-token prompt arriving while a sequence decodes is computed 4 tokens a step in
    the same steps as the decode row; it samples only once its last chunk is done."""
    from areal_tik.engine.scheduler import Scheduler

    config = EngineConfig(max_num_seqs=4, max_model_len=32, kv_block_size=4, num_kv_blocks=20,
                          prefill_chunk_tokens=4)
    sched = Scheduler(config, BlockManager(20, 4), eos_token_ids=[0])
    first = Sequence(0, [5, 6, 7], SamplingParams(max_new_tokens=8), 0)
    sched.add(first)
    batch, has_prefill = sched.schedule()
    assert batch == [first] and has_prefill and first.num_scheduled_tokens == 3
    sched.postprocess(batch, [9], [-1.0], version=0)
    late = Sequence(1, list(range(3, 15)), SamplingParams(max_new_tokens=8), 1)
    sched.add(late)
    for step in range(3):
        batch, has_prefill = sched.schedule()
        assert batch == [late, first] and has_prefill
        assert (late.num_computed_tokens, late.num_scheduled_tokens, first.num_scheduled_tokens) == (4 * step, 4, 1)
        sampled = [9, 9] if step == 2 else [9]  # rows in sampling order: finished chunks, then decodes
        sched.postprocess(batch, sampled, [-1.0] * len(sampled), version=0)
    assert late.output_ids == [9] and first.output_ids == [9] * 4
    batch, has_prefill = sched.schedule()
    assert batch == [first, late] and not has_prefill  # both decode now, in running order

"""The model runner through the engine: rollout log-probs bitwise equal to the packed
training forward over mixed batches, late joins, reordering and preemption; CUDA-graph
buckets.

CPU: tiny random models under the Triton interpreter (about a second per engine step:
few steps each). GPU (-m gpu): published configs, CUDA graphs, 64 prompts x 256 tokens.
Bitwise claims are checked on integer bit views, never with a tolerance.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.model_runner import graph_buckets
from areal_tik.model import UnifiedCausalLM, published_config, random_model

from ._engine_utils import assert_bitwise_logprobs, assert_same_outputs, prompts_of
from ._engine_utils import hf_small, unified  # noqa: F401 - fixtures


# Prompt lengths cross the interpreter's attention tile (16) and KV split (32); params mix
# temperatures (two LM-head groups per step), greedy, top-k and top-p, with explicit seeds.
REQUESTS = [
    (1, SamplingParams(temperature=0.7, max_new_tokens=6, seed=11, ignore_eos=True)),
    (14, SamplingParams(temperature=1.0, max_new_tokens=7, seed=12, ignore_eos=True)),
    (15, SamplingParams(temperature=0.7, top_k=5, max_new_tokens=5, seed=13, ignore_eos=True)),
    (33, SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=4, seed=14, ignore_eos=True)),
    (13, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)),
]


LATE = [  # submitted while the first ones decode
    (4, SamplingParams(temperature=0.7, max_new_tokens=4, seed=15, ignore_eos=True)),
    (17, SamplingParams(temperature=1.0, max_new_tokens=3, seed=16, ignore_eos=True)),
]


PREEMPT = [1, 2, 4]  # REQUESTS indices rerun with a tiny KV cache


@pytest.fixture(scope="module")
def mixed_run(unified):
    """REQUESTS submitted at once, LATE while they decode; outputs in that order."""
    prompts = prompts_of([n for n, _ in REQUESTS + LATE])
    with LLM(unified, EngineConfig(max_num_seqs=8, max_model_len=48, kv_block_size=16)) as llm:
        futures = [llm.submit(p, sp) for p, (_, sp) in zip(prompts, REQUESTS)]
        deadline = time.monotonic() + 300
        while llm.num_steps < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(f.done() for f in futures), "the late requests must arrive during decoding"
        futures += [llm.submit(p, sp) for p, (_, sp) in zip(prompts[len(REQUESTS):], LATE)]
        outputs = [f.result(timeout=600) for f in futures]
    return prompts, outputs


def test_mixed_batch_logprobs_bitwise_equal_packed_forward(unified, mixed_run):
    prompts, outputs = mixed_run
    for prompt, out, (_, sp) in zip(prompts, outputs, REQUESTS + LATE):
        assert out.prompt_ids == prompt
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == sp.max_new_tokens
        assert out.finish_reason == "length" and set(out.versions) == {0}
        assert out.logprob_temperature == sp.logprob_temperature
        assert out.logprobs_match_sampling == (sp.temperature > 0 and sp.top_k == 0 and sp.top_p == 1.0)
    # The trainer's regime: packed, with autograd, micro-batched and ordered unlike the rollout.
    assert_bitwise_logprobs(unified, outputs, max_tokens_per_batch=40, order=[6, 3, 0, 5, 2, 4, 1], grad=True)
    assert_bitwise_logprobs(unified, outputs, max_tokens_per_batch=1000)


def test_top_k_top_p_and_greedy_respected(unified, mixed_run):
    prompts, outputs = mixed_run
    for index, (_, sp) in enumerate(REQUESTS):
        if sp.top_k == 0 and sp.top_p == 1.0 and sp.temperature > 0:
            continue
        out = outputs[index]
        seq = out.prompt_ids + out.token_ids
        n = len(seq)
        with torch.no_grad():
            hidden = unified.forward_packed(torch.tensor(seq), torch.arange(n),
                                            torch.tensor([0, n], dtype=torch.int32), n)
            logits, _ = unified.logits_lse(hidden[len(out.prompt_ids) - 1: n - 1], sp.logprob_temperature)
        for row, token in zip(logits.float(), out.token_ids):
            order = row.sort(descending=True, stable=True).indices.tolist()
            if sp.temperature == 0:
                assert token == order[0]
            elif sp.top_k:
                assert token in order[:sp.top_k]
            else:
                probs = torch.softmax(row / sp.temperature, -1)[order]
                kept = int((probs.cumsum(0) - probs < sp.top_p).sum())
                assert token in order[:kept]


def test_reordered_and_split_batches_reproduce_tokens_and_bits(unified, mixed_run):
    prompts, outputs = mixed_run
    params = [sp for _, sp in REQUESTS + LATE]
    seeded = [i for i, sp in enumerate(params) if sp.seed is not None or sp.temperature == 0]
    order = list(reversed(seeded))
    with LLM(unified, EngineConfig(max_num_seqs=3, max_model_len=48, kv_block_size=16)) as llm:
        first = llm.generate([prompts[i] for i in order[:2]], [params[i] for i in order[:2]])
        rest = llm.generate([prompts[i] for i in order[2:]], [params[i] for i in order[2:]])
    assert_same_outputs(first + rest, [outputs[i] for i in order])


def test_preemption_recomputes_the_same_tokens_and_bits(unified, mixed_run):
    prompts, outputs = mixed_run
    # 4 usable blocks of 16 tokens: three sequences of 14-21 tokens cannot all hold 2 blocks.
    config = EngineConfig(max_num_seqs=8, max_model_len=32, kv_block_size=16, num_kv_blocks=5)
    with LLM(unified, config) as llm:
        rerun = llm.generate([prompts[i] for i in PREEMPT], [REQUESTS[i][1] for i in PREEMPT])
        assert llm.num_preemptions > 0
        assert llm.runner.block_manager.num_free_blocks == 4
    assert any(o.num_preemptions for o in rerun)
    assert_same_outputs(rerun, [outputs[i] for i in PREEMPT])
    assert_bitwise_logprobs(unified, rerun)


def test_graph_buckets():
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40] and graph_buckets(1) == [1]


def _gpu_prompts(n, seed, vocab, lo=16, hi=200):
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Llama-3.2-1B"])
def test_gpu_rollout_bitwise_with_cuda_graphs(name):
    model = UnifiedCausalLM.from_hf(random_model(published_config(name), device="cuda", seed=0), kernels="unified")
    prompts = _gpu_prompts(64, 0, model.config.vocab)
    # Two temperatures (two LM-head groups per step); the 24 late requests join after 20
    # decode steps, so the batch later shrinks to 24 rows: a padded CUDA-graph bucket.
    params = [SamplingParams(temperature=(1.0, 0.7)[i % 2], max_new_tokens=256, ignore_eos=True, seed=i)
              for i in range(64)]
    config = EngineConfig(max_num_seqs=64, max_model_len=512, kv_block_size=64, cuda_graphs=True)
    with LLM(model, config) as llm:
        assert llm.runner.graphs, "CUDA graphs were not captured"
        futures = [llm.submit(p, sp) for p, sp in zip(prompts[:40], params[:40])]
        while llm.num_steps < 20:
            time.sleep(0.001)
        futures += [llm.submit(p, sp) for p, sp in zip(prompts[40:], params[40:])]  # join mid-decode
        outputs = [f.result() for f in futures]
        assert llm.runner.graph_replays >= 255
    assert all(len(o.token_ids) == 256 for o in outputs)
    assert_bitwise_logprobs(model, outputs, max_tokens_per_batch=8192, order=list(range(63, -1, -1)))


@pytest.mark.gpu
def test_gpu_preemption_and_graph_padding_bitwise():
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0),
                                    kernels="unified")
    prompts = _gpu_prompts(24, 2, model.config.vocab, 30, 120)
    params = [SamplingParams(temperature=1.0, max_new_tokens=128 + 5 * i, ignore_eos=True, seed=100 + i)
              for i in range(24)]
    big = EngineConfig(max_num_seqs=24, max_model_len=384, kv_block_size=64)
    tight = EngineConfig(max_num_seqs=24, max_model_len=384, kv_block_size=64, num_kv_blocks=40)
    with LLM(model, big) as llm:
        reference = llm.generate(prompts, params)
    with LLM(model, tight) as llm:
        squeezed = llm.generate(prompts, params)
        assert llm.num_preemptions > 0
    assert_same_outputs(squeezed, reference)
    assert_bitwise_logprobs(model, squeezed)


@pytest.mark.gpu
def test_gpu_graph_staging_matches_eager_decode():
    # The graph path reads the persistent staging buffer (inputs, sampling keys, padding
    # rows); eager decode reads views of the same buffer without padding. Mixed prompt and
    # output lengths make the batch shrink through several buckets.
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0),
                                    kernels="unified")
    prompts = _gpu_prompts(20, 5, model.config.vocab, 8, 90)
    params = [SamplingParams(temperature=(1.0, 0.7, 0.0)[i % 3], max_new_tokens=8 + 4 * i, ignore_eos=True,
                             seed=7 * i) for i in range(20)]
    outs = {}
    for graphs in (True, False):
        config = EngineConfig(max_num_seqs=20, max_model_len=256, kv_block_size=64, cuda_graphs=graphs)
        with LLM(model, config) as llm:
            outs[graphs] = llm.generate(prompts, params)
            assert (llm.runner.graph_replays > 0) == graphs
    assert_same_outputs(outs[True], outs[False])
    assert_bitwise_logprobs(model, outs[True])

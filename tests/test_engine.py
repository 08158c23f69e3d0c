"""The rollout engine: bitwise log-probs vs the packed training forward, batching, sampling.

CPU: tiny random models. Tests of numerics use kernels="unified" (Triton interpreter,
about a second per engine step: few steps each); tests of engine logic use the fast
"standard" ops. GPU (-m gpu): published configs, CUDA graphs, 64 prompts x 256 tokens.
Bitwise claims are checked on integer bit views, never with a tolerance.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from areal_tik.engine import LLM, EngineConfig, GenerationOutput, SamplingParams
from areal_tik import consistency
from areal_tik.engine import sampler
from areal_tik.engine.block_manager import BlockManager
from areal_tik.engine.model_runner import graph_buckets
from areal_tik.engine.scheduler import Scheduler
from areal_tik.engine.sequence import Sequence, SequenceStatus
from areal_tik.model import UnifiedCausalLM, missing_ops, published_config, random_model, tiny_config

VOCAB = 128
SMALL = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=VOCAB)


def _require_unified():
    missing = missing_ops("unified")
    if missing:
        pytest.skip(f"unified kernels not available yet: {missing}")


@pytest.fixture(scope="module")
def hf_small():
    return random_model(tiny_config("qwen3", **SMALL), seed=3)


@pytest.fixture(scope="module")
def unified(hf_small):
    _require_unified()
    return UnifiedCausalLM.from_hf(hf_small, kernels="unified")


@pytest.fixture
def standard():
    # Fresh weights per test: some tests update them.
    return UnifiedCausalLM.from_hf(random_model(tiny_config("llama", **SMALL), seed=4), kernels="standard")


def prompts_of(lengths, seed=0, vocab=VOCAB):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_bitwise_logprobs(model, outputs, **kwargs):
    reference = consistency.packed_logprobs(model, outputs, **kwargs)
    result = consistency.compare(outputs, reference)
    assert result.num_identical == result.num_tokens > 0, (
        f"{result.num_identical}/{result.num_tokens} bit-identical, max |delta| {result.max_abs_delta}, "
        f"first mismatch {result.first_mismatch}")


def assert_same_outputs(a: list[GenerationOutput], b: list[GenerationOutput]):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        xs, ys = torch.tensor(x.logprobs), torch.tensor(y.logprobs)
        assert torch.equal(xs.view(torch.int32), ys.view(torch.int32))
        assert x.finish_reason == y.finish_reason


# ----------------------------------------------------------------------------- unified: bitwise

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


# ----------------------------------------------------------------------------- sampler


def test_sampler_greedy_top_k_top_p_exact():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g).bfloat16()
    logits[0, :10] = 3.0  # ties: top-k must still keep exactly k, in index order
    keys = torch.arange(6, dtype=torch.int64)
    for step in range(20):
        counters = torch.full((6,), step, dtype=torch.int64)
        assert torch.equal(sampler.sample(logits, 0.0, keys, counters), logits.argmax(-1))
        top_k = torch.tensor([3, 1, 5, 0, 50, 2])
        top_p = torch.tensor([1.0, 1.0, 0.5, 0.3, 0.9, 1.0])
        keep = sampler.filter_mask(logits.float() / 0.8, top_k, top_p)
        assert keep[0].tolist() == [True] * 3 + [False] * 47
        assert keep[1].sum() == 1 and keep.sum(-1).min() >= 1
        tokens = sampler.sample(logits, 0.8, keys, counters, top_k, top_p)
        assert keep[torch.arange(6), tokens].all()
    probs = torch.softmax(logits[3].float() / 0.8, -1)
    order = probs.sort(descending=True, stable=True)
    kept = int((order.values.cumsum(0) - order.values < 0.3).sum())
    assert set(keep[3].nonzero().flatten().tolist()) == set(order.indices[:kept].tolist())


def test_sampler_matches_the_softmax_distribution():
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    logits = (probs.log() * 0.7).bfloat16()  # sampled at T = 0.7 gives back ~probs
    n = 100_000
    tokens = sampler.sample(logits.expand(n, -1), 0.7, torch.full((n,), 7), torch.arange(n))
    freq = torch.bincount(tokens, minlength=8).double() / n
    expected = torch.softmax(logits.double() / 0.7, -1)
    assert (freq - expected).abs().max() < 0.01  # ~5 standard deviations at n = 1e5


def test_sampler_noise_is_row_local_and_keyed():
    logits = torch.randn(5, 300).bfloat16()
    keys = torch.tensor([1, 2, 3, 4, 2**62 + 5])
    counters = torch.tensor([0, 5, 9, 2, 7])
    together = sampler.sample(logits, 1.0, keys, counters)
    alone = torch.cat([sampler.sample(logits[i:i + 1], 1.0, keys[i:i + 1], counters[i:i + 1]) for i in range(5)])
    perm = torch.tensor([3, 0, 4, 1, 2])
    shuffled = sampler.sample(logits[perm], 1.0, keys[perm], counters[perm])
    assert torch.equal(together, alone) and torch.equal(together[perm], shuffled)
    u = sampler.uniform_noise(keys, counters, 300)
    assert 0 < u.min() and u.max() < 1
    assert not torch.equal(u, sampler.uniform_noise(keys, counters + 1, 300))


def test_sampler_kernel_matches_the_torch_formulation():
    # The fused Triton kernel (GPU path; here interpreted) and the torch ops (CPU path)
    # hash the same noise: same tokens, over several BLOCK_V chunks, with filtered entries.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 3000, generator=g).bfloat16()
    logits[2, 100:] = float("-inf")
    keys = torch.randint(0, 2**62, (8,), generator=g)
    counters = torch.randint(0, 2**40, (8,), generator=g)
    for temperature in (1.0, 0.7):
        fused = sampler.gumbel_argmax(logits, keys, counters, temperature, use_kernel=True)
        plain = sampler.gumbel_argmax(logits, keys, counters, temperature, use_kernel=False)
        assert torch.equal(fused, plain) and fused[2] < 100
    n = torch.cat([torch.arange(0, 1 << 23, 997), torch.arange((1 << 23) - 64, 1 << 23)]).double()
    exact = -torch.log((n + 0.5) / (1 << 23))
    rel = (sampler.exponential_from_bits(n.float()).double() - exact).abs() / exact
    assert rel.max() < 2.5e-7  # fp32 level everywhere, also next to u = 1


# ----------------------------------------------------------------------------- bookkeeping


def test_block_manager_allocates_appends_and_frees():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = Sequence(0, [1] * 6, SamplingParams(), 0)
    assert bm.can_allocate(seq) and bm.num_free_blocks == 5
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and 0 not in seq.block_table  # block 0 is scratch
    assert [bm.slot(seq, p) for p in (0, 5)] == [seq.block_table[0] * 4, seq.block_table[1] * 4 + 1]
    seq.append(7, -1.0, 0)
    seq.append(7, -1.0, 0)
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2  # 8 tokens fit in two blocks
    seq.append(7, -1.0, 0)
    bm.append_slot(seq)
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 5 and seq.block_table == []
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)


def test_scheduler_admits_within_budgets_and_preempts_newest():
    config = EngineConfig(max_num_seqs=2, max_model_len=16, kv_block_size=4, num_kv_blocks=6,
                          max_num_batched_tokens=16)
    sched = Scheduler(config, BlockManager(6, 4), eos_token_ids=[0])
    seqs = [Sequence(i, [5] * 4, SamplingParams(max_new_tokens=8), i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs[:2]  # max_num_seqs
    for s in batch:
        s.append(9, -1.0, 0)
    batch, is_prefill = sched.schedule()
    assert not is_prefill and batch == seqs[:2] and sched.blocks.num_free_blocks == 1
    for _ in range(4):
        for s in batch:
            s.append(9, -1.0, 0)
        batch, _ = sched.schedule()
    # 9 tokens each need 3 blocks: 6 > 5 usable, so the newest running sequence was preempted.
    assert seqs[1].status is SequenceStatus.WAITING and seqs[1].block_table == []
    assert list(sched.waiting)[0] is seqs[1] and sched.num_preemptions == 1
    finished = sched.postprocess(batch, [0], [-0.5], version=3)
    assert finished == [seqs[0]] and seqs[0].finish_reason == "stop" and seqs[0].versions[-1] == 3


def test_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="kv_block_size"):
        EngineConfig(kv_block_size=24)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_model_len=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(max_num_seqs=8, cuda_graph_sizes=(4, 16))
    assert EngineConfig(cuda_graph_sizes=[8, 1, 8]).cuda_graph_sizes == (1, 8)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40] and graph_buckets(1) == [1]


# ----------------------------------------------------------------------------- engine logic


def _small_engine(model, **overrides) -> LLM:
    config = dict(max_num_seqs=8, max_model_len=64, kv_block_size=16)
    config.update(overrides)
    return LLM(model, EngineConfig(**config))


def test_stop_conditions(standard):
    prompt = prompts_of([5])[0]
    with _small_engine(standard) as llm:
        base = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1))[0]
        assert base.finish_reason == "length" and len(base.token_ids) == 6
        stop = llm.generate([prompt], SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True,
                                                     stop_token_ids=[base.token_ids[2]]))
        assert stop[0].token_ids == base.token_ids[:base.token_ids.index(base.token_ids[2]) + 1]
        assert stop[0].finish_reason == "stop"
        long_prompt = prompts_of([60])[0]
        capped = llm.generate([long_prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
        assert capped.finish_reason == "length" and len(capped.token_ids) == 4  # max_model_len 64
    with LLM(standard, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=16),
             eos_token_ids=range(VOCAB)) as llm:
        eos = llm.generate([prompt], SamplingParams(max_new_tokens=6))[0]
        assert eos.finish_reason == "stop" and len(eos.token_ids) == 1
        ignored = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        assert ignored.finish_reason == "length" and len(ignored.token_ids) == 6


def test_eos_ids_come_from_the_model_config(standard):
    with _small_engine(standard) as llm:
        assert llm.eos_token_ids == (2,)


BAD_REQUESTS = [
    ([], SamplingParams(), ValueError, "empty"),
    ([5] * 64, SamplingParams(), ValueError, "max_model_len"),
    ([5, VOCAB], SamplingParams(), ValueError, "prompt_ids"),
    ([5, 1.5], SamplingParams(), ValueError, "prompt_ids"),
    ("hello", SamplingParams(), TypeError, "prompt_ids"),
    ([5], SamplingParams(stop_token_ids=[VOCAB]), ValueError, "stop_token_ids"),
    ([5], {"temperature": 1.0}, TypeError, "SamplingParams"),
]


def test_bad_requests_fail_alone(standard):
    with _small_engine(standard) as llm:
        good = llm.submit(prompts_of([6])[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
        for prompt, params, exc, match in BAD_REQUESTS:
            with pytest.raises(exc, match=match):
                llm.submit(prompt, params)
        with pytest.raises(ValueError, match="request 1"):
            llm.generate([[5], []])
        assert good.result(timeout=60).finish_reason == "length"
        assert llm.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].finish_reason in ("length", "stop")


def test_update_weights_in_place_checks_and_versions(standard):
    prompt = prompts_of([7])[0]
    params = SamplingParams(max_new_tokens=5, seed=3, ignore_eos=True)
    hf = standard.hf_model
    with _small_engine(standard) as llm:
        before = llm.generate([prompt], params)[0]
        assert llm.version == 0 and set(before.versions) == {0}
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        pointers = {k: v.data_ptr() for k, v in hf.state_dict().items()}
        # Every tensor before the bad one differs: a copy-then-check update would change them.
        shifted = {k: v + 1 for k, v in state.items()}
        cases = (("lm_head.weight", torch.zeros(VOCAB + 1, 32, dtype=torch.bfloat16), ValueError),
                 ("model.norm.weight", state["model.norm.weight"].float(), TypeError),
                 ("model.extra.weight", torch.zeros(1), ValueError))
        for key, value, exc in cases:
            bad = {k: v for k, v in shifted.items() if k != key}
            bad[key] = value
            with pytest.raises(exc):
                llm.update_weights(bad, version=9)
        with pytest.raises(ValueError, match="lacks"):
            llm.update_weights({"lm_head.weight": state["lm_head.weight"]}, version=9)
        for k, v in hf.state_dict().items():
            assert torch.equal(v, state[k]), f"{k} changed by a rejected update"
        assert llm.version == 0
        new = {k: v * 1.5 if v.is_floating_point() else v for k, v in state.items()}
        llm.update_weights(new, version=4)
        assert llm.version == 4
        assert all(v.data_ptr() == pointers[k] for k, v in hf.state_dict().items())  # in place
        after = llm.generate([prompt], params)[0]
        assert set(after.versions) == {4}
        assert after.logprobs != before.logprobs
        llm.update_weights(state)  # default: version + 1, partial=False
        assert llm.version == 5
        assert llm.generate([prompt], params)[0].token_ids == before.token_ids


def test_versions_change_mid_request_and_pause_blocks_steps(standard):
    with _small_engine(standard) as llm:
        fut = llm.submit(prompts_of([3])[0], SamplingParams(max_new_tokens=60, ignore_eos=True))
        while llm.num_steps < 3:
            time.sleep(0.001)
        llm.pause()
        steps = llm.num_steps
        time.sleep(0.05)
        assert llm.paused and llm.num_steps == steps and not fut.done()
        restarted = llm.update_weights(llm.model.hf_model, version=7)
        assert restarted == 1  # the running sequence goes back to prefill under the new weights
        llm.resume()
        out = fut.result(timeout=60)
    assert out.versions[0] == 0 and out.versions[-1] == 7
    assert out.versions == sorted(out.versions) and len(out.versions) == 60


def test_agenerate_cancel_and_close(standard):
    llm = _small_engine(standard)

    async def run():
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        return await asyncio.gather(*[llm.agenerate(p, params) for p in prompts_of([3, 9, 5])])

    outs = asyncio.run(run())
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    llm.pause()
    pending = llm.submit([5, 6], SamplingParams(max_new_tokens=5))
    cancelled = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=5))
    assert cancelled.cancel()
    llm.close()
    assert pending.result(timeout=10).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        llm.submit([5], SamplingParams())


def test_unseeded_requests_follow_the_engine_seed(standard):
    prompts = prompts_of([3, 8])
    runs = []
    for _ in range(2):
        with _small_engine(standard, seed=123) as llm:
            runs.append(llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    with _small_engine(standard, seed=124) as llm:
        other = llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]


def test_standard_ops_diagnosis_names_an_op(standard):
    # The standard path is not batch invariant in general; when it differs, the diagnosis
    # must name the first op whose row differs (here checked for well-formedness only).
    with _small_engine(standard) as llm:
        outs = llm.generate(prompts_of([5, 12]), SamplingParams(max_new_tokens=4, ignore_eos=True, seed=2))
    result = consistency.compare(outs, consistency.packed_logprobs(standard, outs))
    div = consistency.first_divergence(standard, outs, 1, 2, block_size=16)
    assert div.position == 12 + 2 - 1 and div.regime == "decode" and div.ops_compared > 0
    assert (div.where is None) == (div.max_abs_delta == 0.0)
    assert 0 < result.num_tokens == 8


def test_step_seconds_attribute_host_time(standard):
    with LLM(standard, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=4)) as llm:
        start = time.perf_counter()
        llm.generate(prompts_of([3, 5]), SamplingParams(max_new_tokens=6, ignore_eos=True))
        total = time.perf_counter() - start
    assert llm.num_steps >= 6
    assert set(llm.step_seconds) == {"schedule", "launch", "wait", "postprocess"}
    assert all(v > 0 for v in llm.step_seconds.values())
    assert sum(llm.step_seconds.values()) <= total


def test_decode_staging_matches_per_row_inputs():
    # Staged decode inputs equal the per-row values (padding rows: token 0, position 0,
    # scratch slot, context 1, scratch table), also through a separate "device" buffer
    # that receives only the copied prefix, as on a GPU.
    from areal_tik.engine.decode_inputs import DecodeInputs
    from areal_tik.engine.block_manager import SCRATCH_BLOCK
    rng = random.Random(0)
    blocks = BlockManager(64, 4)
    staging = DecodeInputs(8, 6, blocks, torch.device("cpu"))
    staging._dev = torch.full_like(staging._host, -7)  # stale values must never leak through
    staging._bind_device_views()
    for trial in range(6):
        seqs = []
        for i in range(rng.randint(1, 8)):
            seq = Sequence(100 * trial + i, [rng.randrange(5, 50) for _ in range(rng.randint(1, 20))],
                           SamplingParams(), rng.getrandbits(63))
            seq.append(rng.randrange(5, 50), -1.0, 0)
            blocks.allocate(seq)
            seqs.append(seq)
        rows = rng.randint(len(seqs), 8)
        staging.stage(seqs, rows)
        got = staging.model_inputs(rows)
        pad = rows - len(seqs)
        tables = [s.block_table + [SCRATCH_BLOCK] * (6 - len(s.block_table)) for s in seqs]
        want = dict(input_ids=[s.last_token for s in seqs] + [0] * pad,
                    positions=[s.num_tokens - 1 for s in seqs] + [0] * pad,
                    slot_mapping=[blocks.slot(s, s.num_tokens - 1) for s in seqs] + [0] * pad,
                    block_tables=tables + [[SCRATCH_BLOCK] * 6] * pad,
                    context_lens=[s.num_tokens for s in seqs] + [1] * pad)
        for name, values in want.items():
            assert got[name].tolist() == values, name
        keys, counters = staging.sample_keys(len(seqs))
        assert keys.tolist() == [s.sample_key for s in seqs]
        assert counters.tolist() == [s.num_output_tokens for s in seqs]
        assert got["block_tables"].dtype == got["context_lens"].dtype == torch.int32
        assert got["block_tables"].is_contiguous()
        for seq in seqs:
            blocks.free(seq)


# ----------------------------------------------------------------------------- GPU


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

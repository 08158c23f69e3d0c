"""The engine's front door on the fast "standard" ops: stop conditions, validation, weight
updates and versions, pause, asyncio, cancel and close, seeds, step timing."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from areal_tik.engine import LLM, EngineConfig, SamplingParams

from ._engine_utils import VOCAB, prompts_of, small_engine
from ._engine_utils import standard  # noqa: F401 - fixture


def test_stop_conditions(standard):
    prompt = prompts_of([5])[0]
    with small_engine(standard) as llm:
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
    with small_engine(standard) as llm:
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
    with small_engine(standard) as llm:
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
    with small_engine(standard) as llm:
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
    with small_engine(standard) as llm:
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
    llm = small_engine(standard)

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
        with small_engine(standard, seed=123) as llm:
            runs.append(llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    with small_engine(standard, seed=124) as llm:
        other = llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]


def test_step_seconds_attribute_host_time(standard):
    with LLM(standard, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=4)) as llm:
        start = time.perf_counter()
        llm.generate(prompts_of([3, 5]), SamplingParams(max_new_tokens=6, ignore_eos=True))
        total = time.perf_counter() - start
    assert llm.num_steps >= 6
    assert set(llm.step_seconds) == {"schedule", "launch", "wait", "postprocess"}
    assert all(v > 0 for v in llm.step_seconds.values())
    assert sum(llm.step_seconds.values()) <= total

"""Overlapped steps (``EngineConfig.overlap_steps``): the next decode step is enqueued before
this one's tokens are read (its input tokens copied on the device), and the engine's
outputs stay those of the serial engine, token for token and bit for bit: with stop tokens
ending sequences while a step holding their next row is already enqueued, admissions
mid-run, preemption, the prefix cache, cancellation, pause and weight updates."""
from __future__ import annotations

import random
import time

import pytest
import torch

from areal_tik.engine import SamplingParams
from areal_tik.engine.sequence import Sequence

from ._engine_utils import assert_bitwise_logprobs, assert_same_outputs, prompts_of, small_engine
from ._engine_utils import hf_small, standard, unified  # noqa: F401 - fixtures


def _requests(n: int, seed: int = 0, new_tokens=(4, 20), stops: int = 6):
    rng = random.Random(seed)
    prompts = prompts_of([rng.randint(2, 12) for _ in range(n)], seed=seed)
    # a few frequent-enough stop tokens: some rows stop early, the others on their length
    stop_ids = tuple(rng.sample(range(3, 128), stops))
    params = [SamplingParams(temperature=1.0, max_new_tokens=rng.randint(*new_tokens), stop_token_ids=stop_ids,
                             seed=1000 + i) for i in range(n)]
    return prompts, params


def _run(model, overlap: bool, prompts, params, **config):
    with small_engine(model, overlap_steps=overlap, **config) as llm:
        outputs = llm.generate(prompts, params)
        return outputs, llm.loop.num_overlapped_steps, llm.loop.num_steps


def _versions_and_lists_consistent(outputs):
    for o in outputs:
        assert Sequence.PENDING not in o.token_ids
        assert len(o.token_ids) == len(o.logprobs) == len(o.versions)
        assert not any(torch.isnan(torch.tensor(o.logprobs)))


@pytest.mark.parametrize("config", [dict(max_num_seqs=4), dict(max_num_seqs=8, num_kv_blocks=6),
                                    dict(max_num_seqs=8, enable_prefix_caching=True)],
                         ids=["admissions", "preemption", "prefix-cache"])
def test_overlapped_steps_give_the_serial_engines_outputs(unified, config):  # noqa: F811
    # The unified kernels: which rows share a step, and which prompts hit the prefix cache,
    # depend on thread timing and differ between the two runs; only batch-invariant kernels
    # make the outputs comparable bit for bit (the standard set's CPU matmuls are not).
    # preemption: 5 usable blocks of 16 for 8 sequences that mostly grow past 16 tokens
    prompts, params = _requests(10, **(dict(new_tokens=(10, 20), stops=2) if "num_kv_blocks" in config else {}))
    if config.get("enable_prefix_caching"):  # n samples of a few prompts share their blocks
        prompts = [prompts[i % 3] * 3 for i in range(len(prompts))]
    serial, overlapped_none, _ = _run(unified, False, prompts, params, **config)
    overlapped, num_overlapped, steps = _run(unified, True, prompts, params, **config)
    assert overlapped_none == 0 and num_overlapped > 0, (num_overlapped, steps)
    assert_same_outputs(serial, overlapped)
    assert [o.versions for o in serial] == [o.versions for o in overlapped]
    _versions_and_lists_consistent(overlapped)
    reasons = {o.finish_reason for o in overlapped}
    assert reasons == {"stop", "length"}, reasons  # both ways of ending happened
    if "num_kv_blocks" in config:
        assert any(o.num_preemptions for o in overlapped)


def test_overlapped_unified_engine_equals_the_training_forward(unified):  # noqa: F811
    prompts, params = _requests(6, seed=1)
    outputs, num_overlapped, _ = _run(unified, True, prompts, params, max_num_seqs=4)
    assert num_overlapped > 0
    assert_bitwise_logprobs(unified, outputs)


def test_pause_weight_update_and_cancel_leave_no_pending_token(standard):  # noqa: F811
    prompts, params = _requests(6, seed=2)
    long = [SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=i) for i in range(6)]
    with small_engine(standard, overlap_steps=True, max_model_len=64) as llm:
        futures = [llm.submit(p, q) for p, q in zip(prompts, long)]
        deadline = time.monotonic() + 60
        while llm.loop.num_overlapped_steps < 3:
            assert time.monotonic() < deadline, "no overlapped steps"
            time.sleep(0.001)
        futures[0].cancel()
        llm.pause()  # returns with no step unread: every running sequence's tokens are real
        assert llm.loop._pending is None
        running = list(llm.scheduler.running)
        for seq in running:
            assert Sequence.PENDING not in seq.token_ids
        llm.update_weights(standard.hf_model)  # between steps: drains first
        llm.resume()
        outputs = [f.result(timeout=60) for f in futures[1:]]
    _versions_and_lists_consistent(outputs)
    assert all(len(o.token_ids) == 40 for o in outputs)
    assert all(o.versions == sorted(o.versions) for o in outputs)
    # a request still running at the pause draws its later tokens with the updated weights
    by_prompt = {tuple(o.prompt_ids): o for o in outputs}
    still = [by_prompt[tuple(s.prompt_ids)] for s in running if tuple(s.prompt_ids) in by_prompt]
    assert still and all(o.versions[-1] == 1 for o in still)


def test_every_decode_step_of_a_batch_but_the_first_is_enqueued_behind_an_unread_one(standard):  # noqa: F811
    # 5 prompts of 12 tokens each: after the prefill step (it samples the first token) every
    # decode step but the first is enqueued before the previous one is read, and the batch
    # takes no extra (wasted) step: the last one is read before anything follows it.
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=5)
    prompts = prompts_of([3, 5, 7, 2, 4])
    counts = {}
    for overlap in (False, True):
        with small_engine(standard, overlap_steps=overlap) as llm:
            llm.pause()  # every request queued before the first step: one prefill step for all
            futures = [llm.submit(p, params) for p in prompts]
            llm.resume()
            outputs = [f.result(timeout=60) for f in futures]
            counts[overlap] = (llm.loop.num_steps, llm.runner.step_counts.decode, llm.loop.num_overlapped_steps)
    (steps, decode, none), (o_steps, o_decode, overlapped) = counts[False], counts[True]
    assert none == 0 and (steps, decode) == (12, 11)
    assert (o_steps, o_decode) == (steps, decode) and overlapped == o_decode - 1, counts
    assert all(len(o.token_ids) == 12 for o in outputs)

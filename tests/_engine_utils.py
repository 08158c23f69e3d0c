"""Shared pieces of the engine tests: tiny models, prompts and bitwise output checks."""
from __future__ import annotations

import random

import pytest
import torch

from areal_tik.engine import LLM, EngineConfig, GenerationOutput
from areal_tik import consistency
from areal_tik.model import UnifiedCausalLM, missing_ops, random_model, tiny_config

VOCAB = 128
SMALL = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf_small():
    return random_model(tiny_config("qwen3", **SMALL), seed=3)


@pytest.fixture(scope="module")
def unified(hf_small):
    missing = missing_ops("unified")
    assert not missing, f"unified kernels cannot load: {missing}"
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


def small_engine(model, **overrides) -> LLM:
    config = dict(max_num_seqs=8, max_model_len=64, kv_block_size=16)
    config.update(overrides)
    return LLM(model, EngineConfig(**config))

"""The engine compiles its kernels at start: after ``LLM(...)`` no request waits for Triton.

CPU: the warm-up is skipped (the interpreter compiles nothing; kernels run as Python), and
the switch is checked. GPU (-m gpu): after construction, generates at batch sizes, prompt
lengths, chunked prefill and prefix-cache hits the construction never saw compile nothing
(Triton's post-compile hook sees every new key, disk-cached or not).
"""
from __future__ import annotations

import random

import pytest
import torch
import triton

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.model import UnifiedCausalLM, published_config, random_model

from ._engine_utils import prompts_of
from ._engine_utils import hf_small, unified  # noqa: F401 - fixtures


def test_cpu_engine_skips_the_warmup(unified):
    with LLM(unified, EngineConfig(max_num_seqs=2, max_model_len=32, kv_block_size=16)) as llm:
        assert llm.runner.warmup_counts is None
        out = llm.generate(prompts_of([5]), SamplingParams(max_new_tokens=2, ignore_eos=True, seed=1))
    assert len(out[0].token_ids) == 2


def test_compile_at_start_must_be_a_bool():
    with pytest.raises(TypeError, match="compile_at_start must be a bool, got 'yes'"):
        EngineConfig(compile_at_start="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 256])
def test_gpu_no_jit_compilation_after_engine_start(chunk):
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0),
                                    kernels="unified")
    config = EngineConfig(max_num_seqs=64, max_model_len=1024, kv_block_size=64, cuda_graphs=True,
                          enable_prefix_caching=True, prefill_chunk_tokens=chunk)
    rng = random.Random(3)
    vocab = model.config.vocab
    shared = [rng.randrange(8, vocab) for _ in range(300)]
    compiled = []
    with LLM(model, config) as llm:
        assert llm.runner.warmup_counts and llm.runner.warmup_counts["paged_attention"] == 1
        previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
        try:
            for batch, lo, hi in ((1, 1, 2), (3, 17, 65), (37, 100, 700), (64, 5, 40)):
                prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]
                params = [SamplingParams(temperature=(1.0, 0.7)[i % 2], max_new_tokens=rng.randint(1, 40),
                                         ignore_eos=True, seed=i, top_k=(0, 50)[i % 2]) for i in range(batch)]
                llm.generate(prompts, params)
            # prefix-cache hits: the same 300-token prefix, then other tails
            tails = [shared + [rng.randrange(8, vocab) for _ in range(rng.randint(1, 90))] for _ in range(9)]
            llm.generate(tails, [SamplingParams(max_new_tokens=8, ignore_eos=True, seed=i) for i in range(9)])
            torch.cuda.synchronize()
        finally:
            triton.knobs.runtime.jit_post_compile_hook = previous
    assert not compiled, f"compiled after engine start: {compiled}"

"""Which path each engine step takes (``LLM.step_counts``): with chunked prefill on, a step
with only decode rows is a plain decode step, padded to the CUDA-graph bucket of its batch
size exactly as without chunks, and no step carries a prompt chunk once every prompt is in.

CPU: the standard kernel set on a tiny model (the step path does not depend on the
kernels); graphs are not captured there, so the test checks the decision (kind and
bucket per step), which is what a GPU replays. GPU (-m gpu): every step with decode rows
replays a captured graph, chunked or not, and the tokens and log-prob bits are unchanged.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.model import UnifiedCausalLM, published_config, random_model

from ._engine_utils import assert_same_outputs, prompts_of
from ._engine_utils import standard  # noqa: F401 - fixture

NEW_TOKENS = 8


def _run(model, prompts, new_tokens=NEW_TOKENS, **config):
    """Outputs and step counts of ``prompts`` all admitted before the first step."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=3)
    with LLM(model, EngineConfig(**config)) as llm:
        llm.pause()  # every request is in the scheduler before a step runs: no submit race
        futures = [llm.submit(p, params) for p in prompts]
        llm.resume()
        outputs = [f.result(timeout=300) for f in futures]
        return outputs, llm.step_counts, llm.runner


def test_decode_only_steps_take_the_unchunked_path_with_chunking_on(standard):
    # Three 16-token prompts, a 16-token chunk: step 0 prefills A; steps 1 and 2 decode A
    # (then A, B) beside the next prompt's chunk; from step 3 on, no prompt token is left,
    # so every step is decode-only: A, B, C (bucket 4 of 1, 2, 4, 8) until A's 8th token at
    # step 7, then B, C (bucket 2) and C alone (bucket 1). Without chunks: one prefill of
    # all three, then 7 decode steps of 3 rows.
    prompts = prompts_of([16, 16, 16], seed=5)
    base = dict(max_num_seqs=8, max_model_len=64, kv_block_size=16)
    plain, counts_off, runner_off = _run(standard, prompts, **base)
    chunked, counts_on, runner_on = _run(standard, prompts, prefill_chunk_tokens=16, **base)
    assert runner_on.graph_sizes == runner_off.graph_sizes == (1, 2, 4, 8)
    assert (counts_off.prefill, counts_off.mixed, counts_off.decode) == (1, 0, NEW_TOKENS - 1)
    assert counts_off.decode_buckets == Counter({("decode", 4): NEW_TOKENS - 1})
    assert (counts_on.prefill, counts_on.mixed, counts_on.decode) == (1, 2, NEW_TOKENS - 1)
    assert counts_on.decode_buckets == Counter({("mixed", 1): 1, ("mixed", 2): 1, ("decode", 4): NEW_TOKENS - 3,
                                                ("decode", 2): 1, ("decode", 1): 1})
    assert runner_on.graph_bucket(3) == runner_off.graph_bucket(3) == 4 and runner_on.graph_bucket(9) is None
    assert [o.token_ids for o in chunked] == [o.token_ids for o in plain]


def test_no_chunk_in_a_step_once_every_prompt_is_in(standard):
    # Prompts of 40, 33 and 20 tokens (93) under a 16-token budget fill it in every step but
    # the last, so exactly ceil(93 / 16) = 6 steps compute prompt tokens; every later step
    # is decode-only, and no step is left without a kind.
    prompts = prompts_of([40, 33, 20], seed=6)
    _, counts, _ = _run(standard, prompts, new_tokens=12, max_num_seqs=8, max_model_len=64, kv_block_size=16,
                        prefill_chunk_tokens=16)
    assert counts.prefill + counts.mixed == 6
    assert counts.decode > 0
    decode_launches = sum(n for (kind, _), n in counts.decode_buckets.items() if kind == "decode")
    assert decode_launches == counts.decode


@pytest.mark.gpu
def test_gpu_every_step_with_decode_rows_replays_a_graph_chunked_or_not():
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0),
                                    kernels="unified")
    rng = random.Random(1)
    prompts = [[rng.randrange(8, model.config.vocab) for _ in range(rng.randint(200, 700))] for _ in range(12)]
    base = dict(max_num_seqs=16, max_model_len=1024, kv_block_size=64, cuda_graphs=True)
    outs = {}
    for chunk in (None, 512):
        outs[chunk], counts, runner = _run(model, prompts, new_tokens=48, prefill_chunk_tokens=chunk, **base)
        assert runner.graphs, "CUDA graphs were not captured"
        assert counts.decode > 0 and runner.graph_replays == counts.decode + counts.mixed, (chunk, counts)
        assert (counts.mixed > 0) == (chunk is not None)
    assert_same_outputs(outs[512], outs[None])

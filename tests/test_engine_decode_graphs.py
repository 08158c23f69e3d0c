"""The decode CUDA-graph plan (``engine/decode_graphs.py``): batch buckets x block-table
widths. The standard ops gather every position of the table they get, so their graphs come
in widths of 1, 2, 4, ... blocks and a step replays the smallest that holds its longest
table; the unified kernel stops at each row's context, so it keeps one full-width graph
per bucket. GPU (-m gpu): a standard-ops engine replays graphs of the width its sequences
hold, with the bits of the eager decode at that same width."""
from __future__ import annotations

import random

import pytest

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.decode_graphs import DecodeGraphs, smallest_holding, table_widths
from areal_tik.model import UnifiedCausalLM, published_config, random_model

from ._engine_utils import assert_same_outputs


def test_table_widths_per_kernel_set():
    assert table_widths(36, "standard") == (1, 2, 4, 8, 16, 32, 36)
    assert table_widths(32, "standard") == (1, 2, 4, 8, 16, 32)
    assert table_widths(1, "standard") == (1,)
    assert table_widths(36, "unified") == (36,) and table_widths(36, None) == (36,)


def test_smallest_holding_and_keys_without_capture():
    assert [smallest_holding((1, 2, 4, 8), n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    graphs = DecodeGraphs((1, 2, 4), (1, 2, 4, 5))
    assert graphs.bucket(3) == 4 and graphs.bucket(5) is None
    assert graphs.key(4, 3) is None  # nothing captured (CPU): the step decodes eagerly
    graphs.graphs[(4, 4)] = object()  # what a capture registers; only the lookup is under test
    assert graphs.key(4, 3) == (4, 4) and graphs.key(4, 5) is None and graphs.key(2, 3) is None


@pytest.mark.gpu
def test_gpu_standard_graphs_read_the_width_the_sequences_hold():
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0),
                                    kernels="standard")
    rng = random.Random(4)
    # 4 prompts of 200 tokens + 20 new: every table holds 4 blocks of 64 while decoding, so
    # the replayed graph is (4 rows, width 4) and the eager decode runs the same shapes.
    prompts = [[rng.randrange(8, model.config.vocab) for _ in range(200)] for _ in range(4)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=i) for i in range(4)]
    outs = {}
    for graphs in (True, False):
        config = EngineConfig(max_num_seqs=4, max_model_len=1024, kv_block_size=64, cuda_graphs=graphs,
                              cuda_graph_sizes=(4,))
        with LLM(model, config) as llm:
            outs[graphs] = llm.generate(prompts, params)
            runner = llm.runner
            if graphs:
                assert set(runner.graphs) == {(4, w) for w in (1, 2, 4, 8, 16)}
                assert runner.graph_replays == llm.step_counts.decode == 19
                assert llm.step_counts.decode_buckets == {("decode", 4): 19}
    assert_same_outputs(outs[True], outs[False])

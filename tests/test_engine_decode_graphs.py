"""The decode CUDA-graph plan (``engine/decode_graphs.py``): batch buckets x block-table
widths. The standard ops gather every position of the table they get, so their graphs come
in widths of 1, 2, 4, ... blocks and a step replays the smallest that holds its longest
table; the unified kernel stops at each row's context, so it keeps one full-width graph
per bucket. GPU (-m gpu): a standard-ops engine replays graphs of the width its sequences
hold, with the bits of the eager decode at that same width."""
from __future__ import annotations

import random

import pytest

import torch

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.decode_graphs import DecodeGraphs, smallest_holding, table_widths
from areal_tik.engine.model_runner import graph_samples
from areal_tik.engine.sequence import Sequence
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


def test_graph_samples_only_rows_it_draws_as_sample_would():
    """A graph that samples at T serves a step only when every row samples at T over the
    whole vocabulary: a greedy, filtered or other-temperature row sends the step to ``sample``."""
    def seqs(*params):
        return [Sequence(i, [1, 2], p, sample_key=i) for i, p in enumerate(params)]
    plain = SamplingParams(temperature=1.0)
    assert graph_samples(seqs(plain, SamplingParams(temperature=1.0, seed=3)), 1.0)
    assert not graph_samples(seqs(plain), None)
    assert not graph_samples(seqs(plain), 0.7)
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.9)):
        assert not graph_samples(seqs(plain, other), 1.0), other


def test_replay_slices_every_output_of_a_sampling_graph():
    class Graph:
        replayed = 0

        def replay(self):
            Graph.replayed += 1
    graphs = DecodeGraphs((4,), (2,))
    graphs.graphs[(4, 2)] = Graph()
    graphs.outputs[(4, 2)] = (torch.arange(8).view(4, 2), torch.arange(4), torch.arange(4.0))
    hidden, tokens, logprobs = graphs.replay((4, 2), 3)
    assert hidden.shape == (3, 2) and tokens.tolist() == [0, 1, 2] and logprobs.tolist() == [0.0, 1.0, 2.0]
    graphs.outputs[(4, 2)] = torch.arange(4)
    assert graphs.replay((4, 2), 2).tolist() == [0, 1] and Graph.replayed == graphs.replays == 2


def test_graph_sample_temperature_is_checked():
    assert EngineConfig().graph_sample_temperature == 1.0
    assert EngineConfig(graph_sample_temperature=None).graph_sample_temperature is None
    assert EngineConfig(graph_sample_temperature=2).graph_sample_temperature == 2.0
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="graph_sample_temperature"):
            EngineConfig(graph_sample_temperature=bad)
    with pytest.raises(TypeError, match="graph_sample_temperature"):
        EngineConfig(graph_sample_temperature="1")


@pytest.mark.gpu
def test_gpu_sampling_graphs_draw_the_eager_tokens_and_logprobs():
    """Unified kernels, Qwen3-0.6B config: decode graphs that sample at T = 1 give the
    tokens and log-prob bits of graphs that end at the hidden states and of eager decode;
    every decode step of T = 1 requests is served by the sampling graph, and a step with
    a T = 0.7 row samples eagerly from the same graph's hidden states (same bits again)."""
    model = UnifiedCausalLM.from_hf(random_model(published_config("Qwen3-0.6B"), device="cuda", seed=0))
    model.fuse_projections()
    rng = random.Random(5)
    prompts = [[rng.randrange(8, model.config.vocab) for _ in range(rng.randrange(20, 90))] for _ in range(6)]
    for temps in ((1.0,) * 6, (1.0, 0.7, 1.0, 1.0, 1.0, 1.0)):
        params = [SamplingParams(temperature=t, max_new_tokens=12, ignore_eos=True, seed=i) for i, t in enumerate(temps)]
        outs = {}
        for name, options in (("sampling", dict(graph_sample_temperature=1.0)),
                              ("hidden", dict(graph_sample_temperature=None)), ("eager", dict(cuda_graphs=False))):
            config = EngineConfig(max_num_seqs=8, max_model_len=256, cuda_graph_sizes=(1, 2, 4, 8), **options)
            with LLM(model, config) as llm:
                outs[name] = llm.generate(prompts, params)
                if name == "sampling":
                    decode_steps = llm.step_counts.decode
                    assert decode_steps > 0 and llm.runner.graph_replays == decode_steps
                    assert llm.runner.graph_sampled == (decode_steps if 0.7 not in temps else 0)
        assert_same_outputs(outs["sampling"], outs["hidden"])
        assert_same_outputs(outs["sampling"], outs["eager"])


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

"""Engine and sampling configuration: bad values raise naming the field."""
from __future__ import annotations

import pytest

from areal_tik.engine import EngineConfig, SamplingParams


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


def test_derived_limits_follow_the_fields_set_after_defaults():
    """OmegaConf builds the ``tik:`` block from the defaults, then merges the YAML's values:
    derived limits must follow the merged fields (a frozen default once kept every decode
    batch above 64 out of the CUDA graphs)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(EngineConfig(max_num_seqs=64)),
                             {"max_num_seqs": 128, "max_model_len": 16384})
    config = OmegaConf.to_object(merged)
    assert (config.max_graph_batch_size, config.max_num_batched_tokens) == (None, None)
    assert (config.graph_batch_limit, config.batched_tokens_limit) == (128, 16384)
    assert EngineConfig(max_num_seqs=1024).graph_batch_limit == 512
    assert EngineConfig(max_num_seqs=8, max_graph_batch_size=32).graph_batch_limit == 8
    assert EngineConfig(max_model_len=512, max_num_batched_tokens=600).batched_tokens_limit == 600

"""The training-step benchmark's workload and FLOP count (eval/bench_train.py): the MFU
and the token counts it reports are checked against hand-computed values."""
from __future__ import annotations

import pytest
import torch

from areal_tik.model import published_config
from areal_tik.model.spec import ModelSpec
from eval.train_workload import make_batch, packing, step_flops


def test_grpo_packing_is_a_fixed_long_tailed_mix_of_about_12k_tokens():
    lengths = packing("grpo")
    assert lengths == packing("grpo")  # fixed seed: every run times the same batch
    assert len(lengths) == 64 and all(48 + 64 <= n <= 80 + 64 + 256 for n in lengths)
    assert 11_500 <= sum(lengths) <= 13_000
    assert packing("4x4096") == [4096] * 4


@pytest.mark.parametrize("bad", ["", "4x", "x4096", "0x4096", "4x1", "grpo2", "4 x 4096"])
def test_bad_packing_names_raise(bad):
    with pytest.raises(ValueError, match="packing must be"):
        packing(bad)


def test_step_flops_of_qwen3_0_6b_by_hand():
    spec = ModelSpec.from_hf_config(published_config("Qwen3-0.6B"))
    # Per layer: q 1024x2048, k and v 1024x1024, o 2048x1024, gate/up/down 3 x 1024x3072.
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    params = 28 * per_layer + 151936 * 1024  # + the (tied) LM head
    assert params == 595_984_384
    tokens = 4 * 4096
    attention = 4 * 6 * 4096 ** 2 * (16 * 128) * 28  # causal: half of 12 L^2 Hq D per layer
    assert step_flops(spec, [4096] * 4) == 6 * params * tokens + attention


def test_batch_restarts_positions_per_sequence_and_rolls_targets():
    b = make_batch([3, 1, 4], vocab=50, device="cpu", seed=1)
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 8] and b.cu_seqlens.dtype == torch.int32
    assert b.max_seqlen == 4
    assert torch.equal(b.targets, torch.roll(b.input_ids, -1))  # AReaL's labels over the packed row
    assert b.input_ids.max() < 50 and b.grad_weights.shape == (8,)

"""The stock baseline with AReaL's own trainer (``actor.tik_training_model: hf``): the packed
attention it registers with transformers against each sequence run alone, the options'
checks, and (slow) one tiny CPU run of ``areal-tik run --mode stock --stock-training hf``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_tik.adapter import hf_attention
from areal_tik.model.loading import random_model, tiny_config

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (5, 9, 3)


def packed_call(model, seqs):
    """The model on ``seqs`` packed into one row, called as AReaL's FSDP engine calls it."""
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(len(s) for s in seqs)
    return model(input_ids=ids, position_ids=positions, use_cache=False,
                 attention_mask=dict(full_attention=None, sliding_attention=None),
                 cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest).logits[0]


def random_sequences(model):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in LENGTHS]


def alone_logits(model, seqs):
    model.set_attn_implementation("eager")
    return torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@torch.no_grad()
def test_packed_sequences_attend_only_within_themselves(family):
    model = random_model(tiny_config(family), dtype=torch.float32).eval()
    seqs = random_sequences(model)
    alone = alone_logits(model, seqs)
    model.set_attn_implementation(hf_attention.register())
    torch.testing.assert_close(packed_call(model, seqs), alone, rtol=1e-5, atol=1e-5)


def test_packed_gradients_match_each_sequence_alone():
    model = random_model(tiny_config("qwen3"), dtype=torch.float32)
    seqs = random_sequences(model)
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(2))

    def grads(logits):
        model.zero_grad()
        (logits * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.set_attn_implementation("eager")
    alone = grads(torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]))
    model.set_attn_implementation(hf_attention.register())
    packed = grads(packed_call(model, seqs))
    assert packed.keys() == alone.keys() and any("self_attn.q_proj" in n for n in packed)
    for name in alone:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-4, atol=1e-4, msg=name)  # fp32 sums in another order


@torch.no_grad()
def test_sdpa_under_areals_call_attends_across_sequences():
    # The reason for the module: SDPA under the call AReaL makes (Qwen3: a mask mapping of
    # None) draws one causal triangle over all the packed sequences. (Llama's mask builder
    # does not take that mapping at all: AReaL then needs a varlen attention.)
    model = random_model(tiny_config("qwen3"), dtype=torch.float32).eval()
    seqs = random_sequences(model)
    alone = alone_logits(model, seqs)
    model.set_attn_implementation("sdpa")
    leaky = packed_call(model, seqs)
    first = LENGTHS[0]
    torch.testing.assert_close(leaky[:first], alone[:first], rtol=1e-5, atol=1e-5)
    assert (leaky[first:] - alone[first:]).abs().max() > 1e-3


def test_the_attention_refuses_calls_it_cannot_keep_apart():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="needs packed inputs"):
        hf_attention.varlen_attention(None, q, q, q, None)
    with pytest.raises(ValueError, match="one packed row"):
        hf_attention.varlen_attention(None, torch.zeros(2, 2, 4, 8), q, q, None,
                                      cu_seq_lens_q=torch.tensor([0, 4]), max_length_q=4)


def test_hf_training_is_a_stock_option_only():
    from areal_tik.adapter.config import TikPPOActorConfig
    from areal_tik.adapter.run import mode_overrides

    base = dict(experiment_name="e", trial_name="t", backend="fsdp:d1", unified_kernels=True)
    TikPPOActorConfig(**base, tik_kernels="standard", tik_reuse_logprobs=False, tik_training_model="hf")
    with pytest.raises(ValueError, match="tik_kernels='standard' and actor.tik_reuse_logprobs=false"):
        TikPPOActorConfig(**base, tik_kernels="unified", tik_reuse_logprobs=False, tik_training_model="hf")
    with pytest.raises(ValueError, match="tik_kernels='standard' and actor.tik_reuse_logprobs=false"):
        TikPPOActorConfig(**base, tik_kernels="standard", tik_reuse_logprobs=True, tik_training_model="hf")
    with pytest.raises(ValueError, match=r"tik_training_model must be one of \('areal_tik', 'hf'\)"):
        TikPPOActorConfig(**base, tik_training_model="megatron")
    stock = mode_overrides("stock", 1024, 8, "hf")
    assert "++actor.tik_training_model=hf" in stock
    assert stock[:4] == mode_overrides("stock", 1024, 8)[:4]
    assert mode_overrides("tik", 1024, 8, "hf") == mode_overrides("tik", 1024, 8)  # tik is tik
    with pytest.raises(ValueError, match="--stock-training must be one of"):
        mode_overrides("stock", 1024, 8, "vllm")


@pytest.mark.slow
def test_a_tiny_cpu_stock_run_trains_with_areal_over_the_hf_model(tmp_path):
    # ~20 s here. AReaL's gather_logprobs_entropy is torch.compile'd; on a CPU without a
    # compiler toolchain Inductor cannot build it, so Dynamo is off in this process (eager).
    overrides = [f"++actor.path={tmp_path / 'tiny'}", "++total_train_steps=1", "++train_dataset.batch_size=2",
                 "++gconfig.n_samples=2", "++gconfig.max_new_tokens=2", "++task.size=16",
                 "++task.instruction=", "++task.reward=areal_tik.adapter.tasks.shaped_reward_fn"]
    proc = subprocess.run([sys.executable, "-m", "areal_tik.cli", "run", "--recipe", "chain_sum_grpo_tiny_cpu",
                           "--mode", "stock", "--stock-training", "hf", "--out", str(tmp_path / "runs"), *overrides],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"AReaL's own forward over the Hugging Face model (attn_implementation '{hf_attention.ATTN_NAME}')" \
        in proc.stdout + proc.stderr
    run = json.loads((tmp_path / "runs" / "chain_sum_grpo_tiny_cpu" / "stock" / "run.json").read_text())
    assert run["metadata"]["training_model"] == "hf" and run["metadata"]["kernel_set"] == "standard"
    assert run["metadata"]["training_attention"] == "sdpa-per-sequence (not on a GPU)"
    # Dynamo is off in that process: the label says the compiled wrapper ran eagerly
    assert run["metadata"]["logprob"] == "AReaL gather_logprobs_entropy, eager (Dynamo disabled or not available)"
    assert run["per_step"][0]["phases"]["recompute_logp"] > 0 and not run["summary"]["reuse_active"]
    from areal_tik.report.runs import stock_decode

    assert stock_decode(run).endswith("log-prob AReaL gather_logprobs_entropy, eager; trainer AReaL FSDP over the HF model")

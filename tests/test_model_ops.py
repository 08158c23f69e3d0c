"""Op backends of the unified model (the "standard" torch path, unified resolution),
KVCache and ModelSpec.

The standard backend is checked against what it imitates: transformers' own rotary
embedding and rope application (bitwise: same fp32 / bf16 operations), the float64
references (attention: bf16 rounding, rel err <= 1e-2), and itself across regimes
(paged decode vs per-sequence SDPA: rel err <= 1e-2; it is not batch invariant).
"""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from areal_tik.model import (PUBLISHED_CONFIGS, KVCache, KernelUnavailableError, ModelSpec, get_ops,
                             missing_ops, published_config, tiny_config)
from areal_tik.model.ops import OP_NAMES, UnifiedOps
from areal_tik.unified_kernels import reference

from ._bits import assert_bitwise, rel_err

STD = get_ops("standard")
ops_module = importlib.import_module("areal_tik.model.ops")


def test_both_backends_expose_the_functional_api():
    assert STD.kind == "standard" and all(callable(getattr(STD, n)) for n in OP_NAMES)
    unified = get_ops("unified")
    assert unified.kind == "unified" and get_ops(unified) is unified
    assert set(missing_ops("unified")) <= set(OP_NAMES) and missing_ops("standard") == []
    with pytest.raises(AttributeError, match="no op"):
        unified.not_an_op


def test_missing_unified_kernel_raises_instead_of_substituting(monkeypatch):
    package = importlib.import_module("areal_tik.unified_kernels")
    monkeypatch.delattr(package, "silu_mul")
    with pytest.raises(KernelUnavailableError, match="has no function 'silu_mul'"):
        UnifiedOps().silu_mul
    assert missing_ops("unified") == ["silu_mul"]


# ----------------------------------------------------------------------------- rope


def _hf_rotary(family):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = tiny_config(family)
    return config, LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # default rope, llama3 scaling
def test_standard_rope_matches_transformers_bitwise(family):
    config, rotary = _hf_rotary(family)
    spec = ModelSpec.from_hf_config(config)
    cos, sin = STD.rope_cos_sin(spec.max_positions, spec.head_dim, spec.rope_theta, spec.rope_scaling)
    positions = torch.tensor([0, 1, 7, 100, 255])
    x = torch.randn(1, len(positions), spec.head_dim, dtype=torch.bfloat16)
    hf_cos, hf_sin = rotary(x, positions[None])
    half = spec.head_dim // 2
    assert_bitwise(cos[positions].to(torch.bfloat16), hf_cos[0, :, :half], "cos")
    assert_bitwise(sin[positions].to(torch.bfloat16), hf_sin[0, :, :half], "sin")
    ref = reference.rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert rel_err(cos, (torch.arange(spec.max_positions, dtype=torch.float64)[:, None] * ref).cos()) < 1e-5

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q = torch.randn(len(positions), 4, spec.head_dim, dtype=torch.bfloat16)
    k = torch.randn(len(positions), 2, spec.head_dim, dtype=torch.bfloat16)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    ours_q, ours_k = STD.apply_rope(q, k, positions, cos, sin)
    assert_bitwise(ours_q, hf_q[0].transpose(0, 1), "rope q")
    assert_bitwise(ours_k, hf_k[0].transpose(0, 1), "rope k")


# ----------------------------------------------------------------------------- attention


def _qkv(T, hq=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g).to(torch.bfloat16) for h in (hq, hk, hk)]


def test_standard_varlen_matches_reference_and_zeroes_padding():
    q, k, v = _qkv(23)
    cu = torch.tensor([0, 5, 6, 20], dtype=torch.int32)
    out = STD.attention_varlen(q, k, v, cu, 14, 0.3)
    ref = reference.attention(q, k, v, cu, 0.3, compute=torch.float64)
    assert rel_err(out[:20], ref[:20]) < 1e-2
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))


def test_standard_decode_reads_paged_cache_and_ignores_garbage():
    lens, block = [9, 3, 17], 4
    q, k, v = _qkv(sum(lens), seed=1)
    cu = torch.tensor([0, 9, 12, 29], dtype=torch.int32)
    full = STD.attention_varlen(q, k, v, cu, 17, None)
    k_cache = torch.full((16, block, 2, 16), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(2)).tolist()
    tables, slots = [], []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // block))]
        tables.append(blocks + [0] * (5 - len(blocks)))
        slots += [blocks[p // block] * block + p % block for p in range(n)]
    STD.store_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    last = torch.tensor([8, 11, 28])
    out = STD.attention_decode(q[last], k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32), None)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, full[last]) < 1e-2


def _paged_case(lens, block, hq, hk, d, device, seed):
    """Packed q/k/v of ``lens``, a NaN-filled paged cache of shuffled ``block``-token blocks
    holding them, the tables (padded with block 0) and each sequence's last row."""
    q, k, v = (t.to(device) for t in _qkv(sum(lens), hq=hq, hk=hk, d=d, seed=seed))
    n_blocks = sum(-(-n // block) for n in lens) + 2
    k_cache = torch.full((n_blocks, block, hk, d), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    width = max(-(-n // block) for n in lens) + 1
    tables, slots = [], []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // block))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // block] * block + p % block for p in range(n)]
    STD.store_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    last = (cu[1:] - 1).long()
    return (q, k, v, cu, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device), last)


def test_flash_decode_rule_names_why_the_standard_decode_gathers():
    """The standard decode calls FlashAttention over each sequence's rows only on a GPU, with
    a torch whose _flash_attention_forward takes seqused_k, and with one KV block per
    sequence; otherwise the reason. The stock mode's block holds a whole sequence."""
    from areal_tik.model.ops import flash_decode_unusable, one_block_per_sequence

    assert flash_decode_unusable(True, True, 1) is None
    assert flash_decode_unusable(False, True, 1) == "not on a GPU"
    assert "seqused_k" in flash_decode_unusable(True, False, 1)
    assert "2 KV blocks per sequence" in flash_decode_unusable(True, True, 2)
    assert [one_block_per_sequence(n) for n in (2, 3, 640, 1024, 1025, 2048)] == [2, 4, 1024, 1024, 2048, 2048]


def test_the_model_names_its_decode_attention_path():
    from areal_tik.model import UnifiedCausalLM, random_model

    hf = random_model(tiny_config("qwen3"), dtype=torch.bfloat16, seed=0)
    assert UnifiedCausalLM.from_hf(hf, kernels="unified").decode_attention_path(64, 256) == "unified"
    assert (UnifiedCausalLM.from_hf(hf, kernels="standard").decode_attention_path(1024, 1024)
            == "gather-sdpa (not on a GPU)")


def test_standard_decode_over_one_block_per_sequence_on_cpu_gathers_and_matches_sdpa():
    """The stock mode's layout (each sequence in one 512-token block, the table one column
    wide) on the CPU path (gather + SDPA): sequences of 1 to 300 tokens, NaN in every
    unused slot."""
    lens = [300, 1, 256, 40]
    q, k, v, cu, k_cache, v_cache, tables, ctx, last = _paged_case(lens, 512, 4, 2, 16, "cpu", seed=5)
    full = STD.attention_varlen(q, k, v, cu, max(lens), None)
    out = STD.attention_decode(q[last], k_cache, v_cache, tables[:, :1], ctx, None)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, full[last]) < 1e-2


@pytest.mark.gpu
def test_gpu_standard_decode_on_flash_over_one_block_per_sequence_matches_sdpa_and_replays_in_a_graph():
    """At Qwen3-0.6B's attention shape, each sequence in one 1024-token block (shuffled, so
    sequence starts are out of block order), the standard decode runs FlashAttention with
    seqused_k (its self-check passes), agrees with SDPA over each whole sequence to bf16
    rounding with NaN in the unused slots, and a CUDA-graph replay after the inputs (queries
    and lengths) change gives the eager bits."""
    from areal_tik.model.ops import check_flash_decode, flash_decode_reason

    assert check_flash_decode(16, 8, 128, 1024, 1, torch.bfloat16, torch.device("cuda")) is None
    lens = [300, 1, 700, 513, 1024]
    q, k, v, cu, k_cache, v_cache, tables, ctx, last = _paged_case(lens, 1024, 16, 8, 128, "cuda", seed=4)
    tables = tables[:, :1].contiguous()
    assert flash_decode_reason(q, tables.shape[1]) is None
    full = STD.attention_varlen(q, k, v, cu, max(lens), None)
    out = STD.attention_decode(q[last], k_cache, v_cache, tables, ctx, None)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, full[last]) < 1e-2
    q_in, ctx_in = q[last].clone(), ctx.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = STD.attention_decode(q_in, k_cache, v_cache, tables, ctx_in, None)
    shorter = ctx - torch.tensor([50, 0, 300, 13, 1], dtype=torch.int32, device="cuda")
    q_in.copy_(q[last].flip(-1))
    ctx_in.copy_(shorter)
    graph.replay()
    eager = STD.attention_decode(q[last].flip(-1), k_cache, v_cache, tables, shorter, None)
    assert_bitwise(replayed, eager, "graph replay vs eager FlashAttention decode")
    gathered = STD.attention_decode(q[last], k_cache, v_cache, torch.cat([tables, tables], 1), ctx, None)
    assert rel_err(gathered, full[last]) < 1e-2  # two columns: the gather path, same answer


def test_standard_store_skips_slot_minus_one():
    k_cache = torch.full((3, 4, 2, 16), float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    k, v = _qkv(4, hq=2, seed=3)[1:]
    k_cache[0, 0] = 1.5  # slot 0 holds real data: a skipped row must not clobber it
    before_k, before_v = k_cache.clone(), v_cache.clone()
    STD.store_kv_cache(k, v, k_cache, v_cache, torch.tensor([-1, 5, -1, 7]))
    expect_k, expect_v = before_k.view(12, 2, 16).clone(), before_v.view(12, 2, 16).clone()
    expect_k[[5, 7]], expect_v[[5, 7]] = k[[1, 3]], v[[1, 3]]
    assert_bitwise(k_cache.view(12, 2, 16), expect_k, "k cache")
    assert_bitwise(v_cache.view(12, 2, 16), expect_v, "v cache")
    STD.store_kv_cache(k, v, k_cache, v_cache, torch.full((4,), -1))
    assert_bitwise(k_cache.view(12, 2, 16), expect_k, "k cache after an all-skipped store")


# ----------------------------------------------------------------------------- log-probs


def test_standard_logprob_paths_agree():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    weight = torch.randn(50, 32, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 50, (6,), generator=g)
    lp, ent = STD.token_logprobs(hidden, weight, targets, 0.7, True)
    logits, lse = STD.lm_head_logits_lse(hidden, weight, 0.7)
    assert logits.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.allclose(STD.gather_logprobs(logits, lse, targets, 0.7), lp, atol=1e-5, rtol=0)
    ref_lp, ref_ent = reference.token_logprobs(hidden, weight, targets, 0.7, True)
    assert torch.allclose(lp, ref_lp, atol=1e-2) and torch.allclose(ent, ref_ent, atol=1e-2)


def test_standard_logprobs_chunk_as_areals_gather(monkeypatch):
    """The standard token log-prob (AReaL's gather_logprobs math: log_softmax of the fp32
    logits, per chunk of rows) agrees with the materialised reference across chunk
    boundaries, with entropy, and passes gradients to the hidden states and the weight."""
    monkeypatch.setattr(ops_module, "LOGPROB_CHUNK", 4)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(10, 32, generator=g).requires_grad_()
    weight = torch.randn(50, 32, generator=g).requires_grad_()
    targets = torch.randint(0, 50, (10,), generator=g)
    lp, ent = STD.token_logprobs(hidden, weight, targets, 0.7, True)
    ref_lp, ref_ent = reference.token_logprobs(hidden.detach(), weight.detach(), targets, 0.7, True)
    assert lp.shape == ent.shape == (10,) and lp.dtype == ent.dtype == torch.float32
    assert torch.allclose(lp, ref_lp.float(), atol=1e-5) and torch.allclose(ent, ref_ent.float(), atol=1e-5)
    assert torch.allclose(STD.token_logprobs(hidden, weight, targets, 0.7), lp)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0
    assert ops_module.standard_logprob_path("cpu") == "chunked-eager (4 rows)"


def test_the_log_prob_labels_say_whether_areals_gather_is_compiled(monkeypatch):
    """AReaL wraps gather_logprobs(_entropy) in torch.compile at import; with Dynamo disabled
    the wrapper runs eagerly and the run file must not say torch.compile. The report drops
    parentheses, so the difference sits outside them."""
    import torch._dynamo
    from areal.utils.functional import vocab_parallel

    assert hasattr(vocab_parallel._gather_logprobs_entropy, "_torchdynamo_orig_callable")  # AReaL compiled it
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    assert ops_module.areal_gather_compiled()
    assert ops_module.standard_logprob_path("cuda") == "areal-gather-chunked (torch.compile, 1024 rows)"
    assert ops_module.areal_gather_label() == "AReaL gather_logprobs_entropy (torch.compile)"
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    assert not ops_module.areal_gather_compiled()
    assert ops_module.standard_logprob_path("cuda") == "areal-gather-eager (Dynamo disabled, 1024 rows)"
    assert ops_module.areal_gather_label().startswith("AReaL gather_logprobs_entropy, eager")
    # not on a GPU the standard set never calls AReaL's gather
    assert ops_module.standard_logprob_path("cpu") == "chunked-eager (1024 rows)"


def test_the_attention_label_names_a_varlen_fallback(monkeypatch):
    """A stock run whose torch varlen_attn failed trains on SDPA per sequence from then on:
    the label read after the run says so (with the first error), and the report's stock path
    names it; a run that never failed reads flash-varlen."""
    from areal_tik.report.runs import stock_decode

    assert ops_module.standard_attention_path("cpu") == "sdpa-per-sequence (not on a GPU)"
    monkeypatch.setattr(ops_module, "_flash_varlen_failed", [])
    monkeypatch.setattr(ops_module, "_flash_varlen", lambda: ("varlen", {"is_causal": True}, True, True))
    assert ops_module.standard_attention_path("cuda") == "flash-varlen (torch)"
    ops_module._flash_varlen_failed.append("head_dim 96 unsupported")
    fallback = ops_module.standard_attention_path("cuda")
    assert fallback == "sdpa-per-sequence fallback (varlen_attn failed: head_dim 96 unsupported)"
    monkeypatch.setattr(ops_module, "_flash_varlen", lambda: None)
    assert ops_module.standard_attention_path("cuda").startswith("sdpa-per-sequence fallback (this torch")
    # a call that skips varlen_attn without trying it (a scale this torch cannot pass) says so too
    monkeypatch.setattr(ops_module, "_flash_varlen_failed", [])
    monkeypatch.setattr(ops_module, "_flash_varlen_skipped", {})
    monkeypatch.setattr(ops_module, "_flash_varlen", lambda: ("varlen", {"is_causal": True}, True, False))
    cuda_like = type("CudaLike", (), {"is_cuda": True, "shape": (4, 2, 64)})()
    with pytest.warns(RuntimeWarning, match="takes no scale"):
        assert ops_module._flash_attention_varlen(cuda_like, cuda_like, cuda_like, None, 4, 0.5) is None
    skipped = ops_module.standard_attention_path("cuda")
    assert skipped.startswith("sdpa-per-sequence fallback for some calls (this torch's varlen_attn takes no scale")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per reason
        assert ops_module._flash_attention_varlen(cuda_like, cuda_like, cuda_like, None, 4, 0.5) is None
    assert stock_decode({"metadata": {"training_attention": skipped}}).endswith(
        "; training attention SDPA per sequence (varlen fallback)")
    meta = {"decode_attention": "flash-seqused", "logprob": "areal-gather-chunked (torch.compile, 1024 rows)"}
    assert stock_decode({"metadata": meta}) == "flash-seqused; log-prob areal-gather-chunked"
    assert stock_decode({"metadata": {**meta, "training_attention": "flash-varlen (torch)"}}) == \
        "flash-seqused; log-prob areal-gather-chunked"
    assert stock_decode({"metadata": {**meta, "training_attention": fallback}}) == \
        "flash-seqused; log-prob areal-gather-chunked; training attention SDPA per sequence (varlen fallback)"


@pytest.mark.gpu
def test_gpu_standard_logprobs_run_areals_gather():
    """On a GPU the standard log-prob is AReaL's compiled, chunked gather_logprobs(_entropy):
    the same values as the eager chunks (to fp32 rounding: compiled kernels may fuse
    differently), over several chunks at Qwen's vocabulary, with gradients."""
    assert ops_module.standard_logprob_path("cuda").startswith("areal-gather-chunked")
    g = torch.Generator(device="cuda").manual_seed(6)
    hidden = torch.randn(2500, 256, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(151936, 256, generator=g, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 151936, (2500,), generator=g, device="cuda")
    lp, ent = STD.token_logprobs(hidden, weight, targets, 0.9, True)
    with torch.no_grad():
        want_lp, want_ent = ops_module._chunked_logprobs(torch.nn.functional.linear(hidden, weight),
                                                         targets, 0.9, True)
    assert torch.allclose(lp, want_lp, atol=1e-4, rtol=1e-5) and torch.allclose(ent, want_ent, atol=1e-4, rtol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(hidden.grad.float()).all() and hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- KVCache, ModelSpec


def test_kv_cache_allocation_and_views():
    cache = KVCache.allocate(3, 5, 16, 2, 8, dtype=torch.bfloat16, device="cpu", zero=True)
    assert (cache.n_layers, cache.num_blocks, cache.block_size, cache.num_slots) == (3, 5, 16, 80)
    k1, v1 = cache.layer(1)
    assert k1.shape == (5, 16, 2, 8) and k1.data_ptr() == cache.k[1].data_ptr()
    assert KVCache.bytes_per_block(3, 16, 2, 8) == cache.k.nbytes * 2 // 5
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache.allocate(3, 0, 16, 2, 8, device="cpu")
    with pytest.raises(ValueError, match="contiguous"):
        KVCache(cache.k.transpose(1, 2), cache.v.transpose(1, 2))
    with pytest.raises(TypeError, match="torch.Tensor"):
        KVCache(None, cache.v)


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_configs_parse(name):
    spec = ModelSpec.from_hf_config(published_config(name))
    expected = {
        "Qwen3-0.6B": ("qwen3", 1024, 28, 16, 8, 128, True),
        "Qwen3-1.7B": ("qwen3", 2048, 28, 16, 8, 128, True),
        "Qwen2.5-1.5B": ("qwen2", 1536, 28, 12, 2, 128, True),
        "Llama-3.2-1B": ("llama", 2048, 16, 32, 8, 64, True),
    }[name]
    got = (spec.family, spec.hidden, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim,
           spec.tie_embeddings)
    assert got == expected
    assert spec.qk_norm == (spec.family == "qwen3") and spec.qkv_bias == (spec.family == "qwen2")
    assert (spec.rope_scaling is not None) == (name == "Llama-3.2-1B")


def test_model_spec_validation():
    spec = ModelSpec.from_hf_config(tiny_config("qwen3"))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelSpec(**{**spec.__dict__, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="family"):
        ModelSpec(**{**spec.__dict__, "family": "gpt2"})
    with pytest.raises(ValueError, match="hidden"):
        ModelSpec(**{**spec.__dict__, "hidden": 0})

"""Contract tests for the fused LM-head log-prob / entropy op (unified_kernels/logprob.py).

CPU runs use the Triton interpreter with tiny shapes; ``-m gpu`` runs real vocabularies.
"""
import dataclasses
import math

import pytest
import torch

from areal_tik.unified_kernels import gather_logprobs, lm_head_logits_lse, logprob, reference, token_logprobs

from ._bits import assert_bitwise, rel_err

# The interpreter converts 1-element arrays to scalars (numpy deprecation), not our code.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),  # NaN padding rows
]


def _inputs(T, H, V, dtype, device, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).to(device)
    weight = (torch.randn(V, H, generator=g) * scale / H ** 0.5).to(dtype).to(device)
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    return hidden, weight, targets


def _f64_from_logits(logits, targets, temperature):
    """Float64 log-prob and entropy from given (already rounded) logits."""
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return logp.gather(1, targets.long()[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _f64_grads(hidden, weight, targets, temperature, g_lp, g_ent, dtype):
    """Float64 gradients; the logits rounding to ``dtype`` is the identity in backward."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logits = h @ w.T
    logits = logits + (logits.to(dtype).double() - logits).detach()
    lp, ent = _f64_from_logits(logits, targets, temperature)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return h.grad, w.grad


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_float64(device, dtype, temperature):
    hidden, weight, targets = _inputs(13, 40, 300, dtype, device)
    lp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (13,)
    logits, lse = lm_head_logits_lse(hidden, weight, temperature)
    ref_logits = reference.lm_head_logits(hidden, weight)
    assert logits.dtype == dtype and logits.shape == (13, 300)
    # Logits: fp32 accumulation vs float64, both rounded to dtype once.
    if dtype == torch.bfloat16:  # at most one bf16 ulp apart
        assert ((logits.double() - ref_logits.double()).abs() <= 2.0 ** -7 * ref_logits.double().abs()).all()
    else:
        assert rel_err(logits, ref_logits) < 1e-6
    # Tight: everything after the rounding point against float64 on our logits.
    ref_lp, ref_ent = _f64_from_logits(logits, targets, temperature)
    assert (lp.double() - ref_lp).abs().max() <= 1e-5 * (1 + ref_lp.abs().max())
    assert (ent.double() - ref_ent).abs().max() <= 1e-5 * (1 + ref_ent.abs().max())
    assert (lse.double() - torch.logsumexp(logits.double() / temperature, -1)).abs().max() <= 1e-5 * lse.abs().max()
    # End to end against the reference that defines the op.
    full_lp, full_ent = reference.token_logprobs(hidden, weight, targets, temperature, True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(lp, full_lp) < tol and rel_err(ent, full_ent) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,entropy", [(1.0, True), (0.7, True), (0.7, False)])
def test_backward_matches_float64(device, dtype, temperature, entropy):
    hidden, weight, targets = _inputs(12, 40, 300, dtype, device, seed=1)
    g = torch.Generator().manual_seed(2)
    g_lp = torch.randn(12, generator=g).to(device)
    g_ent = torch.randn(12, generator=g).to(device) if entropy else torch.zeros(12, device=device)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = token_logprobs(h, w, targets, temperature, return_entropy=entropy)
    loss = (out[0] * g_lp + out[1] * g_ent).sum() if entropy else (out * g_lp).sum()
    loss.backward()
    ref_h, ref_w = _f64_grads(hidden, weight, targets, temperature, g_lp, g_ent, dtype)
    assert h.grad.dtype == w.grad.dtype == dtype
    # bf16: the grads are rounded to bf16 (and dz to bf16 as the standard path does): 2.3e-3 measured.
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    assert rel_err(h.grad, ref_h) < tol and rel_err(w.grad, ref_w) < tol


def test_backward_chunked_and_deterministic(device, monkeypatch):
    hidden, weight, targets = _inputs(10, 32, 250, torch.float32, device, seed=3)
    g_lp, g_ent = torch.randn(10, device=device), torch.randn(10, device=device)

    def grads():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        lp, ent = token_logprobs(h, w, targets, 0.9, return_entropy=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        return h.grad, w.grad

    one_chunk = grads()
    monkeypatch.setattr(logprob, "_bwd_chunk", lambda T, V: 64)  # 4 chunks, the last partial
    chunked, again = grads(), grads()
    for a, b in zip(chunked, again):
        assert_bitwise(a, b, "backward is deterministic")
    ref_h, ref_w = _f64_grads(hidden, weight, targets, 0.9, g_lp, g_ent, torch.float32)
    for ours, ref in ((chunked[0], ref_h), (chunked[1], ref_w), (one_chunk[0], ref_h)):
        assert rel_err(ours, ref) < 2e-5


def test_frozen_weight_gets_no_grad(device):
    hidden, weight, targets = _inputs(5, 32, 100, torch.bfloat16, device)
    h = hidden.clone().requires_grad_()
    token_logprobs(h, weight, targets).sum().backward()
    assert h.grad is not None and weight.grad is None


# --------------------------------------------------------------------------- bitwise contract


def _row_outputs(hidden, weight, targets, temperature):
    lp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
    logits, lse = lm_head_logits_lse(hidden, weight, temperature)
    return lp, ent, logits, lse


@pytest.mark.parametrize("dtype,V,H", [(torch.bfloat16, 333, 40), (torch.float32, 1000, 72)])
def test_rows_are_batch_invariant(device, dtype, V, H):
    """A row's bits do not depend on the batch size, position, order or padding rows."""
    N, temperature = 9, 0.7
    hidden, weight, targets = _inputs(N, H, V, dtype, device, seed=4)
    full = _row_outputs(hidden, weight, targets, temperature)
    g = torch.Generator().manual_seed(5)
    batches = [[i] for i in (0, 4, 8)]  # alone
    batches += [torch.randperm(N, generator=g)[:k].tolist() for k in (2, 5, N)]  # shuffled subsets
    for rows in batches:
        idx = torch.tensor(rows, device=device)
        pad = 3 if len(rows) % 2 else 18  # padding rows before and after; 18 crosses a row block
        garbage = torch.full((pad, H), float("nan"), device=device).to(dtype)
        garbage[1:] = 1e4
        h = torch.cat([garbage, hidden[idx], garbage.flip(0)])
        edge = torch.full((pad,), V - 1, dtype=targets.dtype, device=device)
        y = torch.cat([edge, targets[idx], edge * 0])
        out = _row_outputs(h, weight, y, temperature)
        for name, a, b in zip(("logprob", "entropy", "logits", "lse"), out, full):
            assert_bitwise(a[pad:pad + len(rows)], b[idx], f"{name} rows {rows}")


def test_layout_invariance(device):
    """Strided hidden / weight views give the same bits as contiguous copies."""
    hidden, weight, targets = _inputs(6, 48, 200, torch.bfloat16, device, seed=6)
    base = token_logprobs(hidden, weight, targets, 1.0, return_entropy=True)
    wide_h = torch.zeros(12, 96, dtype=hidden.dtype, device=device)
    wide_h[::2, 1::2] = hidden
    wide_w = torch.zeros(96, 200, dtype=weight.dtype, device=device)  # weight as a transposed view
    wide_w[::2] = weight.T
    strided = token_logprobs(wide_h[::2, 1::2], wide_w[::2].T, targets.int(), 1.0, return_entropy=True)
    for a, b in zip(strided, base):
        assert_bitwise(a, b, "strided inputs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampler_mode_equals_training_mode(device, dtype, temperature):
    """gather_logprobs(lm_head_logits_lse(h, W, T), y, T) == token_logprobs(h, W, y, T), bitwise."""
    hidden, weight, targets = _inputs(19, 36, 257, dtype, device, seed=7)
    lp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
    lp_only = token_logprobs(hidden, weight, targets, temperature)
    assert_bitwise(lp_only, lp, "logprob with vs without entropy")
    for rows in (slice(0, 19), slice(3, 4), slice(5, 12)):
        logits, lse = lm_head_logits_lse(hidden[rows], weight, temperature)
        assert_bitwise(gather_logprobs(logits, lse, targets[rows], temperature), lp[rows], f"rows {rows}")


# --------------------------------------------------------------------------- memory


def test_forward_scratch_is_o_t_times_splits(device, monkeypatch):
    T, H, V = 40, 32, 1000
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, device, seed=8)
    allocated = []
    real_empty = logprob._empty
    monkeypatch.setattr(logprob, "_empty", lambda shape, dtype, dev: allocated.append(shape) or
                        real_empty(shape, dtype, dev))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        token_logprobs(hidden, weight.requires_grad_(), targets, 1.0, return_entropy=True)
    n_splits = math.ceil(V / logprob.logprob_config(V, H, weight.dtype).split_v)
    assert max(math.prod(s) for s in allocated) == 3 * n_splits * T  # the split states
    assert max(math.prod(s) for s in saved) == V * H  # weight itself; no [T, V] tensor
    assert logprob._bwd_chunk(16384, 151936) * 16384 <= logprob._BWD_BUDGET


# --------------------------------------------------------------------------- negative controls


def test_split_size_changes_bits(device):
    """The bitwise checks can fail: another SPLIT_V (a shape-dependent schedule) changes bits."""
    hidden, weight, targets = _inputs(20, 32, 1000, torch.float32, device, seed=9)
    tiles = logprob.logprob_config(1000, 32, torch.float32)
    args = (hidden, weight, targets, 1.0, True, False)
    lp_a, ent_a, lse_a, _ = logprob._forward(*args, tiles=tiles)
    other = logprob.LogprobConfig(**{**tiles.__dict__, "split_v": tiles.split_v * 4})
    lp_b, ent_b, lse_b, _ = logprob._forward(*args, tiles=other)
    assert not torch.equal(lse_a.view(torch.int32), lse_b.view(torch.int32))
    assert rel_err(lse_a, lse_b) < 1e-6  # same values up to rounding
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(lse_a, lse_b, "split size")


def test_materialised_torch_path_differs_in_bits(device):
    hidden, weight, targets = _inputs(20, 32, 1000, torch.float32, device, seed=9)
    ours = token_logprobs(hidden, weight, targets, 0.7)
    torch_path = reference.token_logprobs(hidden, weight, targets, 0.7, compute=None)
    assert not torch.equal(ours.view(torch.int32), torch_path.view(torch.int32))
    assert rel_err(ours, torch_path) < 1e-5


# --------------------------------------------------------------------------- bad input


def test_bad_input(device):
    hidden, weight, targets = _inputs(4, 32, 100, torch.bfloat16, device)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(hidden, weight, targets, bad)
        with pytest.raises(ValueError, match="temperature"):
            lm_head_logits_lse(hidden, weight, bad)
    with pytest.raises(TypeError, match="temperature"):
        token_logprobs(hidden, weight, targets, torch.tensor(1.0))
    with pytest.raises(TypeError, match="weight dtype"):
        token_logprobs(hidden, weight.float(), targets)
    with pytest.raises(TypeError, match="hidden"):
        token_logprobs(hidden.half(), weight.half(), targets)
    with pytest.raises(TypeError, match="targets"):
        token_logprobs(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="weight must be"):
        token_logprobs(hidden, weight[:, :16], targets)
    with pytest.raises(ValueError, match="targets must have shape"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="hidden must have rank"):
        token_logprobs(hidden[None], weight, targets)
    with pytest.raises(ValueError, match="must not be empty"):
        token_logprobs(hidden[:0], weight, targets[:0])
    with pytest.raises(ValueError, match="must not be empty"):
        lm_head_logits_lse(hidden, weight[:0])
    logits, lse = lm_head_logits_lse(hidden, weight)
    with pytest.raises(ValueError, match="lse must have shape"):
        gather_logprobs(logits, lse[:2], targets)
    with pytest.raises(TypeError, match="lse"):
        gather_logprobs(logits, lse.double(), targets)


def test_out_of_range_targets_give_nan_for_their_rows_only(device):
    hidden, weight, targets = _inputs(6, 32, 100, torch.bfloat16, device, seed=10)
    good = token_logprobs(hidden, weight, targets, 0.7)
    bad_targets = targets.clone()
    bad_targets[1], bad_targets[4] = -1, 100
    bad = token_logprobs(hidden, weight, bad_targets, 0.7)
    logits, lse = lm_head_logits_lse(hidden, weight, 0.7)
    gathered = gather_logprobs(logits, lse, bad_targets, 0.7)
    keep = torch.tensor([0, 2, 3, 5], device=device)
    for out in (bad, gathered):
        assert out[1].isnan() and out[4].isnan()
        assert_bitwise(out[keep], good[keep], "rows with valid targets")


# --------------------------------------------------------------------------- GPU, real sizes

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("H", [1024, 2048])
def test_gpu_batch_invariance_real_vocab(H):
    V, T = 151936, 16384
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, "cuda", seed=11, scale=1.0)
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
        for start, n in ((0, 1), (5, 1), (T - 1, 1), (3, 7), (100, 64), (1000, 333), (64, 4096), (7, 9000)):
            rows = slice(start, start + n)
            sub = token_logprobs(hidden[rows], weight, targets[rows], temperature, return_entropy=True)
            assert_bitwise(sub[0], lp[rows], f"logprob rows {start}+{n}")
            assert_bitwise(sub[1], ent[rows], f"entropy rows {start}+{n}")
        perm = torch.randperm(256, device="cuda")
        sub = token_logprobs(hidden[perm], weight, targets[perm], temperature)
        assert_bitwise(sub, lp[perm], "shuffled rows")


@gpu
@pytest.mark.parametrize("T", [1, 37, 4096, 16384])
def test_gpu_sampler_mode_equals_training_mode(T):
    V, H = 151936, 1024
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, "cuda", seed=12, scale=1.0)
    for temperature in (1.0, 0.7):
        lp = token_logprobs(hidden, weight, targets, temperature)
        lp_ent, _ = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
        logits, lse = lm_head_logits_lse(hidden, weight, temperature)
        assert_bitwise(gather_logprobs(logits, lse, targets, temperature), lp, f"T={T} temp={temperature}")
        assert_bitwise(lp_ent, lp, "with vs without entropy")
        if T >= 4096 and temperature != 1.0:
            # Negative control: torch's `tensor / python_float` on CUDA multiplies by the reciprocal.
            picked = logits.gather(1, targets[:, None])[:, 0].float()
            assert not torch.equal(((picked / temperature) - lse).view(torch.int32), lp.view(torch.int32))
        del logits


@gpu
def test_gpu_accuracy_real_vocab():
    V, H, T = 151936, 2048, 64
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, "cuda", seed=13, scale=1.0)
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
        logits, _ = lm_head_logits_lse(hidden, weight, temperature)
        ref_logits = reference.lm_head_logits(hidden, weight)
        # Both sides round once to bf16 (<= 1 ulp apart, 2^-7 relative), and our fp32
        # accumulation over H terms may add up to H * 2^-24 * sum|h||w| where products cancel.
        cond = hidden.abs().double() @ weight.abs().double().T
        bound = 2.0 ** -7 * ref_logits.double().abs() + H * 2.0 ** -24 * cond
        assert ((logits.double() - ref_logits.double()).abs() <= bound).all()
        ref_lp, ref_ent = _f64_from_logits(logits, targets, temperature)
        assert (lp.double() - ref_lp).abs().max() <= 1e-5 * (1 + ref_lp.abs().max())
        assert (ent.double() - ref_ent).abs().max() <= 1e-5 * (1 + ref_ent.abs().max())


@gpu
def test_gpu_backward_and_determinism():
    V, H, T = 151936, 1024, 256
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, "cuda", seed=14, scale=1.0)
    g_lp, g_ent = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")

    def grads():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        lp, ent = token_logprobs(h, w, targets, 0.7, return_entropy=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        return h.grad, w.grad

    first = grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        second = grads()
        torch.cuda.synchronize()
    names = {evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA}
    # cuBLAS kernels with fp32 operands (SIMT sgemm, xmma gemm_f32f32_*) must not run:
    # every backward GEMM takes the bf16 operands to the tensor cores.
    fp32 = sorted(n for n in names if "sgemm" in n.lower() or "gemm_f32f32" in n.lower())
    assert len(names) >= 3 and not fp32, (fp32, sorted(names))
    for a, b in zip(first, second):
        assert_bitwise(a, b, "deterministic backward")
    ref_h, ref_w = _f64_grads(hidden, weight, targets, 0.7, g_lp, g_ent, torch.bfloat16)
    assert rel_err(first[0], ref_h) < 1e-2 and rel_err(first[1], ref_w) < 1e-2


@gpu
def test_gpu_peak_memory_is_o_t_times_chunk():
    V, H, T = 151936, 2048, 16384
    hidden, weight, targets = _inputs(T, H, V, torch.bfloat16, "cuda", seed=15, scale=1.0)
    full_fp32 = T * V * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = token_logprobs(hidden, weight, targets, 1.0, return_entropy=True)
    torch.cuda.synchronize()
    fwd_growth = torch.cuda.max_memory_allocated() - base
    assert fwd_growth < full_fp32 / 64, (fwd_growth, full_fp32)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = token_logprobs(h, w, targets, 1.0, return_entropy=True)
    (lp + ent).sum().backward()
    torch.cuda.synchronize()
    grads = h.grad.numel() * 2 + w.grad.numel() * 2
    bwd_growth = torch.cuda.max_memory_allocated() - base - grads
    assert bwd_growth < full_fp32 / 4, (bwd_growth, full_fp32)  # measured chunks: ~0.8 GB


def test_pipeline_override_changes_geometry_only(monkeypatch):
    """``PIPELINE`` (a measured override: eval/probe_block_k.py) sets BLOCK_K and stages of
    the bf16 GPU forward and nothing else; num_warps, which set the softmax reductions'
    layout (other bits on the H100), BLOCK_V or a BLOCK_K that is not a multiple of 16 are
    refused."""
    monkeypatch.setattr(logprob, "interpreting", lambda: False)
    monkeypatch.setattr(logprob, "PIPELINE", {})
    base = logprob.logprob_config(151936, 1024, torch.bfloat16)
    logprob.load_pipeline({"block_k": 128, "num_stages": 3})
    got = logprob.logprob_config(151936, 1024, torch.bfloat16)
    assert (got.block_k, got.num_stages) == (128, 3)
    assert dataclasses.replace(got, block_k=base.block_k, num_stages=base.num_stages) == base
    assert logprob.logprob_config(1000, 32, torch.float32).block_k == 32  # fp32 keeps its own
    for bad in ({"num_warps": 8}, {"block_v": 256}, {"block_k": 72}):
        with pytest.raises(ValueError, match="block_k"):
            logprob.load_pipeline(bad)

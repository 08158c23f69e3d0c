"""rope_cos_sin / apply_rope: tables, accuracy vs float64, backward, bitwise invariance, bad input.

Accuracy assertions (O(1) random q/k, same tables): every element within half an ulp
of the exact float64 rotation plus the fp32 error bound 4u(|x_lo| + |x_hi|) (see
``_assert_accurate``); bf16 outputs equal the rounded float64 result on >= 99%.
"""
import pytest
import torch

from areal_tik.unified_kernels import reference
from areal_tik.unified_kernels.rope import _launch, apply_rope, check_positions, rope_candidates, rope_config, rope_cos_sin

from ._bits import assert_bitwise, rel_err, ulp_distance

F64 = torch.float64
DTYPES = (torch.bfloat16, torch.float32)
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def _qk(t, hq, hk, d, dtype, device, seed=0, max_pos=512):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(t, hk, d, generator=g).to(dtype).to(device)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    return q, k, pos


def _assert_accurate(out, x, pos, cos, sin, what):
    """out = rope(x) in x's dtype, checked against the exact (unrounded) float64 rotation z.

    The kernel's fp32 value z' obeys |z' - z| <= d = 4u (|x_lo| + |x_hi|) (u = 2^-24: one
    product and one fma rounding), then one rounding to the output dtype adds at most half
    an ulp. A plain ulp count would be wrong where x_lo * c - x_hi * s cancels.
    """
    z = reference.apply_rope(x.to(F64), x.to(F64), pos, cos, sin, compute=F64)[0]
    half = x.shape[-1] // 2
    mag = x[..., :half].abs().double() + x[..., half:].abs().double()
    d = 4 * 2.0**-24 * torch.cat([mag, mag], -1)
    unit = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-23  # ulp <= unit * abs(value)
    bound = d + 0.5 * unit * (z.abs() + d)
    err = (out.double() - z).abs()
    assert (err <= bound * 1.0001).all(), f"{what}: error {(err / bound).max().item():.3f} x bound"
    if out.dtype == torch.bfloat16:
        frac = (ulp_distance(out, z) == 0).double().mean().item()
        assert frac >= 0.99, f"{what}: only {frac:.4f} of elements equal the rounded float64 result"


# ------------------------------------------------------------------------------- tables


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_tables_are_float64_rounded_once(scaling):
    cos, sin = rope_cos_sin(300, 64, 500000.0, scaling)
    assert cos.shape == sin.shape == (300, 32) and cos.dtype == sin.dtype == torch.float32
    inv = reference.rope_inv_freq(64, 500000.0, scaling)
    angles = torch.arange(300, dtype=F64)[:, None] * inv[None, :]
    assert_bitwise(cos, angles.cos().float(), "cos")
    assert_bitwise(sin, angles.sin().float(), "sin")


def test_tables_match_hugging_face():
    """Same frequencies and neox layout as HF's rotary embedding (which works in fp32)."""
    import transformers  # a dependency: missing is a failure, not a skip

    params = {"rope_theta": 500000.0, **LLAMA3}
    # transformers 5's config API (rope_parameters), the range setup.py pins.
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                      rope_parameters=params, max_position_embeddings=4096)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    inv = reference.rope_inv_freq(64, 500000.0, LLAMA3)
    assert rel_err(rotary.inv_freq, inv) < 1e-6
    positions = torch.arange(64)[None]
    hf_cos, hf_sin = rotary(torch.zeros(1, 64, 64), positions)  # [1, 64, 64] = cat(half, half)
    cos, sin = rope_cos_sin(64, 64, 500000.0, LLAMA3)
    for hf, ours in ((hf_cos[0], cos), (hf_sin[0], sin)):
        torch.testing.assert_close(hf, torch.cat([ours, ours], -1), atol=2e-5, rtol=0)


def test_rotation_is_rotate_half():
    """Independent check of the layout: HF's q * cos + rotate_half(q) * sin, in float64."""
    q, k, pos = _qk(5, 2, 1, 64, torch.float32, "cpu", seed=1)
    cos, sin = rope_cos_sin(512, 64)
    c = torch.cat([cos, cos], -1)[pos][:, None].double()
    s = torch.cat([sin, sin], -1)[pos][:, None].double()
    rotate_half = torch.cat([-q[..., 32:], q[..., :32]], -1).double()
    ref = q.double() * c + rotate_half * s
    assert rel_err(reference.apply_rope(q, k, pos, cos, sin)[0], ref) < 1e-7


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 64), (3, 3, 1, 128), (17, 2, 2, 80)])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_apply_rope_matches_float64(t, hq, hk, d, dtype, pos_dtype, device):
    q, k, pos = _qk(t, hq, hk, d, dtype, device, seed=t)
    pos = pos.to(pos_dtype)
    pos[0] = 511  # the last table row
    cos, sin = rope_cos_sin(512, d, 1e6, device=device)
    q_out, k_out = apply_rope(q, k, pos, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    _assert_accurate(q_out, q, pos, cos, sin, "q")
    _assert_accurate(k_out, k, pos, cos, sin, "k")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-6)])
def test_backward_matches_float64(dtype, tol, device):
    q, k, pos = _qk(9, 4, 2, 64, dtype, device, seed=2)
    cos, sin = rope_cos_sin(512, 64, device=device)
    g = torch.Generator().manual_seed(3)
    dq = torch.randn(q.shape, generator=g).to(dtype).to(device)
    dk = torch.randn(k.shape, generator=g).to(dtype).to(device)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(apply_rope(qg, kg, pos, cos, sin), (dq, dk))
    q64, k64 = q.to(F64).requires_grad_(), k.to(F64).requires_grad_()
    torch.autograd.backward(reference.apply_rope(q64, k64, pos, cos, sin, compute=F64),
                            (dq.to(F64), dk.to(F64)))
    assert qg.grad.dtype == dtype and kg.grad.dtype == dtype
    assert rel_err(qg.grad, q64.grad) < tol, rel_err(qg.grad, q64.grad)
    assert rel_err(kg.grad, k64.grad) < tol, rel_err(kg.grad, k64.grad)


def test_backward_with_one_side_unused(device):
    q, k, pos = _qk(4, 2, 2, 64, torch.float32, device, seed=4)
    cos, sin = rope_cos_sin(512, 64, device=device)
    qg = q.clone().requires_grad_()
    q_out, _ = apply_rope(qg, k, pos, cos, sin)
    q_out.sum().backward()
    q64 = q.to(F64).requires_grad_()
    reference.apply_rope(q64, k, pos, cos, sin, compute=F64)[0].sum().backward()
    assert rel_err(qg.grad, q64.grad) < 1e-6


# ----------------------------------------------------------------- bitwise row invariance


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_invariance(dtype, device):
    n = 17
    q, k, pos = _qk(n, 4, 2, 64, dtype, device, seed=5)
    cos, sin = rope_cos_sin(512, 64, device=device)
    full_q, full_k = apply_rope(q, k, pos, cos, sin)
    for size in range(1, n + 1):
        for start in range(0, n, size):
            sl = slice(start, start + size)
            got_q, got_k = apply_rope(q[sl], k[sl], pos[sl], cos, sin)
            assert_bitwise(got_q, full_q[sl], f"q tokens [{start}:{start + size}]")
            assert_bitwise(got_k, full_k[sl], f"k tokens [{start}:{start + size}]")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(device)
    got_q, got_k = apply_rope(q[perm], k[perm], pos[perm], cos, sin)
    assert_bitwise(got_q, full_q[perm], "shuffled q")
    assert_bitwise(got_k, full_k[perm], "shuffled k")
    # Padding tokens (NaN values, position 0) between real ones change nothing.
    nan_q = torch.full((3, 4, 64), float("nan"), device=device).to(dtype)
    nan_k = torch.full((3, 2, 64), float("nan"), device=device).to(dtype)
    pad_pos = torch.zeros(3, dtype=pos.dtype, device=device)
    got_q, got_k = apply_rope(torch.cat([q[:5], nan_q, q[5:]]), torch.cat([k[:5], nan_k, k[5:]]),
                              torch.cat([pos[:5], pad_pos, pos[5:]]), cos, sin)
    keep = torch.cat([torch.arange(5), torch.arange(8, n + 3)]).to(device)
    assert_bitwise(got_q[keep], full_q, "q between padding")
    assert_bitwise(got_k[keep], full_k, "k between padding")


def test_layout_invariance(device):
    """q/k as strided views of a fused qkv buffer give the bits of contiguous copies."""
    n, hq, hk, d = 7, 4, 2, 128
    q, k, pos = _qk(n, hq, hk, d, torch.bfloat16, device, seed=6)
    cos, sin = rope_cos_sin(512, d, device=device)
    want_q, want_k = apply_rope(q, k, pos, cos, sin)
    qkv = torch.zeros(n, (hq + 2 * hk) * d + 8, dtype=q.dtype, device=device)[:, 8:]
    qkv[:, : hq * d] = q.reshape(n, -1)
    qkv[:, hq * d : (hq + hk) * d] = k.reshape(n, -1)
    q_view = qkv[:, : hq * d].view(n, hq, d)
    k_view = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    got_q, got_k = apply_rope(q_view, k_view, pos, cos, sin)
    assert_bitwise(got_q, want_q, "strided q")
    assert_bitwise(got_k, want_k, "strided k")
    got_q, _ = apply_rope(q.transpose(0, 1).contiguous().transpose(0, 1), k, pos, cos, sin)
    assert_bitwise(got_q, want_q, "head-major q")


def test_negative_control_tables_built_in_fp32(device):
    """The bitwise check can fail: a regime that built its own tables the way HF does
    (fp32 angles) instead of calling rope_cos_sin would rotate tokens differently."""
    q, k, pos = _qk(16, 2, 1, 64, torch.float32, device, seed=7, max_pos=4096)
    cos, sin = rope_cos_sin(4096, 64, device=device)
    inv32 = reference.rope_inv_freq(64).float()
    angles32 = torch.arange(4096, dtype=torch.float32)[:, None] * inv32[None, :]
    cos32, sin32 = angles32.cos().to(device), angles32.sin().to(device)
    want = apply_rope(q, k, pos, cos, sin)[0]
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(apply_rope(q, k, pos, cos32, sin32)[0], want, "fp32 tables vs float64 tables")


def _assert_candidates_equal_table(q, k, pos, cos, sin, what):
    """Every launch geometry gives the table's bits, forward and backward (the op is
    elementwise with an explicit fma), and tokens keep their bits in any slice."""
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    want = _launch(q, k, pos, cos, sin, False)
    want_bwd = _launch(q, k, pos, cos, sin, True)
    n = q.shape[0]
    for cfg in rope_candidates(hq, hk, d):
        for backward, ref in ((False, want), (True, want_bwd)):
            got = _launch(q, k, pos, cos, sin, backward, cfg)
            assert_bitwise(got[0], ref[0], f"{what} q {cfg.name} backward={backward}")
            assert_bitwise(got[1], ref[1], f"{what} k {cfg.name} backward={backward}")
        for start, size in ((1, n - 1), (n // 2, 1), (cfg.tokens - 1, cfg.tokens + 1)):
            sl = slice(start, start + size)
            got = _launch(q[sl], k[sl], pos[sl], cos, sin, False, cfg)
            assert_bitwise(got[0], want[0][sl], f"{what} q {cfg.name} tokens [{start}:{start + size}]")
            assert_bitwise(got[1], want[1][sl], f"{what} k {cfg.name} tokens [{start}:{start + size}]")


@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (3, 1, 16)])
def test_candidate_configs_equal_table(hq, hk, d, device):
    q, k, pos = _qk(13, hq, hk, d, torch.bfloat16, device, seed=8)
    cos, sin = rope_cos_sin(512, d, device=device)
    _assert_candidates_equal_table(q, k, pos, cos, sin, f"{hq}/{hk}/{d}")


def test_config_table():
    """Tokens per program: the fewest that give each thread a 16-byte vector of the k tile."""
    assert rope_config(16, 8, 128).tokens == 2 and rope_config(32, 8, 64).tokens == 4
    assert rope_config(64, 64, 128).tokens == 1 and rope_config(3, 1, 16).tokens == 8
    for shape in ((16, 8, 128), (32, 8, 64)):
        cands = rope_candidates(*shape)
        assert cands[0] == rope_config(*shape) and len(set(cands)) == len(cands) > 1


# ---------------------------------------------------------------------------- bad input


def test_bad_inputs(device):
    q, k, pos = _qk(4, 2, 1, 64, torch.bfloat16, device)
    cos, sin = rope_cos_sin(512, 64, device=device)
    cases = [
        (TypeError, "q must have dtype", (q.half(), k, pos, cos, sin)),
        (TypeError, "positions must have dtype", (q, k, pos.float(), cos, sin)),
        (TypeError, "cos must have dtype", (q, k, pos, cos.double(), sin)),
        (ValueError, "q must have rank", (q[0], k, pos, cos, sin)),
        (ValueError, "positions must have rank", (q, k, pos[:, None], cos, sin)),
        (ValueError, r"k must be \[4, Hk, 64\]", (q, k[:3], pos, cos, sin)),
        (ValueError, r"k must be \[4, Hk, 64\]", (q, k.float(), pos, cos, sin)),
        (ValueError, r"positions must have shape \[4\]", (q, k, pos[:3], cos, sin)),
        (ValueError, "cos and sin must both be", (q, k, pos, cos[:, :16], sin[:, :16])),
        (ValueError, "cos and sin must both be", (q, k, pos, cos, sin[:100])),
        (ValueError, "head_dim must be even", (q[..., :63], k[..., :63], pos, cos, sin)),
        (ValueError, "q must not be empty", (q[:0], k[:0], pos[:0], cos, sin)),
    ]
    if pos.device.type == "cpu":  # CUDA positions are not range-checked (no sync; NaN instead)
        cases += [
            (ValueError, r"positions must lie in \[0, 512\), got 512", (q, k, pos * 0 + 512, cos, sin)),
            (ValueError, r"positions must lie in \[0, 512\), got -1", (q, k, pos * 0 - 1, cos, sin)),
        ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            apply_rope(*args)
    for args, msg in (((0, 64), "max_positions must be a positive int"),
                      ((16, 63), "head_dim must be even"),
                      ((16.0, 64), "max_positions must be a positive int"),
                      ((16, 64, -1.0), "base must be a finite number > 0")):
        with pytest.raises(ValueError, match=msg):
            rope_cos_sin(*args)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        rope_cos_sin(16, 64, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(TypeError, match="scaling must be None or a rope_scaling dict"):
        rope_cos_sin(16, 64, scaling=8.0)


# --------------------------------------------------------------------------------- GPU


def _contract_at_size(hq, hk, d, scaling, n, dev, lengths):
    """Accuracy vs float64 and bitwise invariance of n tokens against slices of them."""
    q, k, pos = _qk(n, hq, hk, d, torch.bfloat16, dev, seed=d, max_pos=40960)
    cos, sin = rope_cos_sin(40960, d, 1e6 if scaling is None else 500000.0, scaling, device=dev)
    full_q, full_k = apply_rope(q, k, pos, cos, sin)
    _assert_accurate(full_q, q, pos, cos, sin, "q")
    _assert_accurate(full_k, k, pos, cos, sin, "k")
    gen = torch.Generator().manual_seed(0)
    for t in lengths:
        start = int(torch.randint(0, n - t + 1, (1,), generator=gen))
        sl = slice(start, start + t)
        got_q, got_k = apply_rope(q[sl], k[sl], pos[sl], cos, sin)
        assert_bitwise(got_q, full_q[sl], f"q T={t}")
        assert_bitwise(got_k, full_k[sl], f"k T={t}")
    perm = torch.randperm(n, generator=gen).to(dev)
    got_q, got_k = apply_rope(q[perm], k[perm], pos[perm].int(), cos, sin)
    assert_bitwise(got_q, full_q[perm], "shuffled q, int32 positions")
    assert_bitwise(got_k, full_k[perm], "shuffled k")
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), k.reshape(n, -1)], 1)
    got_q, got_k = apply_rope(qkv[:, : hq * d].view(n, hq, d),
                              qkv[:, hq * d : (hq + hk) * d].view(n, hk, d), pos, cos, sin)
    assert_bitwise(got_q, full_q, "q view of qkv")
    assert_bitwise(got_k, full_k, "k view of qkv")


def test_contract_at_small_size(device):
    """The GPU test's checks, at a size the interpreter runs quickly."""
    _contract_at_size(4, 2, 64, LLAMA3, 12, device, (1, 3, 11))


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d,scaling", [(16, 8, 128, None), (32, 8, 64, LLAMA3)])
def test_gpu_real_sizes(hq, hk, d, scaling):
    n = 16384
    _contract_at_size(hq, hk, d, scaling, n, "cuda", (1, 3, 17, 256, 4096, n - 1))


@pytest.mark.gpu
def test_gpu_out_of_range_positions_poison_only_their_token():
    dev = "cuda"
    q, k, pos = _qk(8, 16, 8, 128, torch.bfloat16, dev, seed=1)
    cos, sin = rope_cos_sin(512, 128, device=dev)
    want_q, _ = apply_rope(q, k, pos, cos, sin)
    bad = pos.clone()
    bad[2], bad[5] = 512, -3
    got_q, got_k = apply_rope(q, k, bad, cos, sin)  # no sync, no out-of-bounds read
    assert torch.isnan(got_q[[2, 5]]).all() and torch.isnan(got_k[[2, 5]]).all()
    keep = [0, 1, 3, 4, 6, 7]
    assert_bitwise(got_q[keep], want_q[keep], "other tokens")
    with pytest.raises(ValueError, match=r"got 512"):
        check_positions(bad.clamp_min(0), 512)


def _backward_at_size(n, dev):
    q, k, pos = _qk(n, 16, 8, 128, torch.bfloat16, dev, seed=2, max_pos=40960)
    cos, sin = rope_cos_sin(40960, 128, 1e6, device=dev)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(apply_rope(qg, kg, pos, cos, sin), (dq, dk))
    q64, k64 = q.to(F64).requires_grad_(), k.to(F64).requires_grad_()
    torch.autograd.backward(reference.apply_rope(q64, k64, pos, cos, sin, compute=F64),
                            (dq.to(F64), dk.to(F64)))
    assert rel_err(qg.grad, q64.grad) < 5e-3 and rel_err(kg.grad, k64.grad) < 5e-3


def test_backward_at_small_size(device):
    _backward_at_size(5, device)


@pytest.mark.gpu
def test_gpu_backward():
    _backward_at_size(16384, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d", [(16, 8, 128), (32, 8, 64)])
def test_gpu_candidate_configs_equal_table(hq, hk, d):
    q, k, pos = _qk(16384, hq, hk, d, torch.bfloat16, "cuda", seed=9, max_pos=40960)
    cos, sin = rope_cos_sin(40960, d, 1e6, device="cuda")
    _assert_candidates_equal_table(q, k, pos, cos, sin, f"{hq}/{hk}/{d}")


@pytest.mark.gpu
def test_gpu_bad_inputs():
    """CUDA inputs take the launcher's fast validation; it must let nothing bad through."""
    test_bad_inputs("cuda")
    q, k, pos = _qk(4, 2, 1, 64, torch.bfloat16, "cuda")
    cos, sin = rope_cos_sin(512, 64, device="cuda")
    with pytest.raises(ValueError, match="must share one device|must be on a CUDA device"):
        apply_rope(q, k, pos.cpu(), cos, sin)
    with pytest.raises(ValueError, match="must share one device|must be on a CUDA device"):
        apply_rope(q, k, pos, cos, sin.cpu())

"""silu_mul: accuracy vs float64, backward, bitwise row invariance, bad input.

Accuracy assertions (gate ~ 2 * randn, up ~ randn) against the float64 reference, which
rounds at the same two points: bf16 outputs equal it on >= 99% of the elements, are
within 1 ulp on >= 99.9% and within 3 ulp everywhere (see ``_assert_close_to_f64``);
fp32 outputs within 32 ulp (the GPU's exp is approximate: ~2 ulp plus the rounding of
g * log2(e), which grows with |g|).
"""
import pytest
import torch

from areal_tik.unified_kernels import reference
from areal_tik.unified_kernels.swiglu import _forward, silu_candidates, silu_config, silu_mul

from ._bits import assert_bitwise, rel_err, ulp_distance

F64 = torch.float64
DTYPES = (torch.bfloat16, torch.float32)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def _gate_up(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    inter = shape[-1] // 2
    gate = 2 * torch.randn(*shape[:-1], inter, generator=g)
    up = torch.randn(*shape[:-1], inter, generator=g)
    return torch.cat([gate, up], -1).to(dtype).to(device)


def _assert_close_to_f64(out, ref64, what):
    """bf16: >= 99% of elements equal the float64 reference rounded, >= 99.9% within 1 ulp,
    all within 3 ulp (two rounding points: when the fp32 intermediate rounds to the
    neighbouring bf16 value, the second product can move by up to 2 ulp + its rounding).
    fp32: all within 32 ulp."""
    ulps = ulp_distance(out, ref64)
    if out.dtype != torch.bfloat16:
        assert ulps.max().item() <= 32, f"{what}: max {ulps.max().item()} fp32 ulp from float64"
        return
    assert ulps.max().item() <= 3, f"{what}: max {ulps.max().item()} bf16 ulp from float64"
    for limit, frac_min in ((0, 0.99), (1, 0.999)):
        frac = (ulps <= limit).double().mean().item()
        assert frac >= frac_min, f"{what}: only {frac:.5f} of elements within {limit} ulp"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17, 640), (3, 5, 2000), (1, 128), (6000,)])
def test_matches_float64(shape, dtype, device):
    gu = _gate_up(shape, dtype, device)
    out = silu_mul(gu)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    _assert_close_to_f64(out, reference.silu_mul(gu, compute=F64), f"silu_mul {shape}")


def test_extreme_gates(device):
    """exp(-g) overflows to inf for very negative gates: silu -> -0 (the exact value is
    below 1e-37), never NaN; very positive gates give g * up."""
    gate = torch.tensor([-200.0, -90.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 90.0, 200.0])
    gu = torch.cat([gate, torch.full_like(gate, 1.5)]).to(device)[None]
    out = silu_mul(gu)[0]
    ref = reference.silu_mul(gu, compute=F64)[0]
    assert torch.isfinite(out).all()
    assert out[:2].abs().max().item() < 1e-30
    _assert_close_to_f64(out[2:], ref[2:], "extreme gates")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-6)])
@pytest.mark.parametrize("shape", [(13, 640), (2, 3, 2000)])
def test_backward_matches_float64(shape, dtype, tol, device):
    gu = _gate_up(shape, dtype, device, seed=1)
    d_out = torch.randn(*shape[:-1], shape[-1] // 2, generator=torch.Generator().manual_seed(2))
    d_out = d_out.to(dtype).to(device)
    leaf = gu.clone().requires_grad_()
    silu_mul(leaf).backward(d_out)
    leaf64 = gu.to(F64).requires_grad_()
    reference.silu_mul(leaf64, compute=F64).backward(d_out.to(F64))
    assert leaf.grad.dtype == dtype and leaf.grad.shape == gu.shape
    inter = shape[-1] // 2
    for name, sl in (("gate", slice(None, inter)), ("up", slice(inter, None))):
        err = rel_err(leaf.grad[..., sl], leaf64.grad[..., sl])
        assert err < tol, f"d_{name}: {err}"
    again = gu.clone().requires_grad_()
    silu_mul(again).backward(d_out)
    assert_bitwise(again.grad, leaf.grad, "backward run to run")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance(dtype, device):
    n, width = 13, 2 * 1000  # I = 1000: one masked tail block per row
    rows = _gate_up((n, width), dtype, device, seed=3)
    full = silu_mul(rows)
    for size in range(1, n + 1):
        for start in range(0, n, size):
            assert_bitwise(silu_mul(rows[start : start + size]), full[start : start + size],
                           f"rows [{start}:{start + size}]")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(device)
    assert_bitwise(silu_mul(rows[perm]), full[perm], "shuffled")
    pad = torch.full((3, width), float("nan"), device=device).to(dtype)
    pad[1] = float("inf")
    out = silu_mul(torch.cat([rows[:4], pad, rows[4:]]))
    assert_bitwise(torch.cat([out[:4], out[7:]]), full, "between NaN/inf padding rows")
    # Leading dims and strided rows (a slice of a wider buffer) give the same bits.
    assert_bitwise(silu_mul(rows.view(1, n, width))[0], full, "3-D input")
    wide = torch.zeros(n, width + 24, dtype=dtype, device=device)
    wide[:, 8 : 8 + width] = rows
    assert_bitwise(silu_mul(wide[:, 8 : 8 + width]), full, "strided rows")


def _assert_candidates_equal_table(gu, what):
    """Every launch geometry gives the table's bits (the op is elementwise)."""
    want = _forward(gu)
    for cfg in silu_candidates(gu.shape[-1] // 2):
        assert_bitwise(_forward(gu, cfg), want, f"{what} {cfg.name}")
        assert_bitwise(_forward(gu[1:4], cfg), want[1:4], f"{what} {cfg.name} rows [1:4]")


def test_candidate_configs_equal_table(device):
    _assert_candidates_equal_table(_gate_up((5, 2 * 1000), torch.bfloat16, device, seed=5), "I=1000")
    assert silu_candidates(3072)[0] == silu_config(3072) and len(silu_candidates(3072)) == 5


def test_negative_control_unrounded_activation(device):
    """The bitwise check can fail: a fused variant that keeps silu(gate) in fp32 instead of
    rounding it to bf16 first (HF's rounding point) gives different bits."""
    gu = _gate_up((64, 640), torch.bfloat16, device, seed=4)
    gate, up = gu[:, :320].float(), gu[:, 320:].float()
    fused = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(fused, silu_mul(gu), "unrounded activation vs HF rounding points")


def test_bad_inputs(device):
    gu = _gate_up((4, 64), torch.bfloat16, device)
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        silu_mul(gu.half())
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        silu_mul(gu.to(torch.int32))
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        silu_mul(gu.tolist())
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(gu[:, :63])
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul(gu[0, 0])
    with pytest.raises(ValueError, match="gate_up must not be empty"):
        silu_mul(gu[:0])


# --------------------------------------------------------------------------------- GPU


def _contract_at_size(inter, n, dev, lengths):
    gu = _gate_up((n, 2 * inter), torch.bfloat16, dev, seed=inter)
    full = silu_mul(gu)
    _assert_close_to_f64(full, reference.silu_mul(gu, compute=F64), f"I={inter}")
    gen = torch.Generator().manual_seed(0)
    for t in lengths:
        start = int(torch.randint(0, n - t + 1, (1,), generator=gen))
        assert_bitwise(silu_mul(gu[start : start + t]), full[start : start + t], f"T={t} at {start}")
    perm = torch.randperm(n, generator=gen).to(dev)
    assert_bitwise(silu_mul(gu[perm]), full[perm], "shuffled")
    misaligned = torch.empty(n * 2 * inter + 1, dtype=gu.dtype, device=dev)[1:].view(n, 2 * inter)
    misaligned.copy_(gu)
    assert_bitwise(silu_mul(misaligned), full, "misaligned input")


def _fp32_and_backward_at_size(inter, n, dev):
    gu = _gate_up((n, 2 * inter), torch.float32, dev, seed=1)
    _assert_close_to_f64(silu_mul(gu), reference.silu_mul(gu, compute=F64), "fp32")
    gu16 = gu.to(torch.bfloat16)
    d_out = torch.randn(n, inter, generator=torch.Generator().manual_seed(2)).to(dev).to(torch.bfloat16)
    leaf = gu16.clone().requires_grad_()
    silu_mul(leaf).backward(d_out)
    leaf64 = gu16.to(F64).requires_grad_()
    reference.silu_mul(leaf64, compute=F64).backward(d_out.to(F64))
    assert rel_err(leaf.grad, leaf64.grad) < 5e-3


def test_gpu_checks_at_small_size(device):
    """The GPU tests' checks, at a size the interpreter runs quickly."""
    _contract_at_size(1000, 9, device, (1, 3, 8))
    _fp32_and_backward_at_size(320, 5, device)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [3072, 6144, 8192])
def test_gpu_real_sizes(inter):
    n = 16384
    _contract_at_size(inter, n, "cuda", (1, 3, 17, 256, 4096, n - 1))


@pytest.mark.gpu
def test_gpu_fp32_and_backward():
    _fp32_and_backward_at_size(3072, 4096, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [3072, 8192])
def test_gpu_candidate_configs_equal_table(inter):
    _assert_candidates_equal_table(_gate_up((4096, 2 * inter), torch.bfloat16, "cuda", seed=6), f"I={inter}")


@pytest.mark.gpu
def test_gpu_bad_inputs():
    """CUDA inputs take the launcher's fast validation; it must let nothing bad through."""
    test_bad_inputs("cuda")

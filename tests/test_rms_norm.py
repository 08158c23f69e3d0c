"""rms_norm / add_rms_norm: accuracy vs float64, backward, bitwise row invariance, bad input.

Accuracy assertions (O(1) random inputs) against the float64 reference, which rounds
at the same two points as the kernel: bf16 outputs equal it on >= 99% of the elements,
are within 1 ulp on >= 99.9% and within 3 ulp everywhere (see ``_assert_close_to_f64``);
fp32 outputs within 8 ulp. Only the fp32 rstd (vs exact) can move a result.
"""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from areal_tik.unified_kernels import reference
from areal_tik.unified_kernels.rms_norm import NormConfig, _forward, add_rms_norm, norm_candidates, rms_norm

from ._bits import assert_bitwise, rel_err, ulp_distance

# The module, for monkeypatching (``from package import rms_norm`` may name the module
# or the function, depending on import order).
rms_norm_mod = importlib.import_module("areal_tik.unified_kernels.rms_norm")
F64 = torch.float64
REPO = Path(__file__).resolve().parents[1]
# NaN/inf padding rows make the interpreter's numpy ops warn; those values are intended.
# The interpreter's tensor-valued loop bounds trip a numpy deprecation (numpy < 2.4 pinned).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning",
                                        "ignore:Conversion of an array with ndim:DeprecationWarning")
DTYPES = (torch.bfloat16, torch.float32)


def _inputs(shape, dtype, device, seed=0, residual=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device) if residual else None
    return x, w, r


def _assert_close_to_f64(out, ref64, what):
    """bf16: >= 99% of elements equal the float64 reference rounded, >= 99.9% within 1 ulp,
    all within 3 ulp (two rounding points: when the fp32 intermediate rounds to the
    neighbouring bf16 value, the second product can move by up to 2 ulp + its rounding).
    fp32: all within 8 ulp."""
    ulps = ulp_distance(out, ref64)
    if out.dtype != torch.bfloat16:
        assert ulps.max().item() <= 8, f"{what}: max {ulps.max().item()} fp32 ulp from float64"
        return
    assert ulps.max().item() <= 3, f"{what}: max {ulps.max().item()} bf16 ulp from float64"
    for limit, frac_min in ((0, 0.99), (1, 0.999)):
        frac = (ulps <= limit).double().mean().item()
        assert frac >= frac_min, f"{what}: only {frac:.5f} of elements within {limit} ulp"


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17, 320), (5, 1000), (3, 4, 128), (1, 8, 64), (64,)])
def test_rms_norm_matches_float64(shape, dtype, device):
    x, w, _ = _inputs(shape, dtype, device)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    _assert_close_to_f64(out, reference.rms_norm(x, w, 1e-6, compute=F64), f"rms_norm {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17, 320), (3, 1000), (3, 4, 128)])
def test_add_rms_norm_matches_float64(shape, dtype, device):
    x, w, r = _inputs(shape, dtype, device, residual=True)
    normed, summed = add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_summed = reference.add_rms_norm(x, r, w, 1e-5, compute=F64)
    assert_bitwise(summed, ref_summed, "summed is one rounding of x + residual")
    _assert_close_to_f64(normed, ref_normed, f"add_rms_norm {shape}")


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32),
                                             (torch.float32, torch.bfloat16)])
def test_mixed_weight_dtype(x_dtype, w_dtype, device):
    x, w, _ = _inputs((9, 320), x_dtype, device)
    w = w.to(w_dtype)
    out = rms_norm(x, w)
    assert out.dtype == x_dtype
    _assert_close_to_f64(out, reference.rms_norm(x, w, compute=F64), "mixed dtypes")


def test_per_head_form_equals_flat_rows(device):
    """Qwen3 q/k norm: [T, heads, head_dim] with weight [head_dim] is rms_norm of each head."""
    x, w, _ = _inputs((7, 6, 128), torch.bfloat16, device, seed=3)
    out = rms_norm(x, w)
    assert out.shape == (7, 6, 128)
    assert_bitwise(out, rms_norm(x.reshape(-1, 128), w).view(7, 6, 128), "per-head vs flat rows")
    # A strided view (q out of a fused qkv buffer) gives the same bits.
    qkv = torch.randn(7, 10 * 128, device=device).to(torch.bfloat16)
    qkv[:, : 6 * 128] = x.reshape(7, -1)
    assert_bitwise(rms_norm(qkv[:, : 6 * 128].view(7, 6, 128), w), out, "strided q view")


def test_chunked_path_matches_float64(device, monkeypatch):
    """Rows wider than _MAX_BLOCK are reduced in _CHUNK chunks (shrunk here to stay tiny)."""
    monkeypatch.setattr(rms_norm_mod, "_MAX_BLOCK", 128)
    monkeypatch.setattr(rms_norm_mod, "_CHUNK", 64)
    assert rms_norm_mod.norm_config(320).n_chunks == 5
    x, w, r = _inputs((6, 320), torch.bfloat16, device, residual=True)
    normed, summed = add_rms_norm(x, r, w)
    ref_normed, ref_summed = reference.add_rms_norm(x, r, w, compute=F64)
    assert_bitwise(summed, ref_summed, "chunked summed")
    _assert_close_to_f64(normed, ref_normed, "chunked normed")


# ----------------------------------------------------------------------------- backward


def _f64_grads(fn, tensors, grads_out):
    leaves = [t.detach().to(F64).requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [g.to(F64) for g in grads_out])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(13, 320), (3, 5, 128)])
def test_rms_norm_backward(shape, dtype, tol, device):
    x, w, _ = _inputs(shape, dtype, device, seed=1)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xg, wg, 1e-6).backward(dy)
    ref = _f64_grads(lambda a, b: reference.rms_norm(a, b, 1e-6, compute=F64), (x, w), (dy,))
    assert xg.grad.dtype == dtype and wg.grad.dtype == dtype
    assert rel_err(xg.grad, ref[0]) < tol, rel_err(xg.grad, ref[0])
    assert rel_err(wg.grad, ref[1]) < tol, rel_err(wg.grad, ref[1])


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("use", ["both", "normed", "summed"])
def test_add_rms_norm_backward(use, dtype, tol, device):
    x, w, r = _inputs((11, 320), dtype, device, seed=4, residual=True)
    gen = torch.Generator().manual_seed(5)
    dn, ds = (torch.randn(11, 320, generator=gen).to(dtype).to(device) for _ in range(2))
    if use == "normed":
        ds = torch.zeros_like(ds)
    if use == "summed":
        dn = torch.zeros_like(dn)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    normed, summed = add_rms_norm(*leaves[:2], leaves[2])
    outs, grads = {"both": ((normed, summed), (dn, ds)), "normed": ((normed,), (dn,)),
                   "summed": ((summed,), (ds,))}[use]
    torch.autograd.backward(outs, grads)
    ref = _f64_grads(lambda a, b, c: reference.add_rms_norm(a, b, c, compute=F64), (x, r, w), (dn, ds))
    for name, leaf, g in zip(("x", "residual", "weight"), leaves, ref):
        got = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        assert rel_err(got, g) < tol or g.abs().max() == 0, f"{name}: {rel_err(got, g)}"


def test_backward_chunked_and_deterministic(device, monkeypatch):
    x, w, _ = _inputs((9, 320), torch.float32, device, seed=6)
    dy = torch.randn(9, 320, generator=torch.Generator().manual_seed(7)).to(device)
    ref = _f64_grads(lambda a, b: reference.rms_norm(a, b, compute=F64), (x, w), (dy,))

    def grads():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        rms_norm(xg, wg).backward(dy)
        return xg.grad, wg.grad

    first, second = grads(), grads()
    assert_bitwise(first[0], second[0], "dx run to run")
    assert_bitwise(first[1], second[1], "dw run to run")
    monkeypatch.setattr(rms_norm_mod, "_MAX_BLOCK", 128)  # torch fallback for wide rows
    for got, want in zip(grads(), ref):
        assert rel_err(got, want) < 1e-5


# ----------------------------------------------------------------- bitwise row invariance


def _check_row_invariance(fn, rows, device, seed=0):
    """fn maps [N, ...] -> [N, ...]; rows' outputs must not depend on their batch."""
    n = rows.shape[0]
    full = fn(rows)
    for i in (0, n // 2, n - 1):
        assert_bitwise(fn(rows[i : i + 1])[0], full[i], f"row {i} alone")
    for size in range(1, n + 1):
        for start in range(0, n, size):
            assert_bitwise(fn(rows[start : start + size]), full[start : start + size],
                           f"batch [{start}:{start + size}]")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
    assert_bitwise(fn(rows[perm]), full[perm], "shuffled")
    pad = torch.full((5, *rows.shape[1:]), float("nan"), device=device).to(rows.dtype)
    pad[1] = float("inf")
    pad[2] = 3e38 if rows.dtype == torch.float32 else 1e38
    padded = torch.cat([pad[:3], rows[:4], pad[3:], rows[4:]])
    out = fn(padded)
    assert_bitwise(torch.cat([out[3:7], out[9:]]), full, "between NaN/inf/huge padding rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [320, 1000])
def test_rms_norm_row_invariance(hidden, dtype, device):
    x, w, _ = _inputs((17, hidden), dtype, device, seed=hidden)
    _check_row_invariance(lambda t: rms_norm(t, w), x, device)


@pytest.mark.parametrize("hidden", [128, 320])
def test_add_rms_norm_row_invariance(hidden, device):
    x, w, r = _inputs((9, hidden), torch.bfloat16, device, seed=hidden, residual=True)
    both = torch.stack([x, r], 1)  # [N, 2, H]: rows travel with their residual
    _check_row_invariance(lambda t: torch.stack(add_rms_norm(t[:, 0], t[:, 1], w), 1), both, device)


def test_per_head_row_invariance(device):
    x, w, _ = _inputs((17, 3, 64), torch.bfloat16, device, seed=11)
    _check_row_invariance(lambda t: rms_norm(t, w), x, device)


def test_layout_invariance(device):
    """Strided, misaligned and non-contiguous inputs give the bits of contiguous ones."""
    x, w, _ = _inputs((9, 320), torch.bfloat16, device, seed=12)
    want = rms_norm(x, w)
    buf = torch.zeros(9 * 333 + 1, device=device, dtype=x.dtype)
    misaligned = buf[1 : 1 + 9 * 320].view(9, 320)
    misaligned.copy_(x)
    wide = torch.zeros(9, 400, device=device, dtype=x.dtype)
    wide[:, 8:328] = x
    assert_bitwise(rms_norm(misaligned, w), want, "misaligned base pointer")
    assert_bitwise(rms_norm(wide[:, 8:328], w), want, "row stride 400")
    assert_bitwise(rms_norm(x.t().contiguous().t(), w), want, "column-major")


def test_autograd_and_inference_paths_agree(device):
    x, w, r = _inputs((5, 320), torch.bfloat16, device, seed=13, residual=True)
    with torch.no_grad():
        want = add_rms_norm(x, r, w)
    got = add_rms_norm(x.clone().requires_grad_(), r, w)
    assert_bitwise(got[0], want[0], "normed")
    assert_bitwise(got[1], want[1], "summed")


def test_negative_control_other_chunking_changes_bits(device):
    """The bitwise check can fail: reducing in chunks of 256 instead of one block of 1024
    changes some rows' bits. A kernel whose chunking followed the row count would be caught.
    (fp32 output: in bf16 the rstd's last-bit change rarely survives the rounding.)"""
    x, w, _ = _inputs((64, 1000), torch.float32, device, seed=14)
    one_block, _ = _forward(x, None, w, 1e-6)
    chunked, _ = _forward(x, None, w, 1e-6, NormConfig(256, 4, 1, 4))
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(chunked, one_block, "chunks of 256 vs one block")
    _assert_close_to_f64(chunked, reference.rms_norm(x, w, compute=F64), "chunked is still accurate")


def _config_contract(cfg, x, r, w, lengths, shifts, what):
    """One launch geometry: row slices at any offset (every row slot of a multi-row
    program included) and shuffled rows reproduce the bits of the full batch."""
    n = x.shape[0]
    full_n, full_s = _forward(x, r, w, 1e-6, cfg)
    plain, _ = _forward(x, None, w, 1e-6, cfg)
    gen = torch.Generator().manual_seed(cfg.rows)
    for t in lengths:
        start = int(torch.randint(0, n - t + 1, (1,), generator=gen))
        got_n, got_s = _forward(x[start : start + t], r[start : start + t], w, 1e-6, cfg)
        assert_bitwise(got_n, full_n[start : start + t], f"{what} {cfg.name} T={t} at {start}")
        assert_bitwise(got_s, full_s[start : start + t], f"{what} {cfg.name} summed T={t}")
    for shift in shifts:
        got, _ = _forward(x[shift:], None, w, 1e-6, cfg)
        assert_bitwise(got, plain[shift:], f"{what} {cfg.name} shift {shift}")
    perm = torch.randperm(n, generator=gen).to(x.device)
    assert_bitwise(_forward(x[perm], None, w, 1e-6, cfg)[0], plain[perm], f"{what} {cfg.name} shuffled")
    return plain


@pytest.mark.parametrize("hidden", [64, 320])
def test_candidate_configs_row_invariant(hidden, device):
    """Every geometry the benchmark sweep may pick is row-invariant on its own, with row
    counts that leave multi-row programs partly masked."""
    n = 3 * max(c.rows for c in norm_candidates(hidden)) // 2 + 1
    x, w, r = _inputs((n, hidden), torch.bfloat16, device, seed=21, residual=True)
    want = reference.rms_norm(x, w, compute=F64)
    for cfg in norm_candidates(hidden):
        shifts = sorted({1, cfg.rows - 1, cfg.rows, cfg.rows + 1} - {0})
        plain = _config_contract(cfg, x, r, w, (1, 3, n // 2), shifts, f"H={hidden}")
        _assert_close_to_f64(plain, want, f"H={hidden} {cfg.name}")


def test_candidate_list():
    """The table's geometry comes first; all candidates keep one block per row."""
    for hidden in (64, 128, 1000, 1024, 2048, 4096, 8192):
        cands = norm_candidates(hidden)
        assert cands[0] == rms_norm_mod.norm_config(hidden) and len(set(cands)) == len(cands)
        assert all(c.block == cands[0].block and c.n_chunks == 1 for c in cands)
    assert rms_norm_mod.norm_config(1024) == NormConfig(1024, 1, 4, 4)


def test_aot_table_keeps_row_layout():
    """Without a GPU: compiled for sm_90a, every norm table geometry reduces a row with the
    lanes and warps of the first GPU run's geometry (so no output bit moved), and no
    table kernel of the three ops spills (``python3 -m eval.bench_pointwise --aot --check``)."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "eval.bench_pointwise", "--aot", "--check"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------------- bad input


def test_bad_inputs(device):
    x, w, r = _inputs((4, 64), torch.bfloat16, device, residual=True)
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.to(torch.float16), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm(x.tolist(), w)
    with pytest.raises(TypeError, match="weight must have dtype"):
        rms_norm(x, w.to(torch.int32))
    with pytest.raises(ValueError, match="rank >= 1"):
        rms_norm(x[0, 0], w[:1])
    with pytest.raises(ValueError, match=r"weight must have shape \[64\]"):
        rms_norm(x, w[:32])
    with pytest.raises(ValueError, match="weight must have rank"):
        rms_norm(x, w[None])
    with pytest.raises(ValueError, match="x must not be empty"):
        rms_norm(x[:0], w)
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            rms_norm(x, w, eps)
    with pytest.raises(TypeError, match="eps must be a float"):
        rms_norm(x, w, None)
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm(x, r[:3], w)
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm(x, r.float(), w)


# --------------------------------------------------------------------------------- GPU


def _contract_at_size(hidden, n, dev, lengths):
    """Accuracy vs float64 and bitwise invariance of n rows against slices of them."""
    x, w, r = _inputs((n, hidden), torch.bfloat16, dev, seed=hidden, residual=True)
    x[n // 3] = float("nan")  # a NaN row must not leak into others
    normed, summed = add_rms_norm(x, r, w)
    ref_normed, ref_summed = reference.add_rms_norm(x, r, w, compute=F64)
    ok = torch.ones(n, dtype=torch.bool, device=dev)
    ok[n // 3] = False
    assert_bitwise(summed[ok], ref_summed[ok], "summed")
    _assert_close_to_f64(normed[ok], ref_normed[ok], f"H={hidden}")
    plain = rms_norm(x, w)
    gen = torch.Generator().manual_seed(0)
    for t in lengths:
        start = int(torch.randint(0, n - t + 1, (1,), generator=gen))
        sl = slice(start, start + t)
        got_n, got_s = add_rms_norm(x[sl], r[sl], w)
        assert_bitwise(got_n, normed[sl], f"add_rms_norm T={t} at {start}")
        assert_bitwise(got_s, summed[sl], f"summed T={t} at {start}")
        assert_bitwise(rms_norm(x[sl], w), plain[sl], f"rms_norm T={t} at {start}")
    perm = torch.randperm(n, generator=gen).to(dev)
    assert_bitwise(rms_norm(x[perm], w), plain[perm], "shuffled")
    # Every row offset within a multi-row program (rows at slots 0..ROWS-1).
    for shift in range(1, rms_norm_mod.norm_config(hidden).rows + 2):
        assert_bitwise(rms_norm(x[shift : shift + 300], w), plain[shift : shift + 300], f"shift {shift}")
    misaligned = torch.empty(n * hidden + 3, device=dev, dtype=x.dtype)[3:].view(n, hidden)
    misaligned.copy_(x)
    assert_bitwise(rms_norm(misaligned, w), plain, "misaligned input")
    if hidden == 128:
        assert_bitwise(rms_norm(x.view(-1, 8, 128), w), plain.view(-1, 8, 128), "per-head form")


def test_contract_at_small_size(device):
    """The GPU test's checks, at a size the interpreter runs quickly."""
    _contract_at_size(128, 48, device, (1, 3, 17, 47))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 1024, 2048, 4096])
def test_gpu_real_sizes(hidden):
    """Real sizes: accuracy vs float64 and bitwise invariance across T = 1 .. 16384."""
    n = 16384 if hidden > 128 else 16384 * 8  # per-head form: T * 8 heads rows of 128
    _contract_at_size(hidden, n, "cuda", (1, 2, 3, 17, 64, 255, 256, 1000, 4096, n - 1))


def _backward_at_size(hidden, n, dev):
    x, w, r = _inputs((n, hidden), torch.bfloat16, dev, seed=hidden, residual=True)
    gen = torch.Generator().manual_seed(1)
    dn, ds = (torch.randn(n, hidden, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    torch.autograd.backward(add_rms_norm(*leaves[:2], leaves[2]), (dn, ds))
    ref = _f64_grads(lambda a, b, c: reference.add_rms_norm(a, b, c, compute=F64), (x, r, w), (dn, ds))
    for name, leaf, g in zip(("x", "residual", "weight"), leaves, ref):
        assert rel_err(leaf.grad, g) < 5e-3, f"d{name}: {rel_err(leaf.grad, g)}"
    again = [t.clone().requires_grad_() for t in (x, r, w)]
    torch.autograd.backward(add_rms_norm(*again[:2], again[2]), (dn, ds))
    for a, b in zip(leaves, again):
        assert_bitwise(a.grad, b.grad, "backward run to run")


def test_backward_at_small_size(device):
    _backward_at_size(320, 24, device)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 1024, 4096])
def test_gpu_backward(hidden):
    _backward_at_size(hidden, 16384, "cuda")


@pytest.mark.gpu
def test_gpu_negative_control():
    x, w, _ = _inputs((4096, 4096), torch.float32, "cuda", seed=2)
    one_block, _ = _forward(x, None, w, 1e-6)
    chunked, _ = _forward(x, None, w, 1e-6, NormConfig(1024, 4, 1, 8))
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(chunked, one_block, "chunks of 1024 vs one block")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 1024, 2048, 4096])
def test_gpu_candidate_configs(hidden):
    """Each geometry the sweep times (the table's included) is row-invariant at real
    sizes, every row slot of its multi-row programs included, and accurate."""
    n = 4096 if hidden > 128 else 4096 * 16  # per-head form: T * 16 heads rows of 128
    x, w, r = _inputs((n, hidden), torch.bfloat16, "cuda", seed=hidden + 1, residual=True)
    want = reference.rms_norm(x, w, compute=F64)
    for cfg in norm_candidates(hidden):
        plain = _config_contract(cfg, x, r, w, (1, 2, 3, 17, 255, 1000, n - 1),
                                 range(1, cfg.rows + 2), f"H={hidden}")
        _assert_close_to_f64(plain, want, f"H={hidden} {cfg.name}")


@pytest.mark.gpu
def test_gpu_bad_inputs():
    """CUDA inputs take the launchers' fast validation; it must let nothing bad through."""
    test_bad_inputs("cuda")
    x, w, r = _inputs((4, 64), torch.bfloat16, "cuda", residual=True)
    with pytest.raises(ValueError, match="must share one device|must be on a CUDA device"):
        rms_norm(x, w.cpu())
    with pytest.raises(ValueError, match="must share one device|must be on a CUDA device"):
        add_rms_norm(x, r.cpu(), w)
    with pytest.raises(TypeError, match="eps must be a float"):
        rms_norm(x, w, True)

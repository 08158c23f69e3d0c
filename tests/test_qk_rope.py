"""qk_norm_rope: one launch with the bits of rms_norm (per head), apply_rope and store_kv_cache
in sequence (``qk_rope.compose(UNIFIED_OPS, ...)``, the reference), on q/k/v as views of a fused q|k|v output
(rollout) and as contiguous tensors; the composition under autograd and for layouts the
fused kernel does not take; its launch keys do not follow the token count; bad input."""
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from areal_tik import unified_kernels as U

from ._bits import assert_bitwise

Q = importlib.import_module("areal_tik.unified_kernels.qk_rope")
BF16 = torch.bfloat16


def _inputs(t, hq, hk, d, device, *, fused_view=True, norm=True, dtype=BF16, seed=0, max_pos=64, block=4):
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hk) * d
    if fused_view:
        qkv = torch.randn(t, width, generator=g).to(dtype).to(device)
        q, k, v = (qkv[:, a * d:b * d].view(t, b - a, d) for a, b in ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk)))
    else:
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(device) for h in (hq, hk, hk))
    w = [(1 + torch.randn(d, generator=g) / 4).to(dtype).to(device) for _ in range(2)] if norm else [None, None]
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    cos, sin = U.rope_cos_sin(max_pos, d, 10000.0, device=device)
    blocks = -(-t // block) + 2
    slots = torch.randperm(blocks * block, generator=g)[:t]
    slots[::3] = -1  # skipped tokens (padding)
    return q, k, v, w, pos, cos, sin, slots.to(device), (blocks, block, hk, d)


def _both(t, hq, hk, d, device, store=True, **kw):
    """(fused outputs, composed outputs): q, k and, with ``store``, both caches."""
    q, k, v, (qw, kw_), pos, cos, sin, slots, cache_shape = _inputs(t, hq, hk, d, device, **kw)
    out = []
    for fn in (Q.qk_norm_rope, None):
        caches = [torch.full(cache_shape, 7.0, dtype=q.dtype, device=device) for _ in range(2)]
        cache = dict(v=v, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots) if store else {}
        if fn is None:
            res = Q.compose(Q.UNIFIED_OPS, q, k, pos, cos, sin, qw, kw_, 1e-6, **cache)
        else:
            res = fn(q, k, pos, cos, sin, qw, kw_, 1e-6, **cache)
        out.append([*res, *(caches if store else [])])
    assert Q.fused_ok(q, k, qw, kw_, v)
    return out


@pytest.mark.parametrize("t", [1, 3, 9, 40])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("fused_view", [True, False])
def test_fused_equals_the_composition(device, t, norm, fused_view):
    fused, composed = _both(t, 4, 2, 16, device, norm=norm, fused_view=fused_view)
    for name, a, b in zip(("q", "k", "k_cache", "v_cache"), fused, composed):
        assert_bitwise(a, b, f"{name} t={t}")


def test_fused_without_a_cache_and_in_fp32(device):
    fused, composed = _both(5, 4, 2, 32, device, store=False, dtype=torch.float32)
    for name, a, b in zip(("q", "k"), fused, composed):
        assert_bitwise(a, b, name)


def test_the_cache_write_skips_slot_minus_one_and_writes_the_rotated_k(device):
    q, k, v, (qw, kw_), pos, cos, sin, slots, cache_shape = _inputs(6, 4, 2, 16, device)
    kc, vc = (torch.full(cache_shape, 7.0, dtype=BF16, device=device) for _ in range(2))
    _, k_out = Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    written = set()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            written.add(s)
            assert_bitwise(flat_k[s], k_out[i], f"k row {i}")
            assert_bitwise(flat_v[s], v[i], f"v row {i}")
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert untouched and bool((flat_k[untouched] == 7.0).all()) and bool((flat_v[untouched] == 7.0).all())


def test_row_invariance_one_token_equals_its_row_in_a_batch(device):
    q, k, v, (qw, kw_), pos, cos, sin, _, _ = _inputs(9, 4, 2, 16, device)
    full = Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6)
    for i in (0, 4, 8):
        one = Q.qk_norm_rope(q[i:i + 1], k[i:i + 1], pos[i:i + 1], cos, sin, qw, kw_, 1e-6)
        for a, b in zip(one, full):
            assert_bitwise(a[0], b[i], f"row {i}")


def test_autograd_and_other_layouts_take_the_composition(device):
    q, k, v, (qw, kw_), pos, cos, sin, _, _ = _inputs(3, 4, 2, 16, device, fused_view=False)
    assert Q.fused_ok(q, k, qw, kw_)
    qg = q.clone().requires_grad_()
    assert not Q.fused_ok(qg, k, qw, kw_)
    out_q, _ = Q.qk_norm_rope(qg, k, pos, cos, sin, qw, kw_, 1e-6)
    out_q.float().sum().backward()
    assert qg.grad is not None and qg.grad.shape == q.shape
    odd = torch.zeros(3, 4 * 16 + 8, dtype=BF16, device=device)[:, 8:].view(3, 4, 16).copy_(q)  # stride 72
    assert not Q.fused_ok(odd, k, qw, kw_)
    for a, b in zip(Q.qk_norm_rope(odd, k, pos, cos, sin, qw, kw_, 1e-6),
                    Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6)):
        assert_bitwise(a, b, "strided input")


def test_bad_input(device):
    q, k, v, (qw, kw_), pos, cos, sin, slots, cache_shape = _inputs(3, 4, 2, 16, device)
    kc = torch.zeros(cache_shape, dtype=BF16, device=device)
    with pytest.raises(ValueError, match="together"):
        Q.qk_norm_rope(q, k, pos, cos, sin, qw, None, 1e-6)
    with pytest.raises(ValueError, match="together"):
        Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6, v=v, k_cache=kc)
    with pytest.raises(ValueError, match="head_dim|must be"):
        Q.qk_norm_rope(q, k[..., :8], pos, cos, sin)
    with pytest.raises(ValueError, match="slot_mapping"):
        Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6, v=v, k_cache=kc, v_cache=kc, slot_mapping=slots[:2])


def _reductions(*args):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(pathlib.Path(__file__).parents[1]))
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("_layout_probe.py")), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_sm90_row_reduction_has_the_per_head_norms_layout():
    """Compiled for sm_90a on the CPU with the engine's specialisation (tests/_layout_probe.py):
    the fused kernel's q and k row reductions have exactly the register layout of rms_norm's
    per-head kernel (the same elements per thread, lanes and warps along each row: the same
    order of additions), for head_dim 128 and 64; one row a program (a negative control)
    has another."""
    for heads, found in _reductions().items():
        assert len(found["fused"]) == 2 and found["norm_q"] == found["norm_k"], (heads, found)
        assert found["fused"] == found["norm_q"] * 2, (heads, found)
    for heads, found in _reductions("rows=1").items():
        assert found["fused"][0] != found["norm_q"][0], (heads, found)


# ------------------------------------------------------------------------------------- GPU

# (q heads, kv heads, head_dim, q/k norm): Qwen3-0.6B / 1.7B, Qwen3-4B / 8B, Qwen2.5-1.5B, Llama-3.2-1B,
# Llama-3.2-3B, SmolLM2-135M.
REAL = [(16, 8, 128, True), (32, 8, 128, True), (12, 2, 128, False), (32, 8, 64, False), (24, 8, 128, False),
        (9, 3, 64, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d,norm", REAL)
def test_gpu_fused_equals_the_composition_at_real_sizes(hq, hk, d, norm):
    for t in (1, 2, 17, 64, 257, 2048):
        for fused_view in (True, False):
            fused, composed = _both(t, hq, hk, d, "cuda", norm=norm, fused_view=fused_view, max_pos=4096, block=16,
                                    seed=t)
            for name, a, b in zip(("q", "k", "k_cache", "v_cache"), fused, composed):
                assert_bitwise(a, b, f"{name} {hq}/{hk}/{d} t={t} view={fused_view}")


@pytest.mark.gpu
def test_gpu_out_of_range_positions_poison_only_their_token_as_the_composition_does():
    q, k, v, (qw, kw_), pos, cos, sin, _, _ = _inputs(4, 16, 8, 128, "cuda", max_pos=64)
    pos[2] = 64
    fused = Q.qk_norm_rope(q, k, pos, cos, sin, qw, kw_, 1e-6)
    composed = Q.compose(Q.UNIFIED_OPS, q, k, pos, cos, sin, qw, kw_, 1e-6)
    for a, b in zip(fused, composed):
        assert bool(a[2].isnan().all()) and bool(a[[0, 1, 3]].isfinite().all())
        assert_bitwise(a[[0, 1, 3]], b[[0, 1, 3]], "finite rows")

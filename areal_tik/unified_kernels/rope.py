"""Rotary position embedding, neox / rotate-half layout (Hugging Face Llama, Qwen2/3).

Tables: ``rope_cos_sin`` is the one builder of the cos/sin tables for every regime:
angles ``position * inv_freq`` and their cos/sin in float64 (``reference.rope_inv_freq``,
including Llama-3 ``rope_scaling``), cast once to fp32, ``[max_positions, head_dim // 2]``.
They are built on the CPU and copied, so every device gets the same bits.

Rotation (``reference.apply_rope``), per token t, head h and pair i < D/2, with
``c, s = cos[pos_t, i], sin[pos_t, i]`` and fp32 math, one rounding to the input dtype::

    out[i]         = x[i] * c - x[i + D/2] * s      computed as fma(x[i], c, -(x[i + D/2] * s))
    out[i + D/2]   = x[i + D/2] * c + x[i] * s      computed as fma(x[i + D/2], c, x[i] * s)

The fma is written out so that the compiler has no contraction choice left: a row's bits
are then the same whatever the tensor's strides or alignment (which change the compiled
specialisation). The op is elementwise per token, so any grid gives the same bits; one
program handles one token (its cos/sin row is loaded once for all q and k heads).

Positions must lie in ``[0, max_positions)``. CPU positions are checked on the host
(ValueError); for CUDA positions a check would synchronise on every call, so instead the
kernel never reads outside the tables and writes NaN for a token whose position is out
of range, and ``check_positions`` (one sync) is there for callers that want the error:
positions are shared by all layers, so checking them once per forward is cheap.

Backward: the transposed rotation, i.e. the same kernel with ``-sin``. Outputs are new
contiguous tensors (out of place).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_positive_float, check_same_device, check_tensor, interpreting
from ._rounding import cast_rne
from .reference import rope_inv_freq

# Kernels round with integer ops under the interpreter (see _rounding.py).
_EMULATE_RNE = interpreting()

_POSITION_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rotate_heads(
    x_ptr,  # [NH, 2 * HALF] one token's heads (head stride stride_h, unit column stride)
    stride_h,
    o_ptr,  # [NH, 2 * HALF] contiguous output for the same token
    c,  # [BLOCK_HALF] fp32 cos row
    s,  # [BLOCK_HALF] fp32 sin row (negated for backward)
    NH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)  # head-major views: h * stride_h > 2^31
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NH) & (i < HALF)
    lo = x_ptr + h * stride_h + i
    x_lo = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    c = c[None, :]
    s = s[None, :]
    out_lo = tl.fma(x_lo, c, -(x_hi * s))
    out_hi = tl.fma(x_hi, c, x_lo * s)
    o = o_ptr + h * (2 * HALF) + i
    tl.store(o, cast_rne(out_lo, o_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
    tl.store(o + HALF, cast_rne(out_hi, o_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, HQ, D] queries (strides stride_qt, stride_qh, 1)
    k_ptr,  # [T, HK, D] keys (strides stride_kt, stride_kh, 1)
    qo_ptr,  # [T, HQ, D] contiguous rotated queries
    ko_ptr,  # [T, HK, D] contiguous rotated keys
    pos_ptr,  # [T] int32/int64 absolute positions
    cos_ptr,  # [max_pos, HALF] fp32
    sin_ptr,  # [max_pos, HALF] fp32
    max_pos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    # Grid: one program per token (the grid covers the tokens exactly); no reduction.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    # Out-of-range positions: no table read; NaN cos/sin poison the token's outputs.
    ok = (i < HALF) & (pos >= 0) & (pos < max_pos)
    c = tl.load(cos_ptr + pos * HALF + i, mask=ok, other=float("nan"))
    s = tl.load(sin_ptr + pos * HALF + i, mask=ok, other=float("nan"))
    if BACKWARD:
        s = -s
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * (HQ * 2 * HALF), c, s,
                  HQ, HALF, BLOCK_HQ, BLOCK_HALF, EMULATE_RNE)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, ko_ptr + t * (HK * 2 * HALF), c, s,
                  HK, HALF, BLOCK_HK, BLOCK_HALF, EMULATE_RNE)


# ---------------------------------------------------------------------------- launchers


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, positions, cos, sin, backward: bool):
    """Rotate q [T, HQ, D] and k [T, HK, D]; returns new contiguous tensors."""
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    n_tokens, hq, d = q.shape
    hk = k.shape[1]
    half = d // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    # 4 warps: a token is at most a few thousand elements (e.g. 16 x 128 + 8 x 128).
    _rope_kernel[(n_tokens,)](
        q, k, q_out, k_out, positions, cos.contiguous(), sin.contiguous(),
        cos.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HQ=hq, HK=hk, HALF=half, BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(half),
        BACKWARD=backward, EMULATE_RNE=_EMULATE_RNE, num_warps=4,
    )
    return q_out, k_out


# ----------------------------------------------------------------------------- autograd


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return _launch(q, k, positions, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        positions, cos, sin = ctx.saved_tensors
        dq_in, dk_in = _launch(dq, dk, positions, cos, sin, backward=True)
        return dq_in, dk_in, None, None, None


# --------------------------------------------------------------------------- functional


def rope_cos_sin(max_positions: int, head_dim: int, base: float = 10000.0, scaling=None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each fp32 ``[max_positions, head_dim // 2]``, computed in float64.

    ``scaling``: None or a Hugging Face ``rope_scaling`` dict (``"default"`` or ``"llama3"``).
    """
    for name, value in (("max_positions", max_positions), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    base = check_positive_float("base", base)
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a rope_scaling dict, got {scaling!r}")
    inv_freq = rope_inv_freq(head_dim, base, scaling)  # float64 [head_dim // 2]
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    return cos.to(device), sin.to(device)


def check_positions(positions: torch.Tensor, max_positions: int) -> None:
    """Raise ValueError if any position is outside ``[0, max_positions)`` (syncs on CUDA)."""
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_positions:
        bad = lo if lo < 0 else hi
        raise ValueError(f"positions must lie in [0, {max_positions}), got {bad}")


def _check(q, k, positions, cos, sin) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("positions", positions, dtypes=_POSITION_DTYPES, ndim=1)
    check_tensor("cos", cos, dtypes=(torch.float32,), ndim=2)
    check_tensor("sin", sin, dtypes=(torch.float32,), ndim=2)
    check_same_device(q=q, k=k, positions=positions, cos=cos, sin=sin)
    n_tokens, _, d = q.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got q of shape {tuple(q.shape)}")
    if k.dtype != q.dtype or k.shape[0] != n_tokens or k.shape[2] != d:
        raise ValueError(f"k must be [{n_tokens}, Hk, {d}] of dtype {q.dtype}, "
                         f"got {k.dtype} {tuple(k.shape)}")
    if positions.shape[0] != n_tokens:
        raise ValueError(f"positions must have shape [{n_tokens}], got {tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != d // 2:
        raise ValueError(f"cos and sin must both be [max_positions, {d // 2}], "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions.device.type == "cpu":  # free to check here; CUDA: see module docstring
        check_positions(positions, cos.shape[0])


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` by their tokens' ``positions [T]``.

    ``cos``/``sin`` come from ``rope_cos_sin``. Returns new tensors ``(q_out, k_out)``.
    """
    _check(q, k, positions, cos, sin)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RopeFn.apply(q, k, positions, cos, sin)
    return _launch(q, k, positions, cos, sin, backward=False)


__all__ = ["rope_cos_sin", "apply_rope", "check_positions"]

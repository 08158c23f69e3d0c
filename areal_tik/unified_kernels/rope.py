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
program handles all q and k heads of a few tokens (``rope_config``, a function of the
head layout only), loading each token's cos/sin row once.

Positions must lie in ``[0, max_positions)``. CPU positions are checked on the host
(ValueError); for CUDA positions a check would synchronise on every call, so instead the
kernel never reads outside the tables and writes NaN for a token whose position is out
of range, and ``check_positions`` (one sync) is there for callers that want the error:
positions are shared by all layers, so checking them once per forward is cheap.

Backward: the transposed rotation, i.e. the same kernel with ``-sin``. Outputs are new
contiguous tensors (out of place).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_positive_float, check_same_device, check_tensor, interpreting
from ._rounding import cast_rne
from ._pdl import pdl, pdl_wait
from .reference import rope_inv_freq

# Kernels round with integer ops under the interpreter (see _rounding.py).
_EMULATE_RNE = interpreting()

_POSITION_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------ launch geometry


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    tokens: int  # tokens per program (a power of two)
    num_warps: int

    @property
    def name(self) -> str:
        return f"t{self.tokens}/w{self.num_warps}"


# Launch geometry per head layout (never per token count): a program rotates all q and
# k heads of TOKENS tokens. With one token per program and 4 warps, the k tile of
# Qwen3 (8 x 64 pairs) or Llama-3.2 (8 x 32) gives a thread only 2-4 values, so its
# loads are 4-8 bytes wide (sm_90 PTX: ld.global.v2); TOKENS is the smallest power of
# two that gives every thread at least one 16-byte vector of bf16 in the k tile (Qwen3:
# 2 tokens, 24 KiB moved per program; Llama-3.2: 4 tokens, 40 KiB). The op is elementwise
# with an explicit fma, so the geometry cannot change a bit (the GPU tests compare every
# candidate with the table's); ``eval/bench_pointwise.py --sweep`` times the candidates.
_MIN_K_ELEMS_PER_PROGRAM = 8 * 32 * 4
_MAX_TOKENS = 8
_CONFIGS: dict[tuple[int, int, int], RopeConfig] = {}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rope_config(hq: int, hk: int, head_dim: int) -> RopeConfig:
    """Launch geometry for ``hq`` query heads, ``hk`` key heads of ``head_dim``."""
    key = (hq, hk, head_dim)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        k_elems = _pow2(hk) * _pow2(head_dim // 2)
        tokens = min(_MAX_TOKENS, max(1, _MIN_K_ELEMS_PER_PROGRAM // k_elems))
        cfg = _CONFIGS[key] = RopeConfig(_pow2(tokens), 4)
    return cfg


def rope_candidates(hq: int, hk: int, head_dim: int) -> list[RopeConfig]:
    """The table's geometry first, then the alternatives the benchmark sweep times."""
    out = [rope_config(hq, hk, head_dim)]
    for tokens, warps in ((1, 4), (1, 2), (2, 4), (4, 4), (4, 8), (8, 8)):
        cfg = RopeConfig(tokens, warps)
        if cfg not in out and len(out) < 5:
            out.append(cfg)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, NH, 2 * HALF] heads (strides stride_t, stride_h, 1)
    stride_t,
    stride_h,
    o_ptr,  # [T, NH, 2 * HALF] contiguous output
    t,  # [TOKENS, 1, 1] int64 token indices
    t_ok,  # [TOKENS, 1, 1] token < T
    c,  # [TOKENS, 1, BLOCK_HALF] fp32 cos rows
    s,  # [TOKENS, 1, BLOCK_HALF] fp32 sin rows (negated for backward)
    NH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[None, :, None].to(tl.int64)  # head-major views: h * stride_h > 2^31
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = t_ok & (h < NH) & (i < HALF)
    lo = x_ptr + t * stride_t + h * stride_h + i
    x_lo = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    out_lo = tl.fma(x_lo, c, -(x_hi * s))
    out_hi = tl.fma(x_hi, c, x_lo * s)
    o = o_ptr + t * (NH * 2 * HALF) + h * (2 * HALF) + i
    tl.store(o, cast_rne(out_lo, o_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
    tl.store(o + HALF, cast_rne(out_hi, o_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


# n_tokens is data; max_pos (the table's rows) is only a bounds check: neither is
# specialised, so one kernel serves every token count and table (warm-up uses any table).
@triton.jit(do_not_specialize=["n_tokens", "max_pos"])
def _rope_kernel(
    q_ptr,  # [T, HQ, D] queries (strides stride_qt, stride_qh, 1)
    k_ptr,  # [T, HK, D] keys (strides stride_kt, stride_kh, 1)
    qo_ptr,  # [T, HQ, D] contiguous rotated queries
    ko_ptr,  # [T, HK, D] contiguous rotated keys
    pos_ptr,  # [T] int32/int64 absolute positions
    cos_ptr,  # [max_pos, HALF] fp32
    sin_ptr,  # [max_pos, HALF] fp32
    n_tokens,
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
    TOKENS: tl.constexpr,
    BACKWARD: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid: one program per TOKENS consecutive tokens (tokens past T are masked); no
    # reduction. Each token's cos/sin row is loaded once for all its q and k heads.
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < n_tokens
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    # Out-of-range positions: no table read; NaN cos/sin poison the token's outputs.
    ok = ((pos >= 0) & (pos < max_pos))[:, None] & (i < HALF)
    c = tl.load(cos_ptr + pos[:, None] * HALF + i, mask=ok, other=float("nan"))[:, None, :]
    s = tl.load(sin_ptr + pos[:, None] * HALF + i, mask=ok, other=float("nan"))[:, None, :]
    if BACKWARD:
        s = -s
    t = t[:, None, None]
    t_ok = t_ok[:, None, None]
    _rotate_heads(q_ptr, stride_qt, stride_qh, qo_ptr, t, t_ok, c, s, HQ, HALF, BLOCK_HQ, BLOCK_HALF,
                  EMULATE_RNE)
    _rotate_heads(k_ptr, stride_kt, stride_kh, ko_ptr, t, t_ok, c, s, HK, HALF, BLOCK_HK, BLOCK_HALF,
                  EMULATE_RNE)


# ---------------------------------------------------------------------------- launchers


def _launch(q, k, positions, cos, sin, backward: bool, config: RopeConfig | None = None):
    """Rotate q [T, HQ, D] and k [T, HK, D]; returns new contiguous tensors."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    n_tokens, hq, d = q.shape
    hk = k.shape[1]
    cfg = config or rope_config(hq, hk, d)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    p = pdl(q)
    _rope_kernel[((n_tokens + cfg.tokens - 1) // cfg.tokens,)](
        q, k, q_out, k_out, positions, cos, sin, n_tokens, cos.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=_pow2(hq), BLOCK_HK=_pow2(hk), BLOCK_HALF=_pow2(d // 2),
        TOKENS=cfg.tokens, BACKWARD=backward, EMULATE_RNE=_EMULATE_RNE, PDL=p, num_warps=cfg.num_warps,
        launch_pdl=p,
    )
    return q_out, k_out


# ----------------------------------------------------------------------------- autograd


class _RopeFunction(torch.autograd.Function):
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


def _valid_cuda_call(q, k, positions, cos, sin) -> bool:
    """A cheap test that implies every check of ``_check`` for CUDA tensors (the common
    case skips the generic validators; anything else takes them and gets their message)."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(positions, tensor)
            and isinstance(cos, tensor) and isinstance(sin, tensor) and q.is_cuda and k.is_cuda
            and positions.is_cuda and cos.is_cuda and sin.is_cuda):
        return False
    dev = q.get_device()
    if not (k.get_device() == dev and positions.get_device() == dev and cos.get_device() == dev
            and sin.get_device() == dev and q.dim() == 3 and k.dim() == 3 and positions.dim() == 1
            and cos.dim() == 2):
        return False
    n_tokens, _, d = q.shape
    return (q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and positions.dtype in _POSITION_DTYPES
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and q.numel() > 0
            and k.numel() > 0 and d % 2 == 0 and k.shape[0] == n_tokens and k.shape[2] == d
            and positions.shape[0] == n_tokens and cos.shape == sin.shape and cos.shape[0] > 0
            and cos.shape[1] == d // 2)


def _check(q, k, positions, cos, sin) -> None:
    if _valid_cuda_call(q, k, positions, cos, sin):
        return
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
        return _RopeFunction.apply(q, k, positions, cos, sin)
    return _launch(q, k, positions, cos, sin, backward=False)


__all__ = ["rope_cos_sin", "apply_rope", "check_positions"]

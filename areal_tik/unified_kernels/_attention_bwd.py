"""Attention backward for the packed varlen (training) path: FlashAttention-2 style.

Recomputes p = exp2(s * qk_scale - lse) from the forward's saved log-sum-exp (log2
units) and delta = rowsum(dO * O) (one small kernel, which also zeroes the padding rows
of dQ, dK, dV), then runs two deterministic kernels, no atomics:
  - dK/dV: one program per (KV head, key tile, sequence); it loops over the query heads
    of its group and over the query tiles at or after the key tile, accumulating in fp32
    registers in a fixed order;
  - dQ: one program per (query head, query tile, sequence) looping over key tiles 0..diag.
Gradients carry no bitwise contract (only accuracy vs float64 and determinism), so the
tiling below is free to differ from the forward's.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._attention_fwd import EMULATE, LOG2E, _dot, _precision, cdiv
from ._rounding import cast_rne


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    block_m1: int  # dK/dV: query rows per step
    block_n1: int  # dK/dV: keys per program
    block_m2: int  # dQ: query rows per program
    block_n2: int  # dQ: keys per step
    num_warps1: int = 8
    num_stages1: int = 2
    num_warps2: int = 8
    num_stages2: int = 3


# H200, D=128 (ptxas -v for sm_90a): dK/dV with 64-row steps over 128-key tiles and 8 warps
# holds k, v, dk, dv in 255 registers with 108 B of spills (32/128 with 4 warps, the
# usual fp16 choice, spills 1.4 KB); dQ with 128 x 64 tiles and 8 warps needs 230
# registers, no spills. eval/probe_attention.py times alternatives on the GPU.
GPU_BWD_CONFIG = BwdConfig(block_m1=64, block_n1=128, block_m2=128, block_n2=64,
                           num_warps1=8, num_stages1=2, num_warps2=8, num_stages2=3)
INTERP_BWD_CONFIG = BwdConfig(block_m1=16, block_n1=32, block_m2=32, block_n2=16,
                              num_warps1=4, num_stages1=1, num_warps2=4, num_stages2=1)


def attention_bwd_config() -> BwdConfig:
    return INTERP_BWD_CONFIG if EMULATE else GPU_BWD_CONFIG


# The token and sequence counts and the LSE / delta row stride (= T) follow the packing:
# kept out of Triton's key (they bound loops and offset addresses only).
@triton.jit(do_not_specialize=["num_seqs", "num_rows", "stride_delta_h"])
def _bwd_delta_kernel(
    o_ptr, do_ptr,  # [T, Hq, D]
    delta_ptr,  # [Hq, T] fp32
    dq_ptr,  # [T, Hq, D]
    dk_ptr, dv_ptr,  # [T, Hk, D]
    cu_ptr,  # [S + 1] int32
    num_seqs, num_rows, num_kv_heads,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_delta_h,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # Grid (cdiv(T, BLOCK_T), Hq): delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] in fp32
    # (one tl.sum per row, fixed order), and zeros for the gradient rows past cu[S]
    # (the main kernels write every row of every sequence, nothing else).
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    ok = rows < num_rows
    o = tl.load(o_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(do_ptr + rows[:, None] * stride_dot + h * stride_doh + d[None, :], mask=ok[:, None],
                 other=0.0)
    tl.store(delta_ptr + h * stride_delta_h + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)
    pad = (ok & (rows >= tl.load(cu_ptr + num_seqs)))[:, None]
    zero = tl.zeros([BLOCK_T, HEAD_DIM], dq_ptr.dtype.element_ty)
    tl.store(dq_ptr + rows[:, None] * stride_dqt + h * stride_dqh + d[None, :], zero, mask=pad)
    if h < num_kv_heads:
        tl.store(dk_ptr + rows[:, None] * stride_dkt + h * stride_dkh + d[None, :], zero, mask=pad)
        tl.store(dv_ptr + rows[:, None] * stride_dvt + h * stride_dvh + d[None, :], zero, mask=pad)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_h, do_h, lse_h, delta_h, m0, keys, seqlen, qk_scale,
               stride_qt, stride_dot, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
               DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate one query tile's contribution to dK, dV [BN, D] of a key tile."""
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    rows = m0 + r
    row_ok = rows < seqlen
    row0 = tl.cast(m0, tl.int64)
    qT = tl.load(q_h + row0 * stride_qt + r[None, :] * stride_qt + d[:, None],
                 mask=row_ok[None, :], other=0.0)  # [D, BM]
    do = tl.load(do_h + row0 * stride_dot + r[:, None] * stride_dot + d[None, :],
                 mask=row_ok[:, None], other=0.0)  # [BM, D]
    lse = tl.load(lse_h + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_h + rows, mask=row_ok, other=0.0)
    sT = _dot(k, qT, None, DOT_FP32, PRECISION)
    pT = tl.math.exp2(sT * qk_scale - lse[None, :])
    pT = tl.where((rows[None, :] >= keys[:, None]) & row_ok[None, :], pT, 0.0)
    dv = _dot(cast_rne(pT, do.dtype, DOT_FP32), do, dv, DOT_FP32, PRECISION)
    dpT = _dot(v, tl.trans(do), None, DOT_FP32, PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dk = _dot(cast_rne(dsT, qT.dtype, DOT_FP32), tl.trans(qT), dk, DOT_FP32, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["stride_lse_h"])
def _bwd_dkdv_kernel(
    q_ptr, do_ptr,  # [T, Hq, D]
    k_ptr, v_ptr,  # [T, Hk, D]
    dk_ptr, dv_ptr,  # [T, Hk, D]
    lse_ptr, delta_ptr,  # [Hq, T] fp32
    cu_ptr,  # [S + 1] int32
    qk_scale, sm_scale, num_kv_heads, group,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid (Hk * S, n_key_tiles); key tile 0 has the most work and is launched first.
    kvh = tl.program_id(0) % num_kv_heads
    seq = tl.program_id(0) // num_kv_heads
    n0 = tl.program_id(1) * BLOCK_N
    start = tl.load(cu_ptr + seq)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    if n0 >= seqlen:
        return
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    keys = n0 + n
    key_ok = keys < seqlen
    key_t = (start + keys).to(tl.int64)
    k = tl.load(k_ptr + key_t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + key_t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # One masked loop over the query tiles at or after the key tile. Splitting off the
    # unmasked tiles into a second loop was measured worse on sm_90 (ptxas spills 416 B
    # vs 108 B at 64/128/8 warps), and the mask is a select per score.
    for g in range(0, group):
        h = tl.cast(kvh * group + g, tl.int64)
        q_h = q_ptr + start.to(tl.int64) * stride_qt + h * stride_qh
        do_h = do_ptr + start.to(tl.int64) * stride_dot + h * stride_doh
        lse_h = lse_ptr + h * stride_lse_h + start
        delta_h = delta_ptr + h * stride_lse_h + start
        for m0 in range(n0, seqlen, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_h, do_h, lse_h, delta_h, m0, keys, seqlen,
                                qk_scale, stride_qt, stride_dot,
                                BLOCK_M, HEAD_DIM, DOT_FP32, PRECISION)
    dk = dk * sm_scale
    tl.store(dk_ptr + key_t[:, None] * stride_dkt + kvh * stride_dkh + d[None, :],
             cast_rne(dk, dk_ptr.dtype.element_ty, DOT_FP32), mask=key_ok[:, None])
    tl.store(dv_ptr + key_t[:, None] * stride_dvt + kvh * stride_dvh + d[None, :],
             cast_rne(dv, dv_ptr.dtype.element_ty, DOT_FP32), mask=key_ok[:, None])


@triton.jit
def _dq_step(dq, q, do, lse, delta, rows, k_h, v_h, n0, seqlen, qk_scale, stride_kt, stride_vt,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate one key tile's contribution to dQ [BM, D] of a query tile."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    keys = n0 + n
    key_ok = keys < seqlen
    col0 = tl.cast(n0, tl.int64)
    kT = tl.load(k_h + col0 * stride_kt + n[None, :] * stride_kt + d[:, None],
                 mask=key_ok[None, :], other=0.0)  # [D, BN]
    vT = tl.load(v_h + col0 * stride_vt + n[None, :] * stride_vt + d[:, None],
                 mask=key_ok[None, :], other=0.0)  # [D, BN]
    s = _dot(q, kT, None, DOT_FP32, PRECISION)
    p = tl.math.exp2(s * qk_scale - lse[:, None])
    p = tl.where((rows[:, None] >= keys[None, :]) & key_ok[None, :], p, 0.0)
    dp = _dot(do, vT, None, DOT_FP32, PRECISION)
    ds = p * (dp - delta[:, None])
    return _dot(cast_rne(ds, kT.dtype, DOT_FP32), tl.trans(kT), dq, DOT_FP32, PRECISION)


@triton.jit(do_not_specialize=["stride_lse_h"])
def _bwd_dq_kernel(
    q_ptr, do_ptr, dq_ptr,  # [T, Hq, D]
    k_ptr, v_ptr,  # [T, Hk, D]
    lse_ptr, delta_ptr,  # [Hq, T] fp32
    cu_ptr,  # [S + 1] int32
    qk_scale, sm_scale, num_q_heads, group,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_lse_h,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid (Hq * S, n_query_tiles), longest query tiles first.
    head = tl.program_id(0) % num_q_heads
    seq = tl.program_id(0) // num_q_heads
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    start = tl.load(cu_ptr + seq)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    if m0 >= seqlen:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen
    d = tl.arange(0, HEAD_DIM)
    row_t = (start + rows).to(tl.int64)
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + row_t[:, None] * stride_dot + head * stride_doh + d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + head * stride_lse_h + start + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head * stride_lse_h + start + rows, mask=row_ok, other=0.0)
    kvh = (head // group).to(tl.int64)
    k_h = k_ptr + start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_h = v_ptr + start.to(tl.int64) * stride_vt + kvh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # One masked loop over key tiles 0 .. diagonal: with a separate unmasked loop ptxas
    # serializes the wgmma pipeline (warning C7515 on sm_90).
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, rows, k_h, v_h, n0, seqlen, qk_scale,
                      stride_kt, stride_vt, BLOCK_N, HEAD_DIM, DOT_FP32, PRECISION)
    dq = dq * sm_scale
    tl.store(dq_ptr + row_t[:, None] * stride_dqt + head * stride_dqh + d[None, :],
             cast_rne(dq, dq_ptr.dtype.element_ty, DOT_FP32), mask=row_ok[:, None])


def attention_backward(dout, q, k, v, out, lse, cu, num_seqs, max_seqlen, softmax_scale,
                       config: BwdConfig):
    """(dq, dk, dv) of the causal varlen attention; rows past the last sequence get zeros.
    Three launches (delta, dK/dV, dQ), grids from shapes and ``max_seqlen``, no host reads."""
    T, hq, dim = q.shape
    hk = k.shape[1]
    if num_seqs == 0 or max_seqlen == 0 or T == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty((hq, T), dtype=torch.float32, device=q.device)  # like lse
    common = dict(HEAD_DIM=dim, DOT_FP32=EMULATE, PRECISION=_precision(q.dtype))
    qk_scale = softmax_scale * LOG2E
    block_t = 64 if dim <= 64 else 32
    _bwd_delta_kernel[(cdiv(T, block_t), hq)](
        out, dout, delta, dq, dk, dv, cu, num_seqs, T, hk,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), delta.stride(0),
        HEAD_DIM=dim, BLOCK_T=block_t, num_warps=4,
    )
    _bwd_dkdv_kernel[(hk * num_seqs, cdiv(max_seqlen, config.block_n1))](
        q, dout, k, v, dk, dv, lse, delta, cu,
        qk_scale, softmax_scale, hk, hq // hk,
        q.stride(0), q.stride(1), dout.stride(0), dout.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0),
        BLOCK_M=config.block_m1, BLOCK_N=config.block_n1, **common,
        num_warps=config.num_warps1, num_stages=config.num_stages1,
    )
    _bwd_dq_kernel[(hq * num_seqs, cdiv(max_seqlen, config.block_m2))](
        q, dout, dq, k, v, lse, delta, cu,
        qk_scale, softmax_scale, hq, hq // hk,
        q.stride(0), q.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), lse.stride(0),
        BLOCK_M=config.block_m2, BLOCK_N=config.block_n2, **common,
        num_warps=config.num_warps2, num_stages=config.num_stages2,
    )
    return dq, dk, dv

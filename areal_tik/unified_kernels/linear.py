"""Unified linear layer: ``y = x @ weight.T + bias`` with row-invariant bits.

Numerics (fixed, identical for every row count): each output element accumulates in
fp32 over K blocks 0, 1, 2, ... of a fixed BLOCK_K per dtype, always in the form
``acc = tl.dot(a, b, acc)``; no split-K; the bias is added in fp32 after the loop and
the result is rounded once to ``x.dtype``. bf16 operands go to the tensor cores as bf16
(wgmma on Hopper); fp32 operands use ``input_precision="ieee"`` (exact fp32 FMAs, never
TF32). Under the Triton interpreter the operands and accumulator are upcast to fp64 for
``tl.dot`` (its bf16 dot is wrong, and numpy's fp32 matmul changes its summation order
with the block shape; in fp64 a block's sum of bf16 products is exact), then the
accumulator is rounded back to fp32 after each block.

Launch geometry varies with the row count, numerics do not: a small table of row-count
buckets picks BLOCK_M / BLOCK_N / num_warps / num_stages (tiny tiles that stream the
weight at bandwidth for decode, 128x256 tiles for large prefill and training). An
element's bits depend only on BLOCK_K, the K-loop order and the MMA instruction family,
so every GPU bf16 config shares BLOCK_K and is wgmma-eligible (BLOCK_M a multiple of 64,
num_warps a multiple of 4). The GPU contract test (tests/test_linear.py, ``-m gpu``)
proves this bucket invariance; ``AREAL_TIK_LINEAR_FIXED_TILE=1`` (or setting
``FIXED_TILE = True`` on this module) forces one config for every row count.

Layout: x's leading dims are flattened with ``reshape`` (a copy only when they cannot be
merged); the 2-D view's strides, and the weight's strides, go to the kernel, so a
non-contiguous x or a transposed weight view needs no copy. The output is contiguous.

Backward uses torch matmuls in fp32 (dX = dY @ W, dW = dY^T @ X, db = dY.sum(0)), cast
to the input dtypes; it inherits torch's global TF32 setting for fp32 matmuls (off by
default).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_same_device, check_tensor, interpreting

# When True, one config per dtype serves every row count (see module docstring).
FIXED_TILE = os.environ.get("AREAL_TIK_LINEAR_FIXED_TILE", "0") == "1"


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # rows of tiles per L2 group in the program order


# Row-count buckets: ((max_rows, config), ...); the last bucket has max_rows None.
# BLOCK_K is fixed per dtype (it sets the numerics); the rest is geometry only.
# bf16 on GPU (H200): <=64 rows the weight read bounds the time, so narrow tiles give
# N/32 programs with deep pipelines; large M uses 128x256x64 tiles (3 stages = 144 KiB
# shared memory), the usual best shape for wgmma on Hopper. Compiled offline for sm_90a
# (triton 3.6), every bf16 config here and in _GPU_CANDIDATES lowers to
# wgmma.m64nNk16.f32.bf16.bf16 (4 per BLOCK_K=64 step), cp.async loads, no spills.
_GPU_BUCKETS = {
    torch.bfloat16: (
        (64, TileConfig(64, 32, 64, num_warps=4, num_stages=6)),
        (256, TileConfig(64, 128, 64, num_warps=4, num_stages=4)),
        (1024, TileConfig(128, 128, 64, num_warps=8, num_stages=4)),
        (None, TileConfig(128, 256, 64, num_warps=8, num_stages=3)),
    ),
    # fp32 runs exact FMAs (no tensor cores): modest tiles, no speed target.
    torch.float32: (
        (64, TileConfig(64, 32, 32, num_warps=4, num_stages=3)),
        (None, TileConfig(64, 64, 32, num_warps=4, num_stages=3)),
    ),
}
_GPU_FIXED = {
    torch.bfloat16: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
    torch.float32: TileConfig(64, 64, 32, num_warps=4, num_stages=3),
}
# Further geometries with the same BLOCK_K: the GPU contract test proves them bit-equal
# to the table above and eval/bench_linear.py --sweep times them, so re-tuning the
# table is a measured, invariance-safe edit.
_GPU_CANDIDATES = {
    torch.bfloat16: tuple(TileConfig(bm, bn, 64, num_warps=w, num_stages=s) for bm, bn, w, s in (
        (64, 16, 4, 6), (64, 32, 4, 4), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 3),
        (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 4, 4), (128, 256, 8, 2), (256, 128, 8, 3),
    )),
    torch.float32: tuple(TileConfig(bm, bn, 32, num_warps=w, num_stages=s) for bm, bn, w, s in (
        (32, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3),
    )),
}
# Interpreter: tiny tiles (a 128^3 interpreted matmul takes ~0.3 s) and small thresholds
# so that tiny CPU tests cross a geometry change as the GPU buckets do.
_CPU_TABLE = (
    (4, TileConfig(16, 16, 16)),
    (32, TileConfig(16, 32, 16)),
    (None, TileConfig(32, 32, 16)),
)
_CPU_BUCKETS = {torch.bfloat16: _CPU_TABLE, torch.float32: _CPU_TABLE}
_CPU_FIXED = {torch.bfloat16: TileConfig(16, 16, 16), torch.float32: TileConfig(16, 16, 16)}


def buckets(dtype: torch.dtype) -> tuple:
    """The ((max_rows, TileConfig), ...) table used for ``dtype`` in this process."""
    return (_CPU_BUCKETS if interpreting() else _GPU_BUCKETS)[dtype]


def geometry_variants(dtype: torch.dtype, candidates: bool = True) -> tuple:
    """Every config that must give identical bits for ``dtype``: table, fixed, candidates."""
    if interpreting():
        configs = [cfg for _, cfg in _CPU_BUCKETS[dtype]] + [_CPU_FIXED[dtype]]
    else:
        configs = [cfg for _, cfg in _GPU_BUCKETS[dtype]] + [_GPU_FIXED[dtype]]
        configs += list(_GPU_CANDIDATES[dtype]) if candidates else []
    return tuple(dict.fromkeys(configs))


def select_config(rows: int, dtype: torch.dtype) -> TileConfig:
    """Launch config for ``rows`` rows: the row-count bucket, or the fixed tile."""
    if FIXED_TILE:
        return (_CPU_FIXED if interpreting() else _GPU_FIXED)[dtype]
    for max_rows, config in buckets(dtype):
        if max_rows is None or rows <= max_rows:
            return config
    raise AssertionError("bucket table must end with max_rows=None")


def _launch_metadata(grid, metadata, args):
    m, n, k = args["M"], args["N"], args["K"]
    size = args["x_ptr"].element_size()
    return {
        "name": f"unified_linear [M={m}, N={n}, K={k}]",
        "flops": 2 * m * n * k,
        "bytes": size * (m * k + n * k + m * n),
    }


@triton.jit
def _bf16_rtne(x):
    # fp32 -> bf16, round to nearest even, by bit arithmetic: the interpreter's cast
    # truncates (GPUs round to nearest even in hardware).
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)  # NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit(launch_metadata=_launch_metadata)
def _linear_fwd_kernel(
    x_ptr,  # [M, K] activations, strides (stride_xm, stride_xk)
    w_ptr,  # [N, K] weight, strides (stride_wn, stride_wk)
    b_ptr,  # [N] contiguous bias (unused when HAS_BIAS is False)
    out_ptr,  # [M, N] contiguous output, x.dtype
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask needed (same values loaded)
    MASK_ROWS: tl.constexpr,  # M < BLOCK_M (decode): skip reading the missing rows
    INTERPRET: tl.constexpr,  # CPU interpreter: its bf16 dot is wrong; dot in fp64
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (ignored for bf16)
):
    # Grid: one program per BLOCK_M x BLOCK_N output tile, 1-D, in L2-grouped order
    # (GROUP_M tile rows share each weight tile while it is hot). Order does not matter
    # for numerics: every output element is computed by exactly one program.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/cols are wrapped onto valid ones so the operand loads need no
    # M/N mask; they only feed outputs that are never stored (rows never mix in a dot).
    # With MASK_ROWS the missing rows read zeros instead: at M=1 in a 64x32 tile a K
    # block would otherwise copy 8 KiB of repeated x rows next to 4 KiB of weight.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn

    # Reduction: K blocks 0, 1, 2, ... in order, fp32 accumulator, never split.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K and not MASK_ROWS:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if INTERPRET:
            # fp64 makes each block's sum of bf16 products exact, so the result does
            # not depend on the summation order numpy's matmul picks per block shape.
            acc64 = tl.dot(a.to(tl.float64), b.to(tl.float64), acc.to(tl.float64), out_dtype=tl.float64)
            acc = acc64.to(tl.float32)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        out = _bf16_rtne(acc)
    else:
        out = acc.to(out_ptr.dtype.element_ty)  # one rounding (RTNE) to the output dtype
    tl.store(out_ptrs, out, mask=mask)


def linear_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   config: TileConfig | None = None) -> torch.Tensor:
    """Launch the forward kernel on validated 2-D ``x2d [M, K]``; returns ``[M, N]``.

    ``config`` overrides the bucket choice (benchmarks and tests only: a different
    BLOCK_K changes the numerics).
    """
    M, K = x2d.shape
    N = weight.shape[0]
    cfg = config if config is not None else select_config(M, x2d.dtype)
    out = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if bias is not None:
        bias = bias.contiguous()
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _linear_fwd_kernel[grid](
        x2d, weight, bias if bias is not None else out, out,
        M, N, K,
        x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        EVEN_K=K % cfg.block_k == 0,
        MASK_ROWS=M < cfg.block_m,
        INTERPRET=interpreting(),
        DOT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x2d, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        # No bitwise requirement on gradients; fp32 torch matmuls, deterministic.
        x2d, weight = ctx.saved_tensors
        dy = grad_out.float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ weight.float()).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy.t() @ x2d.float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0).to(weight.dtype)
        return dx, dw, db


def _validate(x, weight, bias) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have rank >= 1 ([..., K]), got shape {tuple(x.shape)}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype must equal x dtype {x.dtype}, got {weight.dtype}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype must equal x dtype {x.dtype}, got {bias.dtype}")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp32 accumulation in a fixed K order, rounded once.

    x ``[..., K]`` (bf16 or fp32), weight ``[N, K]`` and bias ``[N]`` of the same dtype;
    returns ``[..., N]`` in ``x.dtype``. Each row's bits depend only on that row.
    """
    _validate(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        out = _LinearFunction.apply(x2d, weight, bias)
    else:
        out = linear_forward(x2d, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])

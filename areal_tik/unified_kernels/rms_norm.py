"""RMSNorm and fused residual-add + RMSNorm, as Hugging Face Llama/Qwen compute them.

Semantics (``reference.rms_norm`` / ``reference.add_rms_norm``), per row of width H::

    rstd   = 1 / sqrt(sum(x.float() ** 2) / H + eps)      fp32, IEEE sqrt and division
    normed = (x.float() * rstd).to(x.dtype)                first rounding
    out    = (normed.float() * weight.float()).to(x.dtype) second rounding
    add_rms_norm: summed = (x.float() + residual.float()).to(x.dtype); out = rms_norm(summed)

The same function is the per-head form (Qwen3 q/k norm): x ``[T, heads, head_dim]`` with
weight ``[head_dim]``; every head of every token is one row.

Reduction order (the numerical contract): a row's sum of squares is ``tl.sum`` over one
zero-padded block of ``next_power_of_2(H)`` columns, or, for rows wider than
``_MAX_BLOCK``, an elementwise fp32 accumulation over chunks of ``_CHUNK`` columns taken
in order from column 0, summed with ``tl.sum`` at the end. Block, chunking, rows per
program and num_warps are functions of H only (``norm_config``). Two more things would
change which thread adds which element, so both are pinned: the row count is not a
compile-time specialisation (``do_not_specialize``), and the launcher hands the kernel
contiguous rows at a 16-byte aligned address (copying other layouts), so Triton's
alignment specialisation, which sets the load vector width and with it the register
layout that ``tl.sum`` reduces, is the same for every call with this H.

Backward (no bitwise requirement, deterministic): one kernel walks a fixed, contiguous
range of rows per program and writes that program's fp32 partial dW; torch sums the
partials over programs (a reduction without atomics). Rows wider than ``_MAX_BLOCK``
use the same formulas in torch fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, check_positive_float, check_same_device, check_tensor, interpreting,
                      on_fast_device)
from ._rounding import cast_rne
from ._pdl import pdl, pdl_wait

# Kernels round with integer ops under the interpreter (see _rounding.py).
_EMULATE_RNE = interpreting()

# Widest row reduced as one register block: 16384 fp32 over 16 warps is 32 values per
# thread, still without spills; wider rows (no current LLM) take the chunked path.
_MAX_BLOCK = 16384
_CHUNK = 4096
# Launch geometry per width (``norm_config``): a program takes ROWS rows of one block of
# next_power_of_2(H) columns, 4096 elements for rows up to 2048 wide: 32 values (four
# 16-byte bf16 loads) in flight per thread with 4 warps, 8 KiB read per program, so q/k
# norm rows (H = 64..128) fill a program 32-64 at a time instead of launching T * heads
# programs of 256 bytes. Triton lays a [ROWS, block] tile out with 8 contiguous bf16 per
# thread, up to 32 lanes and min(num_warps, block / 256) warps along the row and the
# other warps across rows: with 4 warps every row is reduced by the same lanes and warps
# in the same order as with the earlier 2048-element programs (identical sm_90 TTGIR
# layouts per row, bf16 and fp32, with and without residual), so no bit should move;
# ``eval/bench_pointwise.py --sweep`` times ``norm_candidates`` and checks their bits.
# Rows of 4096 and more keep one row per program with 512 columns per warp.
_ELEMS_PER_PROGRAM = 4096
_BWD_ELEMS_PER_BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class NormConfig:
    block: int  # columns per chunk, a power of two
    n_chunks: int  # chunks per row: block * n_chunks >= H
    rows: int  # rows per program (a power of two)
    num_warps: int

    @property
    def name(self) -> str:
        chunks = f"/c{self.n_chunks}" if self.n_chunks > 1 else ""
        return f"r{self.rows}/w{self.num_warps}{chunks}"


_CONFIGS: dict[tuple[int, int, int], NormConfig] = {}


def norm_config(hidden: int) -> NormConfig:
    """Launch geometry for rows of width ``hidden``: a function of the width only."""
    key = (hidden, _MAX_BLOCK, _CHUNK)  # the limits are module constants (tests shrink them)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = _make_config(*key)
    return cfg


def _make_config(hidden: int, max_block: int, chunk: int) -> NormConfig:
    block = triton.next_power_of_2(hidden)
    if block > max_block:
        return NormConfig(chunk, triton.cdiv(hidden, chunk), 1, 16)
    rows = max(1, _ELEMS_PER_PROGRAM // block)
    return NormConfig(block, 1, rows, min(16, max(4, block // 512)))


def norm_candidates(hidden: int) -> list[NormConfig]:
    """The table's geometry first, then the alternatives the benchmark sweep times: 2, 4
    or 8 K elements per program at 16 or 32 per thread. Each is row-invariant on its own
    (the GPU tests check every one); they differ in speed, and those that put another
    number of warps on a row also in the bits they produce."""
    table = norm_config(hidden)
    out = [table]
    if table.n_chunks > 1:
        return out
    for elems in (2048, 4096, 8192):
        for per_thread in (32, 16):
            rows, warps = elems // table.block, elems // (32 * per_thread)
            cfg = NormConfig(table.block, 1, rows, warps)
            if rows >= 1 and 4 <= warps <= 16 and cfg not in out:
                out.append(cfg)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_row_block(x_ptr, r_ptr, s_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr,
                    STORE_SUM: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 values of x (or of x + residual rounded to x's dtype, stored if STORE_SUM)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = cast_rne(x + r, s_ptr.dtype.element_ty, EMULATE_RNE)
        if STORE_SUM:
            tl.store(s_ptr + offs, s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _load_weight(w_ptr, cols, H: tl.constexpr):
    return tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)


@triton.jit
def _scale_store(x, rstd, w, y_ptr, offs, mask, EMULATE_RNE: tl.constexpr):
    """y = ((x * rstd) rounded to y's dtype) * w (fp32 weight values), rounded again."""
    normed = cast_rne(x * rstd[:, None], y_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    tl.store(y_ptr + offs, cast_rne(normed * w[None, :], y_ptr.dtype.element_ty, EMULATE_RNE),
             mask=mask)


@triton.jit
def _rstd(sum_sq, eps, H: tl.constexpr):
    """1 / sqrt(sum_sq / H + eps) with IEEE division and square root."""
    mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, H, tl.float32))
    return tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    x_ptr,  # [n_rows, H] input rows, contiguous, 16-byte aligned
    r_ptr,  # [n_rows, H] residual (same dtype as x); read only if HAS_RESIDUAL
    w_ptr,  # [H] weight
    y_ptr,  # [n_rows, H] normed output (x's dtype)
    s_ptr,  # [n_rows, H] summed output x + residual; written only if HAS_RESIDUAL
    n_rows,
    eps,
    stride_t,  # HEADS > 0: x's token stride (row r is head r % HEADS of token r // HEADS)
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    HEADS: tl.constexpr = 0,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid: one program per ROWS consecutive rows; rows are independent (rows past
    # n_rows are masked: they read zeros and store nothing). Reduction: see module doc.
    # HEADS > 0 (the per-head form, no residual, one chunk): x is [T, HEADS, H] with unit
    # head stride H and any token stride (q or k inside a fused q|k|v output); y is
    # contiguous. Only the load address changes, never the rows' reduction.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = (rows < n_rows)[:, None]
    cols = tl.arange(0, BLOCK)
    if N_CHUNKS == 1:
        # The weight is loaded before the rows, not after their reduction: at decode sizes the
        # kernel is latency-bound, and the load no longer waits behind the reduction's barrier.
        w = _load_weight(w_ptr, cols, H)
        offs = rows[:, None] * H + cols[None, :]
        mask = row_mask & (cols < H)[None, :]
        if HEADS > 0:
            x_offs = ((rows // HEADS) * stride_t + (rows % HEADS) * H)[:, None] + cols[None, :]
            x = _load_row_block(x_ptr, r_ptr, s_ptr, x_offs, mask, False, False, EMULATE_RNE)
        else:
            x = _load_row_block(x_ptr, r_ptr, s_ptr, offs, mask, HAS_RESIDUAL, True, EMULATE_RNE)
        rstd = _rstd(tl.sum(x * x, axis=1), eps, H)
        _scale_store(x, rstd, w, y_ptr, offs, mask, EMULATE_RNE)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c in tl.static_range(N_CHUNKS):  # chunk c: columns [c * BLOCK, (c + 1) * BLOCK)
            offs = rows[:, None] * H + (c * BLOCK + cols)[None, :]
            mask = row_mask & (c * BLOCK + cols < H)[None, :]
            x = _load_row_block(x_ptr, r_ptr, s_ptr, offs, mask, HAS_RESIDUAL, False, EMULATE_RNE)
            acc += x * x
        rstd = _rstd(tl.sum(acc, axis=1), eps, H)
        for c in tl.static_range(N_CHUNKS):  # x + residual recomputed: the same bits
            offs = rows[:, None] * H + (c * BLOCK + cols)[None, :]
            mask = row_mask & (c * BLOCK + cols < H)[None, :]
            x = _load_row_block(x_ptr, r_ptr, s_ptr, offs, mask, HAS_RESIDUAL, True, EMULATE_RNE)
            _scale_store(x, rstd, _load_weight(w_ptr + c * BLOCK, cols, H - c * BLOCK), y_ptr, offs, mask,
                         EMULATE_RNE)


@triton.jit(do_not_specialize=["n_rows", "rows_per_prog"])
def _rms_norm_bwd_kernel(
    x_ptr,  # [n_rows, H] the normalised input (x, or the rounded x + residual)
    dy_ptr,  # [n_rows, H] gradient of the normed output
    ds_ptr,  # [n_rows, H] gradient of the summed output; read only if HAS_DSUM
    w_ptr,  # [H] weight
    dx_ptr,  # [n_rows, H] gradient wrt x (equal to the gradient wrt residual)
    dw_ptr,  # [n_programs, H] fp32 partial weight gradients, one row per program
    n_rows,
    rows_per_prog,  # a multiple of ROWS
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_DSUM: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    # Grid: program p walks rows [p * rows_per_prog, (p + 1) * rows_per_prog) in blocks
    # of ROWS, in order, and accumulates its dW partial in registers (no atomics).
    # With n = x * rstd, dn = dy * w:  dx = rstd * (dn - n * mean(dn * n)),  dw = sum dy * n.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = (cols < H)[None, :]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    for r0 in range(start, tl.minimum(start + rows_per_prog, n_rows), ROWS):
        rows = r0 + tl.arange(0, ROWS)
        offs = rows[:, None] * H + cols[None, :]
        mask = (rows < n_rows)[:, None] & col_mask
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=1), eps, H)[:, None]
        n = x * rstd
        dn = dy * w
        c = tl.sum(dn * n, axis=1)[:, None] / H
        dx = rstd * (dn - n * c)
        if HAS_DSUM:
            dx += tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, cast_rne(dx, dx_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
        dw += dy * n
    tl.store(dw_ptr + pid.to(tl.int64) * H + cols, tl.sum(dw, axis=0), mask=cols < H)


# ---------------------------------------------------------------------------- launchers


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t`` as contiguous, 16-byte aligned ``[rows, hidden]`` (a copy only if it is not)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, hidden)
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.clone(memory_format=torch.contiguous_format)  # fresh, aligned storage
    return t2


def _forward(x, residual, weight, eps, config: NormConfig | None = None):
    """Launch the forward kernel; returns (normed, summed or None) shaped like x.

    Host work per call is kept to views, alignment checks and the output allocations:
    at decode sizes the call's cost is its Python and launch overhead.
    """
    hidden = x.shape[-1]
    cfg = config or norm_config(hidden)
    if x.dim() == 3 and residual is None and cfg.n_chunks == 1:
        return _forward_heads(x, weight, eps, cfg), None
    x2 = _rows(x, hidden)
    r2 = _rows(residual, hidden) if residual is not None else x2
    w = weight if weight.is_contiguous() and weight.data_ptr() % 16 == 0 else _rows(weight, hidden)
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if residual is not None else y
    n_rows = x2.shape[0]
    p = pdl(x2)
    _rms_norm_fwd_kernel[((n_rows + cfg.rows - 1) // cfg.rows,)](
        x2, r2, w, y, s, n_rows, eps, hidden,
        H=hidden, BLOCK=cfg.block, N_CHUNKS=cfg.n_chunks, ROWS=cfg.rows,
        HAS_RESIDUAL=residual is not None, EMULATE_RNE=_EMULATE_RNE, PDL=p, num_warps=cfg.num_warps, launch_pdl=p,
    )
    if x2 is x:
        return y, (s if residual is not None else None)
    return y.view(x.shape), (s.view(x.shape) if residual is not None else None)


def _forward_heads(x, weight, eps, cfg: NormConfig):
    """The per-head form ``x [T, heads, H]`` read in place: q or k as a view of a fused
    q|k|v output (token stride N) has the bits of the same heads contiguous (token stride
    heads x H). Every 3-D call takes this kernel variant, so the rollout's views and the
    training path's contiguous tensors compile to the same code: their token strides are
    both multiples of 16 (Triton's divisibility specialisation), or the input is copied to
    a contiguous, aligned tensor first."""
    tokens, heads, hidden = x.shape
    if not (x.stride(2) == 1 and x.stride(1) == hidden and x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0):
        width = -(-heads * hidden // 16) * 16  # a token stride that is a multiple of 16, aligned storage
        buf = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
        x = buf[:, :heads * hidden].view(tokens, heads, hidden).copy_(x)
    w = weight if weight.is_contiguous() and weight.data_ptr() % 16 == 0 else _rows(weight, hidden)
    y = torch.empty((tokens, heads, hidden), dtype=x.dtype, device=x.device)
    n_rows = tokens * heads
    p = pdl(x)
    _rms_norm_fwd_kernel[((n_rows + cfg.rows - 1) // cfg.rows,)](
        x, x, w, y, y, n_rows, eps, x.stride(0),
        H=hidden, BLOCK=cfg.block, N_CHUNKS=1, ROWS=cfg.rows,
        HAS_RESIDUAL=False, EMULATE_RNE=_EMULATE_RNE, HEADS=heads, PDL=p, num_warps=cfg.num_warps, launch_pdl=p,
    )
    return y


@functools.lru_cache(maxsize=None)
def _bwd_programs(device: torch.device) -> int:
    # About four resident programs per SM keep every SM streaming; the count depends on
    # the device only, so dW is reduced in the same order on every run.
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _backward_torch(x2, dy2, ds2, w, eps):
    """Wide rows (> _MAX_BLOCK): the kernel's formulas in torch fp32."""
    x = x2.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * rstd
    dn = dy2.float() * w.float()
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    if ds2 is not None:
        dx = dx + ds2.float()
    return dx.to(x2.dtype), (dy2.float() * n).sum(0)


def _backward(x, d_normed, d_summed, weight, eps):
    """(dx, dw) for normed = rms_norm(x); d_summed is added to dx (the residual path)."""
    hidden = x.shape[-1]
    x2, w, dy2 = _rows(x, hidden), _rows(weight, hidden), _rows(d_normed, hidden)
    ds2 = _rows(d_summed, hidden) if d_summed is not None else None
    cfg = norm_config(hidden)
    if cfg.n_chunks > 1:
        dx2, dw = _backward_torch(x2, dy2, ds2, w, eps)
        return dx2.view(x.shape), dw.to(weight.dtype)
    n_rows = x2.shape[0]
    # 2048 elements per block of rows: the backward holds x, dy, w and the dW partial in
    # registers, ~100-120 per thread at this size (sm_90 ptxas) and ~190-210 at 4096.
    rows = max(1, _BWD_ELEMS_PER_BLOCK // cfg.block)
    rows_per_prog = triton.cdiv(triton.cdiv(n_rows, _bwd_programs(x.device)), rows) * rows
    n_progs = triton.cdiv(n_rows, rows_per_prog)
    dx2 = torch.empty_like(x2)
    dw_part = torch.empty((n_progs, hidden), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_progs,)](
        x2, dy2, ds2 if ds2 is not None else dy2, w, dx2, dw_part, n_rows, rows_per_prog, eps,
        H=hidden, BLOCK=cfg.block, ROWS=rows, HAS_DSUM=ds2 is not None,
        EMULATE_RNE=_EMULATE_RNE, num_warps=cfg.num_warps,
    )
    return dx2.view(x.shape), dw_part.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------- autograd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        normed, summed = _forward(x, residual, weight, eps)
        ctx.save_for_backward(summed if residual is not None else x, weight)
        ctx.eps, ctx.has_residual = eps, residual is not None
        ctx.set_materialize_grads(False)
        return (normed, summed) if residual is not None else normed

    @staticmethod
    def backward(ctx, d_normed, d_summed=None):
        x, weight = ctx.saved_tensors
        if d_normed is None and d_summed is None:
            return None, None, None, None
        if d_normed is None:  # only the residual stream is used downstream
            return d_summed, d_summed, None, None
        dx, dw = _backward(x, d_normed, d_summed, weight, ctx.eps)
        return dx, (dx if ctx.has_residual else None), dw, None


# --------------------------------------------------------------------------- functional


def _check(x, residual, weight, eps) -> float:
    if _valid_cuda_call(x, residual, weight, eps):
        return eps
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have rank >= 1, got shape {tuple(x.shape)}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(f"residual must match x ({x.dtype}, {tuple(x.shape)}), "
                             f"got {residual.dtype}, {tuple(residual.shape)}")
    check_same_device(x=x, residual=residual, weight=weight)
    return check_positive_float("eps", eps)


def _valid_cuda_call(x, residual, weight, eps) -> bool:
    """A cheap test that implies every check of ``_check`` (one CUDA device or, under the
    interpreter, the CPU; float eps): the common case skips the generic validators;
    anything else takes them and gets their error message. No check reads device memory
    (no synchronisation)."""
    if not (type(eps) is float and 0.0 < eps < math.inf and on_fast_device(x, weight)):
        return False
    ok = (x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES and x.dim() >= 1
          and weight.dim() == 1 and x.numel() > 0 and weight.shape[0] == x.shape[-1])
    if ok and residual is not None:
        ok = on_fast_device(x, residual) and residual.dtype == x.dtype and residual.shape == x.shape
    return ok


def _needs_autograd(x, residual, weight) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (residual is not None and residual.requires_grad))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., H]`` with ``weight [H]``; returns x's shape and dtype.

    Also the per-head q/k norm: ``x [T, heads, head_dim]``, ``weight [head_dim]``.
    """
    eps = _check(x, None, weight, eps)
    if _needs_autograd(x, None, weight):
        return _RMSNormFunction.apply(x, None, weight, eps)
    return _forward(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``summed = (x + residual).to(x.dtype)``, ``normed = rms_norm(summed)``.

    Returns ``(normed, summed)``; ``summed`` is the next residual stream.
    """
    eps = _check(x, residual, weight, eps)
    if _needs_autograd(x, residual, weight):
        return _RMSNormFunction.apply(x, residual, weight, eps)
    return _forward(x, residual, weight, eps)

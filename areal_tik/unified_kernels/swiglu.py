"""SwiGLU activation on a packed gate/up projection: ``silu(gate) * up``.

Semantics (``reference.silu_mul``; Hugging Face ``act_fn(gate_proj(x)) * up_proj(x)``)::

    gate, up = gate_up[..., :I], gate_up[..., I:]
    act = (g / (1 + exp(-g))).to(dtype)         g = gate.float(); IEEE division
    out = (act.float() * up.float()).to(dtype)

Elementwise per row, no reduction: any grid gives the same bits, and no expression
leaves the compiler a contraction choice (the only products feed a rounding or a
division). Grid: (rows, column blocks of BLOCK); BLOCK is fixed per I.

Backward (fp32, one rounding per gradient), with sig = sigmoid(g) and silu = g * sig::

    d_gate = d_out * up * sig * (1 + g * (1 - sig)),   d_up = d_out * silu
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_tensor, interpreting, on_fast_device
from ._pdl import pdl, pdl_wait
from ._rounding import cast_rne

# Kernels round with integer ops under the interpreter (see _rounding.py).
_EMULATE_RNE = interpreting()


@dataclasses.dataclass(frozen=True)
class SiluConfig:
    block: int  # columns per program (a power of two)
    num_warps: int

    @property
    def name(self) -> str:
        return f"b{self.block}/w{self.num_warps}"


# 1024 columns per program with 4 warps: 8 contiguous elements per thread, one 16-byte
# vector of bf16 per operand, 4-6 KiB moved per program (91-96% of the 4.26 TB/s copy
# bandwidth at 16384 tokens in the first H200 run). It divides the common intermediate
# sizes (3072, 6144, 8192); others get one masked tail block per row. Elementwise, so
# the geometry cannot change a bit; ``eval/bench_pointwise.py --sweep`` times the
# candidates.
_MAX_BLOCK = 1024
_CONFIGS: dict[int, SiluConfig] = {}


def silu_config(inter: int) -> SiluConfig:
    """Launch geometry for an intermediate size ``inter`` (never a function of the rows)."""
    cfg = _CONFIGS.get(inter)
    if cfg is None:
        cfg = _CONFIGS[inter] = SiluConfig(min(_MAX_BLOCK, triton.next_power_of_2(inter)), 4)
    return cfg


def silu_candidates(inter: int) -> list[SiluConfig]:
    """The table's geometry first, then the alternatives the benchmark sweep times."""
    out = [silu_config(inter)]
    for block, warps in ((2048, 4), (2048, 8), (4096, 8), (512, 4)):
        cfg = SiluConfig(min(block, triton.next_power_of_2(inter)), warps)
        if cfg not in out:
            out.append(cfg)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _silu_mul_fwd_kernel(
    gu_ptr,  # [n_rows, 2 * I] packed gate | up (row stride stride_gu, unit column stride)
    out_ptr,  # [n_rows, I] contiguous
    stride_gu,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid: (row, block of BLOCK columns); the grid covers the rows exactly.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_ptr = gu_ptr + row * stride_gu + cols
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + I, mask=mask, other=0.0).to(tl.float32)
    act = cast_rne(tl.math.div_rn(g, 1.0 + tl.exp(-g)), out_ptr.dtype.element_ty, EMULATE_RNE)
    out = cast_rne(act.to(tl.float32) * u, out_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(out_ptr + row * I + cols, out, mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    gu_ptr,  # [n_rows, 2 * I] packed gate | up of the forward (row stride stride_gu)
    dout_ptr,  # [n_rows, I] gradient of the output (row stride stride_dout)
    dgu_ptr,  # [n_rows, 2 * I] contiguous gradient wrt gate | up
    stride_gu,
    stride_dout,
    I: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_ptr = gu_ptr + row * stride_gu + cols
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + I, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(dout_ptr + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + tl.exp(-g))
    d_gate = d * u * sig * (1.0 + g * (1.0 - sig))
    d_up = d * (g * sig)
    dst = dgu_ptr + row * (2 * I) + cols
    tl.store(dst, cast_rne(d_gate, dgu_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
    tl.store(dst + I, cast_rne(d_up, dgu_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


# ---------------------------------------------------------------------------- launchers


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _forward(gate_up: torch.Tensor, config: SiluConfig | None = None) -> torch.Tensor:
    """Launch the forward kernel. Host work is a view, one allocation and the launch: at
    decode sizes the call's cost is its Python and launch overhead."""
    inter = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = gu.new_empty((gu.shape[0], inter))
    cfg = config or silu_config(inter)
    p = pdl(gu)
    _silu_mul_fwd_kernel[(gu.shape[0], (inter + cfg.block - 1) // cfg.block)](
        gu, out, gu.stride(0),
        I=inter, BLOCK=cfg.block, EMULATE_RNE=_EMULATE_RNE, PDL=p, num_warps=cfg.num_warps, launch_pdl=p,
    )
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], inter)


def _backward(gate_up: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    gu, dout = _rows(gate_up), _rows(d_out)
    dgu = torch.empty((gu.shape[0], 2 * inter), dtype=gu.dtype, device=gu.device)
    cfg = silu_config(inter)
    _silu_mul_bwd_kernel[(gu.shape[0], (inter + cfg.block - 1) // cfg.block)](
        gu, dout, dgu, gu.stride(0), dout.stride(0),
        I=inter, BLOCK=cfg.block, EMULATE_RNE=_EMULATE_RNE, num_warps=cfg.num_warps,
    )
    return dgu.view(gate_up.shape)


# ----------------------------------------------------------------------------- autograd


class _SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _forward(gate_up)

    @staticmethod
    def backward(ctx, d_out):
        (gate_up,) = ctx.saved_tensors
        return _backward(gate_up, d_out)


# --------------------------------------------------------------------------- functional


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` for a packed ``[..., 2I]`` input -> ``[..., I]``."""
    # The first test implies every later check for CUDA input, or CPU input under the
    # interpreter (the common case skips the generic validator); anything else takes the
    # full checks and gets their message.
    if not (on_fast_device(gate_up) and gate_up.dtype in FLOAT_DTYPES
            and gate_up.dim() >= 1 and gate_up.numel() > 0 and gate_up.shape[-1] % 2 == 0):
        check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES)
        if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up must be [..., 2I] with an even last dim, got shape {tuple(gate_up.shape)}")
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _SiluMulFunction.apply(gate_up)
    return _forward(gate_up)

"""Unified linear layer: ``y = x @ weight.T + bias`` with row-invariant bits.

Numerics (fixed, identical for every row count): each output element accumulates in
fp32 over K in order, always as ``acc = tl.dot(a, b, acc)`` over K blocks; no split-K;
the bias is added in fp32 after the loop and the result is rounded once to ``x.dtype``.
bf16 operands go to the tensor cores as bf16 (wgmma on Hopper): a block's dot is
BLOCK_K / 16 k16 instructions chained on the accumulator in K order, so the chain's
steps are 16 columns wide whatever BLOCK_K (a multiple of 16) is (``_linear_chain.MMA_K``;
measured, not assumed: tests/test_linear.py ``test_gpu_block_k_is_geometry`` and
eval/probe_block_k.py). fp32 operands use ``input_precision="ieee"`` (one exact FMA per
k, never TF32). The Triton interpreter's bf16 dot is wrong and numpy's fp32 matmul
orders its sums by block shape, so there each 16-column step's dot runs in fp64 (exact
for bf16 products) with the accumulator, rounded back to fp32 after every step.

Geometry varies with the row count and the weight shape, numerics do not. Two kernels
compute the same per-element chain: a tiled kernel (one program per output tile,
pointer loads) and, for large M on Hopper, a persistent kernel (one program per SM
looping over tiles, TMA descriptor loads and stores). A row bucket holds a ladder of
configs; the first whose grid suits this N is used (``linear_config``). An element's
bits depend only on the k16 chain and the MMA instruction family, so every GPU bf16
config is wgmma-eligible (BLOCK_M a multiple of 64, whole warpgroups) with BLOCK_K a
multiple of 16: 64 in the ladders, 128 / 256 in the wide-K decode entries
(``_linear_tiles._WIDE_K_BF16``: fewer sequential K steps where a launch has few
programs; ``AREAL_TIK_LINEAR_WIDE_K=0`` or ``wide_k(False)`` turns them off). The GPU
contract test (tests/test_linear.py, ``-m gpu``) proves every config, both kernels,
bit-equal. ``AREAL_TIK_LINEAR_FIXED_TILE=1`` (or ``FIXED_TILE = True`` on this module)
forces one config for every shape.

K-group tree (tensor-parallel row shards; ``_ktree`` has the definition): with
``k_groups`` G > 1 each kernel reduces K in G contiguous groups, each the chain above
anchored at its group's start, combined by a fixed balanced tree in fp32 before the bias
and the one rounding; one pipelined loop over all of K runs every group's chain and
closes it into the tree at the group's last block (``_linear_chain``). ``linear_partial``
returns one K shard's subtree root unrounded (fp32 output, no bias) and
``combine_partials`` finishes the tree over the shards, so t ranks holding G / t groups
each reproduce ``linear(k_groups=G)`` bit for bit. G = 1 (the default) is the plain chain,
compiled as before. G > 1 takes a smaller tile where the table's cannot hold the tree's
log2(G) + 1 fp32 accumulators in registers (``tree_tile``; the same bits). The persistent
kernel takes G > 1 only when (K / G) % BLOCK_K == 0 (no TMA box across two groups);
otherwise the tiled kernel runs the same config.

Layout: x's leading dims are flattened with ``reshape`` (a copy only when they cannot be
merged); the 2-D view's strides, and the weight's strides, go to the kernel, so a
non-contiguous x or a transposed weight view needs no copy (such views, or any operand
whose base or row stride is not 16-byte aligned, take the tiled kernel: TMA needs
both). The output is contiguous.

Backward (no bitwise requirement; deterministic): dX = dY @ W and dW = dY^T @ X as
cuBLAS GEMMs in the operands' dtype (``_common.grad_mm``): bf16 on the tensor cores with
fp32 accumulation and fp32 split-K reductions, one rounding to bf16, the same error
budget as an fp32 GEMM rounded to bf16 (the earlier fp32 upcast ran SIMT sgemm: 82% of
the Qwen3-0.6B training step's CUDA time on the H200, ~21 TFLOP at ~45 TFLOP/s for
12k tokens). db = dY.sum(0) in fp32. fp32 operands keep torch's fp32 matmul (TF32 only
if turned on globally).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
import triton.language as tl

from . import _common
from ._common import grad_mm, interpreting
from ._ktree import check_k_groups, combine_partials  # noqa: F401  (combine_partials: API of this module)
from ._linear_checks import valid_fast_call, validate
from ._linear_chain import _tiled_group, _tiled_tree, _tma_group, _tma_tree
from . import _pdl
from ._pdl import l2_prefetch_rows_then_wait, pdl, pdl_wait
from ._linear_tiles import (  # noqa: F401  (the tables: tuned by the search, read by tests and benches)
    _CPU_BUCKETS, _CPU_CANDIDATES, _CPU_FIXED, _CPU_PROGRAMS, _GPU_BUCKETS, _GPU_CANDIDATES, _GPU_FIXED,
    _MIN_PROGRAMS, _REFERENCE_SMS, TileConfig, _cfg, _device_info, _rung, _select, buckets, linear_candidates,
    row_probes, tree_tile)

try:  # host-side TMA descriptors (triton >= 3.3): no device scratch, no global allocator
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the tiled kernel serves every shape
    TensorDescriptor = None

# When True, one config per dtype serves every row count (see module docstring).
FIXED_TILE = _common.env_switch("AREAL_TIK_LINEAR_FIXED_TILE", False)
# When True, decode-sized launches take the wide-K entries (see module docstring).
WIDE_K = _common.env_switch("AREAL_TIK_LINEAR_WIDE_K", True)


@contextlib.contextmanager
def wide_k(on: bool):
    """``WIDE_K`` set inside the block (a benchmark's side-by-side runs; the same bits)."""
    global WIDE_K  # (the plan cache keys on it: no plan crosses the switch)
    saved, WIDE_K = WIDE_K, on
    try:
        yield
    finally:
        WIDE_K = saved


def linear_config(rows: int, n: int, k: int, dtype: torch.dtype, tma: bool | None = None,
                  sms: int | None = None, k_groups: int = 1) -> TileConfig:
    """Launch config for ``rows`` rows of a ``[n, k]`` weight: an entry the search promoted
    for this shape (``_linear_tiles.tuned``), else the bucket's ladder; or the fixed tile.

    ``tma`` says whether the persistent TMA kernel can run (default: judged from n and k
    for contiguous operands); when False, persistent rungs are skipped. ``sms``: the
    GPU's SM count (default: the current CUDA device's, else the H200's 132). With
    ``k_groups`` > 1 the tile may be smaller (``tree_tile``: registers; the same bits).
    """
    if tma is None:
        tma = (k * dtype.itemsize) % 16 == 0 and (n * dtype.itemsize) % 16 == 0
    if sms is None:
        cuda = not interpreting() and torch.cuda.is_available()
        sms = _device_info(torch.cuda.current_device())[1] if cuda else _REFERENCE_SMS
    # wide-K entries serve the plain chain only (their BLOCK_K need not divide a group's K)
    return tree_tile(_select(rows, n, k, dtype, tma, sms, FIXED_TILE, interpreting(), WIDE_K and k_groups == 1),
                     k_groups)


def tma_compatible(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the persistent kernel run? TMA needs Hopper or newer, unit inner strides and
    16-byte aligned base pointers and row strides (x, weight and the [M, N] output)."""
    if TensorDescriptor is None:
        return False
    if not interpreting() and not (x2d.is_cuda and _device_info(x2d.device.index or 0)[0]):
        return False
    size = x2d.element_size()
    return (x2d.stride(1) == 1 and weight.stride(1) == 1
            and (x2d.stride(0) * size) % 16 == 0 and (weight.stride(0) * size) % 16 == 0
            and x2d.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (weight.shape[0] * size) % 16 == 0)


def _launch_metadata(grid, metadata, args):
    m, n, k = args["M"], args["N"], args["K"]
    size = args["x_desc"].base.element_size() if "x_desc" in args else args["x_ptr"].element_size()
    return {
        "name": f"unified_linear [M={m}, N={n}, K={k}]",
        "flops": 2 * m * n * k,
        "bytes": size * (m * k + n * k + m * n),
    }


# The row count is data: left unspecialised, so Triton compiles one kernel per config
# whatever M is (it would otherwise key on M == 1 and M % 16 == 0). M only bounds masks
# and the row wrap, never an arithmetic step (the contract tests prove the bits equal).
_ROW_ARGS = ("M",)


@triton.jit
def _bf16_rtne(x):
    # fp32 -> bf16, round to nearest even, by bit arithmetic: the interpreter's cast
    # truncates (GPUs round to nearest even in hardware).
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)  # NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_out(acc, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    # The one rounding (RTNE) of the fp32 result to the output dtype.
    if INTERPRET and dtype == tl.bfloat16:
        return _bf16_rtne(acc)
    return acc.to(dtype)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Tile index -> (tile row, tile col) in L2-grouped order: GROUP_M tile rows share each
    # weight tile while it is hot. Order never affects numerics (one program per element).
    group_size = GROUP_M * num_pid_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group_size) % rows_in_group, (tile % group_size) // rows_in_group


@triton.jit(launch_metadata=_launch_metadata, do_not_specialize=_ROW_ARGS)
def _linear_fwd_kernel(
    x_ptr,  # [M, K] activations, strides (stride_xm, stride_xk)
    w_ptr,  # [N, K] weight, strides (stride_wn, stride_wk)
    b_ptr,  # [N] contiguous bias (unused when HAS_BIAS is False)
    out_ptr,  # [M, N] contiguous output: x.dtype, or fp32 for unrounded partials
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # (K / K_GROUPS) % BLOCK_K == 0: no K mask needed (same values loaded)
    MASK_ROWS: tl.constexpr,  # M < BLOCK_M (decode): skip reading the missing rows
    INTERPRET: tl.constexpr,  # CPU interpreter: its bf16 dot is wrong; dot in fp64
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (ignored for bf16)
    K_GROUPS: tl.constexpr = 1,  # the K-group tree's G (1, 2, 4, 8); K % K_GROUPS == 0
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
    PREFETCH_W: tl.constexpr = False,  # with PDL: this program's weight rows into L2 first (_pdl.py)
):
    # Grid: one program per BLOCK_M x BLOCK_N output tile, 1-D, in L2-grouped order.
    # (Index arithmetic only before the wait: no load reads what an earlier kernel writes.)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/cols are wrapped onto valid ones so the operand loads need no
    # M/N mask; they only feed outputs that are never stored (rows never mix in a dot).
    # With MASK_ROWS the missing rows read zeros instead: at M=1 in a 64x32 tile a K
    # block would otherwise copy 8 KiB of repeated x rows next to 4 KiB of weight.
    cols = (offs_n % N).to(tl.int64)
    # PREFETCH_W: the weight is K-contiguous with 16-byte aligned rows (the launcher checks).
    l2_prefetch_rows_then_wait(w_ptr + cols * stride_wn, K * w_ptr.dtype.element_ty.primitive_bitwidth // 8,
                               PDL, PREFETCH_W)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn

    # Reduction: K blocks in order into an fp32 accumulator; with K groups, one loop over
    # all of K that closes each group's chain into the groups' tree (_linear_chain).
    if K_GROUPS == 1:
        acc = _tiled_group(x_ptrs, w_ptrs, offs_m, offs_k, M, K, stride_xk, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MASK_ROWS, INTERPRET, DOT_PRECISION)
    else:
        acc = _tiled_tree(x_ptrs, w_ptrs, offs_m, offs_k, M, K // K_GROUPS, stride_xk, stride_wk, K_GROUPS,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MASK_ROWS, INTERPRET, DOT_PRECISION)

    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptrs, _round_out(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit(launch_metadata=_launch_metadata, do_not_specialize=_ROW_ARGS)
def _linear_fwd_persistent_kernel(
    x_desc,  # TMA descriptor of x [M, K] (unit K stride), block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of weight [N, K] (unit K stride), block [BLOCK_N, BLOCK_K]
    out_desc,  # TMA descriptor of out [M, N] contiguous, block [BLOCK_M, BLOCK_N (/ 2 if SPLIT)]
    b_ptr,  # [N] contiguous bias (unused when HAS_BIAS is False)
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,  # the grid size bound: number of SMs
    SPLIT_EPILOGUE: tl.constexpr,  # store two BLOCK_N/2 halves (less shared memory)
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_GROUPS: tl.constexpr = 1,  # the K-group tree's G; > 1 only with (K / G) % BLOCK_K == 0
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid: min(#SMs, #tiles) programs; program p computes tiles p, p + NUM_PROGRAMS, ...
    # in the same L2-grouped order as the tiled kernel. flatten=True (one group only) lets
    # the pipeliner issue the next tile's first TMA loads while this tile's epilogue runs;
    # with K groups, flattening the tile loop around the K loop (and its group-closing
    # scf.if) made ptxas serialise the wgmma (sm_90a, triton 3.6), so G > 1 keeps two loops.
    # Each tile's reduction is the tiled kernel's: K blocks in order, one dot per block,
    # zeros past K (TMA zero-fills out-of-bounds boxes; out-of-bounds stores drop), with K
    # groups closed into the groups' tree on the way.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=K_GROUPS == 1):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if K_GROUPS == 1:
            acc = _tma_group(x_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, DOT_PRECISION)
        else:
            acc = _tma_tree(x_desc, w_desc, off_m, off_n, K // K_GROUPS, K_GROUPS,
                            BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, DOT_PRECISION)
        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            acc = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        dtype: tl.constexpr = out_desc.dtype
        if SPLIT_EPILOGUE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            out_desc.store([off_m, off_n], _round_out(left, dtype, INTERPRET))
            out_desc.store([off_m, off_n + BLOCK_N // 2], _round_out(right, dtype, INTERPRET))
        else:
            out_desc.store([off_m, off_n], _round_out(acc, dtype, INTERPRET))


def _launch_options(x2d, has_bias: bool, cfg: TileConfig, k_groups: int) -> dict:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                HAS_BIAS=has_bias, INTERPRET=interpreting(), K_GROUPS=k_groups,
                DOT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32",
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@dataclasses.dataclass(frozen=True)
class _Plan:  # one launch's kernel, grid, int and constexpr arguments, TMA boxes (x, weight, out)
    persistent: bool
    grid: tuple
    ints: tuple  # M, N, K, then (tiled) the strides of x, weight and out
    consts: dict
    boxes: tuple = ()
    prefetch_w: bool = False  # tiled, few rows, rows fit the L2 bulk prefetch (_prefetch_rows_ok)


# Rows up to which the tiled kernel prefetches its weight slice into L2 under PDL: the
# streaming buckets, where each weight tile is read by one to four programs and the time is
# the weight's bytes (_linear_tiles); above them the kernel is compute-bound.
_PREFETCH_MAX_ROWS = 256


def _prefetch_rows_ok(weight, K: int) -> bool:
    # cp.async.bulk.prefetch.L2: 16-byte aligned source, a multiple of 16 bytes: whole
    # K-contiguous weight rows at 16-byte aligned addresses.
    size = weight.element_size()
    return (weight.stride(1) == 1 and (weight.stride(0) * size) % 16 == 0 and weight.data_ptr() % 16 == 0
            and (K * size) % 16 == 0)


# Shared memory one program may take on Hopper (227 KiB), less a margin for barriers.
_SMEM_BYTES = 232448 - 1024


def _partial_stages(cfg: TileConfig, in_size: int, out_size: int) -> int:
    """Pipeline stages of a persistent launch with a wider (fp32 partial) output: its
    epilogue keeps a BLOCK_M x BLOCK_N / 2 fp32 tile in shared memory beside the stages'
    operand tiles, more than the bf16 tile the table's configs were sized for (128x256/s4:
    262,176 bytes, over the limit). Stages are geometry only: drop them until both fit."""
    stages, epilogue = cfg.num_stages, cfg.block_m * (cfg.block_n // 2) * out_size
    while stages > 2 and stages * (cfg.block_m + cfg.block_n) * cfg.block_k * in_size + epilogue > _SMEM_BYTES:
        stages -= 1
    return stages


def _make_plan(x2d, weight, out, has_bias: bool, config: TileConfig | None, k_groups: int) -> _Plan:
    """The persistent kernel runs where TMA can read the operands and, with several K
    groups, no TMA box straddles two groups ((K / G) % BLOCK_K == 0); otherwise the tiled
    kernel runs with the same tile (the same bits)."""
    (M, K), N = x2d.shape, weight.shape[0]
    tma = tma_compatible(x2d, weight)
    cfg = config
    if cfg is None:
        sms = _device_info(x2d.device.index or 0)[1] if x2d.is_cuda else _REFERENCE_SMS
        cfg = linear_config(M, N, K, x2d.dtype, tma=tma, sms=sms, k_groups=k_groups)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    options = _launch_options(x2d, has_bias, cfg, k_groups)
    if cfg.persistent and tma and (k_groups == 1 or (K // k_groups) % bk == 0):
        sms = _CPU_PROGRAMS if interpreting() else _device_info(x2d.device.index or 0)[1]
        # An fp32 output (partials) of bf16 operands stores half tiles: the epilogue's shared
        # memory is then that of a whole bf16 tile, which not every config fits beside its
        # stages (_partial_stages drops some: geometry only).
        split = cfg.split_epilogue or out.element_size() > x2d.element_size()
        if out.element_size() > x2d.element_size():
            options["num_stages"] = _partial_stages(cfg, x2d.element_size(), out.element_size())
        return _Plan(True, (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),), (M, N, K),
                     dict(options, NUM_PROGRAMS=sms, SPLIT_EPILOGUE=split),
                     ((bm, bk), (bn, bk), (bm, bn // 2 if split else bn)))
    return _Plan(False, (triton.cdiv(M, bm) * triton.cdiv(N, bn),),
                 (M, N, K, x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0)),
                 dict(options, EVEN_K=(K // k_groups) % bk == 0, MASK_ROWS=M < bm),
                 prefetch_w=M <= _PREFETCH_MAX_ROWS and _prefetch_rows_ok(weight, K))


# Plans by everything ``_make_plan`` reads (shapes, strides, dtypes, device, 16-byte alignment
# of x and weight, bias, K groups, fixed tile): 7 linears a layer skip its lookups and dicts
# (eval/probe_host.py). Used while ``_common.HOST_FAST_PATH`` is on.
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # row counts vary per step: bounded, cleared when full


def _plan_key(x2d, weight, out, has_bias: bool, k_groups: int) -> tuple:
    return (x2d.shape, x2d.stride(), weight.shape, weight.stride(), out.stride(), x2d.dtype, out.dtype,
            x2d.get_device(), x2d.data_ptr() % 16, weight.data_ptr() % 16, has_bias, k_groups, FIXED_TILE, WIDE_K)


def _plan(x2d, weight, out, has_bias: bool, k_groups: int) -> _Plan:
    key = _plan_key(x2d, weight, out, has_bias, k_groups)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(x2d, weight, out, has_bias, None, k_groups)
    return plan


def _launch_tiled(x2d, weight, bias, out, plan: _Plan) -> None:
    p = pdl(x2d)
    _linear_fwd_kernel[plan.grid](x2d, weight, bias if bias is not None else out, out, *plan.ints, **plan.consts,
                                  PDL=p, PREFETCH_W=p and plan.prefetch_w and _pdl.PREFETCH, launch_pdl=p)


def _launch_persistent(x2d, weight, bias, out, plan: _Plan) -> None:
    (M, N, K), (box_x, box_w, box_out) = plan.ints, plan.boxes
    p = pdl(x2d)
    _linear_fwd_persistent_kernel[plan.grid](
        TensorDescriptor(x2d, [M, K], [x2d.stride(0), 1], list(box_x)),
        TensorDescriptor(weight, [N, K], [weight.stride(0), 1], list(box_w)),
        TensorDescriptor(out, [M, N], [N, 1], list(box_out)),
        bias if bias is not None else out, M, N, K, **plan.consts, PDL=p, launch_pdl=p)


def _forward_into(x2d, weight, bias, out, config: TileConfig | None, k_groups: int) -> torch.Tensor:
    """One launch into ``out``: its dtype is the output's (x's, rounded once; or fp32,
    unrounded partials). ``config`` None: the table's, through the plan cache."""
    has_bias = bias is not None
    if config is None and _common.HOST_FAST_PATH:
        plan = _plan(x2d, weight, out, has_bias, k_groups)
    else:
        plan = _make_plan(x2d, weight, out, has_bias, config, k_groups)
    if has_bias and not bias.is_contiguous():
        bias = bias.contiguous()
    (_launch_persistent if plan.persistent else _launch_tiled)(x2d, weight, bias, out, plan)
    return out


def linear_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   config: TileConfig | None = None, *, k_groups: int = 1) -> torch.Tensor:
    """Launch the forward kernel on validated 2-D ``x2d [M, K]``; returns ``[M, N]``.

    ``config`` overrides the table (benchmarks and tests only; any config with wgmma
    shapes and a BLOCK_K that is a multiple of 16 gives the table's bits). A persistent config whose operands TMA cannot read runs the
    tiled kernel with the same tile shape. ``k_groups``: the K-group tree's G (validated).
    """
    out = torch.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype, device=x2d.device)
    return _forward_into(x2d, weight, bias, out, config, k_groups)


def partial_forward(x2d: torch.Tensor, weight: torch.Tensor, k_groups: int,
                    config: TileConfig | None = None) -> torch.Tensor:
    """The unrounded fp32 tree root over ``k_groups`` groups of validated ``x2d [M, K]``, no bias."""
    out = torch.empty((x2d.shape[0], weight.shape[0]), dtype=torch.float32, device=x2d.device)
    return _forward_into(x2d, weight, None, out, config, k_groups)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, k_groups):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x2d, weight, bias, k_groups=k_groups)

    @staticmethod
    def backward(ctx, grad_out):
        # No bitwise requirement on gradients: tensor-core GEMMs, fp32 accumulation,
        # deterministic (see module docstring).
        x2d, weight = ctx.saved_tensors
        dy = grad_out.to(x2d.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad_mm(dy, weight)
        if ctx.needs_input_grad[1]:
            dw = grad_mm(dy.t(), x2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(weight.dtype)
        return dx, dw, db, None  # the backward ignores the K-group tree (no bitwise requirement)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           k_groups: int = 1) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp32 accumulation in a fixed K order, rounded once.

    x ``[..., K]`` (bf16 or fp32), weight ``[N, K]`` and bias ``[N]`` of the same dtype;
    returns ``[..., N]`` in ``x.dtype``. Each row's bits depend only on that row.
    ``k_groups`` G (1, 2, 4 or 8; K % G == 0): K reduced in G groups combined by the fixed
    balanced tree (``_ktree``), so that G / t groups on each of t tensor-parallel ranks
    (``linear_partial`` + ``combine_partials``) give the same bits; G = 1 is the plain chain.
    """
    if not (_common.HOST_FAST_PATH and valid_fast_call(x, weight, bias)):
        validate(x, weight, bias)
    check_k_groups(k_groups, x.shape[-1])
    flat = x.dim() == 2
    x2d = x if flat else x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        out = _LinearFunction.apply(x2d, weight, bias, k_groups)
    else:
        out = linear_forward(x2d, weight, bias, k_groups=k_groups)
    return out if flat else out.reshape(*x.shape[:-1], weight.shape[0])


def linear_partial(x: torch.Tensor, weight_shard: torch.Tensor, *, k_groups: int) -> torch.Tensor:
    """One rank's subtree of the K-group tree: fp32 ``[..., N]``, unrounded, no bias.

    ``x [..., K']`` and ``weight_shard [N, K']`` are this rank's K' = K / t contiguous
    columns; ``k_groups`` = G / t groups of them. Forward only (no autograd). The ranks'
    results, in rank order, go to ``combine_partials``.
    """
    validate(x, weight_shard, None)
    check_k_groups(k_groups, x.shape[-1])
    x2d = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        out = partial_forward(x2d, weight_shard.detach(), k_groups)
    return out.reshape(*x.shape[:-1], weight_shard.shape[0])

"""Fused LM head -> token log-prob (and entropy) without materialising fp32 logits.

Semantics (``reference.token_logprobs``): ``logits = hidden @ weight.T`` accumulated in
fp32 and rounded to the weight dtype (what ``lm_head`` returns), ``z = logits.float() / T``
(IEEE division), ``logprob = z[target] - logsumexp(z)``,
``entropy = -sum softmax(z) * log_softmax(z)``: AReaL's ``log_softmax(logits.float() / T)``.

Forward = two launches, both with a schedule that depends on (V, H, dtype) only:
1. ``_lse_partial_kernel``, grid = row blocks of BLOCK_T tokens x vocabulary splits of a
   fixed SPLIT_V (anchored at 0, so the split count depends on V only and decode-sized
   T still fills the GPU). A program walks its split in BLOCK_V chunks; per chunk it
   computes the logits tile with a fixed-order K loop (``acc = tl.dot(a, b, acc)``),
   rounds it to the weight dtype, divides by T, and merges the chunk's softmax state
   into a running (max m, sum exp s, sum exp * (z - m) u) in chunk order. It writes
   one state per (row, split), picks the target's z if the target lies in its split,
   and (``WRITE_LOGITS``) stores the rounded logits tile for the sampler.
2. ``_combine_kernel`` merges splits 0, 1, ... in order with the same merge, then
   ``lse = m + log s``, ``logprob = z_target - lse``, ``entropy = log s - u / s``.
Peak extra memory is the [3, n_splits, T] fp32 state, never [T, V].

Backward (no bitwise requirement, deterministic): per vocabulary chunk, recompute the
logits with cuBLAS, form dz/T in one Triton pass and apply two matmuls, so [T, V] is
never materialised either. Every GEMM takes bf16 operands on the tensor cores with fp32
accumulation and fp32 split-K reductions (``_common.fp32_reductions``); dHidden sums the
chunks in fp32 (``mm(..., out_dtype=float32)``), dW is one bf16 rounding per row.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, check_positive_float, check_same_device, check_tensor,
                      fp32_reductions, grad_mm, interpreting, measured_overrides)
from ._pdl import pdl, pdl_wait
from ._rounding import cast_rne

_INT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _merge(m, s, u, m2, s2, u2, ENTROPY: tl.constexpr):
    """Merge two softmax states (m = max z, s = sum exp(z - m), u = sum exp(z - m) (z - m))."""
    m_new = tl.maximum(m, m2)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exps at 0
    a = tl.exp(m - ref)
    b = tl.exp(m2 - ref)
    if ENTROPY:
        # Re-centre u on the new max: sum e^(z-ref)(z-ref) = a * (u + (m - ref) * s).
        u = a * (u + tl.where(s > 0, m - ref, 0.0) * s) + b * (u2 + tl.where(s2 > 0, m2 - ref, 0.0) * s2)
    s = s * a + s2 * b
    return m_new, s, u


# Token counts (and the backward's chunk bounds, which follow T) are data: left
# unspecialised, so one kernel serves every T (Triton would key on T == 1 and T % 16).
# They bound masks and loops only, never an arithmetic step.
@triton.jit(do_not_specialize=["T"])
def _lse_partial_kernel(
    hidden_ptr,   # [T, H] bf16/fp32
    weight_ptr,   # [V, H] same dtype
    targets_ptr,  # [T] int32/int64 (HAS_TARGETS)
    logits_ptr,   # [T, V] weight dtype, written when WRITE_LOGITS
    state_ptr,    # [3, n_splits, T] fp32: m, s, u per (split, row)
    tz_ptr,       # [T] fp32: z of the target, written by the split that holds it
    T, V, H, n_splits,
    stride_ht, stride_hk, stride_wv, stride_wk, stride_lt,
    temperature,  # fp32 runtime scalar
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_V: tl.constexpr, GROUP_T: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
    HAS_TARGETS: tl.constexpr, ENTROPY: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grouped program order (GROUP_T row blocks share one sweep of the splits) keeps the
    # working set in L2; it changes which program computes a tile, never how.
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(T, BLOCK_T)
    per_group = GROUP_T * n_splits
    first = (pid // per_group) * GROUP_T
    group_rows = min(n_row_blocks - first, GROUP_T)
    pid_t = first + (pid % per_group) % group_rows
    pid_s = (pid % per_group) // group_rows

    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    v_begin = pid_s * SPLIT_V
    v_end = min(v_begin + SPLIT_V, V)
    if HAS_TARGETS:
        tgt = tl.load(targets_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    u = tl.zeros([BLOCK_T], tl.float32)
    tz = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        cols64 = cols.to(tl.int64)
        # Fixed K order: blocks 0, BLOCK_K, ... accumulate into one fp32 tile.
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            a = tl.load(hidden_ptr + rows64[:, None] * stride_ht + ks[None, :] * stride_hk,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(weight_ptr + cols64[:, None] * stride_wv + ks[None, :] * stride_wk,
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if INTERPRET:
                # Interpreter only: its tl.dot is np.matmul, whose OpenBLAS blocking makes a
                # row's bits depend on its position in the tile (and its bf16 dot is wrong).
                # Products summed over k in order are exact per row (bf16 products are exact).
                acc += tl.sum(a.to(tl.float32)[:, :, None] * tl.trans(b.to(tl.float32))[None, :, :], axis=1)
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        logits = cast_rne(acc, weight_ptr.dtype.element_ty, INTERPRET)  # the lm_head rounding point
        if WRITE_LOGITS:
            tl.store(logits_ptr + rows64[:, None] * stride_lt + cols64[None, :], logits,
                     mask=row_ok[:, None] & col_ok[None, :])
        z = tl.math.div_rn(logits.to(tl.float32), temperature)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_c = tl.max(z, axis=1)
        ref = tl.where(m_c == float("-inf"), 0.0, m_c)
        e = tl.exp(z - ref[:, None])
        u_c = tl.zeros([BLOCK_T], tl.float32)
        if ENTROPY:
            u_c = tl.sum(e * tl.where(e > 0, z - ref[:, None], 0.0), axis=1)
        m, s, u = _merge(m, s, u, m_c, tl.sum(e, axis=1), u_c, ENTROPY)
        if HAS_TARGETS:
            # Exact pick: adding -0.0 changes no value (NaN, +-0 and +-inf included).
            hit = cols64[None, :] == tgt[:, None]
            pick = tl.sum(tl.where(hit, z, -0.0), axis=1)
            tz = tl.where((tgt >= v0) & (tgt < v0 + BLOCK_V), pick, tz)
    out = state_ptr + pid_s.to(tl.int64) * T + rows64
    tl.store(out, m, mask=row_ok)
    tl.store(out + n_splits * T, s, mask=row_ok)
    if ENTROPY:
        tl.store(out + 2 * n_splits * T, u, mask=row_ok)
    if HAS_TARGETS:
        tl.store(tz_ptr + rows64, tz, mask=row_ok & (tgt >= v_begin) & (tgt < v_end))


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(
    state_ptr,    # [3, n_splits, T] fp32 from _lse_partial_kernel
    tz_ptr,       # [T] fp32 target z
    targets_ptr,  # [T] int32/int64
    lse_ptr,      # [T] fp32 out
    lp_ptr,       # [T] fp32 out (HAS_TARGETS); NaN where the target is out of [0, V)
    ent_ptr,      # [T] fp32 out (ENTROPY)
    T, V, n_splits,
    BLOCK: tl.constexpr, HAS_TARGETS: tl.constexpr, ENTROPY: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # One program per BLOCK rows; splits merged in index order 0, 1, ..., n_splits - 1.
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_splits):
        ptr = state_ptr + i * T + rows64
        m_i = tl.load(ptr, mask=row_ok, other=0.0)
        s_i = tl.load(ptr + n_splits * T, mask=row_ok, other=1.0)
        u_i = tl.zeros([BLOCK], tl.float32)
        if ENTROPY:
            u_i = tl.load(ptr + 2 * n_splits * T, mask=row_ok, other=0.0)
        m, s, u = _merge(m, s, u, m_i, s_i, u_i, ENTROPY)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + rows64, lse, mask=row_ok)
    if HAS_TARGETS:
        tgt = tl.load(targets_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
        valid = (tgt >= 0) & (tgt < V)
        tz = tl.load(tz_ptr + rows64, mask=row_ok & valid, other=0.0)
        tl.store(lp_ptr + rows64, tl.where(valid, tz - lse, float("nan")), mask=row_ok)
    if ENTROPY:
        tl.store(ent_ptr + rows64, log_s - tl.math.div_rn(u, s), mask=row_ok)


@triton.jit(do_not_specialize=["T", "C", "v0"])
def _dz_kernel(
    logits_ptr,   # [T, C] weight dtype: recomputed logits of vocabulary chunk [v0, v0 + C)
    lse_ptr, ent_ptr, glp_ptr, gent_ptr,  # [T] fp32
    targets_ptr,  # [T] int32/int64
    dz_ptr,       # [T, C] weight dtype out: d loss / d logits
    T, C, v0, stride_lt, stride_dt,
    temperature,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ENTROPY: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Elementwise: dz = g_lp (onehot - p) - g_ent p (log p + H), then / T.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :], mask=mask, other=0.0)
    logp = tl.math.div_rn(x.to(tl.float32), temperature) - tl.load(lse_ptr + rows, mask=row_ok)[:, None]
    p = tl.exp(logp)
    g = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tgt = tl.load(targets_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    dz = tl.where((cols + v0).to(tl.int64)[None, :] == tgt[:, None], g, 0.0) - g * p
    if ENTROPY:
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)[:, None]
        dz -= g_ent * p * (logp + tl.load(ent_ptr + rows, mask=row_ok, other=0.0)[:, None])
    dz = tl.math.div_rn(dz, temperature)
    tl.store(dz_ptr + rows64[:, None] * stride_dt + cols[None, :],
             cast_rne(dz, dz_ptr.dtype.element_ty, INTERPRET), mask=mask)


@dataclasses.dataclass(frozen=True)
class LogprobConfig:
    """The forward schedule. Fixed per (V, H, dtype): it decides the bits, so it never
    depends on T (one config; a different BLOCK_T could change the MMA/reduction layout)."""
    block_t: int
    block_v: int
    block_k: int
    split_v: int
    group_t: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        assert self.split_v % self.block_v == 0, self


def logprob_config(V: int, H: int, dtype: torch.dtype) -> LogprobConfig:
    if interpreting():  # tiny tiles: interpreted cost grows with tile area
        return LogprobConfig(16, 32, 16, 64, 2, 1, 1)
    if dtype == torch.float32:  # IEEE fp32 dot: rare (tests), smaller K tile for shared memory
        return LogprobConfig(64, 64, 32, 512, 8, 4, 2)
    # bf16: 64-row tiles halve the padded MMA work of decode (T <= 64) against 128-row
    # tiles; SPLIT_V = 512 gives ~300 programs for V = 151936 at T = 1; 4 warps and 4
    # stages use 96 KiB of shared memory and ~190 registers (sm_90, no spills), so two
    # programs share an SM; GROUP_T = 16 keeps a wave's hidden rows and weight slices
    # in L2. eval/bench_logprob.py --sweep times the alternatives. BLOCK_K and stages are
    # geometry (a bf16 dot is a chain of k16 MMA steps, as in linear.py): ``PIPELINE``
    # overrides them. BLOCK_T, BLOCK_V and SPLIT_V set the merge order; num_warps sets the
    # layout of the softmax's row reductions: not geometry (on the H100 at 85e8ca9, 8 warps
    # gave other bits at T = 1: eval/results/2026-12-07_h100_85e8ca9/probe_block_k.log;
    # BLOCK_K 32 / 128 / 256 at 4 warps gave the same bits; none was faster, so 64 stays).
    return dataclasses.replace(LogprobConfig(64, 128, 64, 512, 16, 4, 4), **PIPELINE)


# bf16 GPU overrides of the forward's BLOCK_K / num_stages: the "logprob" entry of the JSON
# eval/probe_block_k.py writes (AREAL_TIK_LINEAR_TILES), after its bit check.
PIPELINE: dict = {}


def load_pipeline(fields: dict) -> None:
    """Set ``PIPELINE``; only BLOCK_K (a multiple of 16) and num_stages (geometry)."""
    if set(fields) - {"block_k", "num_stages"} or fields.get("block_k", 16) % 16:
        raise ValueError(f"logprob pipeline override must set block_k (a multiple of 16) or num_stages "
                         f"only, got {fields}")
    PIPELINE.clear()
    PIPELINE.update(fields)


load_pipeline(measured_overrides("logprob"))  # an experiment's override (AREAL_TIK_LINEAR_TILES), if any


_COMBINE_BLOCK = 128
_BWD_BLOCK = (16, 64) if interpreting() else (32, 128)
_BWD_BUDGET = 1 << 27  # elements of one [T, chunk] backward buffer (256 MiB in bf16)


def _forward(hidden, weight, targets, temperature, entropy, write_logits, tiles=None):
    """Launch both kernels; returns (logprob | None, entropy | None, lse, logits | None)."""
    V = weight.shape[0]
    state, tz, logits = _partial(hidden, weight, targets, temperature, entropy, write_logits,
                                 tiles or logprob_config(V, hidden.shape[1], weight.dtype))
    lp, ent, lse = _combine(state, tz, targets, V, entropy)
    return lp, ent, lse, logits


def _partial(hidden, weight, targets, temperature, entropy, write_logits, tiles):
    """The first launch over ``weight``'s rows: (state [2|3, n_splits, T], tz, logits | None)."""
    T, H = hidden.shape
    V = weight.shape[0]
    n_splits = triton.cdiv(V, tiles.split_v)
    dev = hidden.device
    has_t = targets is not None
    state = _empty((3 if entropy else 2, n_splits, T), torch.float32, dev)
    tz = _empty((T,) if has_t else (1,), torch.float32, dev)
    logits = _empty((T, V) if write_logits else (1, 1), weight.dtype, dev)
    grid = (triton.cdiv(T, tiles.block_t) * n_splits,)
    p = pdl(hidden)
    _lse_partial_kernel[grid](
        hidden, weight, targets if has_t else tz, logits, state, tz, T, V, H, n_splits,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), logits.stride(0),
        float(temperature),
        BLOCK_T=tiles.block_t, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k,
        SPLIT_V=tiles.split_v, GROUP_T=tiles.group_t,
        INTERPRET=interpreting(), PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        HAS_TARGETS=has_t, ENTROPY=entropy, WRITE_LOGITS=write_logits, PDL=p,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=False,  # no FMA contraction: the same rounding in every variant
        launch_pdl=p,
    )
    return state, tz, (logits if write_logits else None)


def _combine(state, tz, targets, V, entropy):
    """The second launch: the splits of ``state`` merged in index order -> (lp, ent, lse)."""
    n_splits, T = state.shape[1:]
    dev = state.device
    has_t = targets is not None
    lse = _empty((T,), torch.float32, dev)
    lp = _empty((T,), torch.float32, dev) if has_t else None
    ent = _empty((T,), torch.float32, dev) if entropy else None
    p = pdl(state)
    _combine_kernel[(triton.cdiv(T, _COMBINE_BLOCK),)](
        state, tz, targets if has_t else tz, lse, lp if has_t else lse, ent if entropy else lse,
        T, V, n_splits,
        BLOCK=_COMBINE_BLOCK, HAS_TARGETS=has_t, ENTROPY=entropy, PDL=p, enable_fp_fusion=False, launch_pdl=p,
    )
    return lp, ent, lse


def _empty(shape, dtype, device):
    # Every forward allocation goes through here (the memory test counts them).
    return torch.empty(shape, dtype=dtype, device=device)


@functools.cache
def _mm_out_dtype_ok() -> bool:
    try:
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _mm_f32(a, b):
    """``a @ b`` with an fp32 result and fp32 accumulation, for bf16 or fp32 operands."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        if _mm_out_dtype_ok():
            return torch.mm(a, b, out_dtype=torch.float32)
        # A torch without mm(out_dtype=): still tensor cores (never an fp32 SIMT GEMM),
        # at the cost of one bf16 rounding per vocabulary chunk.
        return grad_mm(a, b).float()
    return a.float() @ b.float()  # CPU: bf16 products are exact in fp32


def _bwd_chunk(T: int, V: int) -> int:
    """Vocabulary chunk of the backward: keeps each [T, chunk] buffer under the budget."""
    return min(V, max(1024, (_BWD_BUDGET // max(T, 1)) // 256 * 256))


def _backward(hidden, weight, targets, temperature, lse, ent, g_lp, g_ent, need_h, need_w):
    T, H = hidden.shape
    chunk = _bwd_chunk(T, weight.shape[0])
    d_hidden = torch.zeros((T, H), dtype=torch.float32, device=hidden.device) if need_h else None
    d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    with fp32_reductions():
        _backward_chunks(hidden, weight, targets, temperature, lse, ent, g_lp, g_ent, d_hidden, d_weight, chunk)
    return (d_hidden.to(hidden.dtype) if need_h else None), d_weight


def _backward_chunks(hidden, weight, targets, temperature, lse, ent, g_lp, g_ent, d_hidden, d_weight, chunk):
    """Accumulate into ``d_hidden`` (fp32, or None) and write ``d_weight`` (or None) chunk by chunk."""
    T, V = hidden.shape[0], weight.shape[0]
    entropy = ent is not None
    bt, bc = _BWD_BLOCK
    for v0 in range(0, V, chunk):
        w_c = weight[v0:v0 + chunk]
        logits = torch.nn.functional.linear(hidden, w_c)  # [T, C], weight dtype
        C = logits.shape[1]
        dz = torch.empty_like(logits)
        _dz_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc))](
            logits, lse, ent if entropy else lse, g_lp, g_ent if entropy else g_lp, targets, dz,
            T, C, v0, logits.stride(0), dz.stride(0), float(temperature),
            BLOCK_T=bt, BLOCK_C=bc, ENTROPY=entropy,
            INTERPRET=interpreting(),
        )
        if d_hidden is not None:
            d_hidden += _mm_f32(dz, w_c)
        if d_weight is not None:
            torch.mm(dz.t(), hidden, out=d_weight[v0:v0 + C])
        del logits, dz  # free before the next chunk allocates


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, return_entropy):
        lp, ent, lse, _ = _forward(hidden, weight, targets, temperature, return_entropy, False)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        return (lp, ent) if return_entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if not (need_h or need_w):
            return None, None, None, None, None
        g_lp = g_lp.float().contiguous()
        g_ent = g_ent.float().contiguous() if ent is not None else None
        d_h, d_w = _backward(hidden, weight, targets, ctx.temperature, lse, ent, g_lp, g_ent, need_h, need_w)
        return d_h, d_w, None, None, None


def _check_head(hidden, weight):
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype must equal hidden dtype {hidden.dtype}, got {weight.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] for hidden {tuple(hidden.shape)}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] >= 2**31:
        raise ValueError(f"vocabulary size must be < 2**31, got {weight.shape[0]}")


def _check_targets(targets, T):
    check_tensor("targets", targets, dtypes=_INT_DTYPES, ndim=1)
    if targets.shape[0] != T:
        raise ValueError(f"targets must have shape ({T},), got {tuple(targets.shape)}")
    return targets.contiguous()


def token_logprobs(hidden, weight, targets, temperature=1.0, return_entropy=False):
    """Per-token ``log_softmax(lm_head(hidden).float() / T)[target]`` (and entropy), fused.

    hidden ``[T, H]`` and weight ``[V, H]`` (same dtype, bf16 or fp32), targets ``[T]``
    int32/int64. Returns logprobs ``[T]`` fp32 (and entropy ``[T]`` fp32). Each row's bits
    depend only on that row. A target outside ``[0, V)`` yields NaN for its row (checked
    on the device, so no host sync). Differentiable w.r.t. hidden and weight.
    """
    _check_head(hidden, weight)
    targets = _check_targets(targets, hidden.shape[0])
    check_same_device(hidden=hidden, weight=weight, targets=targets)
    temperature = check_positive_float("temperature", temperature)
    return _TokenLogprobsFunction.apply(hidden, weight, targets, temperature, bool(return_entropy))


def lm_head_logits_lse(hidden, weight, temperature=1.0):
    """The same kernel, also writing the rounded logits: ``(logits [T, V] weight dtype, lse [T] fp32)``.

    ``lse`` is ``logsumexp(logits.float() / T)``; ``gather_logprobs(logits, lse, y, T)``
    equals ``token_logprobs(hidden, weight, y, T)`` bit for bit. No autograd (sampling).
    """
    _check_head(hidden, weight)
    check_same_device(hidden=hidden, weight=weight)
    temperature = check_positive_float("temperature", temperature)
    with torch.no_grad():
        _, _, lse, logits = _forward(hidden, weight, None, temperature, False, True)
    return logits, lse


def gather_logprobs(logits, lse, targets, temperature=1.0):
    """``logits[t, target].float() / T - lse[t]`` as fp32 ``[T]``; NaN where target is out of range.

    The division and subtraction are the kernel's IEEE ops. The divisor is a device tensor
    on purpose: CUDA torch turns ``tensor / python_float`` into a multiply by the
    reciprocal, which differs from IEEE division in the last bit.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("lse", lse, dtypes=(torch.float32,), ndim=1)
    T, V = logits.shape
    if lse.shape[0] != T:
        raise ValueError(f"lse must have shape ({T},), got {tuple(lse.shape)}")
    targets = _check_targets(targets, T)
    check_same_device(logits=logits, lse=lse, targets=targets)
    temperature = check_positive_float("temperature", temperature)
    valid = (targets >= 0) & (targets < V)
    picked = logits.gather(1, torch.where(valid, targets, 0).long()[:, None])[:, 0].float()
    z = torch.div(picked, torch.full((), temperature, dtype=torch.float32, device=logits.device))
    return torch.where(valid, z - lse, math.nan)

"""Unified causal attention: packed varlen prefill/training, paged KV-cache store and decode.

One numerical core (``_attention_fwd._softmax_tile`` inside ``_attn_split``) serves every
regime, so a query row's output bits are the same whether it is computed

- by ``attention_varlen`` in a packed micro-batch (any composition, padding rows),
- by prefill of its sequence alone (``store_kv_cache`` + ``attention_varlen``), or
- by ``attention_decode`` at context p + 1 from a paged cache (any block table, unused
  slots holding garbage, any batch composition or order), or
- by ``attention_paged_prefill`` in a chunk of rows starting at any position of its
  sequence, the earlier K/V read from the paged cache (chunked prefill, prefix-cache hits).

See ``_attention_fwd`` for the schedule (fixed BLOCK_N tiles anchored at position 0,
fixed-size KV splits folded in order) and why it is regime-invariant, ``_attention_bwd``
for the FlashAttention-2 style backward of the training path (deterministic, no atomics).

Layouts: q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (any strides with a unit last stride),
``cu_seqlens`` ``[S + 1]`` int32; caches ``[num_blocks, block_size, Hk, D]`` with
``block_size`` a multiple of the KV tile (64 on the GPU, 16 under the interpreter).

Value checks (cu_seqlens monotone, context lengths covered by the block table, slot
numbers in range) read small index tensors on the host, a device sync per call. They are
skipped while a CUDA graph is being captured, or when ``validate=False`` is passed: a
per-layer caller validates its batch once (first layer) and passes ``validate=False``
after that. Unvalidated input must be right: ``max_seqlen`` below the longest sequence
leaves rows uncomputed, out-of-range slots or block ids address foreign memory.

Host cost per call with ``validate=False``: no device reads, grids from shapes (decode:
B, heads and the block table's width; prefill: the int ``max_seqlen``), so every entry
point can be captured in a CUDA graph. Launches: store 1; prefill 1 (+ the output and,
for training, the LSE allocation); decode 1 when the table covers one KV split, else 2 and
one fp32 workspace; backward 3. Metadata checks are plain attribute reads (about 10 us of
Python in all on a 2-core CI machine, the Triton launch path about as much per kernel):
small eager calls are bounded by that, which is why the engine captures decode in graphs.
With ``validate=False`` a cheap test (``_attention_checks``) is tried first and the
generic checks run only when it fails (they then name the bad value).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _attention_bwd, _attention_fwd, _common
from ._attention_checks import HEAD_DIMS, paged_fast_ok, store_fast_ok, varlen_fast_ok
from ._attention_bwd import BwdConfig
from ._attention_fwd import FwdConfig
from ._common import FLOAT_DTYPES, check_positive_float, check_same_device, check_tensor
from ._pdl import pdl, pdl_wait


# ----------------------------------------------------------------------------- KV cache store


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, Hk, D]
    kc_ptr, vc_ptr,  # [num_blocks, block_size, Hk, D]
    slot_ptr,  # [T] int64, -1 = skip
    block_size, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py)
):
    pdl_wait(PDL)
    # Grid (T,): one program copies one token's K and V rows (all KV heads); bits are moved, not computed.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_kv_heads)[:, None]
    kx = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    vx = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :], kx, mask=mask)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :], vx, mask=mask)


# ----------------------------------------------------------------------------- validation


def _checking(validate: bool) -> bool:
    """Value checks need host reads, which a CUDA graph capture forbids."""
    return validate and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def _check_heads(name_q: str, q: torch.Tensor, name_k: str, k: torch.Tensor) -> None:
    dim = q.shape[-1]
    if dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {dim} ({name_q} shape {tuple(q.shape)})")
    if k.shape[-1] != dim:
        raise ValueError(f"{name_k} head_dim must equal {name_q}'s {dim}, got shape {tuple(k.shape)}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    if k.dtype != q.dtype:
        raise TypeError(f"{name_k} must have {name_q}'s dtype {q.dtype}, got {k.dtype}")


def _scale(softmax_scale, dim: int) -> float:
    if softmax_scale is None:
        return dim ** -0.5
    return check_positive_float("softmax_scale", softmax_scale)


def _check_varlen(q, k, v, cu_seqlens, max_seqlen, validate):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=3, allow_empty=True)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1)
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    _check_heads("q", q, "k", k)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k's shape {tuple(k.shape)} and dtype {k.dtype}, "
                         f"got {tuple(v.shape)} {v.dtype}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same number of tokens, got {q.shape[0]} and {k.shape[0]}")
    if isinstance(max_seqlen, torch.Tensor) and max_seqlen.numel() == 1:
        max_seqlen = int(max_seqlen.item())
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if not _checking(validate):
        return max_seqlen
    cu = cu_seqlens.tolist()
    T = q.shape[0]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} exceeds the number of tokens T = {T}")
    longest = max(lengths, default=0)
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen = {max_seqlen} is shorter than the longest sequence ({longest})")
    return longest


def _check_cache(k_cache, v_cache, config: FwdConfig):
    check_tensor("k_cache", k_cache, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("v_cache", v_cache, dtypes=FLOAT_DTYPES, ndim=4)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache's shape {tuple(k_cache.shape)} and dtype "
                         f"{k_cache.dtype}, got {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"KV caches need a unit last stride, got {k_cache.stride()} / {v_cache.stride()}")
    block_size = k_cache.shape[1]
    if block_size % config.block_n:
        raise ValueError(f"block_size must be a multiple of the KV tile {config.block_n}, got {block_size}")


# ----------------------------------------------------------------------------- autograd


class _AttentionVarlenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, num_seqs, max_seqlen, scale, config, bwd_config):
        need_lse = any(ctx.needs_input_grad[:3])
        out, lse = _forward(q, k, v, cu_seqlens, num_seqs, max_seqlen, scale, need_lse, config)
        if need_lse:
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
            ctx.meta = (num_seqs, max_seqlen, scale, bwd_config)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        num_seqs, max_seqlen, scale, bwd_config = ctx.meta
        dq, dk, dv = _attention_bwd.attention_backward(
            dout, q, k, v, out, lse, cu_seqlens, num_seqs, max_seqlen, scale, bwd_config)
        return dq, dk, dv, None, None, None, None, None, None


def _forward(q, k, v, cu_seqlens, num_seqs, max_seqlen, scale, store_lse, config):
    T, hq, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, T), dtype=torch.float32, device=q.device) if store_lse else None
    if T > 0:
        _attention_fwd.launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen,
                                      scale, config)
    return out, lse


# ----------------------------------------------------------------------------- functional API


def attention_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, *,
                     validate: bool = True, config: FwdConfig | None = None,
                     bwd_config: BwdConfig | None = None):
    """Causal GQA attention over sequences packed along T; differentiable in q, k, v.

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (bf16 or fp32), ``cu_seqlens`` ``[S + 1]`` int32
    (0, monotone, ``cu[-1] <= T``); rows past ``cu[-1]`` are padding and return zeros.
    ``config``/``bwd_config`` override the tiling (for probing only: the contract holds
    only when prefill and decode use the same forward config).
    """
    if validate or not (_common.HOST_FAST_PATH and varlen_fast_ok(q, k, v, cu_seqlens, max_seqlen)):
        max_seqlen = _check_varlen(q, k, v, cu_seqlens, max_seqlen, validate)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    scale = _scale(softmax_scale, q.shape[-1])
    config = config or _attention_fwd.attention_config()
    bwd_config = bwd_config or _attention_bwd.attention_bwd_config()
    num_seqs = cu_seqlens.shape[0] - 1
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionVarlenFunction.apply(q, k, v, cu_seqlens, num_seqs, max_seqlen, scale, config,
                                      bwd_config)
    return _forward(q, k, v, cu_seqlens, num_seqs, max_seqlen, scale, False, config)[0]


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, validate: bool = True):
    """Write k/v ``[T, Hk, D]`` into the paged caches at flat slots (block * block_size +
    offset); slot -1 skips a row (padding)."""
    if validate or not (_common.HOST_FAST_PATH and store_fast_ok(k, v, k_cache, v_cache, slot_mapping)):
        _check_store(k, v, k_cache, v_cache, slot_mapping, validate)
    if k.shape[0] == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    hk, dim = k.shape[1], k.shape[2]
    p = pdl(k)
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1], hk,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(hk), PDL=p, num_warps=4, launch_pdl=p,
    )


def _check_store(k, v, k_cache, v_cache, slot_mapping, validate: bool) -> None:
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndim=3, allow_empty=True)
    check_tensor("v", v, dtypes=FLOAT_DTYPES, ndim=3, allow_empty=True)
    check_tensor("k_cache", k_cache, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("v_cache", v_cache, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, allow_empty=True)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k's shape {tuple(k.shape)} and dtype {k.dtype}, got {tuple(v.shape)} {v.dtype}")
    if v_cache.shape != k_cache.shape or k_cache.dtype != k.dtype or v_cache.dtype != k.dtype:
        raise ValueError(f"caches must share shape and k's dtype {k.dtype}, got {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache [.., Hk, D] = {tuple(k_cache.shape[2:])} must match k's {tuple(k.shape[1:])}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {slot_mapping.shape[0]}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"KV caches need a unit last stride, got {k_cache.stride()} / {v_cache.stride()}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if _checking(validate) and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping values must lie in [-1, {num_slots}), got min {lo} max {hi}")


def attention_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale=None, *,
                     validate: bool = True, config: FwdConfig | None = None):
    """One new query per sequence against its paged KV cache (its own K/V already stored).

    q ``[B, Hq, D]``, caches ``[num_blocks, block_size, Hk, D]``, ``block_tables``
    ``[B, max_blocks]`` int32, ``context_lens`` ``[B]`` int32 (cached positions including
    the current token; 0 gives a zero row). CUDA-graph capturable.
    """
    config = config or _attention_fwd.attention_config()
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    _check_cache(k_cache, v_cache, config)
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2)
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      context_lens=context_lens)
    _check_heads("q", q, "k_cache", k_cache)
    B = q.shape[0]
    if block_tables.shape[0] != B or context_lens.shape[0] != B:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must have one row per query (B = {B})")
    if B > 65535:
        raise ValueError(f"batch size must be <= 65535, got {B}")
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    if _checking(validate):
        _check_decode_values(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    q = _unit_last_stride(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _attention_fwd.launch_decode(q, k_cache, v_cache, block_tables, context_lens, out,
                                 _scale(softmax_scale, q.shape[-1]), config)
    return out


def attention_paged_prefill(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables,
                            query_starts, softmax_scale=None, *, validate: bool = True,
                            config: FwdConfig | None = None):
    """Causal attention of query rows that start past position 0 (chunked prefill,
    prefix-cache hits): sequence s has rows ``cu[s]:cu[s + 1]`` at positions
    ``query_starts[s] + [0, n_s)`` and reads K/V of positions ``[0, query_starts[s] + n_s)``
    from the paged caches (earlier chunks or cached blocks, and its own rows, stored
    before the call). A row's bits equal ``attention_varlen`` over the whole sequence and
    ``attention_decode`` at that position. Inference only (no autograd).

    q ``[T, Hq, D]``, caches ``[num_blocks, block_size, Hk, D]``, ``cu_seqlens`` ``[S + 1]``
    int32, ``max_seqlen`` the most query rows of one sequence, ``block_tables``
    ``[S, max_blocks]`` int32, ``query_starts`` ``[S]`` int32. Rows past ``cu[-1]`` get zeros.
    """
    config = config or _attention_fwd.attention_config()
    if validate or not (_common.HOST_FAST_PATH and paged_fast_ok(
            q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables, query_starts, config.block_n)):
        max_seqlen = _check_paged(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables, query_starts,
                                  validate, config)
    num_seqs = cu_seqlens.shape[0] - 1
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    q = _unit_last_stride(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] > 0:
        _attention_fwd.launch_prefill_paged(q, k_cache, v_cache, cu_seqlens, block_tables,
                                            query_starts, out, num_seqs, max_seqlen,
                                            _scale(softmax_scale, q.shape[-1]), config)
    return out


def _check_paged(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables, query_starts, validate: bool,
                 config: FwdConfig):
    """Every check of ``attention_paged_prefill``; returns ``max_seqlen`` as an int."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3, allow_empty=True)
    _check_cache(k_cache, v_cache, config)
    for name, t, ndim in (("cu_seqlens", cu_seqlens, 1), ("block_tables", block_tables, 2),
                          ("query_starts", query_starts, 1)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=ndim, allow_empty=name != "cu_seqlens")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens=cu_seqlens,
                      block_tables=block_tables, query_starts=query_starts)
    _check_heads("q", q, "k_cache", k_cache)
    num_seqs = cu_seqlens.shape[0] - 1
    if block_tables.shape[0] != num_seqs or query_starts.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and query_starts "
                         f"{tuple(query_starts.shape)} must have one row per sequence (S = {num_seqs})")
    max_seqlen = _check_varlen(q, q[:, :1], q[:, :1], cu_seqlens, max_seqlen, validate)
    if _checking(validate) and num_seqs:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(query_starts.device)
        if int(query_starts.min()) < 0:
            raise ValueError(f"query_starts must be >= 0, got min {int(query_starts.min())}")
        _check_decode_values(block_tables, query_starts + lengths, k_cache.shape[0], k_cache.shape[1])
    return max_seqlen


def _check_decode_values(block_tables, context_lens, num_blocks, block_size):
    ctx = context_lens.cpu()
    covered = block_tables.shape[1] * block_size
    if int(ctx.min()) < 0 or int(ctx.max()) > covered:
        raise ValueError(f"context_lens must lie in [0, {covered}] (block table width x block_size), "
                         f"got min {int(ctx.min())} max {int(ctx.max())}")
    used = (ctx + block_size - 1) // block_size  # blocks each sequence reads
    tables = block_tables.cpu()
    cols = torch.arange(tables.shape[1])[None, :] < used[:, None]
    ids = tables[cols]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables entries in use must lie in [0, {num_blocks}), "
                         f"got min {int(ids.min())} max {int(ids.max())}")

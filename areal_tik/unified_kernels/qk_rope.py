"""q/k head norm, rope and the K/V cache write of one attention layer in one launch.

What it computes: exactly ``rms_norm`` per head on q and k (Qwen3's q_norm / k_norm; skipped
when no weights are given, as for Qwen2 and Llama), then ``apply_rope`` on both, then, when a
cache is given, ``store_kv_cache`` of the rotated k and of v. The same bits as those three ops
(four launches per layer, three without the norms) in sequence: that composition is this op's
reference, and ``compose(UNIFIED_OPS, ...)`` is it (the stock op set runs ``compose`` over its own ops).

Why the bits are the same:

- The norm: a program takes the same ``ROWS`` consecutive (token, head) rows of the same
  ``[ROWS, BLOCK]`` tile as ``rms_norm``'s per-head kernel (``norm_config(head_dim)``, the
  same num_warps), loads it with the same address arithmetic from a token stride that is a
  multiple of 16 at a 16-byte aligned address (the same divisibility specialisation, so the
  same vector width and register layout), and reduces it with the same ``tl.sum`` and
  ``_rstd``. The two roundings (``x * rstd`` to the dtype, then ``* weight`` to the dtype)
  are the same elementwise operations on the halves of each row, reloaded from the input.
  ``tests/_layout_probe.py`` compiles both kernels for sm_90a on the CPU and finds the same
  reduction layout; ``tests/test_qk_rope.py``'s GPU test compares every output and cache bit
  with the composition on the published configs' shapes, views of a fused q|k|v output and
  contiguous tensors.
- The rope: the same explicit fma on the same fp32 values (the normed values rounded to the
  dtype, as the rope kernel loads them), one rounding to the dtype. Elementwise, so the
  grouping of rows into programs cannot matter.
- The cache write moves bits.

Where it runs: every forward without autograd (rollout prefill and decode, with the cache
write; a no-grad training-regime forward without it). Under autograd (the training forward)
and for inputs the fused kernel does not take (a token stride not a multiple of 16, an
unaligned view, rows wider than one norm block) the composition runs: the same bits, with
the backward of each op.

Saving: per layer of a Qwen3 decode step, four launches become one (three for Qwen2 and
Llama); the q and k rows are read once and never written back before the rotation.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch
import triton
import triton.language as tl

from ._common import env_switch, on_fast_device
from ._pdl import pdl, pdl_wait
from ._rounding import cast_rne
from ._attention_checks import store_fast_ok

# The op modules (the package attributes ``rms_norm`` and ``apply_rope`` are the functions).
_attention, _rms, _rope = (importlib.import_module(f".{name}", __package__)
                           for name in ("attention", "rms_norm", "rope"))

_EMULATE_RNE = _rms._EMULATE_RNE
# ``AREAL_TIK_FUSED_QK_ROPE=0``: always the composition (the same bits, more launches); read at
# call time, so a benchmark can time both in one process (``enabled``).
ENABLED = env_switch("AREAL_TIK_FUSED_QK_ROPE", True)


@contextlib.contextmanager
def enabled(on: bool):
    """``ENABLED`` set inside the block (a benchmark's side-by-side runs)."""
    global ENABLED
    saved, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = saved


@triton.jit
def _norm_rope_rows(
    x_ptr, stride_t, w_ptr, o_ptr, pos_ptr, cos_ptr, sin_ptr, n_rows, max_pos, eps, prog,
    v_ptr, stride_vt, stride_vh, kc_ptr, vc_ptr, slot_ptr, block_size,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEADS: tl.constexpr, H: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    # Rows r = prog * ROWS + [0, ROWS) of x [T, HEADS, H]: head r % HEADS of token r // HEADS,
    # as in rms_norm's per-head kernel (the same rows, tile, addresses and reduction).
    # Every load that depends on no other is issued first (positions, slots, x, weights, v),
    # then the tables at the positions: two memory latencies in a row instead of five (this
    # kernel is latency-bound at decode sizes: ~5 us a launch with the loads in use order).
    rows = prog.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    row_mask = row_ok[:, None]
    token = rows // HEADS
    head = rows % HEADS
    row_base = token * stride_t + head * H
    i = tl.arange(0, BLOCK_HALF)
    hmask = row_mask & (i < HALF)[None, :]
    pos = tl.load(pos_ptr + token, mask=row_ok, other=0).to(tl.int64)
    if STORE:
        slot = tl.load(slot_ptr + token, mask=row_ok, other=-1)
        d = tl.arange(0, BLOCK)
        dmask = row_mask & (d < H)[None, :]
        vx = tl.load(v_ptr + (token * stride_vt + head * stride_vh)[:, None] + d[None, :], mask=dmask)
    lo = x_ptr + row_base[:, None] + i[None, :]
    x_lo = tl.load(lo, mask=hmask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo + HALF, mask=hmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        cols = tl.arange(0, BLOCK)
        mask = row_mask & (cols < H)[None, :]
        x = _rms._load_row_block(x_ptr, x_ptr, x_ptr, row_base[:, None] + cols[None, :], mask, False, False,
                                 EMULATE_RNE)
        w_lo = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w_hi = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    # Rope tables, as _rotate_heads: out-of-range positions read no table and poison the row (NaN).
    ok = ((pos >= 0) & (pos < max_pos))[:, None] & (i < HALF)[None, :]
    c = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=float("nan"))
    s = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=float("nan"))
    if HAS_NORM:
        rstd = _rms._rstd(tl.sum(x * x, axis=1), eps, H)[:, None]
        n_lo = cast_rne(x_lo * rstd, o_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        n_hi = cast_rne(x_hi * rstd, o_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        x_lo = cast_rne(n_lo * w_lo, o_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        x_hi = cast_rne(n_hi * w_hi, o_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    out_lo = cast_rne(tl.fma(x_lo, c, -(x_hi * s)), o_ptr.dtype.element_ty, EMULATE_RNE)
    out_hi = cast_rne(tl.fma(x_hi, c, x_lo * s), o_ptr.dtype.element_ty, EMULATE_RNE)
    o = o_ptr + rows[:, None] * H + i[None, :]  # contiguous [T, HEADS, H]
    tl.store(o, out_lo, mask=hmask)
    tl.store(o + HALF, out_hi, mask=hmask)
    if STORE:  # store_kv_cache: slot -1 skips the token; bits are moved
        keep = row_mask & (slot >= 0)[:, None]
        blk = slot // block_size
        off = slot % block_size
        kc = kc_ptr + (blk * stride_kcb + off * stride_kcs + head * stride_kch)[:, None] + i[None, :]
        tl.store(kc, out_lo, mask=hmask & keep)
        tl.store(kc + HALF, out_hi, mask=hmask & keep)
        tl.store(vc_ptr + (blk * stride_vcb + off * stride_vcs + head * stride_vch)[:, None] + d[None, :], vx,
                 mask=dmask & keep)


# Row and program counts are data (do_not_specialize); the token strides are multiples of 16
# (the launcher's condition), the cache geometry is fixed per engine.
@triton.jit(do_not_specialize=["n_q_rows", "n_k_rows", "n_q_progs", "max_pos"])
def _qk_norm_rope_kernel(
    q_ptr, stride_qt,  # [T, HQ, H] with head stride H, unit last stride
    k_ptr, stride_kt,  # [T, HK, H]
    qw_ptr, kw_ptr,  # [H] q_norm / k_norm weights (read only if HAS_NORM)
    qo_ptr, ko_ptr,  # contiguous [T, HQ, H] / [T, HK, H] outputs
    pos_ptr, cos_ptr, sin_ptr,  # [T] positions; [max_pos, HALF] fp32 tables
    n_q_rows, n_k_rows, n_q_progs, max_pos, eps,
    v_ptr, stride_vt, stride_vh,  # [T, HK, H] values (read only if STORE)
    kc_ptr, vc_ptr, slot_ptr, block_size,  # [blocks, block_size, HK, H] caches; [T] int64 slots
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HQ: tl.constexpr, HK: tl.constexpr, H: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid: the q rows' programs, then the k rows' (the k programs also write the cache).
    pid = tl.program_id(0)
    if pid < n_q_progs:
        _norm_rope_rows(q_ptr, stride_qt, qw_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr, n_q_rows, max_pos, eps, pid,
                        v_ptr, stride_vt, stride_vh, kc_ptr, vc_ptr, slot_ptr, block_size,
                        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                        HQ, H, HALF, BLOCK, BLOCK_HALF, ROWS, HAS_NORM, False, EMULATE_RNE)
    else:
        _norm_rope_rows(k_ptr, stride_kt, kw_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, n_k_rows, max_pos, eps,
                        pid - n_q_progs,
                        v_ptr, stride_vt, stride_vh, kc_ptr, vc_ptr, slot_ptr, block_size,
                        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                        HK, H, HALF, BLOCK, BLOCK_HALF, ROWS, HAS_NORM, STORE, EMULATE_RNE)


# ---------------------------------------------------------------------------- launchers


def _heads_in_place(x: torch.Tensor) -> bool:
    """Rows the per-head norm reads in place (rms_norm._forward_heads' condition)."""
    _, heads, dim = x.shape
    return x.stride(2) == 1 and x.stride(1) == dim and x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0


def _aligned_weight(w) -> bool:
    return w is None or (w.is_contiguous() and w.data_ptr() % 16 == 0)


def fused_ok(q, k, q_weight, k_weight, v=None) -> bool:
    """Whether ``qk_norm_rope`` launches the fused kernel for these inputs (else the composition)."""
    if not ENABLED or q.dim() != 3 or k.dim() != 3 or q.shape[0] == 0:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, q_weight, k_weight, v)):
        return False
    dim = q.shape[2]
    return (_heads_in_place(q) and _heads_in_place(k) and _aligned_weight(q_weight) and _aligned_weight(k_weight)
            and _rms.norm_config(dim).n_chunks == 1 and (v is None or v.stride(-1) == 1))


def compose(ops, q, k, positions, cos, sin, q_weight=None, k_weight=None, eps=1e-6, *, v=None, k_cache=None,
            v_cache=None, slot_mapping=None, validate=True):
    """The op's definition: ``ops``' per-head ``rms_norm`` (when weights are given), ``apply_rope``,
    then ``store_kv_cache`` (when a cache is), in sequence. ``ops`` is any op table: ``UNIFIED_OPS``
    (this op's reference and its path under autograd) or a stock set (model/ops.py, whose
    compiled ops it then calls)."""
    if q_weight is not None:
        q, k = ops.rms_norm(q, q_weight, eps), ops.rms_norm(k, k_weight, eps)
    q, k = ops.apply_rope(q, k, positions, cos, sin)
    if k_cache is not None:
        ops.store_kv_cache(k, v, k_cache, v_cache, slot_mapping, validate=validate)
    return q, k


# The three unified ops ``compose`` runs for this op.
UNIFIED_OPS = types.SimpleNamespace(rms_norm=_rms.rms_norm, apply_rope=_rope.apply_rope,
                                    store_kv_cache=_attention.store_kv_cache)


def _check(q, k, positions, cos, sin, q_weight, k_weight, eps, v, k_cache, v_cache, slot_mapping, validate):
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together (or neither)")
    cache = (v, k_cache, v_cache, slot_mapping)
    if any(t is None for t in cache) and any(t is not None for t in cache):
        raise ValueError("v, k_cache, v_cache and slot_mapping must be given together (or none)")
    _rope._check(q, k, positions, cos, sin)
    if q_weight is not None:
        _rms._check(q, None, q_weight, eps)
        eps = _rms._check(k, None, k_weight, eps)
    if k_cache is not None and (validate or not store_fast_ok(k, v, k_cache, v_cache, slot_mapping)):
        _attention._check_store(k, v, k_cache, v_cache, slot_mapping, validate)
    return eps


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, *, v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                 validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` per-head RMS-normed (when ``q_weight`` / ``k_weight`` are given) and rotated by
    ``positions``; with ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` the rotated k and v
    are also written to the paged caches (slot -1 skips a token). Returns new contiguous
    ``(q_out, k_out)``: the bits of ``rms_norm``, ``apply_rope`` and ``store_kv_cache`` in sequence."""
    eps = _check(q, k, positions, cos, sin, q_weight, k_weight, eps, v, k_cache, v_cache, slot_mapping, validate)
    if not (on_fast_device(q, k, positions, cos) and fused_ok(q, k, q_weight, k_weight, v)):
        return compose(UNIFIED_OPS, q, k, positions, cos, sin, q_weight, k_weight, eps, v=v, k_cache=k_cache,
                       v_cache=v_cache, slot_mapping=slot_mapping, validate=validate)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    tokens, hq, dim = q.shape
    hk = k.shape[1]
    cfg = _rms.norm_config(dim)
    q_out = torch.empty((tokens, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, hk, dim), dtype=k.dtype, device=k.device)
    n_q_progs = triton.cdiv(tokens * hq, cfg.rows)
    n_k_progs = triton.cdiv(tokens * hk, cfg.rows)
    store = k_cache is not None
    if store:
        kcs, vcs = k_cache.stride(), v_cache.stride()
        cache_args = (v, v.stride(0), v.stride(1), k_cache, v_cache, slot_mapping, k_cache.shape[1],
                      kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2])
    else:  # never read: any pointers, the ints 1 (a fixed specialisation)
        cache_args = (k, 1, 1, k, k, positions, 1, 1, 1, 1, 1, 1, 1)
    has_norm = q_weight is not None
    p = pdl(q)
    _qk_norm_rope_kernel[(n_q_progs + n_k_progs,)](
        q, q.stride(0), k, k.stride(0), q_weight if has_norm else q, k_weight if has_norm else k,
        q_out, k_out, positions, cos, sin, tokens * hq, tokens * hk, n_q_progs, cos.shape[0], eps,
        *cache_args,
        HQ=hq, HK=hk, H=dim, HALF=dim // 2, BLOCK=cfg.block, BLOCK_HALF=triton.next_power_of_2(dim // 2),
        ROWS=cfg.rows, HAS_NORM=has_norm, STORE=store, EMULATE_RNE=_EMULATE_RNE, PDL=p,
        num_warps=cfg.num_warps, launch_pdl=p,
    )
    return q_out, k_out


__all__ = ["qk_norm_rope", "fused_ok", "compose", "UNIFIED_OPS"]

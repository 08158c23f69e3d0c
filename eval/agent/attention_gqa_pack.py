"""Agent candidate for the attention search (issue 15): prefill programs that pack the query
heads of one KV group at the same positions, instead of one head at twice the positions.

Hypothesis. The root's bf16 prefill program covers 2 x 64 consecutive positions of ONE query
head (``prefill_subtiles`` 2: 128 rows, 8 warps). Its rows reach the causal diagonal at two
different tiles, so every program walks one more KV tile than its first 64 rows need (an
exact no-op for them) and masks two tiles. Here a program covers 64 positions of TWO query
heads of the same KV group (GQA: Qwen3 has 16 query / 8 KV heads): the same 128 rows and 8
warps, the same K/V tile shared by both halves, but both halves stop at the same tile, so a
program walks cdiv(p0 + 64, 64) tiles instead of cdiv(p0 + 128, 64) for 128 rows and masks
one. Predicted: 2-5% less prefill / training-forward time at 1K-4K (fewer wasted tiles), about
1% at 16K; decode unchanged (the root's kernel).

Why the bits are the root's (the contract's argument for sub-tiles, applied to other rows):
each warp still owns 16 rows and issues the same MMA shapes and per-row instructions; rows
never interact; a row walks the same KV tiles 0, 1, ... of BLOCK_N anchored at 0 and folds the
same splits in order; the extra tile the root's first half walks is an exact no-op (p = 0,
alpha = 1), and whether a whole tile runs masked or unmasked does not change its bits (the
mask selects s everywhere there). The gate checks this against the root, bit for bit.

Groups of an odd size (no pair of heads shares a KV head) and fp32 inputs run the root's
launch.
"""
from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

F = importlib.import_module("areal_tik.unified_kernels._attention_fwd")
A = importlib.import_module("areal_tik.unified_kernels.attention")
cast_rne = F.cast_rne
_attn_split = F._attn_split
_attn_whole_split = F._attn_whole_split
_merge = F._merge
_finalize = F._finalize

CONFIG = F.attention_config()
PACK = 2  # query heads per program


@triton.jit(do_not_specialize=["num_seqs", "num_rows", "stride_lse_h"])
def _gqa_prefill_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_ptr,
    qk_scale, num_q_heads, group, num_seqs, num_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    HEAD_DIM: tl.constexpr, SUB_M: tl.constexpr, PACK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, UNMASKED_LOOP: tl.constexpr, STORE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid ((Hq / PACK_H) * (S + 1), cdiv(max_seqlen, SUB_M)): head packs vary fastest, the
    # position blocks run longest-first, slot S zeroes the padding rows [cu[S], T).
    BLOCK_M: tl.constexpr = SUB_M * PACK_H
    packs = num_q_heads // PACK_H
    pack = tl.program_id(0) % packs
    seq = tl.program_id(0) // packs
    tile_m = tl.num_programs(1) - 1 - tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, BLOCK_M)
    head = pack * PACK_H + r // SUB_M  # rows [j * SUB_M, (j + 1) * SUB_M): head j of the pack
    offset = r % SUB_M
    if seq == num_seqs:
        step = tl.num_programs(1) * SUB_M
        for r0 in range(tl.load(cu_ptr + num_seqs) + tile_m * SUB_M, num_rows, step):
            pad = (r0 + offset).to(tl.int64)
            tl.store(out_ptr + pad[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty),
                     mask=(pad < num_rows)[:, None])
        return
    start = tl.load(cu_ptr + seq)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    kvh = ((pack * PACK_H) // group).to(tl.int64)
    p0 = tile_m * SUB_M
    if p0 >= seqlen:
        return
    rows = p0 + offset  # positions (= query rows) of this program, the same for every head
    row_ok = rows < seqlen
    limit = tl.minimum(rows + 1, seqlen)
    row_t = (start + rows).to(tl.int64)
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = v_ptr + start.to(tl.int64) * stride_vt + kvh * stride_vh
    n_tiles = tl.cdiv(tl.minimum(p0 + SUB_M, seqlen), BLOCK_N)
    tile_full = (p0 + 1) // BLOCK_N
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    O = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = 0
    if UNMASKED_LOOP:
        first = tile_full // TILES_PER_SPLIT
        for sp in range(0, first):
            m, l, acc = _attn_whole_split(q, limit, sp * TILES_PER_SPLIT, qk_scale, k_base, v_base,
                                          stride_kt, stride_vt, BLOCK_M, BLOCK_N, HEAD_DIM,
                                          TILES_PER_SPLIT, DOT_FP32, PRECISION)
            M, L, O = _merge(M, L, O, m, l, acc)
    for sp in range(first, tl.cdiv(n_tiles, TILES_PER_SPLIT)):
        lo = sp * TILES_PER_SPLIT
        hi = tl.minimum(lo + TILES_PER_SPLIT, n_tiles)
        m, l, acc = _attn_split(q, limit, lo, tile_full, hi, seqlen, qk_scale, k_base, v_base, cu_ptr,
                                1, stride_kt, stride_vt, 0, 0,
                                False, BLOCK_M, BLOCK_N, HEAD_DIM, TILES_PER_SPLIT, UNMASKED_LOOP,
                                DOT_FP32, PRECISION)
        M, L, O = _merge(M, L, O, m, l, acc)
    out = cast_rne(_finalize(O, L), out_ptr.dtype.element_ty, DOT_FP32)
    tl.store(out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out,
             mask=row_ok[:, None])
    if STORE_LSE:
        tl.store(lse_ptr + head * stride_lse_h + start + rows, M + tl.math.log2(L), mask=row_ok)


def prefill(q, k, v, cu_seqlens, max_seqlen, store_lse=False):
    """(out [T, Hq, D], lse [Hq, T] fp32 log2-domain or None); LSE rows past cu[-1] unset."""
    T, hq, dim = q.shape
    hk = k.shape[1]
    group = hq // hk
    out = torch.empty_like(q)
    lse = torch.empty(hq, T, dtype=torch.float32, device=q.device) if store_lse else None
    num_seqs = cu_seqlens.shape[0] - 1
    sub_m, warps = F.prefill_tiling(CONFIG, q.dtype)
    if q.dtype == torch.float32 or group % PACK or sub_m != CONFIG.block_m * PACK:
        F.launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen, dim ** -0.5, CONFIG)
        return out, lse
    sub_m = CONFIG.block_m
    _gqa_prefill_fwd_kernel[(hq // PACK * (num_seqs + 1), max(1, triton.cdiv(max_seqlen, sub_m)))](
        q, k, v, out, lse if store_lse else out, cu_seqlens,
        dim ** -0.5 * F.LOG2E, hq, group, num_seqs, T,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if store_lse else 0,
        HEAD_DIM=dim, SUB_M=sub_m, PACK_H=PACK, BLOCK_N=CONFIG.block_n,
        TILES_PER_SPLIT=CONFIG.kv_split // CONFIG.block_n, UNMASKED_LOOP=CONFIG.unmasked_loop,
        STORE_LSE=store_lse, DOT_FP32=F.EMULATE, PRECISION=F._precision(q.dtype),
        num_warps=warps, num_stages=CONFIG.stages_prefill, enable_fp_fusion=False,
    )
    return out, lse


def decode(q, k_cache, v_cache, block_tables, context_lens):
    return A.attention_decode(q, k_cache, v_cache, block_tables, context_lens, validate=False, config=CONFIG)

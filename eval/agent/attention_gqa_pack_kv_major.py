"""Agent candidate for the attention search (issue 15), round 2: the GQA-packed prefill of
round 1 (attention_gqa_pack.py) with its grid turned KV-group-major: the position blocks of
one (sequence, head pack) are adjacent in launch order instead of the packs of one block.

Hypothesis. Round 1 (H100, audit a0003 at bfa1bf5) measured the packed programs at 0.89-0.95x
of the root's latency at batch 1-8 but 1.03-1.06x at batch 16 x 1K/4K (over the 1.05 cap). A
packed program covers 64 positions, where the root covers 128 and leaves the KV tile of a
group's second head to its neighbour in launch order; so the packed grid reads each KV prefix
from L2 or memory once per 64 positions, and it reuses the prefix only across the programs of
the other position blocks running beside it. With the packs of one position block adjacent
(the root's order) those are the (S + 1) x 8 programs of that block: about 3.7 blocks in flight
at batch 8 on 132 SMs, 1.9 at batch 16; hence batch 16 loses. Here program_id(0) walks the
position blocks of one (sequence, pack), longest first, so the programs in flight read the
prefixes of about 4 KV heads (a few MB, far below L2) and every KV tile comes from memory about
once. Predicted: every batch-16 prefill and training workload below 1.0x of the root, the
batch 1-8 ones as in round 1 or up to 3% better, decode unchanged (the root's kernel).

Why the bits are the root's: launch order changes only when a program runs; each program's
arithmetic is round 1's, whose bits the gate found equal to the root's (the sub-tile
argument: each warp owns 16 rows, issues the same MMA shapes, walks the same KV tiles
anchored at 0 and folds the same splits in order).

The second grid dimension holds packs x (S + 1), at most 65535: a batch with more sequences
than that allows, groups of an odd size and fp32 inputs run the root's launch.
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
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


@triton.jit(do_not_specialize=["num_seqs", "num_rows", "stride_lse_h"])
def _gqa_prefill_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_ptr,
    qk_scale, num_q_heads, group, num_seqs, num_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    HEAD_DIM: tl.constexpr, SUB_M: tl.constexpr, PACK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, UNMASKED_LOOP: tl.constexpr, STORE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid (cdiv(max_seqlen, SUB_M), (Hq / PACK_H) * (S + 1)): the position blocks of one
    # (sequence, pack) vary fastest, longest first; slot S zeroes the padding rows [cu[S], T).
    BLOCK_M: tl.constexpr = SUB_M * PACK_H
    packs = num_q_heads // PACK_H
    pack = tl.program_id(1) % packs
    seq = tl.program_id(1) // packs
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, BLOCK_M)
    head = pack * PACK_H + r // SUB_M  # rows [j * SUB_M, (j + 1) * SUB_M): head j of the pack
    offset = r % SUB_M
    if seq == num_seqs:
        step = tl.num_programs(0) * SUB_M
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
    if (q.dtype == torch.float32 or group % PACK or sub_m != CONFIG.block_m * PACK
            or hq // PACK * (num_seqs + 1) > MAX_GRID_Y):
        F.launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen, dim ** -0.5, CONFIG)
        return out, lse
    sub_m = CONFIG.block_m
    _gqa_prefill_fwd_kernel[(max(1, triton.cdiv(max_seqlen, sub_m)), hq // PACK * (num_seqs + 1))](
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

"""Attention forward kernels: ONE numerical core shared by prefill/training and paged decode.

Numerics (identical in every regime, which is what makes a row's bits regime-invariant):
a query row at position p walks the KV tiles 0, 1, 2, ... of a fixed ``BLOCK_N`` anchored
at position 0 up to its causal limit p + 1, grouped in splits of ``kv_split`` positions
(split s covers tiles [s * TPS, (s + 1) * TPS), TPS = kv_split // BLOCK_N). Inside a split
the online softmax starts fresh (m = -inf, l = 0, acc = 0) and updates per tile with
``_softmax_tile``:
    s     = q @ k^T                        (fp32 accumulate, tl.dot)
    s     = where(pos < limit, s, -inf)    (causal / context mask; exact identity elsewhere)
    m'    = max(m, rowmax(s) * qk_scale)   (qk_scale = softmax_scale * log2(e))
    p     = exp2(fma(s, qk_scale, -m'))
    alpha = 1 if m' == m else exp2(m - m')
    l'    = fma(l, alpha, rowsum(p))
    acc'  = dot(p.to(v.dtype), v, acc * alpha)
The split results are folded in split order by ``_merge`` starting from the empty state
(M = -inf, L = 0, O = 0), and the row's output is ``O / L`` (IEEE division) rounded once.
Prefill/training does the whole fold inside one program (splits made only of tiles every
row of the program sees whole run in a constant-trip loop without masks, then the
diagonal split); decode runs one program per split (partials stored exactly in fp32) and
the same fold in ``_decode_combine_kernel``, or in the same program when a single split
covers the block table.

Why the bits match: the MMA instruction shape, the rows each warp owns (block_m /
num_warps = 16) and the dtype fix the register layout, hence the order of the in-tile
reductions; decode programs use the config's (block_m, num_warps) and bf16 prefill
programs ``prefill_subtiles`` times both, so every warp runs the same instructions on its
own rows. Tiles past a row's limit inside a program's loop are exact no-ops (p = 0,
alpha = 1); tiles every row of a program sees whole skip the mask (it would select s
everywhere); masked loads read zeros for K and V, so garbage or NaN in unused cache slots
never reaches a result. Rows are independent in every step, so which other rows share a
tile (prefill: consecutive positions of one head; decode: the query heads of one KV-head
group, padded) does not matter. FMA contraction is disabled (``enable_fp_fusion=False``)
so the compiler cannot fuse a mul/add pair in one kernel and not in another; the two
fusions the core wants are written as explicit ``tl.fma``. Compiled for sm_90a, prefill
and decode carry the same wgmma shapes with one warp column (warpsPerCTA [w, 1]) and,
for one core loop and one merge each, the same per-thread counts of wgmma / ex2 / fma /
max instructions (``eval/probe_attention.py --aot --check``, run by the CPU test suite).

Under the Triton interpreter (CPU tests) the dots are broadcast-multiply + sum in fp32
(numpy's BLAS matmul changes a row's summation order with its row index) and bf16 casts
use the round-to-nearest-even emulation of ``_rounding.cast_rne``.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import triton
import triton.language as tl

from ._common import interpreting
from ._pdl import pdl, pdl_wait
from ._rounding import cast_rne

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Forward tiling. block_m, block_n, num_warps and kv_split fix the numerics and are
    shared by prefill/training and decode; the other fields change scheduling only.

    ``prefill_subtiles`` = s makes a bf16 prefill program cover s x block_m rows with
    s x num_warps warps: every warp still owns block_m / num_warps rows and issues the
    same MMA shapes and per-row instructions as a decode program (rows never interact),
    so the bits are those of s programs of block_m rows. fp32 inputs (FMA dots with
    blocked layouts, where that argument does not hold) always use one sub-tile."""

    block_m: int
    block_n: int
    num_warps: int
    kv_split: int  # positions per split, a power-of-two multiple of block_n
    stages_prefill: int = 3
    stages_decode: int = 3
    # Run the tiles every row sees whole in a loop without masks (bits are the same
    # either way: the mask selects s everywhere there; tests check it).
    unmasked_loop: bool = True
    prefill_subtiles: int = 1
    # Query heads of one KV group per prefill program (GQA): its block_m x prefill_subtiles
    # rows are prefill_pack_heads heads at the same positions instead of one head at more
    # positions, so all its rows stop at the same KV tile and share each K/V tile. A
    # divisor of prefill_subtiles: every warp still owns rows of one head. Launches whose
    # group size it does not divide, and fp32 (one sub-tile), run one head per program.
    prefill_pack_heads: int = 1
    # Launch order of prefill programs: 0 = heads (or head packs) fastest, then sequences,
    # position blocks longest first; c > 0 = a one-dimensional grid in chunks of c position
    # blocks, chunks longest first, the blocks of one (sequence, head pack) adjacent inside
    # a chunk (programs reading the same K/V prefix run together). Order changes when a
    # program runs, never what it computes.
    prefill_order_chunk: int = 0
    # Decode splits a KV group's query heads over more programs (each re-reads the group's
    # K/V) while its grid has fewer than decode_programs_per_sm programs per SM; 0 never
    # splits. Geometry only: rows never interact.
    decode_programs_per_sm: int = 2
    # Prefill / training (contiguous and paged) and decode: the K/V tiles every row of a
    # program sees whole are loaded through TMA descriptors (Hopper; bf16 / fp16 operands
    # with unit head-dim stride, heads adjacent, 16-byte aligned; see kv_descriptors), the
    # others (diagonal, masked) through pointers. The same values reach the same dots:
    # scheduling only.
    prefill_tma: bool = False
    decode_tma: bool = False

    def __post_init__(self):
        tiles = self.kv_split // self.block_n
        if self.kv_split % self.block_n or tiles < 1 or tiles & (tiles - 1):
            raise ValueError(f"kv_split must be a power-of-two multiple of block_n, got {self}")
        sub = self.prefill_subtiles
        if sub < 1 or sub & (sub - 1):
            raise ValueError(f"prefill_subtiles must be a power of two >= 1, got {self}")
        pack = self.prefill_pack_heads
        if pack < 1 or pack & (pack - 1) or sub % pack:
            raise ValueError(f"prefill_pack_heads must be a power of two dividing prefill_subtiles, got {self}")
        if self.prefill_order_chunk < 0:
            raise ValueError(f"prefill_order_chunk must be >= 0, got {self}")
        if self.decode_programs_per_sm < 0:
            raise ValueError(f"decode_programs_per_sm must be >= 0, got {self}")
        # Paged prefill programs start on row blocks aligned to the splits (see the kernel):
        # a program wider than a split walks a fully masked split (wrong bits, found by a
        # search), so every path refuses such a config here, once.
        rows = self.block_m * sub
        if self.kv_split % rows:
            raise ValueError(f"prefill rows per program (block_m x prefill_subtiles = {self.block_m} x {sub} "
                             f"= {rows}) must divide kv_split = {self.kv_split}, got {self}")


# H200 choice (bf16, D = 128). Numerics: 64 x 64 tiles, one warpgroup (wgmma m64).
# Decode packs only the Hq/Hk query heads of a group into its 64 rows, so 128-row tiles
# double its wasted MMA work (measured 1.3-2x slower decode). kv_split = 1024 (was 2048):
# decode at small batch and long context gets 2x the programs (B1 x 8K: 8 splits x 8 KV
# heads) without chunking the head group (which re-reads K/V); prefill restarts its online
# softmax every 16 tiles instead of 32 (a pipeline drain per split). Scheduling: bf16
# prefill runs 2 sub-tiles per program (128 rows, 8 warps; with 2048 splits measured 397 /
# 465 TFLOP/s at 4K / 16K vs 365 / 409 with 64-row programs) at 3 stages (4 measured
# worse at 64 rows). ptxas (sm_90a, D = 128): prefill 255 registers, 36 B spilled, 128
# KiB shared memory (one program per SM); decode 255 registers, 112 KiB (two per SM).
# eval/probe_attention.py times the alternatives from CUDA graphs (kv_split 512 / 1024 /
# 2048, sub-tiles, stages) and checks each for prefill == decode bits; change this line
# from its table. Prefill packs the two heads of a KV group into a program's 128 rows
# (prefill_pack_heads=2) and launches in chunks of 8 position blocks (prefill_order_chunk=8)
# since the agent-driven search promoted that launch (2026-12-07, H100 80GB, code 7730c1e,
# run eval/results/2026-12-07_h100_7730c1e/: candidate c0007, audit a0009, T(root)/T 1.060 on
# the 48 workloads, none over the 1.05 cap; bits equal to the root's, scheduling only).
# Prefill and training load whole K/V tiles through TMA descriptors (prefill_tma) since round 5
# promoted it on that root (2026-12-07, H100 80GB, code eb9edf2, run
# eval/results/2026-12-07_h100_eb9edf2/agent_round5/: candidate c0001, audit a0003, T(root)/T
# 1.020, largest workload ratio 1.023; decode's TMA loads stay off: round 4 measured them up to
# 1.46x slower). Decode keeps a KV group's query heads in one program (decode_programs_per_sm=0:
# each group's K/V read once) since the mechanical search promoted it on that root (2026-12-07,
# H100 80GB, code d719991, per-call timer, eval/results/2026-12-07_h100_eb9edf2/optimize_d719991/:
# candidate c0094, audit a0120, T(root)/T 1.013; decode 0.83-1.02x, largest workload 1.024x).
GPU_CONFIG = FwdConfig(block_m=64, block_n=64, num_warps=4, kv_split=1024, stages_prefill=3,
                       stages_decode=3, prefill_subtiles=2, prefill_pack_heads=2, prefill_order_chunk=8,
                       decode_programs_per_sm=0, prefill_tma=True)
# Interpreter: tiny tiles and a short split, so CPU tests cross several tiles and splits
# (and prefill runs 2 sub-tiles like the GPU default).
INTERP_CONFIG = FwdConfig(block_m=16, block_n=16, num_warps=4, kv_split=32, stages_prefill=1,
                          stages_decode=1, prefill_subtiles=2)


# Triton decides interpreter vs GPU when a kernel is decorated (at import), so reading
# the switch once here is exact, and saves an environment lookup per launch.
EMULATE = interpreting()


def attention_config() -> FwdConfig:
    return INTERP_CONFIG if EMULATE else GPU_CONFIG


def cdiv(a: int, b: int) -> int:
    # Host-side ceil division: ``triton.cdiv`` is a ConstexprFunction (~1.5 us a call).
    return -(-a // b)


# ----------------------------------------------------------------------------- core


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc [M, N] fp32 + a [M, K] @ b [K, N]; ``acc=None`` starts from zero."""
    if DOT_FP32:
        # Interpreter: fixed, row-independent summation order (sequential over K).
        prod = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        if acc is None:
            return prod
        else:
            return acc + prod
    else:
        if acc is None:
            return tl.dot(a, b, input_precision=PRECISION)
        else:
            return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _softmax_tile(q, kT, v, pos, limit, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step: q [BM, D], kT [D, BN], v [BN, D], pos [BN], limit [BM].
    MASKED=False is for tiles every row sees whole (the mask would select s everywhere)."""
    s = _dot(q, kT, None, DOT_FP32, PRECISION)
    if MASKED:
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # tl.fma does not broadcast: give it full [BM, BN] operands.
    scale = tl.full([BLOCK_M, BLOCK_N], qk_scale, tl.float32)
    p = tl.math.exp2(tl.fma(s, scale, tl.broadcast_to(-m_new[:, None], [BLOCK_M, BLOCK_N])))
    alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_new))
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    acc = acc * alpha[:, None]
    acc = _dot(cast_rne(p, v.dtype, DOT_FP32), v, acc, DOT_FP32, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_step(t, q, limit, n_valid, m_i, l_i, acc, qk_scale, k_base, v_base, tiles, ids,
             block_size, stride_k_pos, stride_v_pos, stride_k_blk, stride_v_blk,
             k_desc, v_desc, desc_row, desc_col,
             MASKED: tl.constexpr, PAGED: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr = False):
    """Load KV tile t (positions t * BLOCK_N + [0, BLOCK_N)) and apply one softmax step.
    TMA (whole tiles only): the tile comes through the descriptors k_desc / v_desc of K / V
    viewed as [rows, Hk * D] (contiguous: token rows, from desc_row; paged: the cache's
    block-major slots) at column desc_col; the same values reach the same dot as through
    the pointer loads."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    start = t * BLOCK_N
    if PAGED:
        # block_size is a multiple of BLOCK_N, so a tile lies inside one cache block.
        blk = tl.sum(tl.where(tiles == t, ids, 0), axis=0)
        slot = start % block_size
    if TMA and not MASKED:
        if PAGED:
            row = blk * block_size + slot  # < 2^31: kv_descriptors refuses taller views
        else:
            row = desc_row + start
        kT = tl.trans(k_desc.load([row, desc_col]))  # [D, BN]
        v = v_desc.load([row, desc_col])  # [BN, D]
        return _softmax_tile(q, kT, v, start + n, limit, m_i, l_i, acc, qk_scale, False,
                             BLOCK_M, BLOCK_N, DOT_FP32, PRECISION)
    if PAGED:
        k_tile = k_base + blk.to(tl.int64) * stride_k_blk + tl.cast(slot, tl.int64) * stride_k_pos
        v_tile = v_base + blk.to(tl.int64) * stride_v_blk + tl.cast(slot, tl.int64) * stride_v_pos
    else:
        k_tile = k_base + tl.cast(start, tl.int64) * stride_k_pos
        v_tile = v_base + tl.cast(start, tl.int64) * stride_v_pos
    # In-tile offsets are small int32; the tile base above is an int64 scalar.
    k_ptrs = k_tile + n[None, :] * stride_k_pos + d[:, None]  # [D, BN]
    v_ptrs = v_tile + n[:, None] * stride_v_pos + d[None, :]  # [BN, D]
    pos = start + n
    if MASKED:  # positions past n_valid read zeros: cache garbage / NaN never enters a dot
        valid = pos < n_valid
        kT = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        kT = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return _softmax_tile(q, kT, v, pos, limit, m_i, l_i, acc, qk_scale, MASKED,
                         BLOCK_M, BLOCK_N, DOT_FP32, PRECISION)


@triton.jit
def _attn_split(q, limit, tile_lo, tile_full, tile_hi, n_valid, qk_scale,
                k_base, v_base,  # K/V of this sequence and KV head (paged: of block 0, slot 0)
                table_ptr,  # [max_blocks] int32 block ids of this sequence (PAGED only)
                block_size, stride_k_pos, stride_v_pos, stride_k_blk, stride_v_blk,
                k_desc, v_desc, desc_row, desc_col,  # TMA only (see _kv_step)
                PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, UNMASKED_LOOP: tl.constexpr,
                DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr = False):
    """Fresh online softmax over KV tiles [tile_lo, tile_hi); returns (m, l, acc). With
    UNMASKED_LOOP, tiles below tile_full (whole for every row) skip the masks (and with
    TMA load through the descriptors)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if PAGED:
        # The split's block ids, read once: with the table read inside the loop the K/V
        # loads become indirect and the pipeliner keeps only 2 buffers whatever num_stages
        # says (80 KiB of shared memory at 2, 3 or 4 stages on sm_90, D=128).
        tiles = tile_lo + tl.arange(0, TILES_PER_SPLIT)
        ids = tl.load(table_ptr + (tiles * BLOCK_N) // block_size, mask=tiles < tile_hi, other=0)
    else:
        tiles = 0
        ids = 0
    mid = tile_lo
    if UNMASKED_LOOP:
        mid = tl.minimum(tl.maximum(tile_full, tile_lo), tile_hi)
        for t in range(tile_lo, mid):
            m_i, l_i, acc = _kv_step(t, q, limit, n_valid, m_i, l_i, acc, qk_scale, k_base,
                                     v_base, tiles, ids, block_size, stride_k_pos, stride_v_pos,
                                     stride_k_blk, stride_v_blk, k_desc, v_desc, desc_row, desc_col,
                                     False, PAGED, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_FP32, PRECISION, TMA)
    for t in range(mid, tile_hi):
        m_i, l_i, acc = _kv_step(t, q, limit, n_valid, m_i, l_i, acc, qk_scale, k_base, v_base,
                                 tiles, ids, block_size, stride_k_pos, stride_v_pos,
                                 stride_k_blk, stride_v_blk, k_desc, v_desc, desc_row, desc_col,
                                 True, PAGED, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_FP32, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attn_whole_split(q, limit, tile_lo, qk_scale, k_base, v_base, stride_k_pos, stride_v_pos,
                      k_desc, v_desc, desc_row, desc_col,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      TILES_PER_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                      PRECISION: tl.constexpr, TMA: tl.constexpr = False):
    """``_attn_split`` for a contiguous split whose tiles every row sees whole: the same
    unmasked steps with a constant trip count (no per-split bounds or empty masked loop).
    Asking Triton to fuse the loop over such splits (``tl.range(flatten=True)``) was
    tried: ptxas then serializes the wgmma pipeline (C7515) and spills twice as much."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j in range(0, TILES_PER_SPLIT):
        m_i, l_i, acc = _kv_step(tile_lo + j, q, limit, 0, m_i, l_i, acc, qk_scale, k_base, v_base,
                                 0, 0, 1, stride_k_pos, stride_v_pos, 0, 0,
                                 k_desc, v_desc, desc_row, desc_col, False, False,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, DOT_FP32, PRECISION, TMA)
    return m_i, l_i, acc


@triton.jit
def _merge(M, L, O, m, l, acc):
    """Fold one split's (m, l, acc) into the running (M, L, O); exact no-op for an empty split."""
    M_new = tl.maximum(M, m)
    a = tl.where(M == M_new, 1.0, tl.math.exp2(M - M_new))
    b = tl.where(m == M_new, 1.0, tl.math.exp2(m - M_new))
    L = L * a + l * b
    O = O * a[:, None] + acc * b[:, None]
    return M_new, L, O


@triton.jit
def _finalize(O, L):
    """O / L with IEEE division; rows with L == 0 (no context) give zeros."""
    den = tl.broadcast_to(L[:, None], O.shape)  # div_rn does not broadcast
    return tl.where(den > 0, tl.math.div_rn(O, den), 0.0)


# ----------------------------------------------------------------------------- kernels


# Integers that follow the packing (sequence and token counts, the LSE row stride = T, the
# block-table width) stay out of Triton's key: one compilation serves every packing. They
# only bound loops and offset addresses; the arithmetic on values is the same.
@triton.jit(do_not_specialize=["num_seqs", "num_rows", "n_blocks", "stride_lse_h", "stride_tb"])
def _prefill_fwd_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr, v_ptr,  # [T, Hk, D]
    k_desc, v_desc,  # TMA: descriptors of K / V as [T, Hk * D], box [BLOCK_N, D] (else unused)
    out_ptr,  # [T, Hq, D]
    lse_ptr,  # [Hq, T] fp32, log2 units (written when STORE_LSE)
    cu_ptr,  # [S + 1] int32 query rows of each sequence
    table_ptr,  # [S, max_blocks] int32 block ids (PAGED)
    start_ptr,  # [S] int32 position of each sequence's first query row (PAGED)
    qk_scale, num_q_heads, group, num_seqs, num_rows, block_size,
    n_blocks,  # position blocks per (sequence, head pack): the grid's second dimension or its chunks' span
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, stride_kb, stride_vb, stride_tb,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, UNMASKED_LOOP: tl.constexpr, STORE_LSE: tl.constexpr,
    PAGED: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    PACK_H: tl.constexpr, CHUNK: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid (Hq * (S + 1), cdiv(max_seqlen, BLOCK_M)): heads vary fastest so GQA siblings
    # share K/V in L2, and the M tiles run longest-first (causal work grows with the tile
    # index). The extra sequence slot S writes zeros to the padding rows [cu[S], T).
    # PAGED (chunked prefill, prefix-cache hits): the query rows of sequence s sit at
    # positions start[s] + [0, n_s) and read K/V (their own already stored) from the
    # paged caches k_ptr/v_ptr [num_blocks, block_size, Hk, D] through the block table.
    # The walk is the same: tiles 0, 1, ... anchored at position 0, splits folded in
    # order, so a row's bits do not depend on where its chunk starts. The start is a
    # runtime value: one compilation serves every offset.
    # PACK_H > 1: a program's BLOCK_M rows are PACK_H heads of one KV group (head pack
    # `unit`) at the same POS_M positions; CHUNK > 0: the chunked one-dimensional order
    # (FwdConfig.prefill_order_chunk). PACK_H = 1, CHUNK = 0 is the launch described above.
    POS_M: tl.constexpr = BLOCK_M // PACK_H
    units = num_q_heads // PACK_H
    if CHUNK == 0:
        blocks = tl.num_programs(1)
        unit = tl.program_id(0) % units
        seq = tl.program_id(0) // units
        tile_m = blocks - 1 - tl.program_id(1)
    else:
        blocks = n_blocks
        span = CHUNK * units * (num_seqs + 1)
        chunk = tl.program_id(0) // span
        rest = tl.program_id(0) - chunk * span
        width = tl.minimum(CHUNK, n_blocks - chunk * CHUNK)  # < CHUNK in the last chunk only
        unit = (rest // width) % units
        seq = (rest // width) // units
        tile_m = n_blocks - 1 - (chunk * CHUNK + rest % width)
    if PACK_H == 1:
        offs = tl.arange(0, BLOCK_M)
        head = unit
        o_head = head * stride_oh
        q_head = head * stride_qh
    else:
        offs = tl.arange(0, BLOCK_M) % POS_M
        head = unit * PACK_H + tl.arange(0, BLOCK_M) // POS_M  # per row
        o_head = head[:, None] * stride_oh
        q_head = head[:, None] * stride_qh
    d = tl.arange(0, HEAD_DIM)
    if seq == num_seqs:
        step = blocks * POS_M
        for r0 in range(tl.load(cu_ptr + num_seqs) + tile_m * POS_M, num_rows, step):
            pad = (r0 + offs).to(tl.int64)
            tl.store(out_ptr + pad[:, None] * stride_ot + o_head + d[None, :],
                     tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty),
                     mask=(pad < num_rows)[:, None])
        return
    start = tl.load(cu_ptr + seq)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    kvh = ((unit * PACK_H) // group).to(tl.int64)
    if PAGED:
        # Programs cover position blocks aligned to POS_M (which divides the split size),
        # not chunk-relative ones: then the last split a program walks starts at or before
        # its first row, so every split holds an unmasked position for every row (a fully
        # masked split would give m = -inf and NaN, not the no-op of an empty split). The
        # grid has one program more than cdiv(max_seqlen, POS_M) for the unaligned start.
        ctx0 = tl.load(start_ptr + seq)  # position of query row 0
        p0 = (ctx0 // POS_M + tile_m) * POS_M
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        table = table_ptr + seq.to(tl.int64) * stride_tb
    else:
        ctx0 = 0
        p0 = tile_m * POS_M
        k_base = k_ptr + start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_base = v_ptr + start.to(tl.int64) * stride_vt + kvh * stride_vh
        table = cu_ptr  # unused
    desc_col = (kvh * HEAD_DIM).to(tl.int32)  # TMA: this KV head's columns of [T, Hk * D]
    n_ctx = ctx0 + seqlen  # K/V positions [0, n_ctx) hold this sequence's keys
    if p0 >= n_ctx:
        return
    pos = p0 + offs  # positions of this program's rows
    rows = pos - ctx0  # query-row index inside the sequence
    if PAGED:
        row_ok = (rows >= 0) & (rows < seqlen)
        limit = tl.where(row_ok, pos + 1, n_ctx)  # padding rows of the tile see the whole sequence
    else:  # (the same values; this form measured 36 B of spills instead of 68 at D = 128)
        row_ok = rows < seqlen
        limit = tl.minimum(rows + 1, seqlen)
    row_t = (start + rows).to(tl.int64)
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)
    n_tiles = tl.cdiv(tl.minimum(p0 + POS_M, n_ctx), BLOCK_N)
    tile_full = (p0 + 1) // BLOCK_N  # tiles below this one are whole for every row here
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    O = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Splits 0, 1, ... in order, each a fresh online softmax folded into (M, L, O): first
    # the splits made only of whole tiles, then the rest (the diagonal) with masks.
    first = 0
    if UNMASKED_LOOP and not PAGED:  # paged: _attn_split runs whole tiles unmasked too
        first = tile_full // TILES_PER_SPLIT
        for sp in range(0, first):
            m, l, acc = _attn_whole_split(q, limit, sp * TILES_PER_SPLIT, qk_scale, k_base, v_base,
                                          stride_kt, stride_vt, k_desc, v_desc, start, desc_col,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, TILES_PER_SPLIT, DOT_FP32,
                                          PRECISION, TMA)
            M, L, O = _merge(M, L, O, m, l, acc)
    for sp in range(first, tl.cdiv(n_tiles, TILES_PER_SPLIT)):
        lo = sp * TILES_PER_SPLIT
        hi = tl.minimum(lo + TILES_PER_SPLIT, n_tiles)
        m, l, acc = _attn_split(q, limit, lo, tile_full, hi, n_ctx, qk_scale,
                                k_base, v_base, table,
                                block_size, stride_kt, stride_vt, stride_kb, stride_vb,
                                k_desc, v_desc, start, desc_col,
                                PAGED, BLOCK_M, BLOCK_N, HEAD_DIM, TILES_PER_SPLIT, UNMASKED_LOOP,
                                DOT_FP32, PRECISION, TMA)
        M, L, O = _merge(M, L, O, m, l, acc)
    out = cast_rne(_finalize(O, L), out_ptr.dtype.element_ty, DOT_FP32)
    tl.store(out_ptr + row_t[:, None] * stride_ot + o_head + d[None, :], out,
             mask=row_ok[:, None])
    if STORE_LSE:
        tl.store(lse_ptr + head * stride_lse_h + start + rows, M + tl.math.log2(L), mask=row_ok)


# rows_per_prog follows the batch size, num_splits and stride_tb the block-table width.
@triton.jit(do_not_specialize=["rows_per_prog", "num_splits", "stride_tb"])
def _decode_fwd_kernel(
    q_ptr,  # [B, Hq, D]
    kc_ptr, vc_ptr,  # [num_blocks, block_size, Hk, D]
    k_desc, v_desc,  # TMA: descriptors of the caches as [num_blocks * block_size, Hk * D] (else unused)
    table_ptr,  # [B, max_blocks] int32
    ctx_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (written when DIRECT)
    part_ptr,  # fp32 [P * D] o partials then [P, 2] (m, l); P = B * Hq * num_splits (unless DIRECT)
    qk_scale, num_q_heads, group, rows_per_prog, block_size, num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, UNMASKED_LOOP: tl.constexpr, DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid (num_splits, Hk * chunks, B), all from static shapes (num_splits from the block
    # table's width): one program per (split, KV head, chunk of its query heads,
    # sequence). The chunking only spreads small batches over more SMs; each row's
    # arithmetic is the same whichever rows share its tile.
    sp = tl.program_id(0)
    chunks = tl.cdiv(group, rows_per_prog)
    kvh = tl.program_id(1) // chunks
    chunk = tl.program_id(1) % chunks
    b = tl.program_id(2).to(tl.int64)
    ctx = tl.load(ctx_ptr + b)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    lo = sp * TILES_PER_SPLIT
    if (sp > 0) & (lo >= n_tiles):
        return  # split past this sequence's context (split 0 always runs: ctx 0 -> zeros)
    r = tl.arange(0, BLOCK_M)
    gi = chunk * rows_per_prog + r  # index inside the KV-head group
    row_ok = (r < rows_per_prog) & (gi < group)
    head = kvh * group + gi
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    limit = tl.zeros([BLOCK_M], tl.int32) + ctx
    k_base = kc_ptr + kvh.to(tl.int64) * stride_kh
    v_base = vc_ptr + kvh.to(tl.int64) * stride_vh
    hi = tl.minimum(lo + TILES_PER_SPLIT, n_tiles)
    m, l, acc = _attn_split(q, limit, lo, ctx // BLOCK_N, hi, ctx, qk_scale, k_base, v_base,
                            table_ptr + b * stride_tb, block_size, stride_ks, stride_vs,
                            stride_kb, stride_vb, k_desc, v_desc, 0, (kvh * HEAD_DIM).to(tl.int32),
                            True, BLOCK_M, BLOCK_N, HEAD_DIM, TILES_PER_SPLIT, UNMASKED_LOOP,
                            DOT_FP32, PRECISION, TMA)
    if DIRECT:
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        O = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        M, L, O = _merge(M, L, O, m, l, acc)
        out = cast_rne(_finalize(O, L), out_ptr.dtype.element_ty, DOT_FP32)
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :], out,
                 mask=row_ok[:, None])
    else:
        # Partials stored exactly (fp32), partial index (b, head, split).
        part = (b * num_q_heads + head) * num_splits + sp
        ml_ptr = part_ptr + tl.num_programs(2).to(tl.int64) * num_q_heads * num_splits * HEAD_DIM
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + 2 * part, m, mask=row_ok)
        tl.store(ml_ptr + 2 * part + 1, l, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    part_ptr,  # fp32 [P * D] o partials then [P, 2] (m, l); P = B * Hq * num_splits
    ctx_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]
    num_q_heads, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, EMULATE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl.py): no numerics
):
    pdl_wait(PDL)
    # Grid (B, cdiv(Hq, BLOCK_H)): the fold of _merge over splits 0, 1, ... in order,
    # exactly as the prefill program does it in registers.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_q_heads
    d = tl.arange(0, HEAD_DIM)
    ctx = tl.load(ctx_ptr + b)
    ml_ptr = part_ptr + tl.num_programs(0).to(tl.int64) * num_q_heads * num_splits * HEAD_DIM
    M = tl.full([BLOCK_H], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_H], tl.float32)
    O = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    base = (b * num_q_heads + h) * num_splits
    for sp in range(0, tl.maximum(tl.cdiv(ctx, SPLIT), 1)):
        m = tl.load(ml_ptr + 2 * (base + sp), mask=h_ok, other=0.0)
        l = tl.load(ml_ptr + 2 * (base + sp) + 1, mask=h_ok, other=0.0)
        acc = tl.load(part_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :],
                      mask=h_ok[:, None], other=0.0)
        M, L, O = _merge(M, L, O, m, l, acc)
    out = cast_rne(_finalize(O, L), out_ptr.dtype.element_ty, EMULATE)
    tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + d[None, :], out, mask=h_ok[:, None])


# ----------------------------------------------------------------------------- launchers


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 FMAs (never TF32); bf16 goes to the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so CPU tests also exercise the head-chunked decode
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def prefill_tiling(config: FwdConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, warps) of a prefill program: ``prefill_subtiles`` sub-tiles for bf16."""
    sub = config.prefill_subtiles if dtype != torch.float32 else 1
    return config.block_m * sub, config.num_warps * sub


def prefill_packing(config: FwdConfig, dtype: torch.dtype, hq: int, hk: int) -> tuple[int, int]:
    """(query heads per prefill program, launch-order chunk) of a launch: the config's head
    pack where it divides the GQA group and the program has that many sub-tiles (fp32 runs
    one sub-tile), else 1; the chunk as configured (0: the default order)."""
    pack = config.prefill_pack_heads
    if dtype == torch.float32 or (hq // hk) % pack:
        pack = 1
    return pack, config.prefill_order_chunk


def launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen, softmax_scale,
                   config: FwdConfig):
    """Causal varlen forward into ``out`` [T, Hq, D] (rows past the last sequence get
    zeros); also the log2-domain LSE [Hq, T] when ``lse`` is given (training).
    One launch; the grid comes from shapes and the int ``max_seqlen``, no host reads."""
    _launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen, softmax_scale, config,
                    paged=None)


def launch_prefill_paged(q, k_cache, v_cache, cu_seqlens, block_tables, query_starts, out,
                         num_seqs, max_seqlen, softmax_scale, config: FwdConfig):
    """``launch_prefill`` for query rows at positions ``query_starts[s] + [0, n_s)`` whose
    K/V (earlier positions and their own) are in the paged caches. One launch, no host reads."""
    _launch_prefill(q, k_cache, v_cache, cu_seqlens, out, None, num_seqs, max_seqlen,
                    softmax_scale, config, paged=(block_tables, query_starts))


@functools.lru_cache(maxsize=None)
def _pointer_loads_instead(reason: str) -> None:
    """Say once per reason that a config asking for TMA loads runs pointer loads (the same
    bits: scheduling only). A warning, not a log record: AReaL's logging set-up disables the
    loggers that exist before it runs."""
    warnings.warn(f"attention: TMA loads asked for, pointer loads used: {reason}", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def kv_descriptors(k, v, block_n: int, wanted: bool):
    """TMA descriptors of K and V as 2-D [rows, Hk * D] with a [block_n, D] box: contiguous
    [T, Hk, D] by token row, paged caches [num_blocks, block_size, Hk, D] by block-major
    slot (block * block_size + slot). None where not ``wanted``, or where they cannot run;
    the pointer loads give the same bits. fp32 operands are outside the knob (their FMA dots
    take pointer loads) and need no word. Anything else says so with a RuntimeWarning, once
    per reason: no descriptor support, a GPU before Hopper, a head-dim stride other than 1,
    heads not adjacent, a cache whose blocks are not back to back, a base or row stride not
    16-byte aligned, 2^31 rows or more (int32 coordinates), no rows."""
    if not wanted or k.dtype == torch.float32:
        return None
    reason = None
    if TensorDescriptor is None:
        reason = "this triton has no host-side tensor descriptors"
    elif not EMULATE and not (k.is_cuda and _hopper_or_newer(k.device.index)):
        reason = "not a Hopper-or-newer GPU"
    descs = []
    for x in (k, v):
        if reason is not None:
            break
        hk, dim = x.shape[-2:]
        row = x.stride(-3)
        rows = x.shape[0] * (x.shape[1] if x.dim() == 4 else 1)
        if x.dim() == 4 and x.stride(0) != x.shape[1] * row:
            reason = "cache blocks not back to back"
        elif x.stride(-1) != 1 or x.stride(-2) != dim:
            reason = "head dim not unit-strided or heads not adjacent"
        elif (row * x.element_size()) % 16 or x.data_ptr() % 16:
            reason = "base or row stride not 16-byte aligned"
        elif not 0 < rows < 2 ** 31:
            reason = f"{rows} rows (TMA coordinates are int32)"
        else:
            descs.append(TensorDescriptor(x, [rows, hk * dim], [row, 1], [block_n, dim]))
    if reason is not None:
        _pointer_loads_instead(reason)
        return None
    return tuple(descs)


def _launch_prefill(q, k, v, cu_seqlens, out, lse, num_seqs, max_seqlen, softmax_scale,
                    config: FwdConfig, paged):
    T, hq, dim = q.shape
    store_lse = lse is not None
    block_m, warps = prefill_tiling(config, q.dtype)
    if paged is None:  # k/v [T, Hk, D]
        table, starts, block_size, stride_tb = cu_seqlens, cu_seqlens, 1, 0
        stride_kp, stride_kh, stride_kb = k.stride(0), k.stride(1), 0
        stride_vp, stride_vh, stride_vb = v.stride(0), v.stride(1), 0
    else:  # caches [num_blocks, block_size, Hk, D]
        table, starts = paged
        block_size, stride_tb = k.shape[1], table.stride(0)
        stride_kb, stride_kp, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vp, stride_vh = v.stride(0), v.stride(1), v.stride(2)
    hk = k.shape[-2]
    pack, chunk = prefill_packing(config, q.dtype, hq, hk)
    positions = block_m // pack
    blocks = max(1, cdiv(max_seqlen, positions)) + (paged is not None)
    units = hq // pack * (num_seqs + 1)
    grid = (units, blocks) if chunk == 0 else (blocks * units,)
    descs = kv_descriptors(k, v, config.block_n, config.prefill_tma)
    p = pdl(q)
    _prefill_fwd_kernel[grid](
        q, k, v, *(descs or (k, v)), out, lse if store_lse else out, cu_seqlens, table, starts,
        softmax_scale * LOG2E, hq, hq // hk, num_seqs, T, block_size, blocks,
        q.stride(0), q.stride(1), stride_kp, stride_kh, stride_vp, stride_vh,
        out.stride(0), out.stride(1), lse.stride(0) if store_lse else 0,
        stride_kb, stride_vb, stride_tb,
        HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=config.block_n,
        TILES_PER_SPLIT=config.kv_split // config.block_n, UNMASKED_LOOP=config.unmasked_loop,
        STORE_LSE=store_lse, PAGED=paged is not None,
        DOT_FP32=EMULATE, PRECISION=_precision(q.dtype), PACK_H=pack, CHUNK=chunk,
        TMA=descs is not None, PDL=p, num_warps=warps, num_stages=config.stages_prefill, enable_fp_fusion=False,
        launch_pdl=p,
    )


def _decode_rows_per_program(batch, hk, group, num_splits, block_m, num_sms, programs_per_sm):
    """Query heads per decode program: the whole group, halved while the grid has fewer
    than ``programs_per_sm`` programs per SM (geometry only: rows never interact)."""
    rows = min(group, block_m)
    while rows > 1 and batch * hk * num_splits * cdiv(group, rows) < programs_per_sm * num_sms:
        rows = cdiv(rows, 2)
    return rows


def launch_decode(q, k_cache, v_cache, block_tables, context_lens, out, softmax_scale,
                  config: FwdConfig):
    """Paged decode into ``out`` [B, Hq, D]. The grid and the split count come from static
    shapes (B, heads, the block table's width), never from tensor values: no host reads,
    CUDA-graph capturable. One launch when the table covers one KV split, else two (split
    programs, then the in-order combine) and one fp32 workspace allocation."""
    B, hq, dim = q.shape
    _, block_size, hk, _ = k_cache.shape
    group = hq // hk
    num_splits = max(1, cdiv(block_tables.shape[1] * block_size, config.kv_split))
    direct = num_splits == 1
    rows = _decode_rows_per_program(B, hk, group, num_splits, config.block_m, _sm_count(q.device),
                                    config.decode_programs_per_sm)
    part = out if direct else torch.empty(B * hq * num_splits * (dim + 2), dtype=torch.float32,
                                          device=q.device)
    descs = kv_descriptors(k_cache, v_cache, config.block_n, config.decode_tma)
    p = pdl(q)
    _decode_fwd_kernel[(num_splits, hk * cdiv(group, rows), B)](
        q, k_cache, v_cache, *(descs or (k_cache, v_cache)), block_tables, context_lens, out, part,
        softmax_scale * LOG2E, hq, group, rows, block_size, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        TILES_PER_SPLIT=config.kv_split // config.block_n, UNMASKED_LOOP=config.unmasked_loop,
        DIRECT=direct, DOT_FP32=EMULATE, PRECISION=_precision(q.dtype), TMA=descs is not None, PDL=p,
        num_warps=config.num_warps, num_stages=config.stages_decode, enable_fp_fusion=False, launch_pdl=p,
    )
    if not direct:
        block_h = min(16, triton.next_power_of_2(hq))
        _decode_combine_kernel[(B, cdiv(hq, block_h))](
            part, context_lens, out, hq, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=dim, BLOCK_H=block_h, SPLIT=config.kv_split, EMULATE=EMULATE, PDL=p,
            num_warps=4, enable_fp_fusion=False, launch_pdl=p,
        )

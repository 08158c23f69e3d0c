"""The unified linear's per-element reduction: each K group's chain and the groups' tree.

Device functions of the two kernels in linear.py (the tiled kernel's pointer loads and
the persistent kernel's TMA loads run the same chain); linear.py's docstring has the
numerics, ``_ktree`` the tree's definition and its host side.
"""
import triton
import triton.language as tl


@triton.jit
def _dot_step(a, b, acc, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc + a @ b for one K block: the per-element chain every kernel and config shares.
    if INTERPRET:
        # fp64 makes each block's sum of bf16 products exact, so the result does not
        # depend on the summation order numpy's matmul picks per block shape.
        acc64 = tl.dot(a.to(tl.float64), b.to(tl.float64), acc.to(tl.float64), out_dtype=tl.float64)
        return acc64.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


# The K-group tree (see _ktree): group g covers columns [g K/G, (g+1) K/G). The kernels
# unroll it statically: acc = s0, then for level 0, 1, 2 (while 2^level < G) acc = acc +
# (the subtree of the next 2^level groups), i.e. ((s0 + s1) + (s2 + s3)) + ((s4 + s5) +
# (s6 + s7)), left + right in fp32. Evaluated left to right, at most log2(G) + 1
# accumulators are live (G = 8: s0123, s45, s6 and the running s7). Register pressure:
# each is a BLOCK_M x BLOCK_N fp32 tile, BLOCK_M * BLOCK_N / (32 * num_warps) registers
# per thread (8 for 64x16 on 4 warps, 64 for 64x128, 128 for 256x128 on 8 warps). ptxas
# (sm_90a, triton 3.6, bf16) reports: decode 64x16/w4/s20 no spills at G = 1, 2, 8 (121,
# 165, 254 registers); persistent 256x128/w8/s3 none at G = 1 (156 registers), 0.8 KB
# of spill stores per thread at G = 2 and 12 KB at G = 8; the tiled 256x128/w8/s3 already
# spills 0.8 KB at G = 1, 2.8 KB at G = 2, 10 KB at G = 8. eval/bench_linear.py
# --k-groups times what that costs; smaller tiles for G > 1 would change no bits.
# Every group is a runtime loop finished before its add, so no tree add can fold into a
# dot's accumulator (Triton rewrites dot(a, b, 0) + c as dot(a, b, c)). K_GROUPS = 1 is
# the one-group chain over all of K: today's code, unchanged.
@triton.jit
def _tiled_group(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk, INDEX: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 MASK_ROWS: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Group INDEX: its blocks 0, 1, 2, ... in order (anchored at its first column), fp32
    # accumulator from zero, the last block masked at the group's end (EVEN_K: group_k %
    # BLOCK_K == 0, nothing to mask).
    if INDEX > 0:
        x_ptrs += INDEX * group_k * stride_xk
        w_ptrs += INDEX * group_k * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(group_k, BLOCK_K)):
        if EVEN_K and not MASK_ROWS:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < group_k - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot_step(a, b, acc, INTERPRET, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _tiled_subtree(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk,
                   FIRST: tl.constexpr, COUNT: tl.constexpr,  # groups FIRST .. FIRST + COUNT - 1; COUNT 1, 2, 4
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   MASK_ROWS: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    acc = _tiled_group(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk, FIRST,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MASK_ROWS, INTERPRET, DOT_PRECISION)
    if COUNT >= 2:
        acc = acc + _tiled_group(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk, FIRST + 1,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MASK_ROWS, INTERPRET, DOT_PRECISION)
    if COUNT == 4:
        acc = acc + _tiled_subtree(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk, FIRST + 2, 2,
                                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MASK_ROWS, INTERPRET, DOT_PRECISION)
    return acc


@triton.jit
def _tma_group(x_desc, w_desc, off_m, off_n, group_k, INDEX: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The tiled kernel's group chain through TMA: blocks of group INDEX in order, zeros
    # past K (TMA fills out-of-bounds boxes with zeros). Inside K a box past a group's end
    # would read the next group: the launcher takes this kernel for K_GROUPS > 1 only when
    # group_k % BLOCK_K == 0.
    if INDEX > 0:
        k0 = INDEX * group_k
    else:
        k0 = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(group_k, BLOCK_K)):
        a = x_desc.load([off_m, k0 + kb * BLOCK_K])
        b = w_desc.load([off_n, k0 + kb * BLOCK_K])
        acc = _dot_step(a, b.T, acc, INTERPRET, DOT_PRECISION)
    return acc


@triton.jit
def _tma_subtree(x_desc, w_desc, off_m, off_n, group_k, FIRST: tl.constexpr, COUNT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # As _tiled_subtree: groups FIRST .. FIRST + COUNT - 1 (COUNT 1, 2, 4), left + right.
    acc = _tma_group(x_desc, w_desc, off_m, off_n, group_k, FIRST, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, DOT_PRECISION)
    if COUNT >= 2:
        acc = acc + _tma_group(x_desc, w_desc, off_m, off_n, group_k, FIRST + 1,
                               BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, DOT_PRECISION)
    if COUNT == 4:
        acc = acc + _tma_subtree(x_desc, w_desc, off_m, off_n, group_k, FIRST + 2, 2,
                                 BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, DOT_PRECISION)
    return acc

"""The unified linear's per-element reduction: each K group's chain and the groups' tree.

Device functions of the two kernels in linear.py (the tiled kernel's pointer loads and
the persistent kernel's TMA loads run the same chain); linear.py's docstring has the
numerics, ``_ktree`` the tree's definition and its host side.
"""
import triton
import triton.language as tl


# K of one tensor-core instruction for 16-bit operands (wgmma / mma k16). A bf16 tl.dot over
# a BLOCK_K-wide block is BLOCK_K / 16 such instructions chained on the accumulator in K
# order, so the chain's steps are 16 columns wide whatever BLOCK_K is: BLOCK_K (any
# multiple of 16) is geometry, not numerics (the H200 / H100 bits: tests/test_linear.py
# test_gpu_block_k_is_geometry; eval/probe_block_k.py). fp32 operands ("ieee") run one FMA
# per k on the GPU: any BLOCK_K gives their bits too.
MMA_K = tl.constexpr(16)


@triton.jit
def _dot_step(a, b, acc, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc + a @ b for one K block: the per-element chain every kernel and config shares.
    if INTERPRET:
        # The interpreter models the MMA's chain: one step per MMA_K columns, each step's
        # sum of products and the accumulator added in fp64 (exact for bf16 products, so
        # numpy's summation order inside a step does not matter), rounded to fp32.
        tl.static_assert(a.shape[1] % MMA_K == 0, "BLOCK_K must be a multiple of the MMA's K (16)")
        a64 = a.to(tl.float64)
        b64 = b.to(tl.float64)
        if a.shape[1] == MMA_K:
            acc = tl.dot(a64, b64, acc.to(tl.float64), out_dtype=tl.float64).to(tl.float32)
        else:
            ks = tl.arange(0, a.shape[1])
            for step in tl.static_range(a.shape[1] // MMA_K):
                cols = (ks >= step * MMA_K) & (ks < (step + 1) * MMA_K)
                acc = tl.dot(tl.where(cols[None, :], a64, 0.0), b64, acc.to(tl.float64),
                             out_dtype=tl.float64).to(tl.float32)
        return acc
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _load_block(x_ptrs, w_ptrs, offs_m, offs_k, M, k_left, EVEN_K: tl.constexpr, MASK_ROWS: tl.constexpr):
    # One K block of x [BLOCK_M, BLOCK_K] and weight [BLOCK_K, BLOCK_N]; columns from
    # k_left on (past the group's end) and, with MASK_ROWS, rows past M read zeros.
    if EVEN_K and not MASK_ROWS:
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
    else:
        k_ok = offs_k < k_left
        a = tl.load(x_ptrs, mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    return a, b


# The K-group tree (see _ktree): group g covers columns [g K/G, (g+1) K/G), each an fp32
# chain from zero over its own BLOCK_K blocks; the G sums are combined by the balanced
# tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), left + right in fp32.
#
# K_GROUPS = 1 is the one-group chain over all of K (_tiled_group / _tma_group): today's
# code, unchanged (the same sm_90a PTX). K_GROUPS > 1 runs ONE pipelined loop over
# the G x blocks-per-group blocks of all of K (_tiled_tree / _tma_tree): `acc` is the
# running group's chain; at the last block of group g < G - 1 (a runtime scalar
# condition, an scf.if) the group is closed into the live partial sums like a binary
# counter (_close_group) and `acc` restarts from the zero tile; after the loop the last
# group's chain is merged with what is left (_finish_tree). These are the tree's adds, each
# left + right, so the bits are the tree's (tests/test_linear_tree*.py: per-group chains
# and the tree on the host). At most log2(G) + 1 tiles are live: acc and p0, p1, p2 (G = 8).
# Why one loop: the earlier version ran every group as its own loop, each pipelined on
# its own; at K = 2048, G = 8 a group has 4 blocks, so a num_stages = 20 decode config
# filled and drained its pipeline 8 times and kept 8 loops' prologue state live. ptxas
# (sm_90a, triton 3.6, bf16), before -> now: 64x16/w4/s20 with masked rows (decode) at
# G = 8: 255 registers and 5 KB of spill stores -> 113 registers, no spills (G = 2: 40,
# as G = 1); 256x128/w8/s3 at G = 8: 12 KB of spills and serialised wgmma -> 4.4 KB, the
# wgmma asynchronous (one in flight, as G = 1). The H200 measured the earlier version at
# 2.7-18.5x G = 1 (eval/results/2026-12-02_h200_15165ad). A loop over groups around a loop
# over blocks would refill the pipeline per group again.
# What still spills: log2(G) + 1 tiles of BLOCK_M * BLOCK_N / (32 * num_warps) registers
# each; without spills up to about 192 of them: 256x128/w8 (128 a tile) spills 0.5 KB at
# G = 2, 2.2 KB at G = 4; 128x128/w8 and 64x128/w4 (64) none up to G = 4, under 1 KB at
# G = 8; 64x64/w4 (32) none at G = 8. So G > 1 takes a smaller tile where the table's
# would spill (_linear_tiles.tree_tile: the same BLOCK_K, the same bits);
# eval/bench_linear.py --k-groups times the table's tile beside it.
# No tree add folds into a dot: the one dot's accumulator is the loop-carried `acc`,
# never a constant zero, so Triton's dot(a, b, 0) + c -> dot(a, b, c) rewrite cannot
# match (the TTIR test in tests/test_linear_tree.py checks it); the closed group is read
# only inside the scf.if, where the pipeliner waits for the dot first.
@triton.jit
def _close_group(acc, p0, p1, p2, g, K_GROUPS: tl.constexpr):
    # Group g (< K_GROUPS - 1) has sum acc. p_l holds the left subtree of 2^l groups that
    # waits for its right sibling; g's trailing one bits say how many levels complete now:
    # g = 0, 2, 4, 6: p0 = s_g; g = 1, 5: p1 = p0 + s_g; g = 3: p2 = p1 + (p0 + s3).
    # Selects on the scalar g, not branches: each p then takes a select's result, never
    # the dot's own value, which reaches only `acc`'s yield. A dot result carried in two
    # loop values is not made asynchronous by Triton's wgmma pipeliner (a wait after
    # every dot); unused adds here cost one tile add per group.
    left = g % 2 == 0
    if K_GROUPS >= 4:
        pair = p0 + acc  # (g odd) the right sibling of p0 closes a level-1 subtree
        if K_GROUPS == 8:
            p2 = tl.where(g == 3, p1 + pair, p2)
            p1 = tl.where(~left & (g != 3), pair, p1)
        else:
            p1 = tl.where(~left, pair, p1)
    p0 = tl.where(left, acc, p0)
    return p0, p1, p2


@triton.jit
def _finish_tree(acc, p0, p1, p2, K_GROUPS: tl.constexpr):
    # acc = the last group's sum (g = G - 1: every bit one): each waiting left subtree,
    # innermost first, + the right one built so far.
    root = p0 + acc
    if K_GROUPS > 2:
        root = p1 + root
    if K_GROUPS > 4:
        root = p2 + root
    return root


@triton.jit
def _tiled_tree(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk, K_GROUPS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                MASK_ROWS: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Block kb is block j of group g: columns g group_k + j BLOCK_K + [0, BLOCK_K), masked at
    # the group's end (EVEN_K: group_k % BLOCK_K == 0, every block whole and kb BLOCK_K its
    # start): the same loads, masks and dots, in the same order, as one loop per group.
    per_group = tl.cdiv(group_k, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_GROUPS * per_group):
        g = kb // per_group
        j = kb - g * per_group
        if EVEN_K:
            xs, ws = x_ptrs, w_ptrs
        else:
            xs = x_ptrs + (g * group_k + j * BLOCK_K) * stride_xk
            ws = w_ptrs + (g * group_k + j * BLOCK_K) * stride_wk
        a, b = _load_block(xs, ws, offs_m, offs_k, M, group_k - j * BLOCK_K, EVEN_K, MASK_ROWS)
        acc = _dot_step(a, b, acc, INTERPRET, DOT_PRECISION)
        if EVEN_K:
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if (j == per_group - 1) & (g < K_GROUPS - 1):
            p0, p1, p2 = _close_group(acc, p0, p1, p2, g, K_GROUPS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return _finish_tree(acc, p0, p1, p2, K_GROUPS)


@triton.jit
def _tiled_group(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k, stride_xk, stride_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 MASK_ROWS: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The one-group chain (K_GROUPS = 1): blocks 0, 1, 2, ... in order, fp32 accumulator
    # from zero, the last block masked at K (EVEN_K: K % BLOCK_K == 0).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(group_k, BLOCK_K)):
        a, b = _load_block(x_ptrs, w_ptrs, offs_m, offs_k, M, group_k - kb * BLOCK_K, EVEN_K, MASK_ROWS)
        acc = _dot_step(a, b, acc, INTERPRET, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _tma_tree(x_desc, w_desc, off_m, off_n, group_k, K_GROUPS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # _tiled_tree through TMA. A box past a group's end would read the next group, so the
    # launcher takes this kernel for K_GROUPS > 1 only when group_k % BLOCK_K == 0: block
    # kb starts at column kb BLOCK_K; zeros past K (TMA zero-fills out-of-bounds boxes).
    per_group = group_k // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_GROUPS * per_group):
        a = x_desc.load([off_m, kb * BLOCK_K])
        b = w_desc.load([off_n, kb * BLOCK_K])
        acc = _dot_step(a, b.T, acc, INTERPRET, DOT_PRECISION)
        g = kb // per_group
        if (kb - g * per_group == per_group - 1) & (g < K_GROUPS - 1):
            p0, p1, p2 = _close_group(acc, p0, p1, p2, g, K_GROUPS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return _finish_tree(acc, p0, p1, p2, K_GROUPS)


@triton.jit
def _tma_group(x_desc, w_desc, off_m, off_n, group_k,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The tiled kernel's one-group chain through TMA (K_GROUPS = 1): blocks in order,
    # zeros past K (TMA fills out-of-bounds boxes with zeros).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(group_k, BLOCK_K)):
        a = x_desc.load([off_m, kb * BLOCK_K])
        b = w_desc.load([off_n, kb * BLOCK_K])
        acc = _dot_step(a, b.T, acc, INTERPRET, DOT_PRECISION)
    return acc

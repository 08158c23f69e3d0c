"""The K-group tree's one K loop (``_linear_chain._tiled_tree`` / ``_tma_tree``), bit for bit.

One loop over all of K closes each group's chain at the group's last block into the
tree's live partial sums. Checked under the interpreter against the definition built on
the host: each group's fp32 chain from zero (``_chain``, block by block), the groups
combined by ``_ktree.tree_sum``; for group widths that put a close at every block, whole
blocks, a masked last block, and a group narrower than one block; rows masked (fewer rows
than the tile) and whole tiles; every config, the persistent kernel where each group is
whole blocks (with several tiles per program), and the unrounded fp32 partials. And the
tile G > 1 takes where the table's would spill its accumulators (``tree_tile``).
"""
import importlib

import pytest
import torch

from areal_tik.unified_kernels._ktree import tree_sum
from areal_tik.unified_kernels._linear_tiles import _GPU_BUCKETS, _GPU_CANDIDATES, _GPU_FIXED, _cfg, tree_tile
from tests._bits import assert_bitwise
from tests.test_linear import _count_persistent_launches
from tests.test_linear_tree import _chain, _problem

L = importlib.import_module("areal_tik.unified_kernels.linear")

STEP = 16  # the chain's step: the MMA's K (_linear_chain.MMA_K), whatever a config's BLOCK_K
WIDTHS = (16, 32, 40, 8)  # columns per group: 1 block (a close each block), 2 blocks, 2.5, half a block


def _host_tree(x, w, k_groups):
    """fp32 root: the tree over the groups' chains (bf16 values, exact products)."""
    width = x.shape[1] // k_groups
    return tree_sum([_chain(x[:, g * width:(g + 1) * width].float(), w[:, g * width:(g + 1) * width].float(),
                            STEP) for g in range(k_groups)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter numerics (the GPU proof is -m gpu)")
@pytest.mark.parametrize("k_groups", [2, 4, 8])
def test_one_loop_equals_per_group_chains_and_the_tree(k_groups, monkeypatch):
    persistent = _count_persistent_launches(monkeypatch)
    configs = L.linear_candidates(torch.bfloat16)
    assert {cfg.block_k for cfg in configs} == {16, 32}  # the table's BLOCK_K and wider K steps
    expected = 0
    tma = tuple(c for c in configs if c.persistent)  # 16x32 (two tiles a program at 37 rows), 32x32 split
    for width in WIDTHS:
        k = width * k_groups
        # 3 rows: masked in every tile; 37: whole tiles and a partial last one (6 tiles of 16x32)
        for m, n in ((3, 16), (37, 40)):
            x, w, b = _problem(m, k, n, torch.bfloat16, "cpu", seed=50 + width + m)
            root = _host_tree(x, w, k_groups)
            expect = (root + b.float()).to(torch.bfloat16)
            for cfg in (L.linear_config(m, n, k, torch.bfloat16), *tma):  # the table's (16x16, 32x32)
                what = f"G={k_groups} width={width} M={m} {cfg}"
                assert_bitwise(L.linear_forward(x, w, b, config=cfg, k_groups=k_groups), expect, what)
                expected += cfg.persistent and width % cfg.block_k == 0
        for cfg in (L.linear_config(m, n, k, torch.bfloat16), tma[0]):  # the unrounded fp32 root, 37 rows
            assert_bitwise(L.partial_forward(x, w, k_groups, config=cfg), root, f"partial G={k_groups} {cfg}")
            expected += cfg.persistent and width % cfg.block_k == 0
    assert persistent["calls"] == expected > 0  # the TMA kernel ran wherever groups are whole blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter numerics (the GPU proof is -m gpu)")
def test_negative_control_a_group_closed_one_block_late_changes_bits():
    """The reference sees a misplaced close: G = 4 groups of 3 blocks vs the tree over
    groups of 4, 3, 3, 2 blocks (the same columns, the same tree, other chains)."""
    x, w, b = _problem(5, 4 * 48, 24, torch.float32, "cpu", seed=60)
    bounds = (0, 64, 112, 160, 192)
    shifted = tree_sum([_chain(x[:, lo:hi], w[:, lo:hi], STEP) for lo, hi in zip(bounds, bounds[1:])])
    got = L.partial_forward(x, w, 4)
    assert_bitwise(got, _host_tree(x, w, 4), "G=4")
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(got, shifted, "closed late")


def test_tree_tile_keeps_the_bits_and_fits_the_accumulators():
    """For G > 1 the GPU table's tiles shrink until log2(G) + 1 fp32 tiles take <= 192
    registers a thread (or 64x64); BLOCK_K, warps, kernel and wgmma eligibility stay (the
    bits: the GPU contract test runs both); G = 1 is the table's tile itself."""
    configs = {cfg for table in _GPU_BUCKETS.values() for _, ladder in table for cfg, _, _ in ladder}
    configs |= set(_GPU_FIXED.values()) | {cfg for extra in _GPU_CANDIDATES.values() for cfg in extra}
    for cfg in configs:
        assert tree_tile(cfg, 1) is cfg
        for k_groups in (2, 4, 8):
            tile = tree_tile(cfg, k_groups)
            kept = (tile.block_k, tile.num_warps, tile.persistent, tile.group_m)
            assert kept == (cfg.block_k, cfg.num_warps, cfg.persistent, cfg.group_m), (cfg, k_groups)
            smaller = tile.block_m <= cfg.block_m and tile.block_n <= cfg.block_n
            assert tile == cfg or (tile.block_m % 64 == 0 and smaller)
            regs = k_groups.bit_length() * tile.block_m * tile.block_n // (32 * tile.num_warps)
            assert regs <= 192 or (tile.block_m, tile.block_n) == (64, 64), (cfg, k_groups, tile)
            assert tile == cfg or tile.num_stages >= 4
    big = _cfg(256, 128, 8, 3, "P")  # > 1024 rows on the H200
    assert [tree_tile(big, g) for g in (2, 4, 8)] == [_cfg(128, 128, 8, 4, "P")] * 2 + [_cfg(128, 64, 8, 4, "P")]
    assert tree_tile(_cfg(64, 16, 4, 20), 8) == _cfg(64, 16, 4, 20)  # decode: 8 registers a tile
    assert tree_tile(_cfg(64, 128, 4, 8), 8) == _cfg(64, 64, 4, 8)

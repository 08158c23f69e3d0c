"""Paged KV-cache bookkeeping: allocation, appends, freeing, the scratch block."""
from __future__ import annotations

import pytest

from areal_tik.engine import SamplingParams
from areal_tik.engine.block_manager import BlockManager
from areal_tik.engine.sequence import Sequence


def test_block_manager_allocates_appends_and_frees():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = Sequence(0, [1] * 6, SamplingParams(), 0)
    assert bm.can_allocate(seq) and bm.num_free_blocks == 5
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and 0 not in seq.block_table  # block 0 is scratch
    assert [bm.slot(seq, p) for p in (0, 5)] == [seq.block_table[0] * 4, seq.block_table[1] * 4 + 1]
    seq.append(7, -1.0, 0)
    seq.append(7, -1.0, 0)
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2  # 8 tokens fit in two blocks
    seq.append(7, -1.0, 0)
    bm.append_slot(seq)
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 5 and seq.block_table == []
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)

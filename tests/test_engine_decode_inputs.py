"""Staged decode inputs equal the per-row values, also through a separate device buffer."""
from __future__ import annotations

import random

import pytest
import torch

from areal_tik.engine import SamplingParams
from areal_tik.engine.block_manager import BlockManager
from areal_tik.engine.sequence import Sequence


@pytest.mark.parametrize("max_bs", [8, 3])
def test_decode_staging_matches_per_row_inputs(max_bs):
    # Staged decode inputs equal the per-row values (padding rows: token 0, position 0,
    # scratch slot, context 1, scratch table), also through a separate "device" buffer
    # that receives only the copied prefix, as on a GPU.
    from areal_tik.engine.decode_inputs import DecodeInputs
    from areal_tik.engine.block_manager import SCRATCH_BLOCK
    rng = random.Random(0)
    blocks = BlockManager(64, 4)
    staging = DecodeInputs(max_bs, 6, blocks, torch.device("cpu"))
    staging._dev = torch.full_like(staging._host, -7)  # stale values must never leak through
    staging._bind_device_views()
    for trial in range(6):
        seqs = []
        for i in range(rng.randint(1, max_bs)):
            seq = Sequence(100 * trial + i, [rng.randrange(5, 50) for _ in range(rng.randint(1, 20))],
                           SamplingParams(), rng.getrandbits(63))
            seq.append(rng.randrange(5, 50), -1.0, 0)
            blocks.allocate(seq)
            seqs.append(seq)
        rows = rng.randint(len(seqs), max_bs)
        staging.stage(seqs, rows)
        got = staging.model_inputs(rows)
        pad = rows - len(seqs)
        tables = [s.block_table + [SCRATCH_BLOCK] * (6 - len(s.block_table)) for s in seqs]
        want = dict(input_ids=[s.last_token for s in seqs] + [0] * pad,
                    positions=[s.num_tokens - 1 for s in seqs] + [0] * pad,
                    slot_mapping=[blocks.slot(s, s.num_tokens - 1) for s in seqs] + [0] * pad,
                    block_tables=tables + [[SCRATCH_BLOCK] * 6] * pad,
                    context_lens=[s.num_tokens for s in seqs] + [1] * pad)
        for name, values in want.items():
            assert got[name].tolist() == values, name
        keys, counters = staging.sample_keys(len(seqs))
        assert keys.tolist() == [s.sample_key for s in seqs]
        assert counters.tolist() == [s.num_output_tokens for s in seqs]
        assert got["block_tables"].dtype == got["context_lens"].dtype == torch.int32
        assert got["block_tables"].is_contiguous()
        for seq in seqs:
            blocks.free(seq)


@pytest.mark.parametrize("max_bs", [1, 2, 3, 5, 6, 8, 13])
def test_every_decode_input_starts_16_byte_aligned(max_bs):
    # Triton keys a kernel on its pointers' 16-byte alignment. With the sections at
    # 4 * max_bs-byte offsets, an engine of 3 sequences gave the decode attention an
    # unaligned block table: a kernel variant the start-up warm-up had not compiled.
    from areal_tik.engine.decode_inputs import DecodeInputs
    staging = DecodeInputs(max_bs, 5, BlockManager(64, 4), torch.device("cpu"))
    views = {**staging.model_inputs(max_bs), **dict(zip(("keys", "counters"), staging.sample_keys(max_bs)))}
    assert len(views) == 7
    for name, view in views.items():
        assert view.data_ptr() % 16 == 0, (name, view.data_ptr() - staging._dev.data_ptr())


def test_staging_rewrites_a_table_row_whenever_its_table_changed():
    # The host rows keep the tables written at the previous step and are rewritten only when
    # a row's table differs (another list, or the same list grown in place): over steps that
    # grow tables across blocks, reorder and drop rows, and free and reallocate a sequence
    # (a new list of the same length), every staged table equals the sequence's own.
    from areal_tik.engine.block_manager import SCRATCH_BLOCK
    from areal_tik.engine.decode_inputs import DecodeInputs
    rng = random.Random(1)
    blocks = BlockManager(200, 4)
    staging = DecodeInputs(6, 16, blocks, torch.device("cpu"))
    seqs = []
    for i in range(6):
        seq = Sequence(i, [rng.randrange(5, 50) for _ in range(rng.randint(1, 9))], SamplingParams(), i)
        blocks.allocate(seq)
        seqs.append(seq)
    rewrites = 0
    for step in range(40):
        for seq in seqs:
            seq.append(rng.randrange(5, 50), -1.0, 0)
            assert blocks.try_append_slot(seq)
        if step % 7 == 3:  # free and reallocate one: a new list, maybe the same length
            seq = rng.choice(seqs)
            blocks.free(seq)
            blocks.allocate(seq)
        batch = rng.sample(seqs, rng.randint(1, 6))  # another order, some rows dropped
        rows = rng.randint(len(batch), 6)
        before = staging._np_tables.copy()
        staging.stage(batch, rows)
        rewrites += int((before != staging._np_tables).any())
        got = staging.model_inputs(rows)
        want = [s.block_table + [SCRATCH_BLOCK] * (16 - len(s.block_table)) for s in batch]
        assert got["block_tables"].tolist() == want + [[SCRATCH_BLOCK] * 16] * (rows - len(batch)), step
        assert got["slot_mapping"][:len(batch)].tolist() == [blocks.slot(s, s.num_tokens - 1) for s in batch]
    assert rewrites > 0

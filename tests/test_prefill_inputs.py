"""A prefill step's host inputs (``prefill_inputs``) against the per-token definition."""
from __future__ import annotations

import random

import torch

from areal_tik.engine import SamplingParams
from areal_tik.engine.block_manager import SCRATCH_BLOCK, BlockManager
from areal_tik.engine.prefill_inputs import ALIGN, prefill_inputs
from areal_tik.engine.sequence import Sequence

CPU = torch.device("cpu")


def reference(seqs, bm):
    """The definition, token by token: ids, positions, slots (``BlockManager.slot``), cu,
    the rows that sample, and for chunks past position 0 the padded tables and starts."""
    ids, positions, slots, cu, logits = [], [], [], [0], []
    for seq in seqs:
        a, b = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        for p in range(a, b):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(bm.slot(seq, p))
        cu.append(cu[-1] + b - a)
        if b == seq.num_tokens:
            logits.append(cu[-1] - 1)
    out = dict(input_ids=ids, positions=positions, slot_mapping=slots, cu_seqlens=cu,
               logits_indices=logits or [cu[-1] - 1], max_seqlen=max(e - s for s, e in zip(cu, cu[1:])))
    if any(s.num_computed_tokens for s in seqs):
        width = max(len(s.block_table) for s in seqs)
        out["block_tables"] = [s.block_table + [SCRATCH_BLOCK] * (width - len(s.block_table)) for s in seqs]
        out["query_starts"] = [s.num_computed_tokens for s in seqs]
    return out


def _step(lengths, computed, scheduled, seed=0):
    rng = random.Random(seed)
    bm = BlockManager(64, 4)
    rng.shuffle(bm._free)  # noqa: SLF001  (tables of non-consecutive blocks)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(i, [rng.randrange(1000) for _ in range(n)], SamplingParams(), i)
        bm.allocate(seq)
        seqs.append(seq)
    for seq, a, k in zip(seqs, computed, scheduled):
        seq.num_computed_tokens, seq.num_scheduled_tokens = a, k
    return seqs, bm


def _check(seqs, bm):
    got = prefill_inputs(seqs, bm.block_size, CPU)
    want = reference(seqs, bm)
    assert got.keys() == want.keys()
    assert got["max_seqlen"] == want["max_seqlen"] and isinstance(got["max_seqlen"], int)
    for key, value in want.items():
        if key == "max_seqlen":
            continue
        dtype = torch.int32 if key in ("cu_seqlens", "block_tables", "query_starts") else torch.int64
        assert got[key].dtype == dtype, key
        assert got[key].tolist() == value, key
        assert got[key].storage_offset() % ALIGN == 0, key  # each part aligned like a tensor of its own
        assert got[key].is_contiguous(), key


def test_whole_prompts_match_the_per_token_definition():
    seqs, bm = _step([7, 1, 13], [0, 0, 0], [7, 1, 13])
    _check(seqs, bm)
    assert "block_tables" not in prefill_inputs(seqs, bm.block_size, CPU)


def test_chunks_past_position_zero_match_the_per_token_definition():
    # a first chunk, a middle chunk across block boundaries, a last chunk that samples,
    # and a chunk that starts at a block boundary (a prefix-cache hit's tail)
    seqs, bm = _step([19, 30, 9, 12], [0, 5, 6, 8], [6, 13, 3, 4])
    _check(seqs, bm)
    assert prefill_inputs(seqs, bm.block_size, CPU)["block_tables"].shape == (4, 8)


def test_a_step_of_chunks_only_keeps_one_row_for_the_final_norm():
    seqs, bm = _step([20, 17], [4, 0], [8, 5])
    _check(seqs, bm)
    assert prefill_inputs(seqs, bm.block_size, CPU)["logits_indices"].tolist() == [12]

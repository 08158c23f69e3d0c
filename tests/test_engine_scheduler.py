"""Continuous batching: admission within budgets, recompute-style preemption, stops."""
from __future__ import annotations

from areal_tik.engine import EngineConfig, SamplingParams
from areal_tik.engine.block_manager import BlockManager
from areal_tik.engine.scheduler import Scheduler
from areal_tik.engine.sequence import Sequence, SequenceStatus


def test_scheduler_admits_within_budgets_and_preempts_newest():
    config = EngineConfig(max_num_seqs=2, max_model_len=16, kv_block_size=4, num_kv_blocks=6,
                          max_num_batched_tokens=16)
    sched = Scheduler(config, BlockManager(6, 4), eos_token_ids=[0])
    seqs = [Sequence(i, [5] * 4, SamplingParams(max_new_tokens=8), i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs[:2]  # max_num_seqs
    for s in batch:
        s.append(9, -1.0, 0)
    batch, is_prefill = sched.schedule()
    assert not is_prefill and batch == seqs[:2] and sched.blocks.num_free_blocks == 1
    for _ in range(4):
        for s in batch:
            s.append(9, -1.0, 0)
        batch, _ = sched.schedule()
    # 9 tokens each need 3 blocks: 6 > 5 usable, so the newest running sequence was preempted.
    assert seqs[1].status is SequenceStatus.WAITING and seqs[1].block_table == []
    assert list(sched.waiting)[0] is seqs[1] and sched.num_preemptions == 1
    finished = sched.postprocess(batch, [0], [-0.5], version=3)
    assert finished == [seqs[0]] and seqs[0].finish_reason == "stop" and seqs[0].versions[-1] == 3

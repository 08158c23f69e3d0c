"""Continuous batching: which sequences run in the next step, and what happens after it.

Each step is either a prefill of newly admitted (or preempted) sequences or one decode
token for every running sequence. A waiting sequence is admitted when the sequence
count, the prefill token budget and the free KV blocks allow it. When a running
sequence needs a block and none is free, the most recently admitted running sequence
is preempted recompute-style: its blocks are freed and it goes back to the front of
the waiting queue, to be prefilled again over its prompt plus the tokens it already
generated. Every step samples at least one token, so preemption cannot livelock.
"""
from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids=()):
        self.config = config
        self.blocks = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is, freeing its blocks; marks it finished with "abort"."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.finish("abort")

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences, is_prefill) for the next step; empty when there is no work."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > budget or not self.blocks.can_allocate(seq):
                break
            budget -= seq.num_tokens
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        try_append_slot = self.blocks.try_append_slot
        while self.running:
            seq = self.running.popleft()
            while not try_append_slot(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                batch.append(seq)
        self.running.extend(batch)
        return batch

    def preempt_all_running(self) -> int:
        """Send every running sequence back to prefill, keeping their order; returns how many.

        After a weight update this rebuilds their KV caches with the new weights, so every
        token sampled afterwards depends on one weight version only.
        """
        running = list(self.running)
        self.running.clear()
        for seq in reversed(running):
            self._preempt(seq)
        return len(running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                    version: int) -> list[Sequence]:
        """Append each sequence's sampled token; finish and free those that stop. Returns them."""
        finished = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.append(token, logprob, version)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.finish(reason)
                self.blocks.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        num_tokens = len(seq.token_ids)  # per row and step: plain lengths, not properties
        if (num_tokens - len(seq.prompt_ids) >= params.max_new_tokens
                or num_tokens >= self.config.max_model_len):
            return "length"
        return None

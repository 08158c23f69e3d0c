"""Continuous batching: which sequences run in the next step, and what happens after it.

Without chunked prefill each step is either a prefill of newly admitted (or preempted)
sequences or one decode token for every running sequence. A waiting sequence is admitted
when the sequence count, the prefill token budget and the free KV blocks allow it. When a
running sequence needs a block and none is free, the most recently admitted running
sequence is preempted recompute-style: its blocks are freed and it goes back to the front
of the waiting queue, to be prefilled again over its prompt plus the tokens it already
generated. Every step samples at least one token, so preemption cannot livelock.

With chunked prefill (``prefill_chunk_tokens``) every step decodes one token for each
running sequence whose prompt is done AND computes up to that many prompt tokens of
sequences still in prefill (those already running first, then new admissions): a long
prompt no longer stalls the decoding batch for its whole length.

With the prefix cache, an admission starts past its cached prefix. A sequence whose next
block is being written by a running prefill (n samples of one prompt, submitted
together) waits until that block is registered, then reuses it; within one step a
prefill never reads K/V written by another sequence of the same launch, so the kernels'
order of reads and writes stays that of a cold prefill.
"""
from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus, sampling_rows


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
        """Return (sequences, has_prefill) for the next step; empty when there is no work.
        Each sequence's ``num_scheduled_tokens`` says how many of its tokens the step computes."""
        if self.config.prefill_chunk_tokens is not None:
            return self._schedule_mixed()
        batch = self._admit(self.config.batched_tokens_limit, chunked=False)
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _admit(self, budget: int, chunked: bool) -> list[Sequence]:
        """Admit waiting sequences in order within ``budget`` prompt tokens (a chunk of the
        first one that does not fit, when ``chunked``); skip those waiting on a pending block."""
        batch: list[Sequence] = []
        deferred: list[Sequence] = []
        blocks = self.blocks
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            hits = blocks.match(seq)
            if blocks.waits_on_pending(seq, len(hits)):
                deferred.append(seq)
                continue
            todo = seq.num_tokens - len(hits) * blocks.block_size
            n = min(todo, budget) if chunked else todo
            if n <= 0 or n > budget or not blocks.can_allocate(seq, hits):
                self.waiting.appendleft(seq)
                break
            blocks.allocate(seq, hits)
            seq.num_scheduled_tokens = n
            budget -= n
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        self.waiting.extendleft(reversed(deferred))
        return batch

    def _reserve(self) -> list[Sequence]:
        """Give every running sequence a slot for its next token, preempting the newest
        when blocks run out; returns the running sequences that remain, in order."""
        kept: list[Sequence] = []
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
                kept.append(seq)
        self.running.extend(kept)
        return kept

    def _schedule_decode(self) -> list[Sequence]:
        batch = self._reserve()
        for seq in batch:  # without chunks a running sequence has all but its last token's K/V
            seq.num_computed_tokens = len(seq.token_ids) - 1
            seq.num_scheduled_tokens = 1
        return batch

    def _schedule_mixed(self) -> tuple[list[Sequence], bool]:
        budget = self.config.prefill_chunk_tokens
        prefill: list[Sequence] = []
        decode: list[Sequence] = []
        for seq in self._reserve():
            todo = seq.num_tokens - seq.num_computed_tokens
            n = 1 if todo == 1 else min(todo, budget)
            seq.num_scheduled_tokens = n
            if todo == 1:
                decode.append(seq)
            elif n:
                budget -= n
                prefill.append(seq)
        if budget:
            prefill += self._admit(budget, chunked=True)
        return prefill + decode, bool(prefill)

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
        """Advance each sequence's K/V progress by its scheduled tokens; append the sampled
        token of each that sampled (``sampling_rows`` order); finish and free those that
        stop. Returns the finished ones."""
        rows = sampling_rows(seqs)
        register = self.blocks.register if self.blocks.prefix_caching else None
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if register is not None:
                register(seq)
        finished = []
        for seq, token, logprob in zip(rows, tokens, logprobs, strict=True):
            seq.append(token, logprob, version)
            self._end_if_stopped(seq, token, len(seq.token_ids), finished)
        return finished

    def _end_if_stopped(self, seq: Sequence, token: int, num_tokens: int, finished: list) -> None:
        """Finish and free ``seq`` if ``token``, its ``num_tokens``-th, ends it; its lists are
        cut after that token (an overlapped step's later placeholder goes with them)."""
        reason = self._stop_reason(seq, token, num_tokens)
        if reason is None:
            return
        out = num_tokens - len(seq.prompt_ids)  # log-probs and versions: output tokens only
        del seq.token_ids[num_tokens:], seq.logprobs[out:], seq.versions[out:]
        seq.finish(reason)
        self.blocks.free(seq)
        self.running.remove(seq)
        finished.append(seq)

    def fill_pending(self, step, tokens: list[int], logprobs: list[float],
                     advance: bool) -> list[Sequence]:
        """``postprocess`` for a step enqueued with overlap (``LaunchedStep``): its rows' tokens
        were appended as ``Sequence.PENDING`` at ``step.indices``; write them there and stop
        the rows that end (their lists cut after the token: a later step's placeholder goes).
        ``advance``: no later step has been scheduled (else the K/V progress is that step's).
        A row whose sequence ended or was aborted meanwhile is skipped. Returns the finished."""
        if advance:
            for seq in step.seqs:
                seq.num_computed_tokens += seq.num_scheduled_tokens
                seq.num_scheduled_tokens = 0
        register = self.blocks.register if self.blocks.prefix_caching else None
        finished = []
        for seq, index, token, logprob in zip(step.rows, step.indices, tokens, logprobs, strict=True):
            if seq.is_finished:
                continue
            seq.token_ids[index] = token
            seq.logprobs[index - len(seq.prompt_ids)] = logprob
            if register is not None:  # blocks below the K/V progress: never a pending token
                register(seq)
            self._end_if_stopped(seq, token, index + 1, finished)
        return finished

    def ends_on_length(self, seq: Sequence) -> bool:
        """Its last token (drawn or pending) is the last its length limits allow."""
        num_tokens = len(seq.token_ids)
        return (num_tokens - len(seq.prompt_ids) >= seq.params.max_new_tokens
                or num_tokens >= self.config.max_model_len)

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if (num_tokens - len(seq.prompt_ids) >= params.max_new_tokens
                or num_tokens >= self.config.max_model_len):
            return "length"
        return None

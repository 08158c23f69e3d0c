"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and per-sequence block tables.

Token at position p of a sequence lives in slot ``block_table[p // B] * B + p % B`` of the
cache (B = block size). Block 0 is reserved: CUDA-graph padding rows write their K/V to
it and read from it, so padding never touches a live sequence's cache.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(SCRATCH_BLOCK + 1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for the K/V of all of ``seq``'s tokens (a prefill writes them all)."""
        return self.blocks_for(seq.num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        need = self.blocks_for(seq.num_tokens)
        assert need <= len(self._free), "allocate() without can_allocate()"
        seq.block_table = [self._free.popleft() for _ in range(need)]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of ``seq``'s last token, which the next decode step writes."""
        return self._needs_block(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            assert self._free, "append_slot() without can_append()"
            seq.block_table.append(self._free.popleft())

    def try_append_slot(self, seq: Sequence) -> bool:
        """``append_slot`` if ``can_append``, in one pass (the decode scheduler's per-row call)."""
        table = seq.block_table
        if len(table) * self.block_size >= len(seq.token_ids):
            return True
        if not self._free:
            return False
        table.append(self._free.popleft())
        return True

    def free(self, seq: Sequence) -> None:
        # Most recently taken blocks go back first: they are the warmest in cache.
        self._free.extendleft(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        return [self.slot(seq, p) for p in range(start, end)]

    def _needs_block(self, seq: Sequence) -> int:
        return int(len(seq.block_table) < self.blocks_for(seq.num_tokens))

"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, a prefix cache.

Token at position p of a sequence lives in slot ``block_table[p // B] * B + p % B`` of the
cache (B = block size). Block 0 is reserved: CUDA-graph padding rows write their K/V to
it and read from it, so padding never touches a live sequence's cache.

Prefix cache (``prefix_caching=True``): a block whose B tokens all have their K/V written
is registered under a content address, the chain hash (blake2b, 128 bits) of its tokens
and of the hash of the block before it, so equal addresses mean equal token prefixes. A
new sequence takes the registered blocks of its longest cached prefix (reference-counted,
read-only: a sequence writes only positions past its cached prefix, which lie in its own
blocks). Only full blocks are shared, never the last partial one, and at most
``(n - 1) // B`` blocks of an n-token sequence, so at least one token is computed and the
last prompt row produces logits. A released block keeps its K/V and address while its
count is 0 ("evictable", LRU order, the tail of a sequence first); allocation takes free
blocks first and then evicts the least recently used. Attention reads a cached block with
the same tile walk as the block's own sequence did (regime R3 of the kernels), so a hit
changes no bits. The index holds blocks of one weight version: ``reset_prefix_cache`` (on
every weight update) drops every address, and a sequence whose K/V predate the update
never registers its blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass

from .sequence import Sequence

SCRATCH_BLOCK = 0


@dataclass
class PrefixCacheStats:
    """Counters since the engine started; ``hit_tokens`` are prefill tokens saved."""

    queries: int = 0        # sequences admitted (or re-admitted) with the cache on
    query_tokens: int = 0   # their tokens
    hits: int = 0           # admissions that reused at least one block
    hit_tokens: int = 0     # tokens whose K/V came from the cache
    evictions: int = 0      # cached blocks reclaimed for new ones
    resets: int = 0         # weight updates that dropped the index

    def as_dict(self) -> dict:
        out = asdict(self)
        out["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.version = 0
        self.stats = PrefixCacheStats()
        self._free: deque[int] = deque(range(SCRATCH_BLOCK + 1, num_blocks))
        self._refs = [0] * num_blocks
        self._address: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, LRU first
        self._pending: Counter[bytes] = Counter()  # addresses running prefills will write

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache

    def _hashes(self, seq: Sequence, blocks: int | None = None) -> list[bytes]:
        """Chain hashes of ``seq``'s full blocks (extended as its tokens grow), of its first
        ``blocks`` at least when given (``register``: only blocks with K/V, never one holding
        an overlapped step's pending token)."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        for i in range(len(hashes), len(tokens) // bs if blocks is None else blocks):
            h = hashlib.blake2b(hashes[i - 1] if i else b"", digest_size=16)
            h.update(array("q", tokens[i * bs:(i + 1) * bs]).tobytes())
            hashes.append(h.digest())
        return hashes

    def match(self, seq: Sequence) -> list[int]:
        """Blocks of ``seq``'s longest cached prefix (at most (n - 1) // B of them)."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in self._hashes(seq)[:(seq.num_tokens - 1) // self.block_size]:
            block = self._index.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def waits_on_pending(self, seq: Sequence, num_hits: int) -> bool:
        """True when the next block ``seq`` would compute is being written by a running
        prefill: admitted a step later, it reuses that block instead of computing it again."""
        hashes = seq.block_hashes
        limit = (seq.num_tokens - 1) // self.block_size
        return self.prefix_caching and num_hits < min(len(hashes), limit) and hashes[num_hits] in self._pending

    def register(self, seq: Sequence) -> None:
        """Give addresses to ``seq``'s blocks whose tokens all have K/V now."""
        full = seq.num_computed_tokens // self.block_size
        if not self.prefix_caching or full <= seq.num_registered_blocks:
            return
        if seq.kv_version != self.version:  # K/V of older weights: never shared
            self._release_pending(seq)
            seq.num_registered_blocks = full
            return
        hashes, table = self._hashes(seq, full), seq.block_table
        for i in range(seq.num_registered_blocks, full):
            h, block = hashes[i], table[i]
            if seq.pending_hashes and seq.pending_hashes[0] == h:
                self._drop_pending(seq.pending_hashes.pop(0))
            if h not in self._index and self._address[block] is None:
                self._index[h] = block
                self._address[block] = h
        seq.num_registered_blocks = full

    def reset_prefix_cache(self, version: int) -> None:
        """Forget every address (a weight update): later requests never see older K/V."""
        self.version = version
        self._index.clear()
        self._pending.clear()
        for block in range(self.num_blocks):
            self._address[block] = None
        self._free.extend(self._evictable)
        self._evictable.clear()
        self.stats.resets += 1

    def _drop_pending(self, h: bytes) -> None:
        if self._pending[h] > 1:
            self._pending[h] -= 1
        else:
            self._pending.pop(h, None)

    def _release_pending(self, seq: Sequence) -> None:
        for h in seq.pending_hashes:
            self._drop_pending(h)
        seq.pending_hashes = []

    # ------------------------------------------------------------------ allocation

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # reclaim the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._address[block]]
            self._address[block] = None
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Room for the K/V of all of ``seq``'s tokens beyond its cached prefix ``hits``."""
        hits = self.match(seq) if hits is None else hits
        reclaimed = sum(1 for b in hits if self._refs[b] == 0)  # taken out of the evictable pool
        return self.blocks_for(seq.num_tokens) - len(hits) <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self.match(seq) if hits is None else hits
        assert self.can_allocate(seq, hits), "allocate() without can_allocate()"
        for block in hits:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        need = self.blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take() for _ in range(need)]
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        seq.num_registered_blocks = len(hits)
        seq.kv_version = self.version
        if self.prefix_caching:
            seq.pending_hashes = list(self._hashes(seq)[len(hits):])
            self._pending.update(seq.pending_hashes)
            stats = self.stats
            stats.queries += 1
            stats.query_tokens += seq.num_tokens
            stats.hits += bool(hits)
            stats.hit_tokens += cached

    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of ``seq``'s last token, which the next decode step writes."""
        return self._needs_block(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            assert self.num_free_blocks, "append_slot() without can_append()"
            seq.block_table.append(self._take())

    def try_append_slot(self, seq: Sequence) -> bool:
        """``append_slot`` if ``can_append``, in one pass (the decode scheduler's per-row call)."""
        table = seq.block_table
        if len(table) * self.block_size >= len(seq.token_ids):
            return True
        if not self._free and not self._evictable:
            return False
        table.append(self._take())
        return True

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; addressed ones stay cached (tail first in LRU order)."""
        self._release_pending(seq)
        unaddressed = []
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self._address[block] is None:
                unaddressed.append(block)
            else:
                self._evictable[block] = None
        # Most recently taken blocks go back first: they are the warmest in cache.
        self._free.extendleft(reversed(unaddressed))
        seq.block_table = []
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _needs_block(self, seq: Sequence) -> int:
        return int(len(seq.block_table) < self.blocks_for(seq.num_tokens))

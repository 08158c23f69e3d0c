"""Persistent decode-step inputs: one host buffer filled in place, one copy to the device.

A decode step needs, per row, the input token, its position, its KV slot, the sampling
key and output index, the context length and the block table. Building five or six small
tensors per step (each a host allocation, a pinned staging copy and a transfer, then a
copy into the CUDA-graph inputs) costs far more host time than the values themselves.
Here every value lives in one flat int32 buffer, allocated once (pinned on a GPU) with a
device twin whose views ARE the CUDA-graph inputs:

    words [0, 10 * pad)            five int64 rows of pad: input_ids, positions,
                                   slot_mapping, sample keys, output counters
    words [10 * pad, 11 * pad)     int32 context_lens
    words [11 * pad, ...)          int32 block_tables [max_bs, width]

where pad is max_bs rounded up to a multiple of 4, so that every section starts 16-byte
aligned whatever max_bs is: Triton keys a kernel on its pointers' 16-byte alignment, and
with sections at 4 * max_bs-byte offsets an engine of 3 sequences launched a decode-
attention variant (unaligned block table) that the start-up warm-up had not compiled.

A step writes rows [0, rows) through numpy views and copies the prefix that holds them
(all int64 rows, the context lengths and the first ``rows`` table rows: contiguous) with
a single host-to-device copy. The step ends by reading its sampled tokens back, which
waits for that copy, so the host buffer is normally free when the next step fills it; an
event recorded after the copy guards the case of a step that failed before that read.
Rows past the real batch are padding: token 0 at position 0, writing and reading only
the scratch block, context length 1 (the same values the eager path used).
"""
from __future__ import annotations

import numpy as np
import torch

from .block_manager import SCRATCH_BLOCK, BlockManager
from .sequence import Sequence

_INT64_ROWS = ("input_ids", "positions", "slot_mapping", "keys", "counters")


class DecodeInputs:
    def __init__(self, max_bs: int, width: int, block_manager: BlockManager, device: torch.device):
        self.max_bs = max_bs
        self.width = width
        self.blocks = block_manager
        self.device = device
        self._scratch_slot = SCRATCH_BLOCK * block_manager.block_size
        self._pad = pad = -(-max_bs // 4) * 4
        words = 11 * pad + max_bs * width
        on_gpu = device.type == "cuda"
        self._host = torch.zeros(words, dtype=torch.int32, pin_memory=on_gpu)
        self._dev = torch.zeros(words, dtype=torch.int32, device=device) if on_gpu else self._host
        self._copied = torch.cuda.Event() if on_gpu else None  # the last staging copy
        host = self._host.numpy()
        self._np64 = host[:10 * pad].view(np.int64).reshape(5, pad)
        self._np_ctx = host[10 * pad:10 * pad + max_bs]
        self._np_tables = host[11 * pad:].reshape(max_bs, width)
        # Which block-table list each host row holds, and its length then: a table only ever
        # grows in place (a new block appended) or is replaced by a new list (allocation,
        # free), so the same list at the same length means the row is already written. The
        # references keep the lists alive, so an identity is never a recycled one.
        self._row_tables: list[list[int] | None] = [None] * max_bs
        self._row_widths = [0] * max_bs
        self._rows = np.arange(max_bs)
        self._fill_padding(0, max_bs)
        self._bind_device_views()

    def _bind_device_views(self) -> None:
        max_bs, pad = self.max_bs, self._pad
        if self._dev is not self._host:
            self._dev.copy_(self._host)
        dev64 = self._dev[:10 * pad].view(torch.int64).view(5, pad)
        self._rows64 = dict(zip(_INT64_ROWS, dev64.unbind(0)))
        self._ctx = self._dev[10 * pad:10 * pad + max_bs]
        self._tables = self._dev[11 * pad:].view(max_bs, self.width)

    def _fill_padding(self, start: int, end: int) -> None:
        ids, positions, slots, keys, counters = self._np64
        ids[start:end] = 0
        positions[start:end] = 0
        slots[start:end] = self._scratch_slot
        keys[start:end] = 0
        counters[start:end] = 0
        self._np_ctx[start:end] = 1
        self._np_tables[start:end] = SCRATCH_BLOCK
        self._row_tables[start:end] = [None] * (end - start)

    def stage(self, seqs: list[Sequence], rows: int, pending=None) -> None:
        """Write ``seqs`` into rows [0, len(seqs)), padding up to ``rows``; copy to the device.
        ``pending`` = (device tokens [m] of a step not read yet, for each row of ``seqs`` the
        index of its input token there or None): those input tokens are copied on the device."""
        n = len(seqs)
        assert n <= rows <= self.max_bs, (n, rows, self.max_bs)
        if self._copied is not None:
            self._copied.synchronize()  # already complete unless the last step failed early
        block_size = self.blocks.block_size
        ids, positions, slots, keys, counters = self._np64
        tables, row_tables, row_widths = self._np_tables, self._row_tables, self._row_widths
        for i, seq in enumerate(seqs):  # rewrite only the rows whose table changed
            table = seq.block_table
            if row_tables[i] is not table or row_widths[i] != len(table):
                tables[i, :len(table)] = table
                tables[i, len(table):] = SCRATCH_BLOCK
                row_tables[i], row_widths[i] = table, len(table)
        token_ids = [s.token_ids for s in seqs]
        lens = [len(t) for t in token_ids]
        ids[:n] = [t[-1] for t in token_ids]
        position = positions[:n]
        position[:] = lens
        position -= 1
        slots[:n] = tables[self._rows[:n], position // block_size]
        slots[:n] *= block_size
        slots[:n] += position % block_size
        keys[:n] = [s.sample_key for s in seqs]
        counters[:n] = [len(s.prompt_ids) for s in seqs]
        np.subtract(lens, counters[:n], out=counters[:n])
        self._np_ctx[:n] = lens
        if rows > n:
            self._fill_padding(n, rows)
        if self._dev is not self._host:
            end = 11 * self._pad + rows * self.width
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        if pending is not None:
            self._copy_pending_ids(*pending)

    def _copy_pending_ids(self, tokens: torch.Tensor, src: list) -> None:
        """input_ids[i] = tokens[src[i]] for the rows with a source (stream-ordered after the
        staging copy): one slice copy when row i takes token i for a prefix, else an index copy."""
        ids = self._rows64["input_ids"]
        m = 0
        while m < len(src) and src[m] == m:
            m += 1
        if m and all(s is None for s in src[m:]):
            ids[:m].copy_(tokens[:m])  # fp64 -> int64: token ids < 2^53 are exact
            return
        dst = [i for i, s in enumerate(src) if s is not None]
        if not dst:
            return
        index = torch.tensor([dst, [src[i] for i in dst]], dtype=torch.int64)
        if ids.is_cuda:
            index = index.pin_memory().to(ids.device, non_blocking=True)
        ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(torch.int64))

    def model_inputs(self, rows: int, width: int | None = None) -> dict:
        """The ``decode`` keyword arguments: device views of rows [0, rows), ``width`` table columns."""
        width = self.width if width is None else width
        r = self._rows64
        return dict(input_ids=r["input_ids"][:rows], positions=r["positions"][:rows],
                    slot_mapping=r["slot_mapping"][:rows], block_tables=self._tables[:rows, :width],
                    context_lens=self._ctx[:rows])

    def sample_keys(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device (keys, counters) of rows [0, rows), int64."""
        return self._rows64["keys"][:rows], self._rows64["counters"][:rows]

"""Shared helpers of the model tests: tiny HF models, packing, a paged-cache rollout."""
from __future__ import annotations

import copy
import random

import torch

from areal_tik.model import UnifiedCausalLM, missing_ops, random_model, tiny_config
from areal_tik.model.ops import OP_NAMES

from ._bits import assert_bitwise


def require(kernels: str, names=OP_NAMES) -> None:
    """Fail (naming the ops) if a unified kernel needed here cannot be loaded."""
    if kernels == "unified":
        missing = missing_ops("unified", names)
        assert not missing, f"unified kernels unavailable: {missing}"


# ----------------------------------------------------------------------------- models


def _randomize_extras(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1; make them random so they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


_HF_CACHE: dict = {}


def tiny_hf(family: str, tied: bool, device="cpu", fresh: bool = False):
    """A tiny random HF model (cached: tests that change parameters or grads ask for ``fresh``)."""
    key = (family, tied, str(device))
    if key not in _HF_CACHE:
        model = random_model(tiny_config(family, tie_word_embeddings=tied), device=device, seed=1)
        _randomize_extras(model, seed=2)
        _HF_CACHE[key] = model
    return copy.deepcopy(_HF_CACHE[key]) if fresh else _HF_CACHE[key]


def make_seqs(lens, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def pack(seqs, device, pad: int = 0):
    """(input_ids [T], positions [T], cu_seqlens [S+1] int32, max_seqlen), ``pad`` padding rows."""
    ids = torch.cat([*seqs, torch.zeros(pad, dtype=torch.int64)])
    pos = torch.cat([*(torch.arange(len(s)) for s in seqs), torch.zeros(pad, dtype=torch.int64)])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    return ids.to(device), pos.to(device), cu.to(device), max(len(s) for s in seqs)


def row_offsets(seqs) -> list[int]:
    return [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]


def hf_logits(hf, seqs, device):
    """The transformers model's own logits, one unpadded sequence at a time."""
    with torch.no_grad():
        return torch.cat([hf(s.to(device)[None]).logits[0] for s in seqs])


# ----------------------------------------------------------------------------- paged cache


class PagedLayout:
    """Blocks handed out in a shuffled order; the cache starts full of NaN (unwritten slots)."""

    def __init__(self, model: UnifiedCausalLM, lens, block_size: int, seed: int = 0, spare: int = 3):
        need = [-(-n // block_size) for n in lens]
        blocks = list(range(sum(need) + spare))
        random.Random(seed).shuffle(blocks)
        self.tables, start = [], 0
        for n in need:
            self.tables.append(blocks[start:start + n])
            start += n
        self.block_size = block_size
        self.device = model.device
        self.cache = model.new_kv_cache(len(blocks), block_size)
        self.cache.k.fill_(float("nan"))
        self.cache.v.fill_(float("nan"))

    def slots(self, seq: int, positions) -> torch.Tensor:
        table = self.tables[seq]
        out = [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def block_tables(self, seq_ids) -> torch.Tensor:
        width = max(len(self.tables[i]) for i in seq_ids)
        rows = [self.tables[i] + [0] * (width - len(self.tables[i])) for i in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)


def prefill_rows(m: UnifiedCausalLM, layout: PagedLayout, seqs, seq_ids, upto):
    """Prefill the first ``upto[i]`` tokens of each sequence; hidden of every prefilled row."""
    parts = [seqs[i][: upto[i]] for i in seq_ids]
    ids, pos, cu, max_len = pack(parts, m.device)
    slots = torch.cat([layout.slots(i, range(upto[i])) for i in seq_ids])
    every_row = torch.arange(ids.shape[0], device=m.device)
    return m.prefill(ids, pos, cu, max_len, layout.cache, slots, every_row)


def decode_step(m: UnifiedCausalLM, layout: PagedLayout, seqs, seq_ids, pos_of):
    """One decode step for ``seq_ids`` (in that batch order) at positions ``pos_of[i]``."""
    dev = m.device
    ids = torch.stack([seqs[i][pos_of[i]] for i in seq_ids]).to(dev)
    pos = torch.tensor([pos_of[i] for i in seq_ids], dtype=torch.int64, device=dev)
    slots = torch.cat([layout.slots(i, [pos_of[i]]) for i in seq_ids])
    ctx = torch.tensor([pos_of[i] + 1 for i in seq_ids], dtype=torch.int32, device=dev)
    return m.decode(ids, pos, layout.cache, slots, layout.block_tables(seq_ids), ctx)


def run_rollout(m: UnifiedCausalLM, seqs, prompt_lens, block_size: int, seed: int = 0):
    """Prefill prompts, then decode every remaining token in shuffled, shrinking batches.

    Returns {(seq, position): hidden row} for every prefilled and decoded row.
    """
    layout = PagedLayout(m, [len(s) for s in seqs], block_size, seed=seed)
    rows = {}
    ids = list(range(len(seqs)))
    h = prefill_rows(m, layout, seqs, ids, prompt_lens)
    offs = row_offsets([seqs[i][: prompt_lens[i]] for i in ids])
    for i in ids:
        for p in range(prompt_lens[i]):
            rows[(i, p)] = h[offs[i] + p]
    nxt = dict(zip(ids, prompt_lens))
    rng = random.Random(seed)
    while True:
        live = [i for i in ids if nxt[i] < len(seqs[i])]
        if not live:
            return rows
        rng.shuffle(live)
        h = decode_step(m, layout, seqs, live, nxt)
        for b, i in enumerate(live):
            rows[(i, nxt[i])] = h[b]
            nxt[i] += 1


def packed_rows(m, seqs):
    with torch.no_grad():
        h = m.forward_packed(*pack(seqs, m.device))
    offs = row_offsets(seqs)
    return {(i, p): h[offs[i] + p] for i in range(len(seqs)) for p in range(len(seqs[i]))}


def assert_rows_equal(rows, ref, what):
    assert rows.keys() <= ref.keys()
    for key in sorted(rows):
        assert_bitwise(rows[key], ref[key], f"{what}: seq {key[0]} position {key[1]}")

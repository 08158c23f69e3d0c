"""Regime R3 of the attention contract: query rows that start past position 0.

A sequence's rows computed cold (one ``attention_varlen`` over the whole sequence) must
equal, bit for bit, the same rows computed in chunks by ``attention_paged_prefill``
(each chunk's K/V stored into a poisoned, shuffled paged cache before its call, the
earlier K/V read from there), with chunk boundaries inside KV tiles, on tile edges and
across KV splits; the rows of a sequence whose prefix blocks were written by another
sequence (a prefix-cache hit); one-row chunks (== ``attention_decode``); and the packed
training forward with autograd. Interpreter shapes: KV tile 16, split 32, prefill
programs of 32 rows (two 16-row sub-tiles).
"""
from __future__ import annotations

import math

import pytest
import torch

from areal_tik.unified_kernels import attention as attn_mod
from areal_tik.unified_kernels._attention_fwd import FwdConfig
from areal_tik.unified_kernels.attention import (attention_decode, attention_paged_prefill,
                                                 attention_varlen, store_kv_cache)
from tests._bits import assert_bitwise
from tests.test_attention import _block_size, _cu, _qkv

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


class ChunkedCache:
    """Poisoned paged caches (NaN and +-1e4 garbage) with shuffled block tables; K/V enter
    only through ``store``, so a read of any slot not yet written poisons the result."""

    def __init__(self, lengths, hk, dim, dtype, device, block_size=None, seed=0, shared=None):
        g = torch.Generator().manual_seed(seed)
        self.bs = block_size or _block_size()
        need = [math.ceil(n / self.bs) for n in lengths]
        num_blocks = sum(need) + 3
        shape = (num_blocks, self.bs, hk, dim)
        poison = torch.randn(shape, generator=g) * 1e4
        poison[torch.rand(shape, generator=g) < 0.3] = float("nan")
        self.k = poison.to(dtype).to(device)
        self.v = poison.flip(0).to(dtype).to(device)
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, used = [], 0
        for n in need:
            self.tables.append(order[used:used + n])
            used += n
        if shared is not None:  # (seq, donor, blocks): seq's first blocks are the donor's
            seq, donor, blocks = shared
            self.tables[seq][:blocks] = self.tables[donor][:blocks]
        self.width = max(need) + 1
        self.device = device

    def store(self, s, k, v, start):
        pos = torch.arange(start, start + k.shape[0])
        table = torch.tensor(self.tables[s])
        slots = (table[pos // self.bs] * self.bs + pos % self.bs).to(self.device)
        store_kv_cache(k, v, self.k, self.v, slots)

    def table_rows(self, seq_ids):
        pad = self.tables[0][0]  # unused tail entries point at a live block: never read
        rows = [self.tables[s] + [pad] * (self.width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def chunks(self, pieces, seqs):
        """One paged-prefill call over ``pieces`` = [(seq, start, end)], after storing them."""
        for s, a, b in pieces:
            self.store(s, seqs[s][1][a:b], seqs[s][2][a:b], a)
        q = torch.cat([seqs[s][0][a:b] for s, a, b in pieces])
        cu = _cu([b - a for _, a, b in pieces], self.device)
        starts = torch.tensor([a for _, a, _ in pieces], dtype=torch.int32, device=self.device)
        out = attention_paged_prefill(q, self.k, self.v, cu, max(b - a for _, a, b in pieces),
                                      self.table_rows([s for s, _, _ in pieces]), starts)
        offs = cu.tolist()
        return [out[offs[i]:offs[i + 1]] for i in range(len(pieces))]


def _cold(seqs):
    return [attention_varlen(q, k, v, _cu([q.shape[0]], q.device), q.shape[0]) for q, k, v in seqs]


def _chunked_equals_cold(device, hq, hk, dim, dtype, n, bounds, seed=0):
    seqs = [_qkv(n, hq, hk, dim, dtype, device, seed=40 + seed)]
    cold = _cold(seqs)[0]
    cache = ChunkedCache([n], hk, dim, dtype, device, seed=seed)
    edges = [0, *bounds, n]
    for a, b in zip(edges[:-1], edges[1:]):
        out = cache.chunks([(0, a, b)], seqs)[0]
        assert_bitwise(out, cold[a:b], f"chunk [{a}, {b}) of {n} (boundaries {bounds})")


# Boundaries inside a KV tile (tile 16), on tile edges, on a split edge (32) and past
# it, one-row chunks, and a chunk longer than a prefill program (32 rows).
@pytest.mark.parametrize("bounds", [[5, 16, 17, 31, 32, 33, 50], [1, 2, 40], [37], [3, 69]])
def test_chunks_equal_cold_prefill(device, bounds):
    _chunked_equals_cold(device, 4, 2, 16, torch.bfloat16, 70, bounds)


def test_chunks_equal_cold_prefill_fp32_d32_gqa4(device):
    _chunked_equals_cold(device, 8, 2, 32, torch.float32, 45, [7, 32, 33], seed=1)


def test_cuts_at_every_kind_of_edge_equal_cold(device):
    """Two chunks cut next to every tile (16), program (32) and split (32) edge of a
    40-row sequence, and mid-tile (one launch per cut)."""
    n = 40
    seqs = [_qkv(n, 4, 4, 16, torch.bfloat16, device, seed=7)]
    cold = _cold(seqs)[0]
    for cut in (1, 2, 7, 15, 16, 17, 24, 31, 32, 33, 38, 39):
        cache = ChunkedCache([n], 4, 16, torch.bfloat16, device, seed=cut)
        cache.store(0, seqs[0][1][:cut], seqs[0][2][:cut], 0)
        out = cache.chunks([(0, cut, n)], seqs)[0]
        assert_bitwise(out, cold[cut:], f"rows after cut {cut}")


def test_mixed_batch_of_chunks_and_single_rows(device):
    """One launch with sequences at different offsets (0, mid-tile, past a split, a
    one-row chunk) in shuffled order; each equals its cold rows and, for a one-row
    chunk, the paged decode of that row."""
    lengths = [33, 70, 20, 50]
    seqs = [_qkv(n, 4, 2, 16, torch.bfloat16, device, seed=60 + i) for i, n in enumerate(lengths)]
    cold = _cold(seqs)
    cache = ChunkedCache(lengths, 2, 16, torch.bfloat16, device, seed=3)
    first = [(1, 0, 37), (3, 0, 49), (2, 0, 5)]
    for (s, a, b), out in zip(first, cache.chunks(first, seqs)):
        assert_bitwise(out, cold[s][a:b], f"first chunk of seq {s}")
    second = [(3, 49, 50), (0, 0, 33), (1, 37, 70), (2, 5, 20)]
    for (s, a, b), out in zip(second, cache.chunks(second, seqs)):
        assert_bitwise(out, cold[s][a:b], f"second chunk of seq {s} [{a}, {b})")
    ctx = torch.tensor([50], dtype=torch.int32, device=device)
    dec = attention_decode(seqs[3][0][49:50], cache.k, cache.v, cache.table_rows([3]), ctx)
    assert_bitwise(dec[0], cold[3][49], "decode of the one-row chunk's row")


def test_prefix_hit_on_blocks_written_by_another_sequence(device):
    """Sequence 1 shares sequence 0's first three blocks (same prefix K/V); only its
    suffix is stored and computed; its rows equal its own cold prefill."""
    bs = _block_size()  # 32 positions: 2 KV tiles, one split
    n0, n1, hit = 100, 120, 3 * bs
    s0 = _qkv(n0, 4, 2, 16, torch.bfloat16, device, seed=80)
    s1 = tuple(torch.cat([t[:hit], u[hit:]]) for t, u in zip(s0, _qkv(n1, 4, 2, 16, torch.bfloat16,
                                                                     device, seed=81)))
    s1 = tuple(t[:n1] for t in s1)
    seqs = [s0, s1]
    cold = _cold(seqs)
    cache = ChunkedCache([n0, n1], 2, 16, torch.bfloat16, device, seed=4, shared=(1, 0, 3))
    assert_bitwise(cache.chunks([(0, 0, n0)], seqs)[0], cold[0], "donor")
    out = cache.chunks([(1, hit, n1)], seqs)[0]
    assert_bitwise(out, cold[1][hit:], "rows after the prefix hit")


def test_chunks_equal_packed_training_forward(device):
    """Chunked rows == the packed training forward (with autograd, other sequences and
    padding in the micro-batch)."""
    lengths = [23, 61]
    seqs = [_qkv(n, 4, 2, 16, torch.bfloat16, device, seed=90 + i) for i, n in enumerate(lengths)]
    q, k, v = (torch.cat([seqs[1][i], seqs[0][i], seqs[0][i][:5]]).requires_grad_() for i in range(3))
    packed = attention_varlen(q, k, v, _cu([61, 23], device), 61).detach()
    cache = ChunkedCache(lengths, 2, 16, torch.bfloat16, device, seed=5)
    for pieces in ([(1, 0, 17), (0, 0, 9)], [(0, 9, 23), (1, 17, 48)], [(1, 48, 61)]):
        for (s, a, b), out in zip(pieces, cache.chunks(pieces, seqs)):
            base = 0 if s == 1 else 61
            assert_bitwise(out, packed[base + a:base + b], f"seq {s} [{a}, {b}) vs training")


def test_padding_rows_are_zero_and_launch_reads_no_host_values(device, monkeypatch):
    seqs = [_qkv(20, 4, 2, 16, torch.bfloat16, device, seed=9)]
    cache = ChunkedCache([20], 2, 16, torch.bfloat16, device, seed=6)
    cache.store(0, seqs[0][1], seqs[0][2], 0)
    q = torch.cat([seqs[0][0][12:], torch.ones(3, 4, 16, dtype=torch.bfloat16, device=device)])
    args = (q, cache.k, cache.v, _cu([8], device), 8, cache.table_rows([0]),
            torch.tensor([12], dtype=torch.int32, device=device))
    out = attention_paged_prefill(*args)
    assert_bitwise(out[:8], _cold(seqs)[0][12:], "rows")
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))
    grids = []
    monkeypatch.setattr(attn_mod._attention_fwd, "_prefill_fwd_kernel",
                        type("R", (), {"__getitem__": lambda self, g: lambda *a, **kw: grids.append(g)})())
    with monkeypatch.context() as m:
        for method in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__index__"):
            m.setattr(torch.Tensor, method, lambda *a, **kw: (_ for _ in ()).throw(AssertionError("host read")))
        attention_paged_prefill(*args, validate=False)
    assert len(grids) == 1


def test_bad_paged_prefill_input_raises(device):
    seqs = [_qkv(20, 4, 2, 16, torch.bfloat16, device, seed=9)]
    cache = ChunkedCache([20], 2, 16, torch.bfloat16, device, seed=6)
    q, cu, table = seqs[0][0][:8], _cu([8], device), cache.table_rows([0])
    starts = lambda x: torch.tensor([x], dtype=torch.int32, device=device)  # noqa: E731
    with pytest.raises(ValueError, match="query_starts must be >= 0"):
        attention_paged_prefill(q, cache.k, cache.v, cu, 8, table, starts(-1))
    with pytest.raises(ValueError, match="context_lens must lie in"):
        attention_paged_prefill(q, cache.k, cache.v, cu, 8, table, starts(10 ** 4))
    with pytest.raises(ValueError, match="one row per sequence"):
        attention_paged_prefill(q, cache.k, cache.v, cu, 8, table, starts(0).repeat(2))
    with pytest.raises(TypeError, match="query_starts"):
        attention_paged_prefill(q, cache.k, cache.v, cu, 8, table, starts(0).long())
    with pytest.raises(ValueError, match="max_seqlen"):
        attention_paged_prefill(q, cache.k, cache.v, cu, 4, table, starts(0))


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,dim", [(16, 8, 128), (32, 8, 64)])
def test_gpu_chunks_equal_cold_prefill(hq, hk, dim):
    """Chunk boundaries next to the 64-row tile, the 128-row program and the 1024 split."""
    _chunked_equals_cold("cuda", hq, hk, dim, torch.bfloat16, 3000,
                         [1, 63, 64, 65, 200, 1023, 1024, 1025, 2047, 2100, 2999])


@pytest.mark.gpu
def test_gpu_prefix_hit_and_mixed_batch():
    lengths = [2500, 1500, 700]
    seqs = [_qkv(n, 16, 8, 128, torch.bfloat16, "cuda", seed=70 + i) for i, n in enumerate(lengths)]
    cold = _cold(seqs)
    cache = ChunkedCache(lengths, 8, 128, torch.bfloat16, "cuda", block_size=64, seed=8)
    first = [(0, 0, 1030), (1, 0, 1), (2, 0, 700)]
    second = [(1, 1, 1500), (0, 1030, 2500)]
    for pieces in (first, second):
        for (s, a, b), out in zip(pieces, cache.chunks(pieces, seqs)):
            assert_bitwise(out, cold[s][a:b], f"seq {s} [{a}, {b})")


def test_standard_paged_prefill_matches_float64_reference(device):
    """The standard-ops twin (the benchmarks' baseline, not batch invariant): each chunk
    within bf16 tolerance of the float64 reference over the whole sequence."""
    from areal_tik.model.ops import get_ops
    from areal_tik.unified_kernels import reference
    from tests._bits import rel_err

    std = get_ops("standard").attention_paged_prefill
    lengths = [45, 20]
    seqs = [_qkv(n, 4, 2, 16, torch.bfloat16, device, seed=95 + i) for i, n in enumerate(lengths)]
    refs = [reference.attention(q, k, v, _cu([q.shape[0]], device)) for q, k, v in seqs]
    cache = ChunkedCache(lengths, 2, 16, torch.bfloat16, device, seed=7)
    for s, (q, k, v) in enumerate(seqs):
        cache.store(s, k, v, 0)
    pieces = [(0, 17, 45), (1, 0, 20)]
    q = torch.cat([seqs[s][0][a:b] for s, a, b in pieces])
    out = std(q, cache.k, cache.v, _cu([28, 20], device), 28, cache.table_rows([0, 1]),
              torch.tensor([17, 0], dtype=torch.int32, device=device))
    assert rel_err(out[:28], refs[0][17:]) < 1e-2 and rel_err(out[28:], refs[1]) < 1e-2


def test_paged_prefill_refuses_programs_wider_than_a_split():
    # One check, in FwdConfig: a 64-row program over 32-position splits gave wrong bits.
    with pytest.raises(ValueError, match=r"64 x 1 = 64\) must divide kv_split = 32"):
        FwdConfig(block_m=64, block_n=16, num_warps=4, kv_split=32)

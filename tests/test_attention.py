"""Unified attention: accuracy vs float64, and the bitwise contract across regimes.

A query row at position p must have the same output bits whether computed by the packed
varlen forward (any composition, padding), by prefill of its sequence alone, or by paged
decode at context p + 1 (shuffled block tables, poisoned unused slots, any batch).
CPU runs use the interpreter tiles (16 x 16, KV split 32, prefill programs of 2 sub-tiles),
so lengths 17, 33 and 70 cross tiles, splits and prefill programs; ``-m gpu`` repeats the
contract at real sizes.
"""
import dataclasses
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton

from areal_tik.unified_kernels import _attention_bwd, _attention_fwd, reference
from areal_tik.unified_kernels import attention as attn_mod
from areal_tik.unified_kernels._attention_fwd import FwdConfig, attention_config
from areal_tik.unified_kernels.attention import attention_decode, attention_varlen, store_kv_cache
from tests._bits import assert_bitwise, rel_err

BF16_TOL = 1e-2
FP32_TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]

# The interpreter turns 1-element loop bounds into ints through a deprecated numpy path.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _tol(dtype):
    return BF16_TOL if dtype == torch.bfloat16 else FP32_TOL


def _cu(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                        device=device)


def _qkv(T, hq, hk, dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda h: torch.randn(T, h, dim, generator=g).to(dtype).to(device)  # noqa: E731
    return mk(hq), mk(hk), mk(hk)


def _block_size():
    return 2 * attention_config().block_n


class PagedCache:
    """Paged caches holding several sequences in shuffled blocks. Every slot is first
    poisoned (about 30 % NaN, the rest +-1e4 garbage), then the real K/V are stored; the
    slots a decode must not read (future positions, unused blocks) keep the poison."""

    def __init__(self, seqs_kv, block_size, device, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        hk, dim, dtype = seqs_kv[0][0].shape[1], seqs_kv[0][0].shape[2], seqs_kv[0][0].dtype
        need = [math.ceil(k.shape[0] / block_size) for k, _ in seqs_kv]
        num_blocks = sum(need) + 3
        self.block_size = block_size
        shape = (num_blocks, block_size, hk, dim)
        poison = torch.randn(shape, generator=g) * 1e4
        poison[torch.rand(shape, generator=g) < 0.3] = float("nan")
        self.k = poison.to(dtype).to(device)
        self.v = poison.flip(0).to(dtype).to(device)
        order = torch.randperm(num_blocks, generator=g)
        width = max(need) + 1
        self.tables, used = [], 0
        for (k, v), n in zip(seqs_kv, need):
            blocks = order[used:used + n]
            used += n
            table = torch.cat([blocks, order[-1:].repeat(width - n)])  # tail entries unused
            self.tables.append(table.to(torch.int32).to(device))
            pos = torch.arange(k.shape[0])
            slots = (blocks[pos // block_size] * block_size + pos % block_size).to(device)
            store_kv_cache(k, v, self.k, self.v, slots)

    def decode(self, q_rows, seq_ids, positions):
        """Decode q_rows [B, Hq, D] of sequences seq_ids at positions (context p + 1)."""
        tables = torch.stack([self.tables[s] for s in seq_ids])
        ctx = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=q_rows.device)
        return attention_decode(q_rows, self.k, self.v, tables, ctx)


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 16), (4, 2, 32), (8, 2, 16)])
def test_forward_matches_float64_reference(device, dtype, hq, hk, dim):
    lengths = [1, 5, 17, 33]
    T = sum(lengths) + 3  # three padding rows
    q, k, v = _qkv(T, hq, hk, dim, dtype, device)
    cu = _cu(lengths, device)
    out = attention_varlen(q, k, v, cu, max(lengths))
    ref = reference.attention(q, k, v, cu, compute=torch.float64)
    ref64 = reference.attention(q.double(), k.double(), v.double(), cu)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref64) < _tol(dtype)
    assert rel_err(out, ref) < 2 * _tol(dtype)
    assert torch.equal(out[sum(lengths):], torch.zeros_like(out[sum(lengths):]))


def test_softmax_scale_and_long_sequence(device):
    lengths = [70]  # 5 tiles, 3 KV splits on CPU
    q, k, v = _qkv(70, 4, 2, 16, torch.float32, device, seed=1)
    cu = _cu(lengths, device)
    out = attention_varlen(q, k, v, cu, 70, softmax_scale=0.3)
    ref = reference.attention(q.double(), k.double(), v.double(), cu, softmax_scale=0.3)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 2)])
def test_backward_matches_float64_reference(device, dtype, hq, hk):
    lengths = [1, 5, 17, 33]
    T = sum(lengths) + 3
    q, k, v = (t.requires_grad_() for t in _qkv(T, hq, hk, 16, dtype, device, seed=2))
    cu = _cu(lengths, device)
    out = attention_varlen(q, k, v, cu, max(lengths))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, cu)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == dtype
        assert rel_err(g, r) < _tol(dtype), name
        assert torch.equal(g[sum(lengths):], torch.zeros_like(g[sum(lengths):])), name
    again = torch.autograd.grad(attention_varlen(q, k, v, cu, max(lengths)), (q, k, v), dout)
    for g, g2 in zip(grads, again):
        assert_bitwise(g, g2, "backward is deterministic")


# ----------------------------------------------------------------------------- bitwise contract


def _contract_prefill_vs_decode(device, hq, hk, dim, dtype, lengths, positions=None,
                                block_size=None, alone=6):
    """Prefill each sequence alone, then decode rows from a shuffled, poisoned paged cache:
    a few alone (batch 1), and all together in one shuffled batch."""
    seqs = [_qkv(n, hq, hk, dim, dtype, device, seed=10 + i) for i, n in enumerate(lengths)]
    prefill = [attention_varlen(q, k, v, _cu([q.shape[0]], device), q.shape[0]) for q, k, v in seqs]
    cache = PagedCache([(k, v) for _, k, v in seqs], block_size or _block_size(), device)
    jobs = []
    for s, n in enumerate(lengths):
        pos = positions(n) if positions else sorted({0, n // 2, n - 1})
        jobs += [(s, p) for p in pos]
    for s, p in jobs[:: max(1, len(jobs) // alone)]:
        out = cache.decode(seqs[s][0][p:p + 1], [s], [p])
        assert_bitwise(out[0], prefill[s][p], f"decode alone seq {s} pos {p}")
    order = torch.randperm(len(jobs), generator=torch.Generator().manual_seed(5)).tolist()
    batch = [jobs[i] for i in order]
    q_rows = torch.stack([seqs[s][0][p] for s, p in batch])
    out = cache.decode(q_rows, [s for s, _ in batch], [p for _, p in batch])
    for i, (s, p) in enumerate(batch):
        assert_bitwise(out[i], prefill[s][p], f"decode in batch seq {s} pos {p}")


def _prompt_then_answer(device, hq, hk, dim, P, A, block_size):
    """Prompt rows of the full prefill == prompt-only prefill; each answer row == the
    decode step that produced it, after storing its K/V into the cache."""
    q, k, v = _qkv(P + A, hq, hk, dim, torch.bfloat16, device, seed=20)
    full = attention_varlen(q, k, v, _cu([P + A], device), P + A)
    prompt = attention_varlen(q[:P], k[:P], v[:P], _cu([P], device), P)
    assert_bitwise(prompt, full[:P], "prompt-only prefill")
    bs = block_size
    blocks = math.ceil((P + A) / bs)
    g = torch.Generator().manual_seed(21)
    kc = torch.full((blocks + 2, bs, hk, dim), float("nan")).to(torch.bfloat16).to(device)
    vc = torch.randn(kc.shape, generator=g).mul(1e4).to(torch.bfloat16).to(device)
    table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32).to(device)
    slots = table.long()[torch.arange(P + A, device=device) // bs] * bs + torch.arange(P + A, device=device) % bs
    store_kv_cache(k[:P], v[:P], kc, vc, slots[:P])
    for p in range(P, P + A):
        store_kv_cache(k[p:p + 1], v[p:p + 1], kc, vc, slots[p:p + 1])
        ctx = torch.tensor([p + 1], dtype=torch.int32, device=device)
        out = attention_decode(q[p:p + 1], kc, vc, table[None], ctx)
        assert_bitwise(out[0], full[p], f"answer token {p}")


def _packed_equals_alone(device, hq, hk, dim, lengths, layouts):
    """Packed forward (orders and padding from layouts) == each sequence's own prefill."""
    seqs = [_qkv(n, hq, hk, dim, torch.bfloat16, device, seed=30 + i) for i, n in enumerate(lengths)]
    alone = [attention_varlen(q, k, v, _cu([q.shape[0]], device), q.shape[0]) for q, k, v in seqs]
    for order, pad in layouts:
        cat = lambda i: torch.cat([seqs[s][i] for s in order]  # noqa: E731
                                  + [torch.randn_like(seqs[0][i][:1]).expand(pad, -1, -1)])
        q, k, v = cat(0), cat(1), cat(2)
        cu = _cu([lengths[s] for s in order], device)
        out = attention_varlen(q, k, v, cu, max(lengths[s] for s in order))
        for j, s in enumerate(order):
            assert_bitwise(out[cu[j]:cu[j + 1]], alone[s], f"packed order {order} seq {s}")
        assert torch.equal(out[int(cu[-1]):], torch.zeros_like(out[int(cu[-1]):]))


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 2)])
def test_prefill_rows_equal_paged_decode(device, hq, hk):
    _contract_prefill_vs_decode(device, hq, hk, 16, torch.bfloat16, [1, 5, 17, 33, 70])


def test_prefill_rows_equal_paged_decode_fp32_d32(device):
    _contract_prefill_vs_decode(device, 4, 2, 32, torch.float32, [17, 33])


def test_every_row_of_a_sequence_equals_decode(device):
    _contract_prefill_vs_decode(device, 4, 2, 16, torch.bfloat16, [40], positions=lambda n: range(n))


def test_prompt_then_answer_token_by_token(device):
    _prompt_then_answer(device, 4, 2, 16, P=19, A=16, block_size=_block_size())


@pytest.mark.parametrize("hq,hk", [(4, 2), (8, 2)])
def test_packed_training_equals_per_sequence_prefill(device, hq, hk):
    layouts = (([0, 1, 2, 3, 4, 5], 0), ([4, 2, 0, 5, 3, 1], 7), ([3], 2), ([1, 4], 13), ([1], 40))
    _packed_equals_alone(device, hq, hk, 16, [33, 1, 17, 5, 70, 16], layouts)


def test_all_padding_and_empty_batches(device):
    q, k, v = _qkv(21, 4, 2, 16, torch.bfloat16, device)
    out = attention_varlen(q, k, v, _cu([], device), 0)  # cu_seqlens = [0]: all padding
    assert torch.equal(out, torch.zeros_like(out))
    out = attention_varlen(q[:0], k[:0], v[:0], _cu([0, 0], device), 0)
    assert out.shape == (0, 4, 16)


def test_training_forward_with_grad_equals_inference_forward(device):
    lengths = [17, 33]
    q, k, v = _qkv(50, 4, 2, 16, torch.bfloat16, device, seed=40)
    cu = _cu(lengths, device)
    plain = attention_varlen(q, k, v, cu, 33)
    trained = attention_varlen(q.requires_grad_(), k.requires_grad_(), v, cu, 33)
    assert_bitwise(trained.detach(), plain, "forward with LSE saved")


def test_single_split_table_equals_multi_split_table(device):
    """A block table covering one KV split takes the in-kernel fold; a wider one writes
    split partials for the combine kernel. Same bits either way."""
    cfg = attention_config()
    n = cfg.kv_split  # exactly one split
    q, k, v = _qkv(n, 4, 2, 16, torch.bfloat16, device, seed=45)
    full = attention_varlen(q, k, v, _cu([n], device), n)
    cache = PagedCache([(k, v)], cfg.kv_split, device)  # one block per split
    narrow, wide = cache.tables[0][:1], cache.tables[0]
    assert narrow.numel() * cfg.kv_split <= cfg.kv_split < wide.numel() * cfg.kv_split
    picks = [0, n // 2, n - 1]
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=device)
    for table in (narrow, wide):
        tables = table[None].expand(len(picks), -1).contiguous()
        out = attention_decode(q[picks], cache.k, cache.v, tables, ctx)
        assert_bitwise(out, full[picks], f"table width {table.numel()}")


def test_scheduling_switches_keep_bits(device):
    """Skipping the mask on whole tiles and running prefill programs of one sub-tile
    instead of two are scheduling choices, not numerics changes."""
    masked_only = dataclasses.replace(attention_config(), unmasked_loop=False)
    one_subtile = dataclasses.replace(attention_config(), prefill_subtiles=1, prefill_pack_heads=1)
    q, k, v = _qkv(75, 4, 2, 16, torch.bfloat16, device, seed=47)
    cu = _cu([70, 5], device)
    base = attention_varlen(q, k, v, cu, 70)
    assert_bitwise(attention_varlen(q, k, v, cu, 70, config=masked_only), base, "prefill masked")
    assert_bitwise(attention_varlen(q, k, v, cu, 70, config=one_subtile), base, "prefill 1 sub-tile")
    cache = PagedCache([(k[:70], v[:70])], _block_size(), device)
    tables, picks = cache.tables[0][None].expand(3, -1).contiguous(), [0, 40, 69]
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=device)
    assert_bitwise(attention_decode(q[picks], cache.k, cache.v, tables, ctx, config=masked_only),
                   attention_decode(q[picks], cache.k, cache.v, tables, ctx), "decode")


@pytest.mark.parametrize("hq,hk", [(4, 2), (8, 2), (3, 3)])
def test_packed_heads_and_chunked_order_keep_bits(device, hq, hk):
    """Prefill programs over two query heads of a KV group (prefill_pack_heads) and the
    chunked launch order (prefill_order_chunk) are scheduling: every row, the training LSE,
    the zeroed padding rows and the paged chunk rows keep the default launch's bits. Lengths
    70 and 5 give 5 position blocks of 16 (chunks of 2 leave a partial last chunk); a group
    of 1 (3 / 3 heads) falls back to one head per program."""
    base = attention_config()
    configs = {f"pack {p}, chunk {c}": dataclasses.replace(base, prefill_pack_heads=p, prefill_order_chunk=c)
               for p in (1, 2) for c in (0, 1, 2, 8) if (p, c) != (1, 0)}
    q, k, v = _qkv(80, hq, hk, 16, torch.bfloat16, device, seed=48)
    cu = _cu([70, 5], device)
    grad_q = q.detach().requires_grad_()
    want = attention_varlen(q, k, v, cu, 70)
    want_lse = attn_mod._forward(q, k, v, cu, 2, 70, 16 ** -0.5, True, base)[1]
    for label, cfg in configs.items():
        assert_bitwise(attention_varlen(q, k, v, cu, 70, config=cfg), want, f"prefill, {label}")
        assert_bitwise(attention_varlen(grad_q, k, v, cu, 70, config=cfg).detach(), want, f"training, {label}")
        lse = attn_mod._forward(q, k, v, cu, 2, 70, 16 ** -0.5, True, cfg)[1]
        assert_bitwise(lse[:, :75], want_lse[:, :75], f"LSE, {label}")
        pad = attention_varlen(q, k, v, cu, 70, config=cfg)[75:]  # padding rows: +0.0, bit for bit
        assert_bitwise(pad, torch.zeros_like(pad), f"padding rows, {label}")
    # paged chunked prefill: rows 40..69 of the first sequence against its cache
    cache = PagedCache([(k[:70], v[:70])], _block_size(), device)
    chunk_cu = _cu([30], device)
    starts = torch.tensor([40], dtype=torch.int32, device=device)
    for label, cfg in configs.items():
        got = attn_mod.attention_paged_prefill(q[40:70], cache.k, cache.v, chunk_cu, 30, cache.tables[0][None],
                                               starts, config=cfg)
        assert_bitwise(got, want[40:70], f"paged chunk, {label}")


def test_decode_head_group_split_threshold_keeps_bits(device):
    """decode_programs_per_sm decides how many programs share a KV group's query heads
    (0: one program a group; more: the group split while the grid is small): geometry only,
    so every setting gives the same bits, and the settings do give different geometries."""
    base = attention_config()
    q, k, v = _qkv(90, 8, 2, 16, torch.bfloat16, device, seed=49)
    cache = PagedCache([(k[:90], v[:90])], _block_size(), device)
    picks = [0, 45, 89]
    tables = cache.tables[0][None].expand(len(picks), -1).contiguous()
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=device)
    want = attention_varlen(q, k, v, _cu([90], device), 90)[picks]
    splits = max(1, -(-tables.shape[1] * _block_size() // base.kv_split))
    sms = _attention_fwd._sm_count(torch.device(device))
    rows = {n: _attention_fwd._decode_rows_per_program(len(picks), 2, 4, splits, base.block_m, sms, n) for n in (0, 1, 2, 64)}
    assert rows[0] == 4 and rows[64] == 1, rows  # whole groups vs one head a program
    for n in rows:
        cfg = dataclasses.replace(base, decode_programs_per_sm=n)
        assert_bitwise(attention_decode(q[picks], cache.k, cache.v, tables, ctx, config=cfg), want,
                       f"decode, {n} programs per SM")
    with pytest.raises(ValueError, match="decode_programs_per_sm"):
        dataclasses.replace(base, decode_programs_per_sm=-1)


def _tma_cases(device, lengths, hq, hk, dim, seed):
    """q, k, v as views of one fused projection output [T, (Hq + 2 Hk) * D] (the model's
    layout: heads adjacent, row stride 16-byte aligned, what the descriptors need)."""
    T = sum(lengths) + 3
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(T, hq + 2 * hk, dim, generator=g).to(torch.bfloat16).to(device)
    return qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], _cu(lengths, device)


def test_tma_loads_keep_bits(device):
    """Whole K/V tiles loaded through TMA descriptors (prefill_tma: contiguous and paged
    prefill; decode_tma: paged decode) instead of pointers: the same values reach the same
    dots, so every row, the training LSE, the zeroed padding rows, the paged chunk rows and
    decode at one and at several splits keep the pointer loads' bits. The descriptors are
    built (the test would otherwise compare the pointer path with itself), and a layout
    they cannot describe (heads not adjacent) falls back to pointers."""
    base = dataclasses.replace(attention_config(), prefill_tma=False, decode_tma=False)  # pointer loads
    tma = dataclasses.replace(base, prefill_tma=True, decode_tma=True)
    lengths = [70, 5, 100]
    q, k, v, cu = _tma_cases(device, lengths, 4, 2, 16, seed=50)
    assert _attention_fwd.kv_descriptors(k, v, base.block_n, True) is not None
    assert _attention_fwd.kv_descriptors(k, v, base.block_n, False) is None
    spread = torch.randn(k.shape[0], 2, 32).to(torch.bfloat16).to(device)[:, :, :16]  # head stride 32
    _attention_fwd._pointer_loads_instead.cache_clear()
    with pytest.warns(RuntimeWarning, match="pointer loads used: head dim not unit-strided or heads not adjacent"):
        assert _attention_fwd.kv_descriptors(spread, spread, base.block_n, True) is None
    with warnings.catch_warnings():  # fp32 is outside the knob (FMA dots): pointer loads, no word
        warnings.simplefilter("error")
        assert _attention_fwd.kv_descriptors(k.float(), v.float(), base.block_n, True) is None
    want, want_lse = attn_mod._forward(q, k, v, cu, 3, 100, 16 ** -0.5, True, base)
    got, got_lse = attn_mod._forward(q, k, v, cu, 3, 100, 16 ** -0.5, True, tma)
    assert_bitwise(got, want, "prefill")
    assert_bitwise(got_lse[:, :175], want_lse[:, :175], "training LSE")
    assert_bitwise(got[175:], torch.zeros_like(got[175:]), "padding rows")
    grad_q = q.detach().requires_grad_()
    assert_bitwise(attention_varlen(grad_q, k, v, cu, 100, config=tma).detach(), want, "training forward")
    # the paged regimes: a cache holding the third sequence in shuffled, poisoned blocks
    k3, v3, q3 = k[75:175], v[75:175], q[75:175]
    cache = PagedCache([(k3, v3)], _block_size(), device)
    assert _attention_fwd.kv_descriptors(cache.k, cache.v, base.block_n, True) is not None
    starts = torch.tensor([40], dtype=torch.int32, device=device)
    for label, cfg in (("pointers", base), ("TMA", tma)):
        chunk = attn_mod.attention_paged_prefill(q3[40:100], cache.k, cache.v, _cu([60], device), 60,
                                                 cache.tables[0][None], starts, config=cfg)
        assert_bitwise(chunk, want[115:175], f"paged chunk, {label}")
    picks = [0, 31, 32, 63, 64, 99]  # across tiles and splits of 32
    tables = cache.tables[0][None].expand(len(picks), -1).contiguous()
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=device)
    for label, t in (("several splits", tables), ("one split", tables[:, :1])):
        rows = [i for i, p in enumerate(picks) if p < t.shape[1] * _block_size()]
        got = attention_decode(q3[[picks[i] for i in rows]], cache.k, cache.v, t[rows], ctx[rows], config=tma)
        assert_bitwise(got, want[[75 + picks[i] for i in rows]], f"decode, {label}")


def test_packed_heads_and_order_chunk_are_checked():
    with pytest.raises(ValueError, match="prefill_pack_heads"):
        FwdConfig(16, 16, 4, 32, prefill_subtiles=2, prefill_pack_heads=4)
    with pytest.raises(ValueError, match="prefill_pack_heads"):
        FwdConfig(16, 16, 4, 64, prefill_subtiles=4, prefill_pack_heads=3)
    with pytest.raises(ValueError, match="prefill_order_chunk"):
        FwdConfig(16, 16, 4, 32, prefill_order_chunk=-1)
    cfg = FwdConfig(16, 16, 4, 32, prefill_subtiles=2, prefill_pack_heads=2)
    assert _attention_fwd.prefill_packing(cfg, torch.bfloat16, 8, 2) == (2, 0)
    assert _attention_fwd.prefill_packing(cfg, torch.bfloat16, 3, 1) == (1, 0)  # group of 3
    assert _attention_fwd.prefill_packing(cfg, torch.float32, 8, 2) == (1, 0)  # one sub-tile


def test_kernels_compile_for_sm90_with_identical_core():
    """Without a GPU: compile the kernels for sm_90a (H200) and check that prefill and
    decode get the same MMA / exp2 / fma / max / shuffle instructions."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "eval.probe_attention", "--aot", "--check"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr


def test_store_kv_cache_copies_bits_and_skips_padding(device):
    k, v = _qkv(6, 2, 2, 16, torch.bfloat16, device, seed=50)[1:]
    kc = torch.full((3, 16, 2, 16), 7.0, dtype=torch.bfloat16, device=device)
    vc = kc.clone()
    slots = torch.tensor([5, -1, 16, 47, -1, 0], dtype=torch.int64, device=device)
    store_kv_cache(k, v, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert_bitwise(kc.view(-1, 2, 16)[s], k[t], "k row")
            assert_bitwise(vc.view(-1, 2, 16)[s], v[t], "v row")
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[[5, 16, 47, 0]] = False
    assert (kc.view(-1, 2, 16)[untouched.to(device)] == 7).all()


def test_decode_zero_context_gives_zeros(device):
    seqs = [_qkv(5, 4, 2, 16, torch.bfloat16, device, seed=60)]
    cache = PagedCache([(k, v) for _, k, v in seqs], _block_size(), device)
    table = cache.tables[0][None]
    ctx = torch.zeros(1, dtype=torch.int32, device=device)
    out = attention_decode(seqs[0][0][:1], cache.k, cache.v, table, ctx)
    assert torch.equal(out, torch.zeros_like(out))


def test_negative_control_other_block_n_changes_bits(device):
    """The bitwise checks can fail: a different KV tile size reorders the softmax sums."""
    base = attention_config()
    other = FwdConfig(base.block_m, 2 * base.block_n, base.num_warps, 2 * base.kv_split,
                      base.stages_prefill, base.stages_decode)
    q, k, v = _qkv(70, 4, 2, 16, torch.bfloat16, device, seed=70)
    cu = _cu([70], device)
    a = attention_varlen(q, k, v, cu, 70)
    b = attention_varlen(q, k, v, cu, 70, config=other)
    assert rel_err(a, b) < BF16_TOL
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))


class _LaunchRecorder:
    """Stands in for a Triton kernel: records (name, grid), computes nothing."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, tuple(grid)))


def test_validate_false_reads_no_device_values_and_grids_come_from_shapes(monkeypatch):
    """With validate=False no launcher reads a tensor's values on the host (so every call
    is CUDA-graph capturable and never syncs), and decode's grid and launches depend on
    static shapes only, not on context_lens."""
    launches = []
    kernels = ((_attention_fwd, ("_prefill_fwd_kernel", "_decode_fwd_kernel", "_decode_combine_kernel")),
               (_attention_bwd, ("_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")),
               (attn_mod, ("_store_kv_kernel",)))
    for module, names in kernels:
        for name in names:
            monkeypatch.setattr(module, name, _LaunchRecorder(name, launches))
    q, k, v = _qkv(40, 4, 2, 16, torch.bfloat16, "cpu")
    q.requires_grad_()
    cu = _cu([30, 10], "cpu")
    kc = torch.zeros(8, _block_size(), 2, 16, dtype=torch.bfloat16)
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)
    slots = torch.arange(40)

    def host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    with monkeypatch.context() as m:
        for method in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
            m.setattr(torch.Tensor, method, host_read)
        out = attention_varlen(q, k, v, cu, 30, validate=False)
        torch.autograd.grad(out, q, torch.ones_like(out))
        store_kv_cache(k, v, kc, kc.clone(), slots, validate=False)
        grids = []
        for ctx in ([1, 1], [3 * _block_size(), 2 * _block_size() + 5]):
            launches.clear()
            attention_decode(q[:2].detach(), kc, kc, tables, torch.tensor(ctx, dtype=torch.int32),
                             validate=False)
            grids.append(list(launches))
    assert grids[0] == grids[1] and grids[0][0][0] == "_decode_fwd_kernel"


def test_config_validation():
    with pytest.raises(ValueError, match="kv_split"):
        FwdConfig(16, 16, 4, 48)
    with pytest.raises(ValueError, match="prefill_subtiles"):
        FwdConfig(16, 16, 4, 32, prefill_subtiles=3)
    with pytest.raises(ValueError, match=r"16 x 4 = 64\) must divide kv_split = 32"):
        FwdConfig(16, 16, 4, 32, prefill_subtiles=4)
    FwdConfig(16, 16, 4, 32, prefill_subtiles=2)  # 32 rows: one split


# ----------------------------------------------------------------------------- bad input


def _bad_varlen_cases(device):
    q, k, v = _qkv(10, 4, 2, 16, torch.bfloat16, device)
    cu = _cu([4, 6], device)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return [
        ((q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous(), cu, 6), ValueError, "head_dim"),
        ((q[:, :3], k, v, cu, 6), ValueError, "multiple of KV heads"),
        ((q, k, v, i32([0, 6, 4]), 6), ValueError, "non-decreasing"),
        ((q, k, v, i32([1, 4, 6]), 6), ValueError, "start at 0"),
        ((q, k, v, i32([0, 4, 11]), 7), ValueError, "exceeds"),
        ((q, k, v, cu, 5), ValueError, "max_seqlen"),
        ((q, k, v, cu.long(), 6), TypeError, "cu_seqlens"),
        ((q.half(), k.half(), v.half(), cu, 6), TypeError, "dtype"),
        ((q, k.float(), v.float(), cu, 6), TypeError, "dtype"),
        ((q[0], k, v, cu, 6), ValueError, "rank"),
        ((q, k[:9], v[:9], cu, 6), ValueError, "tokens"),
        ((q, k, v, cu, 6.0), TypeError, "max_seqlen"),
        ((q.tolist(), k, v, cu, 6), TypeError, "torch.Tensor"),
    ]


def test_bad_varlen_input_raises(device):
    for args, exc, words in _bad_varlen_cases(device):
        with pytest.raises(exc, match=words):
            attention_varlen(*args)
    q, k, v = _qkv(10, 4, 2, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention_varlen(q, k, v, _cu([10], device), 10, softmax_scale=-1.0)


def test_bad_decode_input_raises(device):
    seqs = [_qkv(20, 4, 2, 16, torch.bfloat16, device)]
    bs = _block_size()
    cache = PagedCache([(k, v) for _, k, v in seqs], bs, device)
    q = seqs[0][0][:1]
    table = cache.tables[0][None]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    covered = table.shape[1] * bs
    half_tile = attention_config().block_n // 2
    cases = [
        ((q, cache.k, cache.v, table, i32([covered + 1])), ValueError, "context_lens"),
        ((q, cache.k, cache.v, table, i32([-1])), ValueError, "context_lens"),
        ((q, cache.k, cache.v, table.long(), i32([5])), TypeError, "block_tables"),
        ((q, cache.k, cache.v, table, i32([5, 6])), ValueError, "one row per query"),
        ((q, cache.k, cache.v, table[0], i32([5])), ValueError, "rank"),
        ((q[:, :3], cache.k, cache.v, table, i32([5])), ValueError, "multiple of KV heads"),
        ((q.float(), cache.k, cache.v, table, i32([5])), TypeError, "dtype"),
        ((q, cache.k[:, :half_tile], cache.v[:, :half_tile], table, i32([5])), ValueError, "block_size"),
        ((q, cache.k, cache.v, torch.full_like(table, 10 ** 6), i32([5])), ValueError, "block_tables"),
        ((q[0], cache.k, cache.v, table, i32([5])), ValueError, "rank"),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc, match=words):
            attention_decode(*args)


def test_bad_store_input_raises(device):
    k, v = _qkv(4, 2, 2, 16, torch.bfloat16, device)[1:]
    kc = torch.zeros((2, 16, 2, 16), dtype=torch.bfloat16, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="slot_mapping values"):
        store_kv_cache(k, v, kc, kc.clone(), slots + 30)
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kv_cache(k, v, kc, kc.clone(), slots.int())
    with pytest.raises(ValueError, match="one slot per token"):
        store_kv_cache(k, v, kc, kc.clone(), slots[:3])
    with pytest.raises(ValueError, match="dtype"):
        store_kv_cache(k, v, kc.float(), kc.float(), slots)


def test_exports():
    import areal_tik.unified_kernels as uk

    for name in ("attention_varlen", "store_kv_cache", "attention_decode"):
        assert getattr(uk, name) is getattr(attn_mod, name)


# ----------------------------------------------------------------------------- GPU, real sizes

gpu = pytest.mark.gpu
GPU_SHAPES = [(32, 8, 128), (16, 8, 64)]  # (Hq, Hk, D): GQA 4 and 2


def _boundary_positions(n):
    """Tile (64), prefill program (128) and KV-split boundaries, the middle and the last row."""
    split = attention_config().kv_split
    edges = {0, 1, 63, 64, 65, 127, 128, 129, n // 2, n - 2, n - 1}
    edges |= {s + e for s in range(split, n, split) for e in (-1, 0, 1)}
    return sorted(p for p in edges if 0 <= p < n)


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES + [(8, 8, 128)])
@pytest.mark.parametrize("block_size", [64, 128])
def test_gpu_prefill_rows_equal_paged_decode(hq, hk, dim, block_size):
    _contract_prefill_vs_decode("cuda", hq, hk, dim, torch.bfloat16, [1, 129, 1000, 2049, 8192],
                                positions=_boundary_positions, block_size=block_size, alone=10)


@gpu
def test_gpu_prefill_rows_equal_paged_decode_fp32():
    _contract_prefill_vs_decode("cuda", 8, 2, 64, torch.float32, [129, 300], block_size=64)


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_prompt_then_answer_token_by_token(hq, hk, dim):
    _prompt_then_answer("cuda", hq, hk, dim, P=1000, A=80, block_size=64)  # crosses row 1024
    _prompt_then_answer("cuda", hq, hk, dim, P=2040, A=20, block_size=128)  # crosses the split


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_packed_training_equals_per_sequence_prefill(hq, hk, dim):
    lengths = [1000, 129, 1, 2049, 3000, 17]
    total = sum(lengths)
    pad = -total % 256  # AReaL pads packed micro-batches to a multiple of 256
    layouts = (([0, 1, 2, 3, 4, 5], pad), ([5, 3, 1, 4, 0, 2], pad + 256), ([4], 7), ([2, 0], 0))
    _packed_equals_alone("cuda", hq, hk, dim, lengths, layouts)


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_forward_matches_float64_reference(hq, hk, dim):
    lengths = [1, 17, 129, 1000, 2100]
    q, k, v = _qkv(sum(lengths) + 5, hq, hk, dim, torch.bfloat16, "cuda", seed=80)
    cu = _cu(lengths, "cuda")
    out = attention_varlen(q, k, v, cu, max(lengths))
    ref = reference.attention(q.double(), k.double(), v.double(), cu)
    assert rel_err(out, ref) < BF16_TOL
    q, k, v = _qkv(429, 8, 2, 64, torch.float32, "cuda", seed=81)
    cu = _cu([129, 300], "cuda")
    ref = reference.attention(q.double(), k.double(), v.double(), cu)
    assert rel_err(attention_varlen(q, k, v, cu, 300), ref) < FP32_TOL


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_backward_matches_float64_reference(hq, hk, dim):
    lengths = [1, 129, 1000, 2100]
    T = sum(lengths) + 100
    q, k, v = (t.requires_grad_() for t in _qkv(T, hq, hk, dim, torch.bfloat16, "cuda", seed=90))
    cu = _cu(lengths, "cuda")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(91)).to(torch.bfloat16).cuda()
    grads = torch.autograd.grad(attention_varlen(q, k, v, cu, max(lengths)), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = torch.autograd.grad(reference.attention(q64, k64, v64, cu), (q64, k64, v64), dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert rel_err(g, r) < BF16_TOL, name
    again = torch.autograd.grad(attention_varlen(q, k, v, cu, max(lengths)), (q, k, v), dout)
    for g, g2 in zip(grads, again):
        assert_bitwise(g, g2, "backward is deterministic")


@gpu
def test_gpu_cuda_graph_decode_replays_eager_bits():
    hq, hk, dim, bs = 32, 8, 128, 64
    lengths = [3000, 100, 5000, 17]
    seqs = [_qkv(n, hq, hk, dim, torch.bfloat16, "cuda", seed=100 + i) for i, n in enumerate(lengths)]
    cache = PagedCache([(k, v) for _, k, v in seqs], bs, "cuda")

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        pos = [int(torch.randint(0, n, (1,), generator=g)) for n in lengths]
        perm = torch.randperm(len(lengths), generator=g).tolist()
        q = torch.stack([seqs[s][0][pos[s]] for s in perm])
        tables = torch.stack([cache.tables[s] for s in perm])
        ctx = torch.tensor([pos[s] + 1 for s in perm], dtype=torch.int32, device="cuda")
        return q, tables, ctx

    static = [t.clone() for t in inputs(0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attention_decode(*static[:1], cache.k, cache.v, *static[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention_decode(static[0], cache.k, cache.v, static[1], static[2])
    for seed in (1, 2, 3):
        new = inputs(seed)
        if seed == 3:  # new cache contents too: overwrite sequence 0's K/V in place
            k0, v0 = _qkv(lengths[0], hq, hk, dim, torch.bfloat16, "cuda", seed=999)[1:]
            pos = torch.arange(lengths[0], device="cuda")
            table = cache.tables[0].long()
            store_kv_cache(k0, v0, cache.k, cache.v, table[pos // bs] * bs + pos % bs)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = attention_decode(new[0], cache.k, cache.v, new[1], new[2])
        assert_bitwise(static_out, eager, f"graph replay {seed}")


@gpu
def test_gpu_negative_controls():
    """SDPA is not regime-invariant (last prefill row != one-token decode), and a
    different KV tile changes our bits: the bitwise checks above can fail."""
    g = torch.Generator().manual_seed(110)
    differs = []
    for L in (100, 1000, 4000):
        q, k, v = (torch.randn(1, 32, L, 128, generator=g).to(torch.bfloat16).cuda() for _ in range(3))
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        one = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, v)
        differs.append(not torch.equal(full[:, :, -1:].view(torch.int16), one.view(torch.int16)))
    assert any(differs), "SDPA prefill and decode agreed bitwise at every length"
    base = attention_config()
    other = FwdConfig(base.block_m, 2 * base.block_n, base.num_warps, base.kv_split)
    q, k, v = _qkv(3000, 32, 8, 128, torch.bfloat16, "cuda", seed=111)
    cu = _cu([3000], "cuda")
    a = attention_varlen(q, k, v, cu, 3000)
    b = attention_varlen(q, k, v, cu, 3000, config=other)
    assert rel_err(a, b) < BF16_TOL
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))


@gpu
def test_gpu_bad_device_raises():
    q, k, v = _qkv(10, 4, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="device"):
        attention_varlen(q, k, v, _cu([10], "cpu"), 10)
    with pytest.raises(ValueError, match="device"):
        attention_varlen(q.cpu(), k, v, _cu([10], "cuda"), 10)


@gpu
def test_gpu_int64_offsets_and_layout_invariance():
    """Row offsets past 2**31 elements (strided q/k/v views, a 4.3 GB paged cache) give
    the same bits as the contiguous layout, forward and backward."""
    hq, hk, dim, L = 32, 8, 128, 2100
    q, k, v = _qkv(L, hq, hk, dim, torch.bfloat16, "cuda", seed=120)
    row = 2 ** 20 + (hq + 2 * hk) * dim  # row stride: rows >= 2048 start past 2**31
    big = torch.empty(L, row, dtype=torch.bfloat16, device="cuda")
    views = [big[:, a:b].view(L, -1, dim) for a, b in
             ((0, hq * dim), (hq * dim, (hq + hk) * dim), ((hq + hk) * dim, (hq + 2 * hk) * dim))]
    for dst, src in zip(views, (q, k, v)):
        dst.copy_(src)
    cu = _cu([L], "cuda")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(121)).to(torch.bfloat16).cuda()
    results = []
    for args in ((q, k, v), tuple(views)):
        leaves = [t.detach().requires_grad_() for t in args]
        out = attention_varlen(*leaves, cu, L)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_bitwise(b, a, f"strided {name}")
    del big, views
    bs, num_blocks = 64, 33000  # 33000 * 64 * 8 * 128 > 2**31 elements per cache
    kc = torch.zeros(num_blocks, bs, hk, dim, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    need = math.ceil(L / bs)
    table = (num_blocks - 1 - torch.randperm(need, generator=torch.Generator().manual_seed(122)))
    table = table.to(torch.int32).cuda()
    pos = torch.arange(L, device="cuda")
    store_kv_cache(k, v, kc, vc, table.long()[pos // bs] * bs + pos % bs)
    picks = [0, 1000, 2047, 2048, L - 1]
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device="cuda")
    out = attention_decode(q[picks], kc, vc, table[None].expand(len(picks), -1).contiguous(), ctx)
    for i, p in enumerate(picks):
        assert_bitwise(out[i], results[0][0][p], f"decode from a 4.3 GB cache, pos {p}")


@gpu
def test_gpu_unmasked_loop_switch_keeps_bits():
    masked_only = dataclasses.replace(attention_config(), unmasked_loop=False)
    q, k, v = _qkv(5000, 32, 8, 128, torch.bfloat16, "cuda", seed=130)
    cu = _cu([3000, 2000], "cuda")
    assert_bitwise(attention_varlen(q, k, v, cu, 3000, config=masked_only),
                   attention_varlen(q, k, v, cu, 3000), "prefill")
    cache = PagedCache([(k[:3000], v[:3000])], 64, "cuda")
    picks = [0, 63, 64, 2047, 2048, 2999]
    tables = cache.tables[0][None].expand(len(picks), -1).contiguous()
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device="cuda")
    assert_bitwise(attention_decode(q[picks], cache.k, cache.v, tables, ctx, config=masked_only),
                   attention_decode(q[picks], cache.k, cache.v, tables, ctx), "decode")


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_prefill_subtiles_keep_bits(hq, hk, dim):
    """A prefill program of 2 sub-tiles (128 rows, 8 warps) gives the bits of programs of
    one 64-row sub-tile (the decode tiling), with and without the training LSE."""
    base = attention_config()
    # one head a program where one sub-tile leaves no room for a pack (the GPU default packs 2)
    one, two = (dataclasses.replace(base, prefill_subtiles=s, prefill_pack_heads=min(s, base.prefill_pack_heads))
                for s in (1, 2))
    lengths = [1, 100, 129, 1000, 2049, 3000]
    q, k, v = _qkv(sum(lengths) + 5, hq, hk, dim, torch.bfloat16, "cuda", seed=140)
    cu = _cu(lengths, "cuda")
    assert_bitwise(attention_varlen(q, k, v, cu, 3000, config=two),
                   attention_varlen(q, k, v, cu, 3000, config=one), "inference")
    grad_q = q.detach().requires_grad_()
    assert_bitwise(attention_varlen(grad_q, k, v, cu, 3000, config=two).detach(),
                   attention_varlen(grad_q, k, v, cu, 3000, config=one).detach(), "training (LSE)")


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_packed_heads_and_chunked_order_keep_bits(hq, hk, dim):
    """Prefill programs over two query heads of a KV group, in the default and the chunked
    launch order, give the default launch's bits at real sizes (inference, training LSE,
    zeroed padding rows; a group of one head falls back to one head per program)."""
    base = attention_config()
    lengths = [1, 100, 129, 1000, 2049, 3000]
    q, k, v = _qkv(sum(lengths) + 5, hq, hk, dim, torch.bfloat16, "cuda", seed=141)
    cu = _cu(lengths, "cuda")
    scale = dim ** -0.5
    want, want_lse = attn_mod._forward(q, k, v, cu, len(lengths), 3000, scale, True, base)
    for pack, chunk in ((1, 0), (2, 0), (1, 8), (2, 8), (2, 3)):  # (1, 0): the launch before 6b9f35f
        cfg = dataclasses.replace(base, prefill_pack_heads=pack, prefill_order_chunk=chunk)
        out, lse = attn_mod._forward(q, k, v, cu, len(lengths), 3000, scale, True, cfg)
        label = f"pack {pack}, chunk {chunk}"
        assert_bitwise(out, want, label)
        assert_bitwise(lse[:, :sum(lengths)], want_lse[:, :sum(lengths)], f"LSE, {label}")
        assert_bitwise(attention_varlen(q, k, v, cu, 3000, config=cfg), want, f"inference, {label}")


@gpu
@pytest.mark.parametrize("hq,hk,dim", GPU_SHAPES)
def test_gpu_tma_loads_keep_bits(hq, hk, dim):
    """Whole K/V tiles through TMA descriptors give the pointer loads' bits at real sizes:
    packed prefill with the training LSE (q, k, v views of one fused projection, as the
    model lays them out), paged chunks of a prompt, and paged decode at one and at
    several KV splits over shuffled, poisoned blocks."""
    base = dataclasses.replace(attention_config(), prefill_tma=False, decode_tma=False)  # pointer loads
    tma = dataclasses.replace(base, prefill_tma=True, decode_tma=True)
    lengths = [1, 100, 129, 1000, 2049, 3000]
    q, k, v, cu = _tma_cases("cuda", lengths, hq, hk, dim, seed=142)
    assert _attention_fwd.kv_descriptors(k, v, base.block_n, True) is not None
    scale = dim ** -0.5
    want, want_lse = attn_mod._forward(q, k, v, cu, len(lengths), 3000, scale, True, base)
    got, got_lse = attn_mod._forward(q, k, v, cu, len(lengths), 3000, scale, True, tma)
    assert_bitwise(got, want, "prefill")
    assert_bitwise(got_lse[:, :sum(lengths)], want_lse[:, :sum(lengths)], "training LSE")
    first = sum(lengths[:-1])  # the 3000-token sequence, paged
    cache = PagedCache([(k[first:first + 3000], v[first:first + 3000])], _block_size(), "cuda")
    assert _attention_fwd.kv_descriptors(cache.k, cache.v, base.block_n, True) is not None
    starts = torch.tensor([1000], dtype=torch.int32, device="cuda")
    for label, cfg in (("pointers", base), ("TMA", tma)):
        chunk = attn_mod.attention_paged_prefill(q[first + 1000:first + 3000], cache.k, cache.v,
                                                 _cu([2000], "cuda"), 2000, cache.tables[0][None], starts,
                                                 config=cfg)
        assert_bitwise(chunk, want[first + 1000:first + 3000], f"paged chunk, {label}")
    picks = _boundary_positions(3000)
    tables = cache.tables[0][None].expand(len(picks), -1).contiguous()
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device="cuda")
    per_split = base.kv_split // _block_size()
    for label, t in (("several splits", tables), ("one split", tables[:, :per_split])):
        rows = [i for i, p in enumerate(picks) if p < t.shape[1] * _block_size()]
        got = attention_decode(q[[first + picks[i] for i in rows]], cache.k, cache.v, t[rows], ctx[rows], config=tma)
        assert_bitwise(got, want[[first + picks[i] for i in rows]], f"decode, {label}")


@gpu
def test_gpu_cuda_graph_prefill_replays_eager_bits():
    hq, hk, dim = 32, 8, 128
    lengths = [700, 1500, 33]
    q, k, v = _qkv(sum(lengths) + 20, hq, hk, dim, torch.bfloat16, "cuda", seed=150)
    cu = _cu(lengths, "cuda")
    static = [t.clone() for t in (q, k, v, cu)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_varlen(*static, 1500)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention_varlen(*static, 1500)
    new = _qkv(sum(lengths) + 20, hq, hk, dim, torch.bfloat16, "cuda", seed=151) + (_cu([1500, 33, 700], "cuda"),)
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(static_out, attention_varlen(*new, 1500), "graph replay")

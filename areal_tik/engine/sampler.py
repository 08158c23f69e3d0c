"""Token sampling from bf16 logits without a host sync: Gumbel-max with counter-based noise.

The noise of row b at vocabulary index v is a hash of (request key, output index, v), so a
request draws the same tokens whatever batch it shares, whatever its row position and
across preemption (the output index, not a stream position, keys the draw). On a GPU one
Triton kernel per step fuses scaling, hashing, Gumbel noise and the row argmax (one read
of the logits; the torch formulation below costs ~35 full [B, V] int64 passes, about
1.5 ms per step at B = 64, V = 152k, a third of a decode step). On CPU the same hash runs
as int64 torch ops that never overflow: both draw the same uniforms. Sampling is free to
be anything: the recorded log-probs come from the unified log-prob op, not from here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..unified_kernels._pdl import pdl, pdl_wait

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): split c in 16-bit halves so no product overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply, lowbias32 constants) on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One well-mixed 32-bit value per row from a 63-bit request key and an output index."""
    k_lo, k_hi = keys & _M32, (keys >> 32) & _M32
    return mix32(k_lo ^ mix32(k_hi ^ mix32(counters & _M32)))


_COLUMN_CACHE: dict[tuple[torch.device, int], torch.Tensor] = {}


def _columns(vocab: int, device: torch.device) -> torch.Tensor:
    """(v * golden) mod 2^32 for v < vocab, cached per device and vocabulary size."""
    key = (device, vocab)
    if key not in _COLUMN_CACHE:
        _COLUMN_CACHE[key] = _mul32(torch.arange(vocab, dtype=torch.int64, device=device), _GOLDEN)
    return _COLUMN_CACHE[key]


def uniform_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 uniforms in (0, 1), shape [rows, vocab], a pure function of (key, counter, column).

    23 bits per draw: (n + 0.5) / 2^23 is exact in fp32, so 0 and 1 never occur.
    """
    return ((_hash_bits(keys, counters, vocab) + 0.5) * (1.0 / (1 << 23))).float()


def _hash_bits(keys, counters, vocab, col0=0):
    """The 23 noise bits of vocabulary indices col0 .. col0 + vocab - 1."""
    columns = _columns(col0 + vocab, keys.device)[col0:]
    return mix32((row_keys(keys, counters)[:, None] + columns[None, :]) & _M32) >> 9


# Exponential variates E = -log(u). Near u = 1, log(u) loses all relative precision (and a
# fast hardware log may even return 0, making the Gumbel noise infinite), so for
# v = 1 - u < 1/16 (exact: v = (2^23 - 1 - n + 0.5) / 2^23) E is the series
# v + v^2/2 + ... + v^7/7 (truncation error < 3e-9 relative); elsewhere -log(u).
_SERIES_BELOW = 0.0625


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 Exp(1) variates, shape [rows, vocab]: -log of ``uniform_noise``, accurate near u = 1."""
    return exponential_from_bits(_hash_bits(keys, counters, vocab).float())


def exponential_from_bits(n: torch.Tensor) -> torch.Tensor:
    """-log((n + 0.5) / 2^23) in fp32 for integer-valued fp32 n in [0, 2^23)."""
    u = (n + 0.5) * (1.0 / (1 << 23))
    v = ((8388607.0 - n) + 0.5) * (1.0 / (1 << 23))
    series = v * (1 + v * (1 / 2 + v * (1 / 3 + v * (1 / 4 + v * (1 / 5 + v * (1 / 6 + v / 7))))))
    return torch.where(v < _SERIES_BELOW, series, -torch.log(u))


def filter_mask(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [rows, vocab] of tokens kept by top-k (0 = off) then top-p (1.0 = off).

    Works in sorted order (stable, descending) so exactly k tokens survive even with ties;
    top-p keeps the smallest prefix whose probability mass reaches p (at least one token).
    """
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    k = torch.where(top_k > 0, top_k, scores.shape[-1])
    keep = ranks < k[:, None]
    probs = torch.softmax(sorted_scores.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0))  # 1.0 never drops a token
    keep &= mass_before < p[:, None]
    return torch.empty_like(keep).scatter_(-1, order, keep)


# ------------------------------------------------------------------ fused GPU kernel


@triton.jit
def _mix32(x):
    # x: uint32; multiplications wrap mod 2^32 and shifts are logical, as in ``mix32``.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _exponential(n):
    # -log(u) for u = (n + 0.5) / 2^23, series near u = 1 (see ``exponential_noise``).
    u = (n + 0.5) * (1.0 / 8388608.0)
    v = ((8388607.0 - n) + 0.5) * (1.0 / 8388608.0)
    series = v * (1 + v * (1 / 2 + v * (1 / 3 + v * (1 / 4 + v * (1 / 5 + v * (1 / 6 + v / 7))))))
    return tl.where(v < 0.0625, series, -tl.log(u))


# keys/counters arrive as rows of one [2, B] int64 tensor: the second row is 16-byte aligned
# only for even B, so their alignment is not part of the kernel key (scalar loads: no cost).
# col0 (a vocabulary shard's first column) is data too: one variant serves every shard, and
# so are the split width and count (one variant for every batch size).
@triton.jit(do_not_specialize=["keys_ptr", "counters_ptr", "col0", "span", "n_splits"])
def _gumbel_argmax_kernel(
    scores_ptr,    # [B, V] bf16 logits or fp32 pre-scaled scores (-inf = filtered out)
    keys_ptr,      # [B] int64 request keys
    counters_ptr,  # [B] int64 output index of the token being drawn
    out_ptr,       # [B, n_splits] int64 each split's candidate (column index + col0)
    best_ptr,      # [B, n_splits] fp32 its noisy score
    V, stride_row, temperature, col0,
    span,          # columns per split, a multiple of BLOCK_V
    n_splits,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (unified_kernels/_pdl.py)
):
    pdl_wait(PDL)
    # Grid: (rows, splits). Split s walks columns [s * span, (s + 1) * span) in BLOCK_V
    # chunks (the chunks of the whole row: span is a multiple of BLOCK_V); the running best
    # only moves on a strictly larger value, so ties keep the lowest index. The combine
    # kernel takes the first split holding the maximum: the first maximal index of the row.
    # Column c of the scores is vocabulary index col0 + c (its noise is that index's).
    row = tl.program_id(0)
    split = tl.program_id(1)
    key = tl.load(keys_ptr + row)
    counter = tl.load(counters_ptr + row)
    k_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    k_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    rkey = _mix32(k_lo ^ _mix32(k_hi ^ _mix32((counter & 0xFFFFFFFF).to(tl.uint32))))
    base = scores_ptr + row.to(tl.int64) * stride_row
    lo = split * span
    hi = tl.minimum(lo + span, V)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = lo.to(tl.int64)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < hi
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(x, temperature)  # IEEE division: equals torch's logits.float() / T
        n = (_mix32(rkey + (cols + col0).to(tl.uint32) * 0x9E3779B9) >> 9).to(tl.float32)
        total = tl.where(ok, z - tl.log(_exponential(n)), float("-inf"))
        chunk_best = tl.max(total, axis=0)
        chunk_idx = tl.argmax(total, axis=0).to(tl.int64) + start
        better = chunk_best > best
        best_idx = tl.where(better, chunk_idx, best_idx)
        best = tl.where(better, chunk_best, best)
    slot = row.to(tl.int64) * n_splits + split
    tl.store(out_ptr + slot, best_idx + col0)
    tl.store(best_ptr + slot, best)


@triton.jit(do_not_specialize=["n_splits"])
def _gumbel_combine_kernel(part_idx_ptr, part_best_ptr, out_ptr, best_ptr, n_splits, MAX_SPLITS: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # One program per row: the first split (in column order) whose best is the row's maximum.
    row = tl.program_id(0)
    offs = tl.arange(0, MAX_SPLITS)
    ok = offs < n_splits
    base = row.to(tl.int64) * n_splits
    best = tl.load(part_best_ptr + base + offs, mask=ok, other=float("-inf"))
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(ok & (best == top), offs, MAX_SPLITS), axis=0)
    first = tl.minimum(first, n_splits - 1)  # NaN rows: no split equals the max; take the last
    tl.store(out_ptr + row, tl.load(part_idx_ptr + base + first))
    tl.store(best_ptr + row, tl.load(part_best_ptr + base + first))


_BLOCK_V = 2048
_MAX_SPLITS = 128  # splits of one row (a fixed constexpr: one combine variant for every batch)
_TARGET_PROGRAMS = 528  # ~4 per H200 SM: one program per row left 64 rows on 132 SMs (125 us a step)


def gumbel_splits(rows: int, vocab: int) -> tuple[int, int]:
    """(columns per split, number of splits) of a ``[rows, vocab]`` draw: enough programs
    to fill the GPU at any batch size, whole BLOCK_V chunks per split. A function of the
    shape only; the token does not depend on it (the first maximal index either way)."""
    chunks = triton.cdiv(vocab, _BLOCK_V)
    splits = max(1, min(chunks, _MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS, rows)))
    span = triton.cdiv(chunks, splits) * _BLOCK_V
    return span, triton.cdiv(vocab, span)


def _noisy_scores(scores, keys, counters, temperature, col0=0):
    """The torch form: ``scores / T - log E`` with the noise of columns col0, col0 + 1, ..."""
    z = scores.float() / temperature
    return z - torch.log(exponential_from_bits(_hash_bits(keys, counters, scores.shape[-1], col0).float()))


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                  temperature: float = 1.0, use_kernel: bool | None = None) -> torch.Tensor:
    """argmax(scores / T - log E) per row (E exponential: the Gumbel-max trick).

    ``use_kernel`` defaults to the Triton kernel on CUDA and the torch ops elsewhere (the
    kernel also runs under the Triton interpreter, which tests use to compare the two).
    """
    return gumbel_candidates(scores, keys, counters, temperature, 0, use_kernel)[1]


def gumbel_candidates(scores, keys, counters, temperature: float = 1.0, col0: int = 0,
                      use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(best noisy score fp32 [B], its vocabulary index col0 + c [B])`` of the scores'
    columns, read as vocabulary indices col0, col0 + 1, ...: a shard's Gumbel candidate
    (the first maximal index on ties, as over the full row)."""
    if use_kernel is None:
        use_kernel = scores.device.type == "cuda"
    if not use_kernel:
        total = _noisy_scores(scores, keys, counters, temperature, col0)
        index = total.argmax(dim=-1)  # the first maximal index
        return total.gather(1, index[:, None])[:, 0], index + col0
    scores = scores.contiguous()
    rows, vocab = scores.shape
    span, splits = gumbel_splits(rows, vocab)
    part_idx = torch.empty((rows, splits), dtype=torch.int64, device=scores.device)
    part_best = torch.empty((rows, splits), dtype=torch.float32, device=scores.device)
    p = pdl(scores)
    _gumbel_argmax_kernel[(rows, splits)](
        scores, keys, counters, part_idx, part_best, vocab, scores.stride(0), float(temperature),
        int(col0), span, splits, BLOCK_V=_BLOCK_V, PDL=p, num_warps=8, launch_pdl=p)
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    best = torch.empty(rows, dtype=torch.float32, device=scores.device)
    _gumbel_combine_kernel[(rows,)](part_idx, part_best, out, best, splits, MAX_SPLITS=_MAX_SPLITS, PDL=p,
                                    num_warps=1, launch_pdl=p)
    return best, out


# ------------------------------------------------------------------ entry point


def sample(logits: torch.Tensor, temperature: float, keys: torch.Tensor, counters: torch.Tensor,
           top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [rows] int64 drawn from softmax(logits.float() / temperature), filtered.

    logits [rows, vocab] (bf16 from the unified LM-head op); temperature 0 is greedy
    (first maximal index); keys/counters [rows] int64; top_k [rows] int64, top_p [rows]
    fp32 or None when no row of the group filters.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    if top_k is None and top_p is None:
        return gumbel_argmax(logits, keys, counters, temperature)
    scores = logits.float() / temperature
    rows = scores.shape[0]
    top_k = top_k if top_k is not None else torch.zeros(rows, dtype=torch.int64, device=scores.device)
    top_p = top_p if top_p is not None else torch.ones(rows, dtype=torch.float32, device=scores.device)
    scores = scores.masked_fill(~filter_mask(scores, top_k, top_p), float("-inf"))
    return gumbel_argmax(scores, keys, counters, 1.0)  # x / 1.0 is exact: same scores


def warmup_tasks(vocab: int, dtype: torch.dtype, device) -> list:
    """The sampler's kernel launches at start-up (``unified_kernels.warmup.run_tasks``): the
    Gumbel kernel on ``dtype`` logits, and on the fp32 scores a top-k / top-p row leaves."""
    import functools

    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    return [functools.partial(sample, logits, 1.0, ids, ids, top_k=top_k, top_p=None) for top_k in (None, ids + 1)]


def sample_sharded(logits: torch.Tensor, col0: int, gather, temperature: float, keys: torch.Tensor,
                   counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` (no top-k / top-p) from a vocabulary shard: ``(tokens [B], their logits [B, 1])``.

    ``logits`` are the columns col0, col0 + 1, ... of the full rows; ``gather`` returns every
    rank's tensor in rank order, ranks holding the vocabulary in that order. Each rank takes
    its candidate (the first maximal index of its columns, greedy or Gumbel with the noise of
    the global index) and the candidates are gathered, packed in one fp64 tensor (exact for
    fp32 scores, indices < 2^53 and bf16 logits); the first rank whose score is maximal
    wins. That is the first maximal index of the full row: the token ``sample`` draws from
    the gathered logits, whatever ties straddle a shard boundary.
    """
    if temperature == 0.0:
        local = logits.argmax(dim=-1)
        best, index = logits.gather(1, local[:, None])[:, 0].float(), local + col0
    else:
        best, index = gumbel_candidates(logits, keys, counters, temperature, col0)
    picked = logits.gather(1, (index - col0)[:, None])[:, 0]
    ranks = torch.stack(gather(torch.stack([best.double(), index.double(), picked.double()])))  # [t, 3, B]
    winner = ranks[:, 0].argmax(dim=0)  # the first maximal rank
    won = ranks.gather(0, winner[None, None, :].expand(1, 3, -1))[0]
    return won[1].long(), won[2].to(logits.dtype)[:, None]

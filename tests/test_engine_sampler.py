"""The sampler: greedy / top-k / top-p exactness, the sampled distribution, row-local keyed
noise, and the fused kernel against the torch formulation."""
from __future__ import annotations

import torch

from areal_tik.engine import sampler


def test_sampler_greedy_top_k_top_p_exact():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g).bfloat16()
    logits[0, :10] = 3.0  # ties: top-k must still keep exactly k, in index order
    keys = torch.arange(6, dtype=torch.int64)
    for step in range(20):
        counters = torch.full((6,), step, dtype=torch.int64)
        assert torch.equal(sampler.sample(logits, 0.0, keys, counters), logits.argmax(-1))
        top_k = torch.tensor([3, 1, 5, 0, 50, 2])
        top_p = torch.tensor([1.0, 1.0, 0.5, 0.3, 0.9, 1.0])
        keep = sampler.filter_mask(logits.float() / 0.8, top_k, top_p)
        assert keep[0].tolist() == [True] * 3 + [False] * 47
        assert keep[1].sum() == 1 and keep.sum(-1).min() >= 1
        tokens = sampler.sample(logits, 0.8, keys, counters, top_k, top_p)
        assert keep[torch.arange(6), tokens].all()
    probs = torch.softmax(logits[3].float() / 0.8, -1)
    order = probs.sort(descending=True, stable=True)
    kept = int((order.values.cumsum(0) - order.values < 0.3).sum())
    assert set(keep[3].nonzero().flatten().tolist()) == set(order.indices[:kept].tolist())


def test_sampler_matches_the_softmax_distribution():
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    logits = (probs.log() * 0.7).bfloat16()  # sampled at T = 0.7 gives back ~probs
    n = 100_000
    tokens = sampler.sample(logits.expand(n, -1), 0.7, torch.full((n,), 7), torch.arange(n))
    freq = torch.bincount(tokens, minlength=8).double() / n
    expected = torch.softmax(logits.double() / 0.7, -1)
    assert (freq - expected).abs().max() < 0.01  # ~5 standard deviations at n = 1e5


def test_sampler_noise_is_row_local_and_keyed():
    logits = torch.randn(5, 300).bfloat16()
    keys = torch.tensor([1, 2, 3, 4, 2**62 + 5])
    counters = torch.tensor([0, 5, 9, 2, 7])
    together = sampler.sample(logits, 1.0, keys, counters)
    alone = torch.cat([sampler.sample(logits[i:i + 1], 1.0, keys[i:i + 1], counters[i:i + 1]) for i in range(5)])
    perm = torch.tensor([3, 0, 4, 1, 2])
    shuffled = sampler.sample(logits[perm], 1.0, keys[perm], counters[perm])
    assert torch.equal(together, alone) and torch.equal(together[perm], shuffled)
    u = sampler.uniform_noise(keys, counters, 300)
    assert 0 < u.min() and u.max() < 1
    assert not torch.equal(u, sampler.uniform_noise(keys, counters + 1, 300))


def test_sampler_kernel_splits_do_not_change_the_token(monkeypatch):
    # The vocabulary is split over programs (sampler.gumbel_splits); the combine takes the
    # first split holding the maximum: one split or one per chunk, the same first maximal
    # index, also for ties placed in different splits and for a row with nothing allowed.
    g = torch.Generator().manual_seed(4)
    vocab = 5 * 2048 - 7
    logits = torch.randn(3, vocab, generator=g).bfloat16()
    logits[1] = float("-inf")
    logits[1, [2100, 4200, 8300]] = float("inf")  # +inf ties in splits 1, 2 and 4: the first wins
    logits[2] = float("-inf")  # nothing allowed: index 0, as the torch argmax gives
    keys, counters = torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2])
    plain = sampler.gumbel_argmax(logits, keys, counters, 1.0, use_kernel=False)
    assert plain.tolist()[1:] == [2100, 0]
    for target, splits in ((1, 1), (3 * 5, 5), (6, 2)):
        monkeypatch.setattr(sampler, "_TARGET_PROGRAMS", target)
        assert sampler.gumbel_splits(3, vocab)[1] == splits
        assert torch.equal(sampler.gumbel_argmax(logits, keys, counters, 1.0, use_kernel=True), plain), splits


def test_sampler_kernel_matches_the_torch_formulation():
    # The fused Triton kernel (GPU path; here interpreted) and the torch ops (CPU path)
    # hash the same noise: same tokens, over several BLOCK_V chunks, with filtered entries.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 3000, generator=g).bfloat16()
    logits[2, 100:] = float("-inf")
    keys = torch.randint(0, 2**62, (8,), generator=g)
    counters = torch.randint(0, 2**40, (8,), generator=g)
    for temperature in (1.0, 0.7):
        fused = sampler.gumbel_argmax(logits, keys, counters, temperature, use_kernel=True)
        plain = sampler.gumbel_argmax(logits, keys, counters, temperature, use_kernel=False)
        assert torch.equal(fused, plain) and fused[2] < 100
    n = torch.cat([torch.arange(0, 1 << 23, 997), torch.arange((1 << 23) - 64, 1 << 23)]).double()
    exact = -torch.log((n + 0.5) / (1 << 23))
    rel = (sampler.exponential_from_bits(n.float()).double() - exact).abs() / exact
    assert rel.max() < 2.5e-7  # fp32 level everywhere, also next to u = 1

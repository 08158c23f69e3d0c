"""Vocabulary parallelism of the embedding and LM head (model/vocab_parallel.py), in one
process: each shard's kernel part, laid end to end and combined, == the one-device LM head
bitwise; the embedding's select keeps every bit (-0.0 included); bad splits refused.
The multi-rank engine runs are in test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch

from areal_tik.engine import EngineConfig
from areal_tik.engine.sampler import gumbel_candidates, sample, sample_sharded
from areal_tik.model import ModelSpec, UnifiedCausalLM, random_model, tiny_config
from areal_tik.model.tensor_parallel import shard_model
from areal_tik.model.vocab_parallel import VocabShard, vocab_split_count
from areal_tik.unified_kernels.logprob import lm_head_logits_lse
from areal_tik.unified_kernels.logprob_shards import vocab_splits

from ._bits import assert_bitwise

H = 32


def _spec(vocab: int) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_config("qwen3", vocab_size=vocab))


def _head(vocab: int, seed: int = 3, T: int = 40):  # 40 rows: a wrong split order shows
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).bfloat16()
    weight = (torch.randn(vocab, H, generator=gen) * 0.5).bfloat16()
    return hidden, weight


def _shards(vocab: int, size: int) -> list[VocabShard]:
    return [VocabShard.of(_spec(vocab), torch.bfloat16, r, size) for r in range(size)]


def _on_every_rank(size: int, fn) -> list:
    """``fn(rank, gather)`` for each rank in this process, ``gather`` returning every rank's
    tensor of the same (n-th) call in rank order: a first pass records each rank's tensors,
    the second pass's results are returned."""
    sent: dict[int, list[torch.Tensor]] = {}

    def gather_of(rank):
        calls = []

        def gather(local):
            n = len(calls)
            calls.append(local)
            mine = sent.setdefault(rank, [])
            if len(mine) == n:  # the first pass
                mine.append(local)
            return [sent[r][n] if len(sent.get(r, [])) > n else torch.zeros_like(local) for r in range(size)]
        return gather
    for r in range(size):
        fn(r, gather_of(r))
    return [fn(r, gather_of(r)) for r in range(size)]


def _sharded_logits_lse(hidden, weight, size, temperature):
    """Every rank's ``VocabShard.logits_lse`` (run in this process); all ranks must agree."""
    shards = _shards(weight.shape[0], size)
    got = _on_every_rank(size, lambda r, gather: shards[r].logits_lse(
        hidden, weight[shards[r].start:shards[r].stop], temperature, gather))
    for r, (logits, lse) in enumerate(got[1:], 1):
        assert_bitwise(logits, got[0][0], f"rank {r}'s logits")
        assert_bitwise(lse, got[0][1], f"rank {r}'s lse")
    return got[0]


# 256 = 4 splits of 64 (the interpreter's split), 250: a partial last split; 192 = 3 and
# 320 = 5 splits: runs of 1 + 2 and 1 + 1 + 1 + 2 splits (uneven, as Qwen3's 297 at TP = 2).
@pytest.mark.parametrize("vocab, size, runs", [(256, 2, (2, 2)), (256, 4, (1, 1, 1, 1)), (250, 4, (1, 1, 1, 1)),
                                               (192, 2, (1, 2)), (320, 4, (1, 1, 1, 2))])
def test_shard_parts_combine_to_the_one_device_lm_head(vocab, size, runs):
    split_v, n_splits = vocab_splits(vocab, H, torch.bfloat16)
    assert split_v == 64 and _shards(vocab, size)[0].runs == runs
    hidden, weight = _head(vocab)
    logits, lse = lm_head_logits_lse(hidden, weight, 0.7)
    got_logits, got_lse = _sharded_logits_lse(hidden, weight, size, 0.7)
    assert_bitwise(got_logits, logits, f"logits, {size} shards")
    assert_bitwise(got_lse, lse, f"lse, {size} shards")


def test_a_tie_across_a_shard_boundary_picks_the_tp1_token():
    # Rows 127 and 128 (the last of shard 0 and the first of shard 1 at TP = 2) are equal and
    # dominate: the logits tie there, and greedy and Gumbel sampling over the gathered row
    # resolve it as TP = 1 does (greedy: the first maximal index, 127).
    hidden, weight = _head(256, seed=4, T=3)
    weight[127] = weight[128] = hidden[0] * 4
    logits, lse = lm_head_logits_lse(hidden, weight)
    got, got_lse = _sharded_logits_lse(hidden, weight, 2, 1.0)
    assert logits[0, 127] == logits[0, 128] == logits[0].max()
    assert_bitwise(got, logits, "tied logits")
    assert_bitwise(got_lse, lse, "lse")
    keys = torch.arange(3, dtype=torch.int64)
    assert sample(got, 0.0, keys, keys)[0] == 127
    for temperature in (1.0, 0.5):
        assert torch.equal(sample(got, temperature, keys, keys), sample(logits, temperature, keys, keys))


def test_the_embedding_select_keeps_every_bit():
    vocab, size = 256, 4
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(vocab, H, generator=gen).bfloat16()
    weight[200, :4] = -0.0  # a sum with the other ranks' zeros would turn these into +0.0
    ids = torch.tensor([0, 63, 64, 127, 128, 200, 255, 200])
    shards = _shards(vocab, size)
    got = _on_every_rank(size, lambda r, gather: shards[r].embed(ids, weight[shards[r].start:shards[r].stop], gather))
    for r, rows in enumerate(got):
        assert_bitwise(rows, torch.nn.functional.embedding(ids, weight), f"rank {r}'s embedding")


def _planted_logits(vocab: int = 250) -> torch.Tensor:
    """Rows with ties across the TP = 2 and TP = 4 shard boundaries (127 | 128, 63 | 64,
    191 | 192), rows whose first shards are all -inf (their candidates must lose), and a
    -0.0 | +0.0 tie (equal scores: the first, -0.0, wins and keeps its sign bit)."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, vocab, generator=gen).bfloat16()
    logits[0, [127, 128]] = 9.0
    logits[1, [63, 64, 200]] = 9.0
    logits[2, :191] = float("-inf")
    logits[2, [191, 192]] = 9.0
    logits[3, :128] = float("-inf")
    logits[4] = float("-inf")
    logits[4, 127], logits[4, 128] = -0.0, 0.0
    return logits


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_sampling_draws_the_tp1_token_with_its_tie_breaking(size):
    logits = _planted_logits()
    keys, counters = torch.arange(6, dtype=torch.int64) * 977, torch.arange(6, dtype=torch.int64)
    shards = _shards(logits.shape[1], size)
    for temperature in (0.0, 1.0, 0.6):
        want = sample(logits, temperature, keys, counters)
        got = _on_every_rank(size, lambda r, gather: sample_sharded(
            logits[:, shards[r].start:shards[r].stop], shards[r].start, gather, temperature, keys, counters))
        for r, (tokens, picked) in enumerate(got):
            assert torch.equal(tokens, want), (r, temperature, tokens, want)
            assert_bitwise(picked[:, 0], logits.gather(1, want[:, None])[:, 0], f"rank {r}'s picked logits")
    assert sample(logits, 0.0, keys, counters)[:5].tolist() == [127, 63, 191, 128 + int(logits[3, 128:].argmax()), 127]
    for s in shards:  # the fused kernel's candidates == the torch ones (the kernel runs on GPUs)
        part = logits[:, s.start:s.stop]
        fused = gumbel_candidates(part, keys, counters, 0.6, s.start, use_kernel=True)
        plain = gumbel_candidates(part, keys, counters, 0.6, s.start, use_kernel=False)
        assert_bitwise(fused[0], plain[0], "candidate scores")
        assert torch.equal(fused[1], plain[1])


def test_more_ranks_than_vocab_splits_are_refused_naming_both_numbers():
    spec = ModelSpec.from_hf_config(tiny_config("qwen3", vocab_size=128, num_key_value_heads=4))
    split_v, n_splits = vocab_split_count(spec, torch.bfloat16)
    assert n_splits == 2
    config = EngineConfig(tensor_parallel_size=4, k_groups=4, vocab_parallel=True)
    words = f"tensor_parallel_size=4 exceeds the LM head's vocabulary splits (2 splits of {split_v} for vocab 128)"
    with pytest.raises(ValueError) as info:
        config.check_model(spec, torch.bfloat16)
    assert words in str(info.value)
    EngineConfig(tensor_parallel_size=2, k_groups=2, vocab_parallel=True).check_model(spec)  # 1 split each
    EngineConfig(tensor_parallel_size=4, k_groups=4).check_model(spec)  # replicated: fine
    hf = random_model(tiny_config("qwen3", vocab_size=128, num_key_value_heads=4), seed=1)
    with pytest.raises(ValueError) as info:
        shard_model(UnifiedCausalLM.from_hf(hf, k_groups=4), 0, 4, None, vocab_parallel=True)
    assert words in str(info.value)
    with pytest.raises(ValueError, match="vocab_parallel needs the unified kernels, not 'standard'"):
        config.check_kernels("standard")
    with pytest.raises(ValueError, match="vocab_parallel needs the unified kernels"):
        shard_model(UnifiedCausalLM.from_hf(hf, kernels="standard", k_groups=4), 0, 4, None, vocab_parallel=True)
    with pytest.raises(TypeError, match="vocab_parallel must be a bool, got 1"):
        EngineConfig(vocab_parallel=1)


def test_serve_refuses_more_ranks_than_vocab_splits_before_loading(tmp_path):
    import argparse

    from areal_tik.adapter import server, server_tp
    from areal_tik.model.checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "v128", num_hidden_layers=1, num_key_value_heads=4, vocab_size=128)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--tensor-parallel-size", "4", "--k-groups", "4",
                              "--vocab-parallel"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 exceeds the LM head's vocabulary splits \(2 splits"):
        server_tp.check_model_split(args, server.check_args(args))


@pytest.mark.parametrize("tied", [False, True])
def test_shard_model_keeps_the_ranks_vocabulary_rows(tied):
    hf = random_model(tiny_config("qwen3", vocab_size=320, tie_word_embeddings=tied), seed=2)
    full_embed, full_head = hf.model.embed_tokens.weight.clone(), hf.lm_head.weight.clone()
    model = shard_model(UnifiedCausalLM.from_hf(hf, k_groups=2), 1, 2, None, vocab_parallel=True)
    shard = model.tensor_parallel.vocab  # 5 splits of 64: rank 0 takes 2, rank 1 takes 3
    assert (shard.start, shard.stop, shard.runs) == (128, 320, (2, 3))
    assert_bitwise(model.embed_weight, full_embed[128:], "embedding rows")
    assert_bitwise(model.lm_head_weight, full_head[128:], "LM head rows")
    assert (model.lm_head_weight is model.embed_weight) == tied
    assert shard.saved_bytes == (1 if tied else 2) * 128 * H * 2
    assert model.spec.vocab == 320  # the engine still sees (and samples from) the full vocabulary
    full = {"model.embed_tokens.weight": full_embed, "lm_head.weight": full_head}
    assert {k: tuple(v.shape) for k, v in model.tensor_parallel.local_weights(full).items()} == {
        "model.embed_tokens.weight": (192, H), "lm_head.weight": (192, H)}  # weight updates: the rank's rows
    with pytest.raises(ValueError, match="token_logprobs needs the full LM head"):
        model.token_logprobs(torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64))

"""Prefix cache and chunked prefill in the engine under the bitwise contract (regime R3).

Model level: every prompt row's hidden state computed in chunks through the paged cache
(``prefill`` with block tables and start positions) equals the packed training forward.
Engine level, on the tiny Qwen2, Qwen3 and Llama models: a GRPO group (identical prompts
submitted together) plus a prompt sharing a prefix, run cold (no cache), warm (prefix
cache) and chunked + warm; every token and log-prob bit-identical across the three and to
the packed training forward. Under the interpreter an engine step costs about 0.1-0.5 s.
"""
from __future__ import annotations

import random

import pytest
import torch

from areal_tik import consistency
from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.model import UnifiedCausalLM

from ._model_utils import PagedLayout, pack, packed_rows, require, tiny_hf
from ._bits import assert_bitwise

FAMILIES = ["qwen2", "qwen3", "llama"]
BLOCK = 16  # the interpreter's KV tile is 16, its split 32


def _unified(family: str) -> UnifiedCausalLM:
    require("unified")
    return UnifiedCausalLM.from_hf(tiny_hf(family, tied=False), kernels="unified")


def _prompts(seed: int = 0):
    """A GRPO group of three identical 37-token prompts and one sharing its first 16."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(37)]
    other = base[:16] + [rng.randrange(3, 256) for _ in range(9)]
    return [base, base, base, other]


def _params(n: int, tokens: int = 2):
    return [SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=100 + i, ignore_eos=True)
            for i in range(n)]


def _run(model, prompts, params, **config):
    cfg = dict(max_num_seqs=8, max_model_len=64, kv_block_size=BLOCK)
    cfg.update(config)
    with LLM(model, EngineConfig(**cfg)) as llm:
        outputs = llm.generate(prompts, params)
        return outputs, llm.prefix_cache_stats


def assert_same_bits(a, b, what):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.token_ids == y.token_ids, f"{what}: request {i} tokens"
        assert torch.equal(torch.tensor(x.logprobs).view(torch.int32),
                           torch.tensor(y.logprobs).view(torch.int32)), f"{what}: request {i} log-prob bits"


def assert_training_bits(model, outputs):
    result = consistency.compare(outputs, consistency.packed_logprobs(model, outputs, grad=True))
    assert result.num_identical == result.num_tokens > 0, (
        f"{result.num_identical}/{result.num_tokens} bit-identical, first mismatch {result.first_mismatch}")


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prompt_rows_equal_packed_training_forward(family):
    """Chunks [0, 5), [5, 21), [21, 40) of one prompt and [0, 33), [33, 34) of another,
    interleaved in two batched calls, against the packed forward, row by row."""
    m = _unified(family)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 34)]
    ref = packed_rows(m, seqs)
    layout = PagedLayout(m, [40, 34], BLOCK, seed=2)
    rows = {}
    for pieces in ([(0, 0, 5), (1, 0, 33)], [(1, 33, 34), (0, 5, 21)], [(0, 21, 40)]):
        ids, _, cu, max_len = pack([seqs[s][a:b] for s, a, b in pieces], m.device)
        pos = torch.cat([torch.arange(a, b) for _, a, b in pieces])
        slots = torch.cat([layout.slots(s, range(a, b)) for s, a, b in pieces])
        starts = torch.tensor([a for _, a, _ in pieces], dtype=torch.int32)
        with torch.no_grad():
            h = m.prefill(ids, pos, cu, max_len, layout.cache, slots, torch.arange(ids.shape[0]),
                          block_tables=layout.block_tables([s for s, _, _ in pieces]), query_starts=starts)
        offs = cu.tolist()
        for j, (s, a, b) in enumerate(pieces):
            for p in range(a, b):
                rows[(s, p)] = h[offs[j] + p - a]
    assert len(rows) == 74
    for key in sorted(rows):
        assert_bitwise(rows[key], ref[key], f"{family} seq {key[0]} position {key[1]}")


@pytest.mark.parametrize("family", FAMILIES)
def test_cold_warm_chunked_and_training_bits_agree(family):
    m = _unified(family)
    prompts, params = _prompts(), _params(4)
    cold, cold_stats = _run(m, prompts, params)
    warm, stats = _run(m, prompts, params, enable_prefix_caching=True)
    chunked, chunk_stats = _run(m, prompts, params, enable_prefix_caching=True, prefill_chunk_tokens=BLOCK)
    assert cold_stats["queries"] == 0
    # The group's later samples wait for the first one's blocks, then reuse all but the
    # last partial block: 2 x 32 tokens; the fourth prompt reuses the shared 16.
    for s in (stats, chunk_stats):
        assert s["hit_tokens"] == 2 * 32 + 16 and s["hits"] == 3, s
    assert [o.num_cached_tokens for o in warm] == [0, 32, 32, 16]
    assert_same_bits(warm, cold, f"{family} warm vs cold")
    assert_same_bits(chunked, cold, f"{family} chunked vs cold")
    assert_training_bits(m, cold)


def test_block_written_by_decode_is_reused_by_a_later_turn():
    """A multi-turn prefix: the second request's prompt is the first request's prompt plus
    its answer; the block completed by decode steps (positions 30 and 31) is reused, and
    every token still equals the packed training forward."""
    m = _unified("qwen3")
    first = _prompts()[0][:30]
    with LLM(m, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=BLOCK,
                             enable_prefix_caching=True)) as llm:
        out = llm.generate([first], _params(1, tokens=3))[0]
        turn = first + out.token_ids + [7, 8, 9]
        second = llm.generate([turn], _params(1))[0]
    assert second.num_cached_tokens == 32  # both full blocks, the second one finished by decode
    assert_training_bits(m, [out, second])

"""The training-step benchmark's workload (eval/bench_train.py): GRPO-like and NxL packings,
the packed batch and the model FLOPs of one forward + backward."""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

import torch

from areal_tik.model.spec import ModelSpec


def packing(name: str, seed: int = 0) -> list[int]:
    """Sequence lengths of a packing: ``grpo`` or ``NxL``."""
    if name == "grpo":
        g = random.Random(seed)
        return [g.randint(48, 80) + 64 + int(256 * g.random() ** 3) for _ in range(64)]
    match = re.fullmatch(r"(\d+)x(\d+)", name)
    if not match or int(match[1]) < 1 or int(match[2]) < 2:
        raise ValueError(f"packing must be 'grpo' or NxL (N >= 1, L >= 2), got {name!r}")
    return [int(match[2])] * int(match[1])


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, 0.. per sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    targets: torch.Tensor  # [T] next token (AReaL's roll over the packed row)
    grad_weights: torch.Tensor  # [T] fp32 g of loss = sum(logprob * g)


def make_batch(lengths: list[int], vocab: int, device, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    weights = torch.randn(tokens, generator=g) / tokens ** 0.5
    return Batch(ids.to(device), positions.to(device), cu.to(device), max(lengths),
                 torch.roll(ids, -1).to(device), weights.to(device))


def step_flops(spec: ModelSpec, lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward: 6 N T for the matmul parameters (LM head
    included, embedding lookup not) + causal attention 6 L^2 Hq D per layer and sequence."""
    h, q, kv = spec.hidden, spec.q_size, spec.kv_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate
    params = spec.n_layers * per_layer + spec.vocab * h
    attention = sum(6 * n * n * q for n in lengths) * spec.n_layers
    return 6.0 * params * sum(lengths) + attention

"""Rollout vs training consistency: recorded log-probs against a packed training forward.

It lives above the engine (the engine is rollout only; this runs the model's training
forward over the engine's outputs) and is what ``areal-tik check`` and the engine tests
run.

``packed_logprobs`` runs the training regime (``model.forward_packed`` over prompt +
response, micro-batched, then ``model.token_logprobs`` next-token aligned) and
``compare`` counts bit-identical tokens. When some differ, ``first_divergence`` replays
one request in the engine's regimes at batch size 1 (prefill of the prompt, then decode
token by token) and in the packed regime, records every op's output row through a
recording op backend, and names the first op whose row bits differ.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_tik.bitwise import BitComparison, compare_bits
from areal_tik.engine import GenerationOutput
from areal_tik.unified_kernels import bitwise_equal

# ------------------------------------------------------------------ packed forward


def _micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    batches, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def _packed_pass(model, seqs: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """fp32 log-prob of token i+1 at row i for every row of each sequence (last row: target 0)."""
    dev = model.device
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev)
    positions = torch.tensor([p for s in seqs for p in range(len(s))], dtype=torch.int64, device=dev)
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    targets = torch.roll(ids, -1)
    hidden = model.forward_packed(ids, positions, cu, max(lengths))
    logprobs = model.token_logprobs(hidden, targets, temperature).detach()
    return list(logprobs.split(lengths))


def packed_logprobs(model, outputs: list[GenerationOutput], max_tokens_per_batch: int = 16384,
                    order: list[int] | None = None, grad: bool = False, progress=None) -> list[torch.Tensor]:
    """Training-forward log-probs of each output's response tokens (fp32, on the model's device).

    Sequences are packed in ``order`` (default: as given) into micro-batches of at most
    ``max_tokens_per_batch`` tokens, one packed pass per micro-batch and temperature.
    ``grad`` runs the forward with autograd on, as a trainer does.
    """
    order = list(range(len(outputs))) if order is None else list(order)
    by_temperature: dict[float, list[int]] = {}
    for i in order:
        by_temperature.setdefault(outputs[i].logprob_temperature, []).append(i)
    result: list[torch.Tensor | None] = [None] * len(outputs)
    with torch.set_grad_enabled(grad):
        for temperature, members in by_temperature.items():
            seqs = [outputs[i].prompt_ids + outputs[i].token_ids for i in members]
            for batch in _micro_batches([len(s) for s in seqs], max_tokens_per_batch):
                rows = _packed_pass(model, [seqs[j] for j in batch], temperature)
                for j, lp in zip(batch, rows):
                    out = outputs[members[j]]
                    p = len(out.prompt_ids)
                    result[members[j]] = lp[p - 1: p - 1 + len(out.token_ids)]
                if progress is not None:
                    progress.update(len(batch))
    return result


def compare(outputs: list[GenerationOutput], reference: list[torch.Tensor]) -> BitComparison:
    """Bitwise comparison of recorded log-probs with reference log-probs; ``first_mismatch``
    is ``(request index, token index)``."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs but {len(reference)} reference rows")
    recorded = [torch.tensor(out.logprobs, dtype=torch.float32) for out in outputs]
    return compare_bits(recorded, [ref.float() for ref in reference])


# ------------------------------------------------------------------ op-level diagnosis


@dataclass
class OpRecord:
    label: str
    outputs: list[torch.Tensor] = field(default_factory=list)


class RecordingOps:
    """An op backend that forwards to ``inner`` and keeps a copy of every op's outputs."""

    _PARTS = {"add_rms_norm": ("normed", "residual"), "apply_rope": ("q", "k"), "qk_norm_rope": ("q", "k")}

    def __init__(self, inner):
        self.inner = inner
        self.kind = inner.kind
        self.records: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out is not None:
                outs = out if isinstance(out, tuple) else (out,)
                self.records.append((name, tuple(o.detach().clone() for o in outs)))
            return out
        return recorded


def _merge_projections(records) -> list[tuple[str, tuple]]:
    """Each run of consecutive ``linear`` records (q, k, v; gate, up) as one record of
    their outputs side by side: the fused rollout GEMM's output (model/fused.py, the same
    bits per column), so both regimes' sequences line up whichever path ran."""
    merged: list[tuple[str, tuple]] = []
    for name, outs in records:
        if name == "linear" and merged and merged[-1][0] == "linear":
            merged[-1] = ("linear", (torch.cat([merged[-1][1][0], outs[0]], dim=-1),))
        else:
            merged.append((name, outs))
    return merged


def _labelled(records, n_layers: int) -> list[tuple[str, str, torch.Tensor]]:
    """(layer label, op label, tensor) for each output, attention unified under one name.

    A layer starts at the first norm after the previous layer's SwiGLU; the norm after
    the last layer is the final norm.
    """
    labelled, layer, after_silu = [], 0, False
    for name, outs in records:
        if name in ("rms_norm", "add_rms_norm") and after_silu:
            layer, after_silu = layer + 1, False
        if name == "silu_mul":
            after_silu = True
        op = "attention" if name.startswith("attention") else name
        parts = RecordingOps._PARTS.get(name, ("out",) * len(outs))
        where = f"layer {layer}" if layer < n_layers else "final norm"
        for part, t in zip(parts, outs):
            labelled.append((where, f"{op}.{part}" if len(outs) > 1 else op, t))
    return labelled


@dataclass
class Divergence:
    """First op whose output row differs between the rollout regime and the packed forward."""

    request: int
    token: int
    position: int
    regime: str  # "prefill" or "decode"
    where: str | None  # "layer 3 attention", None if every op agreed
    max_abs_delta: float
    ops_compared: int


def _with_ops(model, ops, fn):
    saved = model.ops
    model.ops = ops
    try:
        return fn()
    finally:
        model.ops = saved


def _replay_rollout(model, tokens: list[int], prompt_len: int, position: int, block_size: int) -> RecordingOps:
    """Prefill the prompt then decode up to ``position`` at batch 1; record the step computing it."""
    dev = model.device
    blocks = -(-len(tokens) // block_size)
    cache = model.new_kv_cache(blocks + 1, block_size)
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=dev)[None, :]
    recorder = RecordingOps(model.ops)

    def i64(values):
        return torch.tensor(values, dtype=torch.int64, device=dev)

    def prefill():
        cu = torch.tensor([0, prompt_len], dtype=torch.int32, device=dev)
        slots = i64(list(range(block_size, block_size + prompt_len)))
        return model.prefill(i64(tokens[:prompt_len]), i64(list(range(prompt_len))), cu, prompt_len,
                             cache, slots, i64([prompt_len - 1]))

    def decode(pos):
        ctx = torch.tensor([pos + 1], dtype=torch.int32, device=dev)
        return model.decode(i64([tokens[pos]]), i64([pos]), cache, i64([block_size + pos]), table, ctx)

    with torch.inference_mode():
        if position == prompt_len - 1:
            _with_ops(model, recorder, prefill)
            return recorder
        prefill()
        for pos in range(prompt_len, position):
            decode(pos)
        _with_ops(model, recorder, lambda: decode(position))
    return recorder


def _token_row(t: torch.Tensor, tokens: int, index: int) -> torch.Tensor:
    """The part of an op output that belongs to token ``index`` of ``tokens``.

    Outputs are [tokens, ...] or [tokens * heads, ...] (per-head norms); an output with a
    single row that is neither is a selected row (prefill's final norm at logits_indices).
    """
    if t.shape[0] % tokens == 0:
        return t.reshape(tokens, -1)[index]
    assert t.shape[0] == 1, f"cannot map an output of shape {tuple(t.shape)} to {tokens} tokens"
    return t.reshape(1, -1)[0]


def first_divergence(model, outputs: list[GenerationOutput], request: int, token: int,
                     block_size: int) -> Divergence:
    """Name the first op whose row bits differ between rollout and training for one token."""
    out = outputs[request]
    tokens = out.prompt_ids + out.token_ids
    prompt_len = len(out.prompt_ids)
    position = prompt_len - 1 + token  # the row whose hidden state predicts the token
    rollout = _replay_rollout(model, tokens, prompt_len, position, block_size)
    packed = RecordingOps(model.ops)
    dev = model.device
    n = position + 1
    with torch.no_grad():
        _with_ops(model, packed, lambda: model.forward_packed(
            torch.tensor(tokens[:n], device=dev), torch.arange(n, device=dev),
            torch.tensor([0, n], dtype=torch.int32, device=dev), n))
    regime = "prefill" if position == prompt_len - 1 else "decode"
    rollout_rows, rollout_index = (prompt_len, position) if regime == "prefill" else (1, 0)
    n_layers = model.spec.n_layers
    a = _labelled(_merge_projections(rollout.records), n_layers)
    b = _labelled(_merge_projections(packed.records), n_layers)
    compared = 0
    for (layer, op, x), (_, op_b, y) in zip(a, b):
        assert op == op_b, f"op sequences differ: {op} vs {op_b}"
        row_x = _token_row(x, rollout_rows, rollout_index)
        row_y = _token_row(y, n, position)
        compared += 1
        if not bitwise_equal(row_x, row_y):
            delta = float((row_x.double() - row_y.double()).abs().max())
            return Divergence(request, token, position, regime, f"{layer} {op}", delta, compared)
    return Divergence(request, token, position, regime, None, 0.0, compared)

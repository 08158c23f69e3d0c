"""The stock training step's parts for eval/bench_train.py: what an AReaL user runs.

- ``varlen_attention``: a transformers attention function (register it with
  ``AttentionInterface.register(ATTN_NAME, ...)``) over packed rows: torch's FlashAttention
  ``varlen_attn`` reading ``cu_seq_lens_q`` (no mask, no host synchronisation); on CPU the
  project's standard op (SDPA per sequence) stands in.
- ``stock_logprob_fn``: AReaL's own ``gather_logprobs`` (torch.compile'd
  ``log_softmax(logits.float() / T)`` + gather over 1024-token chunks), or a stand-in
  written to match it where AReaL does not import, named with the reason.
- ``liger_loss``: Liger-Kernel's fused linear cross-entropy, or None when not installed.
"""
from __future__ import annotations

import torch

from areal_tik.model.ops import _flash_varlen, get_ops

ATTN_NAME = "bench_train_varlen"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention over packed rows: q/k/v ``[1, H, T, D]`` -> ``([1, T, Hq, D], None)``."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    found = _flash_varlen() if q.is_cuda else None
    if found is None:  # CPU smoke runs: the project's standard op (SDPA per sequence)
        return get_ops("standard").attention_varlen(q, k, v, cu, max_len, scaling)[None], None
    varlen_attn, causal, has_gqa, has_scale = found
    extra = dict(causal, **({"scale": scaling} if has_scale else {}))
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    return (out[0] if isinstance(out, tuple) else out)[None], None


def stock_attention_label(device) -> str:
    found = _flash_varlen() if torch.device(device).type == "cuda" else None
    if found is None:
        return "SDPA per sequence (no torch varlen_attn here)"
    return "torch FlashAttention varlen_attn" + ("" if found[2] else " (K/V heads repeated for GQA)")


def _gather_chunk(logits, labels, temperature):
    log_probs = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


_gather_chunk_compiled = torch.compile(_gather_chunk)


def _standin_gather_logprobs(logits, labels, temperature=1.0, chunk_size=1024):
    """AReaL 1.0.4's gather_logprobs re-stated: the compiled chunk function over 1024-row chunks."""
    return torch.cat([_gather_chunk_compiled(logits[i:i + chunk_size], labels[i:i + chunk_size], temperature)
                      for i in range(0, logits.shape[0], chunk_size)])


def stock_logprob_fn():
    """(gather_logprobs, label): AReaL's own, else the stand-in, saying why."""
    try:
        from importlib.metadata import version

        from areal.utils.functional import gather_logprobs
        return gather_logprobs, f"AReaL {version('areal')} gather_logprobs (torch.compile, 1024-token chunks)"
    except Exception as exc:  # AReaL or one of its imports is not on this image
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
        return _standin_gather_logprobs, f"stand-in: torch.compile'd chunked log_softmax+gather as AReaL's ({why})"


def liger_loss():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="none")

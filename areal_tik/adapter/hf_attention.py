"""Packed-sequence attention for AReaL's own FSDP actor over the Hugging Face model, where the
``flash_attn`` package AReaL's default ``attn_impl: flash_attention_2`` needs is not installed.

AReaL 1.0.4 packs a micro-batch's sequences into one row of ``[1, T]`` tokens and hands the
model ``cu_seq_lens_q`` / ``max_length_q`` with no attention mask: FlashAttention-2's varlen
entry keeps the sequences apart. transformers' ``sdpa`` would attend across them under that
call (its mask is ``None``, so one causal triangle spans every sequence). ``varlen_attention``
reads the same keywords and runs torch's own FlashAttention varlen kernel on CUDA (the
FlashAttention-2 algorithm as torch ships it; the project's standard ``attention_varlen``
op, SDPA per sequence where torch has no varlen entry or on CPU). It is registered with
transformers' ``AttentionInterface`` under ``ATTN_NAME``; a name transformers has no mask
function for gets no mask built, as FlashAttention-2 gets none.
"""
from __future__ import annotations

ATTN_NAME = "areal_tik_varlen"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention over packed rows: q/k/v ``[1, H, T, D]`` -> ``([1, T, Hq, D], None)``."""
    from areal_tik.model.ops import get_ops

    if "cu_seq_lens_q" not in kwargs:
        raise ValueError(f"{ATTN_NAME} attention needs packed inputs (cu_seq_lens_q / max_length_q, as "
                         "AReaL's FSDP engine passes them); got none")
    if dropout:
        raise ValueError(f"{ATTN_NAME} attention has no dropout; got {dropout}")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME} attention takes one packed row, got a batch of {query.shape[0]}")
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return get_ops("standard").attention_varlen(q, k, v, cu, max_len, scaling)[None], None


def register() -> str:
    """Register ``varlen_attention`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention)
    return ATTN_NAME

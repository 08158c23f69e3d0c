"""The training forward on the unified kernels, over AReaL's packed micro-batches.

AReaL's FSDP engine packs a micro-batch into one ``[1, T]`` row padded to a multiple of
256 tokens (the pad is one extra "sequence" at the end of ``cu_seq_lens_q``, with
positions 0..pad-1) and computes ``log_softmax(logits.float() / T)[roll(input_ids, -1)]``.
``micro_batch_logprobs`` computes the same quantity with ``UnifiedCausalLM.forward_logprobs``
(the stack runs as the forward of the HF model and of each decoder layer, so FSDP2's
gather/reshard and mixed-precision casts run around it), fused with the lm head so no
``[T, V]`` logits tensor is kept for backward. Outputs cover the real tokens only (AReaL
trims the pad off its results anyway).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class TikOutput(NamedTuple):
    """What the unified forward hands to AReaL's per-micro-batch callbacks instead of logits."""

    logprobs: torch.Tensor          # [T_real] fp32, position t scores input_ids[t + 1]
    entropy: torch.Tensor | None    # [T_real] fp32 or None (forward-only passes)


def unified_logprobs(model, input_ids, positions, cu_seqlens, max_seqlen: int, targets,
                     temperature: float, return_entropy: bool):
    """``(logprobs, entropy or None)`` of a packed row. Module-level so that one function
    is the training side's log-prob source (the audit tests perturb exactly this)."""
    out = model.forward_logprobs(input_ids, positions, cu_seqlens, max_seqlen, targets,
                                 temperature=temperature, return_entropy=return_entropy)
    if return_entropy:
        return out[0], out[1]
    return out, None


def micro_batch_logprobs(model, inputs: dict, temperature: float, return_entropy: bool,
                    pad_length: int = 0) -> TikOutput:
    """Log-probs of one AReaL padded micro-batch (``FSDPEngine._prepare_mb_list`` output)
    for its ``T - pad_length`` real tokens.

    AReaL appends the pad as one extra sequence at the end of ``cu_seq_lens_q``; by row
    invariance it cannot change the real rows, so it is not computed at all (up to 255
    rows a micro-batch). Targets are taken from the padded row exactly as AReaL does
    (``roll(input_ids, -1)``), so the last real position scores the first pad token.
    """
    for key in ("input_ids", "position_ids", "cu_seq_lens_q", "max_length_q"):
        if key not in inputs:
            raise ValueError(f"packed micro-batch lacks {key!r}; got keys {sorted(inputs)}")
    input_ids = inputs["input_ids"].reshape(-1).long()
    positions = inputs["position_ids"].reshape(-1).long()
    if positions.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(inputs['position_ids'].shape)} do not match "
                         f"input_ids {tuple(inputs['input_ids'].shape)} (multimodal rope is not supported)")
    cu_seqlens = inputs["cu_seq_lens_q"].to(torch.int32)
    total = input_ids.shape[0]
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seq_lens_q ends at {int(cu_seqlens[-1])} but the row has {total} tokens")
    targets = torch.roll(input_ids, shifts=-1, dims=-1)
    if pad_length > 0:
        real = total - pad_length
        if cu_seqlens.shape[0] < 3 or int(cu_seqlens[-2]) != real:
            raise ValueError(f"expected the last {pad_length} tokens to be AReaL's pad sequence, "
                             f"got cu_seq_lens_q={cu_seqlens.tolist()}")
        input_ids, positions, targets = input_ids[:real], positions[:real], targets[:real]
        cu_seqlens = cu_seqlens[:-1]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    logprobs, entropy = unified_logprobs(model, input_ids, positions, cu_seqlens, max_seqlen,
                                         targets, float(temperature), return_entropy)
    return TikOutput(logprobs, entropy)

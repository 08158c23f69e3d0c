"""The one decoder-layer code path, shared by prefill, decode and the packed training forward.

Every function reads the parameters from the Hugging Face modules when it is called
(``module.weight`` / ``module.bias``), never from a copy: the same bf16 bits the trainer
updates, the same tensors autograd and FSDP-style wrappers see.

Residual stream as in Hugging Face: bf16 adds, the sum rounded once to bf16. A layer
takes ``(delta, residual)``, where ``delta`` is the previous layer's MLP output (None for
the first layer), and starts with ``add_rms_norm(delta, residual)`` with its OWN input
norm weight; so each layer touches only its own parameters (a wrapper that gathers a
layer's parameters around its call, such as FSDP, sees every access inside the call).
The stack's final ``add_rms_norm`` with the model norm closes the last residual add.

Regime-specific attention is a callable ``attend(q [T, Hq, D], k [T, Hk, D], v) ->
[T, Hq, D]`` (varlen, or paged prefill / decode over the cache) with, for the rollout
regimes, a ``CacheWrite``: where this layer's K/V go. The per-head q/k norms, rope and that
write are one op (``qk_norm_rope``: one launch in the unified set, the bits of the three
ops in sequence). Everything else is the
same code in every regime, except how the column projections are grouped (``proj``):
training runs q/k/v and gate/up as separate linears (autograd needs each weight's
gradient), rollout as one GEMM per group (``fused.py``: the same bits per column).

The row-parallel projections (o_proj, down_proj) go through ``row_proj(x, module)``: on one
device ``linear`` with the model's K-group tree (``row_parallel_proj``); on a
tensor-parallel rank the rank's subtree, gathered and combined (``tensor_parallel.py``),
the same bits.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .fused import FusedProjections, SeparateProjections
from .spec import ModelSpec

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RowProj = Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]


class CacheWrite(NamedTuple):
    """A layer's paged K/V caches and each token's flat slot (-1: not written)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    validate: bool = True  # host-side metadata checks (they sync): once per forward


def _proj(ops, module, x):
    return ops.linear(x, module.weight, module.bias)


def row_parallel_proj(ops, k_groups: int) -> RowProj:
    """o_proj / down_proj on one device: ``linear`` over ``k_groups`` K groups summed in
    the fixed binary tree (k_groups 1: the plain K loop, the call every projection makes)."""
    if k_groups == 1:
        return lambda x, module: _proj(ops, module, x)
    return lambda x, module: ops.linear(x, module.weight, module.bias, k_groups=k_groups)


Projections = type[SeparateProjections] | type[FusedProjections]


def attention_block(ops, spec: ModelSpec, attn, x, positions, cos, sin, attend: Attend, row_proj: RowProj,
                    proj: Projections = SeparateProjections, cache: CacheWrite | None = None):
    """Self-attention of normed ``x [T, hidden]``; returns the o_proj output ``[T, hidden]``.
    With ``cache`` the rotated k and v are written to it before ``attend`` runs."""
    rows = x.shape[0]
    q, k, v = proj.qkv(ops, attn, x)  # [T, Hq*D], [T, Hk*D], [T, Hk*D]; views of one [T, N] when fused
    q = q.view(rows, spec.n_heads, spec.head_dim)
    k = k.view(rows, spec.n_kv_heads, spec.head_dim)
    v = v.view(rows, spec.n_kv_heads, spec.head_dim)
    # Qwen3: RMSNorm over head_dim of each q and k head (one row per token and head) before rope.
    q_w, k_w = (attn.q_norm.weight, attn.k_norm.weight) if spec.qk_norm else (None, None)
    store = {} if cache is None else dict(v=v, k_cache=cache.k_cache, v_cache=cache.v_cache,
                                          slot_mapping=cache.slot_mapping, validate=cache.validate)
    q, k = ops.qk_norm_rope(q, k, positions, cos, sin, q_w, k_w, spec.eps, **store)
    out = attend(q, k, v)
    return row_proj(out.reshape(rows, spec.q_size), attn.o_proj)


def mlp_block(ops, mlp, x, row_proj: RowProj, proj: Projections = SeparateProjections):
    """SwiGLU MLP over the packed ``[T, 2I]`` gate | up that ``silu_mul`` takes: one GEMM
    over the adjacent weights when fused, else two linears and one activation copy."""
    return row_proj(ops.silu_mul(proj.gate_up(ops, mlp, x)), mlp.down_proj)


def decoder_layer(ops, spec: ModelSpec, layer, delta, residual, positions, cos, sin, attend: Attend,
                  row_proj: RowProj, proj: Projections = SeparateProjections, cache: CacheWrite | None = None):
    """One decoder layer: ``(delta, residual) -> (mlp_out, residual)``, HF semantics."""
    if delta is None:
        normed = ops.rms_norm(residual, layer.input_layernorm.weight, spec.eps)
    else:
        normed, residual = ops.add_rms_norm(delta, residual, layer.input_layernorm.weight, spec.eps)
    attn_out = attention_block(ops, spec, layer.self_attn, normed, positions, cos, sin, attend, row_proj, proj,
                               cache)
    normed, residual = ops.add_rms_norm(attn_out, residual, layer.post_attention_layernorm.weight, spec.eps)
    return mlp_block(ops, layer.mlp, normed, row_proj, proj), residual

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
[T, Hq, D]`` (varlen, store + varlen, or store + paged decode); everything else is the
same code in every regime, except how the column projections are grouped (``proj``):
training runs q/k/v and gate/up as separate linears (autograd needs each weight's
gradient), rollout as one GEMM per group (``fused.py``: the same bits per column).

The row-parallel projections (o_proj, down_proj) go through ``row_proj(x, module)``: on one
device ``linear`` with the model's K-group tree (``row_parallel_proj``); on a
tensor-parallel rank the rank's subtree, gathered and combined (``tensor_parallel.py``),
the same bits.
"""
from __future__ import annotations

from typing import Callable

import torch

from .fused import FusedProjections, SeparateProjections
from .spec import ModelSpec

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RowProj = Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]


def _proj(ops, module, x):
    return ops.linear(x, module.weight, module.bias)


def row_parallel_proj(ops, k_groups: int) -> RowProj:
    """o_proj / down_proj on one device: ``linear`` over ``k_groups`` K groups summed in
    the fixed binary tree (k_groups 1: the plain K loop, the call every projection makes)."""
    if k_groups == 1:
        return lambda x, module: _proj(ops, module, x)
    return lambda x, module: ops.linear(x, module.weight, module.bias, k_groups=k_groups)


def _head_norm(ops, norm, x, eps):
    # RMSNorm over head_dim (Qwen3 q_norm / k_norm): one row per (token, head).
    return ops.rms_norm(x, norm.weight, eps)  # x [T, heads, head_dim], a view of q|k|v when fused


Projections = type[SeparateProjections] | type[FusedProjections]


def attention_block(ops, spec: ModelSpec, attn, x, positions, cos, sin, attend: Attend, row_proj: RowProj,
                    proj: Projections = SeparateProjections):
    """Self-attention of normed ``x [T, hidden]``; returns the o_proj output ``[T, hidden]``."""
    rows = x.shape[0]
    q, k, v = proj.qkv(ops, attn, x)  # [T, Hq*D], [T, Hk*D], [T, Hk*D]; views of one [T, N] when fused
    q = q.view(rows, spec.n_heads, spec.head_dim)
    k = k.view(rows, spec.n_kv_heads, spec.head_dim)
    v = v.view(rows, spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = _head_norm(ops, attn.q_norm, q, spec.eps)
        k = _head_norm(ops, attn.k_norm, k, spec.eps)
    q, k = ops.apply_rope(q, k, positions, cos, sin)
    out = attend(q, k, v)
    return row_proj(out.reshape(rows, spec.q_size), attn.o_proj)


def mlp_block(ops, mlp, x, row_proj: RowProj, proj: Projections = SeparateProjections):
    """SwiGLU MLP over the packed ``[T, 2I]`` gate | up that ``silu_mul`` takes: one GEMM
    over the adjacent weights when fused, else two linears and one activation copy."""
    return row_proj(ops.silu_mul(proj.gate_up(ops, mlp, x)), mlp.down_proj)


def decoder_layer(ops, spec: ModelSpec, layer, delta, residual, positions, cos, sin, attend: Attend,
                  row_proj: RowProj, proj: Projections = SeparateProjections):
    """One decoder layer: ``(delta, residual) -> (mlp_out, residual)``, HF semantics."""
    if delta is None:
        normed = ops.rms_norm(residual, layer.input_layernorm.weight, spec.eps)
    else:
        normed, residual = ops.add_rms_norm(delta, residual, layer.input_layernorm.weight, spec.eps)
    attn_out = attention_block(ops, spec, layer.self_attn, normed, positions, cos, sin, attend, row_proj, proj)
    normed, residual = ops.add_rms_norm(attn_out, residual, layer.post_attention_layernorm.weight, spec.eps)
    return mlp_block(ops, layer.mlp, normed, row_proj, proj), residual

"""The unified kernel library: one op per file (kernel -> launcher -> autograd -> function).

Numerical contract (see README.md, "The numerical contract"): for every op, a row's
output bits depend only on that row's inputs (and, for attention, its own sequence's
K/V at positions <= t), never on the number of rows, their order, the batch
composition, padding, memory layout (paged or contiguous) or the regime (rollout
prefill, rollout decode, packed training forward). Tile shapes and reduction orders
are fixed per op and weight shape; nothing is autotuned per row count.

Functional API (bf16 or fp32 activations; CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``):

- ``linear(x, weight, bias=None, *, k_groups=1)``        linear.py
- ``linear_partial(x, weight_shard, *, k_groups)``        linear.py   (fp32 subtree of a K shard)
- ``combine_partials(parts, bias, dtype)``                linear.py   (the tree over shards)
- ``rms_norm(x, weight, eps)``                            rms_norm.py
- ``add_rms_norm(x, residual, weight, eps)``              rms_norm.py  -> (normed, summed)
- ``rope_cos_sin(max_positions, head_dim, base, scaling, device)`` rope.py -> (cos, sin)
- ``apply_rope(q, k, positions, cos, sin)``               rope.py     -> (q, k)
- ``qk_norm_rope(q, k, positions, cos, sin, q_weight, k_weight, eps, *, v, k_cache, v_cache, slot_mapping)``
  qk_rope.py -> (q, k): per-head norms, rope and the K/V cache write in one launch (their bits)
- ``silu_mul(gate_up)``                                   swiglu.py
- ``token_logprobs(hidden, weight, targets, temperature, return_entropy)`` logprob.py
- ``lm_head_logits_lse(hidden, weight, temperature)``     logprob.py  -> (logits, lse)
- ``gather_logprobs(logits, lse, targets, temperature)``  logprob.py
- ``attention_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale)`` attention.py
- ``store_kv_cache(k, v, k_cache, v_cache, slot_mapping)``              attention.py
- ``attention_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale)`` attention.py
- ``attention_paged_prefill(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables,
  query_starts, softmax_scale)`` attention.py (rows starting past position 0)
- ``warmup(WarmupShapes(...), max_rows, device)``: compile every launch variant at start-up  warmup.py

The embedding lookup stays a torch gather (``weight[ids]``): it copies bits and is
exact in every regime, so it needs no kernel.

``reference.py`` holds the slow float64 references that define each op's semantics.
"""
from __future__ import annotations

# Eager imports: decorating Triton kernels compiles nothing, and binding the functions
# here means the package attributes `linear` and `rms_norm` are the functions, never the
# submodules of the same name (reach those through importlib.import_module).
from ._common import bits, bitwise_equal
from .attention import attention_decode, attention_paged_prefill, attention_varlen, store_kv_cache
from .linear import combine_partials, linear, linear_partial
from .logprob import gather_logprobs, lm_head_logits_lse, token_logprobs
from .rms_norm import add_rms_norm, rms_norm
from .qk_rope import qk_norm_rope
from .rope import apply_rope, rope_cos_sin
from .swiglu import silu_mul
from .warmup import WarmupShapes, warmup

__all__ = [
    "bits", "bitwise_equal",
    "linear", "linear_partial", "combine_partials", "rms_norm", "add_rms_norm", "rope_cos_sin", "apply_rope", "silu_mul",
    "qk_norm_rope", "token_logprobs", "lm_head_logits_lse", "gather_logprobs",
    "attention_varlen", "store_kv_cache", "attention_decode", "attention_paged_prefill",
    "WarmupShapes", "warmup",
]

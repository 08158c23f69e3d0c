"""Cheap argument tests of the attention entry points, tried before their generic checks.

Each ``*_fast_ok`` implies every host-side check its entry point makes without
``validate`` (types, ranks, dtypes, shapes, one CUDA device, unit last strides, the
block size; CUDA tensors, or CPU tensors under the interpreter, so the CPU tests
run these paths too); anything else returns False and the entry point takes its generic checks,
which name the bad value. None reads device memory. A prefill step calls store and
attention once per layer: the generic checks are 10-15 tensor checks and a device set
each time (eval/probe_host.py), after the first layer has validated the batch.
"""
from __future__ import annotations

import torch

from ._common import on_fast_device

HEAD_DIMS = (16, 32, 64, 128)
_FLOATS = (torch.bfloat16, torch.float32)


def _heads_ok(q, k) -> bool:
    hk = k.shape[-2]
    return q.shape[-1] in HEAD_DIMS and k.shape[-1] == q.shape[-1] and hk > 0 and q.shape[-2] % hk == 0


def _caches_ok(k_cache, v_cache, dtype, block_n: int) -> bool:
    return (k_cache.dim() == 4 and k_cache.dtype is dtype and v_cache.dtype is dtype
            and v_cache.shape == k_cache.shape and k_cache.numel() > 0 and k_cache.stride(-1) == 1
            and v_cache.stride(-1) == 1 and k_cache.shape[1] % block_n == 0)


def varlen_fast_ok(q, k, v, cu_seqlens, max_seqlen) -> bool:
    """``attention_varlen`` without value checks."""
    if not on_fast_device(q, k, v, cu_seqlens):
        return False
    dtype = q.dtype
    return (dtype in _FLOATS and q.dim() == 3 and k.dim() == 3 and k.dtype is dtype and v.shape == k.shape
            and v.dtype is dtype and k.shape[0] == q.shape[0] and _heads_ok(q, k)
            and cu_seqlens.dtype is torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
            and type(max_seqlen) is int and max_seqlen >= 0)


def store_fast_ok(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """``store_kv_cache`` without value checks."""
    if not on_fast_device(k, v, k_cache, v_cache, slot_mapping):
        return False
    dtype = k.dtype
    return (dtype in _FLOATS and k.dim() == 3 and v.shape == k.shape and v.dtype is dtype
            and _caches_ok(k_cache, v_cache, dtype, 1) and k_cache.shape[2:] == k.shape[1:]
            and slot_mapping.dtype is torch.int64 and slot_mapping.dim() == 1
            and slot_mapping.shape[0] == k.shape[0])


def paged_fast_ok(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables, query_starts, block_n: int) -> bool:
    """``attention_paged_prefill`` without value checks."""
    if not on_fast_device(q, k_cache, v_cache, cu_seqlens, block_tables, query_starts):
        return False
    dtype = q.dtype
    if not (dtype in _FLOATS and q.dim() == 3 and q.shape[1] > 0 and _caches_ok(k_cache, v_cache, dtype, block_n)
            and _heads_ok(q, k_cache) and cu_seqlens.dtype is torch.int32 and cu_seqlens.dim() == 1
            and cu_seqlens.numel() > 0 and type(max_seqlen) is int and max_seqlen >= 0):
        return False
    num_seqs = cu_seqlens.shape[0] - 1
    return (block_tables.dtype is torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
            and query_starts.dtype is torch.int32 and query_starts.dim() == 1 and query_starts.shape[0] == num_seqs)

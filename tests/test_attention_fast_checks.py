"""The attention entry points' cheap argument tests (``_attention_checks``): with
``validate=False`` a good call takes them instead of the generic checks, and every bad
call still raises the generic checks' error."""
from __future__ import annotations

import importlib

import pytest
import torch

from areal_tik.unified_kernels import attention as attn_mod
from areal_tik.unified_kernels._attention_fwd import attention_config
from areal_tik.unified_kernels.attention import attention_paged_prefill, attention_varlen, store_kv_cache
from tests.test_attention import _bad_varlen_cases, _cu, _qkv
from tests.test_attention_chunked import ChunkedCache

C = importlib.import_module("areal_tik.unified_kernels._common")
# Metadata-only cases of the varlen table (the others need the value checks validate=False skips).
_VALUE_CASES = ("non-decreasing", "start at 0", "exceeds")


def _generic_checks_forbidden(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("generic checks ran on a good call")
    for name in ("_check_varlen", "_check_store", "_check_paged"):
        monkeypatch.setattr(attn_mod, name, forbidden)


def _paged_problem(device):
    q = _qkv(20, 4, 2, 16, torch.bfloat16, device, seed=9)[0][:8]
    cache = ChunkedCache([20], 2, 16, torch.bfloat16, device, seed=6)
    return q, cache, _cu([8], device), cache.table_rows([0]), torch.tensor([4], dtype=torch.int32, device=device)


def test_good_calls_skip_the_generic_checks(device, monkeypatch):
    q, k, v = _qkv(10, 4, 2, 16, torch.bfloat16, device)
    pq, cache, cu, table, starts = _paged_problem(device)
    slots = torch.arange(10, device=device)
    _generic_checks_forbidden(monkeypatch)
    attention_varlen(q, k, v, _cu([4, 6], device), 6, validate=False)
    store_kv_cache(k, v, cache.k, cache.v, slots, validate=False)
    attention_paged_prefill(pq, cache.k, cache.v, cu, 8, table, starts, validate=False)
    monkeypatch.setattr(C, "HOST_FAST_PATH", False)  # the switch turns them off
    with pytest.raises(AssertionError, match="generic checks ran"):
        attention_varlen(q, k, v, _cu([4, 6], device), 6, validate=False)


def test_bad_calls_raise_without_validate(device):
    for args, exc, words in _bad_varlen_cases(device):
        if words not in _VALUE_CASES and not (words == "max_seqlen" and exc is ValueError):
            with pytest.raises(exc, match=words):
                attention_varlen(*args, validate=False)
    k, v = _qkv(4, 2, 2, 16, torch.bfloat16, device)[1:]
    kc = torch.zeros((2, 16, 2, 16), dtype=torch.bfloat16, device=device)
    slots = torch.arange(4, device=device)
    store_cases = [((k, v, kc, kc.clone(), slots.int()), TypeError, "slot_mapping"),
                   ((k, v, kc, kc.clone(), slots[:3]), ValueError, "one slot per token"),
                   ((k, v, kc.float(), kc.float(), slots), ValueError, "dtype"),
                   ((k, v[:, :1], kc, kc.clone(), slots), ValueError, "v must match"),
                   ((k, v, kc[..., :8], kc[..., :8], slots), ValueError, "must match k's")]
    for args, exc, words in store_cases:
        with pytest.raises(exc, match=words):
            store_kv_cache(*args, validate=False)
    q, cache, cu, table, starts = _paged_problem(device)
    half = attention_config().block_n // 2  # a block size that is not a multiple of the KV tile
    paged_cases = [((q, cache.k, cache.v, cu, 8, table, starts.repeat(2)), ValueError, "one row per sequence"),
                   ((q, cache.k, cache.v, cu, 8, table, starts.long()), TypeError, "query_starts"),
                   ((q.float(), cache.k, cache.v, cu, 8, table, starts), TypeError, "dtype"),
                   ((q[:, :3], cache.k, cache.v, cu, 8, table, starts), ValueError, "multiple of KV heads"),
                   ((q, cache.k[:, :half], cache.v[:, :half], cu, 8, table, starts), ValueError, "block_size"),
                   ((q, cache.k, cache.v, cu, 8.0, table, starts), TypeError, "max_seqlen"),
                   ((q, cache.k, cache.v, cu.long(), 8, table, starts), TypeError, "cu_seqlens")]
    for args, exc, words in paged_cases:
        with pytest.raises(exc, match=words):
            attention_paged_prefill(*args, validate=False)

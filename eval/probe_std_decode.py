"""Probe: can the standard (stock) engine's paged decode use torch's FlashAttention with a
block table instead of gathering every block of the table into a dense [B, L] K/V?

Prints torch's ``varlen_attn`` signature, then at Qwen3-0.6B's attention shape (16 query
heads, 8 KV heads, head_dim 128, bf16) and batch 128 decodes against paged caches: the
current gather + masked SDPA path (L = table width x block size) and ``varlen_attn`` with
``block_table`` and ``seqused_k``, for block sizes 64 and 256, contexts 640 in a table of
``--table-len`` positions. Reports each path's CUDA-event time and the max |difference| to
the gather path (a baseline: no bitwise claim).
"""
from __future__ import annotations

import argparse
import inspect

import torch


def gather_decode(q, k_cache, v_cache, tables, ctx):
    from areal_tik.model.ops import _gather_attention_decode
    return _gather_attention_decode(q, k_cache, v_cache, tables, ctx)


def paged_flash(q, k_cache, v_cache, tables, ctx):
    from areal_tik.model.ops import _paged_flash_decode  # the standard set's own call
    return _paged_flash_decode(q, k_cache, v_cache, tables, ctx, None)


def timed(fn, *args, reps=50):
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--table-len", type=int, default=4096)
    args = parser.parse_args()
    print("torch", torch.__version__)
    try:
        from torch.nn.attention.varlen import varlen_attn
        print("varlen_attn", inspect.signature(varlen_attn))
    except ImportError as exc:
        print("no varlen_attn:", exc)
    print(torch.ops.aten._flash_attention_forward.default._schema)
    torch.manual_seed(0)
    hq, hk, d = 16, 8, 128
    for bs in (64, 256):
        n_blocks = args.table_len // bs
        pool = args.batch * n_blocks
        k_cache = torch.randn(pool, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(pool, device="cuda").view(args.batch, n_blocks).to(torch.int32)
        ctx = torch.full((args.batch,), args.context, device="cuda", dtype=torch.int32)
        q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.bfloat16)
        from areal_tik.model.ops import paged_flash_decode_reason
        print(f"block {bs}: the standard decode's rule: {paged_flash_decode_reason(q, k_cache) or 'paged-flash'}")
        ref = gather_decode(q, k_cache, v_cache, tables, ctx)
        t_gather = timed(gather_decode, q, k_cache, v_cache, tables, ctx)
        try:
            out = paged_flash(q, k_cache, v_cache, tables, ctx)
            diff = (out.float() - ref.float()).abs().max().item()
            t_flash = timed(paged_flash, q, k_cache, v_cache, tables, ctx)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                paged_flash(q, k_cache, v_cache, tables, ctx)
            graph.replay()
            torch.cuda.synchronize()
            flash = f"paged flash {t_flash:.1f} us, max |diff| {diff:.3g}, graph capture ok"
        except Exception as exc:  # the probe's answer: what torch on this image says
            flash = f"paged flash failed: {type(exc).__name__}: {str(exc)[:300]}"
        kv_bytes = 2 * args.batch * args.context * hk * d * 2
        print(f"block {bs}: gather+SDPA {t_gather:.1f} us (reads {args.table_len} positions a row; "
              f"the context's K/V is {kv_bytes / 1e6:.1f} MB); {flash}", flush=True)


if __name__ == "__main__":
    main()

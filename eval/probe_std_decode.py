"""Probe: the standard (stock) engine's decode on FlashAttention over each sequence's rows
(one KV block per sequence, ``seqused_k``) against gathering the table into a dense [B, L]
K/V and a masked SDPA.

Prints torch's ``_flash_attention_forward`` schema, then at Qwen3-0.6B's attention shape (16
query heads, 8 KV heads, head_dim 128, bf16), batch ``--batch``, contexts of ``--context``
tokens in blocks of ``--block`` (one per sequence, shuffled): each path's CUDA-event time, the
K/V bytes the context holds and the TB/s that makes, the max |difference| to the gather path
(a baseline: no bitwise claim), and whether a CUDA graph captures the flash path.
"""
from __future__ import annotations

import argparse

import torch


def gather_decode(q, k_cache, v_cache, tables, ctx):
    from areal_tik.model.ops import _gather_attention_decode
    return _gather_attention_decode(q, k_cache, v_cache, tables, ctx)


def flash(q, k_cache, v_cache, tables, ctx):
    from areal_tik.model.ops import _flash_decode  # the standard set's own call
    return _flash_decode(q, k_cache, v_cache, tables, ctx, None)


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
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 128])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--block", type=int, default=1024)
    args = parser.parse_args()
    from areal_tik.model.ops import flash_decode_reason

    print("torch", torch.__version__)
    print(torch.ops.aten._flash_attention_forward.default._schema)
    torch.manual_seed(0)
    hq, hk, d = 16, 8, 128
    for batch in args.batch:
        k_cache = torch.randn(batch + 1, args.block, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = (torch.randperm(batch, device="cuda") + 1).view(batch, 1).to(torch.int32)
        ctx = torch.full((batch,), args.context, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * batch * args.context * hk * d * 2
        print(f"batch {batch}: the standard decode's rule: {flash_decode_reason(q, 1) or 'flash-seqused'}")
        ref = gather_decode(q, k_cache, v_cache, tables, ctx)
        t_gather = timed(gather_decode, q, k_cache, v_cache, tables, ctx)
        try:
            out = flash(q, k_cache, v_cache, tables, ctx)
            diff = (out.float() - ref.float()).abs().max().item()
            t_flash = timed(flash, q, k_cache, v_cache, tables, ctx)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flash(q, k_cache, v_cache, tables, ctx)
            graph.replay()
            torch.cuda.synchronize()
            found = (f"flash {t_flash:.1f} us ({kv_bytes / t_flash / 1e6:.2f} TB/s), max |diff| {diff:.3g}, "
                     f"graph capture ok")
        except Exception as exc:  # the probe's answer: what torch on this image says
            found = f"flash failed: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"batch {batch}: context K/V {kv_bytes / 1e6:.1f} MB; gather+SDPA {t_gather:.1f} us "
              f"({kv_bytes / t_gather / 1e6:.2f} TB/s); {found}", flush=True)


if __name__ == "__main__":
    main()

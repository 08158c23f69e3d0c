"""Probe: where paged decode attention's latency goes, by context length (GPU, about 1-2 min).

Usage (GPU, repo root):
    python3 -m eval.probe_decode_latency [--batches 1 16 64] [--contexts 128 256 ... 8192]

Qwen3-0.6B heads (16 query / 8 KV heads of 128, bf16), block size 64, shuffled blocks, the
kernel's default config (one KV split of ``kv_split`` positions a program; one launch when
the block table covers one split, else split programs and the in-order combine). Each
case is captured in a CUDA graph of 20 calls and replayed; the latency per call is the
median of 5 replays, twice: "hot" (back to back: K/V of small cases stay in the 50 MB L2)
and "cold" (a 256 MiB write between calls, its own time measured alone and subtracted).
Per case it prints the tiles each program walks in sequence, us a call and the K/V bytes
read per second, and beside the default:

- ``2 splits``: the same context with the block table twice as wide, so that the launch
  takes the split + combine path even where one split covers the context (the extra
  split's programs return at once): is the one-launch (DIRECT) path slower?
- ``stages 2`` / ``stages 4``, ``1 / 4 programs per SM``: scheduling knobs;

and the us per tile from a least-squares line over the contexts of one program's split
(context <= kv_split): the latency of one dependent step of the online softmax.
Every variant's output is compared with the default's bits (they are scheduling only).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from areal_tik.unified_kernels import _attention_fwd as F
from areal_tik.unified_kernels.attention import attention_decode

HQ, HK, DIM, BLOCK = 16, 8, 128, 64


def make_case(batch: int, context: int, seed: int = 0, widen: int = 1):
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq + 1
    gen = torch.Generator("cpu").manual_seed(seed)
    table = torch.randperm(blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    if widen > 1:  # columns past the context: never read (any valid block id)
        table = torch.cat([table, table[:, :1].expand(batch, per_seq * (widen - 1))], dim=1).contiguous()
    dev = dict(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(batch, HQ, DIM, generator=g, **dev)
    k = torch.randn(blocks, BLOCK, HK, DIM, generator=g, **dev)
    v = torch.randn(blocks, BLOCK, HK, DIM, generator=g, **dev)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, k, v, table.cuda(), ctx


def time_call(fn, flush: torch.Tensor | None, calls: int = 20, reps: int = 5) -> float:
    """us a call: a CUDA graph of ``calls`` calls (each after a flush when given), median of
    ``reps`` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            if flush is not None:
                flush.add_(1)
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def flush_cost(flush: torch.Tensor) -> float:
    return time_call(lambda: None, flush)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_latency needs a CUDA GPU")
    base = F.GPU_CONFIG
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}; config {base}", flush=True)
    flush = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    flush_us = flush_cost(flush)
    print(f"cold = a 256 MiB write before each call ({flush_us:.1f} us alone, subtracted)", flush=True)
    variants = {"stages 2": dataclasses.replace(base, stages_decode=2),
                "stages 4": dataclasses.replace(base, stages_decode=4),
                "1 prog/SM": dataclasses.replace(base, decode_programs_per_sm=1),
                "4 prog/SM": dataclasses.replace(base, decode_programs_per_sm=4)}
    mismatches = 0
    for batch in args.batches:
        print(f"\nbatch {batch}: us a call hot / cold (cold: K/V TB/s), then the variants' hot us "
              "(ratio to the default)", flush=True)
        one_split = []
        for context in args.contexts:
            q, k, v, table, ctx = make_case(batch, context)
            kv_bytes = 2 * batch * context * HK * DIM * 2
            want = attention_decode(q, k, v, table, ctx, config=base)
            hot = time_call(lambda: attention_decode(q, k, v, table, ctx, config=base), None)
            cold = time_call(lambda: attention_decode(q, k, v, table, ctx, config=base), flush) - flush_us
            tiles = min(-(-context // base.block_n), base.kv_split // base.block_n)
            if context <= base.kv_split:
                one_split.append((tiles, hot))
            parts = [f"  c{context:5d}: {tiles:2d} tiles/program  {hot:7.1f} / {cold:7.1f} us "
                     f"({kv_bytes / cold / 1e6:5.2f} TB/s)"]
            q2, k2, v2, table2, ctx2 = make_case(batch, context, widen=2)
            got = attention_decode(q2, k2, v2, table2, ctx2, config=base)
            mismatches += not torch.equal(bits(got), bits(want))
            t2 = time_call(lambda: attention_decode(q2, k2, v2, table2, ctx2, config=base), None)
            parts.append(f"2 splits {t2:6.1f} ({t2 / hot:4.2f})")
            for name, cfg in variants.items():
                got = attention_decode(q, k, v, table, ctx, config=cfg)
                mismatches += not torch.equal(bits(got), bits(want))
                t = time_call(lambda: attention_decode(q, k, v, table, ctx, config=cfg), None)
                parts.append(f"{name} {t:6.1f} ({t / hot:4.2f})")
            print("  ".join(parts), flush=True)
        if len(one_split) >= 2:
            n = len(one_split)
            mx = sum(t for t, _ in one_split) / n
            my = sum(u for _, u in one_split) / n
            slope = sum((t - mx) * (u - my) for t, u in one_split) / max(sum((t - mx) ** 2 for t, _ in one_split), 1e-9)
            print(f"  one split a program: {slope:.2f} us per tile, {my - slope * mx:.1f} us at 0 tiles "
                  f"(least squares over {n} contexts, hot)", flush=True)
    print(f"\nvariants whose bits differ from the default's: {mismatches} (must be 0: scheduling only)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())

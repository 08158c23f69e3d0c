"""Probe: is BLOCK_K part of the linear's numerics on the GPU, or only geometry?

Usage (GPU, repo root): python3 -m eval.probe_block_k [--quick] [--out DIR_OR_CSV]

The unified linear's docstring fixes BLOCK_K = 64 (bf16) because an element's chain is
``acc = dot(a_blk, b_blk, acc)`` over K blocks. On Hopper a bf16 ``tl.dot`` is a chain of
wgmma instructions of K = 16 each on the same accumulator, in K order, so a 128-wide
block is the same 8 instructions in the same order as two 64-wide blocks. If that holds
bit for bit, BLOCK_K is a free knob: fewer, larger K steps for the decode linears,
whose time is dominated by the per-step latency of a sequential chain (32-96 steps of
2-4 KiB at N <= 2048), not by bytes.

1. Bits: for several shapes, row counts and input distributions (normal; a wide exponent
   range; near-cancelling sums), every tile / kernel (tiled, persistent TMA) at BLOCK_K
   16, 32, 128, 256 against the table's config (BLOCK_K 64), compared as int16 views;
   the fused LM-head log-prob (its logits, lse and target log-prob) likewise.
2. Time (CUDA-graph replay, inputs rotated past L2, as eval/bench_linear.py): the decode
   shapes at 1 and 64 rows, the table's config vs BLOCK_K 128 / 256 tiles, and cuBLAS.
Prints one line per case and a summary; writes a long-format CSV.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools

import torch
from triton.runtime.errors import OutOfResources

from eval.bench_linear import SHAPES, measure
from eval.harness import bench_parser, graph_times, print_summary, run_info, write_csv

L = importlib.import_module("areal_tik.unified_kernels.linear")
LP = importlib.import_module("areal_tik.unified_kernels.logprob")
T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")

BIT_SHAPES = ((1024, 4096), (2048, 1024), (3072, 1024), (1024, 6144), (576, 1536), (8192, 2048))  # (K, N)
BIT_ROWS = (1, 17, 64, 300, 2048)
BIT_TILES = (  # (bm, bn, warps, stages, kind)
    (64, 16, 4, 4, ""), (64, 64, 4, 4, ""), (128, 128, 4, 3, ""), (128, 128, 4, 3, "P"), (256, 128, 8, 2, "P"))
BLOCK_KS = (16, 32, 128, 256)
DECODE_LAYERS = ("qkv", "o", "gate_up", "down")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1
SMEM = 200 * 1024  # bytes of shared memory one program may take (the H100/H200 allow 227 KiB)


def dist_inputs(kind: str, m: int, k: int, n: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=g)
    w = torch.randn(n, k, device=DEVICE, generator=g) * k ** -0.5
    if kind == "wide":  # exponents over +-2^24: every alignment shift inside a 16-product sum
        x = x * torch.exp2(torch.randint(-24, 25, (m, k), device=DEVICE, generator=g).float())
        w = w * torch.exp2(torch.randint(-12, 13, (n, k), device=DEVICE, generator=g).float())
    elif kind == "cancel":  # pairs of nearly opposite products: the sums keep only low bits
        x[:, 1::2] = -x[:, 0::2] * (1 + 2.0 ** -7 * torch.randn(m, k // 2, device=DEVICE, generator=g))
        w[:, 1::2] = w[:, 0::2]
    return x.bfloat16(), w.bfloat16()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def probe_bits(quick: bool) -> list[dict]:
    rows = []
    shapes = BIT_SHAPES[:3] if quick else BIT_SHAPES
    for (k, n), m, kind in itertools.product(shapes, BIT_ROWS, ("normal", "wide", "cancel")):
        x, w = dist_inputs(kind, m, k, n, seed=k + n + m)
        bias = (torch.randn(n, device=DEVICE) * 0.1).bfloat16()
        ref = bits(L.linear_forward(x, w, bias))
        for (bm, bn, warps, stages, kind_), bk in itertools.product(BIT_TILES, BLOCK_KS):
            if m > 300 and bm == 64 or m < 64 and bm > 64:
                continue
            cfg = T._cfg(bm, bn, warps, stages, kind_, block_k=bk)
            try:
                got = bits(L.linear_forward(x, w, bias, cfg))
            except OutOfResources:
                continue
            equal = torch.equal(got, ref)
            rows.append({"probe": "linear_bits", "K": k, "N": n, "M": m, "dist": kind, "config": name(cfg),
                         "block_k": bk, "equal": int(equal), "diff_elems": int((got != ref).sum())})
            if not equal:
                print(f"  DIFF linear K={k} N={n} M={m} {kind} {name(cfg)}: {rows[-1]['diff_elems']} elements")
    return rows


def probe_logprob_bits(quick: bool) -> list[dict]:
    rows = []
    V, H = 151936, 1024
    base = LP.logprob_config(V, H, torch.bfloat16)
    for t, kind in itertools.product((1, 64) if quick else (1, 64, 700), ("normal", "wide")):
        x, w = dist_inputs(kind, t, H, V, seed=t)
        tgt = torch.randint(0, V, (t,), device=DEVICE)
        ref = LP._forward(x, w, tgt, 1.0, True, True, base)
        for bk, stages in ((32, 4), (128, 3), (256, 2)):
            cfg = dataclasses.replace(base, block_k=bk, num_stages=stages)
            try:
                got = LP._forward(x, w, tgt, 1.0, True, True, cfg)
            except OutOfResources:
                continue
            parts = {"logprob": 0, "entropy": 1, "lse": 2, "logits": 3}
            eq = {p: torch.equal(bits(got[i]), bits(ref[i])) for p, i in parts.items()}
            rows.append({"probe": "logprob_bits", "K": H, "N": V, "M": t, "dist": kind, "block_k": bk,
                         "equal": int(all(eq.values())), **{f"equal_{p}": int(v) for p, v in eq.items()}})
            if not all(eq.values()):
                print(f"  DIFF logprob T={t} {kind} BLOCK_K={bk}: {eq}")
    return rows


def name(cfg) -> str:
    kind = "/PS" if cfg.split_epilogue else "/P" if cfg.persistent else ""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}{kind}"


def timing_configs(k: int):
    for bk, bn in itertools.product((128, 256), (16, 32, 64)):
        if k % bk:
            continue
        per_stage = (64 + bn) * bk * 2
        deep = max(2, min(20, SMEM // per_stage))
        for stages in dict.fromkeys((deep, max(2, deep // 2))):
            yield T._cfg(64, bn, 4, stages, block_k=bk)


def probe_time(quick: bool, rep_ms: int) -> list[dict]:
    rows = []
    shapes = [s for s in SHAPES if s[1] in DECODE_LAYERS]
    if quick:
        shapes = [s for s in shapes if s[0] == "qwen3-0.6b"]
    for (model, layer, k, n), m in itertools.product(shapes, (1, 64)):
        table = L.linear_config(m, n, k, torch.bfloat16)
        cands = [("table", table)] + [("bk", c) for c in timing_configs(k)]
        base = measure(lambda x, w: (lambda: torch.nn.functional.linear(x, w)), m, k, n, rep_ms, "graph")
        res = []
        for tag, cfg in cands:
            try:
                r = measure(lambda x, w, c=cfg: (lambda: L.linear_forward(x, w, None, c)), m, k, n, rep_ms, "graph")
            except OutOfResources:
                continue
            res.append((r["us"], tag, cfg))
            rows.append({"probe": "linear_time", "model": model, "layer": layer, "K": k, "N": n, "M": m,
                         "config": name(cfg), "tag": tag, "us": r["us"], "tbps": r["tbps"], "cublas_us": base["us"]})
        t_table = next(us for us, tag, _ in res if tag == "table")
        best = min(res, key=lambda r: r[0])
        print(f"  {model:>12} {layer:>7} K={k:<5} N={n:<6} M={m:<3} table {t_table:6.1f} us ({name(table)})  "
              f"best {best[0]:6.1f} us ({name(best[2])}, {t_table / best[0]:.2f}x)  cuBLAS {base['us']:6.1f} us")
    return rows


def probe_logprob_time(rep_ms: int) -> list[dict]:
    rows = []
    V, H = 151936, 1024
    base = LP.logprob_config(V, H, torch.bfloat16)
    for t in (1, 64):
        x, w = dist_inputs("normal", t, H, V, seed=1)
        tgt = torch.randint(0, V, (t,), device=DEVICE)
        line = []
        for bk, stages, warps in ((64, 4, 4), (64, 6, 4), (128, 3, 4), (128, 4, 4), (256, 2, 4), (128, 3, 8)):
            cfg = dataclasses.replace(base, block_k=bk, num_stages=stages, num_warps=warps)
            fn = lambda c=cfg: LP._forward(x, w, tgt, 1.0, False, True, c)  # noqa: E731  (the sampler's call)
            try:
                fn()
            except OutOfResources:
                continue
            us = sorted(graph_times([fn], 200.0, rep_ms))[2]  # the weight (311 MB) is past L2 anyway
            rows.append({"probe": "logprob_time", "K": H, "N": V, "M": t, "block_k": bk, "stages": stages,
                         "warps": warps, "us": us, "tbps": V * H * 2 / us * 1e-6})
            line.append(f"bk{bk}/s{stages}/w{warps} {us:.1f} us")
        print(f"  logprob T={t}: " + ", ".join(line))
    return rows


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args(argv)
    info = run_info()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}")
    rows = probe_bits(args.quick)
    rows += probe_logprob_bits(args.quick)
    lin = [r for r in rows if r["probe"] == "linear_bits"]
    lp = [r for r in rows if r["probe"] == "logprob_bits"]
    summary = [f"linear bits: {sum(r['equal'] for r in lin)} / {len(lin)} cases equal to the table's "
               f"(BLOCK_K {', '.join(map(str, BLOCK_KS))} vs 64)",
               f"logprob bits: {sum(r['equal'] for r in lp)} / {len(lp)} cases equal"]
    print("\n".join(summary))
    if not args.skip_time:
        rows += probe_time(args.quick, args.rep_ms)
        rows += probe_logprob_time(args.rep_ms)
    rows = [dict(info, **r) for r in rows]
    print_summary(summary, [write_csv(rows, args.out, f"probe_block_k_{info['commit']}.csv")])


if __name__ == "__main__":
    main()

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
   shapes of the supported models per row bucket (``TIMED_BUCKETS``: 1 and 64 rows, 128,
   256), the table's config vs BLOCK_K 128 / 256 tiles (each first checked bit-equal to the
   table's on the three distributions), and cuBLAS; the promotion rule (``PROMOTE_GAIN`` /
   ``PROMOTE_CAP``) picks wide-K entries per shape and bucket, and ``--promote FILE`` writes
   them for ``AREAL_TIK_LINEAR_TILES`` (_linear_tiles.load_wide_k; a run's file joins
   ``_linear_tiles.WIDE_K_SOURCES`` when its entries go into the table).
3. The fused LM-head log-prob at BLOCK_K 64 / 128 / 256 and a few pipelines, timed at 1 and
   64 rows.
Prints one line per case and a summary; writes a long-format CSV.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import json

import torch
from triton.runtime.errors import OutOfResources

from areal_tik.unified_kernels import bits
from eval.bench_linear import SHAPES, measure
from eval.bench_linear import cfg_name as name
from eval.harness import bench_parser, graph_times, print_summary, run_info, write_csv

L = importlib.import_module("areal_tik.unified_kernels.linear")
LP = importlib.import_module("areal_tik.unified_kernels.logprob")
T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")

BIT_SHAPES = ((1024, 4096), (2048, 1024), (3072, 1024), (1024, 6144), (576, 1536), (8192, 2048))  # (K, N)
BIT_ROWS = (1, 17, 64, 300)
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


def probe_bits(quick: bool) -> list[dict]:
    rows = []
    shapes = BIT_SHAPES[:3] if quick else BIT_SHAPES
    for (k, n), m, kind in itertools.product(shapes, BIT_ROWS, ("normal", "wide", "cancel")):
        x, w = dist_inputs(kind, m, k, n, seed=k + n + m)
        ref = bits(L.partial_forward(x, w, 1))  # the unrounded fp32 chain: no bf16 rounding hides a bit
        for (bm, bn, warps, stages, kind_), bk in itertools.product(BIT_TILES, BLOCK_KS):
            if m > 300 and bm == 64 or m < 64 and bm > 64:
                continue
            cfg = T._cfg(bm, bn, warps, stages, kind_, block_k=bk)
            try:
                got = bits(L.partial_forward(x, w, 1, cfg))
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


def timing_configs(k: int, bucket: int = 64):
    """Wide-K tiles for one bucket: BLOCK_K 128 / 256 dividing K, 64-row tiles, BLOCK_N 16-64
    (to 128 above 64 rows), the deepest pipeline that fits ``SMEM`` and half of it."""
    for bk, bn in itertools.product((128, 256), (16, 32, 64) + ((128,) if bucket > 64 else ())):
        if k % bk:
            continue
        per_stage = (64 + bn) * bk * 2
        deep = max(2, min(20, SMEM // per_stage))
        for stages in dict.fromkeys((deep, max(2, deep // 2))):
            yield T._cfg(64, bn, 4, stages, block_k=bk)


def same_bits(cfg, table_cfgs, k, n) -> bool:
    """``cfg``'s unrounded fp32 chain equals the table's at each timed row count on every distribution."""
    for m, kind in itertools.product(table_cfgs, ("normal", "wide", "cancel")):
        x, w = dist_inputs(kind, m, k, n, seed=7 * m + k)
        if not torch.equal(bits(L.partial_forward(x, w, 1, cfg)), bits(L.partial_forward(x, w, 1, table_cfgs[m]))):
            return False
    return True


# The promotion rule, fixed before any timing: per shape and row bucket, the bit-equal candidate
# with the least time summed over the bucket's timed row counts, if that sum is <= 0.97x the
# table's and no row count is slower than 1.02x the table's.
PROMOTE_GAIN, PROMOTE_CAP = 0.97, 1.02
# (bucket max rows, row counts timed in it): decode up to 64 sequences (the 85e8ca9 run's
# entries), then 65-128 and 129-256 sequences (added after it; not yet run).
TIMED_BUCKETS = ((64, (1, 64)), (128, (128,)), (256, (256,)))

# The recipes' other models (recipes/README.md), beyond eval/bench_linear.py's three. SmolLM2-135M's
# K = 576 takes no BLOCK_K above 64 (no masked tail), so only its down_proj (K = 1536) is a candidate.
EXTRA_SHAPES = (
    ("qwen2.5-1.5b", "qkv", 1536, 1536 + 2 * 256), ("qwen2.5-1.5b", "o", 1536, 1536),
    ("qwen2.5-1.5b", "gate_up", 1536, 2 * 8960), ("qwen2.5-1.5b", "down", 8960, 1536),
    ("smollm2-135m", "down", 1536, 576),
)


def probe_time(quick: bool, rep_ms: int) -> tuple[list[dict], dict]:
    rows, promoted = [], {}
    shapes = [s for s in SHAPES + EXTRA_SHAPES if s[1] in DECODE_LAYERS]
    buckets = TIMED_BUCKETS[:1] if quick else TIMED_BUCKETS
    if quick:
        shapes = [s for s in shapes if s[0] == "qwen3-0.6b"]
    cublas = lambda x, w: (lambda: torch.nn.functional.linear(x, w))  # noqa: E731
    for (model, layer, k, n), (bucket, counts) in itertools.product(shapes, buckets):
        table = {m: L.linear_config(m, n, k, torch.bfloat16) for m in counts}
        base = {m: measure(cublas, m, k, n, rep_ms, "graph")["us"] for m in counts}
        timed = []  # (tag, cfg, {m: us})
        for tag, cfg in [("table", None)] + [("wide", c) for c in timing_configs(k, bucket)]:
            try:
                if cfg is not None and not same_bits(cfg, table, k, n):
                    print(f"  DIFF {model} {layer} {name(cfg)}: bits differ from the table's")
                    rows.append({"probe": "linear_time", "model": model, "layer": layer, "K": k, "N": n,
                                 "bucket": bucket, "config": name(cfg), "tag": tag, "equal": 0})
                    continue
                us = {m: measure(lambda x, w, c=cfg or table[m]: (lambda: L.linear_forward(x, w, None, c)),
                                 m, k, n, rep_ms, "graph")["us"] for m in counts}
            except OutOfResources:
                continue
            timed.append((tag, cfg, us))
            for m in counts:
                rows.append({"probe": "linear_time", "model": model, "layer": layer, "K": k, "N": n, "M": m,
                             "bucket": bucket, "config": name(cfg or table[m]), "tag": tag, "equal": 1, "us": us[m],
                             "tbps": 2.0 * (m * k + n * k + m * n) / us[m] * 1e-6, "cublas_us": base[m]})
        ref = timed[0][2]
        best = min(timed[1:], key=lambda t: sum(t[2].values()), default=None)
        verdict = "kept"
        if best is not None:
            gain = sum(best[2].values()) / sum(ref.values())
            if gain <= PROMOTE_GAIN and all(best[2][m] <= PROMOTE_CAP * ref[m] for m in counts):
                promoted[f"{bucket},{n},{k}"] = dataclasses.asdict(best[1])
                verdict = f"promoted ({gain:.2f}x the table's time)"
        for m in counts:
            b = best[2][m] if best else float("nan")
            print(f"  {model:>12} {layer:>7} K={k:<5} N={n:<6} M={m:<3} table {ref[m]:6.1f} us ({name(table[m])})  "
                  f"best wide {b:6.1f} us ({name(best[1]) if best else '-'}, {ref[m] / b:.2f}x)  "
                  f"cuBLAS {base[m]:6.1f} us")
        print(f"  {model:>12} {layer:>7} <= {bucket} rows: {verdict}")
    return rows, promoted


# (BLOCK_K, stages, warps); 8 warps: a control (other reduction layouts, other bits at 85e8ca9)
LOGPROB_PIPELINES = ((64, 4, 4), (64, 6, 4), (128, 3, 4), (128, 4, 4), (256, 2, 4), (128, 3, 8))


def probe_logprob_time(rep_ms: int) -> tuple[list[dict], dict]:
    """The sampler's call (logits written, no entropy) at 1 and 64 rows per pipeline, each
    first checked bit-equal to the default (every output, normal and wide inputs); the same
    promotion rule as the linears'. Returns (rows, the promoted override or {})."""
    rows, timed = [], []
    V, H = 151936, 1024
    base = LP.logprob_config(V, H, torch.bfloat16)
    inputs = {t: dist_inputs("normal", t, H, V, seed=1) for t in (1, 64)}
    tgts = {t: torch.randint(0, V, (t,), device=DEVICE) for t in (1, 64)}
    for bk, stages, warps in LOGPROB_PIPELINES:
        cfg = dataclasses.replace(base, block_k=bk, num_stages=stages, num_warps=warps)
        try:
            for t, kind in itertools.product((1, 64), ("normal", "wide")):
                x, w = dist_inputs(kind, t, H, V, seed=3 + t)
                want, got = LP._forward(x, w, tgts[t], 1.0, True, True, base), LP._forward(x, w, tgts[t], 1.0, True, True, cfg)
                if not all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got)):
                    raise ValueError(f"logprob bk{bk}/s{stages}/w{warps}: bits differ ({kind}, T={t})")
            us = {}
            for t in (1, 64):
                x, w = inputs[t]
                fn = lambda c=cfg, x=x, w=w, t=t: LP._forward(x, w, tgts[t], 1.0, False, True, c)  # noqa: E731
                us[t] = sorted(graph_times([fn], 200.0, rep_ms))[2]  # the weight (311 MB) is past L2 anyway
        except OutOfResources:
            continue
        except ValueError as err:
            print(f"  DIFF {err}")
            rows.append({"probe": "logprob_time", "K": H, "N": V, "block_k": bk, "stages": stages, "warps": warps,
                         "equal": 0})
            continue
        timed.append(((bk, stages, warps), us))
        for t in (1, 64):
            rows.append({"probe": "logprob_time", "K": H, "N": V, "M": t, "block_k": bk, "stages": stages,
                         "warps": warps, "equal": 1, "us": us[t], "tbps": V * H * 2 / us[t] * 1e-6})
        print(f"  logprob bk{bk}/s{stages}/w{warps}: T=1 {us[1]:.1f} us, T=64 {us[64]:.1f} us "
              f"({V * H * 2 / us[1] * 1e-6:.2f} / {V * H * 2 / us[64] * 1e-6:.2f} TB/s of weight)")
    ref = next(us for key, us in timed if key == (base.block_k, base.num_stages, base.num_warps))
    best_key, best = min(timed, key=lambda kv: kv[1][1] + kv[1][64])
    gain = (best[1] + best[64]) / (ref[1] + ref[64])
    if gain <= PROMOTE_GAIN and all(best[t] <= PROMOTE_CAP * ref[t] for t in (1, 64)) and best_key[2] == base.num_warps:
        print(f"  logprob: promoted bk{best_key[0]}/s{best_key[1]} ({gain:.2f}x the default's time)")
        return rows, dict(zip(("block_k", "num_stages"), best_key))
    print(f"  logprob: kept the default (best {gain:.2f}x)")
    return rows, {}


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--promote", help="JSON file for the promoted wide-K entries (linear._linear_tiles.load_wide_k)")
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
        timed, promoted = probe_time(args.quick, args.rep_ms)
        lp_rows, lp_promoted = probe_logprob_time(args.rep_ms)
        rows += timed + lp_rows
        summary.append(f"wide-K entries promoted: {len(promoted)} ({', '.join(promoted) or 'none'}); "
                       f"logprob pipeline: {lp_promoted or 'default kept'}")
        if args.promote:
            with open(args.promote, "w") as f:
                json.dump({"linear": promoted, "logprob": lp_promoted}, f, indent=1, sort_keys=True)
            summary.append(f"wrote {args.promote} (AREAL_TIK_LINEAR_TILES reads it)")
    rows = [dict(info, **r) for r in rows]
    print_summary(summary, [write_csv(rows, args.out, f"probe_block_k_{info['commit']}.csv")])


if __name__ == "__main__":
    main()

"""Benchmark: unified linear vs torch F.linear (cuBLAS), side by side in one process.

Usage (GPU, repo root):
    python3 -m eval.bench_linear [--quick] [--sweep] [--timer graph|events] [--out DIR_OR_CSV]
    python3 -m eval.bench_linear --k-groups 2 4 8 [--out DIR_OR_CSV]   # the K-group tree's cost

Times both implementations on the linear shapes of Qwen3-0.6B, Qwen3-1.7B and
Llama-3.2-1B at 1..16384 tokens, prints the speed ratio (cuBLAS time / ours: >1 means
ours is faster) and hardware terms (TFLOP/s, TB/s, fraction of the H200 ceilings), and
writes a long-format CSV.

Timer (``--timer graph``, the default): calls shorter than ~200 us are replayed from a
CUDA graph (as the rollout engine runs decode), cycling through enough copies of x and
the weight to exceed the L2 cache, so every call streams its weight from HBM and no
host launch overhead enters the time. Eager timing with CUDA events let the host's
Python/launch cost leak into small-M numbers (the first run saw our M=1 time jump from
16 us to 46 us mid-run, for the same kernel and shape, while cuBLAS stayed at 10 us).
Longer calls use ``triton.testing.do_bench`` (L2 cleared before every call), as does
``--timer events`` for everything.

``--k-groups G [G ...]`` times only the K-group tree (tensor-parallel row shards): ``linear``
with k_groups = G vs 1 on the o_proj / down_proj shapes at 1, 64 and 4096 rows (the
default configs), i.e. what the tree costs a TP = 1 trainer; where the table's tile
cannot hold the tree's log2(G) + 1 fp32 tiles in registers, G > 1 runs the smaller tile
of ``linear.tree_tile`` (same BLOCK_K, same bits) and the table's tile is timed beside
it; and one rank's ``linear_partial`` of two ranks (K / 2 columns, G / 2 groups). It
first checks that ``combine_partials`` over two ranks and over G ranks (one group each:
the plain G = 1 chain, the tree's definition) and the table's tile equal the default
kernel bit for bit.

``--sweep`` also times every invariance-proven tile geometry (``linear.linear_candidates``,
both kernels) per token count on a few shapes, skipping geometries that cannot be
competitive there (BLOCK_M > 64 below 512 rows, decode tiles above 1024, persistent below
512), prints the best next to the table's choice and a summary of the table's losses,
to re-tune ``linear._GPU_BUCKETS``.
"""
from __future__ import annotations

import argparse
import importlib
import math
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
from areal_tik.optimize.op_linear import MODEL_PROJECTIONS  # noqa: E402
from eval.harness import event_us, graph_times, run_info, write_csv  # noqa: E402

from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import bitwise_equal, combine_partials, linear, linear_partial  # noqa: E402

L = importlib.import_module("areal_tik.unified_kernels.linear")

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on the H200
PEAK_TBPS = 4.26  # measured device copy (read + write)
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
GRAPH_MAX_US = 200.0  # calls up to this long are timed from a CUDA graph
ROTATE_BYTES = 2 * 60 * 2 ** 20  # > 2x the H200's 50 MiB L2: every call reads from HBM

# (model, layer, K, N): q/k/v and gate/up packed into one matmul each; the search's linear
# workloads are the same list.
SHAPES = MODEL_PROJECTIONS
QUICK_SHAPES = (("qwen3-1.7b", "up", 2048, 6144), ("llama-3.2-1b", "down", 8192, 2048))
QUICK_TOKENS = (1, 64, 1024, 8192)
SWEEP_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)  # to place bucket limits
SWEEP_SHAPES = (  # (model, layer, K, N, tokens)
    ("qwen3-1.7b", "up", 2048, 6144, SWEEP_TOKENS),
    ("qwen3-0.6b", "o", 2048, 1024, SWEEP_TOKENS),
    ("llama-3.2-1b", "down", 8192, 2048, SWEEP_TOKENS),
    ("qwen3-0.6b", "qkv", 1024, 4096, (1, 64, 256, 1024, 4096)),
    ("qwen3-0.6b", "lm_head", 1024, 151936, (1, 64, 1024)),
)
TREE_SHAPES = tuple(shape for shape in SHAPES if shape[1] in ("o", "down"))  # row-parallel under TP
TREE_TOKENS = (1, 64, 4096)






def time_us(make_fn, m, k, n, rep_ms, timer) -> tuple[float, float, float, str]:
    """(median, p20, p80) us per call and the timer used; ``make_fn(x, w)`` -> callable."""
    x, w = inputs(m, k, n)
    fn = make_fn(x, w)
    fn()
    torch.cuda.synchronize()
    # The least of three estimates: one slow host stall must not send a 25 us kernel to the
    # host-bound events timer (2026-12-07: Qwen3-1.7B qkv at 1024 rows timed 66.6 us there,
    # 24.4 us from the graph in the run before, same machine and tile).
    est = min(event_us(fn, 3) for _ in range(3))
    if timer == "graph" and est < GRAPH_MAX_US:
        copies = max(1, min(32, math.ceil(ROTATE_BYTES / (2 * (m * k + n * k)))))
        fns = [fn] + [make_fn(*inputs(m, k, n, seed=i)) for i in range(1, copies)]
        times = sorted(graph_times(fns, est, rep_ms, 2 * m * n))
        del fns
        return statistics.median(times), times[1], times[-2], "graph"
    med, p20, p80 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return med * 1e3, p20 * 1e3, p80 * 1e3, "events"


def measure(make_fn, m, k, n, rep_ms, timer) -> dict:
    us, p20, p80, used = time_us(make_fn, m, k, n, rep_ms, timer)
    flops = 2.0 * m * n * k
    nbytes = 2.0 * (m * k + n * k + m * n)  # bf16 x, weight and output, each once
    tflops, tbps = flops / us * 1e-6, nbytes / us * 1e-6
    return {"us": us, "us_p20": p20, "us_p80": p80, "tflops": tflops, "tbps": tbps,
            "frac_peak_flops": tflops / PEAK_TFLOPS, "frac_peak_bw": tbps / PEAK_TBPS, "timer": used}


def inputs(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    return x, w


def bench_shape(model, layer, k, n, tokens, rep_ms, timer, info) -> list[dict]:
    rows = []
    for m in tokens:
        x, w = inputs(m, k, n)
        ours, ref = linear(x[:256], w).float(), torch.nn.functional.linear(x[:256], w).float()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{model}/{layer} M={m}: unified vs cuBLAS rel err {err:.3g}"
        del x, w, ours, ref
        cfg = L.linear_config(m, n, k, torch.bfloat16)
        timed = {"unified": measure(lambda x, w: lambda: linear(x, w), m, k, n, rep_ms, timer),
                 "cublas": measure(lambda x, w: lambda: torch.nn.functional.linear(x, w), m, k, n, rep_ms, timer)}
        ratio = timed["cublas"]["us"] / timed["unified"]["us"]
        u = timed["unified"]
        print(f"{model:>13} {layer:>8} K={k:<5} N={n:<6} M={m:<6} unified {u['us']:9.1f} us "
              f"cuBLAS {timed['cublas']['us']:9.1f} us  ratio {ratio:5.2f}  "
              f"{u['tflops']:6.1f} TFLOP/s ({u['frac_peak_flops']:4.0%})  "
              f"{u['tbps']:5.2f} TB/s ({u['frac_peak_bw']:4.0%})  {cfg_name(cfg)} [{u['timer']}]", flush=True)
        for impl, res in timed.items():
            rows.append(_row(model, layer, k, n, m, impl, res, info,
                             cfg_name(cfg) if impl == "unified" else "", ratio))
    return rows


def bench_tree(groups: tuple[int, ...], rep_ms, timer, info) -> list[dict]:
    """linear with each of ``groups`` vs 1 (its default configs: for G > 1 the table's tile
    or the smaller one of ``linear.tree_tile``, and then the table's tile beside it), and
    one rank's partial of two ranks."""
    rows = []
    for model, layer, k, n in TREE_SHAPES:
        half = k // 2
        for m in TREE_TOKENS:
            cfg = L.linear_config(m, n, k, torch.bfloat16)
            plain = measure(lambda x, w: lambda: linear(x, w), m, k, n, rep_ms, timer)
            rows.append(_row(model, layer, k, n, m, "unified_g1", plain, info, cfg_name(cfg)))
            for k_groups in groups:
                tree_cfg = L.linear_config(m, n, k, torch.bfloat16, k_groups=k_groups)
                x, w = inputs(m, k, n)
                full = linear(x, w, k_groups=k_groups)
                for t in (2, k_groups):  # t = G: one group a rank, each the plain G = 1 chain (the definition)
                    width = k // t
                    ranks = combine_partials([linear_partial(x[:, r * width:(r + 1) * width].contiguous(),
                                                             w[:, r * width:(r + 1) * width].contiguous(),
                                                             k_groups=k_groups // t) for r in range(t)], None, x.dtype)
                    assert bitwise_equal(ranks, full), f"{model}/{layer} M={m} G={k_groups}: {t} ranks != full"
                assert bitwise_equal(L.linear_forward(x, w, None, config=cfg, k_groups=k_groups), full), \
                    f"{model}/{layer} M={m} G={k_groups}: {cfg_name(cfg)} != {cfg_name(tree_cfg)}"
                del x, w, ranks, full
                timed = {f"unified_g{k_groups}": (measure(lambda x, w: lambda: linear(x, w, k_groups=k_groups),
                                                          m, k, n, rep_ms, timer), tree_cfg)}
                if tree_cfg != cfg:
                    timed[f"unified_g{k_groups}_table_tile"] = (measure(
                        lambda x, w: lambda: L.linear_forward(x, w, None, config=cfg, k_groups=k_groups),
                        m, k, n, rep_ms, timer), cfg)
                timed[f"rank_partial_t2_g{k_groups // 2}"] = (measure(  # a rank of two: K / 2, G / 2 groups
                    lambda x, w: lambda: linear_partial(x, w, k_groups=k_groups // 2), m, half, n, rep_ms, timer),
                    L.linear_config(m, n, half, torch.bfloat16, k_groups=k_groups // 2))
                tree = timed[f"unified_g{k_groups}"][0]["us"]
                extra = "".join(f"  {impl.removeprefix('unified_')} {res['us']:8.1f} us ({cfg_name(c)})"
                                for impl, (res, c) in timed.items() if impl != f"unified_g{k_groups}")
                print(f"{model:>13} {layer:>5} K={k:<5} N={n:<5} M={m:<5} G=1 {plain['us']:8.1f} us "
                      f"({cfg_name(cfg)})  G={k_groups} {tree:8.1f} us ({tree / plain['us']:4.2f}x, "
                      f"{cfg_name(tree_cfg)}){extra}", flush=True)
                for impl, (res, c) in timed.items():
                    rows.append(_row(model, layer, half if impl.startswith("rank") else k, n, m, impl, res, info,
                                     cfg_name(c)))
    return rows


def sweep_worthy(cfg, m) -> bool:
    """Skip geometries that measured >= 1.5x the best in this row range (first sweep)."""
    if m <= 256 and cfg.block_m > 64:
        return False
    if m >= 1024 and (cfg.block_n <= 32 or cfg.num_stages >= 8):
        return False
    return m >= 512 or not cfg.persistent


def sweep_shape(model, layer, k, n, tokens, rep_ms, timer, info) -> tuple[list[dict], list[float]]:
    rows, losses = [], []
    for m in tokens:
        results = {}
        chosen = L.linear_config(m, n, k, torch.bfloat16)
        for cfg in (c for c in L.linear_candidates(torch.bfloat16) if c == chosen or sweep_worthy(c, m)):
            try:
                results[cfg] = measure(lambda x, w, cfg=cfg: lambda: L.linear_forward(x, w, None, config=cfg),
                                       m, k, n, rep_ms, timer)
            except OutOfResources as err:  # a candidate too large for this GPU: skip it
                print(f"sweep {cfg_name(cfg)}: {err}", flush=True)
                continue
            rows.append(_row(model, layer, k, n, m, "unified_sweep", results[cfg], info, cfg_name(cfg)))
        best = min(results, key=lambda c: results[c]["us"])
        table_us = results[chosen]["us"] if chosen in results else float("nan")
        losses.append(table_us / results[best]["us"])
        top = sorted(results, key=lambda c: results[c]["us"])[:3]
        print(f"sweep {model}/{layer} M={m:<6} table {cfg_name(chosen)} {table_us:8.1f} us "
              f"({losses[-1]:4.2f}x best); top: " +
              ", ".join(f"{cfg_name(c)} {results[c]['us']:.1f}" for c in top), flush=True)
    return rows, losses


def cfg_name(cfg) -> str:
    kind = ("/P" + ("S" if cfg.split_epilogue else "")) if cfg.persistent else ""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}{kind}"


def _row(model, layer, k, n, m, impl, res, info, config, ratio=None) -> dict:
    return {"op": "linear", "shape": f"{model}/{layer} K={k} N={n}", "model": model, "layer": layer,
            "K": k, "N": n, "tokens": m, "impl": impl, "config": config,
            **{key: (round(val, 4) if isinstance(val, float) else val) for key, val in res.items()},
            "speed_vs_cublas": "" if ratio is None else round(ratio, 4), **info}


def summarize(rows) -> None:
    """Targets: >= 0.9x cuBLAS at >= 1024 tokens, >= 0.8x at <= 64 tokens."""
    for label, pick, target in (("<= 64 tokens", lambda m: m <= 64, 0.8),
                                (">= 1024 tokens", lambda m: m >= 1024, 0.9)):
        ratios = [r["speed_vs_cublas"] for r in rows if r["impl"] == "unified" and pick(r["tokens"])]
        if ratios:
            met = sum(x >= target for x in ratios)
            print(f"{label}: ratio min {min(ratios):.2f} median {sorted(ratios)[len(ratios) // 2]:.2f}; "
                  f"{met}/{len(ratios)} cases meet {target}x")




def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--quick", action="store_true", help="small subset, < 60 s")
    parser.add_argument("--sweep", action="store_true", help="also time every tile geometry")
    parser.add_argument("--timer", choices=("graph", "events"), default="graph",
                        help="graph: CUDA-graph replay for calls < 200 us (default); events: do_bench")
    parser.add_argument("--rep-ms", type=int, default=40, help="timing budget per case")
    parser.add_argument("--k-groups", type=int, nargs="+", choices=(2, 4, 8), default=None, metavar="G",
                        help="only time the K-group tree: k_groups = G (one or more of 2 4 8) vs 1 on "
                             "o_proj / down_proj shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear needs a CUDA GPU")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}  "
          f"fixed tile: {L.FIXED_TILE}  timer: {args.timer}")
    if args.k_groups is not None:
        rows = bench_tree(tuple(dict.fromkeys(args.k_groups)), args.rep_ms, args.timer, info)
        print(f"wrote {write_csv(rows, args.out, 'bench_linear_tree.csv')} ({len(rows)} rows) "
              f"in {time.time() - start:.0f} s")
        return
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if args.quick else (SHAPES, TOKENS)
    rows = []
    for model, layer, k, n in shapes:
        rows += bench_shape(model, layer, k, n, tokens, args.rep_ms, args.timer, info)
    summarize(rows)
    if args.sweep:
        losses = []
        for model, layer, k, n, sweep_tokens in SWEEP_SHAPES[:1] if args.quick else SWEEP_SHAPES:
            new_rows, new_losses = sweep_shape(model, layer, k, n, tokens if args.quick else sweep_tokens,
                                               max(10, args.rep_ms // 4), args.timer, info)
            rows, losses = rows + new_rows, losses + new_losses
        print(f"sweep: table within 5% of the best in {sum(x <= 1.05 for x in losses)}/{len(losses)} "
              f"cases; worst {max(losses):.2f}x")
    print(f"wrote {write_csv(rows, args.out, 'bench_linear.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

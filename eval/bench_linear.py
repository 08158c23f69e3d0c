"""Benchmark: unified linear vs torch F.linear (cuBLAS), side by side in one process.

Usage (GPU, repo root):
    python3 eval/bench_linear.py [--quick] [--sweep] [--out DIR_OR_CSV]

Times both implementations with ``triton.testing.do_bench`` (median; the L2 cache is
cleared before every call, so small-M runs really stream the weight) on the linear
shapes of Qwen3-0.6B, Qwen3-1.7B and Llama-3.2-1B at 1..16384 tokens, prints the speed
ratio (cuBLAS time / ours: >1 means ours is faster) and hardware terms (TFLOP/s, TB/s,
fraction of the H200 ceilings), and writes a long-format CSV. ``--sweep`` also times
every invariance-proven tile geometry (``linear.geometry_variants``) per token count,
to re-tune the row-count bucket table.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import linear  # noqa: E402  (the function)

L = importlib.import_module("areal_tik.unified_kernels.linear")

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on the H200
PEAK_TBPS = 4.26  # measured device copy (read + write)
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)

# (model, layer, K, N): q/k/v and gate/up are packed into one matmul each.
SHAPES = (
    ("qwen3-0.6b", "qkv", 1024, 2048 + 2 * 1024),
    ("qwen3-0.6b", "o", 2048, 1024),
    ("qwen3-0.6b", "gate_up", 1024, 2 * 3072),
    ("qwen3-0.6b", "down", 3072, 1024),
    ("qwen3-0.6b", "lm_head", 1024, 151936),
    ("qwen3-1.7b", "qkv", 2048, 2048 + 2 * 1024),
    ("qwen3-1.7b", "o", 2048, 2048),
    ("qwen3-1.7b", "up", 2048, 6144),  # one projection: the reference cuBLAS numbers
    ("qwen3-1.7b", "gate_up", 2048, 2 * 6144),
    ("qwen3-1.7b", "down", 6144, 2048),
    ("llama-3.2-1b", "qkv", 2048, 32 * 64 + 2 * 8 * 64),
    ("llama-3.2-1b", "o", 2048, 2048),
    ("llama-3.2-1b", "gate_up", 2048, 2 * 8192),
    ("llama-3.2-1b", "down", 8192, 2048),
)
QUICK_SHAPES = (("qwen3-1.7b", "up", 2048, 6144), ("llama-3.2-1b", "down", 8192, 2048))
QUICK_TOKENS = (1, 64, 1024, 8192)
SWEEP_SHAPES = (("qwen3-1.7b", "up", 2048, 6144), ("qwen3-0.6b", "o", 2048, 1024))
SWEEP_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)  # to place bucket limits


def run_info() -> dict:
    commit = os.environ.get("AREAL_TIK_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                    capture_output=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def measure(fn, m, k, n, rep_ms) -> dict:
    med, p20, p80 = (t * 1e3 for t in do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms,
                                               quantiles=[0.5, 0.2, 0.8]))
    us = med
    flops = 2.0 * m * n * k
    nbytes = 2.0 * (m * k + n * k + m * n)  # bf16 x, weight and output, each once
    tflops, tbps = flops / us * 1e-6, nbytes / us * 1e-6
    return {"us": us, "us_p20": p20, "us_p80": p80, "tflops": tflops, "tbps": tbps,
            "frac_peak_flops": tflops / PEAK_TFLOPS, "frac_peak_bw": tbps / PEAK_TBPS}


def inputs(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    return x, w


def bench_shape(model, layer, k, n, tokens, rep_ms, info) -> list[dict]:
    rows = []
    for m in tokens:
        x, w = inputs(m, k, n)
        ours, ref = linear(x[:256], w).float(), torch.nn.functional.linear(x[:256], w).float()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{model}/{layer} M={m}: unified vs cuBLAS rel err {err:.3g}"
        cfg = L.select_config(m, torch.bfloat16)
        timed = {"unified": measure(lambda: linear(x, w), m, k, n, rep_ms),
                 "cublas": measure(lambda: torch.nn.functional.linear(x, w), m, k, n, rep_ms)}
        ratio = timed["cublas"]["us"] / timed["unified"]["us"]
        u = timed["unified"]
        print(f"{model:>13} {layer:>8} K={k:<5} N={n:<6} M={m:<6} unified {u['us']:9.1f} us "
              f"cuBLAS {timed['cublas']['us']:9.1f} us  ratio {ratio:5.2f}  "
              f"{u['tflops']:6.1f} TFLOP/s ({u['frac_peak_flops']:4.0%})  "
              f"{u['tbps']:5.2f} TB/s ({u['frac_peak_bw']:4.0%})  {_cfg_name(cfg)}", flush=True)
        for impl, res in timed.items():
            rows.append(_row(model, layer, k, n, m, impl, res, info,
                             _cfg_name(cfg) if impl == "unified" else "", ratio))
        del x, w, ours, ref
    return rows


def sweep_shape(model, layer, k, n, tokens, rep_ms, info) -> list[dict]:
    rows = []
    for m in tokens:
        x, w = inputs(m, k, n)
        results = {}
        for cfg in L.geometry_variants(torch.bfloat16):
            try:
                results[cfg] = measure(lambda: L.linear_forward(x, w, None, config=cfg), m, k, n, rep_ms)
            except OutOfResources as err:  # a candidate too large for this GPU: skip it
                print(f"sweep {_cfg_name(cfg)}: {err}", flush=True)
                continue
            rows.append(_row(model, layer, k, n, m, "unified_sweep", results[cfg], info, _cfg_name(cfg)))
        best = min(results, key=lambda c: results[c]["us"])
        chosen = L.select_config(m, torch.bfloat16)
        table_us = results[chosen]["us"] if chosen in results else float("nan")
        print(f"sweep {model}/{layer} M={m:<6} best {_cfg_name(best)} {results[best]['us']:8.1f} us; "
              f"table {_cfg_name(chosen)} {table_us:8.1f} us", flush=True)
    return rows


def _cfg_name(cfg) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}"


def _row(model, layer, k, n, m, impl, res, info, config, ratio=None) -> dict:
    return {"op": "linear", "shape": f"{model}/{layer} K={k} N={n}", "model": model, "layer": layer,
            "K": k, "N": n, "tokens": m, "impl": impl, "config": config,
            **{key: round(val, 4) for key, val in res.items()},
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


def write_csv(rows, out: str) -> Path:
    path = Path(out)
    if path.suffix != ".csv":
        path = path / "bench_linear.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--quick", action="store_true", help="small subset, < 60 s")
    parser.add_argument("--sweep", action="store_true", help="also time every tile geometry")
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear needs a CUDA GPU")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}  "
          f"fixed tile: {L.FIXED_TILE}")
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if args.quick else (SHAPES, TOKENS)
    rows = []
    for model, layer, k, n in shapes:
        rows += bench_shape(model, layer, k, n, tokens, args.rep_ms, info)
    summarize(rows)
    if args.sweep:
        for model, layer, k, n in SWEEP_SHAPES[:1] if args.quick else SWEEP_SHAPES:
            rows += sweep_shape(model, layer, k, n, tokens if args.quick else SWEEP_TOKENS,
                                max(10, args.rep_ms // 2), info)
    print(f"wrote {write_csv(rows, args.out)} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

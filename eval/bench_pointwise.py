"""Benchmark: unified rms_norm / add_rms_norm / apply_rope / silu_mul vs torch eager.

Usage (GPU, repo root):
    python3 eval/bench_pointwise.py [--quick] [--sweep] [--out DIR_OR_CSV]

Times, side by side in one process with ``triton.testing.do_bench`` (median), the
unified kernels and the standard torch path (``reference.*`` with ``compute=None``:
the Hugging Face formulas in eager torch ops) at the shapes of Qwen3-0.6B, Qwen3-1.7B
and Llama-3.2-1B for 1..16384 tokens. For rope and SwiGLU it also times the exact
Hugging Face code (``q * cos + rotate_half(q) * sin`` with per-forward bf16 cos/sin,
and ``F.silu(gate) * up``), and the speed ratio is taken against the faster torch
variant (> 1 means unified is faster). Bandwidth counts every input read once and every
output written once, as a fraction of the measured 4.26 TB/s device copy. ``--sweep``
times other (rows per program, num_warps) choices for the norm kernels, to re-tune
``rms_norm.norm_config`` (each choice is row-invariant on its own; the table must stay
a function of H only).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import reference as R  # noqa: E402
from areal_tik.unified_kernels.rms_norm import NormConfig, _forward, add_rms_norm, norm_config, rms_norm  # noqa: E402
from areal_tik.unified_kernels.rope import apply_rope, rope_cos_sin  # noqa: E402
from areal_tik.unified_kernels.swiglu import silu_mul  # noqa: E402

PEAK_TBPS = 4.26  # measured device copy (read + write) on the H200
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK_TOKENS = (1, 1024, 16384)
MAX_POS = 40960
EPS = 1e-6
# model: (hidden, q heads, kv heads, head_dim, intermediate, per-head q/k norm)
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, True),
    "llama-3.2-1b": (2048, 32, 8, 64, 8192, False),
}
DEVICE = "cuda"
SWEEP_HIDDEN = (128, 1024, 2048, 4096)
SWEEP_TOKENS = (1024, 16384)


def run_info() -> dict:
    commit = os.environ.get("AREAL_TIK_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                    capture_output=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def measure(fn, nbytes, rep_ms) -> dict:
    med, p20, p80 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    us = med * 1e3
    tbps = nbytes / us * 1e-6
    return {"us": us, "us_p20": p20 * 1e3, "us_p80": p80 * 1e3, "tbps": tbps, "frac_peak_bw": tbps / PEAK_TBPS}


# ------------------------------------------------------------------------------ cases


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, cos_full, sin_full):
    """Hugging Face apply_rotary_pos_emb (cos/sin [T, D] in the activation dtype)."""
    c, s = cos_full[:, None], sin_full[:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def cases(model: str, t: int):
    """Yield (op, shape text, bytes moved, {impl: fn}) for one model and token count."""
    hidden, hq, hk, d, inter, qk_norm = MODELS[model]
    dev, bf = DEVICE, torch.bfloat16
    es = 2  # bytes per bf16 element
    x = torch.randn(t, hidden, device=dev, dtype=bf)
    res = torch.randn(t, hidden, device=dev, dtype=bf)
    w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(bf)
    yield ("rms_norm", f"H={hidden}", 2 * t * hidden * es + hidden * es,
           {"unified": lambda: rms_norm(x, w, EPS), "torch": lambda: R.rms_norm(x, w, EPS, compute=None)})
    yield ("add_rms_norm", f"H={hidden}", 4 * t * hidden * es + hidden * es,
           {"unified": lambda: add_rms_norm(x, res, w, EPS),
            "torch": lambda: R.add_rms_norm(x, res, w, EPS, compute=None)})
    q = torch.randn(t, hq, d, device=dev, dtype=bf)
    k = torch.randn(t, hk, d, device=dev, dtype=bf)
    if qk_norm:
        wd = (1 + 0.1 * torch.randn(d, device=dev)).to(bf)
        yield ("rms_norm_head", f"[T,{hq},{d}]", 2 * t * hq * d * es + d * es,
               {"unified": lambda: rms_norm(q, wd, EPS), "torch": lambda: R.rms_norm(q, wd, EPS, compute=None)})
    pos = torch.randint(0, MAX_POS, (t,), device=dev)
    cos, sin = rope_cos_sin(MAX_POS, d, 1e6, device=dev)
    cos_full = torch.cat([cos, cos], -1)[pos].to(bf)  # HF builds these once per forward
    sin_full = torch.cat([sin, sin], -1)[pos].to(bf)
    rope_bytes = 2 * t * (hq + hk) * d * es + t * 8 + 2 * t * (d // 2) * 4
    yield ("apply_rope", f"q[T,{hq},{d}] k[T,{hk},{d}]", rope_bytes,
           {"unified": lambda: apply_rope(q, k, pos, cos, sin),
            "torch": lambda: R.apply_rope(q, k, pos, cos, sin, compute=None),
            "torch_hf": lambda: hf_rope(q, k, cos_full, sin_full)})
    gu = torch.randn(t, 2 * inter, device=dev, dtype=bf)
    yield ("silu_mul", f"I={inter}", 3 * t * inter * es,
           {"unified": lambda: silu_mul(gu), "torch": lambda: R.silu_mul(gu, compute=None),
            "torch_hf": lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]})


def _sanity(op, fns) -> None:
    """The unified result agrees with the torch path to bf16 accuracy (not a bit check)."""
    ours, ref = fns["unified"](), fns["torch"]()
    ours, ref = (ours, ref) if isinstance(ours, tuple) else ((ours,), (ref,))
    for a, b in zip(ours, ref):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        assert err < 1e-2, f"{op}: unified vs torch rel err {err:.3g}"


def bench_model(model, tokens, rep_ms, info) -> list[dict]:
    rows = []
    for t in tokens:
        with torch.no_grad():
            for op, shape, nbytes, fns in cases(model, t):
                _sanity(op, fns)
                timed = {impl: measure(fn, nbytes, rep_ms) for impl, fn in fns.items()}
                best_torch = min(v["us"] for k, v in timed.items() if k != "unified")
                ratio = best_torch / timed["unified"]["us"]
                u = timed["unified"]
                others = "  ".join(f"{k} {v['us']:8.1f} us" for k, v in timed.items() if k != "unified")
                print(f"{model:>12} {op:>13} {shape:>22} T={t:<6} unified {u['us']:8.1f} us  {others}  "
                      f"ratio {ratio:5.2f}  {u['tbps']:5.2f} TB/s ({u['frac_peak_bw']:4.0%})", flush=True)
                for impl, r in timed.items():
                    rows.append(_row(op, shape, model, t, impl, r, info, ratio if impl == "unified" else None))
    return rows


def sweep(rep_ms, info) -> list[dict]:
    """Norm kernels: time (rows per program, num_warps) variants per H at large T."""
    rows = []
    for hidden in SWEEP_HIDDEN:
        block = triton.next_power_of_2(hidden)
        chosen = norm_config(hidden)
        for t in SWEEP_TOKENS:
            n = t * (16 if hidden == 128 else 1)  # H = 128: the per-head form, T * 16 rows
            x = torch.randn(n, hidden, device=DEVICE, dtype=torch.bfloat16)
            w = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
            results = {}
            for r_per in (1, 2, 4, 8, 16, 32):
                for warps in (2, 4, 8, 16):
                    if not 1024 <= r_per * block <= 8192:  # a program moves 2..16 KiB
                        continue
                    cfg = NormConfig(block, 1, r_per, warps)
                    res = measure(lambda: _forward(x, None, w, EPS, cfg), 2 * n * hidden * 2, rep_ms)
                    results[cfg] = res
                    rows.append(_row("rms_norm_sweep", f"H={hidden}", "", t, f"r{r_per}/w{warps}", res, info))
            best = min(results, key=lambda c: results[c]["us"])
            table = results.get(chosen, {"us": float("nan"), "frac_peak_bw": float("nan")})
            print(f"sweep H={hidden:<5} T={t:<6} best rows={best.rows} warps={best.num_warps} "
                  f"{results[best]['us']:7.1f} us ({results[best]['frac_peak_bw']:4.0%}); table rows="
                  f"{chosen.rows} warps={chosen.num_warps} {table['us']:7.1f} us "
                  f"({table['frac_peak_bw']:4.0%})", flush=True)
    return rows


def _row(op, shape, model, t, impl, res, info, ratio=None) -> dict:
    return {"op": op, "shape": shape, "model": model, "tokens": t, "impl": impl,
            **{key: round(val, 4) for key, val in res.items()},
            "speed_vs_torch": "" if ratio is None else round(ratio, 4), **info}


def summarize(rows) -> None:
    """Targets: never slower than torch eager; >= 70% of copy bandwidth at >= 4096 tokens."""
    uni = [r for r in rows if r["impl"] == "unified"]
    if not uni:
        return
    slower = [r for r in uni if r["speed_vs_torch"] < 1.0]
    print(f"speed ratio vs torch: min {min(r['speed_vs_torch'] for r in uni):.2f}; "
          f"{len(uni) - len(slower)}/{len(uni)} cases at least as fast")
    for r in slower:
        print(f"  slower: {r['model']} {r['op']} T={r['tokens']} ratio {r['speed_vs_torch']:.2f}")
    big = [r for r in uni if r["tokens"] >= 4096]
    for op in dict.fromkeys(r["op"] for r in big):
        fr = [r["frac_peak_bw"] for r in big if r["op"] == op]
        print(f"{op:>13} at >= 4096 tokens: {min(fr):.0%}..{max(fr):.0%} of copy bandwidth "
              f"({sum(f >= 0.7 for f in fr)}/{len(fr)} >= 70%)")


def write_csv(rows, out: str) -> Path:
    path = Path(out)
    if path.suffix != ".csv":
        path = path / "bench_pointwise.csv"
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
    parser.add_argument("--quick", action="store_true", help="one model, three token counts, < 60 s")
    parser.add_argument("--sweep", action="store_true", help="also time norm launch geometries")
    parser.add_argument("--rep-ms", type=int, default=25, help="do_bench repetition time per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_pointwise needs a CUDA GPU")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}")
    models, tokens = (("qwen3-0.6b",), QUICK_TOKENS) if args.quick else (tuple(MODELS), TOKENS)
    rows = []
    for model in models:
        rows += bench_model(model, tokens, args.rep_ms, info)
    summarize(rows)
    if args.sweep:
        rows += sweep(max(10, args.rep_ms // 2), info)
    print(f"wrote {write_csv(rows, args.out)} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

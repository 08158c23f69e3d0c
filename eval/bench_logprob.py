"""Benchmark: fused unified token log-prob/entropy vs the standard path, side by side in one process.

Usage (GPU, repo root):
    python3 -m eval.bench_logprob [--quick] [--sweep] [--out DIR_OR_CSV]

Standard path (what Hugging Face + AReaL do): cuBLAS ``F.linear`` -> bf16 logits ->
``log_softmax(logits.float() / T)`` -> gather, plus entropy. Unified path:
``token_logprobs(hidden, weight, targets, T, return_entropy=True)``. Both are timed
forward and forward+backward with ``triton.testing.do_bench`` (median, 20/80 quantiles)
for the LM heads of Qwen3-0.6B, Qwen3-1.7B and Llama-3.2-1B at 1..16384 tokens. Printed:
the speed ratio (standard time / unified: > 1 means unified is faster), TFLOP/s
(model FLOPs: 2TVH forward, 6TVH forward+backward, for both paths) as a fraction of the
790 TFLOP/s bf16 ceiling, and the peak extra memory of each path. ``--sweep`` times
alternative forward tile schedules (each would give other bits: a fixed choice per
shape must be made before any log-prob is recorded).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
from eval.harness import run_info, write_csv  # noqa: E402

from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import token_logprobs  # noqa: E402

L = importlib.import_module("areal_tik.unified_kernels.logprob")

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on the H200
STANDARD_LIMIT_BYTES = 20e9  # skip the standard path when its [T, V] fp32 logits exceed this
TEMPERATURE = 0.7
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
SHAPES = (("qwen3-0.6b", 151936, 1024), ("qwen3-1.7b", 151936, 2048), ("llama-3.2-1b", 128256, 2048))
QUICK_SHAPES, QUICK_TOKENS = (("qwen3-0.6b", 151936, 1024),), (1, 64, 4096)
SWEEP_TILES = (  # (block_t, block_v, block_k, split_v, group_t, num_warps, num_stages)
    (64, 128, 64, 512, 16, 4, 4), (64, 128, 64, 256, 16, 4, 4), (64, 128, 64, 1024, 16, 4, 4),
    (64, 128, 64, 512, 8, 4, 3), (64, 256, 64, 512, 16, 8, 3), (128, 128, 64, 512, 8, 8, 3),
    (128, 128, 64, 512, 8, 8, 4), (128, 64, 64, 512, 8, 4, 3), (64, 64, 64, 512, 16, 4, 4),
    # fewer vocabulary splits: V = 151936 in one wave of two programs per SM (640: 238 splits,
    # 768: 198) or one per SM (1152: 132); other numerics (the split merge order), timing only
    (64, 128, 64, 640, 16, 4, 4), (64, 128, 64, 768, 16, 4, 4), (64, 128, 64, 1152, 16, 4, 4),
)




def standard(hidden, weight, targets, temperature):
    """The materialised path: bf16 logits, fp32 log_softmax, gather, entropy."""
    logits = torch.nn.functional.linear(hidden, weight)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    return lp, -(logp.exp() * logp).sum(-1)


def unified(hidden, weight, targets, temperature):
    return token_logprobs(hidden, weight, targets, temperature, return_entropy=True)


def with_backward(fn, hidden, weight, targets, g_lp, g_ent):
    """fn's forward plus the backward to hidden and weight (a fresh graph per call)."""
    def run():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        lp, ent = fn(h, w, targets, TEMPERATURE)
        return torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (h, w))
    return run


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def measure(fn, flops, rep_ms) -> dict:
    fn()  # compile / warm up outside the timing
    med, p20, p80 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    tflops = flops / (med * 1e-3) * 1e-12
    return {"ms": med, "ms_p20": p20, "ms_p80": p80, "tflops": tflops,
            "frac_peak_flops": tflops / PEAK_TFLOPS, "peak_extra_mb": peak_extra_bytes(fn) / 2**20}


def inputs(T, V, H, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)
    return hidden, weight, targets, g_lp, g_ent


def bench_case(model, V, H, T, rep_ms, info) -> list[dict]:
    hidden, weight, targets, g_lp, g_ent = inputs(T, V, H)
    run_standard = T * V * 4 <= STANDARD_LIMIT_BYTES
    if run_standard:
        ours, ref = unified(hidden, weight, targets, TEMPERATURE), standard(hidden, weight, targets, TEMPERATURE)
        err = max((a - b).abs().max().item() for a, b in zip(ours, ref))
        assert err < 0.1, f"{model} T={T}: unified vs standard max |diff| {err:.3g}"
        del ours, ref
    else:
        print(f"{model} T={T}: standard path skipped ([T, V] fp32 logits {T * V * 4 / 1e9:.0f} GB "
              f"> {STANDARD_LIMIT_BYTES / 1e9:.0f} GB)")
    rows = []
    for mode, flops in (("fwd", 2.0 * T * V * H), ("fwd+bwd", 6.0 * T * V * H)):
        timed = {}
        for name, fn in (("unified", unified), ("standard", standard)):
            if name == "standard" and not run_standard:
                continue
            call = ((lambda fn=fn: fn(hidden, weight, targets, TEMPERATURE)) if mode == "fwd"
                    else with_backward(fn, hidden, weight, targets, g_lp, g_ent))
            timed[name] = measure(call, flops, rep_ms)
        u, s = timed["unified"], timed.get("standard")
        ratio = s["ms"] / u["ms"] if s else float("nan")
        std = (f"standard {s['ms']:8.3f} ms {s['peak_extra_mb']:9.1f} MiB" if s else "standard  skipped")
        print(f"{model:>12} V={V:<6} H={H:<5} T={T:<6} {mode:>7}  unified {u['ms']:8.3f} ms "
              f"{u['peak_extra_mb']:9.1f} MiB  {std}  ratio {ratio:5.2f}  "
              f"{u['tflops']:6.1f} TFLOP/s ({u['frac_peak_flops']:4.0%})", flush=True)
        for name, res in timed.items():
            rows += _rows(info, model, V, H, T, mode, name, "", res, ratio if name == "unified" else None)
    del hidden, weight
    torch.cuda.empty_cache()
    return rows


def sweep(V, H, tokens, rep_ms, info, sampler=False) -> list[dict]:
    """Forward time of each candidate schedule (the kernels only, via the private launcher):
    the training call (targets, entropy) or, with ``sampler``, the decode sampler's (logits
    written, no targets, no entropy)."""
    rows = []
    for T in tokens:
        hidden, weight, targets, _, _ = inputs(T, V, H)
        results = {}
        for cfg in SWEEP_TILES:
            tiles = L.LogprobConfig(*cfg)
            call = ((lambda: L._forward(hidden, weight, None, TEMPERATURE, False, True, tiles)) if sampler else
                    (lambda: L._forward(hidden, weight, targets, TEMPERATURE, True, False, tiles)))
            try:
                results[cfg] = measure(call, 2.0 * T * V * H, rep_ms)
            except OutOfResources as err:
                print(f"sweep {cfg}: {err}", flush=True)
                continue
            rows += _rows(info, "sweep", V, H, T, "fwd", "unified_sweep", _name(tiles), results[cfg])
        default = dataclasses.astuple(L.logprob_config(V, H, torch.bfloat16))
        best = min(results, key=lambda c: results[c]["ms"])
        print(f"sweep V={V} H={H} T={T:<6} best {_name(L.LogprobConfig(*best))} {results[best]['ms']:.3f} ms; "
              f"default {_name(L.LogprobConfig(*default))} {results.get(default, {'ms': float('nan')})['ms']:.3f} ms; "
              + " ".join(f"{_name(L.LogprobConfig(*c))}={r['ms']:.3f}" for c, r in results.items()), flush=True)
    return rows


def _name(t) -> str:
    return f"{t.block_t}x{t.block_v}x{t.block_k}/split{t.split_v}/g{t.group_t}/w{t.num_warps}/s{t.num_stages}"


def _rows(info, model, V, H, T, mode, impl, config, res, ratio=None) -> list[dict]:
    """Long format: one row per metric."""
    base = {"op": "token_logprobs", "model": model, "V": V, "H": H, "tokens": T, "dtype": "bf16",
            "temperature": TEMPERATURE, "mode": mode, "impl": impl, "config": config, **info}
    metrics = dict(res)
    if ratio is not None:
        metrics["speed_vs_standard"] = ratio
    return [{**base, "metric": key, "value": round(val, 5)} for key, val in metrics.items()]




def summarize(rows) -> None:
    """Target: unified at least as fast as the standard path, with O(T x chunk) memory."""
    for mode in ("fwd", "fwd+bwd"):
        ratios = [r["value"] for r in rows if r["metric"] == "speed_vs_standard" and r["mode"] == mode
                  and r["value"] == r["value"]]
        if ratios:
            met = sum(x >= 1.0 for x in ratios)
            print(f"{mode}: ratio min {min(ratios):.2f} median {sorted(ratios)[len(ratios) // 2]:.2f} "
                  f"max {max(ratios):.2f}; {met}/{len(ratios)} cases at least as fast as the standard path")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--quick", action="store_true", help="small subset, < 60 s")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile schedules")
    parser.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per case")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep (no side-by-side cases)")
    parser.add_argument("--sweep-hidden", type=int, default=2048, help="the sweep's hidden size (V = 151936)")
    parser.add_argument("--sweep-sampler", action="store_true", help="sweep the decode sampler's call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_logprob needs a CUDA GPU")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}  "
          f"temperature {TEMPERATURE}  default tiles {_name(L.logprob_config(151936, 1024, torch.bfloat16))}")
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if args.quick else (SHAPES, TOKENS)
    rows = []
    for model, V, H in () if args.sweep_only else shapes:
        for T in tokens:
            rows += bench_case(model, V, H, T, args.rep_ms, info)
    if rows:
        summarize(rows)
    if args.sweep or args.sweep_only:
        rows += sweep(151936, args.sweep_hidden, (1, 64, 4096) if args.quick else (1, 64, 1024, 16384),
                      max(10, args.rep_ms // 2), info, sampler=args.sweep_sampler)
    print(f"wrote {write_csv(rows, args.out, 'bench_logprob.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Benchmark: unified attention vs torch SDPA (cuDNN, flash, efficient) and flash-attn-4, side by side.

Usage (GPU, repo root):
    python3 -m eval.bench_attention [--quick] [--out DIR_OR_CSV] [--block-size 64]

Shapes are Qwen3-style: 32 query / 8 KV heads, D = 128, bf16, causal.
- prefill / training forward: one sequence of 1K, 4K, 16K tokens and 8 packed x 2K;
  SDPA gets [B, H, L, D] tensors (the packed case as a batch of 8) with GQA through
  ``enable_gqa`` (or K/V repeated beforehand where a backend refuses it). TFLOP/s counts
  the causal half: 2 * 2 * L^2 * D * H / 2 per sequence.
- decode: (batch, context) in (1, 8192), (16, 4096), (64, 4096), (64, 128), (1, 128), ours
  on a paged cache, SDPA on a contiguous cache (q [B, H, 1, D]); TB/s of K+V read and its
  fraction of the measured 4.26 TB/s.
- backward (training): dq, dk, dv at 1K and 4K; TFLOP/s with 2.5x the forward flops.
Our calls pass ``validate=False`` (no host read of cu_seqlens / context_lens), as a
per-layer caller does once its batch is validated. Two times per forward case:
- ``us`` (eager): ``do_bench`` medians, L2 cleared before each call; a short kernel also
  pays the host launch path (Python checks + Triton launch) when the host is slower;
- ``us_graph``: kernel time from CUDA-graph replays (what a graph-captured decode step
  or a long prefill pays): a graph of 10 x (L2 flush, call) minus a graph of 10 flushes.
SDPA gets both too (cuDNN and flash; efficient eager only). flash-attn-4 (the CuTe
``flash_attn.cute.flash_attn_varlen_func``, from ``$AREAL_TIK_KERNELS_SITE``) runs on the
packed rows for prefill (eager and graph) and backward (eager): rows ``flash_attn_4`` and
``vs_fa4`` on ours; where it does not import or run, its row holds the error instead of a
time. Ratios are theirs / ours, per column. Writes a long-format CSV (device, versions,
commit, date).
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
from eval.harness import run_info, write_csv  # noqa: E402
from eval.train_baselines import AVAILABLE, add_kernels_site, load_fa4_varlen, why  # noqa: E402

import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import _attention_bwd, _attention_fwd  # noqa: E402
from areal_tik.unified_kernels.attention import (  # noqa: E402
    attention_decode, attention_varlen, store_kv_cache)

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on the H200
PEAK_TBPS = 4.26  # measured device copy (read + write)
HQ, HK, DIM = 32, 8, 128
DEVICE = "cuda"
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
PREFILL = (("1K", [1024]), ("4K", [4096]), ("16K", [16384]), ("8x2K", [2048] * 8))
DECODE = ((1, 8192), (16, 4096), (64, 4096), (64, 128), (1, 128))
BACKWARD = (("1K", [1024]), ("4K", [4096]))
QUICK_PREFILL, QUICK_DECODE, QUICK_BACKWARD = PREFILL[1:2], DECODE[:2], BACKWARD[:1]




FLUSH_BYTES = 128 << 20  # > 2x the H200's 50 MB L2


def graph_us(fn, reps: int = 10, trials: int = 7) -> float:
    """GPU time of one ``fn()`` in microseconds from CUDA-graph replays (no host launch
    cost): median of ``trials`` replays of a graph of ``reps`` x (L2 flush, fn), minus
    the same for a graph of the flushes alone, divided by ``reps``. Each replay is queued
    behind two flushes, so the graph's submission is hidden and the timed span is GPU work."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (compiles, allocator)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = ([], [])
    for trial in range(trials + 1):
        for graph, times in zip(graphs, samples):
            for _ in range(2):  # keep the GPU busy while the host submits the graph
                flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if trial:  # the first replay uploads the graph
                times.append(start.elapsed_time(end))
    med = [sorted(t)[len(t) // 2] for t in samples]
    del graphs
    return max(med[0] - med[1], 0.0) / reps * 1e3


def graph_us_or_nan(fn, **kw) -> float:
    try:
        return graph_us(fn, **kw)
    except RuntimeError as err:  # a backend that cannot be captured: say so, go on
        print(f"    (no CUDA-graph time: {str(err).splitlines()[0][:80]})")
        torch.cuda.synchronize()
        return float("nan")


def timed(fn, rep_ms) -> tuple[float, float, float]:
    """(median, p20, p80) in microseconds."""
    med, p20, p80 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return med * 1e3, p20 * 1e3, p80 * 1e3


def _randn(*shape, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=g).bfloat16()


def _sdpa_variants(q, k, v, causal):
    """{backend: (fn, gqa_mode)} for each SDPA backend that accepts the inputs."""
    f = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    variants = {}
    for name, backend in BACKENDS.items():
        for mode, (kk, vv, kw) in (("enable_gqa", (k, v, {"enable_gqa": True})), ("repeat", (kr, vr, {}))):
            fn = (lambda kk=kk, vv=vv, kw=kw: f(q, kk, vv, is_causal=causal, **kw))
            try:
                with sdpa_kernel([backend]):
                    fn()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()  # surface asynchronous launch errors here
            except RuntimeError:
                continue
            variants[name] = (fn, mode)
            break
    return variants


GRAPH_BACKENDS = ("cudnn", "flash")


def _in_backend(fn, name):
    def call():
        with sdpa_kernel([BACKENDS[name]]):
            return fn()
    return call


def _time_sdpa(variants, rep_ms, graph: bool):
    """{backend: (eager (median, p20, p80), gqa_mode, graph us or nan)}."""
    out = {}
    for name, (fn, mode) in variants.items():
        call = _in_backend(fn, name)
        g = graph_us_or_nan(call) if graph and name in GRAPH_BACKENDS else float("nan")
        out[name] = (timed(call, rep_ms), mode, g)
    return out


def _check_close(ours, variants, what) -> None:
    for fn, _ in variants.values():
        ref = fn().float()
        err = ((ours.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{what}: unified vs SDPA rel err {err:.3g}"
        return


def _row(kind, case, impl, us, info, **extra) -> dict:
    return {"op": "attention", "kind": kind, "case": case, "impl": impl, "us": round(us[0], 3),
            "us_p20": round(us[1], 3), "us_p80": round(us[2], 3),
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in extra.items()}, **info}


def _ratio_rows(kind, case, ours, sdpa, work, unit, info, config, fa4=None):
    """Rows for ours, every SDPA backend and flash-attn-4 (``fa4``: _time_fa4's tuple, or
    the error that skipped it); ratios are their time / ours (> 1: ours faster).
    ``ours`` = (eager (median, p20, p80), graph us or nan)."""
    nan = float("nan")
    best = min((t[0][0] for t in sdpa.values()), default=nan)
    best_g = min((t[2] for t in sdpa.values() if t[2] == t[2]), default=nan)
    flash = sdpa["flash"][0][0] if "flash" in sdpa else nan
    rate = lambda us: work / us * 1e-6  # noqa: E731  (TFLOP/s for flops, TB/s for bytes)
    peak = PEAK_TFLOPS if unit == "tflops" else PEAK_TBPS
    (eager, graph) = ours
    rows = [_row(kind, case, "unified", eager, info, **{
        unit: rate(eager[0]), "frac_peak": rate(eager[0]) / peak, "vs_best_sdpa": best / eager[0],
        "vs_sdpa_flash": flash / eager[0], "us_graph": graph, f"{unit}_graph": rate(graph),
        "vs_best_sdpa_graph": best_g / graph, "config": config,
        **({"vs_fa4": fa4[0][0] / eager[0], "vs_fa4_graph": fa4[2] / graph} if isinstance(fa4, tuple) else {})})]
    for name, (us, mode, g) in sdpa.items():
        rows.append(_row(kind, case, f"sdpa_{name}", us, info, **{
            unit: rate(us[0]), "frac_peak": rate(us[0]) / peak, "gqa": mode, "us_graph": g,
            f"{unit}_graph": rate(g)}))
    if isinstance(fa4, tuple):
        (us, rel_err, g) = fa4
        rows.append(_row(kind, case, "flash_attn_4", us, info, **{
            unit: rate(us[0]), "frac_peak": rate(us[0]) / peak, "gqa": "native", "us_graph": g,
            f"{unit}_graph": rate(g), "rel_err_vs_unified": rel_err}))
    elif fa4 is not None:
        rows.append({"op": "attention", "kind": kind, "case": case, "impl": "flash_attn_4", "error": fa4, **info})
    sd = "  ".join(f"{n} {t[0][0]:7.1f}/{t[2]:7.1f}us" for n, t in sdpa.items())
    if fa4 is not None:
        sd += f"  fa4 {fa4[0][0]:7.1f}/{fa4[2]:7.1f}us" if isinstance(fa4, tuple) else f"  fa4 SKIPPED ({fa4})"
    unit_s = "TF/s" if unit == "tflops" else "TB/s"
    print(f"{kind:>8} {case:>10}  unified eager {eager[0]:7.1f}us graph {graph:7.1f}us "
          f"{rate(graph):6.2f} {unit_s} ({rate(graph) / peak:4.0%})  vs best SDPA: eager "
          f"{rows[0]['vs_best_sdpa']:5.2f}x graph {rows[0]['vs_best_sdpa_graph']:5.2f}x  "
          f"| eager/graph {sd}", flush=True)
    return rows


FA4: dict = {}  # "fn": flash_attn.cute.flash_attn_varlen_func or None, "why": its import error


def load_fa4() -> str:
    """Import flash-attn-4 (CuTe) from the kernels site; "available" or the exact error."""
    add_kernels_site()
    try:
        FA4["fn"] = load_fa4_varlen()
        return AVAILABLE
    except Exception as exc:  # noqa: BLE001  (not installed, or its DSL does not import)
        FA4["fn"], FA4["why"] = None, f"not importable: {why(exc)}"
        return FA4["why"]


def _flat(out) -> torch.Tensor:
    return torch.cat([t.float().flatten() for t in out]) if isinstance(out, tuple) else out.float().flatten()


def _time_fa4(make_call, ours_out, rep_ms, graph: bool, tol: float = 1e-2):
    """flash-attn-4 timed as SDPA is: ((median, p20, p80), rel err vs ours, graph us or
    nan), or the one-line error that skips its cell (not importable, not this GPU, a
    failed compile, a result off ours by more than ``tol`` relative)."""
    if FA4.get("fn") is None:
        return FA4.get("why", "not loaded")
    try:
        call = make_call(FA4["fn"])
        out = call()
        torch.cuda.synchronize()
        ref = _flat(ours_out)
        rel = ((_flat(out) - ref).norm() / ref.norm()).item()
        if not rel < tol:
            return f"rel err {rel:.3g} vs unified (> {tol:g}): not timed"
        g = float("nan")
        if graph:
            try:
                g = graph_us(call)
            except Exception as exc:  # noqa: BLE001  (cannot be captured: eager time only)
                print(f"    (fa4: no CUDA-graph time: {why(exc)[:80]})")
                torch.cuda.synchronize()
        return timed(call, rep_ms), rel, g
    except Exception as exc:  # noqa: BLE001  (its error is the cell)
        return why(exc)


def _fa4_varlen(fn, q, k, v, cu, max_len):
    out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _cfg_name(cfg) -> str:
    return "/".join(f"{k}={v}" for k, v in vars(cfg).items())


def _causal_flops(lengths) -> float:
    return sum(2 * 2 * n * n * DIM * HQ / 2 for n in lengths)


def _packed(lengths, seed):
    T = sum(lengths)
    q, k, v = _randn(T, HQ, DIM, seed=seed), _randn(T, HK, DIM, seed=seed + 1), _randn(T, HK, DIM, seed=seed + 2)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def _as_batch(x, lengths):
    """[T, H, D] packed equal-length sequences -> SDPA's [B, H, L, D]."""
    return x.view(len(lengths), lengths[0], x.shape[1], DIM).transpose(1, 2).contiguous()


def bench_prefill(cases, rep_ms, info) -> list[dict]:
    rows = []
    for name, lengths in cases:
        q, k, v, cu = _packed(lengths, seed=1)
        ours = lambda: attention_varlen(q, k, v, cu, max(lengths), validate=False)  # noqa: E731
        qb, kb, vb = _as_batch(q, lengths), _as_batch(k, lengths), _as_batch(v, lengths)
        variants = _sdpa_variants(qb, kb, vb, causal=True)
        _check_close(_as_batch(ours(), lengths), variants, f"prefill {name}")
        fa4 = _time_fa4(lambda fn: (lambda: _fa4_varlen(fn, q, k, v, cu, max(lengths))), ours(), rep_ms,
                        graph=True)
        rows += _ratio_rows("prefill", name, (timed(ours, rep_ms), graph_us_or_nan(ours)),
                            _time_sdpa(variants, rep_ms, graph=True), _causal_flops(lengths), "tflops",
                            info, _cfg_name(_attention_fwd.attention_config()), fa4)
    return rows


def bench_decode(cases, block_size, rep_ms, info) -> list[dict]:
    rows = []
    for batch, ctx in cases:
        blocks = triton.cdiv(ctx, block_size)
        k, v = _randn(batch * ctx, HK, DIM, seed=3), _randn(batch * ctx, HK, DIM, seed=4)
        q = _randn(batch, HQ, DIM, seed=5)
        kc = torch.empty(batch * blocks + 1, block_size, HK, DIM, dtype=torch.bfloat16, device=DEVICE)
        vc = torch.empty_like(kc)
        tables = torch.randperm(batch * blocks, device=DEVICE).view(batch, blocks).to(torch.int32)
        pos = torch.arange(ctx, device=DEVICE)
        slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
        store_kv_cache(k, v, kc, vc, slots)
        ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        ours = lambda: attention_decode(q, kc, vc, tables, ctx_lens, validate=False)  # noqa: E731
        kb = k.view(batch, ctx, HK, DIM).transpose(1, 2).contiguous()
        vb = v.view(batch, ctx, HK, DIM).transpose(1, 2).contiguous()
        variants = _sdpa_variants(q[:, :, None], kb, vb, causal=False)
        _check_close(ours()[:, :, None], variants, f"decode B={batch} ctx={ctx}")
        kv_bytes = 2.0 * batch * ctx * HK * DIM * 2
        rows += _ratio_rows("decode", f"B{batch}xctx{ctx}", (timed(ours, rep_ms), graph_us_or_nan(ours)),
                            _time_sdpa(variants, rep_ms, graph=True), kv_bytes, "tbps", info,
                            f"block_size={block_size}")
    return rows


def bench_backward(cases, rep_ms, info) -> list[dict]:
    rows = []
    for name, lengths in cases:
        q, k, v, cu = (t.requires_grad_() if t.is_floating_point() else t for t in _packed(lengths, seed=6))
        dout = _randn(*q.shape, seed=7)
        out = attention_varlen(q, k, v, cu, max(lengths), validate=False)
        ours = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        qb, kb, vb = (_as_batch(t.detach(), lengths).requires_grad_() for t in (q, k, v))
        doutb = _as_batch(dout, lengths)
        variants = {}
        for bname, (fn, mode) in _sdpa_variants(qb, kb, vb, causal=True).items():
            with sdpa_kernel([BACKENDS[bname]]):
                o = fn()
            variants[bname] = (lambda o=o: torch.autograd.grad(o, (qb, kb, vb), doutb, retain_graph=True), mode)

        def fa4_grad(fn):
            o = _fa4_varlen(fn, q, k, v, cu, max(lengths))
            return lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
        fa4 = _time_fa4(fa4_grad, ours(), rep_ms, graph=False, tol=2e-2)  # bf16 dq/dk/dv sums
        rows += _ratio_rows("backward", name, (timed(ours, rep_ms), float("nan")),
                            _time_sdpa(variants, rep_ms, graph=False),
                            2.5 * _causal_flops(lengths), "tflops", info,
                            _cfg_name(_attention_bwd.attention_bwd_config()), fa4)
    return rows


def summarize(rows) -> None:
    goals = (("prefill", "vs_sdpa_flash", 1.0), ("decode", "vs_best_sdpa", 0.9),
             ("decode", "vs_best_sdpa_graph", 0.9), ("prefill", "vs_best_sdpa_graph", 0.8),
             ("backward", "vs_best_sdpa", 0.7))
    for kind, key, target in goals:
        vals = [r[key] for r in rows if r["kind"] == kind and r["impl"] == "unified" and r[key] == r[key]]
        if vals:
            print(f"{kind}: {key} min {min(vals):.2f} max {max(vals):.2f}; "
                  f"{sum(v >= target for v in vals)}/{len(vals)} meet {target}x")
    for kind in ("prefill", "backward"):
        vals = [r["vs_fa4"] for r in rows if r["kind"] == kind and r["impl"] == "unified" and "vs_fa4" in r]
        if vals:
            print(f"{kind}: vs flash-attn-4 (eager) min {min(vals):.2f} max {max(vals):.2f}")
        for err in dict.fromkeys(r["error"] for r in rows
                                 if r["kind"] == kind and r["impl"] == "flash_attn_4" and "error" in r):
            print(f"{kind}: flash-attn-4 skipped: {err}")
    cudnn = {r["case"]: r for r in rows if r["kind"] == "prefill" and r["impl"] == "sdpa_cudnn"}
    for r in rows:
        if r["kind"] == "prefill" and r["impl"] == "unified" and r["case"] in cudnn:
            c = cudnn[r["case"]]
            print(f"prefill {r['case']}: vs cuDNN eager {c['us'] / r['us']:.2f}x, "
                  f"graph {c['us_graph'] / r['us_graph']:.2f}x (target 0.8x)")




def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--quick", action="store_true", help="small subset, < 60 s")
    parser.add_argument("--block-size", type=int, default=64, help="paged KV block size for decode")
    parser.add_argument("--rep-ms", type=int, default=60, help="do_bench repetition time per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    # SDPA explains every backend it refuses with a UserWarning; the CSV records which ran.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", message=".*kernel not used because.*")
    warnings.filterwarnings("ignore", message=".*both fused kernels require.*")
    warnings.filterwarnings("ignore", message=".*has been runtime disabled.*")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}")
    print(f"flash-attn-4 (CuTe varlen, prefill and backward): {load_fa4()}")
    print(f"forward config {_cfg_name(_attention_fwd.attention_config())}; "
          f"backward {_cfg_name(_attention_bwd.attention_bwd_config())}")
    quick = args.quick
    rows = bench_prefill(QUICK_PREFILL if quick else PREFILL, args.rep_ms, info)
    rows += bench_decode(QUICK_DECODE if quick else DECODE, args.block_size, args.rep_ms, info)
    rows += bench_backward(QUICK_BACKWARD if quick else BACKWARD, args.rep_ms, info)
    summarize(rows)
    print(f"wrote {write_csv(rows, args.out, 'bench_attention.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

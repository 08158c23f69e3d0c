"""Benchmark: unified rms_norm / add_rms_norm / apply_rope / silu_mul vs torch eager.

Usage (GPU, repo root):
    python3 -m eval.bench_pointwise [--quick] [--sweep] [--timer graph|events] [--out DIR_OR_CSV]
    python3 -m eval.bench_pointwise --aot [--check]   # no GPU needed: compile for sm_90a

Times, side by side in one process, the unified kernels and the standard torch path
(``reference.*`` with ``compute=None``: the Hugging Face formulas in eager torch ops) at
the shapes of Qwen3-0.6B, Qwen3-1.7B and Llama-3.2-1B for 1..16384 tokens. For rope and
SwiGLU it also times the exact Hugging Face code (``q * cos + rotate_half(q) * sin`` with
per-forward bf16 cos/sin, and ``F.silu(gate) * up``); ratios are taken against the
faster torch variant (> 1 means unified is faster). Two times per implementation:

- ``us``, device time: calls shorter than ~200 us are replayed from a CUDA graph (as the
  rollout engine runs decode), cycling through copies of the inputs larger than the L2
  cache, so no host launch overhead enters and data comes from HBM; longer calls use
  ``triton.testing.do_bench`` (L2 cleared before each call). ``--timer events`` uses
  do_bench for everything. (The first run used do_bench alone: its small-token numbers
  were host overhead racing do_bench's L2 clear, not kernel time; e.g. rms_norm H=2048
  read 8.1 us at T=8 for one model and 47.2 us for another, same kernel and shape.)
- ``eager_us``: up to 100 back-to-back eager calls between two events; per call the
  larger of the host's Python + launch cost and the device time (an eager caller's cost).

Bandwidth counts every input read once and every output written once, as a fraction
of the measured 4.26 TB/s device copy and, from 1024 tokens, of a same-size device copy
timed the same way (``copy``). ``--sweep`` times every launch geometry in
``norm_candidates`` / ``rope_candidates`` / ``silu_candidates`` at 4096 and 16384 tokens,
marks those whose bits differ from the table's (``*``; only norm geometries that put
another number of warps on a row can), and proposes a table: per shape the geometry with
the least total time, and the best one that keeps the table's bits.

``--aot`` (no GPU) compiles the table's kernels and the norm candidates for sm_90a and
prints, per geometry, the norm's per-row reduction layout (values per thread, lanes and
warps along the row), registers, spills and load/store vector widths; ``--check`` exits
1 unless every norm table entry reduces a row with the layout of the geometry of the
first GPU run (``EARLIER_NORM``, so no output bit should move; update it when a table
change is meant to move bits) and no table kernel spills.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--aot" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreter ones

import torch

REPO = Path(__file__).resolve().parents[1]
from eval.harness import event_us, graph_times, run_info, write_csv  # noqa: E402

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from areal_tik.unified_kernels import bitwise_equal  # noqa: E402
from areal_tik.unified_kernels import reference as R  # noqa: E402

NORM = importlib.import_module("areal_tik.unified_kernels.rms_norm")
ROPE = importlib.import_module("areal_tik.unified_kernels.rope")
SILU = importlib.import_module("areal_tik.unified_kernels.swiglu")

PEAK_TBPS = 4.26  # measured device copy (read + write) on the H200
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK_TOKENS = (1, 1024, 16384)
GRAPH_MAX_US = 200.0  # calls up to this long are timed from a CUDA graph
ROTATE_BYTES = 2 * 60 * 2 ** 20  # > 2x the H200's 50 MiB L2
EAGER_CALLS = 100
COPY_MIN_TOKENS = 1024  # a same-size copy is timed from here
BIG_TOKENS = 4096  # the bandwidth target applies from here
MAX_POS = 40960
EPS = 1e-6
# model: (hidden, q heads, kv heads, head_dim, intermediate, per-head q/k norm)
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, True),
    "llama-3.2-1b": (2048, 32, 8, 64, 8192, False),
}
DEVICE = "cuda"
SWEEP_TOKENS = (4096, 16384)
SWEEP_NORM = (("rms_norm", 128, 16), ("add_rms_norm", 1024, 1), ("add_rms_norm", 2048, 1),
              ("add_rms_norm", 4096, 1))  # (op, H, rows per token)
SWEEP_ROPE = ((16, 8, 128), (32, 8, 64))
SWEEP_SILU = (3072, 6144, 8192)






def time_fns(fns, nbytes: float, rep_ms: int, timer: str, eager: bool = True) -> dict:
    """Device time of ``fns[0]``'s call (cycling through ``fns``' input copies) and,
    if ``eager``, the per-call time of back-to-back eager calls."""
    fn = fns[0]
    fn()
    torch.cuda.synchronize()
    est = event_us(fn, 3)
    res = {}
    if eager:
        calls = int(min(EAGER_CALLS, max(5, rep_ms * 1e3 / 3 / est)))
        res["eager_us"] = statistics.median(event_us(fn, calls) for _ in range(3))
    if timer == "graph" and est < GRAPH_MAX_US:
        times = sorted(graph_times(fns, est, rep_ms))
        us, p20, p80, used = statistics.median(times), times[1], times[-2], "graph"
    else:
        med, p20, p80 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        us, p20, p80, used = med * 1e3, p20 * 1e3, p80 * 1e3, "events"
    tbps = nbytes / us * 1e-6
    return {"us": us, "us_p20": p20, "us_p80": p80, **res, "tbps": tbps,
            "frac_peak_bw": tbps / PEAK_TBPS, "timer": used}


def copies_for(nbytes: float) -> int:
    return max(1, min(32, math.ceil(ROTATE_BYTES / nbytes)))


_COPY_US: dict[int, float] = {}


def copy_us(nbytes: int, rep_ms: int, timer: str) -> float:
    """Device time of a same-size copy (nbytes / 2 read, nbytes / 2 written)."""
    half = int(nbytes) // 2
    if half not in _COPY_US:
        pairs = [(torch.empty(half, dtype=torch.uint8, device=DEVICE),
                  torch.empty(half, dtype=torch.uint8, device=DEVICE)) for _ in range(copies_for(nbytes))]
        fns = [lambda d=d, s=s: d.copy_(s) for d, s in pairs]
        _COPY_US[half] = time_fns(fns, nbytes, rep_ms, timer, eager=False)["us"]
    return _COPY_US[half]


# ------------------------------------------------------------------------------ cases


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, cos_full, sin_full):
    """Hugging Face apply_rotary_pos_emb (cos/sin [T, D] in the activation dtype)."""
    c, s = cos_full[:, None], sin_full[:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


_TABLES: dict[int, tuple] = {}


def tables(d: int):
    if d not in _TABLES:
        _TABLES[d] = ROPE.rope_cos_sin(MAX_POS, d, 1e6, device=DEVICE)
    return _TABLES[d]


def _randn(*shape, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=g).to(torch.bfloat16)


def cases(model: str, t: int):
    """Yield (op, shape text, bytes moved, make) for one model and token count, where
    ``make(seed)`` builds fresh inputs and returns {impl: zero-argument callable}."""
    hidden, hq, hk, d, inter, qk_norm = MODELS[model]
    es = 2  # bytes per bf16 element
    w = (1 + 0.1 * _randn(hidden, seed=99).float()).to(torch.bfloat16)
    wd = (1 + 0.1 * _randn(d, seed=98).float()).to(torch.bfloat16)

    def norm(x, weight):
        return {"unified": lambda: NORM.rms_norm(x, weight, EPS),
                "torch": lambda: R.rms_norm(x, weight, EPS, compute=None)}

    def add_norm(seed):
        x, res = _randn(t, hidden, seed=seed), _randn(t, hidden, seed=seed + 1000)
        return {"unified": lambda: NORM.add_rms_norm(x, res, w, EPS),
                "torch": lambda: R.add_rms_norm(x, res, w, EPS, compute=None)}

    def rope(seed):
        q, k = _randn(t, hq, d, seed=seed), _randn(t, hk, d, seed=seed + 1000)
        pos = torch.randint(0, MAX_POS, (t,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))
        cos, sin = tables(d)
        cos_full = torch.cat([cos, cos], -1)[pos].to(torch.bfloat16)  # HF builds these once per forward
        sin_full = torch.cat([sin, sin], -1)[pos].to(torch.bfloat16)
        return {"unified": lambda: ROPE.apply_rope(q, k, pos, cos, sin),
                "torch": lambda: R.apply_rope(q, k, pos, cos, sin, compute=None),
                "torch_hf": lambda: hf_rope(q, k, cos_full, sin_full)}

    def silu(seed):
        gu = _randn(t, 2 * inter, seed=seed)
        return {"unified": lambda: SILU.silu_mul(gu), "torch": lambda: R.silu_mul(gu, compute=None),
                "torch_hf": lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]}

    yield "rms_norm", f"H={hidden}", 2 * t * hidden * es + hidden * es, lambda seed: norm(_randn(t, hidden, seed=seed), w)
    yield "add_rms_norm", f"H={hidden}", 4 * t * hidden * es + hidden * es, add_norm
    if qk_norm:
        yield ("rms_norm_head", f"[T,{hq},{d}]", 2 * t * hq * d * es + d * es,
               lambda seed: norm(_randn(t, hq, d, seed=seed), wd))
    rope_bytes = 2 * t * (hq + hk) * d * es + t * 8 + 2 * t * (d // 2) * 4
    yield "apply_rope", f"q[T,{hq},{d}] k[T,{hk},{d}]", rope_bytes, rope
    yield "silu_mul", f"I={inter}", 3 * t * inter * es, silu


def _sanity(op, fns) -> None:
    """The unified result agrees with the torch path to bf16 accuracy (not a bit check)."""
    ours, ref = fns["unified"](), fns["torch"]()
    ours, ref = (ours, ref) if isinstance(ours, tuple) else ((ours,), (ref,))
    for a, b in zip(ours, ref):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        assert err < 1e-2, f"{op}: unified vs torch rel err {err:.3g}"


def bench_model(model, tokens, rep_ms, timer, info) -> list[dict]:
    rows = []
    for t in tokens:
        with torch.no_grad():
            for op, shape, nbytes, make in cases(model, t):
                sets = [make(seed) for seed in range(copies_for(nbytes))]
                _sanity(op, sets[0])
                timed = {impl: time_fns([s[impl] for s in sets], nbytes, rep_ms, timer) for impl in sets[0]}
                del sets
                if t >= COPY_MIN_TOKENS:
                    cus = copy_us(nbytes, rep_ms, timer)
                    timed["copy"] = {"us": cus, "tbps": nbytes / cus * 1e-6, "frac_peak_bw": nbytes / cus * 1e-6 / PEAK_TBPS}
                rows += _report(model, op, shape, t, timed, info)
    return rows


def _report(model, op, shape, t, timed, info) -> list[dict]:
    u = timed["unified"]
    torch_impls = [k for k in timed if k.startswith("torch")]
    ratio = min(timed[k]["us"] for k in torch_impls) / u["us"]
    eager_ratio = min(timed[k]["eager_us"] for k in torch_impls) / u["eager_us"]
    vs_copy = timed["copy"]["us"] / u["us"] if "copy" in timed else None
    others = "  ".join(f"{k} {timed[k]['us']:7.1f} ({timed[k]['eager_us']:6.1f})" for k in torch_impls)
    copy_txt = f", {vs_copy:4.0%} of copy" if vs_copy is not None else ""
    print(f"{model:>12} {op:>13} {shape:>22} T={t:<6} unified {u['us']:7.1f} ({u['eager_us']:6.1f}) us  "
          f"{others}  ratio {ratio:5.2f} eager {eager_ratio:5.2f}  {u['tbps']:5.2f} TB/s "
          f"({u['frac_peak_bw']:4.0%}{copy_txt})", flush=True)
    extra = {"speed_vs_torch": round(ratio, 4), "eager_speed_vs_torch": round(eager_ratio, 4),
             "frac_copy": "" if vs_copy is None else round(vs_copy, 4)}
    return [_row(op, shape, model, t, impl, res, info, "", extra if impl == "unified" else {})
            for impl, res in timed.items()]


def _row(op, shape, model, t, impl, res, info, config="", extra=None) -> dict:
    return {"op": op, "shape": shape, "model": model, "tokens": t, "impl": impl, "config": config,
            **{key: (round(val, 4) if isinstance(val, float) else val) for key, val in res.items()},
            **(extra or {}), **info}


def summarize(rows) -> None:
    """Targets: never slower than torch; >= 70% of copy bandwidth at >= 4096 tokens."""
    uni = [r for r in rows if r["impl"] == "unified"]
    if not uni:
        return
    for key, label in (("speed_vs_torch", "device-time"), ("eager_speed_vs_torch", "eager")):
        slower = [r for r in uni if r[key] < 1.0]
        print(f"{label} ratio vs torch: min {min(r[key] for r in uni):.2f}; "
              f"{len(uni) - len(slower)}/{len(uni)} cases at least as fast")
        for op in dict.fromkeys(r["op"] for r in slower):
            print(f"  slower ({label}) {op}: " + ", ".join(
                f"{r['model']} T={r['tokens']} {r[key]:.2f}" for r in slower if r["op"] == op))
    big = [r for r in uni if r["tokens"] >= BIG_TOKENS]
    for op in dict.fromkeys(r["op"] for r in big):
        fr = [r["frac_peak_bw"] for r in big if r["op"] == op]
        fc = [r["frac_copy"] for r in big if r["op"] == op]
        print(f"{op:>13} at >= {BIG_TOKENS} tokens: {min(fr):.0%}..{max(fr):.0%} of 4.26 TB/s "
              f"({sum(f >= 0.7 for f in fr)}/{len(fr)} >= 70%); {min(fc):.0%}..{max(fc):.0%} of a "
              f"same-size copy")


# ------------------------------------------------------------------------------ sweep


def _sweep_shape(label, candidates, make_run, nbytes, rep_ms, timer, info, rows) -> dict:
    """Time every candidate at every sweep token count; returns {cfg: (total us, same bits)}."""
    total, same = {c: 0.0 for c in candidates}, {c: True for c in candidates}
    for t in SWEEP_TOKENS:
        runs = [make_run(t, seed) for seed in range(copies_for(nbytes(t)))]
        want = runs[0](candidates[0])
        line = []
        for cfg in candidates:
            same[cfg] &= all(bitwise_equal(a, b) for a, b in zip(_tensors(runs[0](cfg)), _tensors(want)))
            res = time_fns([lambda run=run, cfg=cfg: run(cfg) for run in runs], nbytes(t), rep_ms, timer, eager=False)
            total[cfg] += res["us"]
            rows.append(_row(f"sweep_{label.split()[0]}", label, "", t, "unified", res, info, cfg.name))
            line.append(f"{cfg.name} {res['us']:.1f}{'' if same[cfg] else '*'} ({res['frac_peak_bw']:.0%})")
        del runs
        print(f"sweep {label} T={t:<6} " + "  ".join(line), flush=True)
    return {c: (total[c], same[c]) for c in candidates}


def _tensors(x):
    return [t for t in (x if isinstance(x, tuple) else (x,)) if t is not None]


def sweep(rep_ms, timer, info, deadline) -> list[dict]:
    rows, proposals = [], []

    def norm_run(op, hidden, per_token):  # -> make(t, seed) -> run(cfg)
        w = (1 + 0.1 * _randn(hidden, seed=97).float()).to(torch.bfloat16)
        return lambda t, seed: functools.partial(
            NORM._forward, _randn(t * per_token, hidden, seed=seed),
            _randn(t * per_token, hidden, seed=seed + 1000) if op == "add_rms_norm" else None, w, EPS)

    def rope_run(hq, hk, d):
        return lambda t, seed: functools.partial(
            ROPE._launch, _randn(t, hq, d, seed=seed), _randn(t, hk, d, seed=seed + 1000),
            torch.randint(0, MAX_POS, (t,), device=DEVICE), *tables(d), False)

    jobs = [(f"{op} H={h}", NORM.norm_candidates(h), norm_run(op, h, k),
             lambda t, h=h, k=k, op=op: (4 if op == "add_rms_norm" else 2) * t * k * h * 2) for op, h, k in SWEEP_NORM]
    jobs += [(f"apply_rope {hq}/{hk}/{d}", ROPE.rope_candidates(hq, hk, d), rope_run(hq, hk, d),
              lambda t, hq=hq, hk=hk, d=d: 4 * t * (hq + hk) * d + 8 * t + 4 * t * d) for hq, hk, d in SWEEP_ROPE]
    jobs += [(f"silu_mul I={i}", SILU.silu_candidates(i),
              lambda t, seed, i=i: functools.partial(SILU._forward, _randn(t, 2 * i, seed=seed)),
              lambda t, i=i: 6 * t * i) for i in SWEEP_SILU]
    with torch.no_grad():
        for label, candidates, make_run, nbytes in jobs:
            if time.time() > deadline:
                print(f"sweep {label}: skipped (time budget)", flush=True)
                continue
            res = _sweep_shape(label, candidates, make_run, nbytes, rep_ms, timer, info, rows)
            best = min(res, key=lambda c: res[c][0])
            best_same = min((c for c in res if res[c][1]), key=lambda c: res[c][0])
            table_us = res[candidates[0]][0]
            proposals.append(f"  {label:<26} table {candidates[0].name:<9} | fastest {best.name:<9} "
                             f"{table_us / res[best][0]:4.2f}x{'' if res[best][1] else ' (other bits)'} | "
                             f"fastest with the table's bits {best_same.name:<9} {table_us / res[best_same][0]:4.2f}x")
    print("sweep summary (speed-up over the table's geometry, summed over T = "
          f"{'/'.join(map(str, SWEEP_TOKENS))}):")
    print("\n".join(proposals))
    return rows


# ------------------------------------------------------------------------ AOT (no GPU)

EARLIER_NORM = {128: (16, 4), 1024: (2, 4), 2048: (1, 4), 4096: (1, 8)}  # (rows, warps), first run


def _aot(fn, types: dict, const: dict, num_warps: int) -> tuple[str, str, int, int]:
    """Compile ``fn`` for sm_90a with 16-byte aligned pointers and strides: (ttgir, ptx,
    registers, spilled bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in const else types.get(name, "i32")
        if name not in const and (name.endswith("_ptr") or name.startswith("stride") or name == "max_pos"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return (kernel.asm["ttgir"], kernel.asm["ptx"], int(re.search(r"Used (\d+) registers", info).group(1)),
            int(spill.group(1)) if spill else 0)


def _vectors(ptx) -> str:
    return "ld " + "/".join(sorted(set(re.findall(r"ld\.global(?:\.\w+)*?\.(v\d)\.", ptx)))) + \
        " st " + "/".join(sorted(set(re.findall(r"st\.global(?:\.\w+)*?\.(v\d)\.", ptx))))


def _row_layout(ttgir) -> tuple[int, int, int]:
    """(values per thread, lanes, warps) along the row of the sum-of-squares ``tl.sum``."""
    name = re.search(r"\}\) : \(tensor<\d+x\d+xf32, (#\w+)>\) -> tensor<\d+xf32, #ttg\.slice<\{dim = 1", ttgir)
    lay = re.search(rf"^{name.group(1)} = #ttg\.blocked<\{{sizePerThread = \[\d+, (\d+)\], "
                    r"threadsPerWarp = \[\d+, (\d+)\], warpsPerCTA = \[\d+, (\d+)\]", ttgir, re.M)
    return tuple(int(v) for v in lay.groups())


def _aot_norm(hidden, cfg, dtype="*bf16", residual=True):
    types = {n: dtype for n in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "s_ptr")}
    const = dict(H=hidden, BLOCK=cfg.block, N_CHUNKS=cfg.n_chunks, ROWS=cfg.rows, HAS_RESIDUAL=residual,
                 EMULATE_RNE=False)
    return _aot(NORM._rms_norm_fwd_kernel, {**types, "eps": "fp32"}, const, cfg.num_warps)


def aot_main(check: bool) -> int:
    failures = []
    for hidden, (rows, warps) in EARLIER_NORM.items():
        table = NORM.norm_config(hidden)
        earlier = NORM.NormConfig(table.block, 1, rows, warps)
        for dtype in ("*bf16", "*fp32"):
            for residual in (False, True):
                got, want = _row_layout(_aot_norm(hidden, table, dtype, residual)[0]), \
                    _row_layout(_aot_norm(hidden, earlier, dtype, residual)[0])
                if got != want:
                    failures.append(f"H={hidden} {dtype} residual={residual}: table {table.name} row "
                                    f"layout {got} != earlier {earlier.name} {want}")
        if check:
            continue
        base = _row_layout(_aot_norm(hidden, table)[0])
        for cfg in NORM.norm_candidates(hidden):
            ir, ptx, regs, spill = _aot_norm(hidden, cfg)
            lay = _row_layout(ir)
            print(f"norm H={hidden:<5} {cfg.name:<8} row layout {lay}{'' if lay == base else ' *'}  regs {regs} "
                  f"spill {spill}  {_vectors(ptx)}")
    kernels = [(f"norm H={h} {NORM.norm_config(h).name}", _aot_norm(h, NORM.norm_config(h))) for h in EARLIER_NORM]
    for hq, hk, d in SWEEP_ROPE:
        cfg = ROPE.rope_config(hq, hk, d)
        half = d // 2
        const = dict(HQ=hq, HK=hk, HALF=half, BLOCK_HQ=ROPE._pow2(hq), BLOCK_HK=ROPE._pow2(hk),
                     BLOCK_HALF=ROPE._pow2(half), TOKENS=cfg.tokens, BACKWARD=False, EMULATE_RNE=False)
        types = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr")}, "pos_ptr": "*i64",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        kernels.append((f"rope {hq}/{hk}/{d} {cfg.name}", _aot(ROPE._rope_kernel, types, const, cfg.num_warps)))
    for inter in SWEEP_SILU:
        cfg = SILU.silu_config(inter)
        kernels.append((f"silu I={inter} {cfg.name}", _aot(SILU._silu_mul_fwd_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"},
                                                            dict(I=inter, BLOCK=cfg.block, EMULATE_RNE=False), cfg.num_warps)))
    for name, (_, ptx, regs, spill) in kernels:
        print(f"table {name:<28} regs {regs:<3} spill {spill}  {_vectors(ptx)}")
        if spill:
            failures.append(f"{name}: {spill} bytes spilled")
    print("\n".join(failures) if failures else "aot check: table row layouts equal the first run's; no spills")
    return 1 if failures else 0




def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--quick", action="store_true", help="one model, three token counts, < 60 s")
    parser.add_argument("--sweep", action="store_true", help="also time the launch geometry candidates")
    parser.add_argument("--timer", choices=("graph", "events"), default="graph",
                        help="graph: CUDA-graph replay for calls < 200 us (default); events: do_bench")
    parser.add_argument("--rep-ms", type=int, default=25, help="timing budget per implementation")
    parser.add_argument("--budget-s", type=float, default=110.0, help="the sweep skips shapes past this")
    parser.add_argument("--aot", action="store_true", help="compile for sm_90a only (no GPU needed)")
    parser.add_argument("--check", action="store_true", help="with --aot: exit 1 on a layout change or spill")
    args = parser.parse_args(argv)
    if args.aot:
        raise SystemExit(aot_main(args.check))
    if not torch.cuda.is_available():
        raise SystemExit("bench_pointwise needs a CUDA GPU")
    info, start = run_info(), time.time()
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['commit']}  "
          f"timer {args.timer}; times: device us (eager us per back-to-back call)")
    models, tokens = (("qwen3-0.6b",), QUICK_TOKENS) if args.quick else (tuple(MODELS), TOKENS)
    rows = []
    for model in models:
        rows += bench_model(model, tokens, args.rep_ms, args.timer, info)
    summarize(rows)
    print(f"main part: {time.time() - start:.0f} s", flush=True)
    if args.sweep:
        rows += sweep(max(10, args.rep_ms // 2), args.timer, info, start + args.budget_s)
    print(f"wrote {write_csv(rows, args.out, 'bench_pointwise.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Probe attention kernel configs: kernel time of each candidate, and prefill == decode bits.

Usage:
    python3 -m eval.probe_attention            # GPU: forward and backward candidates, < 150 s
    python3 -m eval.probe_attention --aot      # no GPU needed: compile for sm_90a, print
                                               # registers / spills / shared memory
    python3 -m eval.probe_attention --aot --check   # default configs only; exit 1 if a
                                               # kernel fails to compile or prefill and
                                               # decode differ in MMA layout or float ops

The forward config (block_m, block_n, num_warps, kv_split) fixes the numerics; the other
fields (prefill sub-tiles, stages, unmasked loop) only schedule. Each GPU candidate is
timed from CUDA-graph replays (kernel time, no host launch cost, L2 flushed): prefill 4K
and 16K, decode (1, 8192), (4, 16384), (16, 4096), (64, 4096) with distinct cache blocks
per sequence; and checked bitwise: rows of a 4500-token prefill == paged decode at KV
split and tile boundaries, alone and batched, and == the first candidate with the same
numerics (so sub-tiles, stages and the unmasked loop are shown to change no bits).
Backward candidates are timed at 4K and 8 x 2K (eager: long kernels) and compared with
the default's gradients. Pick the best row, then set GPU_CONFIG / GPU_BWD_CONFIG.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if "--aot" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreter ones

import torch  # noqa: E402
import triton  # noqa: E402

from areal_tik.unified_kernels import _attention_bwd as B  # noqa: E402
from areal_tik.unified_kernels import _attention_fwd as F  # noqa: E402
from areal_tik.unified_kernels import attention as A  # noqa: E402

_D = F.GPU_CONFIG
_r = dataclasses.replace
FWD_CANDIDATES = (  # most informative first: the budget may cut the tail
    _D,
    _r(_D, prefill_tma=False),  # pointer loads of whole K/V tiles (the default before round 5): scheduling only
    _r(_D, kv_split=512),
    _r(_D, kv_split=2048),
    _r(_D, prefill_pack_heads=1, prefill_order_chunk=0),  # the launch before audit a0009 promoted packing
    _r(_D, prefill_subtiles=1, prefill_pack_heads=1),  # same numerics as the default: bits must match it
    _r(_D, kv_split=2048, prefill_subtiles=1, prefill_pack_heads=1, prefill_order_chunk=0),  # an older default
    _r(_D, stages_prefill=4),
    _r(_D, stages_decode=4),
    _r(_D, stages_prefill=2, stages_decode=2),
    _r(_D, unmasked_loop=False),
)
BWD_CANDIDATES = (
    B.GPU_BWD_CONFIG,
    B.BwdConfig(32, 64, 64, 32, 4, 3, 4, 3),
    B.BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
    B.BwdConfig(64, 128, 128, 32, 8, 2, 4, 3),
    B.BwdConfig(32, 128, 128, 64, 8, 2, 8, 3),
)
HQ, HK, DIM = 32, 8, 128
DEVICE = "cuda"
CHECK_LEN = 4500  # prefill length of the bitwise check (crosses splits of 512 .. 4096)
CHECK_ROWS = (0, 63, 64, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 3071, 3072, 4095, 4096,
              CHECK_LEN - 1)
PREFILL_LENS = (4096, 16384)
DECODE_CASES = ((1, 8192), (4, 16384), (16, 4096), (64, 4096))
BWD_CASES = (("4K", [4096]), ("8x2K", [2048] * 8))
BUDGET_S = 120  # stop starting new candidates after this (the run allows 150 s)


def _name(cfg) -> str:
    return "/".join(str(v) for v in vars(cfg).values())


# ----------------------------------------------------------------------------- GPU probe


def _randn(*shape, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=g).bfloat16()


def _paged(ks, vs, block_size=64, seed=0):
    """Sequences' K/V in shuffled, distinct blocks of one NaN-poisoned cache; one table row each."""
    need = [triton.cdiv(k.shape[0], block_size) for k in ks]
    width = max(need)
    kc = torch.full((sum(need) + 4, block_size, HK, DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vc = kc.clone()
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    order = torch.randperm(kc.shape[0], device=DEVICE, generator=g).to(torch.int32)
    tables = torch.zeros((len(ks), width), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, (k, v, n) in enumerate(zip(ks, vs, need)):
        tables[i, :n] = order[used:used + n]
        used += n
        pos = torch.arange(k.shape[0], device=DEVICE)
        A.store_kv_cache(k, v, kc, vc, tables[i].long()[pos // block_size] * block_size + pos % block_size)
    return kc, vc, tables


class Inputs:
    """Probe inputs, built once and shared by every candidate."""

    def __init__(self):
        L = CHECK_LEN
        self.check = (_randn(L, HQ, DIM, seed=1), _randn(L, HK, DIM, seed=2), _randn(L, HK, DIM, seed=3))
        self.check_cache = _paged([self.check[1]], [self.check[2]])
        self.prefill = {n: (_randn(n, HQ, DIM, seed=4), _randn(n, HK, DIM, seed=5), _randn(n, HK, DIM, seed=6),
                            torch.tensor([0, n], dtype=torch.int32, device=DEVICE)) for n in PREFILL_LENS}
        self.decode = {}
        for batch, ctx_len in DECODE_CASES:
            k, v = _randn(batch * ctx_len, HK, DIM, seed=7), _randn(batch * ctx_len, HK, DIM, seed=8)
            kc, vc, tables = _paged(list(k.split(ctx_len)), list(v.split(ctx_len)))
            ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device=DEVICE)
            self.decode[batch, ctx_len] = (_randn(batch, HQ, DIM, seed=9), kc, vc, tables, ctx)


def check_bits(cfg, inp: Inputs):
    """(prefill rows == paged decode rows, the prefill output)."""
    q, k, v = inp.check
    L = q.shape[0]
    full = A.attention_varlen(q, k, v, torch.tensor([0, L], dtype=torch.int32, device=DEVICE), L, config=cfg)
    kc, vc, table = inp.check_cache
    picks = list(CHECK_ROWS)
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=DEVICE)
    tables = table.expand(len(picks), -1).contiguous()
    batched = A.attention_decode(q[picks], kc, vc, tables, ctx, config=cfg)
    ok = torch.equal(batched.view(torch.int16), full[picks].view(torch.int16))
    for i in (0, len(picks) // 2, len(picks) - 1):
        alone = A.attention_decode(q[picks[i]:picks[i] + 1], kc, vc, tables[:1], ctx[i:i + 1], config=cfg)
        ok &= torch.equal(alone.view(torch.int16), full[picks[i]:picks[i] + 1].view(torch.int16))
    return bool(ok), full


def probe_forward(cfg, inp: Inputs) -> dict:
    from eval.bench_attention import graph_us

    res = {}
    for n, (q, k, v, cu) in inp.prefill.items():
        us = graph_us(lambda: A.attention_varlen(q, k, v, cu, n, validate=False, config=cfg), reps=3)
        res[f"pre{n // 1024}K TF/s"] = 2 * n * n * DIM * HQ / us * 1e-6
    for (batch, ctx_len), (q, kc, vc, tables, ctx) in inp.decode.items():
        res[f"dec{batch}x{ctx_len // 1024}K us"] = graph_us(
            lambda: A.attention_decode(q, kc, vc, tables, ctx, validate=False, config=cfg))
    return res


def probe_backward(cfg, lengths, reference) -> tuple[dict, tuple]:
    T = sum(lengths)
    q, k, v = (t.requires_grad_() for t in (_randn(T, HQ, DIM, seed=10), _randn(T, HK, DIM, seed=11),
                                             _randn(T, HK, DIM, seed=12)))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    dout = _randn(T, HQ, DIM, seed=13)
    out = A.attention_varlen(q, k, v, cu, max(lengths), bwd_config=cfg)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    us = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                 warmup=5, rep=30) * 1e3
    err = 0.0
    if reference is not None:
        err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(grads, reference))
    flops = sum(2.5 * 2 * n * n * DIM * HQ for n in lengths)
    return {"TF/s": flops / us * 1e-6, "us": us, "rel err vs default": err}, grads


def gpu_main() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    inp = Inputs()
    print("forward (kernel time from CUDA graphs): " + "/".join(f.name for f in dataclasses.fields(F.FwdConfig)))
    by_numerics = {}  # configs with the same numerics must agree bit for bit
    for cfg in FWD_CANDIDATES:
        start = time.time()
        if start - t0 > BUDGET_S * 0.65:
            print(f"  {_name(cfg):34s} skipped: time budget", flush=True)
            continue
        try:
            res, (bits, out) = probe_forward(cfg, inp), check_bits(cfg, inp)
        except Exception as err:  # noqa: BLE001  (a candidate that does not fit: report it, go on)
            print(f"  {_name(cfg):34s} failed: {str(err).splitlines()[0][:100]}", flush=True)
            continue
        key = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.kv_split)
        first = by_numerics.setdefault(key, (cfg, out))
        same = torch.equal(out.view(torch.int16), first[1].view(torch.int16))
        cols = "  ".join(f"{k} {v:6.1f}" for k, v in res.items())
        print(f"  {_name(cfg):34s} {cols}  prefill==decode {'YES' if bits else 'NO'}  "
              f"bits==[{_name(first[0])}] {'YES' if same else 'NO'}  ({time.time() - start:.0f} s)", flush=True)
    del inp
    torch.cuda.empty_cache()
    print("backward (eager do_bench): " + "/".join(f.name for f in dataclasses.fields(B.BwdConfig)))
    references = {}
    for cfg in BWD_CANDIDATES:
        for case, lengths in BWD_CASES:
            if time.time() - t0 > BUDGET_S:
                print(f"  {_name(cfg):34s} {case:5s} skipped: time budget", flush=True)
                continue
            try:
                res, grads = probe_backward(cfg, lengths, references.get(case))
            except Exception as err:  # noqa: BLE001  (a candidate that does not fit: report it, go on)
                print(f"  {_name(cfg):34s} {case:5s} failed: {str(err).splitlines()[0][:100]}", flush=True)
                continue
            references.setdefault(case, grads)
            print(f"  {_name(cfg):34s} {case:5s} " + "  ".join(f"{k} {v:8.3g}" for k, v in res.items()), flush=True)
    print(f"probe done in {time.time() - t0:.0f} s")


# ----------------------------------------------------------------------------- AOT (no GPU)


def _aot(fn, ptr_types, const, num_warps, num_stages):
    """Compile a kernel for sm_90a; returns (ptx, ttgir, ptxas -v summary)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):
            sig[name] = ptr_types[name]
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if "scale" in name else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False))
    ptx = kernel.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    summary = f"regs {regs.group(1) if regs else '?'} spill {spill.group(1) if spill else '?'} B " \
              f"smem {kernel.metadata.shared // 1024} KiB" + ("  [wgmma serialized]" if "C7515" in info else "")
    return ptx, kernel.asm["ttgir"], summary


def _float_ops(ptx) -> collections.Counter:
    """Per-thread counts of the core's float instructions (shuffles left out: the paged
    block-id select also shuffles, integers)."""
    ops = re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.M)
    return collections.Counter(o for o in ops if re.search(r"wgmma\.mma|mma\.sync|ex2|fma\.rn\.f32|max\.f32", o))


def _mma_layouts(ttgir) -> set:
    """MMA encodings with the row-warp count blanked: {(version, warps along N, instrShape)}."""
    found = re.findall(r"nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, "
                       r"warpsPerCTA = \[\d+, (\d+)\], instrShape = (\[[\d, ]+\])", ttgir)
    return set(found)


_FWD_PTRS = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kc_ptr", "vc_ptr")},
             **dict(lse_ptr="*fp32", cu_ptr="*i32", table_ptr="*i32", ctx_ptr="*i32", part_ptr="*fp32",
                start_ptr="*i32")}


def aot_forward(cfg, dim, dtype=torch.bfloat16, direct=False, paged=False):
    ptrs = dict(_FWD_PTRS)
    if dtype == torch.float32:
        ptrs.update({n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kc_ptr", "vc_ptr")})
    common = dict(HEAD_DIM=dim, BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.kv_split // cfg.block_n,
                  UNMASKED_LOOP=cfg.unmasked_loop, DOT_FP32=False, PRECISION=F._precision(dtype))
    rows, warps = F.prefill_tiling(cfg, dtype)
    pack, chunk = F.prefill_packing(cfg, dtype, 16, 8)  # Qwen3-0.6B's heads: a group of 2
    def descs(tma):  # as kv_descriptors decides: bf16 / fp16 only
        tma = tma and dtype != torch.float32
        box = f"tensordesc<{ptrs['k_ptr'][1:]}[{cfg.block_n}, {dim}]>" if tma else ptrs["k_ptr"]
        return dict(ptrs, k_desc=box, v_desc=box), tma

    pre_ptrs, pre_tma = descs(cfg.prefill_tma)
    pre = _aot(F._prefill_fwd_kernel, pre_ptrs, dict(common, BLOCK_M=rows, STORE_LSE=not paged, PAGED=paged,
                                                     PACK_H=pack, CHUNK=chunk, TMA=pre_tma),
               warps, cfg.stages_prefill)
    dec_ptrs, dec_tma = descs(cfg.decode_tma)
    dec = _aot(F._decode_fwd_kernel, dec_ptrs, dict(common, BLOCK_M=cfg.block_m, DIRECT=direct, TMA=dec_tma),
               cfg.num_warps, cfg.stages_decode)
    return pre, dec


def _same_core(cfg, dim, dtype=torch.bfloat16, paged=False) -> tuple[bool, str]:
    """Prefill (``paged``: the chunked / prefix-hit variant) and decode must share MMA
    instruction shapes with every warp on its own rows; with masked steps only and the
    single-split decode (one core loop and one merge each) their per-thread float ops
    must match."""
    (_, pre_ir, _), (_, dec_ir, _) = aot_forward(cfg, dim, dtype, paged=paged)
    layouts_ok = _mma_layouts(pre_ir) == _mma_layouts(dec_ir) and all(w == "1" for _, w, _ in _mma_layouts(pre_ir))
    (pre_ptx, _, _), (dec_ptx, _, _) = aot_forward(dataclasses.replace(cfg, unmasked_loop=False), dim, dtype,
                                                   direct=True, paged=paged)
    a, b = _float_ops(pre_ptx), _float_ops(dec_ptx)
    ops_ok = a == b and (dtype == torch.float32 or any("mma" in op for op in a))
    why = "" if layouts_ok else f" layouts {_mma_layouts(pre_ir)} vs {_mma_layouts(dec_ir)}"
    why += "" if ops_ok else f" ops {dict(a)} vs {dict(b)}"
    return layouts_ok and ops_ok, why


def aot_backward(cfg, dim):
    ptrs = {n: "*bf16" for n in ("q_ptr", "do_ptr", "dq_ptr", "k_ptr", "v_ptr", "dk_ptr", "dv_ptr", "o_ptr")}
    ptrs.update(lse_ptr="*fp32", delta_ptr="*fp32", cu_ptr="*i32")
    common = dict(HEAD_DIM=dim, DOT_FP32=False, PRECISION="tf32")
    dkdv = _aot(B._bwd_dkdv_kernel, ptrs, dict(common, BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1),
                cfg.num_warps1, cfg.num_stages1)
    dq = _aot(B._bwd_dq_kernel, ptrs, dict(common, BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2),
              cfg.num_warps2, cfg.num_stages2)
    return dkdv[2], dq[2]


def aot_main(check: bool) -> int:
    failures = 0
    fwd = (F.GPU_CONFIG,) if check else FWD_CANDIDATES
    bwd = (B.GPU_BWD_CONFIG,) if check else BWD_CANDIDATES
    for dim in (64, 128):
        for cfg in fwd:
            (_, _, pre), (_, _, dec) = aot_forward(cfg, dim)
            core = ""
            if cfg == F.GPU_CONFIG:  # the candidates share its tiles; --check runs this one
                same, why = _same_core(cfg, dim)
                failures += not same
                core = f" | core {'identical' if same else 'DIFFERS:' + why}"
            print(f"D={dim} fwd {_name(cfg):34s} prefill: {pre} | decode: {dec}{core}", flush=True)
        for cfg in bwd:
            dkdv, dq = aot_backward(cfg, dim)
            print(f"D={dim} bwd {_name(cfg):22s} dk/dv: {dkdv} | dq: {dq}", flush=True)
    if check:  # the remaining kernels compile, and the fp32 path keeps one core
        _aot(F._decode_combine_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32", "ctx_ptr": "*i32"},
             dict(HEAD_DIM=128, BLOCK_H=16, SPLIT=F.GPU_CONFIG.kv_split, EMULATE=False), 4, 1)
        _aot(A._store_kv_kernel, {"slot_ptr": "*i64"}, dict(HEAD_DIM=128, BLOCK_H=8), 4, 1)
        _aot(B._bwd_delta_kernel, {"delta_ptr": "*fp32", "cu_ptr": "*i32"}, dict(HEAD_DIM=128, BLOCK_T=32), 4, 1)
        same_fp32, why_fp32 = _same_core(F.GPU_CONFIG, 64, torch.float32)
        failures += not same_fp32
        for dim in (64, 128):
            same, why = _same_core(F.GPU_CONFIG, dim, paged=True)
            print(f"D={dim} paged prefill vs decode: core {'identical' if same else 'DIFFERS:' + why}", flush=True)
            failures += not same
        # the scheduling knobs the search may move (heads of a KV group per prefill program,
        # the chunked launch order, TMA loads), at the default, at one head a program in the
        # default order and with TMA loads: still the decode's core, contiguous and paged
        unpacked = dataclasses.replace(F.GPU_CONFIG, prefill_pack_heads=1, prefill_order_chunk=0)
        pointers = dataclasses.replace(F.GPU_CONFIG, prefill_tma=False, decode_tma=False)
        tma = dataclasses.replace(F.GPU_CONFIG, prefill_tma=True, decode_tma=True)
        for label, cfg in (("the default launch", F.GPU_CONFIG), ("1 head a program, default order", unpacked),
                           ("pointer loads of whole K/V tiles", pointers), ("TMA loads, decode too", tma)):
            for paged in (False, True):
                same, why = _same_core(cfg, 128, paged=paged)
                print(f"D=128 prefill, {label}{', paged' if paged else ''} vs decode: core "
                      f"{'identical' if same else 'DIFFERS:' + why}", flush=True)
                failures += not same
        print(f"D=64 fp32 prefill vs decode core {'identical' if same_fp32 else 'DIFFERS:' + why_fp32}")
    return 1 if failures else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aot", action="store_true", help="compile for sm_90a only (no GPU needed)")
    parser.add_argument("--check", action="store_true", help="with --aot: default configs, exit 1 on failure")
    args = parser.parse_args(argv)
    if args.aot:
        raise SystemExit(aot_main(args.check))
    if not torch.cuda.is_available():
        raise SystemExit("probe_attention needs a CUDA GPU (or --aot)")
    gpu_main()


if __name__ == "__main__":
    main()

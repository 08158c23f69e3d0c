"""Probe attention kernel configs: speed of each candidate, and prefill == decode bits.

Usage:
    python3 eval/probe_attention.py            # GPU: forward and backward candidates
    python3 eval/probe_attention.py --aot      # no GPU needed: compile for sm_90a, print
                                               # registers / spills / shared memory
    python3 eval/probe_attention.py --aot --check   # default configs only; exit 1 if a
                                               # kernel fails to compile or prefill and
                                               # decode get different float instructions

The forward config (BLOCK_M, BLOCK_N, num_warps, kv_split) fixes the numerics; each GPU
candidate is timed (prefill 4K and 16K, decode (1, 8192), (16, 4096), (64, 4096)) and
checked bitwise: rows of a 4500-token prefill == paged decode at those positions, alone
and batched. Backward candidates are timed at 4K and checked against the default
config's gradients. Pick the best row, then set GPU_CONFIG / GPU_BWD_CONFIG.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if "--aot" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreter ones

import torch  # noqa: E402
import triton  # noqa: E402

from areal_tik.unified_kernels import _attention_bwd as B  # noqa: E402
from areal_tik.unified_kernels import _attention_fwd as F  # noqa: E402
from areal_tik.unified_kernels import attention as A  # noqa: E402

FWD_CANDIDATES = (
    F.GPU_CONFIG,
    F.FwdConfig(64, 64, 4, 2048, 3, 3, unmasked_loop=False),
    F.FwdConfig(64, 64, 4, 2048, 4, 4),
    F.FwdConfig(64, 32, 4, 2048, 3, 4),
    F.FwdConfig(64, 128, 4, 2048, 2, 2),
    F.FwdConfig(128, 64, 8, 2048, 2, 2),
    F.FwdConfig(128, 64, 8, 2048, 3, 3),
    F.FwdConfig(128, 64, 8, 2048, 3, 3, unmasked_loop=False),
    F.FwdConfig(128, 128, 8, 2048, 2, 2),
)
BWD_CANDIDATES = (
    B.GPU_BWD_CONFIG,
    B.BwdConfig(64, 128, 128, 64, 8, 3, 8, 2),
    B.BwdConfig(32, 128, 128, 32, 4, 3, 4, 3),
    B.BwdConfig(64, 64, 64, 64, 4, 3, 4, 3),
    B.BwdConfig(32, 64, 64, 32, 4, 3, 4, 3),
)
HQ, HK, DIM = 32, 8, 128
DEVICE = "cuda"
CHECK_LEN = 4500  # prefill length of the bitwise check (crosses splits at 2048 and 4096)
PREFILL_LENS = (4096, 16384)
DECODE_CASES = ((1, 8192), (16, 4096), (64, 4096))
BWD_LEN = 4096
BUDGET_S = 200  # stop starting new candidates after this (the GPU session allows 240 s)


def _name(cfg) -> str:
    return "/".join(str(v) for v in vars(cfg).values())


# ----------------------------------------------------------------------------- GPU probe


def _time_us(fn, rep_ms=30) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=rep_ms) * 1e3


def _randn(*shape, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=g).bfloat16()


def _paged(k, v, block_size=64, seed=0):
    """One sequence's K/V in shuffled blocks of a NaN-poisoned cache."""
    L = k.shape[0]
    blocks = triton.cdiv(L, block_size)
    kc = torch.full((blocks + 4, block_size, HK, DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vc = kc.clone()
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    table = torch.randperm(blocks + 4, device=DEVICE, generator=g)[:blocks].to(torch.int32)
    pos = torch.arange(L, device=DEVICE)
    A.store_kv_cache(k, v, kc, vc, table.long()[pos // block_size] * block_size + pos % block_size)
    return kc, vc, table


def check_bits(cfg) -> bool:
    L = CHECK_LEN
    q, k, v = _randn(L, HQ, DIM, seed=1), _randn(L, HK, DIM, seed=2), _randn(L, HK, DIM, seed=3)
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEVICE)
    full = A.attention_varlen(q, k, v, cu, L, config=cfg)
    kc, vc, table = _paged(k, v)
    picks = sorted(p for p in {0, 63, 64, 1000, 2047, 2048, 2049, 4095, 4096, L - 1} if p < L)
    ctx = torch.tensor([p + 1 for p in picks], dtype=torch.int32, device=DEVICE)
    tables = table[None].expand(len(picks), -1).contiguous()
    batched = A.attention_decode(q[picks], kc, vc, tables, ctx, config=cfg)
    ok = torch.equal(batched.view(torch.int16), full[picks].view(torch.int16))
    for i in (0, len(picks) // 2, len(picks) - 1):
        alone = A.attention_decode(q[picks[i]:picks[i] + 1], kc, vc, tables[:1], ctx[i:i + 1], config=cfg)
        ok &= torch.equal(alone.view(torch.int16), full[picks[i]:picks[i] + 1].view(torch.int16))
    return bool(ok), full


def probe_forward(cfg) -> dict:
    res = {}
    for n in PREFILL_LENS:
        q, k, v = _randn(n, HQ, DIM, seed=4), _randn(n, HK, DIM, seed=5), _randn(n, HK, DIM, seed=6)
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        us = _time_us(lambda: A.attention_varlen(q, k, v, cu, n, validate=False, config=cfg))
        res[f"prefill{n} TFLOP/s"] = 2 * n * n * DIM * HQ / us * 1e-6
    for batch, ctx_len in DECODE_CASES:
        k, v = _randn(ctx_len, HK, DIM, seed=7), _randn(ctx_len, HK, DIM, seed=8)
        kc, vc, table = _paged(k, v)
        q = _randn(batch, HQ, DIM, seed=9)
        tables = table[None].expand(batch, -1).contiguous()  # same blocks: the L2 helps a bit
        ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device=DEVICE)
        us = _time_us(lambda: A.attention_decode(q, kc, vc, tables, ctx, validate=False, config=cfg))
        res[f"decode{batch}x{ctx_len} us"] = us
    return res


def probe_backward(cfg, reference) -> dict:
    n = BWD_LEN
    q, k, v = (t.requires_grad_() for t in (_randn(n, HQ, DIM, seed=10), _randn(n, HK, DIM, seed=11),
                                             _randn(n, HK, DIM, seed=12)))
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    dout = _randn(n, HQ, DIM, seed=13)
    out = A.attention_varlen(q, k, v, cu, n, bwd_config=cfg)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    us = _time_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    err = 0.0
    if reference is not None:
        err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(grads, reference))
    return {f"bwd{n} TFLOP/s": 2.5 * 2 * n * n * DIM * HQ / us * 1e-6, "rel err vs default": err}, grads


def gpu_main() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("forward: block_m/block_n/num_warps/kv_split/stages_prefill/stages_decode/unmasked_loop")
    by_numerics = {}  # configs that differ only in pipelining must agree bit for bit
    t0 = time.time()
    for cfg in FWD_CANDIDATES:
        start = time.time()
        if start - t0 > BUDGET_S * 0.7:
            print(f"  {_name(cfg):30s} skipped: time budget", flush=True)
            continue
        try:
            res, (bits, out) = probe_forward(cfg), check_bits(cfg)
        except Exception as err:  # noqa: BLE001  (a candidate that does not fit: report it, go on)
            print(f"  {_name(cfg):30s} failed: {str(err).splitlines()[0][:100]}", flush=True)
            continue
        key = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.kv_split)
        first = by_numerics.setdefault(key, (cfg, out))
        same = torch.equal(out.view(torch.int16), first[1].view(torch.int16))
        cols = "  ".join(f"{k} {v:7.1f}" for k, v in res.items())
        print(f"  {_name(cfg):30s} {cols}  prefill==decode {'YES' if bits else 'NO'}  "
              f"bits==[{_name(first[0])}] {'YES' if same else 'NO'}  ({time.time() - start:.0f} s)", flush=True)
    print("backward: block_m1/block_n1/block_m2/block_n2/warps1/stages1/warps2/stages2")
    reference = None
    for cfg in BWD_CANDIDATES:
        if time.time() - t0 > BUDGET_S:
            print(f"  {_name(cfg):30s} skipped: time budget", flush=True)
            continue
        try:
            res, grads = probe_backward(cfg, reference)
        except Exception as err:  # noqa: BLE001  (a candidate that does not fit: report it, go on)
            print(f"  {_name(cfg):30s} failed: {str(err).splitlines()[0][:100]}", flush=True)
            continue
        reference = reference if reference is not None else grads
        print(f"  {_name(cfg):30s} " + "  ".join(f"{k} {v:8.3g}" for k, v in res.items()), flush=True)


# ----------------------------------------------------------------------------- AOT (no GPU)


def _aot(fn, ptr_types, const, num_warps, num_stages):
    """Compile a kernel for sm_90a; returns (ptx, ptxas -v summary)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
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
    return ptx, summary


def _float_ops(ptx) -> collections.Counter:
    ops = re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.M)
    return collections.Counter(o for o in ops if re.search(r"wgmma\.mma|mma\.sync|ex2|fma\.rn\.f32|max\.f32|shfl", o))


def aot_forward(cfg, dim, dtype="bf16"):
    prec = "ieee" if dtype == "fp32" else "tf32"
    ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kc_ptr", "vc_ptr")}
    ptrs.update(lse_ptr="*fp32", cu_ptr="*i32", table_ptr="*i32", ctx_ptr="*i32", m_part_ptr="*fp32",
                l_part_ptr="*fp32", o_part_ptr="*fp32")
    common = dict(HEAD_DIM=dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  TILES_PER_SPLIT=cfg.kv_split // cfg.block_n, UNMASKED_LOOP=cfg.unmasked_loop,
                  DOT_FP32=False, PRECISION=prec)
    # Both with exactly one core loop and one merge: prefill (training variant, LSE
    # stored) and single-split decode; the multi-split decode only drops the merge.
    pre = _aot(F._prefill_fwd_kernel, ptrs, dict(common, STORE_LSE=True), cfg.num_warps, cfg.stages_prefill)
    dec = _aot(F._decode_fwd_kernel, ptrs, dict(common, DIRECT=True), cfg.num_warps,
               cfg.stages_decode)
    return pre, dec


def aot_backward(cfg, dim):
    ptrs = {n: "*bf16" for n in ("q_ptr", "do_ptr", "dq_ptr", "k_ptr", "v_ptr", "dk_ptr", "dv_ptr")}
    ptrs.update(lse_ptr="*fp32", delta_ptr="*fp32", cu_ptr="*i32")
    common = dict(HEAD_DIM=dim, DOT_FP32=False, PRECISION="tf32")
    dkdv = _aot(B._bwd_dkdv_kernel, ptrs, dict(common, BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1),
                cfg.num_warps1, cfg.num_stages1)
    dq = _aot(B._bwd_dq_kernel, ptrs, dict(common, BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2),
              cfg.num_warps2, cfg.num_stages2)
    return dkdv, dq


def aot_main(check: bool) -> int:
    failures = 0
    fwd = (F.GPU_CONFIG,) if check else FWD_CANDIDATES
    bwd = (B.GPU_BWD_CONFIG,) if check else BWD_CANDIDATES
    for dim in (64, 128):
        for cfg in fwd:
            (pre_ptx, pre), (dec_ptx, dec) = aot_forward(cfg, dim)
            a, b = _float_ops(pre_ptx), _float_ops(dec_ptx)
            same = a == b and any("mma" in op for op in a)
            failures += not same
            print(f"D={dim} fwd {_name(cfg):22s} prefill: {pre} | decode: {dec} | "
                  f"core ops {'identical' if same else f'DIFFER {dict(a)} vs {dict(b)}'}", flush=True)
        for cfg in bwd:
            (_, dkdv), (_, dq) = aot_backward(cfg, dim)
            print(f"D={dim} bwd {_name(cfg):22s} dk/dv: {dkdv} | dq: {dq}", flush=True)
    if check:
        _aot(F._decode_combine_kernel, {"out_ptr": "*bf16", "m_part_ptr": "*fp32", "l_part_ptr": "*fp32",
             "o_part_ptr": "*fp32", "ctx_ptr": "*i32"},
             dict(HEAD_DIM=128, BLOCK_H=16, SPLIT=F.GPU_CONFIG.kv_split, EMULATE=False), 4, 1)
        _aot(A._store_kv_kernel, {"slot_ptr": "*i64"}, dict(HEAD_DIM=128, BLOCK_H=8), 4, 1)
        cfg = F.GPU_CONFIG
        _aot(F._decode_fwd_kernel, {"table_ptr": "*i32", "ctx_ptr": "*i32", "m_part_ptr": "*fp32",
             "l_part_ptr": "*fp32", "o_part_ptr": "*fp32"},
             dict(HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.kv_split // cfg.block_n,
                  UNMASKED_LOOP=cfg.unmasked_loop, DIRECT=False, DOT_FP32=False, PRECISION="tf32"),
             cfg.num_warps, cfg.stages_decode)
        (pre_ptx, _), (dec_ptx, _) = aot_forward(F.GPU_CONFIG, 64, "fp32")
        failures += _float_ops(pre_ptx) != _float_ops(dec_ptx)
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

"""Compile every PDL forward kernel for sm_90a (no GPU: triton's own ptxas) and print, as JSON,
each one's PTX line numbers of the L2 prefetches, griddepcontrol.wait / launch_dependents and
global memory accesses. Run with TRITON_INTERPRET=0 (tests/test_pdl.py starts it).

The kernels get the launch configs the GPU runs (the modules' GPU tables; the decode-sized
variants where a kernel has several), with PDL on and, for the small-row linear, the weight
prefetch.
"""
from __future__ import annotations

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

U = "areal_tik.unified_kernels."
ACCESS = ("ld.global", "st.global", "cp.async.ca", "cp.async.cg", "atom.global", "red.global",
          "cp.async.bulk.tensor", "ld.volatile.global", "multimem")


def _fwd():
    return importlib.import_module(U + "_attention_fwd").GPU_CONFIG


def cases():
    """(module, kernel, constexprs, argument types other than the default, options)."""
    cfg = _fwd()
    i64 = "*i64"
    return [
        ("linear", "_linear_fwd_kernel",
         dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=64, GROUP_M=8, HAS_BIAS=True, EVEN_K=True, MASK_ROWS=True,
              INTERPRET=False, DOT_PRECISION="tf32", K_GROUPS=1, PDL=True, PREFETCH_W=True),
         {}, dict(num_warps=4, num_stages=6)),
        ("linear", "_linear_fwd_persistent_kernel",
         dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=132, SPLIT_EPILOGUE=True,
              HAS_BIAS=False, INTERPRET=False, DOT_PRECISION="tf32", K_GROUPS=1, PDL=True),
         {"x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[256, 64]>",
          "out_desc": "tensordesc<bf16[128, 128]>"}, dict(num_warps=8, num_stages=3)),
        ("rms_norm", "_rms_norm_fwd_kernel",
         dict(H=1024, BLOCK=1024, N_CHUNKS=1, ROWS=1, HAS_RESIDUAL=True, EMULATE_RNE=False, HEADS=0, PDL=True),
         {"eps": "fp32"}, dict(num_warps=4)),
        ("rope", "_rope_kernel",
         dict(HQ=16, HK=8, HALF=64, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64, TOKENS=1, BACKWARD=False,
              EMULATE_RNE=False, PDL=True),
         {"pos_ptr": i64, "cos_ptr": "*fp32", "sin_ptr": "*fp32"}, dict(num_warps=4)),
        ("qk_rope", "_qk_norm_rope_kernel",
         dict(HQ=16, HK=8, H=128, HALF=64, BLOCK=128, BLOCK_HALF=64, ROWS=32, HAS_NORM=True, STORE=True,
              EMULATE_RNE=False, PDL=True),
         {"pos_ptr": i64, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": i64, "eps": "fp32"},
         dict(num_warps=4)),
        ("swiglu", "_silu_mul_fwd_kernel", dict(I=3072, BLOCK=1024, EMULATE_RNE=False, PDL=True), {},
         dict(num_warps=4)),
        ("attention", "_store_kv_kernel", dict(HEAD_DIM=128, BLOCK_H=8, PDL=True), {"slot_ptr": i64},
         dict(num_warps=4)),
        ("_attention_fwd", "_prefill_fwd_kernel",
         dict(HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.kv_split // cfg.block_n,
              UNMASKED_LOOP=cfg.unmasked_loop, STORE_LSE=True, PAGED=False, DOT_FP32=False, PRECISION="tf32",
              PACK_H=1, CHUNK=0, TMA=False, PDL=True),
         {"lse_ptr": "*fp32", "cu_ptr": "*i32", "table_ptr": "*i32", "start_ptr": "*i32", "qk_scale": "fp32"},
         dict(num_warps=cfg.num_warps, num_stages=cfg.stages_prefill, enable_fp_fusion=False)),
        ("_attention_fwd", "_decode_fwd_kernel",
         dict(HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILES_PER_SPLIT=cfg.kv_split // cfg.block_n,
              UNMASKED_LOOP=cfg.unmasked_loop, DIRECT=False, DOT_FP32=False, PRECISION="tf32", TMA=False, PDL=True),
         {"table_ptr": "*i32", "ctx_ptr": "*i32", "part_ptr": "*fp32", "qk_scale": "fp32"},
         dict(num_warps=cfg.num_warps, num_stages=cfg.stages_decode, enable_fp_fusion=False)),
        ("_attention_fwd", "_decode_combine_kernel",
         dict(HEAD_DIM=128, BLOCK_H=16, SPLIT=cfg.kv_split, EMULATE=False, PDL=True),
         {"part_ptr": "*fp32", "ctx_ptr": "*i32"}, dict(num_warps=4, enable_fp_fusion=False)),
        ("logprob", "_lse_partial_kernel",
         dict(BLOCK_T=64, BLOCK_V=128, BLOCK_K=64, SPLIT_V=512, GROUP_T=16, INTERPRET=False, PRECISION="tf32",
              HAS_TARGETS=True, ENTROPY=False, WRITE_LOGITS=True, PDL=True),
         {"targets_ptr": i64, "state_ptr": "*fp32", "tz_ptr": "*fp32", "temperature": "fp32"},
         dict(num_warps=4, num_stages=4, enable_fp_fusion=False)),
        ("logprob", "_combine_kernel", dict(BLOCK=128, HAS_TARGETS=True, ENTROPY=True, PDL=True),
         {"state_ptr": "*fp32", "tz_ptr": "*fp32", "targets_ptr": i64, "lse_ptr": "*fp32", "lp_ptr": "*fp32",
          "ent_ptr": "*fp32"}, dict(num_warps=4, enable_fp_fusion=False)),
        ("engine.sampler", "_gumbel_argmax_kernel", dict(BLOCK_V=2048, PDL=True),
         {"keys_ptr": i64, "counters_ptr": i64, "out_ptr": i64, "best_ptr": "*fp32", "temperature": "fp32"},
         dict(num_warps=8)),
        ("engine.sampler", "_gumbel_combine_kernel", dict(MAX_SPLITS=128, PDL=True),
         {"part_idx_ptr": i64, "part_best_ptr": "*fp32", "out_ptr": i64, "best_ptr": "*fp32"}, dict(num_warps=1)),
    ]


def compile_ptx(module, name, consts, types, options) -> list[str]:
    path = ("areal_tik." if module.startswith("engine") else U) + module
    kernel = getattr(importlib.import_module(path), name)
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
                 for arg in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options, launch_pdl=True))
    return compiled.asm["ptx"].splitlines()


def lines_of(ptx: list[str]) -> dict:
    def where(pred):
        return [i for i, line in enumerate(ptx) if pred(line)]
    return dict(prefetch=where(lambda l: "cp.async.bulk.prefetch.L2" in l),
                wait=where(lambda l: "griddepcontrol.wait" in l),
                dependents=where(lambda l: "griddepcontrol.launch_dependents" in l),
                access=where(lambda l: any(op in l for op in ACCESS) and "prefetch" not in l))


def main() -> None:
    json.dump({name: lines_of(compile_ptx(module, name, consts, types, options))
               for module, name, consts, types, options in cases()}, sys.stdout)


if __name__ == "__main__":
    main()

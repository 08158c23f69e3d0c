"""Compile rms_norm's per-head kernel and the fused q/k norm + rope kernel for sm_90a (no GPU:
triton's own compiler) with the engine's specialisation (16-byte aligned pointers, token and
cache strides multiples of 16) and print, as JSON, the register layout of every row reduction
(``tt.reduce``) in each one's TTGIR. Run with TRITON_INTERPRET=0 (tests/test_qk_rope.py starts it).

Argument ``rows=N``: the fused kernel with N rows a program instead of the norm table's (the
negative control: one row a program spreads a row over other lanes, and the layout must differ).
"""
from __future__ import annotations

import importlib
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

U = "areal_tik.unified_kernels."
_QK_DIV16 = ("q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "qo_ptr", "ko_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "v_ptr",
             "kc_ptr", "vc_ptr", "slot_ptr", "stride_qt", "stride_kt", "stride_vt", "stride_vh", "block_size",
             "stride_kcb", "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs", "stride_vch")


def ttgir(module, name, consts, types, div16, num_warps) -> str:
    kernel = getattr(importlib.import_module(U + module), name)
    signature = {a: "constexpr" if a in consts else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in kernel.arg_names}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["ttgir"]


def reductions(ir: str) -> list[str]:
    """``axis shape layout`` of each tt.reduce, its layout alias resolved."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, re.M))
    found = re.finditer(r'"tt\.reduce"\(.*?\)\s*<\{axis = (\d+) : i32\}>.*?\) : \(tensor<([^,]+), (#\w+)>', ir, re.S)
    return [f"axis {m[1]} {m[2]} {aliases.get(m[3], m[3])}" for m in found]


def main() -> None:
    rows = dict(a.split("=") for a in sys.argv[1:]).get("rows")
    rms = importlib.import_module(U + "rms_norm")
    out = {}
    for hq, hk, d in ((16, 8, 128), (32, 8, 64)):
        cfg = rms.norm_config(d)
        norm = {heads: reductions(ttgir(
            "rms_norm", "_rms_norm_fwd_kernel",
            dict(H=d, BLOCK=cfg.block, N_CHUNKS=1, ROWS=cfg.rows, HAS_RESIDUAL=False, EMULATE_RNE=False, HEADS=heads,
                 PDL=True),
            {"eps": "fp32"}, ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "s_ptr", "stride_t"), cfg.num_warps))
            for heads in (hq, hk)}
        fused = reductions(ttgir(
            "qk_rope", "_qk_norm_rope_kernel",
            dict(HQ=hq, HK=hk, H=d, HALF=d // 2, BLOCK=cfg.block, BLOCK_HALF=d // 2, ROWS=int(rows or cfg.rows), HAS_NORM=True,
                 STORE=True, EMULATE_RNE=False, PDL=True),
            {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32"},
            _QK_DIV16, cfg.num_warps))
        out[f"{hq}/{hk}/{d}"] = dict(norm_q=norm[hq], norm_k=norm[hk], fused=fused)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

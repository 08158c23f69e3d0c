"""The K-group reduction tree of the unified linear (tensor-parallel row shards).

CPU runs use the Triton interpreter with BLOCK_K = 16 and tiny shapes: the kernel's
chain is checked bit for bit against a torch reference (per-group fp32 chains block by
block, then the tree written recursively), the shard identity ``combine_partials`` over
t ranks == ``linear(k_groups=G)`` for every t | G, G = 1 == today's linear, row
invariance, and bad input. ``-m gpu`` proves every config and both kernels bit-equal at
Qwen3-0.6B's row-parallel shapes.
"""
import concurrent.futures
import functools
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from areal_tik.model.ops import get_ops
from areal_tik.unified_kernels import combine_partials, linear, linear_partial
from tests._bits import assert_bitwise, rel_err
from tests.test_linear import _count_persistent_launches, forward_if_it_fits
from tests.test_linear import _host_chain as _chain  # one group's chain, 16-column steps

L = importlib.import_module("areal_tik.unified_kernels.linear")
MMA_K = importlib.import_module("areal_tik.unified_kernels._linear_chain").MMA_K.value  # the chain's step

DTYPES = [torch.bfloat16, torch.float32]
GROUPS = [1, 2, 4, 8]


def _problem(m, k, n, dtype, device, seed=0, bias=True):
    """O(1)-scale inputs holding bf16 values (so fp32 runs are exact per block in fp64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16().to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).bfloat16().to(device=device, dtype=dtype) if bias else None
    return x, w, b


def _tree(sums):
    """The balanced binary tree, left subtree + right subtree, in fp32."""
    if len(sums) == 1:
        return sums[0]
    half = len(sums) // 2
    return _tree(sums[:half]) + _tree(sums[half:])


def _reference(x, w, b, k_groups, step=MMA_K):
    width = x.shape[1] // k_groups
    root = _tree([_chain(x[:, g * width:(g + 1) * width], w[:, g * width:(g + 1) * width], step)
                  for g in range(k_groups)])
    if b is not None:
        root = root + b.float()
    return root.to(x.dtype)


def _shards(x, w, t, k_groups):
    """combine_partials over t ranks, each holding K / t contiguous columns (a copy, as a rank has)."""
    width = x.shape[-1] // t
    parts = [linear_partial(x[..., r * width:(r + 1) * width].contiguous(),
                            w[:, r * width:(r + 1) * width].contiguous(), k_groups=k_groups // t)
             for r in range(t)]
    return parts


# ---------------------------------------------------------------- the chain, bit for bit
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter numerics (the GPU proof is -m gpu)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [128, 160])  # 160 / 8 = 20: a masked last block inside each group
def test_tree_matches_torch_reference_bitwise(dtype, k):
    x, w, b = _problem(5, k, 24, dtype, "cpu", seed=1)
    for k_groups in GROUPS:
        for bias in (b, None):
            assert_bitwise(linear(x, w, bias, k_groups=k_groups), _reference(x, w, bias, k_groups),
                           f"G={k_groups} K={k} bias={bias is not None}")
        partial = linear_partial(x, w, k_groups=k_groups)
        assert partial.dtype == torch.float32
        assert_bitwise(partial, _reference(x.float(), w.float(), None, k_groups),
                       f"partial G={k_groups} K={k}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter numerics (the GPU proof is -m gpu)")
def test_every_config_and_both_kernels_follow_the_tree(monkeypatch):
    """Every config, the persistent TMA kernel included where each group is whole
    BLOCK_K blocks (else the tiled kernel runs it: a TMA box would straddle two groups)."""
    seen = _count_persistent_launches(monkeypatch)
    configs = L.linear_candidates(torch.bfloat16)
    expected = 0
    for k, k_groups in ((128, 8), (160, 2), (160, 8)):  # group widths 16, 80, 20 (BLOCK_K 16)
        x, w, b = _problem(37, k, 40, torch.bfloat16, "cpu", seed=2)
        expect = _reference(x, w, b, k_groups)
        for cfg in configs:
            assert_bitwise(L.linear_forward(x, w, b, config=cfg, k_groups=k_groups), expect,
                           f"K={k} G={k_groups} {cfg}")
        expected += sum(cfg.persistent and (k // k_groups) % cfg.block_k == 0 for cfg in configs)
    assert seen["calls"] == expected > 0


def test_negative_control_tree_differs_from_plain_chain(device):
    """The check can fail: G = 8 regroups the fp32 sums of G = 1 (same maths, other bits)."""
    x, w, b = _problem(16, 256, 64, torch.float32, device, seed=3)
    plain, tree = linear(x, w, b), linear(x, w, b, k_groups=8)
    assert rel_err(tree, plain) < 1e-6
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(tree, plain, "G=8 vs G=1")


# ---------------------------------------------------------------- shards == one device
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_over_shards_equals_full_tree(dtype, device):
    x, w, b = _problem(9, 160, 24, dtype, device, seed=4)
    for k_groups in GROUPS:
        for t in (1, 2, 4, 8):
            if k_groups % t:
                continue
            parts = _shards(x, w, t, k_groups)
            for bias in (b, None):
                assert_bitwise(combine_partials(parts, bias, dtype), linear(x, w, bias, k_groups=k_groups),
                               f"G={k_groups} over t={t} ranks, bias={bias is not None}")


def test_g1_is_todays_linear(device):
    x, w, b = _problem(33, 96, 40, torch.bfloat16, device, seed=5)
    assert_bitwise(linear(x, w, b, k_groups=1), linear(x, w, b), "k_groups=1 vs default")
    assert_bitwise(L.linear_forward(x, w, b, k_groups=1), L.linear_forward(x, w, b), "launcher")
    assert_bitwise(combine_partials([linear_partial(x, w, k_groups=1)], b, x.dtype), linear(x, w, b),
                   "one rank, one group")


def test_leading_dims_and_autograd(device):
    x, w, b = _problem(12, 64, 16, torch.float32, device, seed=6)
    x3 = x.view(3, 4, 64)
    assert_bitwise(linear(x3, w, b, k_groups=4).view(12, 16), linear(x, w, b, k_groups=4), "3-D x")
    assert_bitwise(linear_partial(x3, w, k_groups=4).view(12, 16), linear_partial(x, w, k_groups=4), "3-D partial")
    leaf = x3.clone().requires_grad_()
    out = linear(leaf, w, b, k_groups=4)
    assert_bitwise(out.detach(), linear(x3, w, b, k_groups=4), "autograd forward")
    out.sum().backward()
    assert rel_err(leaf.grad, torch.ones(3, 4, 16, dtype=torch.float64, device=device) @ w.double()) < 1e-6


# ---------------------------------------------------------------- row invariance
@pytest.mark.parametrize("k_groups", [2, 8])
def test_rows_alone_equal_rows_in_batches(k_groups, device):
    x, w, b = _problem(35, 96, 40, torch.bfloat16, device, seed=7)  # G = 8: 12 columns, one masked block
    probes = (0, 1, 3, 4, 31, 34)
    alone = {r: linear(x[r:r + 1], w, b, k_groups=k_groups) for r in probes}
    alone_parts = {r: linear_partial(x[r:r + 1], w, k_groups=k_groups) for r in probes}
    for m in (2, 5, 33, 35):  # crosses the interpreter's row buckets (4, 32)
        out, parts = linear(x[:m], w, b, k_groups=k_groups), linear_partial(x[:m], w, k_groups=k_groups)
        for r in (r for r in probes if r < m):
            assert_bitwise(out[r:r + 1], alone[r], f"row {r} of {m}")
            assert_bitwise(parts[r:r + 1], alone_parts[r], f"partial row {r} of {m}")


# ---------------------------------------------------------------- the standard kernel set
def test_standard_set_has_the_tree():
    std = get_ops("standard")
    x, w, b = _problem(6, 64, 16, torch.bfloat16, "cpu", seed=8)
    assert_bitwise(std.linear(x, w, b, k_groups=1), torch.nn.functional.linear(x, w, b), "standard G=1")
    exact = x.double() @ w.double().T + b.double()
    for k_groups in (2, 4):
        out = std.linear(x, w, b, k_groups=k_groups)
        assert out.dtype == x.dtype and rel_err(out, exact) < 1e-2
        width = 64 // k_groups
        sums = [x[:, g * width:(g + 1) * width].float() @ w[:, g * width:(g + 1) * width].float().T
                for g in range(k_groups)]
        assert_bitwise(std.linear_partial(x, w, k_groups=k_groups), _tree(sums), f"standard partial G={k_groups}")
        assert_bitwise(std.combine_partials([std.linear_partial(x, w, k_groups=k_groups)], b, x.dtype), out,
                       f"standard combine G={k_groups}")
    with pytest.raises(ValueError, match="got 3"):
        std.linear(x, w, b, k_groups=3)


# ---------------------------------------------------------------- bad input
def test_bad_inputs(device):
    x, w, b = _problem(4, 96, 16, torch.float32, device, seed=9)
    part = linear_partial(x, w, k_groups=2)
    x100, w100, _ = _problem(4, 100, 16, torch.float32, device, seed=10)
    cases = [
        (ValueError, "power of two .* got 3", lambda: linear(x, w, b, k_groups=3)),
        (ValueError, "power of two .* got 16", lambda: linear(x, w, b, k_groups=16)),
        (ValueError, "power of two .* got 0", lambda: linear_partial(x, w, k_groups=0)),
        (TypeError, "int .* got True", lambda: linear(x, w, b, k_groups=True)),
        (TypeError, "int .* got 2.0", lambda: linear_partial(x, w, k_groups=2.0)),
        (ValueError, "K = 100 .* k_groups = 8", lambda: linear(x100, w100, k_groups=8)),
        (ValueError, "K = 20 .* k_groups = 8", lambda: linear_partial(x[:, :20], w[:, :20], k_groups=8)),
        (ValueError, "power of two .* got 3", lambda: combine_partials([part] * 3, b, x.dtype)),
        (ValueError, "power of two .* got 0", lambda: combine_partials([], b, x.dtype)),
        (ValueError, "power of two .* got 16", lambda: combine_partials([part] * 16, b, x.dtype)),
        (TypeError, "sequence", lambda: combine_partials(part, b, x.dtype)),
        (TypeError, r"parts\[1\] must have dtype torch.float32", lambda: combine_partials([part, part.bfloat16()], b, x.dtype)),
        (ValueError, r"parts\[1\] has \(4, 8\)", lambda: combine_partials([part, part[:, :8]], b, x.dtype)),
        (TypeError, "bias must have dtype torch.bfloat16", lambda: combine_partials([part], b, torch.bfloat16)),
        (ValueError, r"bias must have shape \(16,\)", lambda: combine_partials([part], b[:8], x.dtype)),
        (TypeError, "dtype must be one of", lambda: combine_partials([part], None, torch.float16)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


# ---------------------------------------------------------------- GPU proof at real sizes
GPU = "cuda"
TP_SHAPES = [(2048, 1024), (3072, 1024)]  # (K, N): Qwen3-0.6B o_proj and down_proj
TP_ROWS = (1, 17, 64, 1000, 4096)


def _gpu_problem(m, k, n, seed, bias=True):
    g = torch.Generator(device=GPU).manual_seed(seed)
    x = torch.randn(m, k, device=GPU, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=GPU, generator=g) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, device=GPU, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _precompile(calls) -> None:
    """Run ``calls`` once on 8 threads, as the warm-up does: Triton compiles outside the
    GIL, so the ~40 variants per G compile side by side (errors surface in the checks)."""
    with concurrent.futures.ThreadPoolExecutor(8, initializer=torch.cuda.set_device,
                                               initargs=(torch.cuda.current_device(),)) as pool:
        for future in [pool.submit(call) for call in calls]:
            try:
                future.result()
            except OutOfResources:
                pass


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", TP_SHAPES)
@pytest.mark.parametrize("k_groups", [2, 4, 8])
def test_gpu_every_config_and_both_kernels_equal_with_the_tree(k, n, k_groups, monkeypatch):
    """Every table, fixed and candidate config, tiled and persistent, gives the tree's
    bits: at 1000 rows (partial last row tiles) every config; at 17 rows (rows masked)
    the table's; partials (fp32 output, other kernel keys) for the table's configs."""
    table = tuple(dict.fromkeys(cfg for _, ladder in L.buckets(torch.bfloat16) for cfg, _, _ in ladder))
    cases = [(m, configs, *_gpu_problem(m, k, n, seed=30 + m))
             for m, configs in ((1000, L.linear_candidates(torch.bfloat16)), (17, table))]
    calls = []
    for _, configs, x, w, b in cases:
        for cfg in configs:
            calls.append(functools.partial(L.linear_forward, x, w, b, config=cfg, k_groups=k_groups))
            if cfg in table:
                calls.append(functools.partial(L.partial_forward, x, w, k_groups, config=cfg))
    _precompile(calls)
    persistent = _count_persistent_launches(monkeypatch)
    for m, configs, x, w, b in cases:
        base, base_partial = linear(x, w, b, k_groups=k_groups), linear_partial(x, w, k_groups=k_groups)
        for cfg in configs:
            out = forward_if_it_fits(x, w, b, cfg, table, k_groups=k_groups)
            if out is None:
                continue
            assert_bitwise(out, base, f"G={k_groups} {m} rows {cfg}")
            if cfg in table:
                assert_bitwise(L.partial_forward(x, w, k_groups, config=cfg), base_partial,
                               f"partial G={k_groups} {m} rows {cfg}")
    assert persistent["calls"] > 0  # (K / G) % BLOCK_K == 0 here: the persistent configs ran TMA


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", TP_SHAPES)
def test_gpu_shards_and_rows_equal_the_full_tree(k, n):
    """combine_partials over t = 2, 4 and 8 ranks (each a contiguous K / t copy) == the full
    kernel with the same G; t = G gives each rank one group, i.e. the plain G = 1 chain,
    so the one-loop tree is checked against the definition built from it. Every row
    count gives each row the bits it has alone."""
    x, w, b = _gpu_problem(max(TP_ROWS), k, n, seed=40)
    for k_groups in (2, 4, 8):
        full = linear(x, w, b, k_groups=k_groups)
        full_partial = linear_partial(x, w, k_groups=k_groups)
        assert_bitwise(combine_partials([full_partial], b, x.dtype), full, f"G={k_groups} one rank")
        for m in TP_ROWS:
            assert_bitwise(linear(x[:m], w, b, k_groups=k_groups), full[:m], f"G={k_groups} first {m} rows")
            assert_bitwise(linear(x[m - 1:m], w, b, k_groups=k_groups), full[m - 1:m], f"G={k_groups} row {m - 1}")
            assert_bitwise(linear_partial(x[:m], w, k_groups=k_groups), full_partial[:m], f"partial, {m} rows")
            for t in (2, 4, 8):
                if k_groups % t == 0:
                    got = combine_partials(_shards(x[:m], w, t, k_groups), b, x.dtype)
                    assert_bitwise(got, full[:m], f"G={k_groups} over {t} ranks, {m} rows")
        del full, full_partial
    exact = x.double() @ w.double().T + b.double()
    assert rel_err(linear(x, w, b, k_groups=8), exact) < 1e-2


# ---------------------------------------------------------------- the compiled GPU IR
# The interpreter does not run Triton's MLIR passes (a combine pass rewrites dot(a, b, 0)
# + c as dot(a, b, c)), so the tree is also checked where the GPU meets it: the Hopper
# TTIR, built on this CPU (no device needed) in a process without the interpreter.
_IR_SCRIPT = """
import json, re, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
import importlib
L = importlib.import_module("areal_tik.unified_kernels.linear")
common = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, HAS_BIAS=False, INTERPRET=False, DOT_PRECISION="tf32")
kernels = {
    "tiled": (L._linear_fwd_kernel, {**{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
              **{p: "i32" for p in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om")}},
              dict(common, EVEN_K=True, MASK_ROWS=False)),
    "persistent": (L._linear_fwd_persistent_kernel, {"x_desc": "tensordesc<bf16[64, 64]>",
                   "w_desc": "tensordesc<bf16[128, 64]>", "out_desc": "tensordesc<bf16[64, 128]>", "b_ptr": "*bf16",
                   "M": "i32", "N": "i32", "K": "i32"}, dict(common, NUM_PROGRAMS=132, SPLIT_EPILOGUE=False)),
}
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
options = backend.parse_options({"num_warps": 4, "num_stages": 3})
out = {}
for name, (kernel, sig, consts) in kernels.items():
    for groups in (1, 2, 4, 8):
        c = dict(consts, K_GROUPS=groups)
        src = ASTSource(kernel, {**sig, **{k: "constexpr" for k in c}}, c)
        ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
        mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
        stages = {}
        backend.add_stages(stages, options, src.language)
        text = re.sub(r"\\s*loc\\(#loc\\d*\\)", "", str(stages["ttir"](mod, {})))
        out[f"{name}/{groups}"] = text
json.dump(out, sys.stdout)
"""


def _ttir_by_kernel() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _IR_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _reduction_of(ttir: str):
    """The expression the rounded output is computed from, over the K loop's results: a
    leaf ``(loop, i)`` is result i of a loop whose fp32 iter_arg i starts at the zero tile,
    a pair is one fp32 add. Also returns the K loops (from the zero tile) and the dots, and
    checks that every dot accumulates into such an iter_arg (no add folded into a dot)."""
    acc_type = "tensor<64x128xf32>"
    zero = re.search(r"(%\S+) = arith.constant dense<0.000000e\+00> : " + re.escape(acc_type), ttir).group(1)
    loops, adds, dots = {}, {}, []
    for line in ttir.splitlines():
        loop = re.match(r"\s*(%[\w]+)(?::\d+)? = scf.for .*iter_args\((.*?)\) ->", line)
        if loop:
            args = [arg.split(" = ") for arg in loop.group(2).split(", ")]
            from_zero = {i: name for i, (name, init) in enumerate(args) if init == zero}
            if from_zero:
                loops[loop.group(1)] = from_zero
        add = re.match(r"\s*(%\S+) = arith.addf (%\S+), (%\S+) : " + re.escape(acc_type), line)
        if add:
            adds[add.group(1)] = (add.group(2).rstrip(","), add.group(3))
        dot = re.match(r"\s*%\S+ = tt.dot \S+, \S+, (%\S+),", line)
        if dot:
            dots.append(dot.group(1))
    carried = {name for from_zero in loops.values() for name in from_zero.values()}
    assert not set(dots) & set(adds), "a tree add was folded into a dot's accumulator"
    assert set(dots) <= carried, "a dot accumulates into something other than a loop-carried tile from zero"
    root = re.search(r"arith.truncf (%\S+) : " + re.escape(acc_type), ttir).group(1)

    def expr(value):
        if value in adds:
            return tuple(expr(v) for v in adds[value])
        loop, _, index = value.partition("#")
        assert loop in loops and int(index or 0) in loops[loop], f"{value} is neither an add nor a K loop's tile"
        return loop, int(index or 0)

    return expr(root), loops, dots


def test_compiled_gpu_ir_follows_the_tree():
    """Both kernels' Hopper TTIR. G = 1: one loop, one dot from the zero tile, its result
    rounded. G = 2, 4, 8: still one K loop with one dot (no add folded into it), the
    accumulator and log2(G) live partial sums all starting at the zero tile, and after the
    loop the partials (p0, p1, p2: the left subtrees still waiting) each added on the left
    of the right subtree built so far, innermost first: p2 + (p1 + (p0 + acc)). The
    closing of each group inside the loop is proved bit for bit by the interpreter tests
    above (the same code; the interpreter runs no MLIR pass, hence this test)."""
    for key, ttir in _ttir_by_kernel().items():
        groups = int(key.split("/")[1])
        tree, loops, dots = _reduction_of(ttir)
        (loop, carried), = loops.items()
        assert len(dots) == 1 and len(carried) == 1 + groups.bit_length() - 1, key
        acc = next(i for i, name in carried.items() if name == dots[0])
        expect = (loop, acc)
        for partial in sorted(set(carried) - {acc}):  # p0, p1, p2 in the order they are declared
            expect = ((loop, partial), expect)
        assert tree == expect, key

"""Unified linear: accuracy, backward, bitwise row invariance, negative control, bad input.

CPU runs use the Triton interpreter with tiny tiles and small bucket thresholds (4 and 32
rows), so the bucket geometry change is crossed here too; ``-m gpu`` runs the contract
at real sizes on CUDA, including the proof that the row-count buckets change no bits.
"""
import dataclasses
import importlib
import itertools
import json
import warnings
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from areal_tik.unified_kernels import bits, linear  # linear: the function (package API)
from areal_tik.unified_kernels import reference as R
from areal_tik.unified_kernels._common import fp32_reductions
from eval.probe_block_k import dist_inputs
from tests._bits import assert_bitwise, rel_err

L = importlib.import_module("areal_tik.unified_kernels.linear")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# Backward: bf16 GEMMs with fp32 accumulation, rounded once to bf16, sit at the rounding
# floor (relative RMS of an RTNE bf16 rounding ~ 2^-8 / sqrt(3) ~ 2.3e-3 at worst; 1.7e-3
# measured here): 4e-3 leaves no room for a second bf16 rounding or bf16 reductions.
BWD_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _problem(m, k, n, dtype, device, seed=0, bias=True):
    """O(1)-scale inputs: x ~ N(0, 1), weight ~ N(0, 1/K) so outputs are O(1)."""
    x = _randn(m, k, dtype=dtype, device=device, seed=seed)
    w = _randn(n, k, dtype=dtype, device=device, seed=seed + 1, scale=k ** -0.5)
    b = _randn(n, dtype=dtype, device=device, seed=seed + 2) if bias else None
    return x, w, b


def _row_sizes(dtype, largest):
    """Row counts that cross every bucket boundary of the active table."""
    sizes = {1, 2, 7, largest}
    for max_rows, _ in L.buckets(dtype):
        if max_rows is not None and max_rows < largest:
            sizes |= {max_rows, max_rows + 1}
    return sorted(sizes)


def _singles(x, w, b):
    return torch.cat([linear(x[i:i + 1], w, b) for i in range(x.shape[0])])


# ---------------------------------------------------------------- accuracy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape,n", [((3, 64), 48), ((5, 320), 1000), ((2, 3, 40), 24),
                                       ((40, 70), 33), ((40,), 17)])
def test_matches_fp64_reference(dtype, bias, x_shape, n, device):
    k = x_shape[-1]
    x = _randn(*x_shape, dtype=dtype, device=device, seed=1)
    _, w, b = _problem(1, k, n, dtype, device, seed=2, bias=bias)
    out = linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (*x_shape[:-1], n) and out.dtype == dtype
    assert rel_err(out, exact) < TOL[dtype]
    if dtype == torch.bfloat16:
        # Rounded once: within half a bf16 ulp of the exact value (plus fp32 sum error).
        assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5).all()
        ref = R.linear(x, w, b)
        assert (out.double() - ref.double()).abs().max() <= ref.double().abs().max() * 2.0 ** -7
    else:
        assert (out.double() - exact).abs().max() < 1e-5


def test_bf16_rounds_once_to_nearest_even(device):
    # Exact fp32 sums 1 + 2^-8 and 1 + 3 * 2^-8 are ties between bf16 neighbours.
    x = torch.tensor([[1.0, 2.0 ** -8], [1.0, 3 * 2.0 ** -8], [1.0, 2.0 ** -8 + 2.0 ** -14]],
                     dtype=torch.bfloat16, device=device)
    w = torch.ones(1, 2, dtype=torch.bfloat16, device=device)
    expect = torch.tensor([[1.0], [1.0 + 2.0 ** -6], [1.0 + 2.0 ** -7]], dtype=torch.bfloat16)
    assert_bitwise(linear(x, w).cpu(), expect, "ties to even")
    if device == "cpu":  # same BLOCK_K for both dtypes here: same fp32 sums, rounded by torch
        xb, wb, bb = _problem(50, 64, 40, torch.bfloat16, device, seed=15)
        assert_bitwise(linear(xb, wb, bb), linear(xb.float(), wb.float(), bb.float()).bfloat16(),
                       "bf16 output == RTNE(fp32 output)")


# ---------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_backward_matches_fp64_reference(dtype, bias, device):
    x, w, b = _problem(10, 40, 24, dtype, device, seed=3, bias=bias)
    x = x.view(2, 5, 40)
    dy = _randn(2, 5, 24, dtype=dtype, device=device, seed=9)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    linear(*leaves, *([None] if not bias else [])).backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    R.linear(*ref_leaves, *([None] if not bias else []), compute=torch.float64).backward(dy.double())
    for got, ref, name in zip(leaves, ref_leaves, "xwb"):
        assert got.grad.dtype == dtype, name
        assert rel_err(got.grad, ref.grad) < BWD_TOL[dtype], name
    # Deterministic: a second backward gives the same bits.
    again = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    linear(*again, *([None] if not bias else [])).backward(dy)
    for got, second in zip(leaves, again):
        assert_bitwise(got.grad, second.grad, "repeat backward")


def test_fp32_reductions_switches_off_reduced_precision_and_restores(device):
    matmul = torch.backends.cuda.matmul
    saved = [(getattr(matmul, n), getattr(matmul, n + "_split_k"))
             for n in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")]
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        matmul.allow_fp16_reduced_precision_reduction = (False, False)  # the split-K half comes back too
        with pytest.raises(RuntimeError, match="inside"):
            with fp32_reductions():
                assert not matmul.allow_bf16_reduced_precision_reduction
                assert not matmul.allow_fp16_reduced_precision_reduction
                raise RuntimeError("inside")
        assert matmul.allow_bf16_reduced_precision_reduction
        assert not matmul.allow_fp16_reduced_precision_reduction
        assert not matmul.allow_fp16_reduced_precision_reduction_split_k
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved[0]
        matmul.allow_fp16_reduced_precision_reduction = saved[1]


def test_backward_only_requested_grads(device):
    x, w, b = _problem(6, 32, 16, torch.float32, device, seed=4)
    w.requires_grad_()
    linear(x, w, b).sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None
    with torch.no_grad():
        assert linear(x, w, b).grad_fn is None


# ---------------------------------------------------------------- bitwise row invariance
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_equal_rows_in_batches(dtype, device):
    x, w, b = _problem(70, 48, 40, dtype, device, seed=5)
    singles = _singles(x, w, b)
    for m in _row_sizes(dtype, 70):
        assert_bitwise(linear(x[:m], w, b), singles[:m], f"batch of {m} rows")
        assert_bitwise(linear(x[-m:], w, b), singles[-m:], f"last {m} rows")
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(0)).to(device)
    assert_bitwise(linear(x[perm], w, b), singles[perm], "shuffled")
    assert_bitwise(linear(x.view(7, 10, 48), w, b).view(70, 40), singles, "3-D input")


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_do_not_leak(dtype, device):
    x, w, b = _problem(9, 40, 33, dtype, device, seed=6)
    singles = _singles(x, w, b)
    pad = torch.empty(40, 40, dtype=dtype, device=device)
    pad[0::4], pad[1::4], pad[2::4] = float("nan"), float("inf"), -3e38
    pad[3::4] = _randn(10, 40, dtype=dtype, device=device, seed=7) * 1e4
    real = torch.arange(9, device=device) * 4 + 2  # real rows spread among the padding
    batch = pad.clone()
    batch[real] = x
    assert_bitwise(linear(batch, w, b)[real], singles, "rows among NaN/inf/garbage rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_memory_layout_does_not_change_bits(dtype, device):
    x, w, b = _problem(37, 48, 40, dtype, device, seed=8)
    base = linear(x, w, b)
    wide = torch.zeros(37, 96, dtype=dtype, device=device)
    wide[:, ::2] = x  # x as a strided view, stride_xk = 2
    assert_bitwise(linear(wide[:, ::2], w, b), base, "strided x")
    col_major = x.t().contiguous().t()
    assert_bitwise(linear(col_major, w, b), base, "column-major x")
    w_t = w.t().contiguous().t()  # [N, K] view with strides (1, N)
    assert_bitwise(linear(x, w_t, b), base, "transposed weight view")
    x3 = x.view(37, 1, 48).expand(37, 2, 48).permute(1, 0, 2)  # not mergeable: reshape copies
    assert_bitwise(linear(x3, w, b)[1], base, "permuted 3-D x")
    b_strided = torch.stack([b, b], 1)[:, 0]
    assert_bitwise(linear(x, w, b_strided), base, "strided bias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_config_and_fixed_tile_give_same_bits(dtype, device, monkeypatch):
    """Launch geometry varies with the row count and N, numerics do not: every table,
    fixed and candidate config, the persistent TMA kernel included, gives the same bits."""
    x, w, b = _problem(45, 56, 40, dtype, device, seed=10)
    base = linear(x, w, b)
    persistent = _count_persistent_launches(monkeypatch)
    configs = L.linear_candidates(dtype)
    for cfg in configs:
        assert_bitwise(L.linear_forward(x, w, b, config=cfg), base, f"config {cfg}")
    assert persistent["calls"] == sum(cfg.persistent for cfg in configs)
    assert persistent["calls"] > 0 or dtype == torch.float32 and device == "cuda"  # GPU fp32: tiled only
    monkeypatch.setattr(L, "FIXED_TILE", True)
    fixed = L.linear_config(45, 40, 56, dtype)
    assert all(L.linear_config(m, n, 56, dtype) == fixed for m in (1, 5, 33, 10 ** 6) for n in (16, 10 ** 5))
    assert_bitwise(linear(x, w, b), base, "fixed tile")


def _count_persistent_launches(monkeypatch) -> dict:
    """Count launches of the persistent TMA kernel (so a proof cannot pass vacuously)."""
    seen = {"calls": 0}
    launch = L._launch_persistent

    def counting(*args, **kwargs):
        seen["calls"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(L, "_launch_persistent", counting)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_persistent_kernel_falls_back_when_tma_cannot_read(dtype, device, monkeypatch):
    """TMA needs unit inner strides and 16-byte aligned bases and row strides; otherwise
    a persistent config runs the tiled kernel, with the same bits."""
    x, w, b = _problem(37, 48, 40, dtype, device, seed=16)
    cfg = next((c for c in L.linear_candidates(dtype) if c.persistent), None)
    if cfg is None:
        pytest.skip(f"no persistent config for {dtype} here")
    persistent = _count_persistent_launches(monkeypatch)
    base = L.linear_forward(x, w, b, config=cfg)
    assert persistent["calls"] == 1 and L.tma_compatible(x, w)
    buf = torch.zeros(37, 49, dtype=dtype, device=device)
    buf[:, 1:] = x  # base pointer one element past a 16-byte boundary
    k_odd = torch.zeros(37, 53, dtype=dtype, device=device)
    k_odd[:, :48] = x  # row stride of 53 elements: not a multiple of 16 bytes
    views = {"unaligned base": (buf[:, 1:], w), "odd row stride": (k_odd[:, :48], w),
             "transposed weight view": (x, w.t().contiguous().t()), "column-major x": (x.t().contiguous().t(), w)}
    for what, (xv, wv) in views.items():
        assert not L.tma_compatible(xv, wv), what
        assert_bitwise(L.linear_forward(xv, wv, b, config=cfg), base, what)
    assert persistent["calls"] == 1
    n_odd = _problem(1, 48, 41, dtype, device, seed=17)[1]  # output row of 41 elements
    assert not L.tma_compatible(x, n_odd)


def test_negative_control_split_k_changes_bits(device):
    """The bitwise check can fail: summing two K halves (split-K) regroups the fp32 sums."""
    x, w, b = _problem(16, 128, 64, torch.float32, device, seed=11)
    base = linear(x, w, b)
    split = linear(x[:, :64], w[:, :64]) + linear(x[:, 64:], w[:, 64:], b)
    assert rel_err(split, base) < 1e-6  # same maths ...
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(split, base, "split-K")  # ... different bits


def _host_chain(x, w, step):
    """The fp32 chain over K in ``step``-column steps from zero: each step's products summed
    exactly in fp64 with the running sum, rounded to fp32 (what the interpreter models
    for a 16-column MMA step; bf16 products are exact in fp64)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for start in range(0, x.shape[1], step):
        acc = (acc.double() + x[:, start:start + step].double() @ w[:, start:start + step].double().T).float()
    return acc


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter numerics; the GPU's: test_gpu_block_k_is_geometry")
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_k_is_geometry_in_interpreter(dtype):
    """A block's dot is a chain of 16-column steps (as BLOCK_K / 16 chained k16 MMAs are on
    the GPU): every BLOCK_K gives the bits of the host's 16-column chain, both kernels. The
    negative control: 32-column steps (one rounding per 32 columns) give other bits, so
    the check can see a wider step."""
    x, w, _ = _problem(16, 128, 64, dtype, "cpu", seed=11, bias=False)
    expect = _host_chain(x, w, 16)
    assert not torch.equal(_host_chain(x, w, 32).view(torch.int32), expect.view(torch.int32))
    cfg = L.linear_config(16, 64, 128, dtype)
    for block_k, persistent in itertools.product((16, 32, 64, 128), (False, True)):
        tile = dataclasses.replace(cfg, block_k=block_k, persistent=persistent)
        # the unrounded fp32 chain (bf16 outputs would hide a last-bit fp32 difference)
        assert_bitwise(L.partial_forward(x, w, 1, tile), expect, f"BLOCK_K {block_k}, persistent {persistent}")
        assert_bitwise(L.linear_forward(x, w, None, config=tile), expect.to(dtype), f"BLOCK_K {block_k} rounded")


# ---------------------------------------------------------------- configuration table
def test_config_tables_use_mma_k_steps_and_wgmma_shapes():
    tables = [(L._GPU_BUCKETS, L._GPU_FIXED, L._GPU_CANDIDATES),
              (L._CPU_BUCKETS, L._CPU_FIXED, {dt: L._CPU_CANDIDATES for dt in DTYPES})]
    for table, fixed, candidates in tables:
        for dtype, buckets in table.items():
            limits = [m for m, _ in buckets]
            assert limits[-1] is None and limits[:-1] == sorted(limits[:-1])
            configs = [cfg for _, ladder in buckets for cfg, _, _ in ladder] + list(candidates[dtype])
            # K steps of the MMA's 16 columns (_linear_chain.MMA_K): any multiple is geometry
            assert all(cfg.block_k % 16 == 0 for cfg in configs + [fixed[dtype]]), dtype
            # A ladder ends with an unbounded tiled rung: the choice when nothing else fits.
            assert all(not ladder[-1][0].persistent and ladder[-1][2] == 0 for _, ladder in buckets)
            assert not any(cfg.split_epilogue and not cfg.persistent for cfg in configs)
        assert not any(rung[0].persistent for _, ladder in table.get(torch.float32, ()) for rung in ladder)
    bf16 = torch.bfloat16
    gpu_bf16 = [cfg for _, ladder in L._GPU_BUCKETS[bf16] for cfg, _, _ in ladder] + list(L._GPU_CANDIDATES[bf16])
    for cfg in gpu_bf16 + [L._GPU_FIXED[bf16]]:
        # wgmma on Hopper: 64-row warpgroup tiles and whole warpgroups.
        assert cfg.block_m % 64 == 0 and cfg.num_warps % 4 == 0 and cfg.block_n % 16 == 0, cfg


def test_gpu_table_selection(monkeypatch):
    """The bf16 GPU ladders (checked on any machine), for an H200 (132 SMs): while the
    weight streams, one wave of deep-pipelined programs; persistent TMA tiles for large M
    where TMA can run and every SM gets >= 2 tiles."""
    monkeypatch.setattr(L, "interpreting", lambda: False)

    def pick(m, n, k=1536, **kw):  # K = 1536: no promoted entry (``_TUNED_BF16``) has it
        cfg = L.linear_config(m, n, k, torch.bfloat16, sms=132, **kw)
        return cfg.block_m, cfg.block_n, cfg.num_stages, "P" if cfg.persistent else "T"

    assert pick(1, 1024) == pick(64, 2048) == pick(128, 1024) == (64, 16, 20, "T")
    assert pick(1, 3072) == pick(64, 4096) == pick(256, 1024) == (64, 32, 16, "T")
    assert pick(1, 6144) == (64, 64, 12, "T") and pick(8, 12288) == pick(128, 6144) == (64, 128, 8, "T")
    assert pick(1, 17920) == pick(256, 6144) == pick(64, 151936) == (64, 128, 4, "T")
    assert pick(512, 1024) == (64, 64, 6, "T") and pick(512, 6144) == (64, 128, 3, "T")
    assert pick(1024, 1024) == (64, 128, 4, "T") and pick(1024, 6144) == (128, 128, 4, "T")
    assert pick(2048, 1024) == (128, 128, 4, "T") and pick(4096, 1024) == (256, 128, 3, "T")
    assert pick(2048, 6144) == pick(16384, 1024) == (256, 128, 3, "P")
    assert pick(16384, 6144, tma=False) == pick(16384, 6144, k=1004) == (256, 128, 3, "T")
    monkeypatch.setattr(L, "FIXED_TILE", True)
    assert pick(16384, 6144) == (64, 128, 4, "T")


def test_promoted_entries_take_precedence_only_where_the_search_timed_them(monkeypatch):
    """``_TUNED_BF16`` (a promoted audit of the search): its shapes in its row ranges
    (``_TUNED_BOUNDS``) on a 132-SM GPU; the ladder everywhere else (rows above 4096 where
    no "binf" group was promoted). Every entry is a config whose bits the contract proves
    (the ladders' and the candidates')."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(L, "WIDE_K", False)  # the wide-K entries have their own test
    bf16 = torch.bfloat16
    proven = {cfg for _, ladder in T._GPU_BUCKETS[bf16] for cfg, _, _ in ladder} | set(T._GPU_CANDIDATES[bf16])
    assert T._TUNED_BF16 and set(T._TUNED_BF16.values()) <= proven
    assert set(T._TUNED_BF16.values()) <= set(L.linear_candidates(bf16))
    limits = list(T._TUNED_BOUNDS)
    # (rows, n, k, tma, sms) -> whether the promoted entry must be chosen
    cases = {}
    for (max_rows, n, k), cfg in T._TUNED_BF16.items():
        low = limits[limits.index(max_rows) - 1] + 1 if max_rows != limits[0] else 1
        high = max_rows if max_rows is not None else 16384
        for rows in (low, high):
            cases[(rows, n, k, True, 132)] = cfg
            cases[(rows, n, k, True, 114)] = None  # another GPU: the ladder
            cases[(rows, n, k, False, 132)] = None if cfg.persistent else cfg  # no TMA: no persistent entry
        if max_rows == 4096:  # rows above: the "binf" group's entry if the search promoted one
            above = T._TUNED_BF16.get((None, n, k))
            cases[(4097, n, k, True, 132)] = cases[(16384, n, k, True, 132)] = above
        cases[(64, n, k + 64, True, 132)] = None  # a shape the search did not see

    def pick(table):
        monkeypatch.setattr(T, "_TUNED_BF16", table)
        T._select.cache_clear()
        return {c: L.linear_config(c[0], c[1], c[2], bf16, tma=c[3], sms=c[4]) for c in cases}
    chosen, ladder = pick(dict(T._TUNED_BF16)), pick({})
    T._select.cache_clear()
    for case, want in cases.items():
        assert chosen[case] == (want if want is not None else ladder[case]), case
    assert sum(want is not None for want in cases.values()) >= 2 * len(T._TUNED_BF16)
    assert L.linear_config(64, 1024, 2048, torch.float32, sms=132) == L.linear_config(64, 1024, 2048, torch.float32, sms=114)


def test_wide_k_table_is_what_the_probe_promoted():
    """``_WIDE_K_BF16`` holds exactly the entries the GPU runs named in ``WIDE_K_SOURCES``
    promoted (bits checked, timed), merged in order, no hand edits; each a tiled decode tile
    whose BLOCK_K is a multiple of 16 dividing its K."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    promoted = {}
    for source in T.WIDE_K_SOURCES:  # the probe's "linear" entries, a search's wide-K groups
        run = json.loads((Path(__file__).resolve().parents[1] / source).read_text())
        promoted.update({tuple(None if v == "None" else int(v) for v in key.split(",")): fields
                         for key, fields in run.get("linear", {}).items()})
        for key, fields in T.file_groups(run).items():
            if T.is_wide_k(T.TileConfig(**fields)):
                promoted[T.group_key(key)] = fields
            else:
                promoted.pop(T.group_key(key), None)
    assert {key: dataclasses.asdict(cfg) for key, cfg in T._WIDE_K_BF16.items()} == promoted
    for (max_rows, n, k), cfg in T._WIDE_K_BF16.items():
        assert max_rows <= 256 and not cfg.persistent and cfg.block_k % 16 == 0 and k % cfg.block_k == 0
        assert cfg.block_m == 64 and cfg.num_warps == 4  # wgmma tiles, as the ladders'


def test_tuned_table_holds_the_search_runs_groups():
    """Every group of the runs in ``TUNED_SOURCES`` (a linear search's promoted config, as
    eval/optimize_gpu.py --tiles-out wrote it) is in the table where ``load_tuned`` routes it:
    ``_TUNED_BF16`` with no wide-K entry shadowing it, or ``_WIDE_K_BF16`` (K steps > 64);
    so loading the run's file on top of the table changes nothing."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    groups = {}
    for source in T.TUNED_SOURCES:
        groups.update(T.file_groups(json.loads((Path(__file__).resolve().parents[1] / source).read_text())))
    assert groups  # a source without groups would make this test vacuous
    for key, fields in groups.items():
        where, cfg = T.group_key(key), T.TileConfig(**fields)
        if T.is_wide_k(cfg):
            assert T._WIDE_K_BF16.get(where) == cfg, key
        else:
            assert T._TUNED_BF16.get(where) == cfg and where not in T._WIDE_K_BF16, key
    before = (dict(T._TUNED_BF16), dict(T._WIDE_K_BF16))
    try:
        T.load_tuned(groups)
        assert (T._TUNED_BF16, T._WIDE_K_BF16) == before
    finally:
        T._TUNED_BF16.clear(), T._TUNED_BF16.update(before[0])
        T._WIDE_K_BF16.clear(), T._WIDE_K_BF16.update(before[1])
        T._select.cache_clear()


def test_wide_k_entries_serve_decode_rows_of_their_shape_only(monkeypatch, tmp_path):
    """``_WIDE_K_BF16``: its (bucket, N, K) on a 132-SM GPU while ``WIDE_K`` is on and the
    launch is the plain chain (no K groups); the ladder / search entries otherwise. Entries
    load from the JSON eval/probe_block_k.py writes (``AREAL_TIK_LINEAR_TILES``); a BLOCK_K
    that is not a multiple of 16, does not divide K, or a persistent entry is refused; a
    missing file raises."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_WIDE_K_BF16", {})
    bf16, n, k = torch.bfloat16, 1024, 2048
    without = {rows: L.linear_config(rows, n, k, bf16, sms=132) for rows in (1, 64, 65)}
    wide = T._cfg(64, 16, 4, 5, block_k=256)
    path = tmp_path / "wide.json"  # as eval/probe_block_k.py writes it, read as the kernels read it
    path.write_text(json.dumps({"linear": {f"64,{n},{k}": dataclasses.asdict(wide)}, "logprob": {}}))
    monkeypatch.setenv("AREAL_TIK_LINEAR_TILES", str(path))
    assert T.load_wide_k(T.measured_overrides("linear")) == 1
    try:
        assert L.linear_config(1, n, k, bf16, sms=132) == L.linear_config(64, n, k, bf16, sms=132) == wide
        assert wide in L.linear_candidates(bf16)  # so the GPU contract test runs it
        assert L.linear_config(65, n, k, bf16, sms=132) == without[65]  # the next bucket
        assert L.linear_config(1, n, k, bf16, sms=114) == L.linear_config(1, n, k, bf16, sms=114, k_groups=1)
        assert L.linear_config(1, n, k, bf16, sms=114) != wide  # another GPU
        assert L.linear_config(1, n, k, bf16, sms=132, k_groups=2).block_k == 64  # the tree: no wide entry
        assert L.linear_config(1, n, k + 64, bf16, sms=132).block_k == 64  # another shape
        monkeypatch.setattr(L, "WIDE_K", False)
        assert L.linear_config(1, n, k, bf16, sms=132) == without[1]
        for bad, match in ((dict(block_k=40), "not a wide-K decode tile"), (dict(persistent=True), "not a wide-K"),
                           (dict(block_k=96), "does not divide K = 2048"), (dict(block_k=4096), "does not divide K")):
            with pytest.raises(ValueError, match=match):
                T.load_wide_k({f"64,{n},{k}": dataclasses.asdict(dataclasses.replace(wide, **bad))})
        monkeypatch.setenv("AREAL_TIK_LINEAR_TILES", str(tmp_path / "missing.json"))
        with pytest.raises(FileNotFoundError):
            T.measured_overrides("linear")
    finally:
        T._select.cache_clear()


def test_search_runs_promoted_groups_load_as_table_entries(monkeypatch, tmp_path):
    """A linear search run's best config (eval/optimize_gpu.py --tiles-out: the JSON's
    "tuned" section) becomes ``_TUNED_BF16`` entries for its (bucket, N, K) on a 132-SM GPU,
    so a later process (bench_linear) launches it; a key naming no bucket and a config the
    contract test does not run, and a BLOCK_K above 64 that does not divide K are refused;
    the root staying best writes no group. The file records its row ranges; a file from
    before the 4096-row cut (none recorded) reads its "binf" as "b4096", the rows its search
    timed; a file naming other ranges is refused."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    gpu_run = importlib.import_module("eval.optimize_gpu")
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_TUNED_BF16", dict(T._TUNED_BF16))
    bf16, n, k = torch.bfloat16, 2048, 1536  # Qwen2.5-1.5B qkv: no search entry (the ladder)
    ladder = {rows: L.linear_config(rows, n, k, bf16, sms=132) for rows in (64, 1024, 1025, 4096, 4097, 16384)}
    promoted = T._cfg(128, 256, 8, 3, "PS")
    assert promoted != ladder[1024]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"linear": {}, "logprob": {"block_k": 64}}))
    best = {f"b1024:{n}x{k}": dataclasses.asdict(promoted)}
    assert gpu_run.write_tuned(path, {"best": "c0007", "root": "c0000", "best_config": best}) == 1
    written = json.loads(path.read_text())
    assert written["logprob"] == {"block_k": 64} and written["tuned"] == best  # other sections kept
    assert written["tuned_bounds"] == ["b64", "b128", "b256", "b512", "b1024", "b4096", "binf"]
    monkeypatch.setenv("AREAL_TIK_LINEAR_TILES", str(path))
    try:
        assert T.load_tuned(T.file_groups(T.measured_file())) == 1
        assert L.linear_config(1024, n, k, bf16, sms=132) == promoted
        assert L.linear_config(513, n, k, bf16, sms=132) == promoted  # the whole bucket
        assert L.linear_config(64, n, k, bf16, sms=132) == ladder[64]  # other buckets keep theirs
        assert L.linear_config(1025, n, k, bf16, sms=132) == ladder[1025]
        assert L.linear_config(1024, n, k, bf16, sms=114) != promoted  # another GPU
        # rows above 1024: a file from before the cut (its search timed 4096 rows at most) ...
        wide = T._cfg(128, 128, 4, 4, "P")
        assert wide not in (ladder[1025], ladder[4096], ladder[4097], ladder[16384])
        old = {"tuned": {f"binf:{n}x{k}": dataclasses.asdict(wide)}}
        assert T.file_groups(old) == {f"b4096:{n}x{k}": dataclasses.asdict(wide)}
        assert T.load_tuned(T.file_groups(old)) == 1
        assert L.linear_config(1025, n, k, bf16, sms=132) == L.linear_config(4096, n, k, bf16, sms=132) == wide
        assert L.linear_config(4097, n, k, bf16, sms=132) == ladder[4097]
        # ... and one written now, whose "binf" is rows above 4096 (timed at 16384)
        assert T.load_tuned(T.file_groups({"tuned": {f"binf:{n}x{k}": dataclasses.asdict(promoted)},
                                           **T.search_file_fields()})) == 1
        assert L.linear_config(4097, n, k, bf16, sms=132) == L.linear_config(16384, n, k, bf16, sms=132) == promoted
        assert L.linear_config(4096, n, k, bf16, sms=132) == wide
        with pytest.raises(ValueError, match="row ranges"):
            T.file_groups({"tuned": {}, "tuned_bounds": ["b64", "b1024", "binf"]})
        with pytest.raises(ValueError, match="not 'b<max_rows>:<N>x<K>'"):
            T.load_tuned({f"b999:{n}x{k}": dataclasses.asdict(promoted)})
        with pytest.raises(ValueError, match="not a config the contract test runs"):
            T.load_tuned({f"binf:{n}x{k}": dataclasses.asdict(T._cfg(128, 256, 8, 7, "PS"))})
        with pytest.raises(ValueError, match="does not divide K = 576"):  # a masked tail step
            T.load_tuned({"b64:1024x576": dataclasses.asdict(T._cfg(64, 16, 4, 5, block_k=256))})
        assert gpu_run.write_tuned(path, {"best": "c0000", "root": "c0000", "best_config": {}}) == 0
        assert json.loads(path.read_text())["tuned"] == {}
    finally:
        T._select.cache_clear()


def test_partial_outputs_fit_shared_memory_with_every_persistent_config():
    """fp32 partials (``linear_partial``) of bf16 operands keep an fp32 half tile for the
    epilogue beside the pipeline: every persistent GPU config then drops stages (geometry)
    until operands + epilogue fit 227 KiB; 128x256/s4 (262,176 bytes on the H100: out of
    resources before) runs at s3. bf16 outputs keep the table's stages."""
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    bf16 = torch.bfloat16
    gpu = [cfg for _, ladder in T._GPU_BUCKETS[bf16] for cfg, _, _ in ladder] + list(T._GPU_CANDIDATES[bf16])
    configs = [cfg for cfg in gpu + list(T._TUNED_BF16.values()) if cfg.persistent]
    assert T._cfg(128, 256, 8, 4, "PS") in configs
    for cfg in configs:
        stages = L._partial_stages(cfg, 2, 4)
        need = stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2 + cfg.block_m * cfg.block_n // 2 * 4
        assert 2 <= stages <= cfg.num_stages and need <= L._SMEM_BYTES, cfg
        assert stages == cfg.num_stages or (stages + 1) * (cfg.block_m + cfg.block_n) * cfg.block_k * 2 + \
            cfg.block_m * cfg.block_n // 2 * 4 > L._SMEM_BYTES, cfg  # as many as fit
    assert L._partial_stages(T._cfg(128, 256, 8, 4, "PS"), 2, 4) == 3


def test_launch_metadata_names_the_launch():
    x = torch.empty(3, 8, dtype=torch.bfloat16)
    meta = L._launch_metadata((1,), None, {"M": 3, "N": 4, "K": 8, "x_ptr": x})
    assert meta["flops"] == 2 * 3 * 4 * 8 and meta["bytes"] == 2 * (24 + 32 + 12)
    assert "M=3" in meta["name"]
    desc = L.TensorDescriptor(x, [3, 8], [8, 1], [16, 16]) if L.TensorDescriptor else None
    if desc is not None:  # the persistent kernel's arguments are TMA descriptors
        assert L._launch_metadata((1,), None, {"M": 3, "N": 4, "K": 8, "x_desc": desc}) == meta


# ---------------------------------------------------------------- bad input
def test_bad_inputs(device):
    x, w, b = _problem(4, 32, 16, torch.float32, device, seed=12)
    cases = [
        (TypeError, "weight dtype", lambda: linear(x, w.bfloat16())),
        (TypeError, "bias dtype", lambda: linear(x, w, b.bfloat16())),
        (TypeError, "dtype in", lambda: linear(x.half(), w.half())),
        (TypeError, "dtype in", lambda: linear(x.int(), w)),
        (TypeError, "torch.Tensor", lambda: linear(x.tolist(), w)),
        (ValueError, "rank", lambda: linear(x, w[0])),
        (ValueError, "rank", lambda: linear(x, w.view(2, 8, 32))),
        (ValueError, "rank", lambda: linear(x[0, 0], w)),
        (ValueError, "rank", lambda: linear(x, w, b.view(2, 8))),
        (ValueError, "K = x.shape", lambda: linear(x[:, :31], w)),
        (ValueError, "empty", lambda: linear(x[:0], w)),
        (ValueError, "empty", lambda: linear(x, w[:0])),
        (ValueError, r"bias must have shape \(16,\)", lambda: linear(x, w, b[:15])),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    x, w, _ = _problem(2, 16, 16, torch.float32, "cpu", seed=13)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        linear(x, w)


@pytest.mark.gpu
def test_gpu_mixed_devices_rejected():
    x, w, _ = _problem(2, 16, 16, torch.float32, "cuda", seed=14)
    with pytest.raises(ValueError):
        linear(x, w, torch.zeros(16))


# ---------------------------------------------------------------- GPU contract at real sizes
GPU = "cuda"
GPU_MAX_ROWS = 16384
GPU_ROWS = (1, 7, 64, 65, 256, 257, 300, 1024, 1025, 5000, GPU_MAX_ROWS)
LAYOUT_SHAPE = (1000, 2048, 3072)  # (M, K, N)
BACKWARD_SHAPE = (4, 128, 1024, 2048)  # (batch, T, K, N)
GPU_SHAPES = [  # (dtype, K, N, bias)
    (torch.bfloat16, 2048, 6144, True),  # Qwen3-1.7B MLP-sized
    (torch.bfloat16, 1024, 151936, False),  # Qwen3 LM head: M*N > 2^31 at 16384 rows
    (torch.bfloat16, 1000, 1000, True),  # K, N not multiples of any block: masked K loop
    (torch.bfloat16, 4096, 3072, True),
    (torch.float32, 2048, 1024, True),
]
TMA_ODD_SHAPE = (torch.bfloat16, 1004, 2048, True)  # K rows of 2008 bytes: TMA cannot read x


def _gpu_problem(m, k, n, dtype, seed, bias):
    g = torch.Generator(device=GPU).manual_seed(seed)
    x = torch.randn(m, k, device=GPU, generator=g).to(dtype)
    w = (torch.randn(n, k, device=GPU, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=GPU, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,k,n,bias", GPU_SHAPES + [TMA_ODD_SHAPE])
def test_gpu_rows_bitwise_equal_across_buckets(dtype, k, n, bias, monkeypatch):
    """Proof of the bucket hypothesis: a row computed alone (M=1) has the same bits in
    batches of every bucket, at the first, middle and last positions (last rows of the
    LM head at 16384 rows need int64 offsets). Large bf16 batches run the persistent TMA
    kernel where TMA can read the operands (K=1004: it cannot; the tiled kernel runs)."""
    probes, w, b = _gpu_problem(8, k, n, dtype, seed=20, bias=bias)
    alone = _singles(probes, w, b)
    persistent = _count_persistent_launches(monkeypatch)
    for m in sorted(set(GPU_ROWS) | set(_row_sizes(dtype, GPU_MAX_ROWS))):
        batch, _, _ = _gpu_problem(m, k, 1, dtype, seed=21 + m, bias=False)
        pos = torch.linspace(0, m - 1, min(m, 8), device=GPU).round().long().unique()
        batch[pos] = probes[: len(pos)]
        out = linear(batch, w, b)
        assert_bitwise(out[pos], alone[: len(pos)], f"{m} rows, K={k}, N={n}")
        del out, batch
    tma = dtype == torch.bfloat16 and L.tma_compatible(probes, w)
    assert (persistent["calls"] > 0) == tma, (persistent, tma)


def forward_if_it_fits(x, w, b, cfg, table, **kwargs):
    """``linear_forward`` with ``cfg``, or None (and a warning) for a tuning candidate too
    large for this GPU: not a contract issue. A config of the table must fit."""
    try:
        return L.linear_forward(x, w, b, config=cfg, **kwargs)
    except OutOfResources:
        if cfg in table:
            raise
        warnings.warn(f"candidate {cfg} does not fit this GPU {kwargs or ''}")
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("shape,m,candidates", [
    (GPU_SHAPES[0], 1027, True),  # every tuning candidate (each one is a compile)
    (GPU_SHAPES[0], 7, False),  # decode path: rows masked
    (GPU_SHAPES[2], 300, False),  # K not a multiple of BLOCK_K: masked K loop / TMA zero fill
    (TMA_ODD_SHAPE, 300, False),  # persistent configs fall back to the tiled kernel
    (GPU_SHAPES[4], 1027, True),  # fp32 FMA path
])
def test_gpu_every_geometry_gives_same_bits(shape, m, candidates, monkeypatch):
    """Every bucket, the fixed tile and the tuning candidates, both kernels: launch
    geometry only."""
    dtype, k, n, bias = shape
    x, w, b = _gpu_problem(m, k, n, dtype, seed=22, bias=bias)
    table = {cfg for _, ladder in L.buckets(dtype) for cfg, _, _ in ladder}
    configs = L.linear_candidates(dtype, candidates=candidates)
    persistent = _count_persistent_launches(monkeypatch)
    base = L.linear_forward(x, w, b, config=configs[0])
    for cfg in configs[1:]:
        out = forward_if_it_fits(x, w, b, cfg, table)
        if out is not None:
            assert_bitwise(out, base, f"{cfg} vs {configs[0]}")
    expected = sum(cfg.persistent for cfg in configs) if L.tma_compatible(x, w) else 0
    assert persistent["calls"] == expected


@pytest.mark.gpu
def test_gpu_persistent_and_tiled_kernels_agree_on_unaligned_views(monkeypatch):
    """At a persistent-table row count, views TMA cannot read (unaligned base, transposed
    weight) run the tiled kernel: same bits as the persistent kernel on aligned copies."""
    m, k, n = 4096, 2048, 3072
    x, w, b = _gpu_problem(m, k, n, torch.bfloat16, seed=28, bias=True)
    persistent = _count_persistent_launches(monkeypatch)
    base = linear(x, w, b)
    assert persistent["calls"] == 1
    buf = torch.zeros(m, k + 8, dtype=x.dtype, device=GPU)
    buf[:, 1:k + 1] = x
    assert_bitwise(linear(buf[:, 1:k + 1], w, b), base, "x one element past 16-byte alignment")
    assert_bitwise(linear(x, w.t().contiguous().t(), b), base, "transposed weight view")
    assert persistent["calls"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,k,n,bias", [GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[2], GPU_SHAPES[4]])
@pytest.mark.parametrize("m", [1, 300, 4096])
def test_gpu_matches_fp64_reference(dtype, k, n, bias, m):
    x, w, b = _gpu_problem(m, k, n, dtype, seed=23, bias=bias)
    out = linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(out, exact) < TOL[dtype]
    slack = 2e-5 * (k / 64) ** 0.5  # fp32 accumulation error over K, O(1) outputs
    if dtype == torch.bfloat16:
        assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + slack).all()
    else:
        assert (out.double() - exact).abs().max().item() < slack


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_layout_and_repeat_give_same_bits(dtype):
    m, k, n = LAYOUT_SHAPE
    x, w, b = _gpu_problem(m, k, n, dtype, seed=24, bias=True)
    base = linear(x, w, b)
    assert_bitwise(linear(x, w, b), base, "repeat")
    wide = torch.zeros(m, 2 * k, dtype=dtype, device=GPU)
    wide[:, k // 2: k // 2 + k] = x
    assert_bitwise(linear(wide[:, k // 2: k // 2 + k], w, b), base, "x as a column slice")
    assert_bitwise(linear(x.view(8, m // 8, k), w, b).view(m, n), base, "3-D x")
    assert_bitwise(linear(x, w.t().contiguous().t(), b), base, "transposed weight view")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_backward_matches_fp64_reference(dtype):
    batch, t, k, n = BACKWARD_SHAPE
    x, w, b = _gpu_problem(batch * t, k, n, dtype, seed=25, bias=True)
    dy = torch.randn(batch, t, n, device=GPU).to(dtype)
    leaves = [v.detach().clone().requires_grad_() for v in (x.view(batch, t, k), w, b)]
    linear(*leaves).backward(dy)
    refs = [v.detach().double().requires_grad_() for v in (x.view(batch, t, k), w, b)]
    R.linear(*refs, compute=torch.float64).backward(dy.double())
    for got, ref, name in zip(leaves, refs, "xwb"):
        assert rel_err(got.grad, ref.grad) < BWD_TOL[dtype], name


# Training-sized backward: dW reduces over 12288 tokens, the shape where cuBLAS splits K.
TRAIN_BACKWARD_SHAPE = (12288, 1024, 3072)  # (T, K, N): Qwen3-0.6B gate/up at a GRPO packing
# cuBLAS kernels with fp32 operands (SIMT sgemm, xmma gemm_f32f32_*): the upcast backward's.
_FP32_GEMM_KERNELS = ("sgemm", "gemm_f32f32")


@pytest.mark.gpu
def test_gpu_training_backward_on_tensor_cores_deterministic_and_accurate():
    t, k, n = TRAIN_BACKWARD_SHAPE
    x, w, b = _gpu_problem(t, k, n, torch.bfloat16, seed=29, bias=True)
    dy = (torch.randn(t, n, device=GPU) * 0.1).to(torch.bfloat16)

    def grads():
        leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]
        linear(*leaves).backward(dy)
        torch.cuda.synchronize()
        return [v.grad for v in leaves]

    first = grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        second = grads()
    names = {evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA}
    assert len(names) >= 3, f"the profiler saw no backward kernels: {sorted(names)}"
    fp32 = sorted(name for name in names if any(key in name.lower() for key in _FP32_GEMM_KERNELS))
    assert not fp32, f"fp32 GEMMs in the bf16 backward: {fp32}"
    for a, c, name in zip(first, second, "xwb"):
        assert_bitwise(a, c, f"repeat backward d{name}")
    refs = [v.detach().double().requires_grad_() for v in (x, w, b)]
    R.linear(*refs, compute=torch.float64).backward(dy.double())
    for got, ref, name in zip(first, refs, "xwb"):
        assert got.dtype == torch.bfloat16, name
        assert rel_err(got, ref.grad) < BWD_TOL[torch.bfloat16], name


@pytest.mark.gpu
def test_gpu_cublas_row_invariance_report():
    """Context, never a failure: cuBLAS F.linear changes row 0's bits with the row count."""
    x, w, _ = _gpu_problem(4096, 2048, 6144, torch.bfloat16, seed=26, bias=False)
    cublas0 = torch.nn.functional.linear(x[:1], w)
    ours0 = linear(x[:1], w)
    report = {}
    for m in (2, 16, 128, 1024, 4096):
        cub = torch.nn.functional.linear(x[:m], w)[:1]
        report[m] = int((bits(cub) != bits(cublas0)).sum())
        assert_bitwise(linear(x[:m], w)[:1], ours0, f"unified row 0 at {m} rows")
    verdict = "NOT row-invariant" if any(report.values()) else "row-invariant here (by luck)"
    # A warning, so the report shows in pytest's summary without -s.
    warnings.warn(f"cuBLAS F.linear is {verdict}: row 0 elements (of {w.shape[0]}) that differ "
                  f"from M=1, by row count: {report}; unified linear: 0 for every row count")


@pytest.mark.gpu
def test_gpu_fp32_partials_run_every_persistent_config():
    """fp32 partials at persistent row counts: the table's promoted 128x256/s4 split-epilogue
    tile (out of shared memory before ``_partial_stages``) and every persistent candidate
    launch, and each partial rounded to bf16 is the linear's output without bias."""
    k, n, m = 2048, 1024, 2048
    x, w, _ = _gpu_problem(m, k, n, torch.bfloat16, seed=33, bias=False)
    table = L.linear_config(m, n, k, torch.bfloat16)
    assert table.persistent and L._partial_stages(table, 2, 4) < table.num_stages  # the case that did not fit
    expect = L.linear_forward(x, w, None)
    for cfg in [table] + [c for c in L.linear_candidates(torch.bfloat16) if c.persistent]:
        assert_bitwise(L.partial_forward(x, w, 1, cfg).to(torch.bfloat16), expect, f"partial {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 300])
def test_gpu_block_k_is_geometry(m):
    """The claim the wide-K decode entries rest on: a bf16 dot is a chain of k16 wgmma steps,
    so BLOCK_K 16, 32, 128 and 256 give the fp32 chain of BLOCK_K 64 bit for bit (the
    unrounded accumulator, not only its bf16 rounding), tiled and persistent kernels, on
    normal inputs and on inputs built to expose any other step width."""
    k, n = 3072, 1024
    base_cfg = L._cfg(64, 16 if m <= 64 else 64, 4, 4)  # BLOCK_K 64, the ladders'
    for kind in ("normal", "wide", "cancel"):
        x, w = dist_inputs(kind, m, k, n, seed=32)  # eval/probe_block_k.py's: the GPU run's inputs
        base = L.partial_forward(x, w, 1, base_cfg)
        for block_k, persistent in itertools.product((16, 32, 128, 256), (False, True)):
            tile = L._cfg(64, 16 if m <= 64 else 64, 4, 2, "P" if persistent else "", block_k=block_k)
            assert_bitwise(L.partial_forward(x, w, 1, tile), base, f"{kind}: BLOCK_K {block_k} vs 64, {tile}")

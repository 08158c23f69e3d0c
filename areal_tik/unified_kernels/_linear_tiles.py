"""The unified linear's launch geometries: tile configs, the per-row-count ladders, the
candidates the contract proves bit-equal, and the selection (``linear.linear_config``).

Geometry only: every bf16 config here runs the wgmma family with a BLOCK_K that is a
multiple of its K step (16), so no entry changes a bit (``_linear_chain.MMA_K``; the GPU
contract test in tests/test_linear.py proves each one); the tables are what the search
(areal_tik/optimize/op_linear.py), eval/bench_linear.py --sweep and eval/probe_block_k.py
re-tune.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from ._common import interpreting, measured_file, measured_overrides


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # rows of tiles per L2 group in the program order
    persistent: bool = False  # persistent TMA kernel (falls back to tiled when TMA cannot run)
    split_epilogue: bool = False  # persistent: store each tile as two BLOCK_N/2 halves


def _cfg(bm, bn, warps, stages, kind="", block_k=64) -> TileConfig:
    """A TileConfig; kind "P" is the persistent TMA kernel, "PS" that with a split epilogue."""
    return TileConfig(bm, bn, block_k, num_warps=warps, num_stages=stages,
                      persistent=kind.startswith("P"), split_epilogue=kind == "PS")


def _rung(bm, bn, warps, stages, kind="", *, block_k=64, min_programs=128, per_sm=0) -> tuple:
    """A ladder rung: (config, min_programs, per_sm). It fits a problem when the grid has
    >= min_programs programs (tiles) and, if per_sm > 0, <= per_sm x #SMs (one wave)."""
    return _cfg(bm, bn, warps, stages, kind, block_k), min_programs, per_sm


# Buckets: ((max_rows, ladder), ...), the last with max_rows None. The first rung of the
# ladder that fits the grid at the bucket's max rows (actual rows in the last bucket) and
# this N is used, else the last rung. The ladders keep BLOCK_K 64 (bf16) / 32 (fp32); any
# multiple of 16 gives the same bits (the k16 chain: _linear_chain.MMA_K).
# bf16 on the H200 (132 SMs), from the first sweep (eager timing; us):
#  <= 256 rows stream the weight: the time falls with the weight bytes in flight,
#    #programs x BLOCK_N x BLOCK_K x (stages - 1): o (N=1024) M=1 64x16/s6 9.8, 64x32/s4
#    13.3, 64x128/s3 19.0; up (N=6144) M=1 64x64/s6 15.3 (96 programs) ~ 64x16/s6 16.4
#    (384). So: one wave of programs, each with the deepest pipeline that fits (~192 KiB
#    shared memory for one program per SM, ~96 KiB for two), the widest tile that still
#    gives >= 96 programs, else 64x16 (N <= 2048: 64..128 programs).
#  <= 1024 rows: 64-wide tiles while 128x128 gives < 128 programs: up M=512 64x128 30.1 vs
#    128x128 34.6; o M=1024 64x128/s4 15.8 vs 128x128 18.4; up M=1024 128x128/w4 49.4.
#  > 1024 rows: 256x128x64 w8 s3: up M=16384 717 us vs 128x256 969 us; o M=4096 (128 such
#    tiles) 128x128/w4 34.4 vs 256x128 34.7. Persistent + TMA where the operands allow,
#    when every SM gets >= 2 tiles.
_MIN_PROGRAMS = 128
_BF16_STREAM = (
    _rung(64, 128, 4, 8, min_programs=96, per_sm=1), _rung(64, 64, 4, 12, min_programs=96, per_sm=1),
    _rung(64, 32, 4, 16, min_programs=96, per_sm=1), _rung(64, 16, 4, 20, min_programs=1, per_sm=1),
    _rung(64, 128, 4, 4, min_programs=96, per_sm=2), _rung(64, 64, 4, 6, min_programs=96, per_sm=2),
    _rung(64, 32, 4, 8, min_programs=96, per_sm=2), _rung(64, 16, 4, 10, min_programs=1, per_sm=2),
    _rung(64, 128, 4, 4),  # many waves (LM head): two programs per SM hide each one's ramp
)
_GPU_BUCKETS = {
    torch.bfloat16: (
        *((rows, _BF16_STREAM) for rows in (64, 128, 256)),  # 1, 2, 4 tile rows of 64
        (512, (_rung(64, 128, 4, 3), _rung(64, 64, 4, 6), _rung(64, 32, 4, 6))),
        # 2026-11-30 H200: at 1024 rows the tiled 128x128 reached 0.61-0.83x cuBLAS while
        # the persistent kernel reached 0.92-1.0x from 4096 rows; take it where it has
        # at least two tiles per SM (wide N: LM head, gate_up).
        (1024, (_rung(256, 128, 8, 3, "P", min_programs=2 * _MIN_PROGRAMS),
                _rung(128, 128, 4, 4), _rung(64, 128, 4, 4), _rung(64, 64, 4, 6))),
        (None, (_rung(256, 128, 8, 3, "P", min_programs=2 * _MIN_PROGRAMS), _rung(256, 128, 8, 3),
                _rung(128, 128, 4, 4), _rung(64, 128, 4, 4))),
    ),
    # fp32 runs exact FMAs (no tensor cores): modest tiles, no speed target.
    torch.float32: ((64, (_rung(64, 32, 4, 3, block_k=32),)), (None, (_rung(64, 64, 4, 3, block_k=32),))),
}
_GPU_FIXED = {torch.bfloat16: _cfg(64, 128, 4, 4), torch.float32: _cfg(64, 64, 4, 3, block_k=32)}
# Further geometries (BLOCK_K 64 and wider / narrower k16 multiples): the GPU contract test proves them bit-equal
# to the table above and eval/bench_linear.py --sweep times them, so re-tuning the
# table is a measured, invariance-safe edit.
_GPU_CANDIDATES = {
    torch.bfloat16: tuple(_cfg(*spec) for spec in (
        (64, 16, 4, 6), (64, 16, 4, 12), (64, 32, 4, 6), (64, 32, 4, 10), (64, 64, 4, 8), (64, 256, 4, 5),
        (128, 64, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
        (128, 128, 4, 4, "P"), (128, 128, 8, 4, "P"), (128, 256, 8, 3, "P"), (128, 256, 8, 3, "PS"),
        (128, 256, 8, 4, "PS"), (256, 128, 8, 3, "PS"), (256, 128, 8, 4, "PS"))) + tuple(
        # wider K steps (the same k16 chain): decode tiles and one of each kernel at 128 / 256;
        # half the K steps for the narrow 1024-row launches the second search could not speed
        # (Qwen3-0.6B o / down at 1024 rows, 64x128x64/s4: 0.85-0.88x cuBLAS; not yet timed)
        _cfg(*spec, block_k=bk) for *spec, bk in (
            (64, 16, 4, 10, 128), (64, 16, 4, 5, 256), (64, 32, 4, 8, 128), (64, 64, 4, 3, 256),
            (128, 128, 4, 3, "P", 128), (128, 128, 8, 3, 32),
            (64, 128, 4, 3, 128), (64, 128, 4, 4, 128), (128, 64, 4, 4, 128))),
    torch.float32: tuple(_cfg(*spec, block_k=32) for spec in ((32, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3)))
    + (_cfg(64, 64, 4, 2, block_k=64),),
}
# Entries the search promoted, by (bucket max rows, N, K), bf16 on a 132-SM GPU (the
# H200) only, applied before the ladder. Source: areal_tik/optimize's mechanical proposer
# at 796df79 (eval/results/2026-12-02_h200_796df79/: run optimize_linear, candidate c0913,
# audit a0915, 7 rounds): T(root)/T = 1.080 over the 40 workloads of the supported models'
# projections at 1/16/64/1024/4096 rows; every workload it changes (35 of 40) at 0.76-0.98x
# the ladder's latency (Qwen3-0.6B gate|up at 1024 rows 0.764x), none over the 1.05x cap; the
# gate (bits equal to the ladder's on every workload, row invariance, the anti-hacking
# checks) passed. Rows above 4096, which the search did not time, keep the ladder. Every
# entry is a config of _GPU_CANDIDATES or of the ladders (the contract test proves each).
# Second run (TUNED_SOURCES, routed as ``load_tuned`` does): the same proposer at 00d371a on
# an H100 (132 SMs; eval/results/2026-12-07_h100_00d371a/: optimize_linear.log, its run
# directory), 70 workloads (bench_linear's 14 projections x 1/16/64/1024/4096 rows), 150 s:
# 4096 candidates, 10 audited, 10 passing, 3 promoted; best c4784, audit a5673, T(root)/T =
# 1.025; the 13 groups it changes at 0.80-0.97x the root's latency on their workloads
# (Qwen3-1.7B qkv at 1024 rows 32.1 -> 25.6 us), none over the cap. b4096:2048x6144 (the file's
# "binf") replaced c0913's 128x256/s3/P; b64:2048x8192 (BLOCK_K 256) replaced the probe's wide-K entry.
# Search groups are one weight shape in one of ``_TUNED_BOUNDS``' row ranges: the ladders'
# buckets with the last one cut at 4096 rows, so the rows above it, which the first two runs
# never timed (their largest workload: 4096 rows), are a group of their own ("binf"), timed at
# 16384 rows since 2026-12-07. Until then "binf" named rows above 1024 and entries stopped at
# 4096 rows; those runs' groups are the "b4096" groups here (``file_groups`` reads their files).
TUNED_SOURCES = ("eval/results/2026-12-07_h100_00d371a/linear_tiles_searched.json",)
_TUNED_SMS = 132
_TUNED_BOUNDS = (64, 128, 256, 512, 1024, 4096, None)
_TUNED_BF16 = {
    (64, 1024, 2048): _cfg(64, 16, 4, 6), (64, 1024, 3072): _cfg(64, 16, 4, 6),
    (64, 151936, 1024): _cfg(64, 128, 4, 3), (64, 2048, 6144): _cfg(64, 16, 4, 6),
    (64, 3072, 2048): _cfg(64, 32, 4, 6), (64, 4096, 1024): _cfg(64, 32, 4, 6),
    (64, 6144, 1024): _cfg(64, 64, 4, 6),
    (1024, 12288, 2048): _cfg(128, 256, 8, 3, "PS"), (1024, 151936, 1024): _cfg(128, 256, 8, 4, "PS"),
    (1024, 2048, 6144): _cfg(128, 128, 4, 4, "P"), (1024, 3072, 2048): _cfg(128, 256, 8, 3, "PS"),
    (1024, 4096, 1024): _cfg(128, 256, 8, 3, "PS"), (1024, 6144, 1024): _cfg(128, 128, 4, 4, "P"),
    (4096, 1024, 2048): _cfg(128, 256, 8, 4, "PS"), (4096, 1024, 3072): _cfg(128, 256, 8, 4, "PS"),
    (4096, 12288, 2048): _cfg(128, 256, 8, 4, "PS"), (4096, 151936, 1024): _cfg(128, 256, 8, 4, "PS"),
    (4096, 2048, 6144): _cfg(128, 256, 8, 4, "PS"), (4096, 3072, 2048): _cfg(128, 256, 8, 4, "PS"),
    (4096, 4096, 1024): _cfg(128, 256, 8, 3, "PS"), (4096, 6144, 1024): _cfg(128, 256, 8, 4, "PS"),
    # The second linear search run (TUNED_SOURCES), on bench_linear's 14 projections: the shapes
    # the first never timed (Qwen3-1.7B qkv / o / up, Llama-3.2-1B o / gate_up / down).
    (64, 6144, 2048): _cfg(64, 64, 4, 6),
    (1024, 2048, 2048): _cfg(128, 128, 4, 4, "P"), (1024, 2048, 8192): _cfg(128, 128, 4, 4, "P"),
    (1024, 4096, 2048): _cfg(128, 256, 8, 4, "PS"), (1024, 6144, 2048): _cfg(128, 128, 4, 4, "P"),
    (1024, 16384, 2048): _cfg(128, 256, 8, 4, "PS"),
    (4096, 2048, 2048): _cfg(128, 256, 8, 4, "PS"), (4096, 2048, 8192): _cfg(128, 256, 8, 3, "PS"),
    (4096, 4096, 2048): _cfg(128, 256, 8, 4, "PS"), (4096, 6144, 2048): _cfg(128, 256, 8, 4, "PS"),
    (4096, 16384, 2048): _cfg(128, 256, 8, 4, "PS"),
}


# Wide-K entries: decode-sized launches (the first bucket) whose chain takes fewer, wider
# K steps (BLOCK_K 128 / 256 instead of 64; the same k16 wgmma chain, so the same bits).
# At <= 64 rows a narrow layer's time is the sequential chain's step latency, not its
# bytes (Qwen3-0.6B o_proj: 64 programs x 32 steps of 2 KiB in 7.7 us on the H200), so
# fewer steps is the lever the contract leaves free where a K split is not. Checked before
# ``_TUNED_BF16`` while ``wide_k`` is on (``linear.WIDE_K``); an entry's BLOCK_K divides its
# K (no masked tail; ``load_wide_k`` and tests/test_linear.py check it). Source: eval/probe_block_k.py at 85e8ca9 on an H100
# (132 SMs, as the H200; eval/results/2026-12-07_h100_85e8ca9/: linear_tiles_promoted.json):
# each candidate bit-equal to the table's fp32 chain at 1 and 64 rows on normal, wide-exponent
# and cancelling inputs, then promoted by the rule fixed before timing (1 + 64 rows <= 0.97x
# the table's, neither row count > 1.02x): o / down of Qwen3-0.6B, Qwen3-1.7B and
# Llama-3.2-1B at 0.78-0.93x the table's time (Qwen3-1.7B down 18.0 -> 14.6 us at 1 row),
# Qwen3-1.7B qkv / gate_up and Llama qkv at 0.95-0.97x; Qwen3-0.6B qkv / gate_up and Llama
# gate_up kept the ladder. ``AREAL_TIK_LINEAR_TILES=<json>`` adds a run's entries (``load_wide_k``).
# The runs whose promotions the table holds, merged in order (a later run's entry replaces an
# earlier one's; tests/test_linear.py checks the table against them).
WIDE_K_SOURCES = ("eval/results/2026-12-07_h100_85e8ca9/linear_tiles_promoted.json",
                  # the search's wide-K groups (load_tuned routes them here): Llama-3.2-1B down
                  "eval/results/2026-12-07_h100_00d371a/linear_tiles_searched.json")
_WIDE_K_BF16: dict[tuple, TileConfig] = {
    (64, 1024, 2048): _cfg(64, 16, 4, 5, block_k=256), (64, 1024, 3072): _cfg(64, 16, 4, 5, block_k=256),
    (64, 2048, 2048): _cfg(64, 16, 4, 5, block_k=128), (64, 2048, 6144): _cfg(64, 16, 4, 5, block_k=256),
    (64, 2048, 8192): _cfg(64, 16, 4, 5, block_k=256), (64, 3072, 2048): _cfg(64, 32, 4, 8, block_k=128),
    (64, 4096, 2048): _cfg(64, 32, 4, 8, block_k=128), (64, 12288, 2048): _cfg(64, 64, 4, 3, block_k=128),
}


def _check_whole_k_steps(key: str, k: int, cfg: TileConfig) -> None:
    # An entry wider than the ladders' BLOCK_K 64 must divide its K: no masked tail block
    # (``tuned`` serves it for its key's K without looking again).
    if cfg.block_k > 64 and k % cfg.block_k:
        raise ValueError(f"entry {key} {cfg}: BLOCK_K {cfg.block_k} does not divide K = {k}")


def load_wide_k(entries: dict) -> int:
    """Add wide-K entries as eval/probe_block_k.py writes them ({"max_rows,n,k": {TileConfig
    fields}}: its JSON's "linear" section); returns how many. Refuses an entry whose BLOCK_K
    is not a multiple of 16 or does not divide its K, or that is persistent."""
    for key, fields in entries.items():
        max_rows, n, k = (int(v) for v in key.split(","))
        cfg = TileConfig(**fields)
        if cfg.block_k % 16 or cfg.persistent:
            raise ValueError(f"entry {key} {cfg} is not a wide-K decode tile (BLOCK_K a multiple of "
                             f"16, tiled kernel)")
        _check_whole_k_steps(key, k, cfg)
        _WIDE_K_BF16[(max_rows, n, k)] = cfg
    _select.cache_clear()
    return len(entries)


def group_name(max_rows: int | None, n: int, k: int) -> str:
    """A search group's key: "b<max_rows>:<N>x<K>", "binf" for the last row range."""
    return f"b{max_rows if max_rows is not None else 'inf'}:{n}x{k}"


def search_bounds() -> tuple:
    """The row ranges' upper bounds of the search groups in this process: ``_TUNED_BOUNDS``
    on the GPU, the interpreter's buckets there (its tiny search)."""
    return tuple(b for b, _ in _CPU_TABLE) if interpreting() else _TUNED_BOUNDS


def search_group(rows: int, n: int, k: int) -> str:
    """The search group of a launch (``search_bounds``' row range and the weight shape)."""
    return group_name(next(b for b in search_bounds() if b is None or rows <= b), n, k)


def group_key(key: str) -> tuple:
    """(max_rows, N, K) of a GPU search group key (``group_name``'s inverse)."""
    bounds = {group_name(b, 0, 0).partition(":")[0]: b for b in _TUNED_BOUNDS}
    bucket, _, shape = key.partition(":")
    n, _, k = shape.partition("x")
    if bucket not in bounds or not (n.isdigit() and k.isdigit()):
        raise ValueError(f"tuned entry key {key!r} is not 'b<max_rows>:<N>x<K>' with max_rows in "
                         f"{sorted(bounds)}")
    return bounds[bucket], int(n), int(k)


def search_file_fields() -> dict:
    """What a search file records beside its groups (eval/optimize_gpu.py writes it): the
    row ranges its keys name."""
    return {"tuned_bounds": [group_name(b, 0, 0).partition(":")[0] for b in _TUNED_BOUNDS]}


def file_groups(tiles: dict) -> dict:
    """A search file's "tuned" groups, keyed as this table names them. A file that records
    its row ranges ("tuned_bounds") must record these; one from before the 4096-row cut
    records none, and its "binf" (rows above 1024, timed at 4096 rows at most) is "b4096"."""
    groups = dict(tiles.get("tuned", {}))
    if "tuned_bounds" in tiles:
        if tiles["tuned_bounds"] != search_file_fields()["tuned_bounds"]:
            raise ValueError(f"search file's row ranges {tiles['tuned_bounds']} are not this table's "
                             f"{search_file_fields()['tuned_bounds']}")
        return groups
    return {("b4096:" + key[len("binf:"):] if key.startswith("binf:") else key): fields
            for key, fields in groups.items()}


def is_wide_k(cfg: TileConfig) -> bool:
    """A tiled entry with K steps wider than the ladders' 64: the ``WIDE_K`` switch's."""
    return cfg.block_k > 64 and not cfg.persistent


def load_tuned(entries: dict) -> int:
    """Add search-promoted entries as a linear search run's best config holds them
    ({"b<max_rows>:<N>x<K>": {TileConfig fields}}: the JSON's "tuned" section, written by
    eval/optimize_gpu.py --tiles-out); returns how many. Each replaces whatever served its
    (bucket, N, K): the search timed it against the table as it stood and it won. A wide-K
    entry (``is_wide_k``) goes to ``_WIDE_K_BF16``, so ``WIDE_K`` off still means no K step
    above 64; any other to ``_TUNED_BF16``, dropping a wide-K entry of the same key. Refuses
    a key that names no bucket, a config the GPU contract test does not run (not in
    ``linear_candidates``: the search proposes only those, so anything else is not its) and a
    BLOCK_K above 64 that does not divide K (as ``load_wide_k``)."""
    known = set(linear_candidates(torch.bfloat16, gpu=True))
    for key, fields in entries.items():
        where, cfg = group_key(key), TileConfig(**fields)
        if cfg not in known:
            raise ValueError(f"tuned entry {key} {cfg} is not a config the contract test runs "
                             f"(linear_candidates)")
        _check_whole_k_steps(key, where[2], cfg)
        if is_wide_k(cfg):
            _WIDE_K_BF16[where] = cfg
        else:
            _WIDE_K_BF16.pop(where, None)
            _TUNED_BF16[where] = cfg
    _select.cache_clear()
    return len(entries)


def tuned(rows: int, n: int, k: int, dtype: torch.dtype, tma: bool, sms: int, wide_k: bool = True) -> TileConfig | None:
    """The promoted entry for this launch on the GPU (``_WIDE_K_BF16`` while ``wide_k``,
    then ``_TUNED_BF16``) for its search group (``_TUNED_BOUNDS`` row range, N, K), or None
    (the ladder decides): other dtypes or SM counts, a group no search promoted (rows above
    4096 until a search timed at 16384 rows promotes one), or a persistent entry where TMA
    cannot run."""
    if dtype != torch.bfloat16 or sms != _TUNED_SMS:
        return None
    for max_rows in _TUNED_BOUNDS:
        if max_rows is None or rows <= max_rows:
            wide = _WIDE_K_BF16.get((max_rows, n, k)) if wide_k else None
            if wide is not None:  # (its BLOCK_K divides this K: the key's, checked on entry)
                return wide
            cfg = _TUNED_BF16.get((max_rows, n, k))
            return None if cfg is None or (cfg.persistent and not tma) else cfg
    raise AssertionError("_TUNED_BOUNDS must end with None")


# Interpreter: tiny tiles (a 128^3 interpreted matmul takes ~0.3 s) and small thresholds
# so that tiny CPU tests cross a geometry change as the GPU buckets do. The persistent
# kernel is never selected here; the tests run it through explicit candidates.
_CPU_TABLE = (
    (4, (_rung(16, 16, 4, 3, block_k=16),)),
    (32, (_rung(16, 32, 4, 3, block_k=16),)),
    (None, (_rung(32, 32, 4, 3, block_k=16),)),
)
_CPU_BUCKETS = {torch.bfloat16: _CPU_TABLE, torch.float32: _CPU_TABLE}
_CPU_FIXED = {torch.bfloat16: _cfg(16, 16, 4, 3, block_k=16), torch.float32: _cfg(16, 16, 4, 3, block_k=16)}
_CPU_CANDIDATES = (_cfg(16, 32, 4, 3, "P", block_k=16), _cfg(32, 32, 4, 3, "PS", block_k=16),
                   _cfg(16, 16, 4, 3, block_k=32), _cfg(16, 32, 4, 3, "P", block_k=32))  # wider K steps
_CPU_PROGRAMS = 3  # "SMs" of the interpreted persistent kernel: programs loop over tiles
_REFERENCE_SMS = 132  # the H200's SM count: used where no GPU is present


# The K-group tree (G > 1) keeps log2(G) + 1 fp32 tiles live (_linear_chain), each
# BLOCK_M * BLOCK_N / (32 * num_warps) registers a thread; ptxas (sm_90a, triton 3.6)
# spilled once they took more than about 192 (256x128/w8: 0.5 KB at G = 2, 4.4 KB at
# G = 8; 128x128/w8 and 64x128/w4 none up to G = 4; 128x64/w8, 64x64/w4 none at G = 8).
_TREE_ACC_REGS = 192


def tree_tile(cfg: TileConfig, k_groups: int) -> TileConfig:
    """``cfg`` for the plain chain; with ``k_groups`` > 1, a tile whose live accumulators
    fit the registers: BLOCK_M halved down to 128, then BLOCK_N down to 64, then BLOCK_M
    down to 64, with at least 4 stages (the smaller tile's shared memory). BLOCK_K, warps,
    kernel and MMA family stay: the same bits (the GPU contract test runs both)."""
    if k_groups == 1:
        return cfg
    live, bm, bn = k_groups.bit_length(), cfg.block_m, cfg.block_n  # bit_length: log2(G) + 1
    while live * bm * bn > _TREE_ACC_REGS * 32 * cfg.num_warps and (bm > 64 or bn > 64):
        if bm > 128 or (bn <= 64 and bm > 64):
            bm //= 2
        else:
            bn //= 2
    if (bm, bn) == (cfg.block_m, cfg.block_n):
        return cfg
    return dataclasses.replace(cfg, block_m=bm, block_n=bn, num_stages=max(cfg.num_stages, 4), split_epilogue=False)


def buckets(dtype: torch.dtype) -> tuple:
    """The ((max_rows, ladder), ...) table used for ``dtype`` in this process."""
    return (_CPU_BUCKETS if interpreting() else _GPU_BUCKETS)[dtype]


def linear_candidates(dtype: torch.dtype, candidates: bool = True, gpu: bool | None = None) -> tuple:
    """Every config that must give identical bits for ``dtype``: table, fixed, candidates
    (the GPU's or the interpreter's set: ``gpu``, default not ``interpreting()``)."""
    gpu = not interpreting() if gpu is None else gpu
    if gpu:
        table, fixed, extra = _GPU_BUCKETS, _GPU_FIXED, _GPU_CANDIDATES
    else:
        table, fixed, extra = _CPU_BUCKETS, _CPU_FIXED, {dtype: _CPU_CANDIDATES}
    configs = [cfg for _, ladder in table[dtype] for cfg, _, _ in ladder] + [fixed[dtype]]
    if dtype == torch.bfloat16 and gpu:
        configs += list(_TUNED_BF16.values()) + list(_WIDE_K_BF16.values())
    configs += list(extra[dtype]) if candidates else []
    return tuple(dict.fromkeys(configs))


def row_probes(dtype: torch.dtype, max_rows: int) -> list[int]:
    """Row counts in [1, max_rows] at which ``linear.linear_config`` (any shape, SM count,
    TMA or k_groups) or its ``rows < BLOCK_M`` flag may differ from the row before: every
    row up to the largest BLOCK_M, then the first row of each run of ``step`` rows, where
    ``step`` divides every BLOCK_M (tree tiles halve to >= 64), bucket bound and the
    promoted entries' limit. Inside such a run the bucket, ``cdiv(rows, BLOCK_M)`` of
    every config (hence its grid and the rung it picks) and the flag stay the same, so a
    warm-up that visits these rows meets every launch variant (checked against every row
    in tests/test_compile_keys.py) with ~500 calls instead of 16384."""
    configs = linear_candidates(dtype)
    block_ms = [cfg.block_m for cfg in configs] + ([64] if any(cfg.block_m > 64 for cfg in configs) else [])
    bounds = [b for b in {*(b for b, _ in buckets(dtype)), *search_bounds()} if b is not None]
    step = functools.reduce(math.gcd, block_ms + bounds)
    head = max(block_ms)
    return sorted({*range(1, min(head, max_rows) + 1), *range(head + 1, max_rows + 1, step)})


@functools.lru_cache(maxsize=4096)  # ~7 us of Python per call otherwise (launch overhead)
def _select(rows, n, k, dtype, tma, sms, fixed_tile, interpret, wide_k=True) -> TileConfig:
    if fixed_tile:
        return (_CPU_FIXED if interpret else _GPU_FIXED)[dtype]
    promoted = None if interpret else tuned(rows, n, k, dtype, tma, sms, wide_k)
    if promoted is not None:
        return promoted
    for max_rows, ladder in (_CPU_BUCKETS if interpret else _GPU_BUCKETS)[dtype]:
        if max_rows is None or rows <= max_rows:
            span = rows if max_rows is None else max_rows
            usable = [rung for rung in ladder if tma or not rung[0].persistent]
            for cfg, min_programs, per_sm in usable:
                programs = triton.cdiv(span, cfg.block_m) * triton.cdiv(n, cfg.block_n)
                if programs >= min_programs and (per_sm == 0 or programs <= per_sm * sms):
                    return cfg
            return usable[-1][0]
    raise AssertionError("bucket table must end with max_rows=None")


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[bool, int]:
    """(TMA-capable, number of SMs) of CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


load_wide_k(measured_overrides("linear"))  # an experiment's entries (AREAL_TIK_LINEAR_TILES), if any
load_tuned(file_groups(measured_file()))  # a search run's promoted groups (the same file), if any

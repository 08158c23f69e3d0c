"""The linear op for the search: workloads, inputs, contract checks, knobs.

Config: {group key: TileConfig fields}, where a group is one weight shape in one row range
of ``_linear_tiles._TUNED_BOUNDS`` (key "b<max_rows>:<N>x<K>", "binf" for rows above 4096);
groups without an entry use the kernel's own ``linear_config``. The root config
is {} (the kernel's table as it stands). A knob move sets one group to another geometry
from ``linear.linear_candidates`` (BLOCK_K any multiple of 16: the same k16 chain); the
contract checks, not the variant list, decide whether its bits are the root's.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .checks import expect_bits, root_bits
from .ops import Op, Workload, restrict_groups

L = importlib.import_module("areal_tik.unified_kernels.linear")
T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")

# (model, layer, K, N): the projections of the supported models' configs (q/k/v and gate/up
# packed, as the model launches them; Qwen3-1.7B's single "up" as a reference cuBLAS shape).
# eval/bench_linear.py times the same list against cuBLAS (issue 15's linear targets).
MODEL_PROJECTIONS = (
    ("qwen3-0.6b", "qkv", 1024, 2048 + 2 * 1024), ("qwen3-0.6b", "o", 2048, 1024),
    ("qwen3-0.6b", "gate_up", 1024, 2 * 3072), ("qwen3-0.6b", "down", 3072, 1024),
    ("qwen3-0.6b", "lm_head", 1024, 151936),
    ("qwen3-1.7b", "qkv", 2048, 2048 + 2 * 1024), ("qwen3-1.7b", "o", 2048, 2048),
    ("qwen3-1.7b", "up", 2048, 6144), ("qwen3-1.7b", "gate_up", 2048, 2 * 6144),
    ("qwen3-1.7b", "down", 6144, 2048),
    ("llama-3.2-1b", "qkv", 2048, 32 * 64 + 2 * 8 * 64), ("llama-3.2-1b", "o", 2048, 2048),
    ("llama-3.2-1b", "gate_up", 2048, 2 * 8192), ("llama-3.2-1b", "down", 8192, 2048),
)
# (name, N, K) workload shapes; until 2026-12-07 8 of these 14 (the search promoted c0913 on
# those), which left the misses of bench_linear at 1024 rows (Qwen3-1.7B qkv / o / up,
# Llama-3.2-1B o) outside every run.
H200_SHAPES = tuple((f"{model}.{layer}", n, k) for model, layer, k, n in MODEL_PROJECTIONS)
# Row counts: decode (1 / 16 / 64), prefill chunks and micro-batches (1024 / 4096) and, since
# 2026-12-07, a 16K-token training micro-batch (the "binf" groups: bench_linear's 16384-row
# misses, Qwen3-0.6B at 0.85-0.89x cuBLAS, lay outside every earlier run).
H200_TOKENS = (1, 16, 64, 1024, 4096, 16384)
TINY_SHAPES = (("tiny.a", 24, 32), ("tiny.b", 40, 48))
TINY_TOKENS = (1, 5, 40)
_FIELDS = {f.name: f.type for f in dataclasses.fields(L.TileConfig)}


def group_key(rows: int, n: int, k: int) -> str:
    """The group of a launch: its row range (this process's search groups) and weight shape."""
    return T.search_group(rows, n, k)


class LinearImpl:
    """The linear kernels with a per-group config (absent groups: the kernel's table)."""

    def __init__(self, config: dict):
        self.config = config
        self.tiles = {key: L.TileConfig(**fields) for key, fields in config.items()}
        self.modules = (L,)

    def tile(self, rows: int, n: int, k: int):
        return self.tiles.get(group_key(rows, n, k))

    def forward(self, x2d, weight, bias):
        return L.linear_forward(x2d, weight, bias, config=self.tile(x2d.shape[0], *weight.shape))


class LinearOp(Op):
    name = "linear"
    entry_points = ("forward",)
    signatures = ("forward(x2d [M, K] bf16, weight [N, K] bf16, bias None) -> out [M, N] bf16",)
    kernel_files = ("linear.py", "_linear_chain.py", "_linear_tiles.py", "_common.py")

    def __init__(self, grid: str = "h200"):
        if grid not in ("h200", "tiny"):
            raise ValueError(f"linear grid must be 'h200' or 'tiny', got {grid!r}")
        self.grid = grid

    @property
    def kernel_modules(self):
        return (L,)

    def root_config(self) -> dict:
        return {}

    def normalise(self, config: dict) -> dict:
        if not isinstance(config, dict):
            raise TypeError(f"linear config must be a dict of group -> tile fields, got {config!r}")
        out = {}
        for key, fields in config.items():
            if not (isinstance(key, str) and key.startswith("b") and ":" in key):
                raise ValueError(f"linear config keys are 'b<max_rows>:<N>x<K>', got {key!r}")
            unknown = set(fields) - set(_FIELDS)
            if unknown:
                raise ValueError(f"unknown TileConfig fields {sorted(unknown)} for {key!r}; "
                                 f"accepted: {sorted(_FIELDS)}")
            out[key] = dataclasses.asdict(L.TileConfig(**fields))
        return dict(sorted(out.items()))

    def config_impl(self, config: dict):
        return LinearImpl(self.normalise(config))

    def workloads(self, grid: str) -> list[Workload]:
        shapes, tokens = (H200_SHAPES, H200_TOKENS) if grid == "h200" else (TINY_SHAPES, TINY_TOKENS)
        return [Workload(f"{name}.m{m}", "linear", {"m": m, "n": n, "k": k})
                for name, n, k in shapes for m in tokens]

    def make_inputs(self, w, seed, device) -> dict:
        p = w.params
        inputs = {"x": torch.empty(p["m"], p["k"], dtype=torch.bfloat16, device=device),
                  "weight": torch.empty(p["n"], p["k"], dtype=torch.bfloat16, device=device)}
        self.refill(w, inputs, seed)
        return inputs

    def refill(self, w, inputs, seed, scale=1.0) -> None:
        gen = torch.Generator(inputs["x"].device).manual_seed(seed)
        inputs["x"].normal_(0.0, scale, generator=gen)
        inputs["weight"].normal_(0.0, scale * w.params["k"] ** -0.5, generator=gen)

    def call(self, impl, w, inputs) -> tuple:
        return (impl.forward(inputs["x"], inputs["weight"], None),)

    def check_workloads(self, device) -> list[Workload]:
        n, k = (1024, 2048) if device.type == "cuda" else (24, 32)
        return [Workload("check.linear", "linear", {"m": 37 if device.type == "cuda" else 7, "n": n, "k": k})]

    def contract(self, device) -> list:
        return [("root_bits", lambda impl, root: root_bits(self, impl, root, device, 1000)),
                ("row_invariance", lambda impl, root: self._row_invariance(impl, device))]

    def _row_invariance(self, impl, device) -> None:
        # Row r's bits depend on row r only: a prefix of m rows (any bucket) must give the
        # first m rows of the largest call, bit for bit.
        tokens = sorted({m for w in self.workloads(self.grid) for m in (w.params["m"], w.params["m"] + 1)})
        for name, n, k in sorted({(w.name.rsplit(".m", 1)[0], w.params["n"], w.params["k"])
                                  for w in self.workloads(self.grid)}):
            big = Workload(name, "linear", {"m": tokens[-1], "n": n, "k": k})
            inputs = self.make_inputs(big, 77, device)
            full = impl.forward(inputs["x"], inputs["weight"], None)
            for m in tokens[:-1]:
                expect_bits(f"row_invariance: {name} first {m} of {tokens[-1]} rows",
                            impl.forward(inputs["x"][:m], inputs["weight"], None), full[:m])

    def expected_launches(self, config, w, inputs) -> list:
        impl = LinearImpl(config)
        x, weight = inputs["x"], inputs["weight"]
        tma = L.tma_compatible(x, weight)
        cfg = impl.tile(*x.shape[:1], *weight.shape)
        if cfg is None:
            sms = L._device_info(x.device.index or 0)[1] if x.is_cuda else L._REFERENCE_SMS
            cfg = L.linear_config(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, tma=tma, sms=sms)
        kernel = "_linear_fwd_persistent_kernel" if cfg.persistent and tma else "_linear_fwd_kernel"
        return [(kernel, {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                          "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})]

    def moves(self, config: dict) -> list[dict]:
        impl = LinearImpl(config)
        # Variant-major order: one geometry (one compile) across all groups before the
        # next, so a budget cut leaves whole geometries untried, not whole groups.
        moves = []
        for cfg in L.linear_candidates(torch.bfloat16):
            for w in self.workloads(self.grid):
                m, n, k = w.params["m"], w.params["n"], w.params["k"]
                current = impl.tile(m, n, k) or L.linear_config(m, n, k, torch.bfloat16)
                if cfg == current or not self._plausible(cfg, m):
                    continue
                move = {group_key(m, n, k): dataclasses.asdict(cfg)}
                if move not in moves:
                    moves.append(move)
        return moves

    @staticmethod
    def _plausible(cfg, rows: int) -> bool:
        # As eval/bench_linear.py --sweep: tall tiles and the persistent kernel only pay
        # from 512 rows; decode-sized tiles (BLOCK_M 64, narrow) not above 1024.
        if rows < 512 and (cfg.block_m > 64 or cfg.persistent):
            return False
        return not (rows > 1024 and cfg.block_m == 64 and cfg.block_n < 128)

    def restrict(self, delta: dict, winners: set, workloads) -> dict:
        # A group (row bucket, N, K) stays only when every workload it holds was faster
        # than the root (H200 at 8443ba9: qkv at 1024 rows 0.76-0.80x, o at 1024 1.059x).
        return restrict_groups(delta, winners, workloads,
                               lambda w: group_key(w.params["m"], w.params["n"], w.params["k"]))

    def affects(self, delta, w) -> bool:
        return group_key(w.params["m"], w.params["n"], w.params["k"]) in delta

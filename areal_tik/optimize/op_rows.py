"""Row-wise ops for the search: RMSNorm (with and without the residual add), RoPE, SwiGLU.

Each kernel keeps a launch-geometry table keyed by shape, never by the row count
(``rms_norm.norm_config(H)``, ``rope.rope_config(Hq, Hk, D)``, ``swiglu.silu_config(I)``).
Config: {table key: config fields}; keys absent use the kernel's table, so the root is {}.
A move sets one key to another entry of the kernel's own candidate list
(``norm_candidates`` etc., the list ``eval/bench_pointwise.py --sweep`` times). The
kernels' documentation says the RoPE and SwiGLU geometries cannot change a bit and that
RMSNorm geometries putting another number of warps on a row can: the contract suite
(bits equal to the root on every workload, row invariance) decides, not that text.

Workloads (grid "h200"): the supported models' widths (Qwen3-0.6B, Qwen3-1.7B,
Llama-3.2-1B) at 1/16/64/1024/4096 rows (the linear grid's, less its 16384). Grid "tiny": widths small
enough for the CPU interpreter.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .checks import expect_bits, root_bits
from .ops import Op, Workload, restrict_groups

N = importlib.import_module("areal_tik.unified_kernels.rms_norm")
R = importlib.import_module("areal_tik.unified_kernels.rope")
S = importlib.import_module("areal_tik.unified_kernels.swiglu")

H200_ROWS = (1, 16, 64, 1024, 4096)
TINY_ROWS = (1, 3, 9)
_BF16 = torch.bfloat16


class _TableImpl:
    def __init__(self, op, config: dict):
        self.op, self.config = op, config
        self.entries = {key: op.config_type(**fields) for key, fields in config.items()}
        self.modules = (op.module,)

    def forward(self, **inputs):
        return self.op.launch(self, **inputs)


class _TableOp(Op):
    """Shared logic: a per-shape table config, fresh bf16 inputs, root bits and row invariance."""

    entry_points = ("forward",)
    kernel_files = ("_common.py", "_rounding.py")
    module = config_type = None
    row_inputs: tuple = ()  # the inputs with one row per output row
    shapes: dict = {}  # grid -> ((name, params), ...)

    def __init__(self, grid: str = "h200"):
        if grid not in self.shapes:
            raise ValueError(f"{self.name} grid must be one of {sorted(self.shapes)}, got {grid!r}")
        self.grid = grid

    @property
    def kernel_modules(self):
        return (self.module,)

    def root_config(self) -> dict:
        return {}

    def normalise(self, config: dict) -> dict:
        if not isinstance(config, dict):
            raise TypeError(f"{self.name} config must be a dict of table key -> fields, got {config!r}")
        fields = {f.name for f in dataclasses.fields(self.config_type)}
        out = {}
        for key, entry in config.items():
            if not isinstance(key, str) or not isinstance(entry, dict) or set(entry) - fields:
                raise ValueError(f"{self.name} config entries are '<table key>': {{{sorted(fields)}}}, "
                                 f"got {key!r}: {entry!r}")
            out[key] = dataclasses.asdict(self.config_type(**entry))
        return dict(sorted(out.items()))

    def config_impl(self, config: dict):
        return _TableImpl(self, self.normalise(config))

    def entry(self, impl, params):
        return impl.entries.get(self.key(params)) or self.table(params)

    def workloads(self, grid: str) -> list[Workload]:
        rows = H200_ROWS if grid == "h200" else TINY_ROWS
        return [Workload(f"{name}.m{m}", self.name, {**params, "m": m})
                for name, params in self.shapes[grid] for m in rows]

    def make_inputs(self, w, seed, device) -> dict:
        inputs = {name: torch.empty(shape, dtype=_BF16, device=device)
                  for name, shape in self.shapes_of(w.params).items()}
        inputs.update(self.fixed(w.params, device))
        self.refill(w, inputs, seed)
        return inputs

    def refill(self, w, inputs, seed, scale=1.0) -> None:
        gen = torch.Generator(device=next(iter(inputs.values())).device).manual_seed(seed)
        for name in self.shapes_of(w.params):
            inputs[name].normal_(0.0, scale, generator=gen)

    def call(self, impl, w, inputs) -> tuple:
        return tuple(impl.forward(**inputs))

    def check_workloads(self, device) -> list[Workload]:
        name, params = self.shapes[self.grid][-1]
        return [Workload(f"check.{name}", self.name, {**params, "m": 37 if device.type == "cuda" else 7})]

    def contract(self, device) -> list:
        return [("root_bits", lambda impl, root: root_bits(self, impl, root, device, 2000)),
                ("row_invariance", lambda impl, root: self._row_invariance(impl, device))]

    def _row_invariance(self, impl, device) -> None:
        # Row r's bits depend on row r only: a prefix of m rows gives the first m rows of
        # the largest call, bit for bit (m runs over the grid's row counts and one past).
        rows = sorted({m for w in self.workloads(self.grid) for m in (w.params["m"], w.params["m"] + 1)})
        for name, params in self.shapes[self.grid]:
            big = Workload(name, self.name, {**params, "m": rows[-1]})
            inputs = self.make_inputs(big, 78, device)
            full = self.call(impl, big, inputs)
            for m in rows[:-1]:
                part = {k: (v[:m] if k in self.row_inputs else v) for k, v in inputs.items()}
                got = self.call(impl, Workload(name, self.name, {**params, "m": m}), part)
                expect_bits(f"row_invariance: {name} first {m} of {rows[-1]} rows", got,
                            tuple(t[:m] for t in full))

    def moves(self, config: dict) -> list[dict]:
        impl, moves = self.config_impl(config), []
        for name, params in self.shapes[self.grid]:
            current = self.entry(impl, params)
            for cfg in self.candidates(params):
                move = {self.key(params): dataclasses.asdict(cfg)}
                if cfg != current and move not in moves:
                    moves.append(move)
        return moves

    def affects(self, delta, w) -> bool:
        return self.key(w.params) in delta

    def restrict(self, delta: dict, winners: set, workloads) -> dict:
        return restrict_groups(delta, winners, workloads, lambda w: self.key(w.params))

    def fixed(self, params, device) -> dict:
        return {}


class NormOp(_TableOp):
    name, module, config_type = "norm", N, N.NormConfig
    row_inputs = ("x", "residual")
    kernel_files = ("rms_norm.py", *_TableOp.kernel_files)
    signatures = ("forward(x [M, H] bf16, weight [H] bf16, residual [M, H] bf16 or absent) -> "
                  "(normed,) or (normed, x + residual)",)
    shapes = {"h200": (("qwen3-0.6b.norm", {"h": 1024, "residual": True}),
                       ("qwen3-1.7b.norm", {"h": 2048, "residual": True}),
                       ("qwen3.qk_norm", {"h": 128, "residual": False})),
              "tiny": (("tiny.add_norm", {"h": 48, "residual": True}), ("tiny.norm", {"h": 32, "residual": False}))}

    def key(self, p) -> str:
        return f"H{p['h']}"

    def table(self, p):
        return N.norm_config(p["h"])

    def candidates(self, p):
        return N.norm_candidates(p["h"])

    def shapes_of(self, p) -> dict:
        names = ("x", "residual") if p["residual"] else ("x",)
        return {**{n: (p["m"], p["h"]) for n in names}, "weight": (p["h"],)}

    def launch(self, impl, x, weight, residual=None):
        y, s = N._forward(x, residual, weight, 1e-6, config=self.entry(impl, {"h": x.shape[-1]}))
        return (y, s) if residual is not None else (y,)

    def expected_launches(self, config, w, inputs) -> list:
        cfg = self.entry(self.config_impl(config), w.params)
        return [("_rms_norm_fwd_kernel", {"BLOCK": cfg.block, "N_CHUNKS": cfg.n_chunks, "ROWS": cfg.rows,
                                          "num_warps": cfg.num_warps})]


class RopeOp(_TableOp):
    name, module, config_type = "rope", R, R.RopeConfig
    row_inputs = ("q", "k", "positions")
    kernel_files = ("rope.py", *_TableOp.kernel_files)
    signatures = ("forward(q [M, Hq, D] bf16, k [M, Hk, D] bf16, positions [M] int64, cos, sin "
                  "[P, D / 2] fp32) -> (q_out, k_out)",)
    shapes = {"h200": (("qwen3.rope", {"hq": 16, "hk": 8, "d": 128}),
                       ("llama-3.2-1b.rope", {"hq": 32, "hk": 8, "d": 64})),
              "tiny": (("tiny.rope", {"hq": 2, "hk": 1, "d": 16}),)}

    def key(self, p) -> str:
        return f"{p['hq']}x{p['hk']}x{p['d']}"

    def table(self, p):
        return R.rope_config(p["hq"], p["hk"], p["d"])

    def candidates(self, p):
        return R.rope_candidates(p["hq"], p["hk"], p["d"])

    def shapes_of(self, p) -> dict:
        return {"q": (p["m"], p["hq"], p["d"]), "k": (p["m"], p["hk"], p["d"])}

    def fixed(self, p, device) -> dict:
        # Positions past the first rows' (a packed batch's later sequences), same for every round.
        table = 8192 if self.grid == "h200" else 64
        cos, sin = R.rope_cos_sin(table, p["d"], device=device)
        positions = (torch.arange(p["m"], device=device) * 37 + 5) % table
        return {"positions": positions, "cos": cos, "sin": sin}

    def launch(self, impl, q, k, positions, cos, sin):
        cfg = self.entry(impl, {"hq": q.shape[1], "hk": k.shape[1], "d": q.shape[2]})
        return R._launch(q, k, positions, cos, sin, backward=False, config=cfg)

    def expected_launches(self, config, w, inputs) -> list:
        cfg = self.entry(self.config_impl(config), w.params)
        return [("_rope_kernel", {"TOKENS": cfg.tokens, "num_warps": cfg.num_warps})]


class SwigluOp(_TableOp):
    name, module, config_type = "swiglu", S, S.SiluConfig
    row_inputs = ("gate_up",)
    kernel_files = ("swiglu.py", *_TableOp.kernel_files)
    signatures = ("forward(gate_up [M, 2 I] bf16) -> (silu(gate) * up [M, I],)",)
    shapes = {"h200": (("qwen3-0.6b.swiglu", {"i": 3072}), ("qwen3-1.7b.swiglu", {"i": 6144}),
                       ("llama-3.2-1b.swiglu", {"i": 8192})),
              "tiny": (("tiny.swiglu", {"i": 24}), ("tiny.swiglu_odd", {"i": 40}))}

    def key(self, p) -> str:
        return f"I{p['i']}"

    def table(self, p):
        return S.silu_config(p["i"])

    def candidates(self, p):
        return S.silu_candidates(p["i"])

    def shapes_of(self, p) -> dict:
        return {"gate_up": (p["m"], 2 * p["i"])}

    def launch(self, impl, gate_up):
        return (S._forward(gate_up, config=self.entry(impl, {"i": gate_up.shape[-1] // 2})),)

    def expected_launches(self, config, w, inputs) -> list:
        cfg = self.entry(self.config_impl(config), w.params)
        return [("_silu_mul_fwd_kernel", {"BLOCK": cfg.block, "num_warps": cfg.num_warps})]

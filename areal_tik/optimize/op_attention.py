"""The attention forward op for the search: workloads, inputs, contract checks, knobs.

Config: the fields of ``_attention_fwd.FwdConfig``; the root is the kernel's default
(``attention_config()``). A config impl launches the kernels' own launchers with the
config explicitly (``launch_prefill``; ``attention_decode(config=...)``), so no kernel
file is touched. Moves change one knob by one step (stages +-1, sub-tiles x2 / /2, the
unmasked loop, kv_split x2 / /2, warps, tile rows/cols, query heads per prefill program x2 /
/2, the prefill launch order: default -> chunks of 8 -> x2 / /2, decode's head-group split
threshold x2 / /2 down to 0, TMA loads of whole K/V tiles in prefill and in decode on / off);
which of them keep the bits is
for the contract suite to say: the kernel's documentation says block_m, block_n,
num_warps and kv_split fix the numerics, and the gate is expected to refuse them.

Workloads (grid "h200", Qwen3-0.6B heads: 16 query / 8 KV heads of 128, bf16): prefill
at batch 1/4/8/16 x 1K/4K/8K/16K tokens a sequence; the training forward (LSE stored, as
autograd needs) of the same grid with a 128-token answer appended (length L + 128); paged
decode at batch 1/4/8/16 x context 128/1K/4K/8K (block size 64, blocks shuffled): 48.
Grid "tiny" is a CPU-interpreter version (2 / 1 heads of 16, short sequences).
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .checks import expect_bits
from .ops import Op, Workload

F = importlib.import_module("areal_tik.unified_kernels._attention_fwd")
A = importlib.import_module("areal_tik.unified_kernels.attention")

_DIMS = {"h200": dict(hq=16, hk=8, dim=128, block=64), "tiny": dict(hq=2, hk=1, dim=16, block=16)}
_GRIDS = {
    "h200": dict(batches=(1, 4, 8, 16), lengths=(1024, 4096, 8192, 16384), answer=128,
                 contexts=(128, 1024, 4096, 8192)),
    "tiny": dict(batches=(1, 2), lengths=(40,), answer=8, contexts=(9, 40)),
}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


class AttentionImpl:
    """The unified attention kernels launched with an explicit ``FwdConfig``."""

    def __init__(self, config: dict):
        self.fwd = F.FwdConfig(**config)
        self.modules = (F, A)

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, store_lse=False):
        """(out [T, Hq, D], lse [Hq, T] fp32 log2-domain or None); LSE rows past cu[-1] unset."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if store_lse else None
        F.launch_prefill(q, k, v, cu_seqlens, out, lse, cu_seqlens.shape[0] - 1, max_seqlen,
                         q.shape[-1] ** -0.5, self.fwd)
        return out, lse

    def decode(self, q, k_cache, v_cache, block_tables, context_lens):
        return A.attention_decode(q, k_cache, v_cache, block_tables, context_lens, validate=False,
                                  config=self.fwd)


class AttentionOp(Op):
    name = "attention"
    entry_points = ("prefill", "decode")
    signatures = ("prefill(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], cu_seqlens [S + 1] int32, max_seqlen: int, "
                  "store_lse: bool = False) -> (out [T, Hq, D], lse [Hq, T] fp32 log2-domain or None)",
                  "decode(q [B, Hq, D], k_cache [blocks, block_size, Hk, D], v_cache, block_tables [B, W] "
                  "int32, context_lens [B] int32) -> out [B, Hq, D]")
    kernel_files = ("_attention_fwd.py", "attention.py", "_rounding.py", "_common.py")

    def __init__(self, grid: str = "h200"):
        if grid not in _GRIDS:
            raise ValueError(f"attention grid must be one of {sorted(_GRIDS)}, got {grid!r}")
        self.grid = grid
        self.dims = _DIMS[grid]

    @property
    def kernel_modules(self):
        return (F, A)

    def root_config(self) -> dict:
        return dataclasses.asdict(F.attention_config())

    def normalise(self, config: dict) -> dict:
        if not isinstance(config, dict):
            raise TypeError(f"attention config must be a dict of FwdConfig fields, got {config!r}")
        fields = {f.name for f in dataclasses.fields(F.FwdConfig)}
        unknown = set(config) - fields
        if unknown:
            raise ValueError(f"unknown FwdConfig fields {sorted(unknown)}; accepted: {sorted(fields)}")
        return dataclasses.asdict(F.FwdConfig(**config))

    def config_impl(self, config: dict):
        return AttentionImpl(self.normalise(config))

    # ---------------------------------------------------------------- workloads and inputs

    def workloads(self, grid: str) -> list[Workload]:
        g = _GRIDS[grid]
        rows = []
        for b in g["batches"]:
            rows += [Workload(f"prefill.b{b}.{_k(n)}", "prefill", {"batch": b, "seqlen": n})
                     for n in g["lengths"]]
        for b in g["batches"]:
            rows += [Workload(f"train.b{b}.{_k(n)}+{g['answer']}", "train",
                              {"batch": b, "seqlen": n + g["answer"]}) for n in g["lengths"]]
        for b in g["batches"]:
            rows += [Workload(f"decode.b{b}.c{_k(n)}", "decode", {"batch": b, "context": n})
                     for n in g["contexts"]]
        return rows

    def make_inputs(self, w, seed, device) -> dict:
        d, p = self.dims, w.params
        bf16 = dict(dtype=torch.bfloat16, device=device)
        if w.kind in ("prefill", "train"):
            t = p["batch"] * p["seqlen"]
            inputs = {"q": torch.empty(t, d["hq"], d["dim"], **bf16),
                      "k": torch.empty(t, d["hk"], d["dim"], **bf16),
                      "v": torch.empty(t, d["hk"], d["dim"], **bf16),
                      "cu": torch.arange(0, t + 1, p["seqlen"], dtype=torch.int32, device=device)}
        else:
            per_seq = -(-p["context"] // d["block"])
            blocks = p["batch"] * per_seq + 1
            gen = torch.Generator("cpu").manual_seed(seed)
            table = torch.randperm(blocks, generator=gen)[:p["batch"] * per_seq]
            inputs = {"q": torch.empty(p["batch"], d["hq"], d["dim"], **bf16),
                      "k_cache": torch.empty(blocks, d["block"], d["hk"], d["dim"], **bf16),
                      "v_cache": torch.empty(blocks, d["block"], d["hk"], d["dim"], **bf16),
                      "tables": table.view(p["batch"], per_seq).to(torch.int32).to(device),
                      "ctx": torch.full((p["batch"],), p["context"], dtype=torch.int32, device=device)}
        self.refill(w, inputs, seed)
        return inputs

    def refill(self, w, inputs, seed, scale=1.0) -> None:
        gen = torch.Generator(inputs["q"].device).manual_seed(seed)
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            if name in inputs:
                inputs[name].normal_(0.0, scale, generator=gen)

    def call(self, impl, w, inputs) -> tuple:
        if w.kind == "decode":
            return (impl.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["tables"],
                                inputs["ctx"]),)
        train = w.kind == "train"
        out, lse = impl.prefill(inputs["q"], inputs["k"], inputs["v"], inputs["cu"], w.params["seqlen"], train)
        return (out, lse) if train else (out,)

    def check_workloads(self, device) -> list[Workload]:
        n, c = (300, 1100) if device.type == "cuda" else (20, 20)
        return [Workload("check.prefill", "prefill", {"batch": 2, "seqlen": n}),
                Workload("check.train", "train", {"batch": 2, "seqlen": n}),
                Workload("check.decode", "decode", {"batch": 3, "context": c})]

    def expected_launches(self, config, w, inputs) -> list:
        cfg = F.FwdConfig(**config)
        tiles = cfg.kv_split // cfg.block_n
        if w.kind == "decode":
            tma = F.kv_descriptors(inputs["k_cache"], inputs["v_cache"], cfg.block_n, cfg.decode_tma) is not None
            return [("_decode_fwd_kernel", {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                                            "TILES_PER_SPLIT": tiles, "UNMASKED_LOOP": cfg.unmasked_loop,
                                            "TMA": tma,
                                            "num_warps": cfg.num_warps, "num_stages": cfg.stages_decode})]
        rows, warps = F.prefill_tiling(cfg, inputs["q"].dtype)
        pack, chunk = F.prefill_packing(cfg, inputs["q"].dtype, inputs["q"].shape[1], inputs["k"].shape[1])
        tma = F.kv_descriptors(inputs["k"], inputs["v"], cfg.block_n, cfg.prefill_tma) is not None
        return [("_prefill_fwd_kernel", {"BLOCK_M": rows, "BLOCK_N": cfg.block_n, "TILES_PER_SPLIT": tiles,
                                         "UNMASKED_LOOP": cfg.unmasked_loop, "STORE_LSE": w.kind == "train",
                                         "PACK_H": pack, "CHUNK": chunk, "TMA": tma,
                                         "num_warps": warps, "num_stages": cfg.stages_prefill})]

    # ---------------------------------------------------------------- knobs

    def moves(self, config: dict) -> list[dict]:
        c = config
        steps = [("stages_prefill", c["stages_prefill"] - 1), ("stages_prefill", c["stages_prefill"] + 1),
                 ("stages_decode", c["stages_decode"] - 1), ("stages_decode", c["stages_decode"] + 1),
                 ("prefill_subtiles", c["prefill_subtiles"] * 2), ("prefill_subtiles", c["prefill_subtiles"] // 2),
                 ("unmasked_loop", not c["unmasked_loop"]),
                 ("kv_split", c["kv_split"] * 2), ("kv_split", c["kv_split"] // 2),
                 ("num_warps", c["num_warps"] * 2), ("block_m", c["block_m"] * 2),
                 ("block_n", c["block_n"] // 2),
                 ("prefill_pack_heads", c["prefill_pack_heads"] * 2),
                 ("prefill_pack_heads", c["prefill_pack_heads"] // 2),
                 ("prefill_tma", not c["prefill_tma"]), ("decode_tma", not c["decode_tma"])]
        # the launch order: from the default (0) to chunks of 8 position blocks, then x2 / /2
        # (down to 1; from 1 back to the default)
        chunk = c["prefill_order_chunk"]
        steps += [("prefill_order_chunk", v) for v in ((8,) if chunk == 0 else (chunk * 2, chunk // 2))]
        # decode's head-group split threshold: x2 / /2 (down to 0, never split; from 0 to 1)
        per_sm = c["decode_programs_per_sm"]
        steps += [("decode_programs_per_sm", v) for v in ((1,) if per_sm == 0 else (per_sm * 2, per_sm // 2))]
        moves = []
        for field, value in steps:
            # chunk 0: the default launch order; 0 programs per SM: never split a head group
            least = 0 if field in ("prefill_order_chunk", "decode_programs_per_sm") else 1
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                continue
            try:
                self.normalise({**c, field: value})
            except ValueError:
                continue
            if {field: value} not in moves:
                moves.append({field: value})
        return moves

    def closed_knobs(self, delta: dict) -> list[str]:
        # One knob moved and the bits changed: that knob fixes the numerics (H200 at
        # 8443ba9: kv_split 2048 and 512 both changed prefill and decode bits).
        return list(delta) if len(delta) == 1 else []

    def affects(self, delta, w) -> bool:
        if not delta:  # the same config: the same launch everywhere
            return False
        if set(delta) <= {"stages_decode", "decode_programs_per_sm", "decode_tma"}:
            return w.kind == "decode"
        if set(delta) <= {"stages_prefill", "prefill_subtiles", "prefill_pack_heads", "prefill_order_chunk",
                          "prefill_tma"}:
            return w.kind != "decode"
        return True

    # ---------------------------------------------------------------- contract suite

    def contract(self, device) -> list:
        case = _ContractCase(self.dims, self.grid, device)
        return [("root_bits", case.root_bits), ("row_invariance", case.row_invariance),
                ("prefill_decode", case.prefill_decode), ("paged_contiguous", case.paged_contiguous)]


class _ContractCase:
    """Recorded cases of the attention contract (sequences crossing KV tiles and splits)."""

    def __init__(self, dims, grid, device):
        self.d, self.device = dims, device
        root = F.attention_config()
        # GPU: 4500 tokens cross four 1024 splits; tiny: 40 tokens cross 32-token splits.
        self.lengths = (4500, 1000, 77) if grid == "h200" else (40, 9, 3)
        self.pad = 5
        gen = torch.Generator(device).manual_seed(4242)
        t = sum(self.lengths) + self.pad
        bf16 = dict(dtype=torch.bfloat16, device=device, generator=gen)
        self.q = torch.randn(t, dims["hq"], dims["dim"], **bf16)
        self.k = torch.randn(t, dims["hk"], dims["dim"], **bf16)
        self.v = torch.randn(t, dims["hk"], dims["dim"], **bf16)
        self.cu = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32,
                               device=device)
        n = self.lengths[0]
        tile, split = root.block_n, root.kv_split
        self.positions = sorted({p for p in (0, tile - 1, tile, split - 1, split, split + 1, n - 2, n - 1)
                                 if 0 <= p < n})

    def _prefill(self, impl, lse=False):
        out, buf = impl.prefill(self.q, self.k, self.v, self.cu, max(self.lengths), lse)
        # The LSE of padding rows (past cu[-1]) is unspecified: compare the valid rows.
        return (out, buf[:, :int(self.cu[-1])]) if lse else (out,)

    def _decode(self, impl, shuffled: bool):
        """Decode of sequence 0 at every recorded position p (context p + 1), one batch."""
        block, n = self.d["block"], self.lengths[0]
        per_seq = -(-n // block)
        blocks = per_seq + 3
        order = (torch.randperm(blocks, generator=torch.Generator("cpu").manual_seed(7))[:per_seq]
                 if shuffled else torch.arange(per_seq))
        shape = (blocks, block, self.d["hk"], self.d["dim"])
        kc = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self.device)
        vc = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self.device)
        slots = (order.to(self.device)[:, None] * block + torch.arange(block, device=self.device)).flatten()[:n]
        A.store_kv_cache(self.k[:n], self.v[:n], kc, vc, slots.to(torch.int64))
        pos = torch.tensor(self.positions, device=self.device)
        tables = order.to(torch.int32).to(self.device)[None, :].expand(len(self.positions), -1).contiguous()
        return impl.decode(self.q[pos], kc, vc, tables, (pos + 1).to(torch.int32))

    def root_bits(self, impl, root) -> None:
        expect_bits("root_bits: packed prefill", self._prefill(impl), self._prefill(root))
        expect_bits("root_bits: training forward (out, lse)", self._prefill(impl, True),
                    self._prefill(root, True))
        expect_bits("root_bits: paged decode", self._decode(impl, True), self._decode(root, True))

    def row_invariance(self, impl, root) -> None:
        packed = self._prefill(impl)[0]
        for i, n in enumerate(self.lengths):
            s = int(self.cu[i])
            alone = impl.prefill(self.q[s:s + n], self.k[s:s + n], self.v[s:s + n],
                                 torch.tensor([0, n], dtype=torch.int32, device=self.device), n)[0]
            expect_bits(f"row_invariance: sequence {i} alone vs packed", alone, packed[s:s + n])

    def prefill_decode(self, impl, root) -> None:
        rows = self._prefill(impl)[0][torch.tensor(self.positions, device=self.device)]
        expect_bits(f"prefill_decode: positions {self.positions}", self._decode(impl, True), rows)

    def paged_contiguous(self, impl, root) -> None:
        expect_bits("paged_contiguous: shuffled vs in-order blocks", self._decode(impl, True),
                    self._decode(impl, False))

"""The fused log-prob op for the search (LM head + log-softmax + gather, forward).

Config: {"<V>x<H>": ``logprob.LogprobConfig`` fields}; keys absent use the kernel's
``logprob_config(V, H, dtype)``, so the root is {}. The kernel's documentation says the
schedule decides the bits (BLOCK_T, BLOCK_V, BLOCK_K, SPLIT_V fix the MMA and reduction
layout); moves change one field by one step (warps x2 / /2, stages +-1, GROUP_T x2 / /2,
BLOCK_V x2 / /2, SPLIT_V x2 / /2) and the contract suite decides which keep them.
Outputs compared: the per-token log-prob and the LSE (fp32).

Workloads (grid "h200"): the supported models' heads (Qwen3-0.6B V 151936 x H 1024,
Qwen3-1.7B 151936 x 2048, Llama-3.2-1B 128256 x 2048) at 1/8/64/1024/4096 tokens
(rollout scoring to training); "tiny": small heads for the CPU interpreter.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .op_rows import _TableOp
from .ops import Workload

P = importlib.import_module("areal_tik.unified_kernels.logprob")

_STEPS = (("num_warps", 2.0), ("num_warps", 0.5), ("num_stages", +1), ("num_stages", -1),
          ("group_t", 2.0), ("group_t", 0.5), ("block_v", 2.0), ("block_v", 0.5),
          ("split_v", 2.0), ("split_v", 0.5))


class LogprobOp(_TableOp):
    name, module, config_type = "logprob", P, P.LogprobConfig
    kernel_files = ("logprob.py", *_TableOp.kernel_files)
    row_inputs = ("hidden", "targets")
    signatures = ("forward(hidden [T, H] bf16, weight [V, H] bf16, targets [T] int64) -> "
                  "(logprob [T] fp32, lse [T] fp32)",)
    shapes = {"h200": (("qwen3-0.6b.logprob", {"v": 151936, "h": 1024}),
                       ("qwen3-1.7b.logprob", {"v": 151936, "h": 2048}),
                       ("llama-3.2-1b.logprob", {"v": 128256, "h": 2048})),
              "tiny": (("tiny.logprob", {"v": 100, "h": 32}),)}

    def workloads(self, grid: str):
        rows = (1, 8, 64, 1024, 4096) if grid == "h200" else (1, 3, 9)
        return [Workload(f"{name}.m{m}", self.name, {**params, "m": m})
                for name, params in self.shapes[grid] for m in rows]

    def key(self, p) -> str:
        return f"{p['v']}x{p['h']}"

    def table(self, p):
        return P.logprob_config(p["v"], p["h"], torch.bfloat16)

    def candidates(self, p):
        base, out = self.table(p), []
        for field, step in _STEPS:
            value = getattr(base, field)
            value = int(value * step) if isinstance(step, float) else value + step
            try:
                cfg = dataclasses.replace(base, **{field: value})
            except AssertionError:  # SPLIT_V must stay a multiple of BLOCK_V
                continue
            if value >= 1 and cfg not in out:
                out.append(cfg)
        return out

    def shapes_of(self, p) -> dict:
        return {"hidden": (p["m"], p["h"]), "weight": (p["v"], p["h"])}

    def fixed(self, p, device) -> dict:
        return {"targets": torch.empty(p["m"], dtype=torch.int64, device=device)}

    def refill(self, w, inputs, seed, scale=1.0) -> None:
        gen = torch.Generator(device=inputs["hidden"].device).manual_seed(seed)
        inputs["hidden"].normal_(0.0, scale, generator=gen)
        inputs["weight"].normal_(0.0, scale * w.params["h"] ** -0.5, generator=gen)
        inputs["targets"].random_(0, w.params["v"], generator=gen)

    def launch(self, impl, hidden, weight, targets):
        tiles = self.entry(impl, {"v": weight.shape[0], "h": weight.shape[1]})
        lp, _, lse, _ = P._forward(hidden, weight, targets, 1.0, False, False, tiles=tiles)
        return lp, lse

    def expected_launches(self, config, w, inputs) -> list:
        t = self.entry(self.config_impl(config), w.params)
        return [("_lse_partial_kernel", {"BLOCK_T": t.block_t, "BLOCK_V": t.block_v, "BLOCK_K": t.block_k,
                                         "SPLIT_V": t.split_v, "GROUP_T": t.group_t,
                                         "num_warps": t.num_warps, "num_stages": t.num_stages})]

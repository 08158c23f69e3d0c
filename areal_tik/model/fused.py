"""Fused column projections for rollout: q/k/v as one GEMM, gate/up as one GEMM.

Why: at decode sizes a projection costs its launch, not its bytes (H200, Qwen3-0.6B at 64
rows: q/k/v as three linears plus gate/up as two linears and a ``torch.cat`` are six
kernels of 3-6 us each, where one q|k|v GEMM takes 5.7 us and one gate|up GEMM 6.5 us,
``eval/results/2026-11-30_h200_7e210ef/bench_linear.log``), and launches are what an
eager prefill chunk is bound by.

Why the bits do not move: an output element of the unified linear is the fp32 chain of
its row of x and its column of W in k16 MMA steps from k = 0, rounded once; the chain
does not depend on N, on which tile the column falls in, or on the tile shape, BLOCK_K
included (``unified_kernels/_linear_tiles.py``, proven on the GPU by
``tests/test_linear.py``). So column n of ``x @ [Wq; Wk; Wv]^T`` has the bits of the
same column of ``x @ Wq^T`` (or Wk, Wv): the fused rollout and the separate training
projections agree bit for bit, which every engine-vs-training test checks.

How: ``fuse_projection_storage`` lays a layer's q/k/v weights (and biases) out as
consecutive rows of one storage, and gate/up likewise, by re-pointing each parameter's
``.data`` (the Parameter objects stay: an optimizer, a hook or a state dict holding
them still sees them; in-place weight updates land in the shared storage). The rollout
path (``fused_projections``) then takes one ``[sum N_i, K]`` view when the weights are
still adjacent, and falls back to separate linears when they are not (a parameter
replaced after the layout, a sharded or wrapped tensor). The training path always runs
the separate linears: autograd needs each weight's own gradient.

Measured (H200, e0f451c, eval/results/2026-12-02_h200_e0f451c/): rollout tokens/s 1.06-1.28x
the separate projections in the same run (Qwen3-0.6B and 1.7B configs), a 32-row decode step
388 kernels instead of 499. One cost: an eager 2048-row prefill chunk's fused GEMMs have
enough tiles for the persistent TMA kernel, whose launch takes ~3x the tiled kernel's host
time (TensorDescriptors built per launch), so host-bound eager chunks gain less or lose.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from ..unified_kernels._common import env_switch

# The rollout path fuses where it can; AREAL_TIK_FUSED_PROJECTIONS=0 starts a process on
# separate projections (or set ENABLED at run time), for side-by-side timing.
ENABLED = env_switch("AREAL_TIK_FUSED_PROJECTIONS", True)
_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t.data) is torch.Tensor


def adjacent_rows(tensors) -> torch.Tensor | None:
    """One view over ``tensors`` (each ``[n_i, ...]``, contiguous) when they are
    consecutive rows of one storage, in order; else None."""
    first = tensors[0]
    if not all(_plain(t) for t in tensors):
        return None
    tail, rows = first.shape[1:], 0
    expected = first.data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != tail or not t.is_contiguous()
                or t.data_ptr() != expected):
            return None
        expected += t.numel() * t.element_size()
        rows += t.shape[0]
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors[1:]):
        return None
    return first.detach().as_strided((rows, *tail), first.stride())


def _group_view(owner: torch.nn.Module, key: str, tensors) -> torch.Tensor | None:
    # Cached by the tensors' addresses: ~1 us a call instead of the checks above.
    if any(t is None for t in tensors):
        return None
    ptrs = tuple(t.data_ptr() for t in tensors)
    cache = _VIEWS.setdefault(owner, {})
    hit = cache.get(key)
    if hit is not None and hit[0] == ptrs:
        return hit[1]
    view = adjacent_rows(tensors)
    cache[key] = (ptrs, view)
    return view


_warned_not_adjacent = False


def _warn_not_adjacent(key: str) -> None:
    # Said once a process: the separate linears give the same bits, only more launches.
    global _warned_not_adjacent
    if not _warned_not_adjacent:
        _warned_not_adjacent = True
        warnings.warn(f"areal-tik: the {key} weights are not adjacent in memory, so rollout runs them as "
                      "separate linears (the same bits, more launches); UnifiedCausalLM.fuse_projections() "
                      "lays them out (the engine does at start-up)", stacklevel=4)


def _fused_linear(ops, owner, key, modules, x):
    """``ops.linear`` over the modules' adjacent weights (and biases): ``[T, sum N_i]``, or
    None (then the caller runs the separate linears): switched off, weights not adjacent, or
    a forward that autograd records (a fused view would not give each weight its gradient)."""
    weights = [m.weight for m in modules]
    if not ENABLED or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        return None
    weight = _group_view(owner, key + ".weight", weights)
    if weight is None:
        _warn_not_adjacent(key)
        return None
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return ops.linear(x, weight, None)
    bias = None if any(b is None for b in biases) else _group_view(owner, key + ".bias", biases)
    return None if bias is None else ops.linear(x, weight, bias)


class SeparateProjections:
    """The training path: one linear per HF module (autograd sees each weight)."""

    fused = False

    @staticmethod
    def qkv(ops, attn, x):
        return (ops.linear(x, attn.q_proj.weight, attn.q_proj.bias), ops.linear(x, attn.k_proj.weight, attn.k_proj.bias),
                ops.linear(x, attn.v_proj.weight, attn.v_proj.bias))

    @staticmethod
    def gate_up(ops, mlp, x):
        # Packed [T, 2I] (gate | up), the input silu_mul takes: one activation copy.
        return torch.cat([ops.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias),
                          ops.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)], dim=-1)


class FusedProjections:
    """The rollout path: one GEMM per group when the weights are adjacent (see module doc)."""

    fused = True

    @staticmethod
    def qkv(ops, attn, x):
        out = _fused_linear(ops, attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj), x)
        if out is None:
            return SeparateProjections.qkv(ops, attn, x)
        nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        return out[:, :nq], out[:, nq:nq + nk], out[:, nq + nk:]

    @staticmethod
    def gate_up(ops, mlp, x):
        out = _fused_linear(ops, mlp, "gate_up", (mlp.gate_proj, mlp.up_proj), x)
        return SeparateProjections.gate_up(ops, mlp, x) if out is None else out


_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def projection_groups(hf_model) -> list[tuple]:
    """The module groups rollout fuses, every decoder layer's q/k/v and gate/up, in order:
    the one place that names them (the layout, the warm-up's GEMM shapes)."""
    base = getattr(hf_model, "model", hf_model)
    groups = []
    for layer in getattr(base, "layers", ()):
        for parent, names in _GROUPS:
            owner = getattr(layer, parent, None)
            if owner is not None and all(isinstance(getattr(owner, n, None), torch.nn.Linear) for n in names):
                groups.append(tuple(getattr(owner, n) for n in names))
    return groups


def fused_shapes(hf_model) -> set[tuple[int, int, bool]]:
    """(N, K, has_bias) of the fused GEMMs the rollout path runs (for the warm-up)."""
    return {(sum(m.out_features for m in mods), mods[0].in_features, mods[0].bias is not None)
            for mods in projection_groups(hf_model)}


@torch.no_grad()
def _relayout(modules, name: str) -> bool:
    params = [getattr(m, name) for m in modules]
    if any(p is None for p in params):
        return False
    if not all(_plain(p) for p in params) or len({(p.dtype, p.device, p.shape[1:]) for p in params}) != 1:
        return False  # a wrapped or sharded tensor (DTensor, a flat parameter): left alone
    if adjacent_rows(params) is not None:
        return True
    storage = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        p.data = storage[start:start + p.shape[0]]
        start += p.shape[0]
    return True


def fuse_projection_storage(hf_model: torch.nn.Module) -> int:
    """Lay every decoder layer's q/k/v and gate/up weights (and biases) out as adjacent
    rows of one storage each, in place (same Parameter objects, same values). Returns the
    number of groups now adjacent. Idempotent; wrapped parameters are skipped."""
    groups = 0
    for mods in projection_groups(hf_model):
        if _relayout(mods, "weight"):
            groups += 1
            _relayout(mods, "bias")
    return groups

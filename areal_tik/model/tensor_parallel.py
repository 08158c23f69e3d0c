"""Tensor parallelism of the unified model: one rank's shard and its row-parallel tree.

A rank r of t holds (``shard_model``, applied to the full model every rank loaded):
- column-parallel: q/k/v and gate/up keep their output rows of the rank's heads / MLP
  columns (r-th of t contiguous slices). A linear's output column depends on its weight
  row and the input row alone (the k16 chain, whatever the tile), so these columns are
  bitwise the TP = 1 columns; attention and the KV cache then run on the local heads.
- row-parallel: o_proj and down_proj keep the r-th K slice of their weight (K/t columns
  = G/t whole K groups when t divides G, the model's ``k_groups``), i.e. one subtree of
  the fixed K-group tree. ``linear_partial`` gives its fp32 root; an all_gather puts the
  t roots in rank order on every rank (a copy, no arithmetic, so no reduction order of a
  collective enters); ``combine_partials`` finishes the tree, adds the bias in fp32 and
  rounds once. Hence ``combine_partials(roots) == linear(x, w, b, k_groups=G)`` bitwise,
  and every rank holds the same bits of every hidden state.
- replicated: norms, and the embedding and LM head unless ``vocab_parallel``; with it each
  rank holds a run of whole vocabulary splits of both (``vocab_parallel.py``), gathered so
  that logits, samples and log-probs are still the TP = 1 bits on every rank.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .layers import row_parallel_proj
from .spec import ModelSpec
from .vocab_parallel import EMBED_NAME, HEAD_NAME, VocabShard, check_vocab_split

K_GROUP_SIZES = (1, 2, 4, 8)  # powers of two up to 8 (the tree has at most 3 levels)


def _divides(what: str, value: int, name: str, divisor: int) -> None:
    if value % divisor:
        raise ValueError(f"{name}={divisor} does not divide {what} ({value})")


def check_k_groups(spec: ModelSpec, k_groups) -> None:
    """TypeError/ValueError unless ``k_groups`` is one of K_GROUP_SIZES and divides the K of
    o_proj (query heads x head_dim) and of down_proj (the MLP width)."""
    if isinstance(k_groups, bool) or not isinstance(k_groups, int):
        raise TypeError(f"k_groups must be an int, got {k_groups!r}")
    if k_groups not in K_GROUP_SIZES:
        raise ValueError(f"k_groups must be one of {K_GROUP_SIZES}, got {k_groups!r}")
    _divides("o_proj's K (query heads x head_dim)", spec.q_size, "k_groups", k_groups)
    _divides("down_proj's K (intermediate_size)", spec.intermediate, "k_groups", k_groups)


def check_split(spec: ModelSpec, k_groups: int, size: int) -> None:
    """ValueError naming both numbers unless ``size`` ranks split the model evenly."""
    if isinstance(size, bool) or not isinstance(size, int) or size not in K_GROUP_SIZES:
        raise ValueError(f"tensor_parallel_size must be one of {K_GROUP_SIZES}, got {size!r}")
    _divides("the model's query heads", spec.n_heads, "tensor_parallel_size", size)
    _divides("the model's KV heads", spec.n_kv_heads, "tensor_parallel_size", size)
    _divides(f"k_groups ({k_groups})", k_groups, "tensor_parallel_size", size)


def gather_partials(part: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``part`` (same shape on every rank), in rank order, on every rank."""
    part = part.contiguous()
    if dist.get_backend(group) == "nccl":  # one buffer, one collective (CUDA-graph capturable)
        out = part.new_empty((size, *part.shape))
        dist.all_gather_into_tensor(out, part, group=group)
        return list(out.unbind(0))
    parts = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(parts, part, group=group)
    return parts


@dataclasses.dataclass
class TensorParallelShard:
    """Rank ``rank`` of ``size`` over ``group``; ``sliced`` maps each sharded HF tensor
    name to the dim it was cut along (0: output rows, 1: K columns)."""

    rank: int
    size: int
    group: object
    sliced: dict[str, int] = dataclasses.field(default_factory=dict)
    vocab: VocabShard | None = None  # the embedding / LM head rows (None: replicated)

    def gather(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``part`` in rank order (``gather_partials`` over this group)."""
        return gather_partials(part, self.group, self.size)

    def row_proj(self, ops, k_groups: int):
        """The rank's subtree root (``linear_partial`` over its G/t groups), every root
        gathered in rank order, the tree finished by ``combine_partials``."""
        if self.size == 1:  # nothing to gather: the one-device call
            return row_parallel_proj(ops, k_groups)
        local_groups = k_groups // self.size

        def proj(x, module):
            part = ops.linear_partial(x, module.weight, k_groups=local_groups)
            parts = gather_partials(part, self.group, self.size)
            return ops.combine_partials(parts, module.bias, x.dtype)
        return proj

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-model tensor ``name`` (a view; unsliced names as given)."""
        dim = self.sliced.get(name)
        if dim is None:
            return tensor
        if name in (EMBED_NAME, HEAD_NAME) and self.vocab is not None:
            return tensor.narrow(0, self.vocab.start, self.vocab.stop - self.vocab.start)
        width = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * width, width)

    def local_weights(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full-model state dict (weight updates) cut to this rank's shapes."""
        return {name: self.cut(name, t) if isinstance(t, torch.Tensor) else t for name, t in full.items()}


def _keep(module: torch.nn.Linear, dim: int, shard: TensorParallelShard, prefix: str) -> None:
    """Replace ``module``'s weight (and, cut along the rows, its bias) by this rank's slice,
    a contiguous copy: the full tensor is freed and the kernels see dense operands."""
    names = ["weight"] + (["bias"] if dim == 0 and module.bias is not None else [])
    for attr in names:
        full = getattr(module, attr)
        key = f"{prefix}.{attr}"
        shard.sliced[key] = dim
        local = shard.cut(key, full.detach()).contiguous()
        setattr(module, attr, torch.nn.Parameter(local, requires_grad=False))
    if dim == 0:
        module.out_features //= shard.size
    else:
        module.in_features //= shard.size


def shard_model(model, rank: int, size: int, group, vocab_parallel: bool = False):
    """Cut ``model`` (a ``UnifiedCausalLM`` holding the full weights) in place to rank
    ``rank`` of ``size`` over the process group ``group``; returns it. ValueError when
    ``size`` does not split the heads or the model's k_groups (or, ``vocab_parallel``, the
    LM head's vocabulary splits)."""
    spec = model.spec
    if model.tensor_parallel is not None:
        raise ValueError(f"the model is already sharded ({model.tensor_parallel.rank}/{model.tensor_parallel.size})")
    check_split(spec, model.k_groups, size)
    if not isinstance(vocab_parallel, bool):
        raise TypeError(f"vocab_parallel must be a bool, got {vocab_parallel!r}")
    if vocab_parallel and model.kernels != "unified":
        raise ValueError(f"vocab_parallel needs the unified kernels (their fixed vocabulary splits), "
                         f"the model runs {model.kernels!r}")
    if vocab_parallel:
        check_vocab_split(spec, model.dtype, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank!r}")
    shard = TensorParallelShard(rank, size, group)
    if vocab_parallel and size > 1:
        _keep_vocab(model, shard)
    if size > 1:
        for i, layer in enumerate(model.hf_model.model.layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for name in ("q_proj", "k_proj", "v_proj"):
                _keep(getattr(layer.self_attn, name), 0, shard, f"{attn}.{name}")
            _keep(layer.self_attn.o_proj, 1, shard, f"{attn}.o_proj")
            for name in ("gate_proj", "up_proj"):
                _keep(getattr(layer.mlp, name), 0, shard, f"{mlp}.{name}")
            _keep(layer.mlp.down_proj, 1, shard, f"{mlp}.down_proj")
    model.spec = dataclasses.replace(spec, n_heads=spec.n_heads // size, n_kv_heads=spec.n_kv_heads // size,
                                     intermediate=spec.intermediate // size)
    model.tensor_parallel = shard
    return model


def _keep_vocab(model, shard: TensorParallelShard) -> None:
    """Cut the embedding and the LM head (one tensor when tied) to the rank's vocabulary rows."""
    embed = model.hf_model.get_input_embeddings()
    head = model.hf_model.get_output_embeddings()
    tied = head.weight is embed.weight
    full_bytes = embed.weight.numel() * embed.weight.element_size() * (1 if tied else 2)
    vocab = VocabShard.of(model.spec, model.dtype, shard.rank, shard.size)
    kept = vocab.stop - vocab.start
    shard.vocab = dataclasses.replace(vocab, saved_bytes=full_bytes * (vocab.vocab - kept) // vocab.vocab)
    for module, name in ((embed, EMBED_NAME),) + (() if tied else ((head, HEAD_NAME),)):
        shard.sliced[name] = 0
        module.weight = torch.nn.Parameter(shard.cut(name, module.weight.detach()).contiguous(),
                                           requires_grad=False)
    if tied:
        shard.sliced[HEAD_NAME] = 0
        head.weight = embed.weight

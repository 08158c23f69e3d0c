"""The engine's side of tensor parallelism: the process groups and the per-step agreement.

SPMD: every rank runs the same ``LLM`` over its shard of the model (``model.tensor_parallel``)
and is given the same requests in the same order; only the model forward is sharded (its
row-parallel gathers make every rank hold the same hidden states, logits, samples and
log-probs). What could still make ranks diverge is timing: a request that reaches rank 0's
step loop one step before rank 1's, a cancellation, a pause or a weight update seen at
different steps, a KV budget measured from each GPU's free memory. So before each step
the ranks agree (``StepAgreement``, one small all_gather on a gloo group, about a
millisecond on one host):
- requests: each rank admits only the seq ids every rank has received (ids are given in
  submission order, so the same ids are the same requests);
- cancellations: a request is aborted once every rank has cancelled it;
- stepping: no rank steps while any is paused or closing, or while their weight versions
  differ (an update applied on one rank waits for the others at the same step boundary);
- the KV cache size: the smallest rank's (``min_int``).

Launch one process per rank (``torchrun --nproc-per-node t``, or any launcher that sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or an ``init_method`` such as a shared
file); ``init_tensor_parallel`` joins them. A rank whose step fails leaves the others
waiting in their next collective until the process group's timeout.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from .config import EngineConfig


@dataclasses.dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``size``: ``device_group`` carries the model's gathers (NCCL on
    GPUs, gloo on CPU), ``control_group`` (gloo) the engine's per-step agreement."""

    rank: int
    size: int
    device_group: object
    control_group: object

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def gather(self, value) -> list:
        """Every rank's picklable ``value``, in rank order."""
        out = [None] * self.size
        dist.all_gather_object(out, value, group=self.control_group)
        return out


def init_tensor_parallel(config: EngineConfig, device: torch.device | str | None = None,
                         init_method: str | None = None, rank: int | None = None,
                         timeout_s: float = 1800.0) -> TensorParallelGroup:
    """Join (or start) the default process group of ``config.tensor_parallel_size``
    processes and return this rank's groups. NCCL when ``device`` is CUDA, else gloo.
    Without ``init_method`` the environment gives the rendezvous (``env://``: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them)."""
    size = config.tensor_parallel_size
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} needs a process group of {size} ranks, "
                         f"this one has {world}")
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return TensorParallelGroup(dist.get_rank(), size, dist.group.WORLD, control)


@dataclasses.dataclass(frozen=True)
class LocalView:
    """What one rank's step loop has seen before a step."""

    received: int              # seq ids 0 .. received - 1 have all reached this rank
    cancelled: frozenset[int]  # ids this rank's callers cancelled, not yet reaped
    ready: bool                # resumed and not closing
    closing: bool
    version: int


@dataclasses.dataclass(frozen=True)
class Agreed:
    received: int
    cancelled: frozenset[int]
    step: bool
    closing_ranks: tuple[int, ...]


class StepAgreement:
    """The per-step agreement of the ranks' step loops (see the module docstring)."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group

    def __call__(self, view: LocalView) -> Agreed:
        views: list[LocalView] = self.group.gather(view)
        closing = tuple(r for r, v in enumerate(views) if v.closing)
        return Agreed(
            received=min(v.received for v in views),
            cancelled=frozenset.intersection(*(v.cancelled for v in views)),
            step=all(v.ready for v in views) and len({v.version for v in views}) == 1 and not closing,
            closing_ranks=closing)


def check_engine_model(model, config: EngineConfig, group: TensorParallelGroup | None) -> None:
    """ValueError unless ``model`` (its full spec, k_groups and shard), ``config`` and
    ``group`` describe the same split."""
    if config.tensor_parallel_size > 1 or config.k_groups > 1:
        config.check_model(getattr(model, "full_spec", model.config), getattr(model, "dtype", None))
    k_groups = getattr(model, "k_groups", 1)
    if k_groups != config.k_groups:
        raise ValueError(f"the model computes k_groups={k_groups}, the engine config says "
                         f"k_groups={config.k_groups}: build the model with the config's value")
    shard = getattr(model, "tensor_parallel", None)
    size = config.tensor_parallel_size
    if size == 1 and shard is None and group is None:
        return
    if group is None or shard is None:
        raise ValueError(f"tensor_parallel_size={size} needs the group of init_tensor_parallel and a "
                         f"model sharded to its rank (got group={group!r}, model shard={shard!r})")
    if (shard.rank, shard.size) != (group.rank, group.size) or group.size != size:
        raise ValueError(f"the model is sharded as rank {shard.rank} of {shard.size}, the group is rank "
                         f"{group.rank} of {group.size}, the config says tensor_parallel_size={size}")
    if size > 1 and (shard.vocab is not None) != config.vocab_parallel:
        raise ValueError(f"the engine config says vocab_parallel={config.vocab_parallel}, the model's "
                         f"embedding / LM head are {'sharded' if shard.vocab else 'replicated'}: "
                         f"shard_model(..., vocab_parallel=config.vocab_parallel)")

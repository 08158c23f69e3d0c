"""Reusing rollout log-probs as AReaL's old/proximal log-probs (pure functions over batches).

AReaL trajectories (``RLVRWorkflow`` output) are dicts of ``[B, L]`` tensors where
position t holds token t: ``logprobs[t]`` is the rollout log-prob of sampling token t,
``versions[t]`` the weight version that sampled it (-1 for prompt tokens) and
``loss_mask[t]`` is 1 for generated tokens. The trainer's recompute
(``actor.compute_logp``) is next-token aligned instead: its position t is
``log p(x_{t+1} | x_<=t)``. ``compute_advantages`` rolls the rollout tensors by -1 for the
same alignment, so the reused proximal log-prob is ``roll(logprobs, -1)``.

A token may be reused only if it was sampled by the weights the actor holds now
(``version == current_version``); older ("stale") tokens are recomputed, which needs a
forward over their whole sequence, so ``stale_rows`` lists the rows to recompute and
``merge_recomputed`` takes the recomputed value at stale positions only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

REQUIRED_KEYS = ("input_ids", "attention_mask", "logprobs", "loss_mask", "versions")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Next-token alignment used by ``compute_advantages``: position t holds token t+1."""
    return torch.roll(t, shifts=-1, dims=-1)


def check_trajectory(traj: dict, index: int = 0) -> None:
    """ValueError naming what is missing or malformed in one AReaL trajectory dict."""
    if not isinstance(traj, dict):
        raise TypeError(f"trajectory {index} must be a dict of tensors, got {type(traj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in traj]
    if missing:
        raise ValueError(
            f"trajectory {index} lacks {missing}: log-prob reuse needs the rollout's per-token "
            "logprobs and versions (RLVRWorkflow-style output)")
    shape = traj["input_ids"].shape
    for key in REQUIRED_KEYS:
        if traj[key].shape != shape:
            raise ValueError(f"trajectory {index}: {key} has shape {tuple(traj[key].shape)}, "
                             f"input_ids has {tuple(shape)}")
    if traj["logprobs"].dtype != torch.float32:
        raise ValueError(f"trajectory {index}: logprobs must be float32, got {traj['logprobs'].dtype}")


def scored_mask(traj: dict) -> torch.Tensor:
    """Bool ``[B, L]``, next-token aligned: positions whose log-prob enters the loss."""
    return _aligned(traj["loss_mask"]).bool()


def fresh_mask(traj: dict, current_version: int) -> torch.Tensor:
    """Scored positions whose token was sampled by ``current_version`` (reusable)."""
    return scored_mask(traj) & (_aligned(traj["versions"]) == current_version)


def stale_mask(traj: dict, current_version: int) -> torch.Tensor:
    """Scored positions whose token was sampled by another version (recompute them)."""
    return scored_mask(traj) & (_aligned(traj["versions"]) != current_version)


def reused_logprobs(traj: dict) -> torch.Tensor:
    """The rollout log-probs in the recompute's alignment (a new tensor)."""
    return _aligned(traj["logprobs"]).clone()


@dataclass
class ReusePlan:
    """Per trajectory: the reused proximal log-probs and which positions are stale."""

    prox: list[torch.Tensor]   # [B, L] fp32, next-token aligned
    stale: list[torch.Tensor]  # [B, L] bool
    n_reused: int              # scored tokens taken from the rollout
    n_stale: int               # scored tokens that need the recompute

    def stale_rows(self) -> list[tuple[int, int]]:
        """(trajectory, row) of every sequence holding a stale token."""
        rows = []
        for i, mask in enumerate(self.stale):
            rows.extend((i, int(r)) for r in mask.any(dim=-1).nonzero().flatten())
        return rows


def plan_reuse(batch: list[dict], current_version: int,
               refused: list[torch.Tensor] | None = None) -> ReusePlan:
    """Reuse every fresh scored token; mark the stale ones. ``refused``: per trajectory a
    bool ``[B]`` of rows whose reuse is refused (``exactness.row_refusals``); every scored
    token of those rows is marked stale (recomputed)."""
    if not isinstance(batch, list) or not batch:
        raise ValueError(f"batch must be a non-empty list of trajectory dicts, got {batch!r}")
    if refused is not None and len(refused) != len(batch):
        raise ValueError(f"{len(batch)} trajectories but {len(refused)} refusal masks")
    prox, stale, n_reused, n_stale = [], [], 0, 0
    for i, traj in enumerate(batch):
        check_trajectory(traj, i)
        prox.append(reused_logprobs(traj))
        s = stale_mask(traj, current_version)
        if refused is not None:
            s = s | (scored_mask(traj) & refused[i].reshape(-1, 1))
        stale.append(s)
        n_stale += int(s.sum())
        n_reused += int((scored_mask(traj) & ~s).sum())
    return ReusePlan(prox=prox, stale=stale, n_reused=n_reused, n_stale=n_stale)


def row_batch(batch: list[dict], rows: list[tuple[int, int]]) -> list[dict]:
    """One single-row trajectory dict per (trajectory, row), for a forward over those rows."""
    out = []
    for i, r in rows:
        traj = batch[i]
        out.append({k: v[r:r + 1] for k, v in traj.items()
                    if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == traj["input_ids"].shape})
    return out


def fit_row(values: torch.Tensor, traj: dict, row: int) -> torch.Tensor:
    """A recomputed row (``[L']``, recompute alignment) as ``[1, L]`` of ``traj``'s padding.

    AReaL's ``compute_logp`` returns each sequence unpadded (its attention-mask length), so
    a right-padded row comes back shorter than the trajectory; the padding positions are
    never scored and are filled with 0.
    """
    values = values.reshape(-1)
    length = traj["input_ids"].shape[-1]
    tokens = int(traj["attention_mask"][row].sum())
    if not tokens <= values.shape[0] <= length:
        raise ValueError(f"recomputed row {row} has {values.shape[0]} positions; its sequence has "
                         f"{tokens} tokens padded to {length}")
    if values.shape[0] < length:
        values = torch.cat([values, values.new_zeros(length - values.shape[0])])
    return values.unsqueeze(0)


def merge_recomputed(plan: ReusePlan, rows: list[tuple[int, int]],
                     recomputed: list[torch.Tensor]) -> list[torch.Tensor]:
    """Write recomputed values (``[1, L]`` per row, recompute alignment) at stale positions."""
    if len(rows) != len(recomputed):
        raise ValueError(f"{len(rows)} rows but {len(recomputed)} recomputed results")
    for (i, r), values in zip(rows, recomputed):
        values = values.reshape(-1).to(plan.prox[i].dtype)
        mask = plan.stale[i][r]
        if values.shape[0] != mask.shape[0]:
            raise ValueError(f"recomputed row ({i}, {r}) has {values.shape[0]} positions, "
                             f"expected {mask.shape[0]}")
        plan.prox[i][r] = torch.where(mask, values, plan.prox[i][r])
    return plan.prox


def select_rows(batch: list[dict], n_sequences: int,
                candidates: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """``n_sequences`` rows spread evenly over ``candidates`` (default: every row of the
    batch; 0 = all of them), in batch order."""
    all_rows = candidates if candidates is not None else [
        (i, r) for i, traj in enumerate(batch) for r in range(traj["input_ids"].shape[0])]
    if n_sequences <= 0 or n_sequences >= len(all_rows):
        return all_rows
    step = len(all_rows) / n_sequences
    return [all_rows[int(k * step)] for k in range(n_sequences)]

"""Per-trajectory exactness: what the rollout log-probs of one trajectory describe.

Every engine output knows the temperature of its recorded log-probs
(``logprob_temperature``: the request's, 1.0 for greedy) and whether its tokens were drawn
from that very distribution (``logprobs_match_sampling``: False under greedy, top-k or
top-p). AReaL's workflows build trajectories from ``ModelResponse`` objects that have no
field for either, so the engines (in-process ``agenerate`` and the server client) call
``record`` for every response, and ``ExactnessWorkflowExecutor`` collects the records of
one episode (a context variable set per episode task; child tasks of the episode share
the list) and stamps the trajectory with two ``[B]`` tensors:

- ``TEMPERATURE_KEY`` (float32): the episode's log-prob temperature; NaN when its
  responses disagree or when no response was recorded;
- ``MATCH_KEY`` (bool): every response sampled from the recorded distribution.

``row_refusals`` decides reuse per row: refused where the temperature is not the
actor's (the recorded log-probs are then another distribution than the trainer's) or
where the fields are missing (a trajectory built without this executor). Greedy, top-k
and top-p keep reuse: the recorded log-prob is the full-vocabulary softmax at the
temperature, the same bits the recompute gives. That it is not the truncated
distribution the token was drawn from holds with or without reuse (AReaL's recompute
computes the same full softmax); ``MATCH_KEY`` is counted so that a run can see it.
"""
from __future__ import annotations

import contextvars
import math

import torch
from areal.infra import WorkflowExecutor

TEMPERATURE_KEY = "tik_logprob_temperature"
MATCH_KEY = "tik_logprobs_match_sampling"
KEYS = (TEMPERATURE_KEY, MATCH_KEY)

_EPISODE: contextvars.ContextVar[list | None] = contextvars.ContextVar("areal_tik_episode", default=None)


def record(logprob_temperature: float | None, logprobs_match_sampling: bool | None) -> None:
    """Note one response of the running episode (no-op outside an episode). ``None``: the
    response did not say (a server without the fields); the trajectory is then left
    without ``KEYS`` and its reuse refused."""
    records = _EPISODE.get()
    if records is None:
        return
    if logprob_temperature is None or logprobs_match_sampling is None:
        records.append(None)
    else:
        records.append((float(logprob_temperature), bool(logprobs_match_sampling)))


def stamp(traj: dict, records: list[tuple[float, bool] | None]) -> None:
    """Add the episode's ``TEMPERATURE_KEY`` and ``MATCH_KEY`` rows to ``traj`` (in place);
    nothing when a response did not say."""
    if any(r is None for r in records):
        return
    rows = traj["input_ids"].shape[0]
    temperatures = {t for t, _ in records}
    temperature = temperatures.pop() if len(temperatures) == 1 else math.nan
    match = bool(records) and all(m for _, m in records)
    traj[TEMPERATURE_KEY] = torch.full((rows,), temperature, dtype=torch.float32)
    traj[MATCH_KEY] = torch.full((rows,), match, dtype=torch.bool)


class ExactnessWorkflowExecutor(WorkflowExecutor):
    """AReaL's ``WorkflowExecutor`` whose accepted trajectories carry ``KEYS``."""

    def _create_workflow_task(self, pending_task):
        run = super()._create_workflow_task(pending_task)

        async def run_and_stamp():
            records: list[tuple[float, bool]] = []
            _EPISODE.set(records)  # this task's context: the episode's responses append here
            result = await run()
            traj = None if result is None else result.trajectory
            if isinstance(traj, dict) and isinstance(traj.get("input_ids"), torch.Tensor):
                stamp(traj, records)
            return result

        return run_and_stamp


def row_refusals(traj: dict, actor_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[B]`` pair ``(missing, other_temperature)`` on the batch's device: rows whose reuse is refused
    because the trajectory lacks ``KEYS``, or because its log-prob temperature is not
    ``actor_temperature`` (NaN, a mixed episode, included)."""
    rows, device = traj["input_ids"].shape[0], traj["input_ids"].device  # a GPU trainer's batch is on the GPU
    no = torch.zeros(rows, dtype=torch.bool, device=device)
    temperature = traj.get(TEMPERATURE_KEY)
    if temperature is None or traj.get(MATCH_KEY) is None:
        return ~no, no
    temperature = torch.as_tensor(temperature).reshape(-1).float().to(device)
    if temperature.shape[0] != rows:
        return ~no, no  # malformed: treated as missing, never guessed
    return no, temperature != float(actor_temperature)


def truncated_rows(traj: dict) -> torch.Tensor:
    """Bool ``[B]`` on the batch's device: rows whose tokens were drawn from another
    distribution than the recorded one (greedy, top-k, top-p); none without ``MATCH_KEY``."""
    ids = traj["input_ids"]
    match = traj.get(MATCH_KEY)
    if match is None:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    return ~torch.as_tensor(match).reshape(-1).bool().to(ids.device)


def pop_fields(batch: list[dict]) -> None:
    """Remove ``KEYS`` from every trajectory (AReaL's loss never sees them)."""
    for traj in batch:
        for key in KEYS:
            traj.pop(key, None)

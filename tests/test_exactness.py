"""Per-trajectory exactness: each trajectory carries its log-prob temperature and whether
its tokens were drawn from the recorded distribution, through AReaL's WorkflowExecutor,
from the in-process engine and from a server through the client; reuse is decided per row.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
from areal.api import ModelRequest, RolloutWorkflow
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig

from areal_tik.adapter import exactness, reuse
from areal_tik.adapter.audit import RunState
from areal_tik.adapter.old_logprobs import OldLogprobs
from areal_tik.adapter.server import TikServer

from .test_areal_reuse import group, trajectory
from .test_areal_server import TIMEOUT, make_llm
from .test_old_logprobs import exact_recompute


class Generations(RolloutWorkflow):
    """A workflow of one or more generations (one per gconfig), built as RLVRWorkflow
    builds its trajectory (a [1, L] dict of the last response)."""

    def __init__(self, *gconfigs: GenerationHyperparameters):
        self.gconfigs = gconfigs

    async def arun_episode(self, engine, data):
        for g in self.gconfigs:
            resp = await engine.agenerate(ModelRequest(input_ids=list(data["ids"]), gconfig=g))
        n = resp.input_len + resp.output_len
        return {"input_ids": torch.tensor([resp.input_tokens + resp.output_tokens]),
                "logprobs": torch.tensor([[0.0] * resp.input_len + resp.output_logprobs]),
                "loss_mask": torch.tensor([[0] * resp.input_len + [1] * resp.output_len]),
                "versions": torch.tensor([[-1] * resp.input_len + resp.output_versions]),
                "attention_mask": torch.ones(1, n, dtype=torch.bool)}


def gconfig(**kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=3, **kw)


def engine_config() -> InferenceEngineConfig:
    return InferenceEngineConfig(experiment_name="tik-exactness", trial_name="t0", setup_timeout=30,
                                 request_timeout=TIMEOUT, request_retries=1, pause_grace_period=0.0,
                                 consumer_batch_size=1, max_head_offpolicyness=100)  # no staleness wait


@pytest.fixture(params=["inprocess", "server"])
def engine(request):
    """The in-process engine, or the client over a server, behind AReaL's WorkflowExecutor."""
    from areal_tik.adapter.client import TikRemoteInfEngine
    from areal_tik.adapter.inference import TikInferenceEngine

    llm = make_llm()
    server = None
    if request.param == "inprocess":
        eng = TikInferenceEngine(engine_config(), llm=llm)
        eng.initialize()
    else:
        server = TikServer(llm).start()
        eng = TikRemoteInfEngine(engine_config())
        eng.initialize(addr=server.address, train_data_parallel_size=1)
    try:
        yield eng
    finally:
        eng.destroy()
        if server is not None:
            server.stop()
        llm.close()


def rollout(engine, workflow) -> dict:
    (traj,) = engine.rollout_batch([{"ids": [5, 9, 17]}], workflow=workflow)
    return traj


def test_trajectories_carry_their_temperature_and_sampling(engine):
    assert type(engine.workflow_executor) is exactness.ExactnessWorkflowExecutor
    plain = rollout(engine, Generations(gconfig(temperature=0.7)))
    assert plain[exactness.TEMPERATURE_KEY].dtype == torch.float32
    assert plain[exactness.TEMPERATURE_KEY].tolist() == [torch.tensor(0.7).item()]
    assert plain[exactness.MATCH_KEY].tolist() == [True]
    top_p = rollout(engine, Generations(gconfig(temperature=1.0, top_p=0.9)))
    assert top_p[exactness.TEMPERATURE_KEY].tolist() == [1.0] and top_p[exactness.MATCH_KEY].tolist() == [False]
    greedy = rollout(engine, Generations(gconfig(greedy=True)))
    assert greedy[exactness.TEMPERATURE_KEY].tolist() == [1.0] and greedy[exactness.MATCH_KEY].tolist() == [False]
    mixed = rollout(engine, Generations(gconfig(temperature=0.7), gconfig(temperature=1.0)))
    assert math.isnan(mixed[exactness.TEMPERATURE_KEY].item())  # one episode, two temperatures


def test_a_server_that_does_not_say_leaves_the_fields_out():
    from areal_tik.adapter.client import TikServerBackend

    meta = {"output_token_logprobs": [[-0.5, 7, None]], "output_token_versions": [0],
            "finish_reason": {"type": "length"}}
    out = TikServerBackend().parse_generation_response({"meta_info": meta})
    assert out.logprob_temperature is None and out.logprobs_match_sampling is None
    traj = trajectory(2, [0], exact=False)
    exactness.stamp(traj, [(1.0, True), None])
    assert not any(k in traj for k in exactness.KEYS)


def stamped(traj: dict, temperature: float, match: bool = True) -> dict:
    exactness.stamp(traj, [(temperature, match)])
    return traj


def test_reuse_is_refused_per_row_where_the_temperature_differs():
    calls = []
    rows = [stamped(trajectory(2, [3, 3], seed=1), 1.0), stamped(trajectory(2, [3, 3], seed=2), 0.7),
            stamped(trajectory(2, [3, 3], seed=3), 1.0, match=False)]  # top-p / greedy: reused
    batch = [group(*rows)]
    old = OldLogprobs(RunState(audit_every=0), exact_recompute(calls), audit_sequences=0, temperature=1.0)
    stats, fell_back = old.prepare(batch, version=3, needs_prox=True)
    assert not fell_back and old.reuse_active
    assert stats["rows_refused_temperature"] == 1 and stats["rows_refused_no_exactness"] == 0
    assert stats["rows_truncated_sampling"] == 1
    assert stats["tokens_reused"] == 4 and stats["tokens_recomputed"] == 2
    # one recompute: the audit (rows 0 and 2, the refused row is not audited) and row 1
    assert [t["input_ids"].tolist() for t in calls[0]] == [batch[0]["input_ids"][r:r + 1].tolist() for r in (0, 2, 1)]
    assert stats["audited_tokens"] == 4 and stats["audit_passed"] == 1.0


def test_refusal_masks_live_on_the_batch_device():
    """On a GPU trainer the batch is on the GPU while the stamped temperature may come from
    the host: the masks follow ``input_ids`` so they combine with the batch's own masks.
    ("meta" stands in for a second device here.)"""
    traj = stamped(trajectory(2, [3, 3], seed=1), 1.0)
    traj = {k: v.to("meta") if k != exactness.TEMPERATURE_KEY and torch.is_tensor(v) else v
            for k, v in traj.items()}
    missing, other = exactness.row_refusals(traj, 1.0)
    assert missing.device.type == other.device.type == "meta"
    assert (reuse.scored_mask(traj) & (missing | other).reshape(-1, 1)).device.type == "meta"


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_trajectories_without_the_fields_are_recomputed_and_said_once():
    from areal_tik.adapter.log import logger

    records = Records()
    logger.addHandler(records)  # AReaL's loggers do not propagate to pytest's
    calls = []
    state = RunState()
    state.audit_pending = False
    old = OldLogprobs(state, exact_recompute(calls))
    for step in range(2):
        batch = [group(trajectory(2, [step, step], seed=4, exact=False)), stamped(trajectory(2, [step], seed=5), 1.0)]
        stats, _ = old.prepare(batch, version=step, needs_prox=True)
        assert stats["rows_refused_no_exactness"] == 1 and stats["tokens_recomputed"] == 2
        assert stats["tokens_reused"] == 1 and old.reuse_active
        assert torch.equal(batch[0]["prox_logp"], reuse.reused_logprobs(batch[0]))  # exact trainer
    logger.removeHandler(records)
    said = [m for m in records.messages if "carry no" in m]
    assert len(said) == 1 and "tik_logprob_temperature" in said[0]


def test_the_fields_are_removed_before_the_loss():
    batch = [stamped(trajectory(2, [0]), 1.0)]
    exactness.pop_fields(batch)
    assert not any(k in batch[0] for k in exactness.KEYS) and "logprobs" in batch[0]


def test_a_failed_device_qualification_refuses_reuse_naming_the_op(tmp_path, monkeypatch):
    import types

    from areal_tik import qualify
    from areal_tik.adapter.actor import qualification_refusals
    from areal_tik.qualify.verdict import store_verdicts

    monkeypatch.setenv(qualify.CACHE_ENV, str(tmp_path / "verdicts.json"))
    key = qualify.DeviceKey.of(torch.device("cpu"))
    failed = qualify.Verdict(key, [qualify.Check("attention prefill vs decode", False, "row 3 differs"),
                                   qualify.Check("linear", True, "ok")], 1.0)
    store_verdicts(qualify.cache_path(), {key.id: failed.to_json()})  # this device's cached verdict
    (reason,) = qualification_refusals(types.SimpleNamespace(device=torch.device("cpu")))
    assert "device qualification FAILED" in reason and "failing: attention prefill vs decode" in reason
    passed = qualify.Verdict(key, [qualify.Check("linear", True, "ok")], 1.0)
    store_verdicts(qualify.cache_path(), {key.id: passed.to_json()})
    assert qualification_refusals(types.SimpleNamespace(device=torch.device("cpu"))) == []

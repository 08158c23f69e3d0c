"""TikInferenceEngine: the areal-tik rollout engine behind AReaL's InferenceEngine interface,
in the training process (colocated).

It reuses AReaL's own request plumbing (``RemoteInfEngine``: workflow resolution,
``WorkflowExecutor`` with staleness control, submit/wait/prepare_batch, pause/resume)
and replaces the HTTP parts: ``agenerate`` runs the request on an in-process
``areal_tik.engine.LLM``, and weights arrive with ``load_weights`` from the actor (same
bf16 bits, copied in place between engine steps) instead of from disk or NCCL.

A weight update (``LLM.update_weights(..., recompute_running=True)``) sends every
running sequence back to prefill, so the tokens it samples next are computed with the
new weights over a KV cache computed by the new weights too: each token has one
version, and a trainer holding that version reproduces its log-prob bit for bit.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import torch
from areal.api import ModelRequest, ModelResponse
from areal.infra import RemoteInfEngine, WorkflowExecutor
from areal.utils import logging as areal_logging
from areal.utils import perf_tracer, stats_tracker

from . import exactness
from .heartbeat import RolloutHeartbeat
from .config import ColocatedEngineConfig
from .log import logger
from .sampling import sampling_params


def new_token_budget(req: ModelRequest) -> int:
    """Tokens ``req`` may still generate (``max_tokens`` counts the prompt); ValueError for
    requests the engine cannot serve (images) or that leave no room."""
    g = req.gconfig
    if req.image_data or req.vision_msg_vllm:
        raise ValueError("the areal-tik engine serves text-only decoder models; this request has images")
    budget = min(g.max_tokens - len(req.input_ids), g.max_new_tokens)
    if budget <= 0:
        raise ValueError(f"no room to generate: max_tokens={g.max_tokens}, "
                         f"prompt has {len(req.input_ids)} tokens")
    return budget


def build_llm(engine_config, model_path: str, dtype: torch.dtype, kernels: str, device):
    """An ``areal_tik.engine.LLM`` over the checkpoint at ``model_path``, sized by
    ``engine_config`` (the YAML's ``tik:`` block; ``max_model_len`` capped at the
    model's positions)."""
    import dataclasses

    from areal_tik.engine import LLM
    from areal_tik.model import UnifiedCausalLM
    from areal_tik.model.ops import engine_ops

    model = UnifiedCausalLM.from_pretrained(model_path, dtype=dtype, device=device,
                                            kernels=engine_ops(kernels, engine_config.compile_standard_ops),
                                            k_groups=engine_config.k_groups)
    max_len = min(engine_config.max_model_len, model.spec.max_positions)
    if max_len < engine_config.max_model_len:
        logger.info("areal-tik engine: max_model_len %d capped at the model's %d positions",
                    engine_config.max_model_len, max_len)
        engine_config = dataclasses.replace(engine_config, max_model_len=max_len)
    engine_config.check_kernels(model.kernels)
    return LLM(model, engine_config)


def prefix_cache_metrics(current: dict, previous: dict) -> dict[str, float]:
    """``tik/*`` prefix-cache metrics since the previous export (the engine's counters are
    cumulative): prompt tokens whose K/V came from the cache (prefill tokens saved), the
    admissions that hit, their share of the admitted prompt tokens, evictions."""
    delta = {key: current.get(key, 0) - previous.get(key, 0)
             for key in ("queries", "query_tokens", "hits", "hit_tokens", "evictions", "resets")}
    return {"tik/prefix_queries": float(delta["queries"]), "tik/prefix_hits": float(delta["hits"]),
            "tik/prefill_tokens_saved": float(delta["hit_tokens"]),
            "tik/prefix_hit_rate": delta["hit_tokens"] / max(delta["query_tokens"], 1),
            "tik/prefix_evictions": float(delta["evictions"]), "tik/prefix_resets": float(delta["resets"])}


class EngineAbortedError(RuntimeError):
    """A generation the in-process engine aborted (closed, or the request cancelled)."""


class TrainerFacingEngine(RemoteInfEngine):
    """What AReaL's engine classes (``RemoteSGLangEngine``) add to ``RemoteInfEngine`` for
    the trainer: stats export and the perf tracer; and trajectories that carry their
    exactness fields (``exactness.ExactnessWorkflowExecutor`` replaces the executor
    ``RemoteInfEngine.initialize`` builds)."""

    @property
    def workflow_executor(self) -> WorkflowExecutor:
        return RemoteInfEngine.workflow_executor.fget(self)

    @workflow_executor.setter
    def workflow_executor(self, executor: WorkflowExecutor) -> None:
        if type(executor) is WorkflowExecutor:  # AReaL's own, not yet initialized
            executor = exactness.ExactnessWorkflowExecutor(config=executor.config, inference_engine=self)
        RemoteInfEngine.workflow_executor.fset(self, executor)

    def export_stats(self) -> dict[str, float]:
        return stats_tracker.export_all(reduce_group=None)

    def save_perf_tracer(self, step: int | None = None, force: bool = False) -> None:
        perf_tracer.save(step=step, force=force)

    def config_perf_tracer(self, config, rank: int, role: str) -> None:
        if not perf_tracer.is_configured():
            perf_tracer.configure(config, rank=rank, role=role)


class TikInferenceEngine(TrainerFacingEngine):
    """In-process InferenceEngine over the areal-tik LLM (``is_areal_tik_engine``)."""

    is_areal_tik_engine = True
    tik_in_process = True  # weights are copied in place by the actor, not sent over disk/NCCL

    def __init__(self, config, llm=None, *, model_path: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, kernels: str = "unified", device=None,
                 engine_config=None):
        super().__init__(config, backend=None)
        if llm is None and not model_path:
            raise ValueError("TikInferenceEngine needs an LLM or a model_path to build one")
        self.llm = llm
        self._owns_llm = llm is None
        engine_config = ColocatedEngineConfig() if engine_config is None else engine_config
        self._build_args = (engine_config, model_path, dtype, kernels, device)

    def initialize(self, engine_id: str | None = None, addr=None, train_data_parallel_size: int | None = None):
        if addr:
            raise ValueError(f"the in-process areal-tik engine serves no address; got addr={addr!r}")
        self.engine_id = engine_id or uuid.uuid4().hex
        self.logger = areal_logging.getLogger(f"areal-tik engine {self.engine_id}")
        if self.llm is None:
            self.llm = build_llm(*self._build_args)
        self.workflow_executor = WorkflowExecutor(config=self.config, inference_engine=self)
        self.workflow_executor.initialize(logger=self.logger, train_data_parallel_size=train_data_parallel_size)
        self.heartbeat = RolloutHeartbeat(self.logger.info)
        self._initialized = True

    def destroy(self):
        super().destroy()
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.close()
        if self._owns_llm and self.llm is not None:
            self.llm.close()

    def export_stats(self) -> dict[str, float]:
        stats = super().export_stats()
        if self.llm is not None and self.llm.config.enable_prefix_caching:
            current = self.llm.prefix_cache_stats
            stats.update(prefix_cache_metrics(current, getattr(self, "_prefix_seen", {})))
            self._prefix_seen = current
        return stats

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        gconfig = req.gconfig
        max_new_tokens = new_token_budget(req)
        params = sampling_params(gconfig, max_new_tokens, self.llm.vocab_size)
        while self.workflow_executor.is_paused():
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        with self.heartbeat.track():
            out = await asyncio.wrap_future(self.llm.submit(list(req.input_ids), params))
        latency = time.perf_counter() - start
        exactness.record(out.logprob_temperature, out.logprobs_match_sampling)
        if out.finish_reason == "abort":
            # The in-process engine aborts a request only when it is closed or the request
            # was cancelled: an interrupted trajectory must not become an ordinary sample
            # (it used to be reported as "length").
            raise EngineAbortedError(
                f"the areal-tik engine aborted this request after {len(out.token_ids)} tokens "
                "(engine closed or request cancelled)")
        stop_reason = out.finish_reason
        return ModelResponse(
            input_tokens=list(req.input_ids), output_tokens=list(out.token_ids),
            output_logprobs=list(out.logprobs), output_versions=list(out.versions),
            stop_reason=stop_reason, tokenizer=req.tokenizer, processor=req.processor,
            latency=latency, ttft=latency)

    # ------------------------------------------------------------------ weights

    def load_weights(self, named_tensors, version: int) -> None:
        """Copy ``(name, tensor)`` pairs (compute dtype) into the engine, then tag ``version``."""
        state = dict(named_tensors)
        # recompute_running: running sequences go back to prefill (see the module docstring)
        restarted = self.llm.update_weights(state, version=version, recompute_running=True)
        self.logger.info("areal-tik engine: weights version %d loaded (%d tensors, %d running "
                         "sequences re-prefilled)", version, len(state), restarted)

    def update_weights_from_disk(self, meta):
        raise NotImplementedError("the in-process areal-tik engine receives weights from the actor "
                                  "(TikFSDPPPOActor.update_weights), not from disk")

    def update_weights_from_distributed(self, meta, param_specs):
        raise NotImplementedError("the in-process areal-tik engine receives weights from the actor "
                                  "(TikFSDPPPOActor.update_weights), not over NCCL")

    def init_weights_update_group(self, meta, xccl_group_ranks=None):
        raise NotImplementedError("the in-process areal-tik engine needs no weight-update group")

    # ------------------------------------------------------------------ control

    @contextlib.contextmanager
    def between_steps(self):
        """Hold the engine between two steps: no engine kernel runs inside the block."""
        self.llm.pause()
        try:
            yield
        finally:
            self.llm.resume()

    def pause_generation(self):
        self.llm.pause()

    def continue_generation(self):
        self.llm.resume()

    def offload(self) -> None:
        raise NotImplementedError("offloading the in-process areal-tik engine is not supported; "
                                  "set enable_offload=false and do not colocate by scheduling")

    def onload(self, tags=None) -> None:
        raise NotImplementedError("onloading the in-process areal-tik engine is not supported")

    def launch_server(self, server_args):
        raise NotImplementedError("the areal-tik engine runs in process; it launches no server")

    def teardown_server(self):
        return None


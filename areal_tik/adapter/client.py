"""The client side of server mode: AReaL's ``RemoteInfEngine`` over areal-tik servers
(``server.py``, beside it).

``TikServerBackend`` is the backend object ``RemoteInfEngine(config, backend)`` takes, in
the shape of AReaL's SGLang backend (same endpoints and payloads where they exist), so
AReaL drives an areal-tik server as it drives SGLang. Its parser also returns the
per-token weight versions the server recorded (``TikGenerationResult.output_versions``).

Stock ``RemoteInfEngine.agenerate`` stamps every token with the client's version at
request time, which is wrong for tokens sampled after a weight update landed mid-request
and would make the trainer reuse (or refuse) the wrong tokens. ``TikRemoteInfEngine``
is ``RemoteInfEngine`` with an ``agenerate`` that keeps the server's versions instead,
so reuse of rollout log-probs stays exact.
"""
from __future__ import annotations

import _thread
import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from areal.api import ModelRequest, ModelResponse
from areal.api.io_struct import HttpGenerationResult, HttpRequest, WeightUpdateRequests
from areal.infra import workflow_context
from areal.infra.utils.http import arequest_with_retry

from . import exactness, sampling
from .inference import TrainerFacingEngine, new_token_budget
from .log import logger


@dataclass
class TikGenerationResult(HttpGenerationResult):
    """``HttpGenerationResult`` plus the weight version of each output token."""

    output_versions: list[int] = field(default_factory=list)
    logprob_temperature: float | None = None      # None: the server did not say
    logprobs_match_sampling: bool | None = None


class TikServerBackend:
    """Request builder / response parser for an areal-tik server (SGLang-shaped)."""

    def build_generation_request(self, req: ModelRequest, with_lora: bool, version: int) -> HttpRequest:
        """SGLang's ``/generate`` payload; the sampling options go through the one
        gconfig translation (``sampling.sampling_params``), so an option the engine does
        not implement fails here, before any request is sent."""
        if with_lora:
            raise NotImplementedError("LoRA is not supported by the areal-tik engine")
        params = sampling.sampling_params(req.gconfig, req.gconfig.max_new_tokens, vocab_size=None)
        payload = {"input_ids": list(req.input_ids), "image_data": req.image_data,
                   "sampling_params": sampling.to_json(params), "return_logprob": True, "stream": False}
        return HttpRequest(endpoint="/generate", payload=payload)

    def parse_generation_response(self, response: dict[str, Any]) -> TikGenerationResult:
        meta = response["meta_info"]
        pairs = meta["output_token_logprobs"]
        versions = [int(v) for v in meta["output_token_versions"]]
        if len(versions) != len(pairs):
            raise ValueError(f"server returned {len(pairs)} tokens but {len(versions)} versions")
        return TikGenerationResult(
            output_tokens=[int(p[1]) for p in pairs], output_logprobs=[float(p[0]) for p in pairs],
            stop_reason=meta["finish_reason"]["type"], output_versions=versions,
            logprob_temperature=meta.get("logprob_temperature"),
            logprobs_match_sampling=meta.get("logprobs_match_sampling"))

    def build_score_request(self, input_ids, target_len, with_lora, version) -> HttpRequest:
        raise NotImplementedError("the areal-tik server does not score prompts (compute_logp)")

    def parse_score_response(self, response, target_len) -> list[float]:
        raise NotImplementedError("the areal-tik server does not score prompts (compute_logp)")

    def build_disk_weight_update_requests(self, meta) -> WeightUpdateRequests:
        if meta.use_lora:
            raise NotImplementedError("LoRA is not supported by the areal-tik engine")
        payload = {"model_path": str(meta.path), "abort_all_requests": False,
                   "weight_version": meta.version}
        return WeightUpdateRequests(requests=[HttpRequest(endpoint="/update_weights_from_disk", payload=payload)])

    def build_distributed_weight_update_requests(self, meta, param_specs) -> WeightUpdateRequests:
        """SGLang's payload plus ``weight_version``: the server stages the buckets and applies
        them at once, as that version, when they cover the whole model."""
        if meta.use_lora:
            raise NotImplementedError("LoRA is not supported by the areal-tik engine")
        payload = {"names": [p.name for p in param_specs], "dtypes": [p.dtype for p in param_specs],
                   "shapes": [list(p.shape) for p in param_specs], "group_name": meta.nccl_group_name,
                   "weight_version": meta.version}
        return WeightUpdateRequests(requests=[HttpRequest(endpoint="/update_weights_from_distributed",
                                                          payload=payload)])

    def build_init_weights_group_request(self, addr, server_idx, meta) -> HttpRequest:
        """The trainer (rank 0) and every server rank, as AReaL sizes the group (its world
        size + 1): server ``server_idx`` of tensor-parallel size t holds ranks
        ``1 + server_idx * t`` .. ``+ t - 1`` (it passes ``rank_offset``, each of its ranks
        joins at its offset). No pipeline parallelism."""
        if meta.gen_allocation is None:
            raise ValueError("meta.gen_allocation is needed to size the weight update group")
        par = meta.gen_allocation.parallel
        if par.pp_size > 1:
            raise NotImplementedError(f"areal-tik servers do not run pipeline parallelism; got "
                                      f"pp_size={par.pp_size}")
        from areal.infra.platforms import current_platform
        from areal.utils.network import format_host_for_url

        return HttpRequest(endpoint="/init_weights_update_group", payload={
            "master_address": format_host_for_url(meta.nccl_master_address),
            "master_port": str(meta.nccl_master_port), "rank_offset": 1 + server_idx * par.tp_size,
            "world_size": par.world_size + 1, "backend": current_platform.communication_backend,
            "group_name": meta.nccl_group_name})

    def get_pause_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/pause_generation", payload={})

    def get_resume_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/continue_generation", payload={})

    def get_health_check_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/health", payload={}, method="GET")

    def get_version_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/get_weight_version", payload={}, method="GET")

    def get_offload_request(self) -> HttpRequest:
        raise NotImplementedError("offloading the areal-tik server is not supported")

    def get_onload_request(self, tags=None) -> HttpRequest:
        raise NotImplementedError("onloading the areal-tik server is not supported")

    def launch_server(self, server_args: dict[str, Any]) -> subprocess.Popen:
        """Start ``areal-tik serve`` with ``model``/``host``/``port`` (``model_path``
        accepted for SGLang-style args), optional ``dtype``/``kernels``/``device`` and an
        ``engine`` (``EngineConfig``) whose fields become the server's engine flags."""
        from areal_tik.commands.flags import dataclass_to_argv

        model = server_args.get("model") or server_args.get("model_path")
        if not model:
            raise ValueError(f"server_args needs 'model' (or 'model_path'), got {sorted(server_args)}")
        cmd = [sys.executable, "-m", "areal_tik.cli", "serve", "--model", str(model), "--parent-pid", str(os.getpid()),
               "--host", str(server_args.get("host", "127.0.0.1")), "--port", str(server_args.get("port", 0))]
        for key in ("dtype", "kernels", "device"):
            if server_args.get(key) is not None:
                cmd += [f"--{key}", str(server_args[key])]
        if server_args.get("engine") is not None:
            cmd += dataclass_to_argv(server_args["engine"])
        return subprocess.Popen(cmd)


def watch_servers(procs: list, stopping, on_death, poll_s: float = 1.0) -> threading.Thread:
    """A daemon thread that calls ``on_death(proc)`` once, for the first process in ``procs``
    (a list that may grow) that ends with a non-zero code while ``stopping()`` is false.

    AReaL's rollout loop logs a failed request and waits for more rollouts, so a trainer
    whose server has died waits for ever; its engine stops the trainer instead."""
    def run() -> None:
        while True:
            time.sleep(poll_s)
            if stopping():
                return
            for proc in list(procs):
                code = proc.poll()
                if code not in (None, 0):
                    on_death(proc)
                    return

    thread = threading.Thread(target=run, name="areal-tik-server-watch", daemon=True)
    thread.start()
    return thread


def _stop_the_trainer(proc) -> None:
    logger.error("the areal-tik server (pid %d) ended with code %s: its log says why (an engine that broke "
                 "ends its server); stopping the trainer, which would otherwise wait for its rollouts for ever",
                 proc.pid, proc.returncode)
    _thread.interrupt_main()


class TikRemoteInfEngine(TrainerFacingEngine):
    """``RemoteInfEngine`` whose responses carry the server's per-token weight versions.

    ``own_servers``: server processes this engine launched (``launch_local_server``); they
    are stopped by ``destroy``.
    """

    is_areal_tik_engine = True

    def __init__(self, config, backend: TikServerBackend | None = None):
        super().__init__(config, backend or TikServerBackend())
        self.own_servers: list[subprocess.Popen] = []
        self._stopping = False
        self._watch: threading.Thread | None = None

    def launch_local_server(self, server_args: dict[str, Any]) -> str:
        """Start one areal-tik server on a free local port; returns its 'host:port'
        (``initialize(addr=...)`` then waits until it answers /health)."""
        from areal.utils.network import find_free_ports

        port = find_free_ports(1)[0]
        self.own_servers.append(self.backend.launch_server({**server_args, "host": "127.0.0.1", "port": port}))
        if self._watch is None:
            self._watch = watch_servers(self.own_servers, lambda: self._stopping, _stop_the_trainer)
        return f"127.0.0.1:{port}"

    def server_health(self, timeout: float = 30.0) -> dict[str, dict]:
        """``{address: /health answer}`` of each server."""
        import json
        import urllib.request

        found = {}
        for addr in self.addresses:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout) as r:
                found[addr] = json.loads(r.read())
        return found

    def server_kernels(self, timeout: float = 30.0) -> dict[str, str | None]:
        """``{address: kernel set}`` as each server's /health reports it."""
        return {addr: health.get("kernels") for addr, health in self.server_health(timeout).items()}

    def server_k_groups(self, timeout: float = 30.0) -> dict[str, int | None]:
        """``{address: k_groups}`` (the row-parallel K-group tree) as each server reports it."""
        return {addr: health.get("k_groups") for addr, health in self.server_health(timeout).items()}

    def destroy(self):
        self._stopping = True  # the servers are about to end: not a death to react to
        try:
            super().destroy()
        finally:
            for proc in self.own_servers:
                proc.terminate()
            for proc in self.own_servers:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.own_servers = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Like ``RemoteInfEngine.agenerate`` (one server per rid, resume after an abort),
        with ``output_versions`` from the server."""
        req = req.copy()
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(f"one request samples one sequence; got n_samples={g.n_samples}")
        max_new = g.max_new_tokens = new_token_budget(req)
        addr = self._server_for(req.rid)
        session = await workflow_context.get_aiohttp_session()
        start = time.perf_counter()
        prompt_len = len(req.input_ids)
        tokens, logprobs, versions, stop_reason = [], [], [], None
        while stop_reason not in ("stop", "tool_calls", "length") and len(tokens) < max_new:
            while self.workflow_executor.is_paused():
                await asyncio.sleep(0.05)
            http_req = self.backend.build_generation_request(req, with_lora=False, version=self.get_version())
            result = await arequest_with_retry(
                session=session, addr=addr, endpoint=http_req.endpoint, payload=http_req.payload,
                method=http_req.method, max_retries=self.config.request_retries,
                timeout=self.config.request_timeout)
            if not isinstance(result, dict):
                raise ValueError(f"expected a JSON object from the server, got {type(result).__name__}")
            out = self.backend.parse_generation_response(result)
            exactness.record(out.logprob_temperature, out.logprobs_match_sampling)
            stop_reason = out.stop_reason
            tokens += out.output_tokens
            logprobs += out.output_logprobs
            versions += out.output_versions
            req.input_ids = list(req.input_ids) + out.output_tokens
            g.max_new_tokens -= len(out.output_tokens)
        if stop_reason == "abort":  # left the loop with the budget spent
            stop_reason = "length"
        latency = time.perf_counter() - start
        return ModelResponse(
            input_tokens=list(req.input_ids[:prompt_len]), output_tokens=tokens,
            output_logprobs=logprobs, output_versions=versions, stop_reason=stop_reason,
            tokenizer=req.tokenizer, processor=req.processor, latency=latency, ttft=latency)

    def _server_for(self, rid) -> str:
        # One server per request id (AReaL keeps a multi-turn conversation on one KV cache).
        with self.lock:
            if rid not in self.rid_to_address:
                self.rid_to_address[rid] = self.choose_server()
                self.rid_queue.append(rid)
                if len(self.rid_queue) > 128:
                    self.rid_to_address.pop(self.rid_queue.pop(0), None)
            return self.rid_to_address[rid]

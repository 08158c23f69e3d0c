"""Server mode of the areal-tik rollout engine: an HTTP server around ``areal_tik.engine.LLM``
with the SGLang-like endpoints AReaL's ``RemoteInfEngine`` drives (see ``client.py``).

Endpoints (JSON bodies; errors are ``{"error": message}`` with a 4xx/5xx status):

- ``POST /generate``: ``{"input_ids": [...], "sampling_params": {temperature, top_k, top_p,
  max_new_tokens, stop_token_ids, ignore_eos, seed}}`` -> ``{"output_ids": [...],
  "meta_info": {"output_token_logprobs": [[logprob, token, null], ...],
  "output_token_versions": [...], "finish_reason": {"type": ...}, "prompt_tokens",
  "completion_tokens", "weight_version", "logprobs_match_sampling"}}``. Each token's
  version is the engine's version when it was sampled (not the client's).
- ``POST /pause_generation`` / ``POST /continue_generation``: stop / restart stepping;
  requests in flight wait (they are not aborted) and continue after the resume.
- ``POST /update_weights_from_disk``: ``{"model_path": dir, "weight_version": int | null}``
  loads every ``*.safetensors`` file of ``dir`` and calls ``LLM.update_weights`` (default
  version: current + 1); running sequences go back to prefill.
- ``POST /init_weights_update_group``: ``{"master_address", "master_port", "rank_offset",
  "world_size", "backend", "group_name"}`` (SGLang's payload) joins the trainer's
  weight-update process group (NCCL on GPUs, gloo on CPU) as rank ``rank_offset``; returns
  once the trainer has joined too.
- ``POST /update_weights_from_distributed``: ``{"names", "dtypes", "shapes", "group_name",
  "weight_version"}`` receives one bucket of tensors by broadcast from the group's rank 0.
  Buckets are staged per ``weight_version`` and applied together, in one
  ``LLM.update_weights``, once they cover every tensor of the model: no token is ever
  sampled from half-updated weights, and a bucket of another version drops what was
  staged (a failed partial update is never completed by its old tensors under a new tag).
- ``GET /health`` (``{"status", "paused", "kernels", "k_groups", "tensor_parallel_size",
  "vocab_parallel", "vocab_rows", "vocab_saved_bytes", "prefix_cache"}``; the vocabulary
  fields are rank 0's, see ``LLM.vocab_parallel_stats``), ``GET /get_weight_version``
  (``{"weight_version": int}``).

An engine whose step loop stops on an error (a CUDA fault, running out of memory) refuses
every later request with 503; since AReaL's rollout loop logs failed requests and waits for
more rollouts, the server then ends (``areal-tik serve`` exits with code 1, naming the
error), and the trainer's ``TikRemoteInfEngine``, which watches the servers it launched,
stops the trainer rather than letting it wait for ever.

``areal-tik serve --model <path> --port N`` serves a checkpoint; the engine flags are
generated from ``EngineConfig`` (``areal-tik serve --help``). With
``--tensor-parallel-size t`` (t > 1) it runs as t processes, one per rank, rank 0 serving
HTTP and passing every engine call on to the others (``server_tp.py``; ``serve.py`` is the
command that picks one). Sampling options are
translated by ``sampling.from_json``, the same translation the client and the in-process
engine use.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

from aiohttp import web

from . import sampling

logger = logging.getLogger(__name__)

class BadRequest(ValueError):
    """A request the server refuses (HTTP 400)."""


def load_safetensors_dir(path, device) -> dict:
    """``{name: tensor}`` from every ``*.safetensors`` file in the directory ``path``."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        raise BadRequest(f"model_path {str(path)!r} is not a directory holding *.safetensors files")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    return state


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class TikServer:
    """The aiohttp application around one ``LLM``, served from a background thread by
    ``start()`` (port 0 binds an ephemeral port; ``address`` then names it)."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0):
        self.llm = llm
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._weights_lock = asyncio.Lock()
        self._groups: dict = {}          # group_name -> process group (weight updates)
        self._staged: dict = {}          # name -> tensor received for the pending update ...
        self._staged_version = None      # ... of this weight_version
        # Set once the engine's step loop has stopped on an error: every later request would
        # be refused, and AReaL's rollout loop retries refused requests for ever, so the
        # process ends instead (serve_until) and the trainer that launched it sees the exit.
        self.broken = threading.Event()
        self.broken_reason = ""

    def _check_broken(self) -> None:
        error = getattr(self.llm, "error", None)
        if error is not None and not self.broken.is_set():
            self.broken_reason = f"{type(error).__name__}: {error}"
            logger.error("the engine's step loop stopped on %s; the server stops", self.broken_reason)
            self.broken.set()

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/generate", self.generate), web.get("/health", self.health),
            web.get("/health_generate", self.health), web.get("/get_weight_version", self.weight_version),
            web.post("/pause_generation", self.pause), web.post("/continue_generation", self.resume),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed)])
        return app

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
        return body

    # ------------------------------------------------------------------ handlers

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if body.get("image_data"):
                raise BadRequest("the areal-tik engine serves text-only models; got image_data")
            if body.get("lora_path"):
                raise BadRequest("LoRA is not supported by the areal-tik engine")
            params = sampling.from_json(body.get("sampling_params", {}), self.llm.vocab_size)
            ids = body.get("input_ids")
            if not isinstance(ids, list):
                raise BadRequest(f"input_ids must be a list of token ids, got {type(ids).__name__}")
            future = self.llm.submit(ids, params)   # validates: ValueError/TypeError name the value
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except RuntimeError as exc:  # engine closed, or broken by an earlier step
            self._check_broken()
            return _error(503, str(exc))
        try:
            out = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # client went away: abort the request at the next step
            raise
        except Exception as exc:  # the engine step failed
            logger.exception("generation failed")
            self._check_broken()
            return _error(500, f"generation failed: {exc}")
        meta = {
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(out.logprobs, out.token_ids)],
            "output_token_versions": list(out.versions),
            "finish_reason": {"type": out.finish_reason},
            "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.token_ids),
            "weight_version": self.llm.version,
            "logprob_temperature": out.logprob_temperature,
            "logprobs_match_sampling": out.logprobs_match_sampling,
        }
        return web.json_response({"output_ids": list(out.token_ids), "meta_info": meta})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "paused": self.llm.paused,
                                  "kernels": getattr(self.llm.model, "kernels", None),
                                  "k_groups": getattr(self.llm.model, "k_groups", 1),
                                  "tensor_parallel_size": self.llm.config.tensor_parallel_size,
                                  **self.llm.vocab_parallel_stats,
                                  "prefix_cache": self.llm.prefix_cache_stats})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.llm.version})

    async def pause(self, request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(None, self.llm.pause)
        return web.json_response({"success": True, "paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.llm.resume()
        return web.json_response({"success": True, "paused": False})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise BadRequest(f"model_path must be a directory path, got {path!r}")
            version = body.get("weight_version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
                raise BadRequest(f"weight_version must be an int >= 0, got {version!r}")
            loop = asyncio.get_running_loop()
            async with self._weights_lock:
                count, restarted = await loop.run_in_executor(None, self.load_weights_from_disk, path, version)
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        logger.info("weights version %d loaded from %s (%d tensors, %d running sequences re-prefilled)",
                    self.llm.version, path, count, restarted)
        return web.json_response({"success": True, "message": "ok", "weight_version": self.llm.version,
                                  "num_restarted": restarted})

    def load_weights_from_disk(self, path: str, version: int | None) -> tuple[int, int]:
        """Load ``path`` into the engine: (tensors loaded, running sequences re-prefilled)."""
        state = load_safetensors_dir(path, self.llm.device)
        return len(state), self.llm.update_weights(state, version=version, recompute_running=True)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            name = body.get("group_name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"group_name must be a non-empty string, got {name!r}")
            if name in self._groups:
                raise BadRequest(f"weight update group {name!r} already exists")
            ints = {}
            for key in ("master_port", "rank_offset", "world_size"):
                try:
                    ints[key] = int(body.get(key))
                except (TypeError, ValueError):
                    raise BadRequest(f"{key} must be an integer, got {body.get(key)!r}") from None
            if not 0 < ints["rank_offset"] < ints["world_size"]:
                raise BadRequest(f"rank_offset must be in [1, world_size), got {ints['rank_offset']} "
                                 f"with world_size {ints['world_size']}")
            backend = body.get("backend") or ("nccl" if self.llm.device.type == "cuda" else "gloo")
            addr = body.get("master_address")
            if not isinstance(addr, str) or not addr:
                raise BadRequest(f"master_address must be a host name, got {addr!r}")
        except BadRequest as exc:
            return _error(400, str(exc))
        join = (backend, f"tcp://{addr}:{ints['master_port']}", ints["world_size"], ints["rank_offset"], name)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.join_weight_group, *join)
        except (RuntimeError, ValueError) as exc:
            return _error(500, f"joining weight update group {name!r} failed: {exc}")
        logger.info("joined weight update group %r as rank %d of %d (%s)", name, ints["rank_offset"],
                    ints["world_size"], backend)
        return web.json_response({"success": True, "message": "ok"})

    def join_weight_group(self, backend: str, init_method: str, world_size: int, rank: int, name: str) -> None:
        """Join the trainer's weight-update group ``name`` as ``rank`` (AReaL's own helper)."""
        from areal.engine.core.distributed import init_custom_process_group

        self._groups[name] = init_custom_process_group(backend=backend, init_method=init_method,
                                                       world_size=world_size, rank=rank, group_name=name)

    def receive_bucket(self, group_name: str, names, dtypes, shapes, version: int | None) -> dict:
        """One bucket of the update ``version`` by broadcast from the group's rank 0."""
        return self._receive_bucket(self._groups[group_name], names, dtypes, shapes)

    def _receive_bucket(self, group, names, dtypes, shapes) -> dict:
        import torch
        import torch.distributed as dist

        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.llm.device)
            dist.broadcast(tensor, src=0, group=group)
            received[name] = tensor
        if self.llm.device.type == "cuda":
            torch.cuda.synchronize(self.llm.device)
        return received

    def stage(self, received: dict, version: int | None) -> dict | None:
        """Stage one bucket of ``version``; the whole update once the buckets of that version
        cover every tensor of the model (the staging is then empty again), else None.
        Tensors staged for another version are dropped first: never completed by these."""
        if self._staged and self._staged_version != version:
            logger.warning("dropping %d staged tensors of weight version %s: a bucket of version %s "
                           "arrived before that update was complete", len(self._staged),
                           self._staged_version, version)
            self._staged = {}
        self._staged_version = version
        self._staged.update(received)
        try:
            if self.llm.validate_weights(self._staged):
                return None
        except (TypeError, ValueError):
            self._staged = {}
            raise
        staged, self._staged = self._staged, {}
        return staged

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        import torch

        try:
            body = await self._json(request)
            group = self._groups.get(body.get("group_name"))
            if group is None:
                raise BadRequest(f"group_name {body.get('group_name')!r} is not a weight update group of "
                                 f"this server (known: {sorted(self._groups)}); call /init_weights_update_group")
            names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                    and len(names) == len(dtypes) == len(shapes)):
                raise BadRequest("names, dtypes and shapes must be lists of one length")
            for dtype in dtypes:
                if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                    raise BadRequest(f"dtypes: {dtype!r} is not a torch dtype name")
            version = body.get("weight_version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
                raise BadRequest(f"weight_version must be an int >= 0, got {version!r}")
        except BadRequest as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        async with self._weights_lock:
            # Receive first, whatever happens next: the trainer is broadcasting already.
            try:
                received = await loop.run_in_executor(None, self.receive_bucket, body["group_name"], names, dtypes,
                                                      shapes, version)
            except RuntimeError as exc:  # a collective failure (torch's DistBackendError is one)
                self._staged = {}
                return _error(500, f"receiving the broadcast failed: {exc}")
            try:
                staged = self.stage(received, version)
                if staged is None:  # tensors still to come
                    return web.json_response({"success": True, "message": "staged",
                                              "staged_tensors": len(self._staged)})
                restarted = await loop.run_in_executor(
                    None, lambda: self.llm.update_weights(staged, version=version, recompute_running=True))
            except (TypeError, ValueError) as exc:
                self._staged = {}
                return _error(400, f"weight update refused: {exc}")
        logger.info("weights version %d received by broadcast (%d tensors, %d running sequences "
                    "re-prefilled)", self.llm.version, len(staged), restarted)
        return web.json_response({"success": True, "message": "ok", "weight_version": self.llm.version,
                                  "num_restarted": restarted})

    # ------------------------------------------------------------------ lifecycle

    async def _start_site(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the ephemeral port actually bound

    def start(self) -> "TikServer":
        """Serve from a daemon thread; returns once the port is bound."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start_site())
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="areal-tik-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self, close_llm: bool = False) -> None:
        """Stop serving (and close the engine with ``close_llm``); idempotent."""
        if self._thread is not None and self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._thread = None
        if close_llm:
            self.llm.close()

    def __enter__(self) -> "TikServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser) -> None:
    from areal_tik.commands.flags import add_dataclass_arguments
    from areal_tik.engine.config import EngineConfig
    from areal_tik.runtime import DEFAULT_KERNELS, KERNEL_SETS

    parser.add_argument("--model", required=True, help="local HF checkpoint dir or .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = an ephemeral port (logged)")
    parser.add_argument("--dtype", default="bfloat16", help=f"one of {SERVED_DTYPES}")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS, choices=KERNEL_SETS)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="end when the process with this pid (this server's parent, a trainer) ends")
    add_dataclass_arguments(parser.add_argument_group("engine (EngineConfig)"), EngineConfig)


SERVED_DTYPES = ("bfloat16", "float32")  # those generate/check and the trainer's bits are verified in


def check_args(args):
    """Refuse, before any model is loaded, the options that would fail later (UsageError:
    ``areal-tik`` answers it in one line); returns the ``EngineConfig``."""
    from areal_tik.commands.flags import dataclass_from_args
    from areal_tik.engine import EngineConfig
    from areal_tik.errors import UsageError

    if args.dtype not in SERVED_DTYPES:
        raise UsageError(f"--dtype {args.dtype} is not served; use one of {SERVED_DTYPES} "
                         "(the bitwise contract is verified in those)")
    try:
        config = dataclass_from_args(EngineConfig, args)
        config.check_kernels(args.kernels)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad engine option: {exc}") from None
    return config


def build_llm(args, device: str | None = None, tensor_parallel=None):
    """The ``LLM`` the flags describe (``max_model_len`` capped at the model's positions); with
    ``tensor_parallel`` (a rank's group) the model is cut to that rank's shard."""
    import torch

    from areal_tik.commands.flags import dataclass_from_args
    from areal_tik.engine import LLM, EngineConfig
    from areal_tik.model import UnifiedCausalLM
    from areal_tik.model.ops import engine_ops
    from areal_tik.model.tensor_parallel import shard_model

    device = device or args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = UnifiedCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device=device,
                                            kernels=engine_ops(args.kernels, args.compile_standard_ops),
                                            k_groups=args.k_groups)
    config = dataclass_from_args(EngineConfig, args,
                                 max_model_len=min(args.max_model_len, model.spec.max_positions))
    config.check_kernels(model.kernels)
    if tensor_parallel is not None:
        shard_model(model, tensor_parallel.rank, tensor_parallel.size, tensor_parallel.device_group,
                    vocab_parallel=config.vocab_parallel)
    return LLM(model, config, tensor_parallel=tensor_parallel)


def serve_until(server: TikServer, stop: threading.Event, note: str = "", poll_s: float = 0.5) -> bool:
    """Start ``server``, serve until ``stop`` is set (or Ctrl-C) or its engine breaks, then
    stop serving; True when the engine broke (the process should end with an error)."""
    server.start()
    logger.info("serving on http://%s%s", server.address, note)
    try:
        while not stop.wait(poll_s):
            if server.broken.is_set():
                return True
        return False
    except KeyboardInterrupt:
        return False
    finally:
        server.stop()

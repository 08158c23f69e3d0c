"""``areal-tik serve --tensor-parallel-size t`` (t > 1): the server as t processes, one per rank.

Rank 0 is this process: it serves HTTP exactly as the TP = 1 server does (``TikServer``,
same endpoints) over a ``ForwardingLLM``, which applies every engine call it makes (submit,
cancel, pause, resume, weight update, close) to rank 0's engine and sends the same call,
in the same order, over a pipe to ranks 1 .. t-1. Each of those runs ``_rank_main``: a
loop that applies the calls to its own engine. The engines' per-step agreement
(``engine.tensor_parallel``) then keeps the ranks in lock step: a call that reaches a rank
later than rank 0 only delays the step at which every rank acts on it.

Weight updates:
- from disk: rank 0 loads and applies the checkpoint, then each other rank loads the same
  directory and keeps its slice (``LLM.update_weights`` cuts full-model tensors to a rank);
- by broadcast (the xccl path): every rank joins the trainer's weight-update group, rank r
  as ``rank_offset + r`` (AReaL sizes that group as one rank per server worker, its
  ``gen_allocation`` world size + 1); rank 0 passes each bucket's request on, every rank
  receives the broadcast itself, stages it by weight version (``TikServer.stage``) and
  applies the complete update, keeping its slice. Every rank applies the same version, so
  per-token versions are unchanged; on GPUs each rank receives on its own device (NCCL).

Lifetime: ranks 1 .. t-1 end when rank 0 closes them, or at once when rank 0's pipe closes
(rank 0 died). Rank 0 polls its ranks; one that ends while serving (or an engine that
breaks) makes rank 0 log which rank, with its exit code, and exit 1 within seconds.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import traceback
from concurrent.futures import Future

from .server import TikServer, build_llm, load_safetensors_dir, serve_until

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0   # a collective's longest wait (a rank alive but stuck); dead ranks are seen at once
START_TIMEOUT_S = 600.0   # rank 0 waits this long for every rank's engine (model load, compile)
POLL_S = 0.2              # how often rank 0 looks at its ranks' processes
CLOSE_TIMEOUT_S = 30.0    # a rank's orderly shutdown; then it is killed


def rank_device(device: str | None, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda`` (or ``cuda:i``) shifts to ``cuda:(i + rank)``."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    return f"cuda:{(parsed.index or 0) + rank}"


def check_model_split(args, config) -> None:
    """ValueError naming both numbers unless ``config``'s split fits the checkpoint's heads,
    K widths and (``vocab_parallel``) vocabulary splits in ``--dtype`` (read from its
    config.json; a .gguf is checked once loaded)."""
    from pathlib import Path

    if Path(args.model).suffix == ".gguf":
        return
    import torch
    from transformers import AutoConfig

    from areal_tik.model import ModelSpec

    config.check_model(ModelSpec.from_hf_config(AutoConfig.from_pretrained(args.model)), getattr(torch, args.dtype))


def build_rank_llm(args, rank: int, init_method: str):
    """Rank ``rank``'s engine: join the group, load the checkpoint, keep this rank's shard."""
    from areal_tik.commands.flags import dataclass_from_args
    from areal_tik.engine import EngineConfig
    from areal_tik.engine.tensor_parallel import init_tensor_parallel


    import torch

    device = rank_device(args.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL groups (the model's, the trainer's) bind to the current device
    group = init_tensor_parallel(dataclass_from_args(EngineConfig, args), device, init_method=init_method,
                                 rank=rank, timeout_s=GROUP_TIMEOUT_S)
    return build_llm(args, device=device, tensor_parallel=group)


# ------------------------------------------------------------------ ranks 1 .. t-1


def _receive_and_stage(llm, weights: TikServer, group_name, names, dtypes, shapes, version) -> None:
    """This rank's part of one broadcast bucket: receive it, stage it, apply the update once
    complete; what rank 0 answers with an HTTP error is logged here (rank 0 refuses alike)."""
    try:
        received = weights.receive_bucket(group_name, names, dtypes, shapes, version)
    except RuntimeError as exc:
        weights._staged = {}
        logger.error("rank %d: receiving the broadcast failed: %s", llm.tensor_parallel.rank, exc)
        return
    try:
        staged = weights.stage(received, version)
        if staged is not None:
            llm.update_weights(staged, version=version, recompute_running=True)
    except (TypeError, ValueError) as exc:
        weights._staged = {}
        logger.error("rank %d: weight update refused: %s", llm.tensor_parallel.rank, exc)


def _apply(llm, futures: dict, weights: TikServer, message: tuple) -> None:
    """Apply one of rank 0's calls to this rank's engine (``weights``: its groups and staging)."""
    kind = message[0]
    if kind == "submit":
        _, n, ids, params = message
        future = llm.submit(ids, params)
        futures[n] = future
        future.add_done_callback(lambda _, n=n: futures.pop(n, None))
    elif kind == "cancel":
        future = futures.get(message[1])
        if future is not None:
            future.cancel()
    elif kind == "pause":
        llm.pause()
    elif kind == "resume":
        llm.resume()
    elif kind == "join":  # the trainer's group: rank 0 joins as rank_offset, rank r as rank_offset + r
        backend, init_method, world_size, rank_offset, name = message[1:]
        weights.join_weight_group(backend, init_method, world_size, rank_offset + llm.tensor_parallel.rank, name)
    elif kind == "bucket":
        _receive_and_stage(llm, weights, *message[1:])
    elif kind == "disk":
        llm.update_weights(load_safetensors_dir(message[1], llm.device), version=message[2],
                           recompute_running=True)
    else:
        raise ValueError(f"unknown message {kind!r} from rank 0")


def _rank_main(args, rank: int, init_method: str, conn) -> None:
    """Ranks 1 .. t-1: build the engine, say ready, apply rank 0's calls until it closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 ends us
    logging.basicConfig(level=logging.INFO)
    try:
        llm = build_rank_llm(args, rank, init_method)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise
    conn.send(("ready", None))
    futures: dict[int, Future] = {}
    weights = TikServer(llm)  # never started: its weight groups and staging, as on rank 0
    try:
        while True:
            try:
                message = conn.recv() if conn.poll(1.0) else None
            except (EOFError, OSError):
                logger.error("rank %d: rank 0 is gone; ending", rank)
                os._exit(1)
            if message is None:
                if llm.error is not None:
                    raise RuntimeError(f"rank {rank}'s engine broke") from llm.error
                continue
            if message[0] == "close":
                break
            _apply(llm, futures, weights, message)
    finally:
        llm.close()


# ------------------------------------------------------------------ rank 0


class RankLinks:
    """Rank 0's pipes to ranks 1 .. t-1 and their processes."""

    def __init__(self, args, size: int):
        import multiprocessing

        self._dir = tempfile.mkdtemp(prefix="areal-tik-tp-")
        self.init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, size):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(args, rank, self.init_method, there),
                               name=f"areal-tik-tp-rank {rank}", daemon=True)
            proc.start()
            there.close()  # this end lives in the rank now: its EOF tells us the rank is gone
            self.conns.append(here)
            self.procs.append(proc)
        self._lock = threading.Lock()
        self.closing = False

    def dead(self) -> str | None:
        """Which rank has ended, with its exit code; None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) ended with exit code {proc.exitcode}"
        return None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(POLL_S):
                if self.dead() or time.monotonic() > deadline:
                    raise RuntimeError(self.dead() or f"tensor-parallel rank {rank} not ready after {timeout_s} s")
            kind, detail = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")

    def send(self, *message) -> None:
        with self._lock:
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send(message)
                except OSError as exc:
                    raise RuntimeError(f"tensor-parallel rank {rank} is gone: {exc}") from None

    def close(self, local=None) -> None:
        """Close every rank's engine (and ``local``, rank 0's, right after telling the others:
        ranks that close at one step boundary end quietly; one that goes on alone for a step
        reports the others' closing as an error), wait for the processes (kill the late ones)."""
        self.closing = True
        try:
            self.send("close")
        except RuntimeError as exc:
            logger.warning("%s", exc)
        if local is not None:
            local.close()
        for proc in self.procs:
            proc.join(CLOSE_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("tensor-parallel rank %s did not end in %s s: killed", proc.name, CLOSE_TIMEOUT_S)
                proc.kill()
                proc.join()
            logger.info("tensor-parallel %s ended with exit code %s", proc.name.removeprefix("areal-tik-tp-"),
                        proc.exitcode)
        shutil.rmtree(self._dir, ignore_errors=True)


class ForwardingLLM:
    """Rank 0's ``LLM`` as ``TikServer`` sees it: every call reaches every rank, in order."""

    def __init__(self, llm, links: RankLinks):
        self.local = llm
        self.links = links
        self._submit_lock = threading.Lock()
        self._submitted = 0

    def __getattr__(self, name):  # model, device, version, paused, vocab_size, ...
        return getattr(self.local, name)

    def submit(self, prompt_ids, params=None) -> Future:
        with self._submit_lock:  # one order on every rank: the engines number requests by it
            future = self.local.submit(prompt_ids, params)  # validates: a refused request goes nowhere
            n = self._submitted
            self._submitted += 1
            self.links.send("submit", n, list(prompt_ids), params)
        future.add_done_callback(lambda f: f.cancelled() and self.links.send("cancel", n))
        return future

    def pause(self) -> None:
        self.local.pause()
        self.links.send("pause")

    def resume(self) -> None:
        self.links.send("resume")
        self.local.resume()

    def update_weights_from_disk(self, path: str, version: int | None) -> tuple[int, int]:
        version = self.local.version + 1 if version is None else version
        state = load_safetensors_dir(path, self.local.device)
        restarted = self.local.update_weights(state, version=version, recompute_running=True)
        self.links.send("disk", path, version)
        return len(state), restarted

    def close(self) -> None:
        self.links.close(self.local)


def _watch(links: RankLinks, stop: threading.Event, engines: list) -> None:
    """Exit this process (``_exit_failed``) once a rank ends or rank 0's engine (``engines``,
    empty while it is built) breaks: a peer's collective may never return."""
    while not stop.wait(POLL_S) and not links.closing:
        reason = links.dead()
        if reason is None and engines and engines[0].error is not None:
            reason = f"rank 0's engine broke: {engines[0].error}"
        if reason is not None and not links.closing:
            _exit_failed(reason, engines[0] if engines else None)


def _exit_failed(reason: str, llm) -> None:
    """Log ``reason`` and end this process within seconds."""
    logger.error("%s: stopping the tensor-parallel server", reason)
    if llm is not None:
        closer = threading.Thread(target=llm.close, daemon=True)
        closer.start()
        closer.join(5.0)
    logging.shutdown()
    os._exit(1)


class TPServer(TikServer):
    """``TikServer`` whose weight updates reach every rank: a disk update loads the checkpoint
    on each; every rank joins the trainer's group (rank r as ``rank_offset + r``, AReaL's
    numbering of a TP server's workers) and receives each bucket itself."""

    def join_weight_group(self, backend: str, init_method: str, world_size: int, rank: int, name: str) -> None:
        size = self.llm.tensor_parallel.size
        if rank + size > world_size:
            raise ValueError(f"rank_offset {rank} with world_size {world_size} leaves no room for this "
                             f"server's {size} tensor-parallel ranks (rank_offset + {size} <= world_size)")
        self.llm.links.send("join", backend, init_method, world_size, rank, name)
        super().join_weight_group(backend, init_method, world_size, rank, name)

    def receive_bucket(self, group_name: str, names, dtypes, shapes, version: int | None) -> dict:
        self.llm.links.send("bucket", group_name, names, dtypes, shapes, version)
        return super().receive_bucket(group_name, names, dtypes, shapes, version)

    def load_weights_from_disk(self, path: str, version: int | None) -> tuple[int, int]:
        return self.llm.update_weights_from_disk(path, version)


def serve(args, size: int, stop: threading.Event) -> int:
    """Run rank 0 (HTTP) and start ranks 1 .. size-1; return once ``stop`` is set."""
    links = RankLinks(args, size)
    engines: list = []
    threading.Thread(target=_watch, args=(links, stop, engines), daemon=True).start()
    try:
        engines.append(build_rank_llm(args, 0, links.init_method))
        links.wait_ready()
    except BaseException:
        links.close()
        raise
    llm = ForwardingLLM(engines[0], links)
    server = TPServer(llm, args.host, args.port)
    try:
        broke = serve_until(server, stop, f" (tensor parallel, {size} ranks)")
    finally:
        llm.close()
    if broke:
        logger.error("areal-tik serve: exiting with an error: the engine broke (%s)", server.broken_reason)
        return 1
    return 0

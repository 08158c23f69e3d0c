"""The LLM class: requests in, generated tokens with log-probs and weight versions out.

One engine-loop thread owns the scheduler and the model runner. ``submit`` validates a
request, queues it and returns a ``concurrent.futures.Future``; ``generate`` submits a
list and waits; ``agenerate`` awaits one request from asyncio. Requests submitted while
others decode join the running batch at the next step. A lock held for each step also
serialises ``update_weights``, so weights change only between steps; every token records
the version of the weights it was sampled with.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import random
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError, as_completed

import torch

from .config import EngineConfig, SamplingParams
from .model_runner import ModelRunner
from .progress import Progress
from .scheduler import Scheduler
from .sequence import GenerationOutput, Sequence
from .weight_update import apply_update, as_state_dict, missing_names, plan_update

logger = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[LLM]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for llm in list(_LIVE):
        llm.close()


def model_eos_token_ids(model) -> tuple[int, ...]:
    """EOS ids from the wrapped model's config and generation config (int or list each)."""
    hf = getattr(model, "hf_model", None)
    ids: list[int] = []
    for cfg in (getattr(hf, "config", None), getattr(hf, "generation_config", None)):
        value = getattr(cfg, "eos_token_id", None)
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(sorted(set(int(i) for i in ids)))


class LLM:
    """Rollout engine over a ``UnifiedCausalLM``.

    ``LLM(model, EngineConfig(...))``; ``eos_token_ids`` overrides the ids read from the
    model's configs. Call ``close()`` (or use ``with``) to stop the engine thread.
    """

    def __init__(self, model, config: EngineConfig | None = None, *, eos_token_ids: tuple[int, ...] | None = None):
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.vocab_size = model.config.vocab
        self.runner = ModelRunner(model, config)
        eos = model_eos_token_ids(model) if eos_token_ids is None else tuple(eos_token_ids)
        self.eos_token_ids = eos
        self.scheduler = Scheduler(config, self.runner.block_manager, eos)
        self._version = 0
        self._step_lock = threading.Lock()      # held by a step, a weight update, a pause
        self._submit_lock = threading.Lock()    # request ids and sampling keys
        self._resumed = threading.Event()
        self._resumed.set()
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._cancelled: set[int] = set()       # ids whose Future the caller cancelled
        self._seq_ids = itertools.count()
        self._keys = random.Random(config.seed)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.num_steps = 0
        # Host seconds per phase of all steps, to attribute per-step overhead: "schedule"
        # (reaping + scheduling), "launch" (inputs + forward + sampling enqueued), "wait"
        # (until the sampled tokens are on the host), "postprocess" (bookkeeping + futures).
        self.step_seconds = dict.fromkeys(("schedule", "launch", "wait", "postprocess"), 0.0)
        _LIVE.add(self)

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters (hits, hit_tokens = prefill tokens saved, hit_rate, ...)."""
        return self.runner.block_manager.stats.as_dict()

    def submit(self, prompt_ids, params: SamplingParams | None = None) -> Future:
        """Queue one request; the Future resolves to a ``GenerationOutput``.

        Bad input raises ValueError/TypeError here; other requests are unaffected.
        Cancelling the Future aborts the request at the next step.
        """
        seq = self._make_sequence(prompt_ids, params)
        return self._enqueue(seq)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (lists of token ids); outputs in prompt order.

        All requests are validated before any is queued: a bad one raises ValueError
        naming its index and nothing runs.
        """
        prompts = list(prompts)
        params_list = self._params_list(params, len(prompts))
        seqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
            try:
                seqs.append(self._make_sequence(prompt, sp))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        futures = [self._enqueue(seq) for seq in seqs]
        with Progress(len(futures), "generate", enabled=progress, unit="req") as bar:
            for _ in as_completed(futures):
                bar.update()
        return [f.result() for f in futures]

    async def agenerate(self, prompt_ids, params: SamplingParams | None = None) -> GenerationOutput:
        """asyncio-friendly ``submit``: awaits the request's ``GenerationOutput``."""
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    def validate_weights(self, weights) -> list[str]:
        """Raise what a partial ``update_weights(weights, strict=False)`` would raise (unknown
        names, shape or dtype mismatches); return the model's tensor names ``weights`` does
        not cover. Copies nothing."""
        target, source = self._weight_target().state_dict(), as_state_dict(weights)
        plan_update(target, source, strict=False)
        return missing_names(target, source)

    def update_weights(self, weights, version: int | None = None, strict: bool = True,
                       recompute_running: bool = True) -> int:
        """Copy ``weights`` (a state dict or a module) into the model in place, between steps.

        Every name, shape and dtype is checked before anything is copied, so a bad update
        raises and leaves the old weights untouched. ``version`` defaults to version + 1.
        With ``recompute_running`` the running sequences go back to prefill (recompute-style
        preemption), so their KV caches are rebuilt with the new weights and each later
        token is exactly what a training forward at the new version computes. Returns the
        number of sequences sent back.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        target = self._weight_target().state_dict()
        pairs = plan_update(target, as_state_dict(weights), strict=strict)
        with self._step_lock:
            apply_update(pairs)
            hook = getattr(self.model, "on_weights_updated", None)
            if callable(hook):
                hook()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._version = self._version + 1 if version is None else version
            self.runner.block_manager.reset_prefix_cache(self._version)  # no old K/V after this
            return self.scheduler.preempt_all_running() if recompute_running else 0

    def pause(self) -> None:
        """Stop stepping after the step in flight (returns once it has ended)."""
        self._resumed.clear()
        with self._step_lock:
            pass

    def resume(self) -> None:
        self._resumed.set()

    def close(self) -> None:
        """Stop the engine thread; requests still pending finish with reason "abort"."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._resumed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._step_lock:
            self._drain_inbox()
            for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
                self.scheduler.abort(seq)
                self._complete(seq)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ------------------------------------------------------------------ requests

    def _weight_target(self) -> torch.nn.Module:
        return getattr(self.model, "hf_model", self.model)

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point:
                raise ValueError(f"prompt_ids tensor must be 1-D integer, got {prompt_ids.dtype} "
                                 f"shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
            raise TypeError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt_ids must not be empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids must be ints in [0, {self.vocab_size}), got {bad[:3]!r}")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} "
                             "leaves no room for a generated token")
        return ids

    def _make_sequence(self, prompt_ids, params: SamplingParams | None) -> Sequence:
        if self._closed:
            raise RuntimeError("the engine is closed")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}, got {bad!r}")
        ids = self._check_prompt(prompt_ids)
        with self._submit_lock:
            seq_id = next(self._seq_ids)
            key = params.seed if params.seed is not None else self._keys.getrandbits(63)
        return Sequence(seq_id, ids, params, key)

    def _enqueue(self, seq: Sequence) -> Future:
        future: Future = Future()
        self._futures[seq.seq_id] = future
        future.add_done_callback(self._note_cancel(seq.seq_id))
        self._inbox.put(seq)
        self._ensure_thread()
        return future

    def _ensure_thread(self) -> None:
        with self._submit_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="areal-tik-engine", daemon=True)
                self._thread.start()

    # ------------------------------------------------------------------ engine loop

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels launch on the current device
        while not self._closed:
            idle = not self.scheduler.has_work()
            if not self._wait_for_work(block=idle):
                continue
            if not self._resumed.wait(timeout=0.1):
                continue
            with self._step_lock:
                if not self._closed:
                    self._step()

    def _wait_for_work(self, block: bool) -> bool:
        """Move queued requests into the scheduler; False when the engine should stop or idle."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not block
        if item is None:
            return False
        self.scheduler.add(item)
        self._drain_inbox()
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self.scheduler.add(item)

    def _step(self) -> None:
        start = time.perf_counter()
        self._reap_cancelled()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            assert not self.scheduler.has_work(), "scheduler has work but scheduled nothing"
            return
        timing = self.step_seconds
        timing["schedule"] += time.perf_counter() - start
        try:
            result = self.runner.run(seqs, is_prefill, timing)
        except Exception as exc:  # a failed step fails its requests, the engine keeps serving
            logger.exception("engine step failed; failing %d requests", len(seqs))
            for seq in seqs:
                self.scheduler.abort(seq)
                self._fail(seq, exc)
            return
        self.num_steps += 1
        start = time.perf_counter()
        for seq in self.scheduler.postprocess(seqs, result.tokens, result.logprobs, self._version):
            self._complete(seq)
        timing["postprocess"] += time.perf_counter() - start

    def _note_cancel(self, seq_id: int):
        # Runs in whichever thread resolves the Future; set.add is atomic under the GIL.
        # The engine then scans its queues only on steps after a cancellation.
        def callback(future: Future) -> None:
            if future.cancelled():
                self._cancelled.add(seq_id)
        return callback

    def _reap_cancelled(self) -> None:
        if not self._cancelled:
            return
        ids = set(self._cancelled)
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            if seq.seq_id in ids:
                self.scheduler.abort(seq)
                self._futures.pop(seq.seq_id, None)
        # Ids not found are still in the inbox (reaped on a later step) or already resolved.
        self._cancelled.difference_update(i for i in ids if i not in self._futures)

    def _complete(self, seq: Sequence) -> None:
        self._resolve(seq, lambda f: f.set_result(seq.to_output()))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self._resolve(seq, lambda f: f.set_exception(exc))

    def _resolve(self, seq: Sequence, how) -> None:
        future = self._futures.pop(seq.seq_id, None)
        if future is None:
            return
        try:
            how(future)
        except InvalidStateError:  # cancelled by the caller meanwhile
            pass

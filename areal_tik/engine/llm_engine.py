"""The LLM class: the engine's front door (requests in, generated tokens with log-probs
and weight versions out).

``submit`` validates a request, hands it to the step loop (``step_loop.StepLoop``, one
thread that owns the scheduler and the model runner) and returns a
``concurrent.futures.Future``; ``generate`` submits a list and waits; ``agenerate`` awaits
one request from asyncio; cancelling a Future aborts its request. Requests submitted
while others decode join the running batch at the next step. Weight updates run between
steps, so every token records the version of the weights it was sampled with. After an
unexpected error in the step loop every pending request fails with it and later calls
raise ``EngineBrokenError`` naming it.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import random
import threading
import weakref
from concurrent.futures import Future, wait

import torch

from .config import EngineConfig, SamplingParams
from .model_runner import ModelRunner
from .progress import Progress
from .scheduler import Scheduler
from .sequence import GenerationOutput, Sequence
from .step_loop import StepLoop
from .tensor_parallel import StepAgreement, TensorParallelGroup, check_engine_model
from .weight_update import apply_update, as_state_dict, missing_names, plan_update

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

    Tensor parallelism (``config.tensor_parallel_size`` > 1): one ``LLM`` per rank, each
    over the model sharded to its rank and the ``tensor_parallel`` group of
    ``init_tensor_parallel``; give every rank the same requests in the same order (see
    ``tensor_parallel.py``). Every rank returns the same outputs.
    """

    def __init__(self, model, config: EngineConfig | None = None, *, eos_token_ids: tuple[int, ...] | None = None,
                 tensor_parallel: TensorParallelGroup | None = None):
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        check_engine_model(model, config, tensor_parallel)
        fuse = getattr(model, "fuse_projections", None)
        if fuse is not None:
            fuse()  # rollout's q/k/v and gate/up as one GEMM each (model/fused.py): same bits
        self.model = model
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.vocab_size = model.config.vocab
        self.runner = ModelRunner(model, config, tensor_parallel)
        eos = model_eos_token_ids(model) if eos_token_ids is None else tuple(eos_token_ids)
        self.eos_token_ids = eos
        self.scheduler = Scheduler(config, self.runner.block_manager, eos)
        agreement = None if tensor_parallel is None else StepAgreement(tensor_parallel)
        self.loop = StepLoop(self.scheduler, self.runner, agreement)
        if agreement is not None:
            self.loop.start()
        self._submit_lock = threading.Lock()    # request ids and sampling keys
        self._seq_ids = itertools.count()
        self._keys = random.Random(config.seed)
        _LIVE.add(self)

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        return self.loop.version

    @property
    def paused(self) -> bool:
        return self.loop.paused

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the step loop, or None while the engine serves."""
        return self.loop.error

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def step_seconds(self) -> dict[str, float]:
        return self.loop.step_seconds

    @property
    def decode_step_seconds(self) -> tuple[int, dict[str, float]]:
        """(steps, host seconds by phase) over the steps that only decode."""
        return self.loop.num_decode_steps, self.loop.decode_step_seconds

    @property
    def step_counts(self):
        """``StepCounts``: steps by kind (prefill / mixed / decode) and decode launches by
        the CUDA-graph bucket they pad to."""
        return self.runner.step_counts

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters (hits, hit_tokens = prefill tokens saved, hit_rate, ...)."""
        return self.runner.block_manager.stats.as_dict()

    @property
    def vocab_parallel_stats(self) -> dict:
        """``{"vocab_parallel", "vocab_rows", "vocab_saved_bytes"}``: whether this rank holds a
        vocabulary slice of the embedding / LM head, its rows ``[start, stop)`` and the bytes
        of those tensors it does not hold (0 when replicated)."""
        shard = getattr(getattr(self.model, "tensor_parallel", None), "vocab", None)
        if shard is None:
            return {"vocab_parallel": False, "vocab_rows": None, "vocab_saved_bytes": 0}
        return {"vocab_parallel": True, "vocab_rows": [shard.start, shard.stop],
                "vocab_saved_bytes": shard.saved_bytes}

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids, params: SamplingParams | None = None) -> Future:
        """Queue one request; the Future resolves to a ``GenerationOutput``.

        Bad input raises ValueError/TypeError here; other requests are unaffected. A
        closed engine raises ``EngineClosedError``, a broken one ``EngineBrokenError``
        (both RuntimeError). Cancelling the Future aborts the request and frees its KV
        blocks at the next loop iteration, also while paused.
        """
        self.loop.check_usable()
        return self.loop.enqueue(self._make_sequence(prompt_ids, params))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (lists of token ids); outputs in prompt order.

        All requests are validated before any is queued: a bad one raises ValueError
        naming its index and nothing runs.
        """
        prompts = list(prompts)
        params_list = self._params_list(params, len(prompts))
        self.loop.check_usable()
        seqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
            try:
                seqs.append(self._make_sequence(prompt, sp))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        futures = [self.loop.enqueue(seq) for seq in seqs]
        if progress:
            _show_token_progress(seqs, futures)
        return [f.result() for f in futures]

    async def agenerate(self, prompt_ids, params: SamplingParams | None = None) -> GenerationOutput:
        """asyncio-friendly ``submit``: awaits the request's ``GenerationOutput``."""
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    def pause(self) -> None:
        """Stop stepping; returns once the step in flight has ended and no other can start."""
        self.loop.pause()

    def resume(self) -> None:
        self.loop.resume()

    def close(self) -> None:
        """Stop the engine thread; requests still pending finish with reason "abort"."""
        self.loop.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ weights

    def validate_weights(self, weights) -> list[str]:
        """Raise what a partial ``update_weights(weights, strict=False)`` would raise (unknown
        names, shape or dtype mismatches); return the model's tensor names ``weights`` does
        not cover. Copies nothing."""
        target, source = self._weight_target().state_dict(), self._local(weights)
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
        number of sequences sent back. A broken engine raises ``EngineBrokenError``.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        target = self._weight_target().state_dict()
        pairs = plan_update(target, self._local(weights), strict=strict)
        with self.loop.between_steps():
            apply_update(pairs)
            hook = getattr(self.model, "on_weights_updated", None)
            if callable(hook):
                hook()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.loop.version = self.loop.version + 1 if version is None else version
            self.runner.block_manager.reset_prefix_cache(self.loop.version)  # no old K/V after this
            return self.scheduler.preempt_all_running() if recompute_running else 0

    def _weight_target(self) -> torch.nn.Module:
        return getattr(self.model, "hf_model", self.model)

    def _local(self, weights):
        """``weights`` (full-model names and shapes) as this rank holds them."""
        source = as_state_dict(weights)
        shard = getattr(self.model, "tensor_parallel", None)
        return source if shard is None else shard.local_weights(source)

    # ------------------------------------------------------------------ validation

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


def _show_token_progress(seqs: list[Sequence], futures: list[Future]) -> None:
    """A bar over generated tokens (a finished request counts its max_new_tokens), polled
    twice a second, so that a slow step (a long prefill, the Triton interpreter) still
    shows the elapsed time and the tokens so far rather than 0 of N requests."""
    total = sum(seq.params.max_new_tokens for seq in seqs)
    with Progress(total, "generate", unit="tok") as bar:
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5)
            done = sum(seq.params.max_new_tokens if fut.done() else seq.num_output_tokens
                       for seq, fut in zip(seqs, futures))
            if done > bar.count:
                bar.update(done - bar.count)

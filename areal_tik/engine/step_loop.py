"""The engine's step loop: one thread owns the scheduler and the model runner.

Requests reach the loop through an inbox; each one is registered with its Future before
it is queued, so whatever happens later (a finished sequence, a cancellation, ``close``,
an unexpected error) resolves every registered Future exactly once.

Locks: ``step_lock`` is held by a step, by moving inbox items into the scheduler, by
reaping cancelled requests and by whatever runs ``between_steps`` (weight updates);
``_state_lock`` orders registration against ``close`` and against the loop breaking.
Futures are resolved with neither lock held, so their callbacks may call back in.
The loop tests the resumed flag while holding ``step_lock``, so once ``pause`` has
cleared the flag and taken the lock once, no further step can start.

Any exception escaping a step (scheduler, model runner, postprocess, reaping, an assert)
breaks the engine: every registered request fails with that exception, and later
submits and weight updates raise ``EngineBrokenError`` naming it. The KV cache and the
scheduler's queues are in an unknown state after such an error, so nothing is retried.

With an ``agreement`` (tensor parallelism, ``tensor_parallel.StepAgreement``) every loop
iteration first agrees with the other ranks' loops on what to admit, abort and whether to
step, so every rank runs the same steps; a rank that closes ends every rank's loop.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError

import torch

from .sequence import Sequence
from .tensor_parallel import LocalView

logger = logging.getLogger(__name__)

_PHASES = ("schedule", "launch", "wait", "postprocess")
_WAKE = object()          # inbox item that only wakes the loop (close)
_IDLE_WAIT_S = 0.5        # longest block on an empty inbox before re-checking state
_PAUSED_POLL_S = 0.05     # while paused: how often cancelled requests are reaped


class EngineBrokenError(RuntimeError):
    """The step loop stopped on an unexpected error; ``__cause__`` is that error."""


class EngineClosedError(RuntimeError):
    """The engine was closed; it takes no more requests."""


class StepLoop:
    """Runs ``scheduler`` and ``runner`` steps in a daemon thread; see the module docstring."""

    def __init__(self, scheduler, runner, agreement=None):
        self.scheduler = scheduler
        self.runner = runner
        self.agreement = agreement
        self._held: dict[int, Sequence] = {}  # with an agreement: received, not yet admitted
        self._received = 0                    # ids 0 .. _received - 1 have all arrived
        self._early: set[int] = set()         # ids >= _received that arrived
        self.version = 0
        self.step_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._resumed = threading.Event()
        self._resumed.set()
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[int, tuple[Sequence, Future]] = {}  # registered, not yet resolved
        self._cancelled: set[int] = set()   # ids whose Future the caller cancelled
        self._done: list[tuple[Future, object]] = []  # finished in this step, resolved after it
        self._thread: threading.Thread | None = None
        self.closed = False
        self.error: BaseException | None = None
        self.num_steps = 0
        # Host seconds per phase of all steps, to attribute per-step overhead: "schedule"
        # (reaping + scheduling), "launch" (inputs + forward + sampling enqueued), "wait"
        # (until the sampled tokens are on the host), "postprocess" (bookkeeping + futures);
        # the same over the steps that only decode (no prompt chunk), and their count.
        self.step_seconds = dict.fromkeys(_PHASES, 0.0)
        self.decode_step_seconds = dict.fromkeys(_PHASES, 0.0)
        self.num_decode_steps = 0

    # ------------------------------------------------------------------ front-door calls

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def check_usable(self) -> None:
        """Raise if the engine takes no more work (closed, or broken by an earlier error)."""
        if self.error is not None:
            raise EngineBrokenError(
                f"the engine is broken: its step loop stopped on {type(self.error).__name__}: "
                f"{self.error}") from self.error
        if self.closed:
            raise EngineClosedError("the engine is closed")

    def enqueue(self, seq: Sequence) -> Future:
        """Register ``seq`` with a new Future and queue it; raises if closed or broken."""
        future: Future = Future()
        with self._state_lock:
            self.check_usable()
            self._requests[seq.seq_id] = (seq, future)
            self._inbox.put(seq)
            self._start_locked()
        future.add_done_callback(self._note_cancel(seq.seq_id))
        return future

    def start(self) -> None:
        """Start the thread now (else the first request starts it). With an agreement every
        rank's loop must run from the start: a closing rank waits for the others' loops."""
        with self._state_lock:
            self.check_usable()
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="areal-tik-engine", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def between_steps(self):
        """Hold the step lock (no step runs inside); raises first if the engine is broken."""
        with self.step_lock:
            if self.error is not None:
                self.check_usable()
            yield

    def pause(self) -> None:
        """Return once no step runs and none will start until ``resume``."""
        self._resumed.clear()
        with self.step_lock:  # waits for the step in flight; later steps see the flag
            pass

    def resume(self) -> None:
        self._resumed.set()

    def close(self) -> None:
        """Stop the thread; every request not yet resolved finishes with reason "abort"."""
        with self._state_lock:
            if self.closed:
                return
            self.closed = True
        self._inbox.put(_WAKE)
        self._resumed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self.step_lock:
            with self._state_lock:
                requests = list(self._requests.values())
                self._requests.clear()
            for seq, _ in requests:
                seq.finish("abort")
        for seq, future in requests:  # resolved first, outside the lock: freeing blocks may raise
            _resolve(future, lambda f, s=seq: f.set_result(s.to_output()))
        if self.error is None:
            with self.step_lock:
                for seq, _ in requests:
                    self.scheduler.abort(seq)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            if self.runner.device.type == "cuda":
                torch.cuda.set_device(self.runner.device)  # kernels launch on the current device
            while self._iterate():
                pass
        except BaseException as exc:  # noqa: BLE001 - any error breaks the engine, none hangs it
            self._resolve_done()  # requests that finished before the error keep their outputs
            self._break(exc)

    def _iterate(self) -> bool:
        """One iteration; False once the loop should end."""
        item = None
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if not self.scheduler.has_work() else None
        except queue.Empty:
            pass
        with self.step_lock:
            if item is not None:
                self._admit(item)
            self._drain_inbox()
            if self.agreement is None:
                self._reap_cancelled()
                go_on = not self.closed
                stepping = go_on and self._resumed.is_set() and self.scheduler.has_work()
            else:
                go_on, stepping = self._agree()
            if stepping:
                self._step()
        self._resolve_done()  # outside the lock: a callback may call pause, close or submit
        if not stepping and self.scheduler.has_work() and go_on:
            self._resumed.wait(timeout=_PAUSED_POLL_S)
        return go_on

    def _admit(self, item) -> None:
        if item is _WAKE:
            return
        if self.agreement is not None:  # held until every rank has it (``_agree``)
            self._held[item.seq_id] = item
            self._early.add(item.seq_id)
            while self._received in self._early:
                self._early.remove(self._received)
                self._received += 1
            return
        if item.is_finished:  # a cancelled request reaped while queued
            return
        self.scheduler.add(item)

    def _agree(self) -> tuple[bool, bool]:
        """(go on, step) as all ranks agreed; admits and aborts what they agreed on."""
        agreed = self.agreement(LocalView(
            received=self._received, cancelled=frozenset(self._cancelled),
            ready=self._resumed.is_set() and not self.closed, closing=self.closed, version=self.version))
        for seq_id in sorted(i for i in self._held if i < agreed.received):
            seq = self._held.pop(seq_id)
            if not seq.is_finished:
                self.scheduler.add(seq)
        self._reap_cancelled(agreed.cancelled)
        if agreed.closing_ranks and not self.closed:
            raise EngineClosedError(f"rank(s) {list(agreed.closing_ranks)} of the tensor-parallel "
                                    "engine closed it")
        return not agreed.closing_ranks, agreed.step and self.scheduler.has_work()

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._admit(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _step(self) -> None:
        start = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            assert not self.scheduler.has_work(), "scheduler has work but scheduled nothing"
            return
        timing = dict.fromkeys(_PHASES, 0.0)
        timing["schedule"] = time.perf_counter() - start
        result = self.runner.run(seqs, is_prefill, timing)
        self.num_steps += 1
        start = time.perf_counter()
        for seq in self.scheduler.postprocess(seqs, result.tokens, result.logprobs, self.version):
            self._complete(seq)
        timing["postprocess"] = time.perf_counter() - start
        totals = [self.step_seconds]
        if not is_prefill:  # the scheduler's flag: no prompt chunk in this step
            totals.append(self.decode_step_seconds)
            self.num_decode_steps += 1
        for total in totals:
            for phase, seconds in timing.items():
                total[phase] += seconds

    def _break(self, exc: BaseException) -> None:
        logger.error("engine step loop failed; failing every pending request", exc_info=exc)
        with self._state_lock:
            self.error = exc
            requests = list(self._requests.values())
            self._requests.clear()
        for _, future in requests:
            _resolve(future, lambda f: f.set_exception(exc))

    # ------------------------------------------------------------------ requests

    def _note_cancel(self, seq_id: int):
        # Runs in whichever thread resolves the Future; set.add is atomic under the GIL.
        # The loop reaps on its next iteration, also while paused (within _PAUSED_POLL_S).
        def callback(future: Future) -> None:
            if future.cancelled():
                self._cancelled.add(seq_id)
        return callback

    def _reap_cancelled(self, agreed: frozenset[int] | None = None) -> None:
        """Abort the cancelled requests (with an agreement: those every rank cancelled)."""
        if not self._cancelled:
            return
        ids = set(self._cancelled) if agreed is None else self._cancelled & agreed
        self._cancelled.difference_update(ids)
        for seq_id in ids:
            with self._state_lock:
                entry = self._requests.pop(seq_id, None)
            if entry is not None:  # queued or running: drop it and free its KV blocks
                self.scheduler.abort(entry[0])

    def _complete(self, seq: Sequence) -> None:
        output = seq.to_output()  # before unregistering: if this raises, _break fails the request
        with self._state_lock:
            entry = self._requests.pop(seq.seq_id, None)
        if entry is not None:
            self._done.append((entry[1], output))

    def _resolve_done(self) -> None:
        done, self._done = self._done, []
        for future, output in done:
            _resolve(future, lambda f, o=output: f.set_result(o))


def _resolve(future: Future, how) -> None:
    try:
        how(future)
    except InvalidStateError:  # cancelled by the caller meanwhile
        pass

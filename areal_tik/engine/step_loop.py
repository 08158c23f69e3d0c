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

Overlapped steps (``EngineConfig.overlap_steps``): a decode-only step is enqueued and left
unread (``_pending``); the next iteration enqueues the following decode step first (its
input tokens copied on the device from the unread step's draw; ``Sequence.PENDING`` holds
their place on the host, so lengths, KV slots and sampling counters count them), then reads
the unread step and does its bookkeeping (``Scheduler.fill_pending``) while the GPU runs
the new one. A step is enqueued behind an unread one only when it cannot admit, preempt or
end a sequence on its length (``_can_overlap``); otherwise, and before a pause, a weight
update (``between_steps``) or close, the unread step is read first (``drain``). A sequence
that stops on a stop token found when its step is read already has a row in the step
enqueued after it: that row is computed and dropped.

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
        self._pending = None  # a step enqueued with overlap whose tokens are not read yet
        self.closed = False
        self.error: BaseException | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps enqueued while the one before was unread
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
            self.drain()  # a weight update never runs under a step enqueued with overlap
            yield

    def pause(self) -> None:
        """Return once no step runs and none will start until ``resume``."""
        self._resumed.clear()
        with self.step_lock:  # waits for the step in flight; later steps see the flag
            if self.error is None:
                self.drain()

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
            if self.error is None:
                self.drain()  # the unread step's tokens belong to the outputs below
            with self._state_lock:
                requests = list(self._requests.values())
                self._requests.clear()
            for seq, _ in requests:
                seq.finish("abort")
        self._resolve_done()  # requests the drain finished
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

    def _overlap_allowed(self) -> bool:
        """Whether the engine may ever enqueue a step behind an unread one (``overlap_steps``)."""
        config = self.runner.config
        return (config.overlap_steps and self.agreement is None and config.prefill_chunk_tokens is None
                and getattr(self.runner, "tensor_parallel", None) is None)

    def _can_overlap(self) -> bool:
        """The next step may be enqueued before the unread one's tokens are known: it will be
        a decode-only step (nothing waits, or the running batch is full), no row can be
        preempted (a free block for every running sequence), none ends on its length with the
        unread step's token, and the loop runs on (not paused, closing or stopping)."""
        scheduler = self.scheduler
        full = len(scheduler.running) >= self.runner.config.max_num_seqs  # admits nobody
        return ((full or not scheduler.waiting) and self._resumed.is_set() and not self.closed
                and scheduler.blocks.num_free_blocks >= len(scheduler.running)
                and not any(map(scheduler.ends_on_length, scheduler.running)))

    def drain(self) -> None:
        """Read the step enqueued with overlap, if any (with ``step_lock`` held)."""
        if self._pending is not None:
            timing = dict.fromkeys(_PHASES, 0.0)
            self._read_pending(timing, advance=True)
            self._account(timing, decode=True)  # a decode step's wait, counted when it launched

    def _account(self, timing: dict, decode: bool) -> None:
        for total in (self.step_seconds, self.decode_step_seconds) if decode else (self.step_seconds,):
            for phase, seconds in timing.items():
                total[phase] += seconds

    def _read_pending(self, timing: dict, advance: bool) -> None:
        step, self._pending = self._pending, None
        result = self.runner.collect(step, timing)
        start = time.perf_counter()
        for seq in self.scheduler.fill_pending(step, result.tokens, result.logprobs, advance):
            self._complete(seq)
        timing["postprocess"] += time.perf_counter() - start

    def _step(self) -> None:
        timing = dict.fromkeys(_PHASES, 0.0)
        if self._pending is not None and not self._can_overlap():
            self._read_pending(timing, advance=True)
            if not self.scheduler.has_work():
                self._account(timing, decode=True)
                return
        start_schedule = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            assert not self.scheduler.has_work(), "scheduler has work but scheduled nothing"
            return
        timing["schedule"] = time.perf_counter() - start_schedule
        step = self.runner.launch(seqs, timing, self._pending)
        self.num_steps += 1
        self.num_overlapped_steps += self._pending is not None
        if not is_prefill and self._overlap_allowed():
            # the rows' tokens count from now on; the step before this one is read meanwhile
            for seq in step.rows:
                step.indices.append(len(seq.token_ids))
                seq.append(Sequence.PENDING, float("nan"), self.version)
            if self._pending is not None:
                self._read_pending(timing, advance=False)
            self._pending = step
        else:
            assert self._pending is None, "a step is enqueued behind an unread one only with overlap"
            result = self.runner.collect(step, timing)
            start = time.perf_counter()
            for seq in self.scheduler.postprocess(seqs, result.tokens, result.logprobs, self.version):
                self._complete(seq)
            timing["postprocess"] += time.perf_counter() - start
        self.num_decode_steps += not is_prefill  # the scheduler's flag: no prompt chunk in this step
        self._account(timing, decode=not is_prefill)

    def _break(self, exc: BaseException) -> None:
        logger.error("engine step loop failed; failing every pending request", exc_info=exc)
        self._pending = None
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

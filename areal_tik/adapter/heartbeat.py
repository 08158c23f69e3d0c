"""A progress line for long in-process rollouts: every ``every`` seconds while requests are
in flight, how many are running and finished and for how long. A rollout under the Triton
interpreter can spend a minute and more in one prefill step, where nothing else is said."""
from __future__ import annotations

import contextlib
import threading
import time


class RolloutHeartbeat:
    def __init__(self, log, every: float = 15.0):
        if every <= 0:
            raise ValueError(f"every must be > 0 seconds, got {every!r}")
        self.log, self.every = log, every
        self.in_flight = self.finished = 0
        self._since: float | None = None  # when the current busy period began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def track(self):
        """Count one request while the block runs."""
        with self._lock:
            if self.in_flight == 0:
                self._since = time.perf_counter()
            self.in_flight += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="areal-tik-rollout-heartbeat", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
                self.finished += 1

    def line(self) -> str | None:
        with self._lock:
            if self.in_flight == 0:
                return None
            busy = time.perf_counter() - self._since
            return (f"areal-tik rollout: {self.in_flight} requests generating, {self.finished} finished, "
                    f"{busy:.0f} s into this rollout")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            text = self.line()
            if text is not None:
                self.log(text)

    def close(self) -> None:
        self._stop.set()

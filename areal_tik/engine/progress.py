"""Progress display for long work: tqdm when installed, else one refreshed stderr line."""
from __future__ import annotations

import importlib.util
import sys
import time


class Progress:
    """``with Progress(total, "generate") as bar: bar.update(n)``; a no-op when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "it"):
        self.total, self.desc, self.enabled, self.unit = total, desc, enabled, unit
        self.count = 0
        self._bar = None
        self._last = 0.0
        self._start = time.perf_counter()
        if enabled and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)

    def update(self, n: int = 1) -> None:
        self.count += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= 0.5 or self.count >= self.total:
            self._last = now
            rate = self.count / max(now - self._start, 1e-9)
            sys.stderr.write(f"\r{self.desc}: {self.count}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s)")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.count:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Start ``areal-tik serve`` in its own process for a test."""
from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import threading
import time

from areal_tik.runtime import INTERPRET_ENV


@contextlib.contextmanager
def server_process(model: str, *args: str, timeout: float = 120.0):
    """Yield the server's ``http://127.0.0.1:<port>`` once /health answers; kill it after."""
    import requests
    from areal.utils.network import find_free_ports

    port = find_free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_tik.cli", "serve", "--model", model, "--port", str(port), *args],
        env={**os.environ, INTERPRET_ENV: "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Read the pipe as the server writes it: a full pipe would block the server's logging.
    tail: collections.deque = collections.deque(maxlen=200)
    reader = threading.Thread(target=lambda: tail.extend(iter(proc.stderr.readline, b"")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                reader.join(timeout=5)
                raise RuntimeError(f"server did not start: {b''.join(tail).decode()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)

"""``areal-tik serve``: the rollout engine over HTTP, as one process (``server.py``) or, at
``--tensor-parallel-size`` t > 1, as t processes, one per rank (``server_tp.py``)."""
from __future__ import annotations

import logging
import threading

from . import server_tp
from .log import logger
from .server import TikServer, add_arguments, build_llm, check_args, serve_until  # noqa: F401  (add_arguments: the CLI's)


def validate(args) -> None:
    """Everything ``serve`` can check before loading: its options, then device, model, port."""
    from .run_checks import validate_serve

    config = check_args(args)
    validate_serve(args)
    if config.tensor_parallel_size > 1:
        server_tp.check_model_split(args, config)


def watch_parent(stop: threading.Event, parent: int, poll_seconds: float = 1.0) -> None:
    """Set ``stop`` once the parent ``parent`` has ended: this process is re-parented, so
    its parent pid is no longer ``parent`` (also when it ended before this was called).
    A poll, not Linux's ``PR_SET_PDEATHSIG``: that fires when the parent's forking
    *thread* ends, which a trainer's short-lived launcher thread does."""
    import os

    if os.getppid() != parent:
        stop.set()

    def poll() -> None:
        while not stop.wait(poll_seconds):
            if os.getppid() != parent:
                logger.warning("the parent process (pid %d) ended: stopping the server", parent)
                stop.set()

    threading.Thread(target=poll, name="areal-tik-parent-watch", daemon=True).start()


def main(args) -> int:
    import signal

    config = check_args(args)
    logging.basicConfig(level=logging.INFO)
    stop = threading.Event()
    # SIGTERM (the trainer's terminate(), or the parent-death signal) ends the server cleanly
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.parent_pid is not None:
        watch_parent(stop, args.parent_pid)
    if config.tensor_parallel_size > 1:  # t processes, one per rank (server_tp)
        return server_tp.serve(args, config.tensor_parallel_size, stop)
    with build_llm(args) as llm:
        server = TikServer(llm, args.host, args.port)
        if serve_until(server, stop):
            logger.error("areal-tik serve: exiting with an error: the engine broke (%s)", server.broken_reason)
            return 1
    return 0

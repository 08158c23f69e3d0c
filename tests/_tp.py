"""Several processes for the tensor-parallel tests: one per rank, over gloo, rendezvous by a
file in the test's own tmp_path (no port, so tests may run side by side)."""
from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import torch

_TIMEOUT_S = 240
# Ranks fork from one server process that has imported these once (forkserver: the server
# is single-threaded, so forking it is safe); spawning each rank afresh re-imported torch,
# transformers and the model classes, ~6 of a rank's ~10 CPU seconds.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen3.modeling_qwen3", "areal_tik.engine", "areal_tik.model",
            "areal_tik.unified_kernels"]


def _child(fn, rank: int, size: int, init_method: str, out: Path, args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        result = fn(rank, size, init_method, *args)
        torch.save({"result": result}, out)
    except BaseException:  # noqa: BLE001 - reported by the parent, with the rank's traceback
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_ranks(fn, size: int, tmp_path: Path, *args, timeout_s: float = _TIMEOUT_S) -> list:
    """``fn(rank, size, init_method, *args)`` in ``size`` processes (``fn`` at a
    module's top level); returns each rank's result in rank order. A rank that fails,
    hangs or dies fails the test with its traceback."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{r}.pt" for r in range(size)]
    procs = [ctx.Process(target=_child, args=(fn, r, size, init_method, outs[r], args), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout_s)
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        saved = torch.load(out, weights_only=False) if out.exists() else {}
        if "error" in saved:
            raise AssertionError(f"rank {r} of {size} failed:\n{saved['error']}")
        assert r not in hung, f"rank {r} of {size} did not finish within {timeout_s} s"
        assert p.exitcode == 0 and "result" in saved, f"rank {r} of {size} ended with exit code {p.exitcode}"
        results.append(saved["result"])
    return results

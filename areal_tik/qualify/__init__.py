"""Device qualification: a contract probe run once per (GPU, SM count, driver, torch, triton,
areal-tik) combination before rollout log-probs may be reused.

The bitwise contract rests on code generation that varies with the device: linear picks
its tile shape, warps and the persistent vs tiled kernel from the row count, the SM
count and pointer alignment; prefill and decode attention run different launch
configurations; decode replays CUDA graphs. The probe checks each of those on this
device, with random inputs, bitwise:

- ``linear``: every row count at and around each bucket boundary of the config table
  gives the rows of the largest batch, for weight shapes whose ladders pick different
  rungs (the persistent kernel included where the table reaches it);
- ``linear variants``: every config the table (or the fixed tile) can pick gives the
  same bits as the table's choice;
- ``attention prefill vs decode``: packed varlen prefill of two sequences against one
  batched paged decode of every row (shuffled block tables, NaN in unwritten slots);
- ``attention CUDA graph`` (GPU only): a captured decode replays the eager bits;
- ``model rollout vs training``: a tiny random model through the engine (CUDA graphs on
  a GPU) against the packed training forward with autograd; a mismatch is diagnosed
  with ``first_divergence``, which names the first op whose row differs.

``qualify()`` caches the verdict in a JSON file keyed by the device tuple (default
``$XDG_CACHE_HOME/areal-tik/qualification.json``, ``AREAL_TIK_QUALIFY_CACHE`` overrides
the path), so a known combination costs one file read. A failed verdict names the
failing ops; whoever consumes it must refuse reuse, and ``pin_linear_tile`` makes
linear use one tile for every shape (``Verdict.pin_linear`` says when that is advised).
"""
from __future__ import annotations

import argparse
import logging
import time

from .probes import PROBES, LinearPin, ProbeSizes, as_device, pin_linear_tile, run_probe
from .verdict import CACHE_ENV, Check, DeviceKey, Verdict, cache_path, load_verdicts, store_verdicts

logger = logging.getLogger(__name__)

__all__ = ["qualify", "run_probe", "pin_linear_tile", "LinearPin", "Verdict", "Check", "DeviceKey", "ProbeSizes",
           "PROBES", "CACHE_ENV", "cache_path"]


def qualify(device=None, *, refresh: bool = False, compile_workers: int | None = None) -> Verdict:
    """The cached verdict for this device's key, else run the full probe and cache it
    (its kernels compiled first on ``compile_workers`` threads: ``run_probe``)."""
    device = as_device(device)
    key = DeviceKey.of(device)
    path = cache_path()
    verdicts = load_verdicts(path)
    if not refresh and key.id in verdicts:
        try:
            return Verdict.from_json(verdicts[key.id])
        except (KeyError, TypeError, ValueError):
            logger.warning("qualification cache %s: entry %s is malformed; probing again", path, key.id)
    verdict = run_probe(device, precompile_workers=compile_workers)
    verdicts = load_verdicts(path)  # another process may have added keys meanwhile
    verdicts[key.id] = verdict.to_json()
    try:
        store_verdicts(path, verdicts)
    except OSError as exc:  # a read-only home: the verdict still holds for this process
        logger.warning("qualification cache %s not written: %s", path, exc)
    return verdict


def main(argv=None) -> int:
    """``python -m areal_tik.qualify [--refresh] [--device cuda:0]``: print the verdict and its
    cost; exit 1 when it failed."""
    parser = argparse.ArgumentParser(prog="python -m areal_tik.qualify", description=main.__doc__)
    parser.add_argument("--device", default=None)
    parser.add_argument("--refresh", action="store_true", help="probe again even if a verdict is cached")
    parser.add_argument("--compile-workers", type=int, default=None, metavar="N",
                        help="threads compiling the probes' kernels before they run (default: one per CPU, "
                             "at most 16; 1: each kernel compiles at its first launch inside the probes)")
    args = parser.parse_args(argv)
    if args.compile_workers is not None and args.compile_workers < 1:
        parser.error(f"--compile-workers must be >= 1, got {args.compile_workers}")
    start = time.perf_counter()
    verdict = qualify(args.device, refresh=args.refresh, compile_workers=args.compile_workers)
    wall = time.perf_counter() - start
    for check in verdict.checks:
        state = {True: "ok", False: "FAIL", None: "n/a"}[check.passed]
        print(f"{state:4} {check.op}: {check.detail}")
    print(verdict.message())
    print(f"cost: {wall:.2f} s ({'cached verdict' if verdict.cached else f'probe {verdict.seconds:.2f} s'}); "
          f"cache {cache_path()} key {verdict.key.id}")
    return 0 if verdict.passed else 1

"""Shared plumbing of the eval/ benchmarks: the argument parser, run metadata, long-format
CSV output and the summary printer. Benchmarks run as modules from the repository root
(``python3 -m eval.<bench>``), so none of them edits ``sys.path``."""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import subprocess
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[1]


def bench_parser(doc: str, out_default: str | Path | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as description, and ``--out``
    (a .csv file or a folder; default ``eval/results``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0].strip())
    parser.add_argument("--out", default=str(out_default or REPO / "eval" / "results"),
                        help="CSV file or folder for the results")
    return parser


def print_summary(lines, written: list[Path | None] = ()) -> None:
    """The summary a benchmark ends with, then the files it wrote."""
    for line in lines:
        print(line)
    for path in written:
        if path is not None:
            print(f"wrote {path}")


def commit() -> str:
    """The commit under test: $AREAL_TIK_COMMIT (the GPU copy has no .git), else git."""
    found = os.environ.get("AREAL_TIK_COMMIT")
    if found:
        return found
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_info(device: str | None = None) -> dict:
    """Columns every CSV row carries: device, versions, commit and UTC date."""
    on_cuda = device != "cpu" and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if on_cuda else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_csv(rows: list[dict], out: str, default_name: str) -> Path:
    """Write ``rows`` to ``out`` (a .csv path, or a folder that gets ``default_name``)."""
    path = Path(out)
    if path.suffix != ".csv":
        path = path / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def event_us(fn, calls: int) -> float:
    """Mean us per call of ``calls`` back-to-back calls, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def graph_times(fns, est_us: float, rep_ms: int, out_bytes: int = 0) -> list[float]:
    """Per-call us of ``fns`` (cycled, so inputs rotate past L2) replayed from one CUDA
    graph: 5 replays of about rep_ms / 5 each. Launch overhead is not counted. Calls per
    graph are bounded by time and, when ``out_bytes`` is given, by the memory the calls'
    outputs take (each call allocates its output inside the graph pool)."""
    calls = min(max(rep_ms * 1e3 / 5 / est_us, 20), 2000)
    if out_bytes:
        calls = min(calls, 2 ** 32 / out_bytes)
    calls = len(fns) * max(1, math.ceil(calls / len(fns)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream (library workspaces)
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = [event_us(graph.replay, 1) / calls for _ in range(5)]
    del graph
    return times

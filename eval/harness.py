"""Shared plumbing of the eval/ benchmarks: run metadata and long-format CSV output."""
from __future__ import annotations

import csv
import datetime
import os
import subprocess
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[1]


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

"""Workers of the process-group tests (imported by the spawned processes: keep imports light)."""
from __future__ import annotations

import json
import os

from torch import distributed as dist


def refusals_worker(rank: int, world: int, port: int, reasons_by_rank: list[list[str]], out_dir: str) -> None:
    """One gloo process: its refusals in, every process's refusals out (``<out_dir>/<rank>.json``)."""
    from areal_tik.adapter.processes import refusals_of_every_process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        every = refusals_of_every_process(reasons_by_rank[rank])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(every, f)

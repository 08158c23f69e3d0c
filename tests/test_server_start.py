"""Server start-up and lifetime: options refused at start in one line, broadcast staging
keyed by weight version, and a trainer's server ending with its trainer."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from areal_tik.adapter.server import TikServer
from areal_tik.engine.config import attention_kv_tile
from areal_tik.runtime import INTERPRET_ENV

from .test_areal_server import make_llm


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_tik.cli", "serve", "--model", "no-such-model", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, INTERPRET_ENV: "1"})


HALF_TILE = attention_kv_tile() // 2


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float16"], "areal-tik: error: --dtype float16 is not served; use one of ('bfloat16', 'float32')"),
    (["--kv-block-size", str(HALF_TILE)],
     f"areal-tik: error: bad engine option: kv_block_size={HALF_TILE} is not a multiple"),
])
def test_bad_options_are_refused_at_start_in_one_line(args, message):
    done = serve(*args)  # refused before the (missing) model is looked at
    assert done.returncode == 2  # a bad command line, as argparse answers it
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and message in done.stderr


def test_staging_is_keyed_by_weight_version():
    llm = make_llm()
    server = TikServer(llm)
    try:
        state = dict(make_llm(seed=1).model.hf_model.state_dict())
        names = list(state)
        first, second = names[: len(names) // 2], names[len(names) // 2:]
        assert server.stage({n: state[n] for n in first}, version=5) is None  # v5: half staged
        # v5 never completes; v6's second half must not be completed by v5's first half
        assert server.stage({n: state[n] for n in second}, version=6) is None
        assert set(server._staged) == set(second)
        whole = server.stage({n: state[n] for n in first}, version=6)
        assert whole is not None and set(whole) == set(names) and server._staged == {}
    finally:
        llm.close()


PARENT = """
import os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-m", "areal_tik.cli", "serve", "--model", sys.argv[1],
                         "--parent-pid", str(os.getpid()), "--kernels", "standard", "--kv-block-size", "16"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(proc.pid, flush=True)
"""


def test_a_server_given_its_parent_pid_ends_with_its_parent(tmp_path):
    from areal_tik.model.checkpoints import make_tiny_checkpoint

    model = str(make_tiny_checkpoint(tmp_path / "llama", num_hidden_layers=1))
    parent = subprocess.run([sys.executable, "-c", PARENT, model], capture_output=True, text=True, timeout=60,
                            env={**os.environ, INTERPRET_ENV: "1"})
    pid = int(parent.stdout.split()[0])  # the parent has exited: the server is an orphan now
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # ended
        if _is_zombie(pid):
            return
        time.sleep(0.5)
    os.kill(pid, 9)
    pytest.fail(f"server {pid} outlived its parent by 90 s")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False

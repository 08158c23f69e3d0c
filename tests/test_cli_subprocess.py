"""Every ``areal-tik`` subcommand as a new user runs it: a fresh process whose environment
has no ``TRITON_INTERPRET`` (the command line must switch the interpreter on by itself,
before any kernel is imported), checking exit codes and the first lines of output.

``--help`` for the long commands; real tiny runs for ``prepare-model``, ``generate`` and
``check`` (a one-layer model on the unified kernels, under the interpreter on CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_tik.cli import COMMANDS
from areal_tik.runtime import INTERPRET_ENV

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--num-prompts", "1", "--prompt-len", "4", "4", "--max-new-tokens", "2", "--ignore-eos",
            "--no-progress"]


def _start(argv) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != INTERPRET_ENV}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    return subprocess.Popen([sys.executable, "-m", "areal_tik.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_all(*argvs, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """The command lines in parallel processes (most of each is importing torch)."""
    procs = [(argv, _start(argv)) for argv in argvs]
    done = []
    for argv, proc in procs:
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done


def areal_tik(*argv: str) -> subprocess.CompletedProcess:
    return run_all(argv)[0]


def test_the_front_door_and_every_command_have_their_help():
    front, *runs = run_all(["--help"], *([name, "--help"] for name, _, _ in COMMANDS))
    assert front.returncode == 0, front.stderr
    assert front.stdout.startswith("usage: areal-tik")
    assert all(name in front.stdout for name, _, _ in COMMANDS)
    for (name, _, _), run in zip(COMMANDS, runs):
        assert run.returncode == 0, (name, run.stderr)
        assert run.stdout.startswith(f"usage: areal-tik {name}"), run.stdout[:200]
        assert "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    run = areal_tik("prepare-model", "tiny", str(path), "--layers", "1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == f"wrote {path}"
    assert (path / "config.json").is_file()
    return path


def test_generate_runs_the_unified_kernels_without_interpret_preset(tiny_model):
    run = areal_tik("generate", "--model", str(tiny_model), *TINY_RUN)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.splitlines()[0])
    assert len(record["prompt_ids"]) == 4 and len(record["token_ids"]) == len(record["logprobs"]) == 2
    assert "generated 2 tokens for 1 prompts" in run.stderr


def test_check_runs_without_interpret_preset(tiny_model):
    run = areal_tik("check", "--model", str(tiny_model), *TINY_RUN, "--strict")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith("2/2 tokens bit-identical (100.00%)"), run.stdout


BAD = [
    (("generate", "--num-prompts", "1", "--prompt-len", "64", "16"),
     "areal-tik: error: --prompt-len 64 16: expected MIN MAX with 1 <= MIN <= MAX"),
    (("demo", "--steps", "0"), "areal-tik: error: --steps must be >= 1, got 0"),
    (("launch", "missing.py"), "areal-tik: error: launch: entry script 'missing.py': no such file"),
]


def test_a_bad_input_is_one_line_and_exit_2():
    for (_, line), run in zip(BAD, run_all(*(argv for argv, _ in BAD))):
        lines = run.stderr.splitlines()
        assert run.returncode == 2, run.stderr
        assert len(lines) == 1 and lines[0].startswith(line), run.stderr

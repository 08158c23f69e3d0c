"""``areal-tik serve --tensor-parallel-size 2`` (and 4): two processes, one per rank, behind rank 0's
HTTP. Its generations (tokens and log-prob bits) == a TP = 1 server's == the TP = 1
training forward, all with the same k_groups, before and after a weight update from disk;
a split the model cannot take is refused at start-up; a rank that dies ends rank 0. The
TP = 4 server also shards the embedding and LM head (``--vocab-parallel``).

One TP = 2 server (a subprocess, unified kernels under the interpreter, a one-layer model)
serves most tests of the module and is ended by SIGTERM last; a TP = 4 one is checked
against TP = 1, then has its rank 2 killed.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests
import torch

from areal_tik.adapter.server import TikServer
from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.model import UnifiedCausalLM
from areal_tik.model.checkpoints import make_tiny_checkpoint
from areal_tik.runtime import INTERPRET_ENV

from ._engine_utils import assert_bitwise_logprobs
from .test_areal_server import TIMEOUT, as_f32, gen_payload, post

K_GROUPS = 2
ENGINE = dict(max_num_seqs=4, max_model_len=32, kv_block_size=16)
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "32", "--kv-block-size", "16", "--k-groups", str(K_GROUPS)]
PROMPTS = [[5, 9, 17, 3], [40, 2, 77, 8, 11]]
SAMPLING = dict(temperature=1.0, max_new_tokens=2, ignore_eos=True)  # a prefill and a decode step
START_S = 180


def _serve_command(model, *flags: str) -> list[str]:
    return [sys.executable, "-m", "areal_tik.cli", "serve", "--model", str(model), "--device", "cpu", *flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-server")
    return (make_tiny_checkpoint(root / "v0", num_hidden_layers=1, seed=0),
            make_tiny_checkpoint(root / "v3", num_hidden_layers=1, seed=1))


def _start_tp(model, size: int, *flags: str) -> tuple[str, subprocess.Popen]:
    """A TP = ``size`` server over ``model``; returns (url, process) once it answers /health."""
    port = _free_port()
    proc = subprocess.Popen(_serve_command(model, "--port", str(port), "--tensor-parallel-size", str(size),
                                           *ENGINE_FLAGS, *flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, INTERPRET_ENV: "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    try:
        while True:
            assert proc.poll() is None, f"the TP = 2 server ended at start-up:\n{proc.stderr.read()}"
            assert time.monotonic() < deadline, f"the TP = 2 server did not answer in {START_S} s"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return url, proc
            except requests.ConnectionError:
                time.sleep(0.5)
    except BaseException:
        _end(proc)
        raise


def _end(proc: subprocess.Popen) -> None:
    """Kill the server and its ranks if still running."""
    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def tp2(checkpoints):
    """(url, process) of the TP = 2 server over checkpoint v0 (unified kernels)."""
    url, proc = _start_tp(checkpoints[0], 2)
    try:
        yield url, proc
    finally:
        _end(proc)


@pytest.fixture(scope="module")
def tp1(checkpoints):
    """(url, llm, model) of an in-process TP = 1 server over checkpoint v0, same k_groups."""
    model = UnifiedCausalLM.from_pretrained(str(checkpoints[0]), dtype=torch.bfloat16, device="cpu",
                                            k_groups=K_GROUPS)
    llm = LLM(model, EngineConfig(**ENGINE, k_groups=K_GROUPS))
    server = TikServer(llm).start()
    try:
        yield f"http://{server.address}", llm, model
    finally:
        server.stop(close_llm=True)


def _generate(url: str) -> list[dict]:
    metas = []
    for i, prompt in enumerate(PROMPTS):
        r = post(url, "/generate", gen_payload(prompt, seed=100 + i, **SAMPLING), timeout=120)
        assert r.status_code == 200, r.text
        metas.append({"ids": r.json()["output_ids"], **r.json()["meta_info"]})
    return metas


def _assert_same(tp2_metas: list[dict], tp1_metas: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(tp2_metas, tp1_metas, strict=True)):
        assert a["ids"] == b["ids"] and len(a["ids"]) == SAMPLING["max_new_tokens"], i
        assert torch.equal(as_f32([p[0] for p in a["output_token_logprobs"]]).view(torch.int32),
                           as_f32([p[0] for p in b["output_token_logprobs"]]).view(torch.int32)), i
        assert a["output_token_versions"] == b["output_token_versions"], i


def _assert_training_bits(tp1, version: int) -> None:
    """The TP = 1 engine (the TP = 1 server's) == the TP = 1 training forward, same k_groups."""
    _, llm, model = tp1
    outputs = llm.generate(PROMPTS, [SamplingParams(seed=100 + i, **SAMPLING) for i in range(len(PROMPTS))])
    assert all(o.versions == [version] * SAMPLING["max_new_tokens"] for o in outputs)
    assert_bitwise_logprobs(model, outputs)


def test_health_reports_the_split(tp2):
    health = requests.get(tp2[0] + "/health", timeout=TIMEOUT).json()
    assert health["tensor_parallel_size"] == 2 and health["k_groups"] == K_GROUPS
    assert (health["vocab_parallel"], health["vocab_rows"], health["vocab_saved_bytes"]) == (False, None, 0)
    assert health["kernels"] == "unified"


def test_tp2_server_equals_tp1_server_and_training_across_a_disk_update(tp2, tp1, checkpoints):
    url2, url1 = tp2[0], tp1[0]
    before = _generate(url2)
    _assert_same(before, _generate(url1))
    _assert_training_bits(tp1, 0)
    for url in (url2, url1):
        r = post(url, "/update_weights_from_disk", {"model_path": str(checkpoints[1]), "weight_version": 3},
                 timeout=120)
        assert r.status_code == 200 and r.json()["weight_version"] == 3, r.text
    after = _generate(url2)
    assert all(m["output_token_versions"] == [3] * SAMPLING["max_new_tokens"] for m in after)
    assert [m["output_token_logprobs"] for m in after] != [m["output_token_logprobs"] for m in before]
    _assert_same(after, _generate(url1))
    _assert_training_bits(tp1, 3)


def _post_in_thread(url: str, endpoint: str, payload: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(r=post(url, endpoint, payload, timeout=120)))
    thread.start()
    return thread, box


def _answer(thread: threading.Thread, box: dict) -> dict:
    thread.join(timeout=120)
    assert not thread.is_alive() and box["r"].status_code == 200, box.get("r") and box["r"].text
    return box["r"].json()


def test_tp2_server_takes_a_broadcast_update_in_buckets(tp2, tp1, checkpoints):
    """The xccl path over gloo: both ranks join the trainer's group (ranks 1 and 2 of 3, as
    AReaL numbers a TP = 2 server's workers) and receive two buckets; each stages them and
    applies the whole update as one version; then TP = 2 == TP = 1 server at v5."""
    import torch.distributed as dist
    from areal.engine.core.distributed import init_custom_process_group
    from areal.utils.network import find_free_ports

    from areal_tik.adapter.server import load_safetensors_dir

    url2, url1 = tp2[0], tp1[0]
    port = find_free_ports(1)[0]
    joined = _post_in_thread(url2, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
        "backend": "gloo", "group_name": "tp_test_group"})
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=3,
                                      rank=0, group_name="tp_test_group")
    try:
        _answer(*joined)
        state = load_safetensors_dir(checkpoints[0], "cpu")  # back to v0's weights, as version 5
        names = sorted(state)
        for k, bucket in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
            sent = _post_in_thread(url2, "/update_weights_from_distributed", {
                "names": bucket, "dtypes": [str(state[n].dtype).split(".")[1] for n in bucket],
                "shapes": [list(state[n].shape) for n in bucket], "group_name": "tp_test_group",
                "weight_version": 5})
            for n in bucket:
                dist.broadcast(state[n].contiguous(), src=0, group=group)
            assert _answer(*sent)["message"] == ("staged" if k == 0 else "ok")
    finally:
        dist.destroy_process_group(group)
    r = post(url1, "/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": 5})
    assert r.status_code == 200, r.text
    after = _generate(url2)
    assert all(m["output_token_versions"] == [5] * SAMPLING["max_new_tokens"] for m in after)
    _assert_same(after, _generate(url1))  # v0's weights again: their training bits are checked above


def test_a_split_the_model_cannot_take_is_refused_at_start_naming_both(checkpoints):
    # the tiny llama has 2 KV heads
    done = subprocess.run(_serve_command(checkpoints[0], "--tensor-parallel-size", "4", "--k-groups", "4"),
                          capture_output=True, text=True, timeout=120, env={**os.environ, INTERPRET_ENV: "1"})
    assert done.returncode == 2, done.stderr
    assert "tensor_parallel_size=4 does not divide the model's KV heads (2)" in done.stderr


def test_pause_holds_requests_on_every_rank_until_continue(tp2):
    url = tp2[0]
    assert post(url, "/pause_generation", {}).status_code == 200
    waiting = _post_in_thread(url, "/generate", gen_payload(PROMPTS[0], seed=1, **SAMPLING))
    waiting[0].join(timeout=1.5)
    assert waiting[0].is_alive() and requests.get(url + "/health", timeout=TIMEOUT).json()["paused"]
    assert post(url, "/continue_generation", {}).status_code == 200
    assert len(_answer(*waiting)["output_ids"]) == SAMPLING["max_new_tokens"]


def _rank_processes(proc: subprocess.Popen) -> list:
    return [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]


def test_sigterm_ends_every_rank(tp2):  # last of the module server's tests: it ends it
    url, proc = tp2
    ranks = _rank_processes(proc)
    assert len(ranks) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children()]
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    stderr = proc.stderr.read()
    assert "tensor-parallel rank 1 ended with exit code 0" in stderr, stderr  # closed by rank 0, not killed
    assert not ranks[0].is_running()


def test_tp4_vocab_parallel_server_equals_tp1_then_a_rank_that_dies_ends_rank_0_with_its_name(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "kv4", num_hidden_layers=1, num_key_value_heads=4, seed=2)
    url, proc = _start_tp(model_dir, 4, "--k-groups", "4", "--vocab-parallel")
    try:
        model = UnifiedCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, device="cpu", k_groups=4)
        health = requests.get(url + "/health", timeout=TIMEOUT).json()  # rank 0: the first of 4 splits of 64
        vocab, hidden, tensors = model.spec.vocab, model.spec.hidden, 1 if model.spec.tie_embeddings else 2
        assert vocab == 256 and health["vocab_parallel"] and health["vocab_rows"] == [0, 64]
        assert health["vocab_saved_bytes"] == tensors * (vocab - 64) * hidden * 2
        with LLM(model, EngineConfig(**ENGINE, k_groups=4)) as llm:
            served = TikServer(llm).start()
            try:
                _assert_same(_generate(url), _generate(f"http://{served.address}"))
            finally:
                served.stop()
            _assert_training_bits((None, llm, model), 0)
        ranks = _rank_processes(proc)
        assert len(ranks) == 3, [c.cmdline() for c in psutil.Process(proc.pid).children()]
        victim = ranks[1]
        victim.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 still runs 30 s after one of its ranks died")
        stderr = proc.stderr.read()
        assert proc.returncode == 1, stderr
        assert re.search(rf"tensor-parallel rank [123] \(pid {victim.pid}\) ended with exit code -9", stderr), stderr
        _, alive = psutil.wait_procs([r for r in ranks if r is not victim], timeout=15)
        assert not alive, f"ranks {alive} outlived rank 0 by 15 s"  # each sees rank 0's pipe close
    finally:
        _end(proc)

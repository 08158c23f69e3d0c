"""Server mode: the areal-tik engine behind HTTP, driven by AReaL's RemoteInfEngine.

Servers run in process on 127.0.0.1 with an ephemeral port and are always stopped by
the fixture; every HTTP call has a timeout.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import requests  # noqa: E402

from areal_tik.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from areal_tik.adapter.server import TikServer  # noqa: E402
from areal_tik.model import UnifiedCausalLM, random_model, tiny_config  # noqa: E402

from ._bits import assert_bitwise  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=128, num_hidden_layers=1)
TIMEOUT = 30
PROMPTS = [[5, 9, 17, 3], [40, 2, 77], [1, 2, 3, 4, 5, 6, 7]]


def make_llm(seed: int = 0) -> LLM:
    hf = random_model(tiny_config("llama", **SMALL), seed=seed)
    model = UnifiedCausalLM.from_hf(hf, kernels="standard")
    return LLM(model, EngineConfig(max_num_seqs=4, max_model_len=64, kv_block_size=16, seed=11),
               eos_token_ids=())


@pytest.fixture
def served():
    llm = make_llm()
    server = TikServer(llm).start()
    try:
        yield llm, f"http://{server.address}"
    finally:
        server.stop(close_llm=True)


def post(url: str, endpoint: str, payload: dict, timeout: float = TIMEOUT):
    return requests.post(url + endpoint, json=payload, timeout=timeout)


def gen_payload(ids, **sampling):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **sampling},
            "return_logprob": True, "stream": False}


def as_f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_binds_loopback_ephemeral_port(served):
    llm, url = served
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    health = requests.get(url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["kernels"] == "standard"
    assert requests.get(url + "/get_weight_version", timeout=TIMEOUT).json() == {"weight_version": 0}


def test_generate_matches_llm_generate_bitwise(served):
    llm, url = served
    sp = dict(temperature=0.8, max_new_tokens=6)
    direct = llm.generate(PROMPTS, [SamplingParams(seed=100 + i, **sp) for i in range(len(PROMPTS))])
    for i, (prompt, ref) in enumerate(zip(PROMPTS, direct)):
        r = post(url, "/generate", gen_payload(prompt, seed=100 + i, **sp))
        assert r.status_code == 200, r.text
        body = r.json()
        meta = body["meta_info"]
        assert body["output_ids"] == ref.token_ids == [p[1] for p in meta["output_token_logprobs"]]
        assert_bitwise(as_f32([p[0] for p in meta["output_token_logprobs"]]), as_f32(ref.logprobs),
                       f"prompt {i}")
        assert meta["output_token_versions"] == ref.versions == [0] * 6
        assert meta["finish_reason"] == {"type": "length"}


def test_bad_requests_are_4xx_and_server_keeps_serving(served):
    llm, url = served
    cases = [
        (gen_payload([]), "prompt_ids must not be empty"),
        (gen_payload([1, 2], top_p=1.5), "1.5"),
        (gen_payload([1, 2], temperature=-1.0), "-1.0"),
        (gen_payload([1, 999]), "999"),
        (gen_payload([1, 2], frequency_penalty=0.5), "frequency_penalty"),
        (gen_payload([1, 2], bogus=1), "bogus"),
        ({"sampling_params": {}}, "input_ids"),
    ]
    for payload, needle in cases:
        r = post(url, "/generate", payload)
        assert 400 <= r.status_code < 500, (payload, r.status_code, r.text)
        assert needle in r.json()["error"], (needle, r.text)
    r = requests.post(url + "/generate", data=b"not json", timeout=TIMEOUT)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = post(url, "/update_weights_from_disk", {"model_path": "/nonexistent-dir"})
    assert r.status_code == 400 and "/nonexistent-dir" in r.json()["error"]
    assert "top_p" in post(url, "/generate", gen_payload([1, 2], top_p=0.0)).json()["error"]
    ok = post(url, "/generate", gen_payload([1, 2], seed=1))
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 6


def test_weight_update_from_disk_bumps_version_and_changes_outputs(served, tmp_path):
    llm, url = served
    payload = gen_payload(PROMPTS[0], seed=5, temperature=1.0)
    before = post(url, "/generate", payload).json()["meta_info"]
    make_llm(seed=1).model.hf_model.save_pretrained(tmp_path / "v3")
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v3"), "weight_version": 3})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == 3 == llm.version
    assert requests.get(url + "/get_weight_version", timeout=TIMEOUT).json()["weight_version"] == 3
    after = post(url, "/generate", payload).json()["meta_info"]
    assert after["output_token_versions"] == [3] * 6
    assert [p[0] for p in after["output_token_logprobs"]] != [p[0] for p in before["output_token_logprobs"]]
    # the same request on an engine built from the new weights gives the same bits
    fresh = make_llm(seed=1)
    try:
        ref = fresh.generate([PROMPTS[0]], SamplingParams(seed=5, max_new_tokens=6))[0]
    finally:
        fresh.close()
    assert_bitwise(as_f32([p[0] for p in after["output_token_logprobs"]]), as_f32(ref.logprobs), "v3")
    # no version given: current + 1
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v3")})
    assert r.json()["weight_version"] == 4


def _generate_in_thread(url, payload):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", post(url, "/generate", payload)))
    thread.start()
    return thread, box


def test_pause_and_continue(served):
    llm, url = served
    assert post(url, "/pause_generation", {}).status_code == 200
    assert llm.paused and requests.get(url + "/health", timeout=TIMEOUT).json()["paused"]
    steps = llm.num_steps
    thread, box = _generate_in_thread(url, gen_payload(PROMPTS[1], seed=2))
    thread.join(timeout=1.0)
    assert thread.is_alive() and llm.num_steps == steps, "generated while paused"
    assert requests.get(url + "/get_weight_version", timeout=TIMEOUT).status_code == 200  # still serving
    assert post(url, "/continue_generation", {}).status_code == 200
    thread.join(timeout=TIMEOUT)
    assert not thread.is_alive() and box["r"].status_code == 200
    assert len(box["r"].json()["output_ids"]) == 6


# ----------------------------------------------------------------------------- AReaL


@pytest.fixture
def remote(served):
    from areal.api.cli_args import InferenceEngineConfig

    from areal_tik.adapter.client import TikRemoteInfEngine

    llm, url = served
    config = InferenceEngineConfig(experiment_name="tik-server-test", trial_name="t0", setup_timeout=30,
                                   request_timeout=TIMEOUT, request_retries=1, pause_grace_period=0.0)
    engine = TikRemoteInfEngine(config)
    engine.initialize(addr=url.removeprefix("http://"), train_data_parallel_size=1)
    try:
        yield llm, url, engine
    finally:
        engine.destroy()


def areal_request(prompt, max_new_tokens=6):
    from areal.api import ModelRequest
    from areal.api.cli_args import GenerationHyperparameters

    return ModelRequest(input_ids=list(prompt),
                        gconfig=GenerationHyperparameters(max_new_tokens=max_new_tokens, temperature=0.9))


def test_remote_inf_engine_matches_direct_engine(remote):
    llm, url, engine = remote
    direct = make_llm()   # same weights and engine seed: the same request order gives the same keys
    try:
        for prompt in PROMPTS:
            resp = asyncio.run(engine.agenerate(areal_request(prompt)))
            ref = direct.generate([prompt], SamplingParams(temperature=0.9, max_new_tokens=6))[0]
            assert resp.input_tokens == prompt and resp.output_tokens == ref.token_ids
            assert_bitwise(as_f32(resp.output_logprobs), as_f32(ref.logprobs), str(prompt))
            assert resp.output_versions == [0] * 6 and resp.stop_reason == "length"
    finally:
        direct.close()


def test_remote_versions_come_from_the_server(remote, tmp_path, monkeypatch):
    """A weight update (AReaL's update_weights_from_disk) lands mid-request: the response
    holds the server's per-token versions (stock RemoteInfEngine would stamp the client's
    version 0 on every token)."""
    from areal.utils import name_resolve, names

    llm, url, engine = remote
    make_llm(seed=1).model.hf_model.save_pretrained(tmp_path / "w")
    repo = name_resolve.NfsNameRecordRepository(record_root=str(tmp_path / "names"))
    monkeypatch.setattr(name_resolve, "wait", repo.wait)
    repo.add(names.update_weights_from_disk("tik-server-test", "t0", engine.get_version()), str(time.time()))
    launch = llm.runner.launch
    monkeypatch.setattr(llm.runner, "launch", lambda *a: (time.sleep(0.02), launch(*a))[1])  # slow steps
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault(
        "resp", asyncio.run(engine.agenerate(areal_request(PROMPTS[2], max_new_tokens=40)))))
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while llm.num_steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.pause_generation()           # AReaL's pause: POST /pause_generation on every server
    engine.update_weights_from_disk(_disk_meta(tmp_path / "w", version=7)).result(timeout=TIMEOUT)
    assert llm.version == 7
    engine.continue_generation()
    thread.join(timeout=TIMEOUT)
    assert not thread.is_alive()
    versions = box["resp"].output_versions
    assert engine.get_version() == 0 and len(versions) == 40
    assert versions[0] == 0 and versions[-1] == 7 and sorted(versions) == versions, versions


def _disk_meta(path, version):
    from areal.api import WeightUpdateMeta

    return WeightUpdateMeta(type="disk", path=str(path), version=version)


def _checkpoint(path, seed):
    make_llm(seed=seed).model.hf_model.save_pretrained(path)
    return str(path)


def _serve_engine_args():
    return ["--kernels", "standard", "--device", "cpu", "--max-num-seqs", "4", "--max-model-len", "64",
            "--seed", "11"]


@pytest.fixture
def server_process(tmp_path):
    """A server in its own process (the weight-update group needs the server and the
    trainer in different processes, as in a real run)."""
    from ._server_utils import server_process as start

    with start(_checkpoint(tmp_path / "v0", 0), *_serve_engine_args()) as url:
        yield url


def test_weight_update_by_broadcast_stages_buckets_then_applies_them_at_once(server_process, tmp_path):
    """AReaL's xccl path, both ends real: the trainer's rank 0 joins a gloo group with a
    server process through AReaL's init_custom_process_group and RemoteInfEngine's
    init_weights_update_group, then sends two buckets (update_weights_from_distributed +
    dist.broadcast, as FSDPEngine does). The first bucket changes nothing; the second
    applies both as version 5, and the server then samples the bits of an engine built
    from the new weights."""
    import torch.distributed as dist
    from areal.api import WeightUpdateMeta
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import ParamSpec
    from areal.engine.core.distributed import init_custom_process_group
    from areal.utils.network import find_free_ports

    from areal_tik.adapter.client import TikRemoteInfEngine

    url = server_process
    engine = TikRemoteInfEngine(InferenceEngineConfig(
        experiment_name="tik-xccl-test", trial_name="t0", setup_timeout=30, request_timeout=TIMEOUT,
        request_retries=1, pause_grace_period=0.0))
    engine.initialize(addr=url.removeprefix("http://"), train_data_parallel_size=1)
    payload = gen_payload(PROMPTS[0], seed=5, temperature=1.0, ignore_eos=True)
    try:
        # the trainer's actor refuses reuse unless every server reports the unified kernels
        assert engine.server_kernels() == {url.removeprefix("http://"): "standard"}
        assert engine.server_k_groups() == {url.removeprefix("http://"): 1}  # and its K-group tree
        before = post(url, "/generate", payload).json()["meta_info"]
        meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("sglang:d1"),
                                nccl_master_address="127.0.0.1", nccl_master_port=find_free_ports(1)[0],
                                nccl_group_name="tik_test_group", version=5)
        joined = engine.init_weights_update_group(meta)
        group = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}", world_size=2, rank=0,
            group_name="tik_test_group")
        joined.result(timeout=TIMEOUT)

        state = {k: v.contiguous() for k, v in make_llm(seed=1).model.hf_model.state_dict().items()}
        names = list(state)
        for k, bucket in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
            specs = [ParamSpec(name=n, shape=tuple(state[n].shape), dtype=str(state[n].dtype).split(".")[1])
                     for n in bucket]
            fut = engine.update_weights_from_distributed(meta, specs)
            for n in bucket:
                dist.broadcast(state[n], src=0, group=group)
            fut.result(timeout=TIMEOUT)
            version = requests.get(url + "/get_weight_version", timeout=TIMEOUT).json()["weight_version"]
            if k == 0:  # staged, not applied
                assert version == 0
                mid = post(url, "/generate", payload).json()["meta_info"]
                assert mid["output_token_logprobs"] == before["output_token_logprobs"]
        assert version == 5
        after = post(url, "/generate", payload).json()["meta_info"]

        bad = post(url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                             "group_name": "nope"})
        assert bad.status_code == 400 and "'nope'" in bad.json()["error"]
        bad = post(url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float99"],
                                                             "shapes": [[1]], "group_name": "tik_test_group"})
        assert bad.status_code == 400 and "float99" in bad.json()["error"]
        bad = post(url, "/init_weights_update_group", {"group_name": "g2", "master_address": "127.0.0.1",
                                                       "master_port": 1, "rank_offset": 0, "world_size": 2})
        assert bad.status_code == 400 and "rank_offset" in bad.json()["error"]
    finally:
        engine.destroy()

    # the reference: a server-configured engine over a checkpoint of the new weights
    from areal_tik.model import UnifiedCausalLM

    model = UnifiedCausalLM.from_pretrained(_checkpoint(tmp_path / "v5", 1), dtype=torch.bfloat16,
                                            device="cpu", kernels="standard")
    with LLM(model, EngineConfig(max_num_seqs=4, max_model_len=64, seed=11)) as ref_llm:
        ref = ref_llm.generate([PROMPTS[0]], SamplingParams(seed=5, max_new_tokens=6, ignore_eos=True))[0]
    assert after["output_token_versions"] == [5] * 6
    assert [p[1] for p in after["output_token_logprobs"]] == ref.token_ids
    assert_bitwise(as_f32([p[0] for p in after["output_token_logprobs"]]), as_f32(ref.logprobs), "v5")
    assert [p[0] for p in after["output_token_logprobs"]] != [p[0] for p in before["output_token_logprobs"]]


def test_backend_builds_sglang_shaped_weight_requests():
    from areal.api import WeightUpdateMeta
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import ParamSpec

    from areal_tik.adapter.client import TikServerBackend

    backend = TikServerBackend()
    meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("sglang:d2"),
                            nccl_master_address="10.0.0.1", nccl_master_port=1234, nccl_group_name="g",
                            version=3)
    init = backend.build_init_weights_group_request("a:1", 1, meta)
    assert init.endpoint == "/init_weights_update_group"
    assert init.payload["rank_offset"] == 2 and init.payload["world_size"] == 3
    reqs = backend.build_distributed_weight_update_requests(meta, [ParamSpec("w", (2, 3), "bfloat16")])
    assert reqs.requests[0].payload == {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                                        "group_name": "g", "weight_version": 3}
    tp2 = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("sglang:d2t2"),
                           nccl_master_address="10.0.0.1", nccl_master_port=1234, nccl_group_name="g")
    init = backend.build_init_weights_group_request("a:1", 1, tp2)  # server 1's ranks: 3 and 4 of 5
    assert init.payload["rank_offset"] == 3 and init.payload["world_size"] == 5
    with pytest.raises(NotImplementedError, match="pp_size=2"):
        backend.build_init_weights_group_request(
            "a:1", 0, WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("sglang:d1p2")))


def test_backend_refuses_what_the_server_cannot_do():
    from areal_tik.adapter.client import TikServerBackend

    backend = TikServerBackend()
    with pytest.raises(NotImplementedError, match="LoRA"):
        backend.build_generation_request(areal_request([1]), with_lora=True, version=0)
    with pytest.raises(ValueError, match="versions"):
        backend.parse_generation_response({"meta_info": {
            "output_token_logprobs": [[-1.0, 3, None]], "output_token_versions": [],
            "finish_reason": {"type": "stop"}}})


def test_a_server_whose_engine_broke_refuses_requests_and_ends():
    """An engine whose step loop stopped on an error refuses every request (503, naming the
    error); AReaL's rollout loop would retry such refusals for ever, so the server stops
    (serve_until returns True: ``areal-tik serve`` exits with code 1)."""
    from areal_tik.adapter.server import serve_until

    llm = make_llm()
    server = TikServer(llm)
    stop = threading.Event()
    result = []
    thread = threading.Thread(target=lambda: result.append(serve_until(server, stop, poll_s=0.05)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while server.port == 0 and time.monotonic() < deadline:  # bound: start() has returned
            time.sleep(0.01)
        url = f"http://{server.address}"
        assert post(url, "/generate", gen_payload(PROMPTS[0])).status_code == 200  # serving
        assert not server.broken.is_set()
        llm.loop.error = RuntimeError("CUDA error: an illegal memory access was encountered")  # as a step would
        r = post(url, "/generate", gen_payload(PROMPTS[1]))
        assert r.status_code == 503 and "the engine is broken" in r.text and "illegal memory access" in r.text
        thread.join(TIMEOUT)
        assert result == [True] and server.broken_reason.startswith("RuntimeError: CUDA error")
    finally:
        stop.set()
        thread.join(TIMEOUT)
        llm.loop.error = None
        llm.close()


def test_the_trainers_watch_reacts_to_a_server_that_died_not_to_one_stopped():
    import subprocess
    import sys

    from areal_tik.adapter.client import watch_servers

    def spawn(code: int, after_s: float):
        return subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep({after_s}); sys.exit({code})"])

    deaths, stopping = [], [False]
    procs = [spawn(0, 0.0), spawn(0, 30)]  # one ends cleanly (code 0), one keeps running
    watch = watch_servers(procs, lambda: stopping[0], deaths.append, poll_s=0.05)
    time.sleep(0.5)
    assert deaths == []
    dying = spawn(3, 0.2)
    procs.append(dying)  # a server launched later is watched too
    watch.join(TIMEOUT)
    assert deaths == [dying] and dying.returncode == 3
    # while the engine stops its servers (destroy), an exit is not a death
    stopping[0] = True
    quiet = watch_servers([spawn(5, 0.0)], lambda: stopping[0], deaths.append, poll_s=0.05)
    quiet.join(TIMEOUT)
    assert deaths == [dying]
    procs[1].kill()

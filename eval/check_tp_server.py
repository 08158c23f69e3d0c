"""Check: ``areal-tik serve --tensor-parallel-size 2`` against a TP = 1 engine and the TP = 1
training forward, across a disk update and a broadcast (xccl) update.

Usage (repo root): python3 -m eval.check_tp_server [--config Qwen3-1.7B] [--layers 4]
    [--device cuda] [--trainer-device cuda:2] [--out DIR]

The server's ranks run on cuda:0 and cuda:1 (NCCL between them); the TP = 1 engine on
cuda:0. The trainer's end of the weight-update group runs in this process on
``--trainer-device`` (NCCL refuses two ranks of one group on one GPU, so the xccl step needs
a third GPU; ``--trainer-device none`` skips it). The model: ``--config``'s published
config cut to ``--layers`` layers, random weights (two seeds: v0, v1), written as
checkpoints. Every comparison is bitwise (tokens, and the log-probs' int32 views);
results go to ``DIR/tp_server.json``; the exit code is 0 only if every check holds.
Without GPUs: ``--device cpu --config tiny-llama --trainer-device cpu`` (gloo, the
interpreter) runs the same steps on the tiny test model, as a dry run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from areal_tik import consistency
from areal_tik.adapter.server import load_safetensors_dir
from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.model import UnifiedCausalLM, published_config, tiny_config
from areal_tik.model.checkpoints import char_tokenizer, random_checkpoint

K_GROUPS, MAX_LEN, TIMEOUT = 2, 256, 600
KV_BLOCKS = 256  # fixed: the server's rank 0 and the TP = 1 engine share cuda:0 (no free-memory sizing)


def _checkpoints(root: Path, config_name: str, layers: int) -> tuple[Path, Path]:
    if config_name.startswith("tiny-"):
        config = tiny_config(config_name.removeprefix("tiny-"), num_hidden_layers=layers)
    else:
        config = published_config(config_name, num_hidden_layers=layers)
    tokenizer = char_tokenizer()
    return tuple(random_checkpoint(root / f"v{seed}", config, tokenizer, seed=seed) for seed in (0, 1))


def _start(model: Path, device: str) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "areal_tik.cli", "serve", "--model", str(model), "--device", device,
                             "--port", str(port), "--tensor-parallel-size", "2", "--k-groups", str(K_GROUPS),
                             "--max-model-len", str(MAX_LEN), "--num-kv-blocks", str(KV_BLOCKS)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except requests.ConnectionError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the TP = 2 server did not start (exit code {proc.poll()})")


def _post(url: str, endpoint: str, payload: dict) -> dict:
    r = requests.post(url + endpoint, json=payload, timeout=TIMEOUT)
    if r.status_code != 200:
        raise RuntimeError(f"{endpoint}: {r.status_code} {r.text}")
    return r.json()


def _prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (8 + 5 * i,), generator=gen).tolist() for i in range(n)]


def _compare(url: str, llm: LLM, model, prompts, new_tokens: int, version: int) -> dict:
    """TP = 2 server vs TP = 1 engine vs TP = 1 training forward on ``prompts``."""
    sp = dict(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    ref = llm.generate(prompts, [SamplingParams(seed=100 + i, **sp) for i in range(len(prompts))])
    same_tokens = same_bits = total = 0
    versions_ok = True
    for i, (prompt, out) in enumerate(zip(prompts, ref)):
        meta = _post(url, "/generate", {"input_ids": prompt, "sampling_params": {"seed": 100 + i, **sp}})["meta_info"]
        served = [p[0] for p in meta["output_token_logprobs"]]
        same_tokens += [p[1] for p in meta["output_token_logprobs"]] == out.token_ids
        bits = torch.tensor(served, dtype=torch.float32).view(torch.int32)
        if len(served) == len(out.logprobs):
            same_bits += int((bits == torch.tensor(out.logprobs, dtype=torch.float32).view(torch.int32)).sum())
        total += len(out.logprobs)
        versions_ok &= meta["output_token_versions"] == [version] * new_tokens
    training = consistency.compare(ref, consistency.packed_logprobs(model, ref))
    return {"version": version, "requests_same_tokens": f"{same_tokens}/{len(prompts)}",
            "logprobs_bitwise_tp2_vs_tp1": f"{same_bits}/{total}", "versions_ok": versions_ok,
            "tp1_vs_training": f"{training.num_identical}/{training.num_tokens}",
            "ok": same_tokens == len(prompts) and same_bits == total and versions_ok
                  and training.num_identical == training.num_tokens > 0}


def _broadcast(url: str, state: dict, trainer_device: str, version: int) -> None:
    """The trainer's side of the xccl path: a group of 3 (trainer, the server's 2 ranks), 2 buckets."""
    from areal.engine.core.distributed import init_custom_process_group
    import torch.distributed as dist

    backend = "nccl" if trainer_device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(trainer_device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    join = threading.Thread(target=_post, args=(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
        "backend": backend, "group_name": "tp_check"}))
    join.start()
    group = init_custom_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", world_size=3,
                                      rank=0, group_name="tp_check")
    join.join()
    names = sorted(state)
    for bucket in (names[: len(names) // 2], names[len(names) // 2:]):
        sent = threading.Thread(target=_post, args=(url, "/update_weights_from_distributed", {
            "names": bucket, "dtypes": [str(state[n].dtype).split(".")[1] for n in bucket],
            "shapes": [list(state[n].shape) for n in bucket], "group_name": "tp_check", "weight_version": version}))
        sent.start()
        for n in bucket:
            dist.broadcast(state[n].to(trainer_device).contiguous(), src=0, group=group)
        sent.join()
    dist.destroy_process_group(group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="Qwen3-1.7B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trainer-device", default="cuda:2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tp-server-check-"))
    v0, v1 = _checkpoints(root, args.config, args.layers)
    device0 = "cuda:0" if args.device == "cuda" else args.device
    url, proc = _start(v0, args.device)
    results: list[dict] = []
    try:
        model = UnifiedCausalLM.from_pretrained(str(v0), dtype=torch.bfloat16, device=device0, k_groups=K_GROUPS)
        with LLM(model, EngineConfig(k_groups=K_GROUPS, max_model_len=MAX_LEN, num_kv_blocks=KV_BLOCKS)) as llm:
            prompts = _prompts(args.requests, min(model.spec.vocab, 256))
            results.append({"step": "v0", **_compare(url, llm, model, prompts, args.new_tokens, 0)})
            for target in (url, None):  # the server, then the TP = 1 engine
                if target:
                    _post(url, "/update_weights_from_disk", {"model_path": str(v1), "weight_version": 3})
                else:
                    llm.update_weights(load_safetensors_dir(v1, device0), version=3)
            results.append({"step": "disk v1", **_compare(url, llm, model, prompts, args.new_tokens, 3)})
            if args.trainer_device != "none":
                _broadcast(url, load_safetensors_dir(v0, "cpu"), args.trainer_device, 5)
                llm.update_weights(load_safetensors_dir(v0, device0), version=5)
                results.append({"step": "xccl v0", **_compare(url, llm, model, prompts, args.new_tokens, 5)})
    finally:
        proc.terminate()
        results.append({"step": "shutdown", "ok": proc.wait(timeout=120) == 0})
    print(json.dumps(results, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tp_server.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Check: AReaL's own vLLM server (the rollout a single-GPU AReaL user runs) in this project's
split environment. GPU only; needs the ``deps`` and ``vllm_deps`` stages.

Usage (GPU, repo root, AReaL's site on PYTHONPATH as every stage has it):
    python3 -m eval.check_areal_vllm [--model qwen3-0.6b] [--workdir /tmp/areal-vllm]

vLLM 0.26 wants transformers >= 5.5.3 and AReaL 1.0.4's trainer <= 5.3, so the server runs in
a process of its own whose path puts vLLM's site, then the image's site-packages (its
transformers), then AReaL's site (``server_env``). The server is AReaL's
``areal.engine.vllm_ext.areal_vllm_server`` with the command AReaL's ``vLLMConfig.build_cmd``
writes (``server_command``), as AReaL's launcher starts it. The check writes the recipe's
random-weight checkpoint (in this process), starts the server on this GPU with a memory
fraction that leaves room for a trainer, and reports: seconds to ready, one completion with
sampled-token log-probs, AReaL's disk weight update (``/areal_update_weights``) and a
completion after it. Each step's failure is printed with the server log's tail: the answer
to whether AReaL with vLLM can be the recipes' stock rollout here. (The vLLM carry,
``scripts/vllm_wheels.sh``, was planned for offline generation; a module the OpenAI server
needs beyond that shows up there as an import error.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVER_MODULE = "areal.engine.vllm_ext.areal_vllm_server"


def server_command(model_path: str, port: int, *, max_model_len: int = 1024, max_num_seqs: int = 128,
                   gpu_memory_utilization: float = 0.35, seed: int = 1) -> list[str]:
    """AReaL's command for one vLLM server (tensor and pipeline parallel 1) on ``port``."""
    from areal.api.cli_args import vLLMConfig

    config = vLLMConfig(model=model_path, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        gpu_memory_utilization=gpu_memory_utilization)
    return vLLMConfig.build_cmd(config, tp_size=1, pp_size=1, host="127.0.0.1", port=port)


def server_env(vllm_site: str, image_site: str, areal_site: str, base: dict | None = None) -> dict:
    """The server's environment: vLLM's site, then the image's site-packages (transformers
    5.17 there shadows AReaL's 5.3), then AReaL's site for areal and what only it carries."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([vllm_site, image_site, areal_site])
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as eval/vllm_generate runs it
    return env


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def _ready(base: str, proc, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"not ready after {timeout:.0f} s")


def _completion(base: str, model: str, prompt: list[int]) -> str:
    out = _post(f"{base}/v1/completions", dict(model=model, prompt=prompt, max_tokens=16, temperature=1.0,
                                               logprobs=0, ignore_eos=True))
    choice = out["choices"][0]
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return f"{len(lps)} tokens, log-probs {[round(x, 3) for x in lps[:4]]}..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--workdir", default="/tmp/areal-vllm")
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    vllm_site = os.environ.get("AREAL_TIK_VLLM_SITE", "/tmp/areal-tik-vllm-site")
    areal_site = os.environ.get("SITE", "/tmp/areal-tik-site")
    image_site = sysconfig.get_paths()["purelib"]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)

    from areal_tik.cli import RANDOM_INIT
    from areal_tik.model import checkpoints, published_config, smollm2_path

    t = time.perf_counter()
    ckpt = work / args.model
    if not (ckpt / "config.json").is_file():
        tokenizer = checkpoints.gguf_tokenizer(smollm2_path())
        shape = published_config(RANDOM_INIT[args.model][1], eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        checkpoints.random_checkpoint(ckpt, shape, tokenizer, seed=0, device="cuda")
    print(f"checkpoint {args.model}: {time.perf_counter() - t:.1f} s", flush=True)
    cmd = server_command(str(ckpt), args.port)
    print("server:", " ".join(cmd), flush=True)
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(cmd, env=server_env(vllm_site, image_site, areal_site), stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    failed = False
    try:
        for name, step in (("ready", lambda: f"{_ready(base, proc, args.timeout):.1f} s"),
                           ("completion", lambda: _completion(base, str(ckpt), list(range(100, 228)))),
                           ("disk weight update", lambda: str(_post(f"{base}/areal_update_weights",
                                                                    {"model_path": str(ckpt)}))[:200]),
                           ("completion after the update", lambda: _completion(base, str(ckpt), list(range(300, 428))))):
            t = time.perf_counter()
            try:
                print(f"{name}: {step()} ({time.perf_counter() - t:.1f} s)", flush=True)
            except Exception as exc:  # noqa: BLE001  (the check's answer is the failure)
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                failed = True
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        tail = (work / "server.log").read_text(errors="replace").splitlines()[-40:]
        print("server log (last 40 lines):\n" + "\n".join(tail), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

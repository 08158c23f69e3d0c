"""Start-up before a run's first step, cold: what the flag adds to a trainer's process.

Each case runs in a fresh process with empty Triton and qualification caches, the phases in
the order the actor and the engine run them: device qualification (``areal_tik.qualify``),
the trainer's kernel warm-up (``unified_kernels.warmup`` for a micro-batch of 16384 tokens,
forward and backward, as ``TikFSDPPPOActor`` does) and the rollout engine's start (warm-up,
KV sizing, CUDA-graph capture, with the recipes' ``tik:`` sizes). Modes, side by side in one
run:

- ``serial``: the qualification probe compiles each kernel at its first launch, and the
  warm-ups run on 8 threads (the code before the probe compiled ahead);
- ``threaded``: the probe's kernels compiled first on threads (``qualify.precompile``), the
  warm-ups on one thread per CPU (at most 16);
- ``warm``: ``threaded`` again over the Triton cache the ``threaded`` case filled, with an
  empty qualification cache (a second run of a recipe on the same machine, which also
  finds its qualification verdict cached: 0.2 s, not shown).

Printed and written (``bench_startup.csv``): the seconds of each phase and of the whole
child process (interpreter start and imports included), per model and mode, and the
serial / threaded ratio.

Usage (GPU, repo root): python3 -m eval.bench_startup [--models qwen3-0.6b llama-3.2-1b] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from eval.harness import bench_parser, print_summary, run_info, write_csv

MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "llama-3.2-1b": "Llama-3.2-1B",
          "qwen2.5-1.5b": "Qwen2.5-1.5B"}
MODES = ("serial", "threaded", "warm")
_MARK = "STARTUP_RESULT "


def child(model_name: str, mode: str) -> dict:
    """One cold start in this process: the phases' seconds."""
    import torch

    from areal_tik import qualify
    from areal_tik.engine import LLM, EngineConfig
    from areal_tik.engine.model_runner import warmup_shapes
    from areal_tik.model import UnifiedCausalLM, published_config, random_model
    from areal_tik.unified_kernels import warmup

    device = torch.device("cuda", torch.cuda.current_device())
    seconds = {}
    start = time.perf_counter()
    verdict = qualify.qualify(device, refresh=True, compile_workers=1 if mode == "serial" else None)
    seconds["qualify"] = time.perf_counter() - start
    model = UnifiedCausalLM.from_hf(random_model(published_config(MODELS[model_name]), device=device, seed=0),
                                    kernels="unified")
    start = time.perf_counter()
    counts = warmup(warmup_shapes(model, dtype=torch.bfloat16), max_rows=16384, device=device, training=True,
                    sampling=False)
    seconds["train_warmup"] = time.perf_counter() - start
    start = time.perf_counter()
    config = EngineConfig(max_num_seqs=128, max_model_len=1024, cuda_graphs=True, gpu_memory_utilization=0.4)
    with LLM(model, config) as llm:
        seconds["engine_start"] = time.perf_counter() - start
        engine_counts = llm.runner.warmup_counts
    return {"seconds": seconds, "passed": verdict.passed, "compile_seconds": verdict.compile_seconds,
            "train_launches": sum(counts.values()), "engine_launches": sum((engine_counts or {}).values())}


def run_case(model_name: str, mode: str, triton_cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=triton_cache, PYTHONUNBUFFERED="1")
    env["AREAL_TIK_QUALIFY_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="startup-qualify-"), "q.json")
    if mode == "serial":
        env["AREAL_TIK_COMPILE_THREADS"] = "8"
    else:
        env.pop("AREAL_TIK_COMPILE_THREADS", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "eval.bench_startup", "--child", model_name, mode],
                          env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    found = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode or not found:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"{model_name} {mode}: child failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(found[-1][len(_MARK):])
    result["process"] = wall
    return result


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=sorted(MODELS))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(_MARK + json.dumps(child(*args.child)), flush=True)
        return 0
    info = run_info()
    rows, lines = [], []
    for model_name in args.models:
        caches = {"serial": tempfile.mkdtemp(prefix="startup-triton-")}
        caches["threaded"] = caches["warm"] = tempfile.mkdtemp(prefix="startup-triton-")
        results = {}
        for mode in MODES:
            results[mode] = result = run_case(model_name, mode, caches[mode])
            sec = result["seconds"]
            print(f"{model_name} {mode:8}: qualify {sec['qualify']:6.1f} s (passed {result['passed']}, "
                  f"{result['compile_seconds']:.1f} s compiling ahead), train warm-up {sec['train_warmup']:5.1f} s "
                  f"({result['train_launches']} launches), engine start {sec['engine_start']:5.1f} s "
                  f"({result['engine_launches']} warm-up launches); process {result['process']:6.1f} s", flush=True)
            rows += [{**info, "model": model_name, "mode": mode, "phase": phase, "seconds": round(value, 3)}
                     for phase, value in (*sec.items(), ("sum", sum(sec.values())), ("process", result["process"]))]
        for cache in set(caches.values()):
            shutil.rmtree(cache, ignore_errors=True)
        serial, threaded = results["serial"], results["threaded"]
        ratio = lambda key: (serial["seconds"][key] / threaded["seconds"][key])  # noqa: E731
        lines.append(f"{model_name}: serial / threaded, qualify {ratio('qualify'):.2f}x, train warm-up "
                     f"{ratio('train_warmup'):.2f}x, engine start {ratio('engine_start'):.2f}x; three phases "
                     f"{sum(serial['seconds'].values()):.1f} -> {sum(threaded['seconds'].values()):.1f} s "
                     f"(warm Triton cache {sum(results['warm']['seconds'].values()):.1f} s); process "
                     f"{serial['process']:.1f} -> {threaded['process']:.1f} s")
    print_summary(lines, [write_csv(rows, args.out, "bench_startup.csv")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

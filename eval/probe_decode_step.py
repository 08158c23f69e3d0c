"""Probe: one decode step of the engine, kernel by kernel, on the unified and on the standard
(stock) kernels: where the stock engine's time goes. GPU only, about a minute.

Usage (GPU, repo root):
    python3 -m eval.probe_decode_step [--model qwen3-0.6b] [--batch 128] [--new 64] [--kernels unified]

The engine as ``eval.bench_rollout`` builds it for each kernel set (same random model,
128-token prompts, CUDA graphs at ``--batch``; the standard set over one KV block per
sequence, its FlashAttention decode), a warm-up generation, then a timed one in which the
fifth decode step runs under torch.profiler (``eval.probe_mixed.MixedSteps``, the engine's
own step path): host wall, the GPU's kernel count and busy time, and the top kernels by
total time. Kernels inside a CUDA-graph replay are listed one by one. Kernel counts per
step and the share of small kernels say whether the stock step is bound by the number of
kernels (norms, rope, the KV store and sampling as eager torch ops) or by their bytes.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from areal_tik.cli import RANDOM_INIT
from areal_tik.engine import LLM, SamplingParams
from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config
from areal_tik.model.ops import one_block_per_sequence
from eval.bench_rollout import PROMPT_LEN, engine_config, make_prompts
from eval.probe_mixed import MixedSteps, report_profile


def probe(hf_model, kernels: str, batch: int, new: int) -> None:
    model = UnifiedCausalLM.from_hf(hf_model, kernels=kernels)
    shapes = [(batch, new)]
    block = one_block_per_sequence(PROMPT_LEN + new) if kernels == "standard" else 64
    vocab = hf_model.config.vocab_size
    # serial steps: the profiled step is one ``runner.run`` (an overlapped step is not)
    with LLM(model, engine_config(shapes, block, overlap_steps=False)) as llm:
        print(f"{kernels}: decode attention {llm.runner.decode_attention}", flush=True)
        params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
        llm.generate(make_prompts(batch, vocab, 1), params)  # compiles, captures
        steps = MixedSteps(llm.runner, long_len=1 << 30, profile_start=-2)  # decode steps only
        t = time.perf_counter()
        llm.generate(make_prompts(batch, vocab), params)
        wall = time.perf_counter() - t
        walls = sorted(steps.decode_walls)
        print(f"  {kernels}: {batch} x {new} in {wall:.2f} s; decode step wall median "
              f"{walls[len(walls) // 2] * 1e3:.2f} ms over {len(walls)} steps", flush=True)
        label, prof, step_wall = steps.profiles.get("decode", ("no decode step profiled", None, 0.0))
        if prof is None:
            print(f"  {label}")
        else:
            report_profile(prof, step_wall, f"{kernels} {label}", top=20)
    llm = model = None
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(RANDOM_INIT))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--kernels", nargs="+", choices=("unified", "standard"), default=["unified", "standard"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_step needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):  # register kineto here
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    kind, key = RANDOM_INIT[args.model]
    hf_model = random_model(published_config(key) if kind == "published" else tiny_config(key), device="cuda", seed=0)
    for kernels in args.kernels:
        probe(hf_model, kernels, args.batch, args.new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

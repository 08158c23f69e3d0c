"""vLLM's side of eval/bench_vllm.py: one mode (default or VLLM_BATCH_INVARIANT=1) per process.

    python3 -m eval.vllm_generate SPEC.json RESULT.json
    python3 -m eval.vllm_generate --check     # imports what offline generation loads

Runs with vLLM's own site directory on PYTHONPATH (vLLM 0.26 needs transformers >= 5.5.3;
the project's AReaL site has 5.3), so it imports nothing of areal_tik: the prompts come in
the spec as token ids (``skip_tokenizer_init``: no tokenizer is needed), and the result is
plain JSON. The result file is rewritten after every shape, so a run stopped at its time
budget (or killed) still reports the shapes it finished; the shapes left out are named.

Spec: {"model_dir", "mode", "shapes": [[batch, new_tokens], ...], "prompts": [[ids], ...]
(at least max batch), "compare_shape": [batch, new_tokens], "budget_s", "seed"}.
Result: {"mode", "vllm_version", "startup_s", "warmup_s", "runs": [{"batch", "new_tokens",
"seconds"}], "skipped": [[batch, new]], "sample": {"batch", "new_tokens", "prompts",
"token_ids", "logprobs"}} or {"mode", "error"} when vLLM cannot start.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


# What LLM(...).generate of a dense bf16 model loads on an H200 (FLASH_ATTN = FA3, or
# TRITON_ATTN; the batch-invariant layer overrides): a missing wheel shows here, before a run.
RUNTIME_MODULES = (
    "vllm.vllm_flash_attn", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.sample.sampler",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
    "vllm.model_executor.models.qwen3", "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.layers.batch_invariant", "vllm.compilation.backends",
    "vllm.model_executor.warmup.kernel_warmup")


def check() -> int:
    import importlib

    import vllm

    failed = []
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # report every module, then fail
            failed.append(f"{name}: {type(error).__name__}: {error}")
    try:  # what the engine's sampler asks at build (imports flashinfer unless switched off)
        from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported
        print(f"FlashInfer sampler: {flashinfer_sampler_supported()} "
              f"(VLLM_USE_FLASHINFER_SAMPLER={os.environ.get('VLLM_USE_FLASHINFER_SAMPLER')})")
    except Exception as error:
        failed.append(f"flashinfer_sampler_supported: {type(error).__name__}: {error}")
    fa = sys.modules.get("vllm.vllm_flash_attn")
    print(f"vllm {vllm.__version__}: FA3 {getattr(fa, 'FA3_AVAILABLE', None)}, FA2 {getattr(fa, 'FA2_AVAILABLE', None)} "
          f"(not carried); {len(RUNTIME_MODULES) - len(failed)}/{len(RUNTIME_MODULES)} runtime modules import")
    print("\n".join(failed))
    return 1 if failed else 0


def write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def sampled_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token (logprobs=0: vLLM returns exactly that one entry
    per position, the raw log_softmax of the logits, which at T = 1 is the objective's)."""
    values = []
    for token, position in zip(completion.token_ids, completion.logprobs):
        entry = position[token]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def build(spec: dict):
    from vllm import LLM

    max_batch = max(b for b, _ in spec["shapes"])
    max_len = len(spec["prompts"][0]) + max(n for _, n in spec["shapes"])
    return LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=spec["seed"],
               max_model_len=max_len, max_num_seqs=max_batch, enable_prefix_caching=False,
               gpu_memory_utilization=0.85,
               # vLLM's own sampling defaults, not the checkpoint's generation_config.json
               # (a top_k/top_p there would become the default and change what is sampled)
               generation_config="vllm")


def generate(llm, prompts, new_tokens: int):
    """No per-request seed: seeded requests take vLLM's slower per-generator sampling path;
    the engine's seed (LLM(seed=...)) fixes the run instead."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=new_tokens, min_tokens=new_tokens,
                            ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def run(spec: dict, out: Path) -> None:
    import vllm

    result = {"mode": spec["mode"], "vllm_version": vllm.__version__, "runs": [], "skipped": []}
    start = time.perf_counter()
    llm = build(spec)  # weights, torch.compile, CUDA-graph capture: vLLM's start-up
    result["startup_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    for batch in sorted({b for b, _ in spec["shapes"]}):
        generate(llm, spec["prompts"][:batch], 4)
    result["warmup_s"] = round(time.perf_counter() - start, 3)
    write(out, result)
    begin = time.perf_counter()
    for batch, new in spec["shapes"]:
        if time.perf_counter() - begin > spec["budget_s"]:
            result["skipped"].append([batch, new])
            continue
        prompts = spec["prompts"][:batch]
        t0 = time.perf_counter()
        outputs = generate(llm, prompts, new)
        seconds = time.perf_counter() - t0
        result["runs"].append({"batch": batch, "new_tokens": new, "seconds": round(seconds, 4)})
        print(f"  vllm {spec['mode']:16s} batch {batch:3d} x {new} tokens: {seconds:.2f} s", flush=True)
        if [batch, new] == list(spec["compare_shape"]):
            result["sample"] = {"batch": batch, "new_tokens": new, "prompts": prompts,
                                "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                                "logprobs": [sampled_logprobs(o.outputs[0]) for o in outputs]}
        write(out, result)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        return check()
    if len(argv) != 2:
        raise SystemExit("usage: python3 -m eval.vllm_generate SPEC.json RESULT.json | --check")
    spec, out = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    if spec["mode"] == "batch_invariant" and os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise SystemExit("mode batch_invariant needs VLLM_BATCH_INVARIANT=1 in the environment")
    try:
        run(spec, out)
    except ImportError as error:  # vLLM (or one of its imports) is not installed here
        write(out, {"mode": spec["mode"], "error": f"{type(error).__name__}: {error}"})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

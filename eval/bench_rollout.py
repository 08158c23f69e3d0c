"""Benchmark: rollout tokens/s of the engine (unified vs standard ops) vs Hugging Face generate.

Usage (GPU, repo root):
    python3 -m eval.bench_rollout [--quick] [--model qwen3-0.6b] [--out DIR_OR_CSV]

One random-initialised model with a published config (weights shared by all three
backends, same prompts): the areal-tik engine on the unified Triton kernels, the same
engine on the standard torch ops (cuBLAS, eager norms; decode attention on FlashAttention 2
over each sequence's one KV block, reading its used rows, else gather + SDPA), and transformers'
``generate``. Sampling at T = 1.0 over the full vocabulary, a fixed number of new
tokens (EOS ignored), batch 1 / 16 / 64 x 256 / 512 new tokens (``--quick``: batch 1
and 64 x 256). Each backend is warmed up at every batch size before timing (Triton
compiles and CUDA-graph captures happen outside the timed runs).

``--backends ... unified-eager-sampler`` adds the unified engine with decode graphs that end
at the hidden states (``graph_sample_temperature=None``: the LM head, the Gumbel draw and
the log-prob launched eagerly every step, as before the sampling graphs): what putting the
sampler into the graph saves per step.

``--backends ... unified-serial`` adds the unified engine without overlapped decode steps
(``overlap_steps=False``), ``unified-nopdl`` the unified engine with programmatic dependent
launch off (``unified_kernels/_pdl.py``), ``unified-prefetch`` with PDL and the small-row
linears' L2 weight prefetch (off by default), ``unified-unfused-qk`` with the q/k norms, rope and
K/V store as separate launches (``unified_kernels/qk_rope.py``), ``unified-k64`` with the decode
linears' wide-K entries off (BLOCK_K 64 in every launch; the same bits): what each changes, side
by side in one run.

``--backends ... compiled`` adds the standard set with its elementwise ops (RMSNorm,
residual add + RMSNorm, rope, SiLU-mul) under ``torch.compile``, as vLLM compiles its model
(``areal_tik.model.ops.compiled_standard_ops``; the recipes' stock engine runs it): how much of
the standard engine's gap is its elementwise launches.

Reported per run: seconds, tokens/s, and in hardware terms the decode weight stream
(bytes of the weights read per step x steps / time, as TB/s and as a fraction of the
measured 4.26 TB/s device copy); ratios unified/standard and engine/HF per shape. For the
unified engine, a step (the run's seconds / new tokens) beside the bytes it must read: the
weights once and every layer's K/V at the step's context, averaged over the run; as TB/s and
as a multiple of the time those bytes take at the device's ceiling (``CEILINGS_TBPS``: the
H200's measured copy, an H100's nominal bandwidth), the figure issue 12's decode targets
(2x at batch 64, 3x at batch 1) are stated in.
Targets: unified >= 0.9x standard; engine >= 3x HF generate at batch 64.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import random
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
from eval.harness import run_info, write_csv  # noqa: E402

from areal_tik.cli import RANDOM_INIT  # noqa: E402
from areal_tik.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from areal_tik.engine.gpu_clock import GpuClock  # noqa: E402
from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config  # noqa: E402
from areal_tik.model.ops import compiled_standard_ops, one_block_per_sequence  # noqa: E402
from areal_tik.unified_kernels import _pdl  # noqa: E402

_qk_rope = importlib.import_module("areal_tik.unified_kernels.qk_rope")
_linear = importlib.import_module("areal_tik.unified_kernels.linear")

PEAK_TBPS = 4.26  # measured device copy (read + write) on the H200
PROMPT_LEN = 128
FULL = dict(batches=(1, 16, 64), new_tokens=(256, 512))
QUICK = dict(batches=(1, 64), new_tokens=(256,))
# The unified engine with one thing changed, each timed beside "unified" in the same run:
# EngineConfig fields, PDL off, the linears' L2 weight prefetch on (unified_kernels/_pdl.py), the
# q/k norms, rope and K/V store as separate launches (unified_kernels/qk_rope.py), the decode
# linears without their wide-K entries (BLOCK_K 64 everywhere; unified_kernels/linear.py).
UNIFIED_VARIANTS = {
    "unified-eager-sampler": dict(options={"graph_sample_temperature": None}),
    "unified-serial": dict(options={"overlap_steps": False}),
    "unified-nopdl": dict(pdl=False),
    "unified-prefetch": dict(prefetch=True),
    "unified-unfused-qk": dict(fused_qk=False),
    "unified-k64": dict(wide_k=False),
}
BACKENDS = ("unified", "standard", "hf", "compiled", *UNIFIED_VARIANTS)
DEFAULT_BACKENDS = ("unified", "standard", "hf")


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]


# ------------------------------------------------------------------ backends


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def engine_config(shapes, block: int = 64, **options) -> EngineConfig:
    """The engine sized for ``shapes`` ((batch, new_tokens) pairs after PROMPT_LEN-token prompts),
    over ``block``-token KV blocks; ``options``: further EngineConfig fields."""
    max_bs = max(b for b, _ in shapes)
    max_len = PROMPT_LEN + max(n for _, n in shapes)
    # Every request of a run finishes together, so decode batches are exactly the benchmark
    # batch sizes: capturing only those saves the other buckets' capture time.
    return EngineConfig(max_num_seqs=max_bs, max_model_len=max_len, kv_block_size=block,
                        num_kv_blocks=max_bs * -(-max_len // block) + 1, cuda_graphs=True,
                        cuda_graph_sizes=tuple(sorted({b for b, _ in shapes})), seed=0, **options)


def bench_engine(hf_model, kernels: str, shapes, vocab: int) -> dict:
    """{(batch, new_tokens): seconds} for the engine on ``kernels`` ops ("compiled": the
    standard set with its elementwise ops compiled)."""
    variant = UNIFIED_VARIANTS.get(kernels)
    ops = "unified" if variant is not None else compiled_standard_ops() if kernels == "compiled" else kernels
    variant = variant or {}
    model = UnifiedCausalLM.from_hf(hf_model, kernels=ops)
    # the standard set as the recipes' stock mode runs it: one KV block per sequence, where its
    # decode calls FlashAttention over each sequence's rows (the engine prints the path it took)
    block = one_block_per_sequence(PROMPT_LEN + max(n for _, n in shapes)) if model.kernels == "standard" else 64
    # PDL and the prefetch hold for the whole backend: its graphs' capture and its eager prefills
    with _pdl.enabled(_pdl.ENABLED and variant.get("pdl", True), _pdl.PREFETCH or variant.get("prefetch", False)), \
            _qk_rope.enabled(_qk_rope.ENABLED and variant.get("fused_qk", True)), \
            _linear.wide_k(_linear.WIDE_K and variant.get("wide_k", True)), \
            LLM(model, engine_config(shapes, block, **variant.get("options", {}))) as llm:
        print(f"  {kernels:8} decode attention: {llm.runner.decode_attention}", flush=True)
        times = _time_engine(llm, kernels, shapes, vocab)
    llm = model = None  # free the KV cache and CUDA graphs before the next backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times


def _time_engine(llm, kernels: str, shapes, vocab: int) -> dict:
    # warm-up, twice at every batch size: Triton compiles for every prefill shape, and
    # torch.compile's second call specialises once more (tensors made under inference mode)
    for seed in (1, 2):
        for batch in sorted({b for b, _ in shapes}):
            llm.generate(make_prompts(batch, vocab, seed), SamplingParams(max_new_tokens=4, ignore_eos=True))
    graphs = _compiled_graphs()
    times = {}
    for batch, new in shapes:
        prompts = make_prompts(batch, vocab)
        params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
        steps, host = llm.num_steps, dict(llm.step_seconds)
        decode_steps, decode_host = llm.decode_step_seconds
        decode_host = dict(decode_host)
        clock = llm.runner.gpu_clock = GpuClock() if torch.cuda.is_available() else None
        times[(batch, new)] = _timed(lambda: llm.generate(prompts, params))
        llm.runner.gpu_clock = None
        print(f"  {kernels:8s} batch {batch:3d} x {new} tokens: {times[(batch, new)]:.2f} s", flush=True)
        print(f"  {kernels:8s}   {host_phases(llm, steps, host, times[(batch, new)])}", flush=True)
        print(f"  {kernels:8s}   {decode_phases(llm, decode_steps, decode_host)}", flush=True)
        if clock is not None:
            print(f"  {kernels:8s}   {gpu_clock_line(clock)}", flush=True)
    if kernels == "compiled":  # a compilation inside the timed runs is in their seconds: say so
        print(f"  compiled: {_compiled_graphs() - graphs} torch.compile graphs built in the timed runs", flush=True)
    return times


def _per_step(steps: int, now: dict, before: dict) -> tuple[str, float, float]:
    """("ms a step: <phase> <ms>, ...", ms not waiting, ms waiting) over ``steps`` steps."""
    per = {k: (v - before[k]) / steps * 1e3 for k, v in now.items()}
    rest = sum(v for k, v in per.items() if k != "wait")
    return "ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()), rest, per["wait"]


def host_phases(llm, steps_before: int, seconds_before: dict, wall: float) -> str:
    """The engine thread's host time per step over one timed run, by phase (the step loop's
    ``step_seconds``: schedule, launch = inputs staged and the step enqueued, wait = until
    sampled tokens are on the host, postprocess), beside the run's wall time per step. A
    serial step waits for its own tokens; with overlapped steps (``overlap_steps``) a decode
    step's wait and postprocess are the previous step's, done while this one runs, so the
    GPU's own idle time between steps is ``GpuClock``'s, not what is not wait here."""
    steps = llm.num_steps - steps_before
    if not steps:
        return "host phases: no steps"
    phases, rest, _ = _per_step(steps, llm.step_seconds, seconds_before)
    return f"host phases over {steps} steps, {phases}; not waiting {rest:.3f}; wall {wall / steps * 1e3:.3f}"


def decode_phases(llm, steps_before: int, seconds_before: dict) -> str:
    """``host_phases`` over the decode-only steps of the run (the prefill step's eager
    launches left out)."""
    total, seconds = llm.decode_step_seconds
    steps = total - steps_before
    if not steps:
        return "decode steps: none"
    phases, rest, wait = _per_step(steps, seconds, seconds_before)
    return f"decode steps only ({steps}), {phases}; not waiting {rest:.3f}; sum {rest + wait:.3f}"


def gpu_clock_line(clock) -> str:
    """``GpuClock``'s figures: the GPU span of a decode step and the idle gap between two."""
    c = clock.summary()
    return (f"GPU clock over {c['steps']} decode steps: span {c['span_ms']:.3f} ms a step (staged inputs "
            f"to results on the host), idle {c['idle_ms']:.3f} ms between consecutive ones "
            f"({c['gaps']} gaps: host time beyond the GPU's)")


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def bench_hf(hf_model, shapes, vocab: int) -> dict:
    """{(batch, new_tokens): seconds} for transformers' ``generate`` (sampling, T = 1, no top-k)."""
    def run(batch, new, seed):
        ids = torch.tensor(make_prompts(batch, vocab, seed), device=hf_model.device)
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                          top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    times = {}
    with torch.inference_mode():
        for batch in sorted({b for b, _ in shapes}):
            run(batch, 4, 1)
        for batch, new in shapes:
            times[(batch, new)] = _timed(lambda: run(batch, new, 0))
            print(f"  hf       batch {batch:3d} x {new} tokens: {times[(batch, new)]:.2f} s", flush=True)
    return times


# ------------------------------------------------------------------ report


def weight_bytes(hf_model) -> int:
    """Bytes of distinct parameters: what each decode step streams at least once."""
    seen, total = set(), 0
    for p in hf_model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# What a step's bytes are measured against, by device name: the H200's measured device copy;
# an H100's nominal HBM3 bandwidth (no copy ceiling of that card is recorded in eval/results).
CEILINGS_TBPS = (("H200", 4.26, "H200 measured copy"), ("H100", 3.35, "H100 nominal HBM3"))


def ceiling_for(device_name: str) -> tuple[float, str] | None:
    for key, tbps, what in CEILINGS_TBPS:
        if key in device_name:
            return tbps, what
    return None


def kv_bytes_per_step(config, batch: int, new: int) -> float:
    """Mean K/V bytes a step of the run reads: every layer's K and V (bf16) at the context the
    step sees, PROMPT_LEN + i at the step that draws token i + 1 (i = 0 .. new - 1; the first,
    the prefill's, reads what it writes), averaged: PROMPT_LEN + (new - 1) / 2 positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    return batch * per_position * (PROMPT_LEN + (new - 1) / 2)


def bound_ratio(step_s: float, nbytes: float, tbps: float) -> float:
    """A step's time over the time its bytes take at ``tbps``."""
    return step_s / (nbytes / (tbps * 1e12))


def bound_line(batch: int, new: int, seconds: float, wbytes: int, kv: float, device_name: str) -> str:
    """A step's time beside the bytes it must read (weights once + the K/V at its context)."""
    step = seconds / new
    total = wbytes + kv
    line = (f"batch {batch:3d} x {new}: {step * 1e3:.3f} ms a step for {total / 1e9:.2f} GB "
            f"({wbytes / 1e9:.2f} weights + {kv / 1e9:.2f} K/V), {total / step / 1e12:.2f} TB/s")
    ceiling = ceiling_for(device_name)
    if ceiling is not None:
        tbps, what = ceiling
        line += f"; {bound_ratio(step, total, tbps):.2f}x the bytes bound at {tbps} TB/s ({what})"
    return line


def rows_for(model_name, backend, batch, new, seconds, wbytes, info) -> list[dict]:
    tokens = batch * new
    tbps = wbytes * new / seconds / 1e12
    base = dict(info, model=model_name, backend=backend, batch=batch, prompt_len=PROMPT_LEN, new_tokens=new)
    return [dict(base, metric="seconds", value=round(seconds, 4), unit="s"),
            dict(base, metric="tokens_per_s", value=round(tokens / seconds, 1), unit="tokens/s"),
            dict(base, metric="weight_stream", value=round(tbps, 4), unit="TB/s"),
            dict(base, metric="weight_stream_fraction", value=round(tbps / PEAK_TBPS, 4), unit="of 4.26 TB/s")]


def ratio_rows(model_name, results, info) -> list[dict]:
    rows = []
    for shape in results["unified"]:
        batch, new = shape
        base = dict(info, model=model_name, batch=batch, prompt_len=PROMPT_LEN, new_tokens=new, unit="x")
        pairs = (("unified/standard", "standard", "unified"), ("unified/hf", "hf", "unified"),
                 ("standard/hf", "hf", "standard"), ("unified/compiled", "compiled", "unified"),
                 ("compiled/standard", "standard", "compiled"),
                 *((f"unified/{v}", v, "unified") for v in UNIFIED_VARIANTS))
        for name, slow, fast in pairs:
            if slow in results and fast in results:
                rows.append(dict(base, backend=name, metric="speedup",
                                 value=round(results[slow][shape] / results[fast][shape], 3)))
    return rows


def summarize(results) -> None:
    # uni/<backend>: the backend's seconds over the unified engine's (> 1: unified is faster)
    others = ("standard", "hf", "compiled", *UNIFIED_VARIANTS)
    labels = ["uni/" + b.removeprefix("unified-").replace("standard", "std").replace("compiled", "comp")
              for b in others]
    widths = [max(8, len(label)) for label in labels]
    print(f"{'batch':>5} {'new':>4} " + " ".join(f"{b + ' tok/s':>16}" for b in results)
          + " " + " ".join(f"{label:>{w}}" for label, w in zip(labels, widths)))
    for shape in results["unified"]:
        batch, new = shape
        rates = " ".join(f"{batch * new / results[b][shape]:16.0f}" for b in results)
        uni = results["unified"][shape]
        ratios = " ".join(f"{results[b][shape] / uni:{w}.2f}" if shape in results.get(b, {}) else f"{'-':>{w}}"
                          for b, w in zip(others, widths))
        print(f"{batch:5d} {new:4d} {rates} {ratios}")




def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(RANDOM_INIT))
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64 x 256 tokens (< 90 s)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS),
                        help="compiled: the standard set with its elementwise ops under torch.compile")
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--device", default="cuda", help="cpu only smoke-tests the plumbing (tiny models)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="BATCHxNEW",
                        help="override the shapes, e.g. 2x8 4x8")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_rollout needs a CUDA GPU (or --device cpu for a plumbing smoke test)")
    if "unified" not in args.backends:
        raise SystemExit("--backends must include unified (the ratios are relative to it)")
    start = time.time()
    sizes = QUICK if args.quick else FULL
    shapes = [(b, n) for n in sizes["new_tokens"] for b in sizes["batches"]]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    kind, key = RANDOM_INIT[args.model]
    config = published_config(key) if kind == "published" else tiny_config(key)
    hf_model = random_model(config, device=args.device, seed=0)
    vocab = hf_model.config.vocab_size
    info = run_info(args.device)
    print(f"{args.model} on {info['device']} ({info['commit']}); prompts of {PROMPT_LEN} tokens", flush=True)
    results = {}
    for backend in args.backends:
        if backend == "hf":
            results["hf"] = bench_hf(hf_model, shapes, vocab)
        else:
            results[backend] = bench_engine(hf_model, backend, shapes, vocab)
    wbytes = weight_bytes(hf_model)
    rows = [r for b, times in results.items() for (batch, new), s in times.items()
            for r in rows_for(args.model, b, batch, new, s, wbytes, info)]
    rows += ratio_rows(args.model, results, info)
    summarize(results)
    print("unified, a step against the bytes it reads (a step = the run's seconds / new tokens):")
    for (batch, new), seconds in results["unified"].items():
        kv = kv_bytes_per_step(hf_model.config, batch, new)
        print("  " + bound_line(batch, new, seconds, wbytes, kv, info["device"]), flush=True)
        ceiling = ceiling_for(info["device"])
        if ceiling is not None:
            rows.append(dict(info, model=args.model, backend="unified", batch=batch, prompt_len=PROMPT_LEN,
                             new_tokens=new, metric="bytes_bound_ratio",
                             value=round(bound_ratio(seconds / new, wbytes + kv, ceiling[0]), 3),
                             unit=f"x ({ceiling[1]}, {ceiling[0]} TB/s)"))
    print(f"wrote {write_csv(rows, args.out, 'bench_rollout.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

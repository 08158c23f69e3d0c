"""Benchmark: prefix caching and chunked prefill in the engine, with bitwise checks.

Usage (GPU, repo root):
    python3 -m eval.bench_prefix [--model qwen3-0.6b] [--out DIR_OR_CSV]
    python3 -m eval.bench_prefix --device cpu   # plumbing smoke test: tiny model, tiny sizes

1. GRPO, prompt-heavy: ``--groups`` prompts x n = ``--samples`` samples of
   ``--prompt-len`` tokens (defaults 8 x 8 x 2048), ``--new-tokens`` (256) answer tokens at
   T = 1.0, each group submitted together; rollout seconds in three modes: without the
   cache ("nocache"), with it ("cache"), and with it plus chunked prefill ("cache+chunked")
   (target: cache >= 1.3x faster). Tokens and log-prob bits must be identical across the
   three modes and to the packed training forward.

   Protocol, fixed before any number was taken: each mode gets a fresh engine (its
   construction, which compiles the kernels at start, is timed as "start"). The engine
   then runs the mode's workload twice, both timed: "first" on prompts of the same shape
   but other tokens (so none of its blocks are cache hits for the next run), which
   includes whatever compilation the start left; then "warm", the measured run, on the
   benchmark's prompts, compilation outside it. Printed per mode: start, first and warm
   seconds; and the time ratio mode / nocache for the warm runs beside that of the whole
   run (start + first + warm), so a compilation-only difference is visible as such. Only
   the warm run's outputs are compared bit for bit.
2. KV memory: peak KV blocks in use in runs 1 (without / with the cache), given as the
   extra sequences of this shape that the saved blocks would hold.
3. Latency: ``--decoders`` sequences decoding (512-token prompts) when a ``--long-len``
   (16K) prompt arrives; the longest gap between two decode steps (the inter-token latency
   every decoding sequence sees) with chunked prefill off vs on (``--chunk`` tokens/step).

Random-initialised published config (no hub access); unified kernels, CUDA graphs.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

if "--device=cpu" in sys.argv or any(a == "--device" and b == "cpu" for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
from eval.harness import run_info, write_csv  # noqa: E402

from areal_tik.cli import RANDOM_INIT  # noqa: E402
from areal_tik import consistency  # noqa: E402
from areal_tik.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config  # noqa: E402

GPU_SIZES = dict(groups=8, samples=8, prompt_len=2048, new_tokens=256, decoders=32, long_len=16384,
                 chunk=2048, block=64)
CPU_SIZES = dict(groups=2, samples=2, prompt_len=40, new_tokens=3, decoders=2, long_len=70,
                 chunk=16, block=16)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepLog:
    """Wall-clock end of every engine step and whether it decoded, plus the peak KV blocks
    in use: the runner's ``run`` wrapped in place (the engine's own code path)."""

    def __init__(self, llm: LLM):
        self.ends: list[tuple[float, bool]] = []
        self.peak_blocks = 0
        runner, blocks = llm.runner, llm.runner.block_manager
        run = runner.run

        def timed(seqs, *args, **kwargs):
            in_use = blocks.num_usable_blocks - blocks.num_free_blocks
            self.peak_blocks = max(self.peak_blocks, in_use)
            out = run(seqs, *args, **kwargs)
            decoded = any(s.num_scheduled_tokens == 1 and s.num_computed_tokens + 1 == s.num_tokens
                          for s in seqs)
            self.ends.append((time.perf_counter(), decoded))
            return out
        runner.run = timed

    def longest_decode_gap(self, since: float) -> float:
        ends = [t for t, decoded in self.ends if decoded and t >= since]
        return max((b - a for a, b in zip(ends, ends[1:])), default=0.0)


def grpo_prompts(sizes, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(sizes["groups"]):
        prompt = [rng.randrange(8, vocab) for _ in range(sizes["prompt_len"])]
        prompts += [prompt] * sizes["samples"]
    return prompts


def engine_config(sizes, max_len: int, max_seqs: int, **extra) -> EngineConfig:
    block = sizes["block"]
    blocks = max_seqs * -(-max_len // block) + 1
    return EngineConfig(max_num_seqs=max_seqs, max_model_len=max_len, kv_block_size=block,
                        num_kv_blocks=extra.pop("num_kv_blocks", blocks),
                        max_num_batched_tokens=max(max_len, 16384), **extra)


def _rollout(llm, sizes, prompts, seed: int) -> tuple[float, list]:
    """(seconds, outputs) of every group of ``prompts``, each group submitted together."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=sizes["new_tokens"], ignore_eos=True, seed=seed + i)
              for i in range(len(prompts))]
    _sync()
    start = time.perf_counter()
    futures = []
    for g in range(0, len(prompts), sizes["samples"]):
        futures += [llm.submit(p, sp) for p, sp in zip(prompts[g:g + sizes["samples"]],
                                                     params[g:g + sizes["samples"]])]
    outputs = [f.result() for f in futures]
    return time.perf_counter() - start, outputs


def grpo_run(model, sizes, prompts, vocab, **extra) -> dict:
    """One mode under the protocol of the module docstring: start, first and warm seconds,
    the warm run's outputs, its peak KV blocks and its prefix-cache hit tokens."""
    max_len = sizes["prompt_len"] + sizes["new_tokens"]
    _sync()
    start = time.perf_counter()
    with LLM(model, engine_config(sizes, max_len, len(prompts), **extra)) as llm:
        _sync()
        started = time.perf_counter() - start
        first, _ = _rollout(llm, sizes, grpo_prompts(sizes, vocab, seed=99), seed=5000)
        hits_before = llm.prefix_cache_stats["hit_tokens"]
        log = StepLog(llm)
        warm, outputs = _rollout(llm, sizes, prompts, seed=1000)
        hit_tokens = llm.prefix_cache_stats["hit_tokens"] - hits_before
    return dict(start=started, first=first, warm=warm, whole=started + first + warm, outputs=outputs,
                peak=log.peak_blocks, hit_tokens=hit_tokens)


def time_ratios(results: dict, base: str = "nocache") -> dict[str, dict[str, float]]:
    """Per mode other than ``base``: time mode / time base, warm run and whole run."""
    return {label: {"warm": r["warm"] / results[base]["warm"], "whole": r["whole"] / results[base]["whole"]}
            for label, r in results.items() if label != base}


def same_bits(a, b) -> bool:
    return all(x.token_ids == y.token_ids and torch.equal(torch.tensor(x.logprobs).view(torch.int32),
                                                          torch.tensor(y.logprobs).view(torch.int32))
               for x, y in zip(a, b, strict=True))


def bench_grpo(model, sizes, vocab, info, name) -> tuple[list[dict], bool]:
    prompts = grpo_prompts(sizes, vocab)
    runs = {"nocache": {}, "cache": dict(enable_prefix_caching=True),
            "cache+chunked": dict(enable_prefix_caching=True, prefill_chunk_tokens=sizes["chunk"])}
    results = {}
    for label, extra in runs.items():
        r = results[label] = grpo_run(model, sizes, prompts, vocab, **extra)
        print(f"  grpo {label:14s} start {r['start']:6.2f} s  first {r['first']:7.2f} s  warm {r['warm']:7.2f} s  "
              f"peak KV blocks {r['peak']:6d}  hit tokens {r['hit_tokens']}", flush=True)
    for label, ratio in time_ratios(results).items():
        print(f"  grpo {label:14s} time / nocache: warm {ratio['warm']:.3f}, whole run {ratio['whole']:.3f}",
              flush=True)
    base_out = results["nocache"]["outputs"]
    ok = all(same_bits(results[k]["outputs"], base_out) for k in ("cache", "cache+chunked"))
    check = consistency.compare(base_out, consistency.packed_logprobs(model, base_out, max_tokens_per_batch=16384))
    ok = ok and check.num_identical == check.num_tokens
    print(f"  bitwise: nocache == cache == cache+chunked: {ok}; vs training forward "
          f"{check.num_identical}/{check.num_tokens}", flush=True)
    base = dict(info, model=name, groups=sizes["groups"], samples=sizes["samples"],
                prompt_len=sizes["prompt_len"], new_tokens=sizes["new_tokens"])
    rows = [dict(base, run=k, metric=f"{phase}_seconds", value=round(v[phase], 4), unit="s")
            for k, v in results.items() for phase in ("start", "first", "warm", "whole")]
    rows += [dict(base, run=k, metric=f"{phase}_time_vs_nocache", value=round(v[phase], 3), unit="ratio")
             for k, v in time_ratios(results).items() for phase in ("warm", "whole")]
    per_seq = -(-(sizes["prompt_len"] + sizes["new_tokens"]) // sizes["block"])
    saved = results["nocache"]["peak"] - results["cache"]["peak"]
    rows += [dict(base, run=k, metric="peak_kv_blocks", value=v["peak"], unit="blocks") for k, v in results.items()]
    rows.append(dict(base, run="cache", metric="extra_sequences_that_fit", value=round(saved / per_seq, 1),
                     unit=f"sequences of {per_seq} blocks"))
    rows.append(dict(base, run="cache", metric="prefill_tokens_saved", value=results["cache"]["hit_tokens"],
                     unit="tokens"))
    rows.append(dict(base, run="all", metric="bitwise_identical", value=int(ok), unit="bool"))
    print(f"  KV: {saved} blocks saved = {saved / per_seq:.1f} extra sequences of {per_seq} blocks", flush=True)
    return rows, ok


def latency_run(model, sizes, vocab, chunk):
    """(longest decode gap after a long prompt arrives among ``decoders`` decoding
    sequences, median gap before it), seconds."""
    rng = random.Random(3)
    n, short, answer = sizes["decoders"], min(512, sizes["prompt_len"]), 2 * sizes["new_tokens"]
    max_len = sizes["long_len"] + sizes["block"]
    blocks = n * -(-(short + answer) // sizes["block"]) + -(-max_len // sizes["block"]) + 2
    extra = dict(prefill_chunk_tokens=chunk) if chunk else {}
    with LLM(model, engine_config(sizes, max_len, n + 1, num_kv_blocks=blocks, **extra)) as llm:
        long_prompt = [rng.randrange(8, vocab) for _ in range(sizes["long_len"])]
        llm.generate([long_prompt[:-1]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # compile
        log = StepLog(llm)
        params = SamplingParams(temperature=1.0, max_new_tokens=answer, ignore_eos=True)
        steps = llm.num_steps
        futures = [llm.submit([rng.randrange(8, vocab) for _ in range(short)], params) for _ in range(n)]
        deadline = time.monotonic() + 120
        while llm.num_steps < steps + min(8, sizes["new_tokens"]) and time.monotonic() < deadline:
            time.sleep(0.001)  # the batch is decoding
        arrival = time.perf_counter()
        llm.submit(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        for f in futures:
            f.result()
    before = [t for t, decoded in log.ends if decoded and t < arrival]
    gaps = sorted(b - a for a, b in zip(before, before[1:]))
    return log.longest_decode_gap(arrival), (gaps[len(gaps) // 2] if gaps else 0.0)


def bench_latency(model, sizes, vocab, info, name) -> list[dict]:
    rows = []
    base = dict(info, model=name, decoders=sizes["decoders"], long_len=sizes["long_len"])
    for label, chunk in (("chunked_off", None), ("chunked_on", sizes["chunk"])):
        gap, steady = latency_run(model, sizes, vocab, chunk)
        print(f"  latency {label:11s} longest decode gap {gap * 1e3:8.1f} ms (median before the "
              f"prompt {steady * 1e3:.1f} ms)", flush=True)
        rows += [dict(base, run=label, chunk=chunk or 0, metric="longest_decode_gap", value=round(gap * 1e3, 3),
                      unit="ms"),
                 dict(base, run=label, chunk=chunk or 0, metric="median_decode_gap_before", unit="ms",
                      value=round(steady * 1e3, 3))]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, choices=list(RANDOM_INIT),
                        help="default qwen3-0.6b (GPU) / tiny-qwen3 (CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--skip-latency", action="store_true")
    for key, value in GPU_SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"GPU default {value}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_prefix needs a CUDA GPU (or --device cpu for a plumbing smoke test)")
    sizes = dict(GPU_SIZES if args.device == "cuda" else CPU_SIZES)
    sizes.update({k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
    name = args.model or ("qwen3-0.6b" if args.device == "cuda" else "tiny-qwen3")
    kind, key = RANDOM_INIT[name]
    config = published_config(key) if kind == "published" else tiny_config(key)
    start = time.time()
    hf = random_model(config, device=args.device, seed=0)
    model = UnifiedCausalLM.from_hf(hf, kernels="unified")
    vocab = hf.config.vocab_size
    info = run_info(args.device)
    print(f"{name} on {info['device']} ({info['commit']}); sizes {sizes}", flush=True)
    rows, ok = bench_grpo(model, sizes, vocab, info, name)
    if not args.skip_latency:
        rows += bench_latency(model, sizes, vocab, info, name)
    print(f"wrote {write_csv(rows, args.out, 'bench_prefix.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

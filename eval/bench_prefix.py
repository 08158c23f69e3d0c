"""Benchmark: prefix caching and chunked prefill in the engine, with bitwise checks.

Usage (GPU, repo root):
    python3 -m eval.bench_prefix [--model qwen3-0.6b] [--out DIR_OR_CSV]
    python3 -m eval.bench_prefix --device cpu   # plumbing smoke test: tiny model, tiny sizes

1. GRPO, prompt-heavy: ``--groups`` prompts x n = ``--samples`` samples of
   ``--prompt-len`` tokens (defaults 8 x 8 x 2048), ``--new-tokens`` (256) answer tokens at
   T = 1.0, each group submitted together; rollout seconds in three modes: without the
   cache ("nocache"), with it ("cache"), and with it plus chunked prefill ("cache+chunked")
   (target: cache >= 1.3x faster on the warm run). Tokens and log-prob bits must be
   identical across the three modes and to the packed training forward.

   Protocol, fixed before any number was taken: each mode gets a fresh engine (its
   construction, which compiles the kernels at start, is timed as "start"). The engine
   then runs the mode's workload twice, both timed: "first" on prompts of the same shape
   but other tokens (so none of its blocks are cache hits for the next run), which
   includes whatever compilation the start left; then "warm", the measured run, on the
   benchmark's prompts, compilation outside it. Printed per mode, side by side: start,
   first, warm and whole (start + first + warm) seconds, and the speed-up nocache / mode
   of the warm run beside that of the whole run, so a compilation-only difference is
   visible as such. Only the warm run's outputs are compared bit for bit.
2. The recipes' own settings, same protocol and modes: ``RECIPE_SETTINGS`` (groups x n
   samples: 32 x 4 as every GPU recipe, and 8 x 16, the top of GRPO's usual n) with prompt
   lengths drawn from ``RECIPE_PROMPT_TOKENS``, the lengths of the reasoning-gym tasks the
   recipes train on (chat template included), and ``RECIPE_NEW_TOKENS`` answer tokens.
   Only full KV blocks are shared, so prompts under one block gain nothing: measured as is.
3. KV memory: peak KV blocks in use in the warm runs of 1 (without / with the cache),
   given as the extra sequences of this shape that the saved blocks would hold.
4. Latency: ``--decoders`` sequences decoding (512-token prompts) when a ``--long-len``
   (16K) prompt arrives, chunked prefill off vs on (``--chunk`` tokens/step). The
   prompt arrives once the batch has run ``DECODE_STEPS_BEFORE`` decode-only steps (with
   chunks on, the decoders' own prompts take several mixed steps first). Reported: the
   longest gap between two steps with decode rows after it arrives (the inter-token
   latency every decoding sequence sees); the median gap between two decode-only steps
   before it (a plain decode step: the same in both modes if chunking leaves decode
   alone); the median wall time of a mixed step (a chunk plus the decode rows); and the
   fraction of decode-only steps that replayed a CUDA graph (1 on a GPU in both modes).

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
from areal_tik.engine.sequence import split_step, step_kind  # noqa: E402
from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config  # noqa: E402

GPU_SIZES = dict(groups=8, samples=8, prompt_len=2048, new_tokens=256, decoders=32, long_len=16384,
                 chunk=2048, block=64)
CPU_SIZES = dict(groups=2, samples=2, prompt_len=40, new_tokens=3, decoders=2, long_len=70,
                 chunk=16, block=16)
# Prompt tokens (min, max) of the recipes' reasoning-gym tasks with their recipe options,
# SmolLM2's tokenizer and chat template (the recipes' tokenizer), 200 items each:
# basic_arithmetic 43-57, chain_sum 52-62 (52-82 with default options),
# fraction_simplification 62-70, simple_equations 49-66, gsm_symbolic 75-191.
RECIPE_PROMPT_TOKENS = ((43, 57), (52, 82), (62, 70), (49, 66), (75, 191))
RECIPE_SETTINGS = {"cuda": ((32, 4), (8, 16)), "cpu": ((1, 2),)}  # (groups, n samples)
RECIPE_NEW_TOKENS = {"cuda": 512, "cpu": 2}  # the recipes' median max_new_tokens (128 to 1024)
DECODE_STEPS_BEFORE = 16


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepLog:
    """Per engine step: wall-clock start and end, kind ("prefill", "mixed" or "decode", as
    ``ModelRunner.step_counts`` counts them) and whether a CUDA graph was replayed; plus the
    peak KV blocks in use. The runner's ``run`` wrapped in place (the engine's own code path)."""

    def __init__(self, llm: LLM):
        self.steps: list[tuple[float, float, str, bool]] = []
        self.peak_blocks = 0
        runner, blocks = llm.runner, llm.runner.block_manager
        run = runner.run

        def timed(seqs, *args, **kwargs):
            in_use = blocks.num_usable_blocks - blocks.num_free_blocks
            self.peak_blocks = max(self.peak_blocks, in_use)
            kind = step_kind(*split_step(seqs))
            replays, start = runner.graph_replays, time.perf_counter()
            out = run(seqs, *args, **kwargs)
            self.steps.append((start, time.perf_counter(), kind, runner.graph_replays > replays))
            return out
        runner.run = timed

    def longest_decode_gap(self, since: float) -> float:
        """Longest time between the ends of two consecutive steps with decode rows after ``since``."""
        ends = [end for _, end, kind, _ in self.steps if kind != "prefill" and end >= since]
        return max((b - a for a, b in zip(ends, ends[1:])), default=0.0)

    def decode_only_gaps(self, until: float) -> list[float]:
        """End-to-end times of adjacent decode-only steps that both ended before ``until``."""
        return [b[1] - a[1] for a, b in zip(self.steps, self.steps[1:])
                if a[2] == b[2] == "decode" and b[1] < until]

    def durations(self, kind: str, since: float = 0.0) -> list[float]:
        return [end - start for start, end, k, _ in self.steps if k == kind and start >= since]

    def replayed_fraction(self, kind: str) -> float:
        flags = [replayed for _, _, k, replayed in self.steps if k == kind]
        return sum(flags) / len(flags) if flags else 0.0


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def grpo_prompts(sizes, vocab: int, seed: int = 0, lengths=None):
    """``groups`` prompts (of ``lengths[g]`` tokens, default ``prompt_len``), each repeated
    ``samples`` times; token ids from ``seed``."""
    rng = random.Random(seed)
    lengths = lengths or [sizes["prompt_len"]] * sizes["groups"]
    prompts = []
    for n in lengths:
        prompt = [rng.randrange(8, vocab) for _ in range(n)]
        prompts += [prompt] * sizes["samples"]
    return prompts


def recipe_lengths(groups: int, scale: float = 1.0, seed: int = 7) -> list[int]:
    """Prompt lengths of ``groups`` groups, task by task in turn, uniform in each task's
    measured range (``scale`` shrinks them for the CPU smoke run)."""
    rng = random.Random(seed)
    ranges = [RECIPE_PROMPT_TOKENS[g % len(RECIPE_PROMPT_TOKENS)] for g in range(groups)]
    return [max(2, round(rng.randint(lo, hi) * scale)) for lo, hi in ranges]


def engine_config(sizes, max_len: int, max_seqs: int, **extra) -> EngineConfig:
    # Serial steps (overlap_steps off unless asked): ``StepTimer`` times each step's
    # ``runner.run``, which an overlapped decode step does not go through.
    block = sizes["block"]
    blocks = max_seqs * -(-max_len // block) + 1
    extra.setdefault("overlap_steps", False)
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


def grpo_run(model, sizes, prompts, first_prompts, **extra) -> dict:
    """One mode under the protocol of the module docstring: start, first and warm seconds,
    the warm run's outputs, its peak KV blocks and its prefix-cache hit tokens."""
    max_len = max(len(p) for p in prompts + first_prompts) + sizes["new_tokens"]
    _sync()
    start = time.perf_counter()
    with LLM(model, engine_config(sizes, max_len, len(prompts), **extra)) as llm:
        _sync()
        started = time.perf_counter() - start
        first, _ = _rollout(llm, sizes, first_prompts, seed=5000)
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


def run_modes(model, sizes, prompts, first_prompts, label: str) -> tuple[dict, bool]:
    """The three modes on one setting, printed side by side; (results, bits equal across modes)."""
    runs = {"nocache": {}, "cache": dict(enable_prefix_caching=True),
            "cache+chunked": dict(enable_prefix_caching=True, prefill_chunk_tokens=sizes["chunk"])}
    results = {mode: grpo_run(model, sizes, prompts, first_prompts, **extra) for mode, extra in runs.items()}
    print(f"  {label}: {sizes['groups']} groups x n = {sizes['samples']}, prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {sizes['new_tokens']} new tokens", flush=True)
    print(f"    {'mode':14s} {'start s':>8s} {'first s':>8s} {'warm s':>8s} {'whole s':>8s}  "
          f"{'speed-up warm':>13s} {'whole':>6s}  peak KV blocks  hit tokens", flush=True)
    ratios = time_ratios(results)
    for mode, r in results.items():
        ratio = ratios.get(mode, {"warm": 1.0, "whole": 1.0})
        print(f"    {mode:14s} {r['start']:8.2f} {r['first']:8.2f} {r['warm']:8.2f} {r['whole']:8.2f}  "
              f"{1 / ratio['warm']:12.2f}x {1 / ratio['whole']:5.2f}x  {r['peak']:14d}  {r['hit_tokens']}", flush=True)
    for mode, ratio in ratios.items():
        print(f"    {mode:14s} time / nocache: warm {ratio['warm']:.3f}, whole run {ratio['whole']:.3f}", flush=True)
    base_out = results["nocache"]["outputs"]
    return results, all(same_bits(results[k]["outputs"], base_out) for k in ("cache", "cache+chunked"))


def mode_rows(base: dict, results: dict) -> list[dict]:
    rows = [dict(base, run=k, metric=f"{phase}_seconds", value=round(v[phase], 4), unit="s")
            for k, v in results.items() for phase in ("start", "first", "warm", "whole")]
    for k, v in time_ratios(results).items():
        for phase in ("warm", "whole"):
            rows.append(dict(base, run=k, metric=f"{phase}_time_vs_nocache", value=round(v[phase], 3), unit="ratio"))
            rows.append(dict(base, run=k, metric=f"{phase}_speedup_vs_nocache", value=round(1 / v[phase], 3),
                             unit="x"))
    rows += [dict(base, run=k, metric="peak_kv_blocks", value=v["peak"], unit="blocks") for k, v in results.items()]
    rows += [dict(base, run=k, metric="prefill_tokens_saved", value=v["hit_tokens"], unit="tokens")
             for k, v in results.items() if k != "nocache"]
    return rows


def bench_grpo(model, sizes, vocab, info, name) -> tuple[list[dict], bool]:
    prompts = grpo_prompts(sizes, vocab)
    results, ok = run_modes(model, sizes, prompts, grpo_prompts(sizes, vocab, seed=99), "prompt-heavy")
    base_out = results["nocache"]["outputs"]
    check = consistency.compare(base_out, consistency.packed_logprobs(model, base_out, max_tokens_per_batch=16384))
    ok = ok and check.num_identical == check.num_tokens
    print(f"  bitwise: nocache == cache == cache+chunked: {ok}; vs training forward "
          f"{check.num_identical}/{check.num_tokens}", flush=True)
    base = dict(info, model=name, setting="prompt_heavy", groups=sizes["groups"], samples=sizes["samples"],
                prompt_len=sizes["prompt_len"], new_tokens=sizes["new_tokens"])
    rows = mode_rows(base, results)
    per_seq = -(-(sizes["prompt_len"] + sizes["new_tokens"]) // sizes["block"])
    saved = results["nocache"]["peak"] - results["cache"]["peak"]
    rows.append(dict(base, run="cache", metric="extra_sequences_that_fit", value=round(saved / per_seq, 1),
                     unit=f"sequences of {per_seq} blocks"))
    rows.append(dict(base, run="all", metric="bitwise_identical", value=int(ok), unit="bool"))
    print(f"  KV: {saved} blocks saved = {saved / per_seq:.1f} extra sequences of {per_seq} blocks", flush=True)
    return rows, ok


def bench_recipes(model, sizes, vocab, info, name, device: str) -> tuple[list[dict], bool]:
    """Section 2 of the module docstring: the recipes' group sizes and prompt lengths."""
    rows, ok = [], True
    scale = 1.0 if device == "cuda" else 0.4
    for groups, samples in RECIPE_SETTINGS[device]:
        setting = dict(sizes, groups=groups, samples=samples, new_tokens=RECIPE_NEW_TOKENS[device])
        lengths = recipe_lengths(groups, scale)
        results, same = run_modes(model, setting, grpo_prompts(setting, vocab, 0, lengths),
                                  grpo_prompts(setting, vocab, 99, lengths), f"recipe setting n = {samples}")
        print(f"    bitwise: nocache == cache == cache+chunked: {same}", flush=True)
        ok = ok and same
        base = dict(info, model=name, setting=f"recipe_n{samples}", groups=groups, samples=samples,
                    prompt_len=f"{min(lengths)}-{max(lengths)}", new_tokens=setting["new_tokens"])
        rows += mode_rows(base, results) + [dict(base, run="all", metric="bitwise_identical", value=int(same),
                                                 unit="bool")]
    return rows, ok


def latency_run(model, sizes, vocab, chunk) -> dict:
    """Section 4 of the module docstring, one mode: seconds and fractions by name."""
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
        llm.pause()  # the decoders are admitted together
        futures = [llm.submit([rng.randrange(8, vocab) for _ in range(short)], params) for _ in range(n)]
        decode_steps = llm.step_counts.decode + min(DECODE_STEPS_BEFORE, answer // 2)
        llm.resume()
        deadline = time.monotonic() + 120
        while llm.step_counts.decode < decode_steps and time.monotonic() < deadline:
            time.sleep(0.0005)  # the batch is decoding
        arrival = time.perf_counter()
        llm.submit(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        for f in futures:
            f.result()
    return dict(longest_decode_gap=log.longest_decode_gap(arrival),
                median_decode_only_gap_before=median(log.decode_only_gaps(arrival)),
                median_mixed_step=median(log.durations("mixed", arrival)),
                median_prefill_step=median(log.durations("prefill", arrival)),
                decode_only_steps_replayed=log.replayed_fraction("decode"))


def bench_latency(model, sizes, vocab, info, name) -> list[dict]:
    rows = []
    base = dict(info, model=name, setting="latency", decoders=sizes["decoders"], long_len=sizes["long_len"])
    for label, chunk in (("chunked_off", None), ("chunked_on", sizes["chunk"])):
        r = latency_run(model, sizes, vocab, chunk)
        print(f"  latency {label:11s} longest decode gap {r['longest_decode_gap'] * 1e3:8.1f} ms; median "
              f"decode-only step before the prompt {r['median_decode_only_gap_before'] * 1e3:.2f} ms "
              f"(graph replayed: {r['decode_only_steps_replayed']:.2f}); median mixed step "
              f"{r['median_mixed_step'] * 1e3:.1f} ms, prefill step {r['median_prefill_step'] * 1e3:.1f} ms",
              flush=True)
        for metric, value in r.items():
            fraction = metric.endswith("replayed")
            rows.append(dict(base, run=label, chunk=chunk or 0, metric=metric, unit="fraction" if fraction else "ms",
                             value=round(value if fraction else value * 1e3, 3)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, choices=list(RANDOM_INIT),
                        help="default qwen3-0.6b (GPU) / tiny-qwen3 (CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-recipes", action="store_true")
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
    if not args.skip_recipes:
        recipe_rows, same = bench_recipes(model, sizes, vocab, info, name, args.device)
        rows, ok = rows + recipe_rows, ok and same
    if not args.skip_latency:
        rows += bench_latency(model, sizes, vocab, info, name)
    print(f"wrote {write_csv(rows, args.out, 'bench_prefix.csv')} ({len(rows)} rows) in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

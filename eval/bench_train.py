"""Training step: the unified packed forward + backward of token log-probs vs the fastest
stock step we can assemble, side by side in one process.

Usage (GPU, repo root):
    python3 -m eval.bench_train [--quick] [--models M,...] [--packings P,...] [--out DIR_OR_CSV]
        [--attention flash_varlen,cudnn,fa4] [--logprob chunked,areal,liger]

Models: random init from the published configs (Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B).
Packings: ``grpo`` (64 sequences: prompt 48..80 + answer 64 + 256 u^3 tokens, u uniform,
12.3k tokens: a long-tailed GRPO length mix) and ``4x4096``; any ``NxL`` works. One step:
forward, token log-probs at T = 1 of the next token, loss = sum(logprob * g) with a fixed
random g, backward into the parameters (no optimizer, no gradient checkpointing).

Paths (one Hugging Face module, one set of parameters):
- ``ours``: ``UnifiedCausalLM.forward_logprobs`` on the unified kernels (fused LM-head log-prob).
- ``stock:<attention>+<log-prob>``: the Hugging Face model's own forward (cuBLAS bf16 GEMMs,
  HF eager norms, rope and SiLU) with attention through transformers' ``AttentionInterface``
  (``flash_varlen``: torch's FlashAttention varlen; ``cudnn``: SDPA's cuDNN backend, padded;
  ``fa4``: flash-attn-4's CuTe varlen) and a log-prob path (``chunked``: a torch.compile'd
  1024-token chunked log_softmax + gather as AReaL 1.0.4 writes it; ``areal``: AReaL's own
  ``gather_logprobs``; ``liger``: Liger-Kernel's fused linear cross-entropy, negated).
  eval/train_baselines.py has them. Every attention backend runs with the reference
  log-prob (``chunked``), every other log-prob path with the fastest attention, then every
  backend with the fastest log-prob (not the full cross product); the fastest of these is
  "fastest stock", and fastest-stock / ours is the headline (the target: >= 1.0x). A
  baseline that does not import (the kernels come from ``$AREAL_TIK_KERNELS_SITE``, appended
  after the image's site-packages) or fails at run time is printed with its error and its
  cell skipped; one whose log-probs differ from ours by more than 4x the reference
  combination's (and > 0.25) is printed with its time but not counted
  (train_baselines.suspect).

Printed per case: ms per step (median of --steps after --warmup; wall clock between CUDA
synchronisations, Python included), the first call (compilation included: Triton and
Inductor caches start empty in each run unless --warm-cache; ours runs
``unified_kernels.warmup`` first, timed on its own, unless --no-warmup), Triton JIT
compilations in the first call and in all later ones (the target: 0), peak memory, MFU
(model FLOPs 6 N T + causal attention 6 L^2 Hq D per layer and sequence, over the measured
790 TFLOP/s bf16 ceiling) for every path, and agreement with the fastest stock step:
relative Frobenius error of all gradients, the worst parameter, max |delta logprob|, and
whether ours repeats bit for bit.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __name__ == "__main__" and "--warm-cache" not in sys.argv:
    # Fresh compilation caches, set before torch and triton read them: the first call is cold.
    _CACHE = tempfile.mkdtemp(prefix="bench-train-cache-")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE, "inductor")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU smoke runs: before triton is imported

import triton  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
from eval.harness import run_info, write_csv  # noqa: E402
from eval.train_baselines import (ATTENTIONS, ATTN_NAME, CUDNN_GQA, FA4_NOTES, KERNELS_SITE_ENV,  # noqa: E402
                                  LOGPROBS, Baselines, add_kernels_site, attention_labels, attention_status,
                                  fastest, fmt_path, headline, logprob_paths, restrict, rounds,
                                  select_baselines, stock_attention, suspect, use_attention, why)
from eval.train_workload import Batch, make_batch, packing, step_flops  # noqa: E402

from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config  # noqa: E402
from areal_tik.model.spec import ModelSpec  # noqa: E402
from areal_tik.unified_kernels import WarmupShapes, bitwise_equal, warmup  # noqa: E402

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on the H200
MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "llama-3.2-1b": "Llama-3.2-1B"}
TINY = {"tiny-qwen3": "qwen3", "tiny-llama": "llama"}  # CPU smoke runs
PACKINGS = ("grpo", "4x4096")
TEMPERATURE = 1.0  # Liger's loss has no temperature


# ------------------------------------------------------------------ steps


def _hf_kwargs(b: Batch) -> dict:
    return dict(input_ids=b.input_ids[None], position_ids=b.positions[None], use_cache=False,
                cu_seq_lens_q=b.cu_seqlens, cu_seq_lens_k=b.cu_seqlens,
                max_length_q=b.max_seqlen, max_length_k=b.max_seqlen)


def make_steps(hf, b: Batch, logprobs: dict):
    """(ours, stock): ``ours()`` and ``stock(attention, log-prob)()`` each run one forward +
    backward and return the detached log-probs (``logprobs``: logprob_paths())."""
    ours = UnifiedCausalLM.from_hf(hf, kernels="unified")

    def finish(lp):
        (lp * b.grad_weights).sum().backward()
        return lp.detach()

    def step_ours():
        return finish(ours.forward_logprobs(b.input_ids, b.positions, b.cu_seqlens, b.max_seqlen,
                                            b.targets, TEMPERATURE))

    def stock(attention, path):
        fn = logprobs[path][0]

        def step():
            use_attention(attention)
            if path == "liger":
                hidden = hf.model(**_hf_kwargs(b)).last_hidden_state[0]
                return finish(-fn(hf.get_output_embeddings().weight, hidden, b.targets))
            return finish(fn(hf(**_hf_kwargs(b)).logits[0], b.targets, TEMPERATURE))
        return step

    return step_ours, stock


def stock_name(combo) -> str:
    return f"stock:{combo[0]}+{combo[1]}"


# ------------------------------------------------------------------ measurement


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _zero(params):
    for p in params:
        p.grad = None


def _timed(step, params, device) -> float:
    _zero(params)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


class CompileCounter:
    """Counts Triton JIT compilations in this process (a new key: compiled, or loaded from
    the disk cache) through triton's post-compile hook; Inductor's kernels are not JIT
    launches and are not counted."""

    def __init__(self):
        self.count = 0
        self._previous = None

    def _hook(self, **kwargs):
        self.count += 1
        return self._previous(**kwargs) if self._previous else None

    def install(self) -> "CompileCounter":
        self._previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = self._hook
        return self


COMPILES = CompileCounter()


def measure(step, params, device, steps: int, warmup: int) -> dict:
    """first-call ms, median/p20/p80 ms of ``steps`` after ``warmup``, peak memory (GiB),
    Triton compilations in the first call and in every later one."""
    before = COMPILES.count
    first = _timed(step, params, device)
    after_first = COMPILES.count
    for _ in range(warmup):
        _timed(step, params, device)
    times = sorted(_timed(step, params, device) for _ in range(steps))
    out = {"first_ms": first, "median_ms": statistics.median(times),
           "p20_ms": times[int(0.2 * (len(times) - 1))], "p80_ms": times[int(0.8 * (len(times) - 1))],
           "compiles_first": after_first - before, "compiles_after_first": COMPILES.count - after_first}
    if torch.device(device).type == "cuda":
        _zero(params)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_over_params_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return out


def _grads(step, named):
    _zero([p for _, p in named])
    lp = step()
    return lp, [p.grad.detach().clone() for _, p in named]


def compare(ours, stock, named) -> dict:
    """Gradients and log-probs of ours vs a stock step, and ours vs ours again (bits)."""
    lp_stock, g_stock = _grads(stock, named)
    lp_ours, g_ours = _grads(ours, named)
    diff2 = ref2 = 0.0
    worst = (0.0, "")
    for (name, _), a, b in zip(named, g_ours, g_stock):
        d2, r2 = (a.double() - b.double()).pow(2).sum().item(), b.double().pow(2).sum().item()
        diff2, ref2 = diff2 + d2, ref2 + r2
        worst = max(worst, ((d2 / max(r2, 1e-300)) ** 0.5, name))
    del g_stock
    lp_again, g_again = _grads(ours, named)
    repeat = all(bitwise_equal(a, b) for a, b in zip(g_ours, g_again)) and bitwise_equal(lp_ours, lp_again)
    return {"grad_rel_err": (diff2 / max(ref2, 1e-300)) ** 0.5, "grad_worst_rel_err": worst[0],
            "grad_worst_param": worst[1], "lp_max_abs_diff": (lp_ours - lp_stock).abs().max().item(),
            "lp_bitwise_fraction": (lp_ours.view(torch.int32) == lp_stock.view(torch.int32)).float().mean().item(),
            "ours_repeat_bitwise": repeat}


# ------------------------------------------------------------------ driver


def build_model(name: str, device):
    config = tiny_config(TINY[name]) if name in TINY else published_config(MODELS[name])
    hf = random_model(config, dtype=torch.bfloat16, device=device, seed=0)
    hf.set_attn_implementation(ATTN_NAME)
    return hf


def warmup_shapes(hf, spec: ModelSpec) -> WarmupShapes:
    """Every projection weight of ``hf`` (the LM head aside), its norms, MLP and heads."""
    lm = hf.get_output_embeddings().weight
    linears = sorted({(m.out_features, m.in_features, m.bias is not None) for m in hf.modules()
                      if isinstance(m, torch.nn.Linear) and m.weight is not lm})
    norms = (spec.hidden, spec.head_dim) if spec.qk_norm else (spec.hidden,)
    return WarmupShapes(tuple(linears), norms, (spec.intermediate,),
                        (spec.n_heads, spec.n_kv_heads, spec.head_dim), tuple(lm.shape), dtype=lm.dtype)


def run_warmup(hf, spec, max_rows: int, device) -> dict:
    before, start = COMPILES.count, time.perf_counter()
    warmup(warmup_shapes(hf, spec), max_rows, device)
    _sync(device)
    return {"warmup_ms": (time.perf_counter() - start) * 1e3, "warmup_compiles": COMPILES.count - before}


def _time_path(step, params, device, args, flops: float, warm=None) -> dict:
    """measure() of one path (after ``warm()``, timed on its own, if given) with its MFU, or
    {"error": ...}: one failing path must not hide the others' numbers."""
    try:
        w = warm() if warm else {}
        m = {**measure(step, params, device, args.steps, args.warmup), **w}
        m["tflops"] = flops / (m["median_ms"] * 1e-3) / 1e12
        m["mfu"] = m["tflops"] / PEAK_TFLOPS
        return m
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        _zero(params)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return {"error": why(exc)}


def _logprobs(step, params):
    """(log-probs of one step, None) or (None, its error)."""
    try:
        _zero(params)
        return step(), None
    except Exception as exc:  # noqa: BLE001  (ours' own failure is reported by its timing)
        return None, why(exc)
    finally:
        _zero(params)


def _check_logprobs(m: dict, step, params, lp_ours, reference: list) -> float | None:
    """max |logprob - ours| of one stock step into ``m``; the median to count, or None if
    the step is suspect (``reference``: the first combination's difference, appended here)."""
    lp, err = _logprobs(step, params)
    if lp is None:
        m["error"] = f"its log-prob check step failed: {err}"
        return None
    diff = m["lp_max_abs_diff_vs_ours"] = (lp.float() - lp_ours.float()).abs().max().item()
    if not reference:
        reference.append(diff)
    elif suspect(diff, reference[0]):
        m["error"] = f"log-probs off from ours by {diff:.3g} (reference {reference[0]:.3g}): not counted"
        return None
    return m["median_ms"]


def run_case(model: str, pack: str, args, baselines: Baselines, device) -> list[dict]:
    """Time ours and the stock combinations (train_baselines.rounds) for one (model,
    packing). Returns long-format CSV rows."""
    hf = build_model(model, device)
    spec = ModelSpec.from_hf_config(hf.config)
    lengths = packing(pack)
    batch = make_batch(lengths, spec.vocab, device)
    named = [(n, p) for n, p in hf.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    ours, stock = make_steps(hf, batch, baselines.paths)
    flops = step_flops(spec, lengths)
    warm = None if args.no_warmup else (lambda: run_warmup(hf, spec, sum(lengths), device))
    results = {"ours": _time_path(ours, params, device, args, flops, warm)}
    times, lp_ours, reference = {}, _logprobs(ours, params)[0], []
    for combos in rounds(baselines.attentions, baselines.logprobs, times):
        for combo in combos:
            m = results[stock_name(combo)] = _time_path(stock(*combo), params, device, args, flops)
            times[combo] = m.get("median_ms")
            if "error" not in m and lp_ours is not None:
                times[combo] = _check_logprobs(m, stock(*combo), params, lp_ours, reference)
    best = fastest(times)
    try:
        agreement = compare(ours, stock(*best[0]), named) if best else {"error": "no stock step ran"}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        agreement = {"error": why(exc)}
    _zero(params)
    results["compare"] = agreement
    print(f"{model} {pack} T={sum(lengths)}", flush=True)
    for path, m in results.items():
        if path != "compare":
            print(f"  {path}: {fmt_path(m)}", flush=True)
    ours_ms = results["ours"].get("median_ms")
    if best and ours_ms:
        agreement.update(fastest_stock=stock_name(best[0]), fastest_stock_ms=best[1],
                         fastest_stock_over_ours=best[1] / ours_ms)
        print(f"  fastest stock {stock_name(best[0])} {best[1]:.1f} ms | fastest-stock/ours "
              f"{best[1] / ours_ms:.2f}x (target >= 1.0)", flush=True)
    print("  agreement with the fastest stock: " + ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in agreement.items()
        if not k.startswith("fastest_stock")), flush=True)
    base = {"model": model, "packing": pack, "tokens": sum(lengths), "sequences": len(lengths),
            "step_gflop": flops / 1e9}
    return [{**base, "path": path, "metric": key, "value": value}
            for path, m in results.items() for key, value in m.items()]


def _cache_entries() -> int:
    """Kernels in Triton's disk cache: one folder per compiled key."""
    root = Path(triton.knobs.cache.dir)
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {[*MODELS, *TINY]}")
    parser.add_argument("--packings", default=",".join(PACKINGS), help="comma list: grpo, NxL")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    parser.add_argument("--quick", action="store_true", help="Qwen3-0.6B at the GRPO packing only")
    parser.add_argument("--warm-cache", action="store_true", help="keep the Triton/Inductor disk caches")
    parser.add_argument("--attention", default=",".join(ATTENTIONS),
                        help=f"stock attention backends to try, comma list of {list(ATTENTIONS)}")
    parser.add_argument("--logprob", default=",".join(LOGPROBS),
                        help=f"stock log-prob paths to try, comma list of {list(LOGPROBS)}")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no unified_kernels.warmup before ours (its first call then compiles)")
    args = parser.parse_args(argv)
    models = ["qwen3-0.6b"] if args.quick else args.models.split(",")
    packs = ["grpo"] if args.quick else args.packings.split(",")
    for name in models:
        if name not in MODELS and name not in TINY:
            raise SystemExit(f"--models: unknown {name!r}; known: {[*MODELS, *TINY]}")
    for pack in packs:
        packing(pack)  # bad names fail before any model is built
    for flag, known in (("attention", ATTENTIONS), ("logprob", LOGPROBS)):
        bad = [n for n in getattr(args, flag).split(",") if n not in known]
        if bad:
            raise SystemExit(f"--{flag}: unknown {bad}; known: {list(known)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers
    transformers.AttentionInterface.register(ATTN_NAME, stock_attention)
    COMPILES.install()
    kernels_site = add_kernels_site()
    baselines = restrict(select_baselines(attention_status(device), logprob_paths()),
                         args.attention.split(","), args.logprob.split(","))
    labels = attention_labels(device)
    notes = {"kernels_site": ":".join(kernels_site) or f"${KERNELS_SITE_ENV} not set",
             **{f"attention:{n}": labels[n] for n in baselines.attentions},
             **{f"logprob:{n}": baselines.paths[n][1] for n in baselines.logprobs},
             "caches": "warm (as found)" if args.warm_cache else "fresh per run",
             "transformers": transformers.__version__}
    for key, value in notes.items():
        print(f"{key}: {value}", flush=True)
    for key, value in baselines.skipped.items():
        print(f"{key}: SKIPPED ({value})", flush=True)
    entries_before = _cache_entries()
    info = {**run_info(device), **notes, **{k: f"SKIPPED ({v})" for k, v in baselines.skipped.items()}}
    rows = []
    for name, pack in itertools.product(models, packs):
        rows += [{**info, **row} for row in run_case(name, pack, args, baselines, device)]
        write_csv(rows, args.out, "bench_train.csv")  # after every case: a timeout keeps the rest
        torch.cuda.empty_cache() if device == "cuda" else None
    headline(rows)
    for note in FA4_NOTES:
        print(f"fa4: {note}")
    if "native" in CUDNN_GQA:
        print(f"cudnn: GQA {'through enable_gqa' if CUDNN_GQA['native'] else 'by repeated K/V heads'}")
    compiled = _cache_entries() - entries_before
    print(f"triton_cache: {triton.knobs.cache.dir}: {compiled} kernels compiled into it by this run")
    rows.append({**info, "path": "run", "metric": "triton_cache_new_kernels", "value": compiled})
    print(f"wrote {write_csv(rows, args.out, 'bench_train.csv')}")


if __name__ == "__main__":
    main()

"""Isolated-layer profiling: one decoder layer per model config, per phase, unified vs stock.

    python3 -m eval.bench_layers --out eval/results/<run>          # H200, about 3 minutes
    python3 -m eval.bench_layers --tiny --models qwen3-0.6b --reps 1  # CPU smoke (interpreter)

Each model is its published config cut to one decoder layer (embedding and final norm
included, no lm head: the log-prob kernel is bench_logprob's), random bf16 weights, run
by ``UnifiedCausalLM`` on the unified kernels and on the standard ones (cuBLAS linear,
FlashAttention varlen / SDPA, torch pointwise ops) from the same weights. Phases:

- ``prefill``: PREFILL_SEQS prompts of PREFILL_LEN tokens into a paged KV cache;
- ``decode_b1`` / ``decode_b16`` / ``decode_b64``: one token for each of B sequences with
  DECODE_CONTEXT tokens already cached (eager, no CUDA graph, in both sets; the standard set's
  cache in one block per sequence, as the recipes' stock mode runs it);
- ``train_forward``: packed varlen forward of TRAIN_SEQS x TRAIN_LEN tokens with autograd;
- ``train_backward``: its backward from a fixed random output gradient.

The stock rollout phases (prefill, decode) run the standard set as the recipes' stock engine
does since 1c44a86: its norms, rope and SiLU-mul under ``torch.compile``
(``compiled_standard_ops``, as vLLM compiles its model); its training phases stay eager, as in
AReaL's FSDP actor. ``--stock-rollout eager`` gives the eager rollout phases of earlier runs.

Reported per model: each phase's mean time for both sets and stock/unified, and the
ratio of summed phase times (stock sum / unified sum; the paper: 1.40x). ``--tiny`` uses
tiny shapes of the same families (for a CPU smoke run under the Triton interpreter).
"""
from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU smoke runs: before kernels import

from eval.harness import bench_parser, print_summary, run_info, write_csv  # noqa: E402

MODELS = ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b", "qwen2.5-1.5b", "llama-3.2-1b")
PHASES = ("prefill", "decode_b1", "decode_b16", "decode_b64", "train_forward", "train_backward")
KERNEL_SETS = ("unified", "standard")
# GPU sizes, and the tiny ones for the interpreter (seqs, tokens per seq).
SIZES = {"gpu": dict(prefill=(16, 512), decode_context=512, train=(8, 1024), block=64),
         "tiny": dict(prefill=(2, 16), decode_context=16, train=(2, 16), block=16)}
TINY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def layer_config(model: str, tiny: bool):
    """``model``'s published config with one decoder layer (tiny shapes with ``tiny``)."""
    from areal_tik.adapter.recipes import SMOLLM2_CONFIG
    from areal_tik.model import PUBLISHED_CONFIGS
    from areal_tik.model.loading import make_config

    names = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen2.5-1.5b": "Qwen2.5-1.5B",
             "llama-3.2-1b": "Llama-3.2-1B"}
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    values = dict(SMOLLM2_CONFIG if model == "smollm2-135m" else PUBLISHED_CONFIGS[names[model]])
    values.update(num_hidden_layers=1, vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if tiny:
        values.update(TINY_SHAPE)
    return make_config(values)


def _timed(fn, reps: int, cuda: bool) -> float:
    """Mean seconds per call over ``reps`` calls, after two warm-up calls on a GPU
    (compilation: Triton's, and torch.compile's, which may specialise again on its second
    call; the interpreter compiles nothing)."""
    if cuda:
        fn()
        fn()
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _packed(seqs: int, length: int, vocab: int, device):
    ids = torch.randint(3, vocab, (seqs * length,), device=device)
    positions = torch.arange(length, device=device).repeat(seqs)
    cu = torch.arange(0, (seqs + 1) * length, length, device=device, dtype=torch.int32)
    return ids, positions, cu


def phase_functions(model, sizes: dict, vocab: int, device) -> dict:
    """Phase name -> a zero-argument callable running it once on ``model``."""
    from areal_tik.model.ops import one_block_per_sequence

    context = sizes["decode_context"]
    p_seqs, p_len = sizes["prefill"]
    # the standard set as the recipes' stock mode runs it: one KV block per sequence, where its
    # decode calls FlashAttention over each sequence's rows
    block = one_block_per_sequence(max(p_len, context + 1)) if model.kernels == "standard" else sizes["block"]
    width = -(-max(p_len, context + 1) // block)  # KV blocks per sequence
    n_seqs = max(p_seqs, 64)
    cache = model.new_kv_cache(n_seqs * width + 1, block, zero=True)
    tables = torch.arange(n_seqs * width, device=device, dtype=torch.int32).view(n_seqs, width)
    ids, pos, cu = _packed(p_seqs, p_len, vocab, device)
    slots = (tables[:p_seqs, :, None] * block + torch.arange(block, device=device)).flatten(1)[:, :p_len]
    last = cu[1:].long() - 1
    fns = {"prefill": lambda: model.prefill(ids, pos, cu, p_len, cache, slots.flatten().long(), last)}
    for b in (1, 16, 64):
        d_ids = torch.randint(3, vocab, (b,), device=device)
        d_pos = torch.full((b,), context, device=device, dtype=torch.long)
        d_slots = tables[:b, context // block].long() * block + context % block
        lens = torch.full((b,), context + 1, device=device, dtype=torch.int32)
        fns[f"decode_b{b}"] = (lambda d_ids=d_ids, d_pos=d_pos, d_slots=d_slots, lens=lens, b=b:
                               model.decode(d_ids, d_pos, cache, d_slots, tables[:b], lens))
    t_seqs, t_len = sizes["train"]
    t_ids, t_pos, t_cu = _packed(t_seqs, t_len, vocab, device)
    grad = torch.randn(t_seqs * t_len, model.spec.hidden, device=device, dtype=model.dtype,
                       generator=torch.Generator(device=device).manual_seed(0))
    fns["train_forward"] = lambda: model.forward_packed(t_ids, t_pos, t_cu, t_len)

    def backward():  # the forward is outside the timed region: one forward per backward
        out = model.forward_packed(t_ids, t_pos, t_cu, t_len)
        return lambda: out.backward(grad, retain_graph=True)
    fns["train_backward"] = backward
    return fns


def bench_model(name: str, tiny: bool, reps: int, device, stock_rollout: str = "compiled") -> list[dict]:
    from areal_tik.model import UnifiedCausalLM, random_model
    from areal_tik.model.ops import compiled_standard_ops

    cuda = device.type == "cuda"
    hf = random_model(layer_config(name, tiny), device=device, seed=0)
    sizes = SIZES["tiny" if tiny else "gpu"]
    rows = []
    for kernels in KERNEL_SETS:
        model = UnifiedCausalLM(hf, kernels=kernels)
        fns = phase_functions(model, sizes, hf.config.vocab_size, device)
        compiled = ([p for p in PHASES if p.startswith(("prefill", "decode"))]
                    if kernels == "standard" and stock_rollout == "compiled" else [])
        if compiled:  # the same weights, compiled ops
            # A stock engine compiles for its one model; across five models in one process each
            # op's variants (ranks, eps, shapes) pile up on one code object and pass Dynamo's
            # recompile limit of 8 (an H100 at 4910541: FailOnRecompileLimitHit in _std_rms_norm
            # before the run's end), so each model starts afresh.
            torch._dynamo.reset()
            rollout = phase_functions(UnifiedCausalLM(hf, kernels=compiled_standard_ops()), sizes,
                                      hf.config.vocab_size, device)
            fns.update({p: rollout[p] for p in compiled})
        for phase in PHASES:
            if phase == "train_backward":
                seconds = _timed(fns[phase](), reps, cuda)
            else:
                with torch.no_grad() if phase.startswith(("prefill", "decode")) else torch.enable_grad():
                    seconds = _timed(fns[phase], reps, cuda)
            rows.append({"model": name, "kernels": kernels, "phase": phase, "seconds": seconds,
                         "ops": "compiled" if phase in compiled else "eager"})
        hf.zero_grad(set_to_none=True)
    return rows


def summarize(rows: list[dict]) -> tuple[list[str], dict[str, float]]:
    """Per model: each phase stock/unified and the summed phase-time ratio."""
    lines, ratios = [], {}
    for model in dict.fromkeys(r["model"] for r in rows):
        t = {(r["kernels"], r["phase"]): r["seconds"] for r in rows if r["model"] == model}
        per_phase = [f"{p} {t['standard', p] / t['unified', p]:.2f}x" for p in PHASES]
        ratios[model] = sum(t["standard", p] for p in PHASES) / sum(t["unified", p] for p in PHASES)
        ops = sorted({r.get("ops", "eager") for r in rows if r["model"] == model and r["kernels"] == "standard"
                      and r["phase"].startswith(("prefill", "decode"))})
        lines.append(f"{model}: summed phase time stock/unified {ratios[model]:.3f}x ({', '.join(per_phase)}); "
                     f"stock rollout ops {'/'.join(ops)}")
    if ratios:
        lines.append(f"mean over {len(ratios)} models: {sum(ratios.values()) / len(ratios):.3f}x (paper: 1.40x)")
    return lines, ratios


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--stock-rollout", choices=("compiled", "eager"), default="compiled",
                        help="the stock prefill and decode phases: elementwise ops compiled (the recipes' "
                             "stock engine) or eager (runs before 1c44a86)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown model(s) {unknown}; choose from {list(MODELS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = run_info()
    rows = [{**row, **info} for m in models
            for row in bench_model(m, args.tiny, args.reps, device, args.stock_rollout)]
    path = write_csv(rows, args.out, "bench_layers.csv")
    lines, _ = summarize(rows)
    print_summary(lines, [path])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

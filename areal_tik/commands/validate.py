"""The checks of ``generate``/``check`` flags that need no model: a bad value is answered
in one line (``UsageError`` naming the value and what is accepted) before anything is
built, and the kernel set for a CPU run is chosen here (``choose_kernels``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from areal_tik.errors import UsageError, at_least

# Measured on a 2-core CPU under the Triton interpreter (tiny-qwen3, 41k parameters,
# unified kernels): about 6 s per decoded token (12 tokens in 79 s), taken as proportional
# to the weight count (each kernel tile is a Python-level step): a rough extrapolation,
# but SmolLM2-135M indeed gave no token in 8 minutes.
INTERPRETER_SECONDS_PER_TOKEN_PER_PARAM = 6.0 / 41_184
# Above this many parameters the interpreter is not usable for generation.
INTERPRETER_PARAM_LIMIT = 2_000_000


def check_device(device: str | None) -> None:
    if device is None:
        return
    import torch

    if device == "cpu":
        return
    if device != "cuda" and not device.startswith("cuda:"):
        raise UsageError(f"--device {device!r}: expected cpu, cuda or cuda:<index>")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible here "
                         "(torch.cuda.is_available() is False); use --device cpu")


def check_model(name: str) -> None:
    """``name`` is a config name, ``smollm2`` (installed), a checkpoint directory or a .gguf file."""
    from .model_args import MODEL_HELP, RANDOM_INIT

    if name in RANDOM_INIT:
        return
    if name == "smollm2":
        from areal_tik.model import smollm2_path

        try:
            smollm2_path()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise UsageError(f"--model smollm2: {exc}") from None
        return
    path = Path(name)
    if not path.exists():
        raise UsageError(f"--model {name!r}: not a known name ({MODEL_HELP}) nor an existing path")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"--model {name!r}: a directory without config.json is not a model; expected "
                         "a Hugging Face checkpoint directory (areal-tik prepare-model writes one) or a .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise UsageError(f"--model {name!r}: a file that is not .gguf; expected a .gguf file or a checkpoint directory")


def check_numbers(args) -> None:
    lo, hi = args.prompt_len
    if lo < 1 or lo > hi:
        raise UsageError(f"--prompt-len {lo} {hi}: expected MIN MAX with 1 <= MIN <= MAX")
    at_least("--num-prompts", args.num_prompts, 0)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    at_least("--top-k", args.top_k, 0)
    at_least("--micro-batch-tokens", getattr(args, "micro_batch_tokens", None), 1)
    if not (args.prompt or args.prompt_ids or args.prompts_file or args.num_prompts):
        raise UsageError("no prompts: give --prompt, --prompt-ids, --prompts-file or --num-prompts")
    if args.prompts_file and not Path(args.prompts_file).is_file():
        raise UsageError(f"--prompts-file {args.prompts_file!r}: no such file")
    from .model_args import sampling_params

    sampling_params(args)  # temperature, top-p, stop ids: SamplingParams' own checks


def model_parameters(name: str) -> int | None:
    """The parameter count of ``--model`` from its config alone (None if unknown)."""
    from .model_args import RANDOM_INIT

    if name in RANDOM_INIT:
        from areal_tik.model import published_config, tiny_config

        kind, key = RANDOM_INIT[name]
        config = tiny_config(key) if kind == "tiny" else published_config(key)
    elif name == "smollm2":
        return 135_000_000
    elif (Path(name) / "config.json").is_file():
        config = json.loads((Path(name) / "config.json").read_text(encoding="utf-8"))
    else:
        return None
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    h, inter, layers, vocab = (get(k) or 0 for k in ("hidden_size", "intermediate_size",
                                                     "num_hidden_layers", "vocab_size"))
    return layers * (4 * h * h + 3 * h * inter) + vocab * h * (1 if get("tie_word_embeddings") else 2)


def choose_kernels(args, command: str) -> None:
    """Set ``args.kernels`` (None: not given). On a GPU, or for a small model: unified. On
    CPU for a model the interpreter cannot run in useful time: ``generate`` takes the
    standard kernels (no bitwise claim is made there), ``check`` keeps the unified ones (its
    whole point) and says how long a token will take."""
    from areal_tik.runtime import DEFAULT_KERNELS

    cpu = (args.device or ("cuda" if _has_gpu() else "cpu")) == "cpu"
    params = model_parameters(args.model) if cpu else None
    big = params is not None and params > INTERPRETER_PARAM_LIMIT
    if args.kernels is None:
        args.kernels = "standard" if (big and command == "generate") else DEFAULT_KERNELS
        if args.kernels == "standard":
            print(f"areal-tik: note: {args.model} on CPU: the unified kernels run in the Triton interpreter "
                  f"({_estimate(params)}); generating with --kernels standard (torch ops; pass --kernels "
                  "unified to insist)", file=sys.stderr)
            return
    if big and args.kernels == "unified":
        print(f"areal-tik: warning: {args.model} with the unified kernels on CPU runs in the Triton "
              f"interpreter: {_estimate(params)}; a GPU, or a tiny model (--model tiny-qwen3), is usable",
              file=sys.stderr)


def _estimate(params: int) -> str:
    hours = params * INTERPRETER_SECONDS_PER_TOKEN_PER_PARAM / 3600
    return (f"roughly {hours:.0f} h per generated token for {params / 1e6:.0f}M parameters, "
            "extrapolated from a tiny model's 6 s")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def validate(args, command: str) -> None:
    """Every check of ``generate``/``check`` flags that needs no model."""
    check_device(args.device)
    check_model(args.model)
    check_numbers(args)
    choose_kernels(args, command)

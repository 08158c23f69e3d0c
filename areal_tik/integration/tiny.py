"""A tiny random checkpoint with a character-level tokenizer, for CPU runs of the recipes,
the demo and the tests (nothing is fetched from a hub).

The tokenizer maps each printable ASCII character to one token and has ChatML special
tokens, so AReaL's chat-template path and reasoning-gym prompts work unchanged; the
model is ``areal_tik.model.tiny_config(family)`` (vocab 256) with random weights.
"""
from __future__ import annotations

import os
import string
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """A PreTrainedTokenizerFast: ChatML specials (ids 0-2) plus one id per printable char."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_checkpoint(path, config, tokenizer, seed: int = 0) -> Path:
    """Write a random-initialised bf16 model of ``config`` and ``tokenizer`` to ``path``."""
    import torch

    from areal_tik.model import random_model

    path = Path(os.fspath(path))
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {config.vocab_size} < tokenizer size {len(tokenizer)}")
    model = random_model(config, dtype=torch.bfloat16, device="cpu", seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_checkpoint(path, family: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random ``family`` model (bf16) and the char tokenizer to ``path``."""
    from areal_tik.model import tiny_config

    tokenizer = char_tokenizer()
    overrides = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None, tie_word_embeddings=True)
    overrides.update(config_overrides)
    return random_checkpoint(path, tiny_config(family, **overrides), tokenizer, seed=seed)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random checkpoint for CPU runs.")
    parser.add_argument("path")
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_checkpoint(args.path, args.family, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

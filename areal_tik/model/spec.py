"""ModelSpec: the shape and numerics of a supported decoder, read from a Hugging Face config.

One generic decoder implementation serves every supported family; the families differ
only in the flags of their row in ``SUPPORTED_FAMILIES`` (biases come from the modules
themselves at call time):

- ``qwen2`` (Qwen2, Qwen2.5): q/k/v projections with bias.
- ``qwen3``: per-head RMSNorm on q and k (over head_dim) before rope.
- ``llama`` (Llama 3.x, SmolLM2): default or ``llama3`` rope scaling; tied or untied
  embeddings; optional attention / MLP biases.

Anything else (mixture-of-experts, sliding-window layers, partial rotary, rope types
other than default/llama3, activations other than SiLU, attention dropout) raises a
``ValueError`` that lists the supported families.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

@dataclasses.dataclass(frozen=True)
class Family:
    """One supported model family: how to recognise it and the flags the decoder reads."""

    model_type: str      # transformers' config.model_type
    architecture: str    # the *ForCausalLM class name
    description: str
    qkv_bias: bool       # q/k/v projections always carry a bias (else: config.attention_bias)
    qk_norm: bool        # RMSNorm over head_dim on q and k before rope


# A new dense decoder family is one row here (plus its tiny config in loading.py).
SUPPORTED_FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5 (q/k/v bias)", qkv_bias=True, qk_norm=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "Qwen3 dense (q/k RMSNorm)", qkv_bias=False, qk_norm=True),
    "llama": Family("llama", "LlamaForCausalLM", "Llama 3.x, SmolLM2 (default or llama3 rope)",
                    qkv_bias=False, qk_norm=False),
}
_ROPE_TYPES = ("default", "llama3")


def supported_families_text() -> str:
    return "; ".join(f"{name}: {f.description} [{f.architecture}]" for name, f in SUPPORTED_FAMILIES.items())


def family_of_model_type(model_type) -> str | None:
    """The family whose row has ``model_type``, or None."""
    return next((name for name, f in SUPPORTED_FAMILIES.items() if f.model_type == model_type), None)


def _unsupported(config, why: str) -> ValueError:
    model_type = getattr(config, "model_type", None)
    return ValueError(
        f"unsupported model config (model_type={model_type!r}): {why}. "
        f"Supported families: {supported_families_text()}")


def detect_family(config) -> str:
    """The family name of a transformers config; ValueError for anything unsupported."""
    model_type = getattr(config, "model_type", None)
    family = family_of_model_type(model_type)
    if family is None:
        raise _unsupported(config, f"model_type {model_type!r} is not a supported family")
    archs = getattr(config, "architectures", None) or []
    expected = SUPPORTED_FAMILIES[family].architecture
    wrong = [a for a in archs if a != expected]
    if wrong:
        raise _unsupported(config, f"architectures {archs!r}: only {expected!r} is supported for {family}")
    return family


def rope_parameters(config) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling dict or None) from a config of transformers 4.x or 5.x."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise _unsupported(config, "no rope_theta in the config")
    if "full_attention" in params and isinstance(params["full_attention"], Mapping):
        raise _unsupported(config, "per-layer-type rope parameters")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in _ROPE_TYPES:
        raise _unsupported(config, f"rope type {kind!r} (supported rope types: {_ROPE_TYPES})")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _unsupported(config, f"partial rotary (partial_rotary_factor={partial!r})")
    if kind == "default":
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise _unsupported(config, f"llama3 rope scaling without {missing}")
    scaling = {"rope_type": "llama3", **{k: params[k] for k in keys}}
    return float(theta), scaling


def _check_features(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise _unsupported(config, f"hidden_act {act!r} (only 'silu' / SwiGLU is supported)")
    if getattr(config, "use_sliding_window", False):
        raise _unsupported(config, "sliding-window attention (use_sliding_window=True)")
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise _unsupported(config, f"layer types {other} (only full attention is supported)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            raise _unsupported(config, f"mixture of experts ({key}={getattr(config, key)!r})")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout != 0.0:
        raise _unsupported(config, f"attention_dropout={dropout!r} (must be 0)")
    tp = getattr(config, "pretraining_tp", 1) or 1
    if tp != 1:
        raise _unsupported(config, f"pretraining_tp={tp!r} (must be 1)")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shapes and numerics of one supported decoder (validated in ``__post_init__``)."""

    family: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None for default rope
    max_positions: int
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    qkv_bias: bool  # informational: biases are read from the modules at call time
    tie_embeddings: bool

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"family must be one of {sorted(SUPPORTED_FAMILIES)}, got {self.family!r}")
        for name in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate",
                     "vocab", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        """Read a transformers config; ValueError (listing supported families) otherwise."""
        family = detect_family(config)
        row = SUPPORTED_FAMILIES[family]
        _check_features(config)
        theta, scaling = rope_parameters(config)
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        qkv_bias = row.qkv_bias or bool(getattr(config, "attention_bias", False))
        return cls(
            family=family,
            hidden=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            eps=float(config.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_positions=config.max_position_embeddings,
            qk_norm=row.qk_norm,
            qkv_bias=qkv_bias,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

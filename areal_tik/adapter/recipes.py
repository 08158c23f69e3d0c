"""The shipped recipes: which YAML in ``recipes/`` is which end-to-end configuration.

A recipe is a YAML file of ``recipes/`` whose name has no leading ``_`` (``_gpu.yaml``,
``_async.yaml``, ... are fragments the recipes compose through Hydra ``defaults``).
``CARDS`` names, for each of the twelve end-to-end configurations (and the two CPU
smoke recipes), the model, the algorithm and what it measures; ``cells(config)`` reads
the rest (task, verifier, sync/async, lengths) from the loaded config, so the README
table (``recipe_table``) cannot drift from the YAMLs. ``algorithm_of(config)`` reads
the algorithm from the loss options, and the tests check it against the card.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
H200_GB = 141.0
# Training state per parameter: bf16 weight + bf16 gradient + fp32 Adam m and v.
TRAIN_BYTES_PER_PARAM = 12
SMOLLM2 = "SmolLM2-135M-Instruct"
# SmolLM2-135M-Instruct's shapes (its GGUF's metadata), for the estimate and bench_layers.
SMOLLM2_CONFIG = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
# Where each model's checkpoint directory is (the recipes' actor.path), by model name.
MODEL_DIRS = {
    SMOLLM2: "/tmp/areal-tik/smollm2",
    "Qwen3-0.6B": "/tmp/areal-tik/models/qwen3-0.6b-random",
    "Qwen3-1.7B": "/tmp/areal-tik/models/qwen3-1.7b-random",
    "Qwen2.5-1.5B": "/tmp/areal-tik/models/qwen2.5-1.5b-random",
    "Llama-3.2-1B": "/tmp/areal-tik/models/llama-3.2-1b-random",
    "tiny": "/tmp/areal-tik/tiny",
}
ALGORITHMS = ("GRPO", "Dr. GRPO", "DAPO-style", "PPO")


@dataclass(frozen=True)
class RecipeCard:
    name: str
    model: str        # a key of MODEL_DIRS
    algorithm: str    # one of ALGORITHMS
    measures: str


def _card(name, model, algorithm, measures) -> RecipeCard:
    return RecipeCard(name, model, algorithm, measures)


CARDS: tuple[RecipeCard, ...] = (
    _card("basic_arithmetic_grpo_smollm2", SMOLLM2, "GRPO", "reward ratio with real weights, short responses"),
    _card("basic_arithmetic_async_grpo_smollm2", SMOLLM2, "GRPO",
          "reward ratio when stale tokens are recomputed and fresh ones reused"),
    _card("basic_arithmetic_ppo_smollm2", SMOLLM2, "PPO", "reward ratio under batch-whitened advantages (no critic: see README)"),
    _card("fraction_simplification_dapo_smollm2", SMOLLM2, "DAPO-style",
          "reward ratio under clip-higher and the overlong penalty, math-verify"),
    _card("gsm_symbolic_grpo_qwen3_0_6b", "Qwen3-0.6B", "GRPO", "throughput at Qwen3-0.6B's shapes"),
    _card("gsm_symbolic_async_grpo_qwen3_0_6b", "Qwen3-0.6B", "GRPO",
          "throughput, async with 2 versions of staleness, long responses"),
    _card("simple_equations_grpo_qwen3_1_7b", "Qwen3-1.7B", "GRPO", "throughput, longest synchronous responses"),
    _card("chain_sum_async_dapo_qwen3_1_7b", "Qwen3-1.7B", "DAPO-style", "throughput, async DAPO-style"),
    _card("basic_arithmetic_drgrpo_qwen2_5_1_5b", "Qwen2.5-1.5B", "Dr. GRPO",
          "throughput with q/k/v biases (Qwen2.5)"),
    _card("gsm_symbolic_async_grpo_qwen2_5_1_5b", "Qwen2.5-1.5B", "GRPO", "throughput, async, long responses"),
    _card("basic_arithmetic_grpo_llama3_2_1b", "Llama-3.2-1B", "GRPO",
          "throughput at the largest vocabulary, shortest responses"),
    _card("simple_equations_async_drgrpo_llama3_2_1b", "Llama-3.2-1B", "Dr. GRPO", "throughput, async Dr. GRPO"),
    # CPU smoke recipes (the Triton interpreter): the machinery, not a measurement.
    _card("chain_sum_grpo_tiny_cpu", "tiny", "GRPO", "CPU smoke test of the whole loop"),
    _card("chain_sum_async_grpo_tiny_cpu", "tiny", "GRPO", "CPU smoke test, asynchronous"),
)
END_TO_END = tuple(c.name for c in CARDS if c.model != "tiny")


def recipe_names() -> list[str]:
    """Every recipe shipped in ``recipes/`` (fragments with a leading '_' left out)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.name.startswith("_"))


def recipe_file(name: str) -> Path:
    """The YAML of recipe ``name``; ValueError listing the recipes when there is none."""
    if not isinstance(name, str) or name.startswith("_") or not (RECIPES_DIR / f"{name}.yaml").is_file():
        raise ValueError(f"no recipe named {name!r}; the recipes are: {', '.join(recipe_names())}")
    return RECIPES_DIR / f"{name}.yaml"


def card(name: str) -> RecipeCard:
    recipe_file(name)
    for c in CARDS:
        if c.name == name:
            return c
    raise ValueError(f"recipe {name!r} has no card in areal_tik.adapter.recipes.CARDS")


def algorithm_of(config) -> str:
    """The algorithm the loss options make: PPO (a critic, or batch-whitened advantages
    without a group baseline), DAPO-style (clip-higher and
    the overlong penalty), Dr. GRPO (group mean without std) or GRPO (group mean and std)."""
    actor = config.actor
    if config.critic is not None or (actor.reward_norm is None and actor.adv_norm is not None
                                     and actor.adv_norm.mean_level == "batch"):
        return "PPO"
    if actor.eps_clip_higher is not None and actor.overlong_reward_penalty:
        return "DAPO-style"
    norm = actor.reward_norm
    if norm is not None and norm.mean_level == "group":
        return "GRPO" if norm.std_level == "group" else "Dr. GRPO"
    raise ValueError(f"recipe {config.experiment_name!r}: no known algorithm in its loss options")


def parameter_count(shape: dict) -> int:
    """Parameters of a Llama/Qwen decoder of ``shape`` (HF config keys)."""
    h, inter, n_layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    bias = (q + 2 * kv) if shape["model_type"] == "qwen2" else 0
    per_layer = 2 * h * q + 2 * h * kv + bias + 3 * h * inter + 2 * h
    qk_norm = 2 * head_dim if shape["model_type"] == "qwen3" else 0
    embed = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings", True) else 2)
    return embed + n_layers * (per_layer + qk_norm) + h


def model_shape(model: str) -> dict | None:
    if model == SMOLLM2:
        return SMOLLM2_CONFIG
    from areal_tik.model import PUBLISHED_CONFIGS

    return PUBLISHED_CONFIGS.get(model)


def estimated_gpu_gb(recipe: RecipeCard, config) -> float | None:
    """Training state (12 B/param, twice with a critic) plus the engine's pool
    (``tik.gpu_memory_utilization`` of an H200); activations are not counted."""
    shape = model_shape(recipe.model)
    if shape is None:
        return None
    models = 2 if config.critic is not None else 1
    train = models * parameter_count(shape) * TRAIN_BYTES_PER_PARAM / 1e9
    return train + config.tik.gpu_memory_utilization * H200_GB


def cells(config) -> dict:
    """The table cells a loaded recipe fills (task, verifier, sync/async, lengths)."""
    staleness = config.rollout.max_head_offpolicyness
    reward = config.task.reward.rsplit(".", 1)[-1]
    return {
        "task": config.task.name,
        "verifier": "math-verify" if reward == "math_verify_reward_fn" else "score_answer",
        "schedule": f"async (staleness {staleness})" if staleness >= 1 else "sync",
        "decoupled": bool(config.actor.use_decoupled_loss),
        "max_new_tokens": config.gconfig.max_new_tokens,
        "batch": f"{config.train_dataset.batch_size}x{config.gconfig.n_samples}",
        "algorithm": algorithm_of(config),
        "steps": config.total_train_steps,
    }


def recipe_table(load) -> str:
    """The README table of the twelve end-to-end recipes; ``load(name)`` gives a config."""
    lines = ["| recipe | model | algorithm | task (verifier) | schedule | response tokens | batch "
             "| est. GPU GB | measures |", "|" + "---|" * 9]
    for c in CARDS:
        if c.model == "tiny":
            continue
        config = load(c.name)
        cell = cells(config)
        weights = "real" if c.model == SMOLLM2 else "random"
        lines.append(f"| `{c.name}` | {c.model} ({weights}) | {c.algorithm} | {cell['task']} ({cell['verifier']}) "
                     f"| {cell['schedule']} | {cell['max_new_tokens']} | {cell['batch']} "
                     f"| {estimated_gpu_gb(c, config):.0f} | {c.measures} |")
    return "\n".join(lines)

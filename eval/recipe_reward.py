"""What a recipe's model scores on its task before training: the reward a run starts from.

    python3 -m eval.recipe_reward --recipe basic_arithmetic_grpo_smollm2 --prompts 48
    python3 -m eval.recipe_reward --recipe basic_arithmetic_grpo_smollm2 \\
        --reward areal_tik.adapter.tasks.reward_fn areal_tik.adapter.verifiers.math_verify_reward_fn

The recipe's prompts (its task, instruction and seed, through the chat template as AReaL's
RLVR workflow builds them), sampled with Hugging Face ``generate`` at the recipe's
temperature (full vocabulary) and ``max_new_tokens``, ``gconfig.n_samples`` per prompt, then
scored by each reward function given (default: the recipe's ``task.reward``). A reward ratio
between two runs can only be told from noise when this is well above 0: with p the mean reward
and n samples a step, one step's standard error is sqrt(p (1 - p) / n). Prints the mean reward
per function and that standard error at the recipe's samples per step. Runs on CPU (a few
minutes for SmolLM2-135M at 48 prompts) or a GPU; the checkpoint is written first if missing,
as ``areal-tik run`` does.
"""
from __future__ import annotations

import argparse
import math
import time


def sample(model_path: str, rows: list[dict], n_samples: int, temperature: float, max_new_tokens: int,
           seed: int = 0) -> list[list[str]]:
    """``n_samples`` completions (text, special tokens kept) for each row's messages."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, num_return_sequences=n_samples,
                             pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    return [texts[i * n_samples:(i + 1) * n_samples] for i in range(len(rows))]


def score(reward, rows: list[dict], completions: list[list[str]]) -> float:
    """The mean of ``reward`` over every completion (AReaL's reward-function signature)."""
    values = [float(reward(prompt="", completion=c, prompt_ids=[], completion_ids=[], answer=r["answer"],
                           task=r["task"], entry=r["entry"]))
              for r, cs in zip(rows, completions) for c in cs]
    return sum(values) / len(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--reward", nargs="+", default=None, help="import strings (default: the recipe's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the recipe (repeatable), e.g. --set actor.path=/tmp/m")
    args = parser.parse_args(argv)
    from areal.utils.dynamic_import import import_from_string

    from areal_tik.adapter import apply_patches, recipes
    from areal_tik.adapter.demo import load_config
    from areal_tik.adapter.run import ensure_model
    from areal_tik.adapter.tasks import _rows

    with apply_patches():
        config = load_config(recipes.recipe_file(args.recipe), [f"++{o}" for o in args.set])
    ensure_model(recipes.card(args.recipe), config.actor.path)
    g = config.gconfig
    new = args.max_new_tokens or g.max_new_tokens
    rows = _rows(config.task, args.prompts, config.task.seed)
    start = time.perf_counter()
    completions = sample(config.actor.path, rows, g.n_samples, g.temperature, new)
    per_step = config.train_dataset.batch_size * g.n_samples
    print(f"{args.recipe}: {args.prompts} prompts x {g.n_samples} samples at T = {g.temperature}, "
          f"{new} new tokens, in {time.perf_counter() - start:.0f} s")
    for name in args.reward or [config.task.reward]:
        p = score(import_from_string(name), rows, completions)
        print(f"  {name}: mean reward {p:.4f}; one step's standard error at {per_step} samples "
              f"{math.sqrt(p * (1 - p) / per_step):.4f}")
    print(f"  e.g. {completions[0][0][:100]!r} (answer {rows[0]['answer']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

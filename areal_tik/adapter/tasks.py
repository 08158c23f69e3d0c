"""reasoning-gym tasks as AReaL RL datasets, scored by the task's own ``score_answer``.

``rl_dataset(TaskConfig(name="chain_sum", size=64))`` gives a ``datasets.Dataset`` whose
rows carry ``messages`` (what ``RLVRWorkflow`` turns into a prompt), ``answer`` and the
JSON-encoded reasoning-gym entry; ``reward_fn`` (pass it to RLVRWorkflow as
``"areal_tik.adapter.tasks.reward_fn"``) scores a completion with that task's
``score_answer``. Everything is generated offline.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from .config import TikGRPOConfig

INSTRUCTION = "Answer with the number only."


@dataclass
class TaskConfig:
    name: str = field(default="chain_sum", metadata={"help": "reasoning-gym dataset name."})
    size: int = field(default=256, metadata={"help": "Training items."})
    seed: int = field(default=1, metadata={"help": "Generator seed."})
    eval_size: int = field(default=0, metadata={"help": "Held-out items (0: no validation set)."})
    params: dict = field(default_factory=dict, metadata={"help": "Task options (e.g. num_terms)."})
    instruction: str = field(default=INSTRUCTION, metadata={"help": "Appended to each question."})
    reward: str = field(default="areal_tik.adapter.tasks.reward_fn",
                        metadata={"help": "RLVRWorkflow reward_fn import path."})

    def __post_init__(self):
        for name in ("size", "eval_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"task.{name} must be an int >= 0, got {value!r}")
        if self.size == 0:
            raise ValueError("task.size must be > 0")


@dataclass
class ReasoningGymGRPOConfig(TikGRPOConfig):
    """TikGRPOConfig plus the reasoning-gym task of the recipe scripts."""

    task: TaskConfig = field(default_factory=TaskConfig)


def _rows(task: "TaskConfig", size: int, seed: int) -> list[dict]:
    import reasoning_gym

    data = reasoning_gym.create_dataset(task.name, size=size, seed=seed, **task.params)
    rows = []
    for entry in data:
        content = f"{entry['question']} {task.instruction}".strip()
        rows.append({
            "messages": [{"role": "user", "content": content}],
            "answer": str(entry["answer"]),
            "task": task.name,
            "entry": json.dumps(entry, default=str),
        })
    return rows


def rl_dataset(task: TaskConfig, split: str = "train"):
    """The ``split`` ("train" or "valid") of ``task`` as a ``datasets.Dataset`` (or None)."""
    from datasets import Dataset

    if split == "train":
        return Dataset.from_list(_rows(task, task.size, task.seed))
    if split == "valid":
        if task.eval_size == 0:
            return None
        return Dataset.from_list(_rows(task, task.eval_size, task.seed + 1_000_003))
    raise ValueError(f"split must be 'train' or 'valid', got {split!r}")


def check_task(task: TaskConfig, rows: int = 3) -> None:
    """Fail now, not mid-run, when ``task`` cannot be trained on: it builds ``rows`` items
    through reasoning-gym and its reward function (``task.reward``, imported with the
    modules it needs) scores each item's own answer 1.0 and a non-answer 0.0.

    A run whose reward function cannot import (math-verify missing on the H200, once)
    otherwise starts, generates, and retries the reward in AReaL's worker until its time
    limit; a task given another task's params stops at its first rollout."""
    from areal.utils.dynamic_import import import_from_string

    reward = import_from_string(task.reward)
    for row in _rows(task, rows, task.seed):
        fields = dict(prompt="", prompt_ids=[], completion_ids=[], answer=row["answer"],
                      task=row["task"], entry=row["entry"])
        right = reward(completion=f"{row['answer']}<|im_end|>", **fields)
        wrong = reward(completion="no answer here<|im_end|>", **fields)
        if (right, wrong) != (1.0, 0.0):
            raise ValueError(f"task {task.name!r}: {task.reward} scores the task's own answer "
                             f"{row['answer']!r} {right} (expected 1.0) and a non-answer {wrong} "
                             f"(expected 0.0)")


@functools.lru_cache(maxsize=32)
def _scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def extract_answer(completion: str) -> str:
    """The completion's answer: the text before the end-of-turn token, stripped."""
    return completion.split("<|im_end|>")[0].split("<|endoftext|>")[0].strip()


def reward_fn(prompt, completion, prompt_ids, completion_ids, task, entry, **kwargs) -> float:
    """RLVRWorkflow reward: reasoning-gym's ``score_answer`` of the completion (0..1)."""
    record = json.loads(entry)
    return float(_scorer(task)(answer=extract_answer(completion), entry=record))


def shaped_reward_fn(prompt, completion, prompt_ids, completion_ids, task, entry, **kwargs) -> float:
    """``0.9 * score_answer + 0.1 * (fraction of answer characters that are digits or '-')``.

    The format term gives an untrained (e.g. random tiny) model a reward that varies
    across samples, so GRPO advantages and weight updates are non-zero from step 1.
    """
    answer = extract_answer(completion)
    shape = sum(c.isdigit() or c == "-" for c in answer) / len(answer) if answer else 0.0
    score = reward_fn(prompt, completion, prompt_ids, completion_ids, task, entry, **kwargs)
    return 0.9 * score + 0.1 * shape

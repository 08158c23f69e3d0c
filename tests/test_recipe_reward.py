"""eval/recipe_reward.py: its scoring is the reward functions' own (a right and a wrong
completion average to 0.5 under both verifiers), and a SmolLM2 recipe samples and scores on
CPU end to end."""
from __future__ import annotations

import pytest

from eval.recipe_reward import main, score


def test_score_averages_each_reward_over_every_completion():
    from areal_tik.adapter.tasks import TaskConfig, _rows, reward_fn
    from areal_tik.adapter.verifiers import math_verify_reward_fn

    task = TaskConfig(name="basic_arithmetic", params={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                       "max_digits": 1}, size=2)
    rows = _rows(task, 2, 1)
    right = [f"{r['answer']}<|im_end|>" for r in rows]
    completions = [[right[0], "no answer<|im_end|>"], [right[1], "no answer<|im_end|>"]]
    assert score(reward_fn, rows, completions) == 0.5
    assert score(math_verify_reward_fn, rows, completions) == 0.5
    talk = [[f"so the sum is {r['answer']}.<|im_end|>"] for r in rows]  # free text: only math-verify finds it
    assert score(math_verify_reward_fn, rows, talk) == 1.0 > score(reward_fn, rows, talk)


@pytest.mark.slow
def test_a_smollm2_recipe_samples_and_scores_on_cpu(tmp_path, capsys):
    assert main(["--recipe", "basic_arithmetic_grpo_smollm2", "--prompts", "2", "--max-new-tokens", "4",
                 "--reward", "areal_tik.adapter.tasks.reward_fn", "areal_tik.adapter.verifiers.math_verify_reward_fn",
                 "--set", f"actor.path={tmp_path / 'smollm2'}"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 4 samples at T = 1.0, 4 new tokens" in out
    for name in ("tasks.reward_fn", "verifiers.math_verify_reward_fn"):
        line = next(l for l in out.splitlines() if name in l)
        assert 0.0 <= float(line.split("mean reward ")[1].split(";")[0]) <= 1.0

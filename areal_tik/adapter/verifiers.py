"""Verifiers for tasks whose answers are math: math-verify through AReaL's worker.

``math_verify_reward_fn`` (``task.reward: areal_tik.adapter.verifiers.math_verify_reward_fn``)
parses the completion and the reference answer as expressions or LaTeX and compares them
symbolically (``138/583`` equals ``276/1166``, ``x = 13`` equals ``13``), with AReaL's
thread-safe timeout. reasoning-gym's own ``score_answer`` (``tasks.reward_fn``) compares
strings or numbers per task; the recipes use math-verify where the answer is a number,
fraction or expression.
"""
from __future__ import annotations

from .tasks import extract_answer


def math_verify_reward_fn(prompt, completion, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when math-verify finds the completion's answer equal to ``answer``, else 0.0."""
    from areal.reward import get_math_verify_worker

    return float(get_math_verify_worker().verify(extract_answer(completion), str(answer)))

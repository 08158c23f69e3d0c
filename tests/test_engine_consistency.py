"""The rollout-vs-training diagnosis on the standard ops: well-formed results."""
from __future__ import annotations

from areal_tik.engine import SamplingParams
from areal_tik import consistency

from ._engine_utils import prompts_of, small_engine
from ._engine_utils import standard  # noqa: F401 - fixture


def test_standard_ops_diagnosis_names_an_op(standard):
    # The standard path is not batch invariant in general; when it differs, the diagnosis
    # must name the first op whose row differs (here checked for well-formedness only).
    with small_engine(standard) as llm:
        outs = llm.generate(prompts_of([5, 12]), SamplingParams(max_new_tokens=4, ignore_eos=True, seed=2))
    result = consistency.compare(outs, consistency.packed_logprobs(standard, outs))
    div = consistency.first_divergence(standard, outs, 1, 2, block_size=16)
    assert div.position == 12 + 2 - 1 and div.regime == "decode" and div.ops_compared > 0
    assert (div.where is None) == (div.max_abs_delta == 0.0)
    assert 0 < result.num_tokens == 8

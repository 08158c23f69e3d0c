"""``first_divergence`` against a known fault: an op made deliberately row-count dependent
(its output's lowest bit flips for more than one row, so a decode step's single row differs
from the packed forward's) is named, layer and op; without the fault no op differs.

CPU: one tiny unified model under the interpreter (a few seconds per diagnosis).
"""
from __future__ import annotations

import pytest

from areal_tik.consistency import first_divergence
from areal_tik.engine.sequence import GenerationOutput
from areal_tik.model import UnifiedCausalLM

from ._engine_utils import prompts_of
from ._engine_utils import hf_small  # noqa: F401 - fixture
from ._planted import planted_ops

PROMPT, RESPONSE = prompts_of([6, 3], seed=5)


def _output() -> GenerationOutput:
    # The diagnosis replays the tokens; recorded log-probs play no part in it.
    return GenerationOutput(prompt_ids=PROMPT, token_ids=RESPONSE, logprobs=[0.0] * 3, versions=[0] * 3,
                            finish_reason="length")


@pytest.mark.parametrize("planted, where", [(None, None), ("silu_mul", "layer 0 silu_mul"),
                                            ("linear", "layer 0 linear")])
def test_first_divergence_names_the_planted_op(hf_small, planted, where):
    ops = "unified" if planted is None else planted_ops(planted, threshold=1)
    model = UnifiedCausalLM.from_hf(hf_small, kernels=ops)
    div = first_divergence(model, [_output()], request=0, token=2, block_size=16)
    assert (div.regime, div.position) == ("decode", len(PROMPT) + 1)
    assert div.where == where
    if planted is None:
        assert div.max_abs_delta == 0.0 and div.ops_compared > 10
    else:
        assert div.max_abs_delta > 0.0
    if planted == "silu_mul":
        assert div.ops_compared > 5  # norm, projections, rope, attention, ... agreed before it

"""Tensor-parallel rollout (TP_DESIGN): TP = t engine == TP = 1 engine == TP = 1 packed
training forward, bitwise, all with the same k_groups; bad splits refused at config time.

The multi-rank cases run one process per rank over gloo under the Triton interpreter
(``_tp.run_ranks``) on tiny models; each takes tens of seconds on two cores.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.tensor_parallel import Agreed, LocalView, StepAgreement, init_tensor_parallel
from areal_tik.model import ModelSpec, UnifiedCausalLM, random_model, tiny_config
from areal_tik.model.tensor_parallel import shard_model

from ._bits import assert_bitwise
from ._engine_utils import assert_bitwise_logprobs, assert_same_outputs, prompts_of
from ._tp import run_ranks

ENGINE = dict(max_num_seqs=4, max_model_len=32, kv_block_size=16)
PROMPTS = prompts_of([5, 9], seed=7, vocab=256)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)  # a prefill and a decode step
ONE_LAYER = {"num_hidden_layers": 1}  # interpreted kernels cost per launch: keep them few
CASES = {  # name: (family, config overrides, seed, tensor_parallel_size, k_groups[, vocab_parallel])
    "qwen3-tp2-g4": ("qwen3", ONE_LAYER, 11, 2, 4),
    "llama-tp4-g4": ("llama", {**ONE_LAYER, "num_key_value_heads": 4}, 12, 4, 4),
    # vocabulary-sharded embedding / LM head, in splits of 64 tokens under the interpreter:
    # 256 = 2 + 2 splits; 320 = 1 + 1 + 1 + 2 (uneven runs, as Qwen3's 297 splits at TP = 2)
    "qwen3-tp2-g2-vocab-tied": ("qwen3", {**ONE_LAYER, "tie_word_embeddings": True}, 13, 2, 2, True),
    "llama-tp4-g4-vocab": ("llama", {**ONE_LAYER, "num_key_value_heads": 4, "vocab_size": 320}, 14, 4, 4, True),
}


def _vocab_parallel(case: str) -> bool:
    return len(CASES[case]) > 5 and CASES[case][5]


def _params(case: str):
    """The vocabulary-sharded cases also sample greedy and filtered rows (top-k / top-p rows
    gather the logits; the others gather each rank's candidate)."""
    if not _vocab_parallel(case):
        return PARAMS
    other = (SamplingParams(temperature=0.8, top_k=8, max_new_tokens=2, ignore_eos=True) if CASES[case][0] == "qwen3"
             else SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    filtered = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=2, ignore_eos=True)
    return [PARAMS if CASES[case][0] == "qwen3" else filtered, other]


def _hf(case: str, seed: int | None = None):
    family, overrides, default_seed = CASES[case][:3]
    return random_model(tiny_config(family, **overrides), seed=default_seed if seed is None else seed)


def _model(case: str) -> UnifiedCausalLM:
    return UnifiedCausalLM.from_hf(_hf(case), k_groups=CASES[case][4])


def _row_operands():
    """fp32 operands of one row-parallel linear (fp32 out: no bf16 rounding hides a sum order)."""
    gen = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((5, 64), (32, 64), (32,)))
    return x, w, b


def _rank_row_proj(model, k_groups: int) -> torch.Tensor:
    """This rank's ``row_proj`` over its K slice of ``_row_operands``: the gathered tree."""
    x, w, b = _row_operands()
    shard = model.tensor_parallel
    width = 64 // shard.size
    module = torch.nn.Linear(width, 32)
    module.weight = torch.nn.Parameter(w.narrow(1, shard.rank * width, width).clone())
    module.bias = torch.nn.Parameter(b.clone())
    with torch.no_grad():
        return model.row_proj(model.ops)(x.narrow(1, shard.rank * width, width), module)


def _rank(rank: int, size: int, init_method: str, case: str, update_seed: int | None):
    """One rank: shard, the row-parallel tree on fp32 operands, generate, (optionally)
    update to other full weights and generate again."""
    config = EngineConfig(**ENGINE, tensor_parallel_size=size, k_groups=CASES[case][4],
                          vocab_parallel=_vocab_parallel(case))
    group = init_tensor_parallel(config, "cpu", init_method=init_method, rank=rank)
    try:
        model = shard_model(_model(case), group.rank, group.size, group.device_group,
                            vocab_parallel=config.vocab_parallel)
        row = _rank_row_proj(model, config.k_groups)
        with LLM(model, config, tensor_parallel=group) as llm:
            outputs = [llm.generate(PROMPTS, _params(case))]
            if update_seed is not None:
                llm.update_weights(_hf(case, update_seed))
                outputs.append(llm.generate(PROMPTS, _params(case)))
            outputs.append(llm.vocab_parallel_stats)
        return row, outputs
    finally:
        dist.destroy_process_group()


def _check_case(case: str, tmp_path, update_seed: int | None = None) -> None:
    size = CASES[case][3]
    rows, ranks = zip(*run_ranks(_rank, size, tmp_path, case, update_seed))
    stats = [outputs.pop() for outputs in ranks]
    model = _model(case)
    _check_vocab_stats(model, stats, size if _vocab_parallel(case) else 1)
    with torch.no_grad():  # the gathered fp32 tree == linear(k_groups=G) on one device, every rank
        x, w, b = _row_operands()
        whole = model.ops.linear(x, w, b, k_groups=model.k_groups)
    for r, row in enumerate(rows):
        assert_bitwise(row, whole, f"rank {r}'s row-parallel linear")
    with LLM(model, EngineConfig(**ENGINE, k_groups=model.k_groups)) as llm:
        single = llm.generate(PROMPTS, _params(case))
    assert sum(len(o.token_ids) for o in single) == len(PROMPTS) * PARAMS.max_new_tokens
    assert_bitwise_logprobs(model, single)  # TP = 1 engine == TP = 1 training forward, same k_groups
    for outputs in ranks:
        assert_same_outputs(outputs[0], single)  # TP = t engine == TP = 1 engine, every rank
        for later, first_rank in zip(outputs[1:], ranks[0][1:]):
            assert_same_outputs(later, first_rank)
    if update_seed is not None:  # after a full-weight update: TP = t engine == TP = 1 training forward
        model.hf_model.load_state_dict(_hf(case, update_seed).state_dict())
        assert_bitwise_logprobs(model, ranks[0][1], grad=True)  # with autograd, as the trainer runs it


def _check_vocab_stats(model, stats, size: int) -> None:
    """Each rank's rows: its run of 64-token splits; the bytes of the rows it does not hold."""
    if size == 1:
        assert all(s == {"vocab_parallel": False, "vocab_rows": None, "vocab_saved_bytes": 0} for s in stats)
        return
    vocab, hidden = model.spec.vocab, model.spec.hidden
    tensors = 1 if model.spec.tie_embeddings else 2
    firsts = [min(64 * (r * -(-vocab // 64) // size), vocab) for r in range(size + 1)]
    for r, s in enumerate(stats):
        kept = firsts[r + 1] - firsts[r]
        assert s == {"vocab_parallel": True, "vocab_rows": [firsts[r], firsts[r + 1]],
                     "vocab_saved_bytes": tensors * (vocab - kept) * hidden * 2}, (r, s)


def test_tp2_qwen3_rollout_equals_tp1_and_training_with_a_weight_update(tmp_path):
    _check_case("qwen3-tp2-g4", tmp_path, update_seed=21)


def test_tp4_llama_rollout_equals_tp1_and_training(tmp_path):
    _check_case("llama-tp4-g4", tmp_path)


def test_tp2_qwen3_tied_vocab_parallel_equals_tp1_and_training_with_a_weight_update(tmp_path):
    _check_case("qwen3-tp2-g2-vocab-tied", tmp_path, update_seed=22)


def test_tp4_llama_vocab_parallel_equals_tp1_and_training(tmp_path):
    _check_case("llama-tp4-g4-vocab", tmp_path)


# ------------------------------------------------------------------ bad input


def _spec(**overrides) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_config("qwen3", **overrides))


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=2), ["tensor_parallel_size=2", "k_groups (1)"]),
    (dict(tensor_parallel_size=8, k_groups=4), ["tensor_parallel_size=8", "k_groups (4)"]),
    (dict(tensor_parallel_size=3, k_groups=4), ["tensor_parallel_size", "3"]),
    (dict(k_groups=16), ["k_groups", "16"]),
    (dict(k_groups=0), ["k_groups", "0"]),
])
def test_engine_config_refuses_a_bad_split(kwargs, words):
    with pytest.raises(ValueError) as info:
        EngineConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("spec_overrides, kwargs, words", [
    ({}, dict(tensor_parallel_size=4, k_groups=4), ["tensor_parallel_size=4", "KV heads (2)"]),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, dict(tensor_parallel_size=4, k_groups=4),
     ["tensor_parallel_size=4", "query heads (2)"]),
    ({"intermediate_size": 36}, dict(k_groups=8), ["k_groups=8", "down_proj", "(36)"]),
    ({"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4}, dict(k_groups=8),
     ["k_groups=8", "o_proj", "(4)"]),
])
def test_engine_config_refuses_a_split_the_model_cannot_take(spec_overrides, kwargs, words):
    with pytest.raises(ValueError) as info:
        EngineConfig(**kwargs).check_model(_spec(**spec_overrides))
    for word in words:
        assert word in str(info.value)


def test_model_refuses_bad_k_groups_and_splits():
    hf = random_model(tiny_config("qwen3"), seed=1)
    with pytest.raises(ValueError, match="k_groups must be one of"):
        UnifiedCausalLM.from_hf(hf, k_groups=3)
    with pytest.raises(TypeError, match="k_groups must be an int"):
        UnifiedCausalLM.from_hf(hf, k_groups=2.0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide k_groups \(1\)"):
        shard_model(UnifiedCausalLM.from_hf(hf), 0, 2, None)
    model = UnifiedCausalLM.from_hf(hf, k_groups=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's KV heads \(2\)"):
        shard_model(model, 0, 4, None)
    with pytest.raises(ValueError, match=r"k_groups=2, the engine config says k_groups=1"):
        LLM(model, EngineConfig(**ENGINE))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs the group"):
        LLM(model, EngineConfig(**ENGINE, tensor_parallel_size=2, k_groups=2))


# ------------------------------------------------------------------ the step agreement


class _Ranks:
    """A group whose ranks' views are given (the agreement is a pure function of them)."""

    def __init__(self, views):
        self.views = views

    def gather(self, view):
        return [view, *self.views]


def _view(received=3, cancelled=(), ready=True, closing=False, version=0):
    return LocalView(received, frozenset(cancelled), ready, closing, version)


@pytest.mark.parametrize("others, agreed", [
    ([_view()], Agreed(3, frozenset(), True, ())),
    ([_view(received=1)], Agreed(1, frozenset(), True, ())),                  # a request still on its way
    ([_view(cancelled=(0, 2))], Agreed(3, frozenset({2}), True, ())),         # cancelled on every rank
    ([_view(ready=False)], Agreed(3, frozenset(), False, ())),                # one rank paused
    ([_view(version=1)], Agreed(3, frozenset(), False, ())),                  # an update seen on one rank
    ([_view(), _view(closing=True, ready=False)], Agreed(3, frozenset(), False, (2,))),
])
def test_step_agreement(others, agreed):
    assert StepAgreement(_Ranks(others))(_view(cancelled=(2, 1))) == agreed


def test_servers_with_another_k_groups_or_kernel_set_refuse_reuse_by_name():
    from areal_tik.adapter.config import server_refusals

    health = {"a:1": {"kernels": "unified", "k_groups": 4}, "b:2": {"kernels": "unified"},
              "c:3": {"kernels": "standard", "k_groups": 4}}
    assert server_refusals(health, 4) == [
        "areal-tik server c:3 runs 'standard' kernels, not 'unified'",
        "areal-tik server b:2's k_groups=1 differs from actor.tik_k_groups=4: o_proj / down_proj sum "
        "their K groups in another tree, so the rollout log-probs are not the trainer's bits"]
    assert server_refusals({"a:1": {"kernels": "unified", "k_groups": 1}}, 1) == []


@pytest.mark.parametrize("flags, words", [
    (["--tensor-parallel-size", "2"], ["tensor_parallel_size=2 does not divide k_groups (1)"]),
    (["--k-groups", "3"], ["k_groups must be one of (1, 2, 4, 8), got 3"]),
])
def test_serve_flags_come_from_the_engine_config_and_refuse_a_bad_split(flags, words):
    import argparse

    from areal_tik.adapter import server
    from areal_tik.errors import UsageError

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model", "unused", *flags])
    with pytest.raises(UsageError) as info:
        server.check_args(args)
    for word in words:
        assert word in str(info.value)
    ok = parser.parse_args(["--model", "unused", "--tensor-parallel-size", "2", "--k-groups", "2"])
    assert server.check_args(ok).tensor_parallel_size == 2  # served as 2 processes (server_tp)


def test_start_up_compiles_the_tree_and_each_ranks_partials():
    from areal_tik.engine.model_runner import warmup_shapes

    def shapes(k_groups, rank=None):
        model = UnifiedCausalLM.from_hf(random_model(tiny_config("qwen3"), seed=1), k_groups=k_groups)
        return warmup_shapes(model if rank is None else shard_model(model, rank, 2, None))

    # tiny qwen3: q/gate/up [64, 32], k/v [32, 32], o/down [32, 64]
    assert shapes(1).linears == ((32, 32, False), (32, 64, False), (64, 32, False)) and not shapes(1).partials
    assert shapes(4).linears == ((32, 32, False), (32, 64, False, 4), (64, 32, False))
    rank = shapes(4, rank=1)  # half the heads and MLP columns; o/down: the rank's 2 of 4 groups
    assert rank.linears == ((16, 32, False), (32, 32, False)) and rank.partials == ((32, 32, 2),)
    assert rank.heads == (2, 1, 16) and rank.intermediates == (32,)

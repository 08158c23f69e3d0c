"""The shipped recipes through AReaL's real (strict) config loader: the twelve end-to-end
configurations load, fill the cells their cards claim, and the README table is theirs."""
from __future__ import annotations

import re

import pytest

from areal_tik.adapter import apply_patches, recipes
from areal_tik.adapter.demo import load_config


@pytest.fixture(scope="module")
def loaded():
    with apply_patches():
        return {c.name: load_config(recipes.recipe_file(c.name)) for c in recipes.CARDS}


def test_every_yaml_is_a_card_and_there_are_twelve_end_to_end():
    assert sorted(c.name for c in recipes.CARDS) == recipes.recipe_names()
    assert len(recipes.END_TO_END) == 12


def test_each_recipe_fills_the_cells_of_its_card(loaded):
    for c in recipes.CARDS:
        config = loaded[c.name]
        assert recipes.algorithm_of(config) == c.algorithm, c.name
        assert config.actor.path == recipes.MODEL_DIRS[c.model], c.name
        assert config.actor.unified_kernels and config.actor.recompute_logprob, c.name
        if config.rollout.max_head_offpolicyness >= 1:  # async: the decoupled loss
            assert config.actor.use_decoupled_loss, c.name
        assert config.tik.max_model_len >= config.gconfig.max_new_tokens + config.train_dataset.max_length // 2


def test_the_twelve_span_models_algorithms_schedules_and_lengths(loaded):
    end = [loaded[name] for name in recipes.END_TO_END]
    cards = [recipes.card(name) for name in recipes.END_TO_END]
    assert {c.model for c in cards} == {recipes.SMOLLM2, "Qwen3-0.6B", "Qwen3-1.7B", "Qwen2.5-1.5B",
                                        "Llama-3.2-1B"}
    assert {recipes.algorithm_of(cfg) for cfg in end} == set(recipes.ALGORITHMS)
    schedules = {recipes.cells(cfg)["schedule"] for cfg in end}
    assert "sync" in schedules and any(s.startswith("async") for s in schedules)
    lengths = [cfg.gconfig.max_new_tokens for cfg in end]
    assert min(lengths) == 128 and max(lengths) >= 1024
    assert {recipes.cells(cfg)["verifier"] for cfg in end} == {"math-verify", "score_answer"}
    ppo = loaded["basic_arithmetic_ppo_smollm2"]
    assert ppo.critic is None and ppo.actor.reward_norm is None  # why no critic: recipes/_ppo.yaml


def test_readme_table_is_generated_from_the_recipes(loaded):
    readme = (recipes.RECIPES_DIR / "README.md").read_text()
    assert recipes.recipe_table(loaded.__getitem__) in readme


def test_an_unknown_key_fails_the_load():
    with apply_patches(), pytest.raises(ValueError, match="not_a_key"):
        load_config(recipes.recipe_file("basic_arithmetic_grpo_llama3_2_1b"), ["++actor.not_a_key=1"])


def test_an_unknown_recipe_lists_the_recipes():
    with pytest.raises(ValueError) as info:
        recipes.recipe_file("no_such_recipe")
    assert "no_such_recipe" in str(info.value)
    assert all(name in str(info.value) for name in recipes.recipe_names())
    with pytest.raises(ValueError):
        recipes.recipe_file("_gpu")  # a fragment is not a recipe


def test_run_command_answers_a_bad_recipe_or_mode_with_the_choices(capsys):
    from areal_tik.cli import main

    bad = [(["--recipe", "nope"], "no recipe named 'nope'.*basic_arithmetic_grpo_smollm2"),
           (["--recipe", "chain_sum_grpo_tiny_cpu", "--mode", "fast"],
            r"--mode must be one of \['tik', 'stock', 'both'\], got 'fast'"),
           (["--recipe", "chain_sum_grpo_tiny_cpu", "--stock-training", "vllm"],
            r"--stock-training must be one of \['areal_tik', 'hf'\], got 'vllm'"),
           (["--recipe", "chain_sum_grpo_tiny_cpu", "--mode", "tik", "--stock-training", "hf"],
            "--stock-training hf names the stock run's trainer")]
    for argv, message in bad:  # one line on stderr, exit code 2, no traceback
        capsys.readouterr()
        assert main(["run", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert re.search(f"areal-tik: error: {message}", err) and "Traceback" not in err, (argv, err)
        with pytest.raises(ValueError, match=message):  # --debug shows the error itself
            main(["--debug", "run", *argv])
    assert main(["run", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [c.name for c in recipes.CARDS]


def test_the_modes_differ_only_in_kernels_reuse_recompute_and_the_stock_engine(loaded):
    from areal_tik.adapter.run import mode_overrides

    assert mode_overrides("tik", 1024, 128) == ["++actor.unified_kernels=true", "++actor.tik_kernels=unified",
                                                "++actor.tik_reuse_logprobs=true"]
    assert mode_overrides("stock", 1024, 128) == ["++actor.unified_kernels=true", "++actor.tik_kernels=standard",
                                                  "++actor.tik_reuse_logprobs=false", "++actor.recompute_logprob=true",
                                                  "++tik.kv_block_size=1024", "++tik.num_kv_blocks=129",
                                                  "++tik.compile_standard_ops=true"]
    assert mode_overrides("stock", 640, 8)[-3:-1] == ["++tik.kv_block_size=1024", "++tik.num_kv_blocks=9"]
    # every recipe's stock engine holds a whole sequence in one block (its decode's FlashAttention
    # path reads one contiguous range per sequence), a block for each sequence of a step plus
    # the scratch block, and EngineConfig accepts it
    for name in loaded:
        asked = load_config(recipes.recipe_file(name), []).tik
        config = load_config(recipes.recipe_file(name), mode_overrides("stock", asked.max_model_len, asked.max_num_seqs))
        assert config.tik.max_blocks_per_seq == 1 and config.tik.kv_block_size < 2 * asked.max_model_len, name
        assert config.tik.num_kv_blocks == asked.max_num_seqs + 1, name
        assert config.tik.compile_standard_ops is True and asked.compile_standard_ops is False, name
        config.tik.__post_init__()  # EngineConfig's own checks
        config.tik.check_kernels(config.actor.tik_kernels)


def test_every_recipe_builds_its_task_and_its_verifier_accepts_the_tasks_answers(loaded):
    """Each recipe's task (name + its own params: a fragment's mapping would merge into
    it key by key) builds through reasoning-gym, and the recipe's reward function scores
    the task's own answer 1.0 and a wrong one 0.0 (``check_task``, which ``run`` calls
    before a run starts). The H200 run of gsm_symbolic_grpo_qwen3_0_6b stopped here before
    any step, on basic_arithmetic's min_terms inherited from _gpu.yaml."""
    from areal_tik.adapter.tasks import check_task

    for name, config in loaded.items():
        check_task(config.task)


def test_check_task_refuses_a_verifier_that_cannot_score_or_import(loaded):
    """The start-up check fails on a reward function that does not give the task's own
    answer 1.0 (the digit-shaped reward on a task whose answers are words: 0.9) and on one
    whose module does not import, before anything is trained."""
    import dataclasses

    from areal_tik.adapter.tasks import check_task

    task = loaded["chain_sum_grpo_tiny_cpu"].task
    with pytest.raises(ValueError, match="scores the task's own answer"):
        check_task(dataclasses.replace(task, name="spell_backward", params={},
                                       reward="areal_tik.adapter.tasks.shaped_reward_fn"))
    with pytest.raises(ImportError):
        check_task(dataclasses.replace(task, reward="areal_tik.adapter.no_such_module.reward_fn"))

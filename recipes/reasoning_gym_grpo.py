"""GRPO on a reasoning-gym task (offline data, task's own scorer) with AReaL's PPOTrainer.

    areal-tik launch recipes/reasoning_gym_grpo.py \
        --config recipes/chain_sum_grpo_tiny_cpu.yaml [key=value ...]

A stock AReaL script in all but the dataset: the areal-tik flag lives in the YAML.
"""
import sys

from areal import PPOTrainer
from areal.api.cli_args import load_expr_config

from areal_tik.adapter.tasks import ReasoningGymGRPOConfig, rl_dataset


def main(args):
    config, _ = load_expr_config(args, ReasoningGymGRPOConfig)
    workflow_kwargs = dict(
        reward_fn=config.task.reward,
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
        enable_thinking=False,
    )
    with PPOTrainer(config, train_dataset=rl_dataset(config.task, "train"),
                    valid_dataset=rl_dataset(config.task, "valid")) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])

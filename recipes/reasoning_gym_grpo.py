"""GRPO on a reasoning-gym task (offline data, task's own scorer) with AReaL's PPOTrainer.

    python3 -m areal.infra.launcher.local recipes/reasoning_gym_grpo.py \
        --config recipes/chain_sum_grpo_tiny_cpu.yaml [key=value ...]

(or ``areal-tik launch`` in place of AReaL's launcher; Ray and Slurm alike). A stock AReaL
script in all but the dataset and the one ``activate()`` call: the flag lives in the YAML.
"""
import sys

from areal_tik.adapter.launch import activate

activate()  # before AReaL builds anything: the areal-tik patches in every trainer process

from areal import PPOTrainer  # noqa: E402
from areal.api.cli_args import load_expr_config  # noqa: E402

from areal_tik.adapter.tasks import ReasoningGymGRPOConfig, rl_dataset  # noqa: E402


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

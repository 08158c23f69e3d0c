"""The trainer entry script of the data-parallel test, started by AReaL's own launcher.

A stock-style entry like ``recipes/reasoning_gym_grpo.py`` (``activate()`` at import, then
AReaL's PPOTrainer on the recipe), plus what the test needs to see inside each rank:

- at weights version 0, rank 0's rollout rows lose the exactness fields (as rows from a
  workflow that records no log-prob temperature): their reuse is refused, so rank 0 has
  nothing to audit while rank 1 has its sample;
- rank 1's training forward with gradients (only rank 1's, not its no-grad recompute)
  returns its log-probs with the lowest mantissa bit flipped, so step 1's audit passes
  and its first minibatch differs on that rank alone;
- each rank writes ``<cluster.fileroot>/rank<R>.json``: the patch sets active at start,
  the actor's class, its batches (rows and scored tokens per weights version), the rows
  of each areal-tik recompute and the versions at which AReaL's recompute pass ran here,
  the run state's summary and the exported stats of every step.
"""
import json
import os
import sys

from areal_tik.adapter.launch import activate

activate()

import torch  # noqa: E402
from areal.api.cli_args import load_expr_config  # noqa: E402

from areal_tik import patches  # noqa: E402
from areal_tik.adapter import demo, exactness, reuse, training  # noqa: E402
from areal_tik.adapter.actor import TikFSDPPPOActor  # noqa: E402
from areal_tik.adapter.tasks import ReasoningGymGRPOConfig, rl_dataset  # noqa: E402

RANK = int(os.environ["RANK"])
RECORD = {"rank": RANK, "patches": patches.active(), "batches": [], "tik_recomputes": [],
          "areal_recompute_versions": []}


def flip_on_rank_1(original):
    def perturbed(model, input_ids, positions, cu_seqlens, max_seqlen, targets, temperature, return_entropy):
        logprobs, entropy = original(model, input_ids, positions, cu_seqlens, max_seqlen, targets,
                                     temperature, return_entropy)
        if RANK != 1 or not return_entropy:  # return_entropy: the training pass, not a recompute
            return logprobs, entropy
        flipped = (logprobs.detach().view(torch.int32) ^ 1).view(torch.float32)
        return logprobs + (flipped - logprobs).detach(), entropy  # same gradient, other bits
    return perturbed


def recording(name, record):
    original = getattr(TikFSDPPPOActor, name)

    def wrapper(self, data, *args, **kwargs):
        record(self, data)
        return original(self, data, *args, **kwargs)
    return wrapper


def record_batch(actor, data):
    RECORD["actor_class"] = type(actor).__name__
    RECORD["batches"].append({"version": actor.get_version(),
                              "rows": sum(int(t["attention_mask"].shape[0]) for t in data),
                              "scored_tokens": sum(int(reuse.scored_mask(t).sum()) for t in data)})
    if RANK == 0 and actor.get_version() == 0:
        exactness.pop_fields(data)


def main(args):
    config, _ = load_expr_config(args, ReasoningGymGRPOConfig)
    training.unified_logprobs = flip_on_rank_1(training.unified_logprobs)
    TikFSDPPPOActor.compute_advantages = recording("compute_advantages", record_batch)
    TikFSDPPPOActor._recompute = recording(  # old_logprobs' recompute: audit sample, join
        "_recompute", lambda actor, data: RECORD["tik_recomputes"].append(
            [actor.get_version(), sum(int(t["attention_mask"].shape[0]) for t in data)]))
    TikFSDPPPOActor.compute_logp = recording(  # the trainer's recompute pass (ours calls PPOActor's)
        "compute_logp", lambda actor, data: RECORD["areal_recompute_versions"].append(actor.get_version()))
    workflow_kwargs = dict(reward_fn=config.task.reward, gconfig=config.gconfig,
                           tokenizer=config.tokenizer_path, enable_thinking=False)
    with demo.recording_trainer_class()(config, train_dataset=rl_dataset(config.task, "train"),
                                        valid_dataset=None) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)
        RECORD.update(summary=trainer.actor.tik_state.summary(), history=trainer.history)
    with open(os.path.join(config.cluster.fileroot, f"rank{RANK}.json"), "w") as f:
        json.dump(RECORD, f)


if __name__ == "__main__":
    main(sys.argv[1:])

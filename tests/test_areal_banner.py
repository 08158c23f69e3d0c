"""AReaL's banner and step lines under the patch list: with the flag on, the
``RECOMPUTED`` banner line is followed by the note that log-probs are reused, and the
per-step line leads with the run's train step; both are undone by ``revert()``."""
from __future__ import annotations

import logging
import types

from areal.trainer.ppo import actor as ppo_actor
from areal.trainer.ppo.actor import PPOActor
from areal.utils import stats_logger

from areal_tik.adapter import apply_patches, banner
from areal_tik.adapter.config import TikPPOActorConfig


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _banner(unified_kernels: bool, **tik) -> list[str]:
    config = TikPPOActorConfig(experiment_name="e", trial_name="t", path="unused", backend="fsdp:d1",
                               unified_kernels=unified_kernels, recompute_logprob=True,
                               use_decoupled_loss=False, **tik)
    handler = _Lines()
    ppo_actor.logger.addHandler(handler)
    try:
        PPOActor._log_configuration(types.SimpleNamespace(config=config))
    finally:
        ppo_actor.logger.removeHandler(handler)
    return handler.lines


def test_the_recompute_banner_is_annotated_only_with_the_flag():
    stock = _banner(True)
    assert any("old_logp (π_old): RECOMPUTED" in line for line in stock)
    assert banner.REUSE_NOTE not in stock
    with apply_patches():
        on, off = _banner(True), _banner(False)
        # a recipe's stock mode: the flag on, reuse off in the config; the recompute runs
        no_reuse = _banner(True, tik_reuse_logprobs=False)
        standard = _banner(True, tik_kernels="standard", tik_reuse_logprobs=False)
    recomputed = next(i for i, line in enumerate(on) if "RECOMPUTED" in line)
    assert on[-1] == banner.REUSE_NOTE and recomputed < len(on) - 1
    assert banner.REUSE_NOTE not in off
    assert banner.REUSE_NOTE not in no_reuse and banner.REUSE_NOTE not in standard
    assert any("RECOMPUTED" in line for line in standard)
    assert _banner(True) == stock  # reverted


def test_the_step_line_leads_with_the_train_step():
    # AReaL's totals are the dataset epoch's batches; the run's length replaces them.
    line = "Epoch 1/1 Step 1/32 Train step 1/32 done."
    assert banner.step_line(line, 3) == ("Train step 1/3 done (epoch 1/1, batch 1 of the 32 in an epoch "
                                         "of the dataset)")
    assert banner.step_line(line).startswith("Train step 1/32 done (epoch 1/1")
    assert banner.step_line("Stats (1/1):") == "Stats (1/1):"
    original = stats_logger.logger
    with apply_patches():
        handler = _Lines()
        original.addHandler(handler)
        try:
            stats_logger.logger.total_steps = 3  # what PPOTrainer.train sets from its config
            stats_logger.logger.info(line)
        finally:
            original.removeHandler(handler)
        assert handler.lines == [banner.step_line(line, 3)]
    assert stats_logger.logger is original

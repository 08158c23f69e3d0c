"""The ``"areal"`` patch set: the areal-tik actor, rollout engine hook and config loader.

Swapped attributes (AReaL itself is not modified or forked):

- ``areal.engine.FSDPPPOActor`` -> ``TikFSDPPPOActor`` (``PPOTrainer`` imports it by
  that name when it creates the actor and the ref model; unchanged without the flag);
- ``PPOTrainer.__init__`` and ``PPOTrainer._init_rollout`` -> wrappers that add the
  in-process areal-tik engine and the reuse checks (stock behaviour without the flag);
- ``areal.api.cli_args.load_expr_config`` -> a wrapper that loads the areal-tik config
  subclasses for stock scripts asking for ``GRPOConfig``/``PPOConfig``.
"""
from __future__ import annotations

from . import Swap


def swaps() -> list[Swap]:
    import areal.api.cli_args as cli_args
    import areal.engine as areal_engine
    from areal.trainer.rl_trainer import PPOTrainer

    from areal_tik.integration.actor import TikFSDPPPOActor
    from areal_tik.integration.trainer import wrap_init_rollout, wrap_load_expr_config, wrap_trainer_init

    return [
        Swap(areal_engine, "FSDPPPOActor", TikFSDPPPOActor),
        Swap(PPOTrainer, "__init__", wrap_trainer_init(PPOTrainer.__init__)),
        Swap(PPOTrainer, "_init_rollout", wrap_init_rollout(PPOTrainer._init_rollout)),
        Swap(cli_args, "load_expr_config", wrap_load_expr_config(cli_args.load_expr_config)),
    ]

"""The AReaL patch list: the areal-tik actor, rollout engine hook and config loader.

Swapped attributes (AReaL itself is not modified or forked):

- ``areal.engine.FSDPPPOActor`` -> ``TikFSDPPPOActor`` (``PPOTrainer`` imports it by
  that name when it creates the actor and the ref model; unchanged without the flag);
- ``PPOTrainer.__init__`` and ``PPOTrainer._init_rollout`` -> wrappers that add the
  in-process areal-tik engine and the reuse checks (stock behaviour without the flag);
- ``areal.api.cli_args.load_expr_config`` -> a wrapper that loads the areal-tik config
  classes for stock scripts asking for ``GRPOConfig``/``PPOConfig`` and names old or
  unknown areal-tik keys;
- two of AReaL's log lines, corrected for the flag (``banner``).

``apply()`` installs them all (or none) through the generic, nest-safe swap machinery
of ``areal_tik.patches`` and returns the handle whose ``revert()`` undoes them.
"""
from __future__ import annotations

from areal_tik.patches import PatchHandle, Swap, apply_swaps

NAME = "areal"


def swaps() -> list[Swap]:
    import areal.api.cli_args as cli_args
    import areal.engine as areal_engine
    from areal.trainer.rl_trainer import PPOTrainer

    from . import banner
    from .actor import TikFSDPPPOActor
    from .loader import wrap_load_expr_config
    from .trainer import wrap_init_rollout, wrap_trainer_init

    return [
        Swap(areal_engine, "FSDPPPOActor", TikFSDPPPOActor),
        Swap(PPOTrainer, "__init__", wrap_trainer_init(PPOTrainer.__init__)),
        Swap(PPOTrainer, "_init_rollout", wrap_init_rollout(PPOTrainer._init_rollout)),
        Swap(cli_args, "load_expr_config", wrap_load_expr_config(cli_args.load_expr_config)),
        *banner.swaps(),  # AReaL's banner and step lines, corrected for the flag
    ]


def apply() -> PatchHandle:
    """Install the AReaL patch list; ``handle.revert()`` (or ``with``) undoes it."""
    return apply_swaps(swaps(), name=NAME)

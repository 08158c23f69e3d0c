"""AReaL's config loader with the areal-tik classes and clear errors for areal-tik keys.

``wrap_load_expr_config`` (installed by ``patch_list``): a stock script asking for
``GRPOConfig``/``PPOConfig`` gets the areal-tik subclasses, so its YAML may carry the
flag. Before AReaL's strict load, the composed YAML (with its command-line overrides)
is read once for areal-tik keys, so that

- an old ``rollout.tik_<option>`` key names its new home, ``tik.<option>``, for every
  such key at once;
- an unknown key of the ``tik:`` block names itself and the known keys
  (``EngineConfig``'s fields);

and AReaL's own unknown-key error is re-raised as ``ValueError`` with a close match
among the areal-tik options.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools

from areal.api.cli_args import GRPOConfig, PPOConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from areal_tik.engine.config import EngineConfig
from areal_tik.errors import UsageError

from .config import TikGRPOConfig, TikInferenceEngineConfig, TikPPOActorConfig, TikPPOConfig
from .overrides import check_override_keys

ENGINE_BLOCK = "tik"


def tik_config_class(config_cls):
    """The areal-tik counterpart of a PPO config class (other classes pass through)."""
    if isinstance(config_cls, type) and issubclass(config_cls, TikPPOConfig):
        return config_cls
    if config_cls is GRPOConfig:
        return TikGRPOConfig
    if config_cls is PPOConfig:
        return TikPPOConfig
    if isinstance(config_cls, type) and issubclass(config_cls, PPOConfig):
        raise TypeError(
            f"{config_cls.__name__} subclasses AReaL's PPOConfig; to use the areal-tik options, "
            "derive it from areal_tik.adapter.config.TikGRPOConfig (or TikPPOConfig) instead")
    return config_cls


def engine_keys() -> list[str]:
    """The keys of the ``tik:`` block: ``EngineConfig``'s field names."""
    return [f.name for f in dataclasses.fields(EngineConfig)]


def moved_keys() -> dict[str, str]:
    """Old ``rollout.tik_<option>`` key -> its key in the ``tik:`` block."""
    return {f"rollout.tik_{name}": f"{ENGINE_BLOCK}.{name}" for name in engine_keys()}


def check_tik_keys(raw: dict) -> None:
    """ValueError naming every old rollout key (with its new key) and every unknown key of
    the ``tik:`` block (with the known ones) in a composed, not yet typed, config."""
    rollout = raw.get("rollout") or {}
    old = [f"{key} -> {new}" for key, new in moved_keys().items()
           if key.split(".", 1)[1] in rollout]
    if old:
        raise UsageError("the areal-tik engine options moved from rollout to the top-level "
                         f"{ENGINE_BLOCK}: block; rename " + ", ".join(old))
    block = raw.get(ENGINE_BLOCK)
    if block is None:
        return
    if not isinstance(block, dict):
        raise UsageError(f"{ENGINE_BLOCK}: must be a mapping of engine options, got {block!r}")
    unknown = sorted(set(block) - set(engine_keys()))
    if unknown:
        raise UsageError(f"unknown key(s) {[f'{ENGINE_BLOCK}.{k}' for k in unknown]} in the "
                         f"{ENGINE_BLOCK}: block; known keys (EngineConfig's fields): {engine_keys()}")


def tik_option_names() -> list[str]:
    names = []
    for prefix, cls in (("actor", TikPPOActorConfig), ("rollout", TikInferenceEngineConfig)):
        names += [f"{prefix}.{f.name}" for f in dataclasses.fields(cls)
                  if f.name == "unified_kernels" or f.name.startswith("tik_")]
    return names + [f"{ENGINE_BLOCK}.{name}" for name in engine_keys()]


def _composed(argv) -> dict:
    import areal.api.cli_args as cli_args

    cfg, _ = cli_args.parse_cli_args(list(argv))
    return OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else {}


def wrap_load_expr_config(original):
    @functools.wraps(original)
    def load_expr_config(argv, config_cls):
        config_cls = tik_config_class(config_cls)
        if isinstance(config_cls, type) and issubclass(config_cls, TikPPOConfig):
            check_override_keys(argv, config_cls)
            check_tik_keys(_composed(argv))
        try:
            return original(argv, config_cls)
        except ConfigKeyError as exc:
            key = getattr(exc, "full_key", None) or ""
            close = difflib.get_close_matches(str(key), tik_option_names(), n=3)
            hint = f" Did you mean {close}?" if close else ""
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(f"unknown config key {key!r} for {config_cls.__name__} ({first_line}).{hint} "
                             f"areal-tik options: {tik_option_names()}") from exc
    return load_expr_config

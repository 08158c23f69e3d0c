"""Command-line overrides (``key=value``) checked against the config before Hydra sees them.

Hydra answers a typo'd key (``actor.unified_kernal=true``) with a tip to append it
(``+actor.unified_kernal=true``), which would add a key AReaL then rejects or ignores.
``check_override_keys`` answers instead with the closest known keys: those of the
config class merged with the YAML, the way AReaL's loader composes them. Keys with a
``+``/``++``/``~`` prefix are left to Hydra (they say what they mean); a new key under an
open mapping (a ``dict`` field such as ``task.params``) is answered with its ``++`` form.
"""
from __future__ import annotations

import difflib

from areal_tik.errors import UsageError


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    config, overrides, it = None, [], iter(argv)
    for arg in it:
        if arg == "--config":
            config = next(it, None)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith(("+", "~", "-")):
            overrides.append(arg)
    return config, overrides


def _walk(node, prefix: str, keys: set[str], open_: set[str]) -> None:
    from omegaconf import DictConfig

    for k in node.keys():
        full = prefix + str(k)
        keys.add(full)
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            if child._is_none() or child._is_missing() or child._metadata.object_type in (None, dict):
                open_.add(full)
            if not (child._is_none() or child._is_missing()):
                _walk(child, full + ".", keys, open_)


def known_keys(config_cls, config_path: str | None) -> tuple[set[str], set[str]] | None:
    """(every dotted key, the keys of open mappings), or None if the config does not compose
    (AReaL's own loader then says why)."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.structured(config_cls)
        if config_path is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(config_path))
    except Exception:  # noqa: BLE001 - the real loader reports a config that does not compose
        return None
    keys, open_ = set(), set()
    _walk(cfg, "", keys, open_)
    return keys, open_


def check_override_keys(argv, config_cls) -> None:
    """UsageError naming the first override whose key is not in the config, with the closest keys."""
    config_path, overrides = _split(list(argv))
    if not overrides or not isinstance(config_cls, type):
        return
    found = known_keys(config_cls, config_path)
    if found is None:
        return
    keys, open_ = found
    for override in overrides:
        key = override.split("=", 1)[0]
        parts = key.split(".")
        if key in keys:
            continue
        mapping = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in open_), None)
        if mapping is not None:
            raise UsageError(f"override {override!r}: {mapping!r} is a mapping without the key {key!r}; "
                             f"add it with ++{override}")
        close = difflib.get_close_matches(key, sorted(keys), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "no close key"
        raise UsageError(f"override {override!r}: {config_cls.__name__} has no key {key!r}; {hint} "
                         "(a new key needs ++key=value)")

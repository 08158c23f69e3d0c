"""Reversible attribute swaps: the generic machinery under every patch set.

A patch set is a list of ``Swap(owner, attribute, replacement)``. ``apply_swaps(swaps,
name)`` sets every attribute and returns a :class:`PatchHandle`; ``handle.revert()``
puts back exactly what was there before this apply (which may be an outer apply's
replacement), so nested applies revert correctly when undone innermost first. A
failure half-way through an apply undoes what it had already set before re-raising.
Handles are context managers.

This module knows no patch set and imports nothing from areal_tik: the one set there is,
AReaL's, is listed by the adapter (``areal_tik.adapter.patch_list``) and applied with
``areal_tik.adapter.apply_patches()``.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_MISSING = object()
_LOCK = threading.Lock()
_ACTIVE: list["PatchHandle"] = []  # innermost last


@dataclass(frozen=True)
class Swap:
    """Set ``owner.attribute = replacement`` while applied."""

    owner: Any
    attribute: str
    replacement: Any

    def describe(self) -> str:
        name = getattr(self.owner, "__name__", type(self.owner).__name__)
        return f"{name}.{self.attribute}"


class PatchHandle:
    """What one ``apply`` changed; ``revert()`` undoes it (idempotent)."""

    def __init__(self, name: str, saved: list[tuple[Swap, Any]]):
        self.name = name
        self._saved = saved
        self.active = True

    def revert(self) -> None:
        with _LOCK:
            if not self.active:
                return
            if _ACTIVE and _ACTIVE[-1] is not self:
                raise RuntimeError(
                    f"patch set {self.name!r} reverted out of order: revert the inner "
                    f"set {_ACTIVE[-1].name!r} first")
            _restore(self._saved)
            self.active = False
            _ACTIVE.remove(self)

    def describe(self) -> list[str]:
        return [swap.describe() for swap, _ in self._saved]

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def _restore(saved: list[tuple[Swap, Any]]) -> None:
    for swap, old in reversed(saved):
        if old is _MISSING:
            delattr(swap.owner, swap.attribute)
        else:
            setattr(swap.owner, swap.attribute, old)


def apply_swaps(swaps: Iterable[Swap], name: str = "custom") -> PatchHandle:
    """Apply ``swaps`` in order; all or nothing."""
    saved: list[tuple[Swap, Any]] = []
    with _LOCK:
        try:
            for swap in swaps:
                if not isinstance(swap, Swap):
                    raise TypeError(f"expected a Swap, got {swap!r}")
                old = swap.owner.__dict__.get(swap.attribute, _MISSING) if isinstance(
                    swap.owner, type) else getattr(swap.owner, swap.attribute, _MISSING)
                setattr(swap.owner, swap.attribute, swap.replacement)
                saved.append((swap, old))
        except BaseException:
            _restore(saved)
            raise
        handle = PatchHandle(name, saved)
        _ACTIVE.append(handle)
        return handle


def active() -> list[str]:
    """Names of the patch sets applied now, outermost first."""
    with _LOCK:
        return [h.name for h in _ACTIVE]

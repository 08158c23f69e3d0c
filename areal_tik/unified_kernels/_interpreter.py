"""A faster ``_patch_builtin`` for the Triton interpreter (``TRITON_INTERPRET=1``).

The interpreter re-patches ``triton.language`` at every kernel launch and again at every
nested ``@triton.jit`` call: ``_patch_builtin(pkg, ...)`` lists every member of the module
or class with ``inspect.getmembers`` and wraps those that are still Triton builtins. Inside
a launch nearly all of them are already wrapped, so the listing is pure overhead: in the
CPU suite's AReaL trainer runs it was about a fifth of the interpreter's time (22,785 calls,
one per nested call, about 1 ms each).

``install()`` replaces it with the same loop over a list of builtin names taken once, before
any launch: each call still wraps exactly the members that are builtins at that moment, so
what is patched, in which order, and what ``restore`` undoes are unchanged (also when two
threads launch at once and one restores what the other patched: the next nested call wraps
them again, as before). Only triton 3.6 is patched (the version the project pins; the
function is private), and only packages listed at install time; any other package takes the
original path. ``tests/test_interpreter_patch.py`` compares both, change for change.
"""
from __future__ import annotations

import inspect

_installed = False


def builtin_names(pkg) -> tuple[str, ...]:
    """The names of ``pkg``'s members that are Triton builtins, in ``getmembers`` order."""
    import triton.language as tl

    return tuple(name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member))


def install() -> bool:
    """Replace the interpreter's ``_patch_builtin`` (once); False where it is not triton 3.6."""
    global _installed
    import triton
    import triton.language as tl

    if _installed:
        return True
    if not triton.__version__.startswith("3.6."):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None:
        return False
    packages = (tl, tl.tensor, tl.math, tl.core, tl.core.tensor, tl.core.tensor_descriptor_base)
    names = {id(pkg): (pkg, builtin_names(pkg)) for pkg in packages}

    def _patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return original(pkg, builder, scope)
        is_builtin = tl.core.is_builtin
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.original = original
    interpreter._patch_builtin = _patch_builtin
    _installed = True
    return True

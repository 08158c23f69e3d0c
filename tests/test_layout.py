"""The floors of the house, held by an AST check of every ``areal_tik`` import.

Imports run one way: kernels <- model <- engine <- adapter. The kernels import nothing
above them, the model only the kernels (and the leaf ``runtime``), the engine neither
the model package nor the adapter, the leaf helpers (``runtime``, ``patches``) nothing
of areal_tik, and no module imports the command line. No two modules (or folders)
import each other, directly or around a loop. Imports inside functions count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "areal_tik"

# part -> the parts of areal_tik it may import (besides itself); None: no rule but "no loop".
ALLOWED = {
    "runtime": set(),
    "patches": set(),
    "unified_kernels": set(),
    "model": {"unified_kernels", "runtime"},
    "engine": {"unified_kernels", "runtime"},
    "bitwise": {"unified_kernels"},
    "consistency": {"engine", "bitwise", "unified_kernels"},
}
FORBIDDEN_EVERYWHERE = {"cli"}  # the front door is imported by nothing inside the package


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every ``areal_tik`` module ``path`` imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}  # from pkg import submodule
    return {m for m in found if m == "areal_tik" or m.startswith("areal_tik.")}


def graph() -> dict[str, set[str]]:
    """module -> the areal_tik modules it imports. A module's own enclosing packages are
    left out: Python has initialised them before the module runs (``from . import x``
    names the package but loads only ``x``)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    g = graph()
    assert "areal_tik.adapter.actor" in g and "areal_tik.engine.llm_engine" in g
    assert "areal_tik.adapter.old_logprobs" in g["areal_tik.adapter.actor"]
    assert "areal_tik.bitwise" in g["areal_tik.consistency"]


@pytest.mark.parametrize("lower", sorted(ALLOWED))
def test_each_floor_imports_only_what_lies_below_it(lower):
    bad = sorted((m, dep) for m, deps in graph().items() if part(m) == lower
                 for dep in deps if part(dep) != lower and part(dep) not in ALLOWED[lower])
    assert not bad, f"{lower} may import only {sorted(ALLOWED[lower]) or 'nothing of areal_tik'}; found {bad}"


def test_nothing_imports_the_command_line():
    bad = sorted((m, dep) for m, deps in graph().items() for dep in deps
                 if part(dep) in FORBIDDEN_EVERYWHERE and part(m) not in FORBIDDEN_EVERYWHERE)
    assert not bad, bad


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_loops_between_modules_or_parts():
    g = graph()
    assert _cycle(g) is None, f"import loop: {' -> '.join(_cycle(g))}"
    parts: dict[str, set[str]] = {}
    for m, deps in g.items():
        parts.setdefault(part(m), set()).update(part(d) for d in deps if part(d) != part(m))
    parts.pop("", None)  # areal_tik/__init__.py
    assert _cycle(parts) is None, f"import loop between parts: {' -> '.join(_cycle(parts))}"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None

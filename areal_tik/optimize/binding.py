"""Hash binding: a run freezes the sha256 of the evaluator's sources and the root's sources.

An audit recomputes both and refuses to judge when either changed: an evaluator edited
mid-run (a looser check, a shrunk workload table) or a kernel file changed under the
root would make the run's numbers incomparable. The root's hash also covers its config.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
KERNELS = PACKAGE.parent / "unified_kernels"
# Everything that decides a verdict: checks, timing, launch evidence, ops, this file.
EVALUATOR_FILES = ("binding.py", "checks.py", "evaluator.py", "launches.py", "op_attention.py",
                   "op_linear.py", "op_logprob.py", "op_rows.py", "ops.py", "timing.py")


class BindingError(RuntimeError):
    """The evaluator or the root is not the one the run was initialised with."""


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def digest_files(base: Path, names) -> dict[str, str]:
    return {name: sha256((Path(base) / name).read_bytes()) for name in names}


def combined(parts: dict) -> str:
    return sha256(json.dumps(parts, sort_keys=True))


def evaluator_digest(base: Path = PACKAGE) -> tuple[str, dict]:
    files = digest_files(base, EVALUATOR_FILES)
    return combined(files), files


def root_digest(kernel_files, root_config: dict, base: Path = KERNELS) -> tuple[str, dict]:
    files = digest_files(base, kernel_files)
    return combined({**files, "config": root_config}), files


def check_binding(config, kernel_files, evaluator_base: Path = PACKAGE,
                  kernel_base: Path = KERNELS) -> None:
    """Raise BindingError naming every file whose hash differs from the run's record."""
    ev_hash, ev_files = evaluator_digest(evaluator_base)
    root_hash, root_files = root_digest(kernel_files, config.root_config, kernel_base)
    changed = [f"evaluator {name}" for name in sorted(set(ev_files) | set(config.evaluator_files))
               if ev_files.get(name) != config.evaluator_files.get(name)]
    changed += [f"root {name}" for name in sorted(set(root_files) | set(config.root_files))
                if root_files.get(name) != config.root_files.get(name)]
    if not changed and ev_hash != config.evaluator_hash:
        changed.append("evaluator hash")
    if not changed and root_hash != config.root_hash:
        changed.append("root hash")
    if changed:
        raise BindingError(f"hash binding broken: {', '.join(changed)} differ from the run's "
                           f"frozen record; start a new run for a new evaluator or root")

"""What a recipe run imports is either on the GPU image or in the GPU carry.

The H200 machine has no package index: AReaL's runtime travels as wheels listed in
``requirements/gpu-carry.txt``, on top of the image's own packages
(``requirements/gpu-image.txt``). A run there once failed because math-verify, imported only
inside AReaL's reward worker, was in neither (the run retried the reward until its time
limit). This test imports what a recipe run imports (the run module, AReaL's trainer and
RLVR workflow, the reward module, and every recipe's task and verifier through
``check_task``) in a fresh interpreter, maps each imported top-level module to the
distribution that installed it, and asks for each in one of the two lists.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.metadata, json, sys
from areal_tik.adapter import recipes, run, tasks
from areal_tik.adapter.demo import load_config, recording_trainer_class
from areal_tik.adapter import patch_list
import areal.reward, areal.workflow.rlvr, wandb
recording_trainer_class()
with patch_list.apply():
    for name in recipes.recipe_names():
        tasks.check_task(load_config(recipes.recipe_file(name), []).task)
owners = importlib.metadata.packages_distributions()
top = sorted({m.split(".")[0] for m in list(sys.modules)})
print(json.dumps({m: owners.get(m, []) for m in top if m not in sys.stdlib_module_names}))
"""


def _names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(_norm(re.split(r"[=<>~! \[]", line)[0]))
    return names


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_distributions() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_distribution_a_recipe_run_imports_is_on_the_image_or_carried():
    carried = _names(ROOT / "requirements" / "gpu-carry.txt")
    image = _names(ROOT / "requirements" / "gpu-image.txt")
    imported = _imported_distributions()
    assert "math_verify" in imported and "reasoning_gym" in imported  # the probe reached the verifiers
    missing = {}
    for module, owners in imported.items():
        owners = {_norm(o) for o in owners}
        if not owners:  # the project itself, or a module no installed distribution claims
            continue
        if not owners & (carried | image | {"areal-tik"}):
            missing[module] = sorted(owners)
    assert not missing, f"imported by a recipe run, neither on the GPU image nor carried: {missing}"


def test_the_lists_parse_and_hold_what_the_run_needs():
    carried = _names(ROOT / "requirements" / "gpu-carry.txt")
    image = _names(ROOT / "requirements" / "gpu-image.txt")
    assert {"areal", "math-verify", "latex2sympy2-extended", "reasoning-gym", "wandb"} <= carried
    assert {"torch", "triton", "transformers", "numpy", "sympy"} <= image

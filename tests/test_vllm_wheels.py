"""The wheel lists that carry vLLM and the kernel baselines to the GPU image (eval/wheels.py,
scripts/vllm_wheels.sh): exact pins, prune rules, and pruning a real (small) wheel file."""
import zipfile
from pathlib import Path

import pytest

from eval import wheels

REPO = Path(__file__).resolve().parents[1]
VLLM, KERNELS = REPO / "requirements" / "gpu-vllm.txt", REPO / "requirements" / "gpu-kernels.txt"


def test_lists_parse_with_exact_pins_only():
    vllm, kernels = wheels.load(VLLM), wheels.load(KERNELS)
    assert vllm.pins["vllm"] == "0.26.0"
    assert kernels.pins["flash-attn-4"] == "4.0.0b19" and "liger-kernel" in kernels.pins
    assert "nvidia-cutlass-dsl-libs-cu13" in kernels.pins and "nvidia-cutlass-dsl-libs-cu12" not in kernels.pins
    # the image's own packages never travel: vLLM runs on its torch and transformers 5.17
    for name in ("torch", "triton", "transformers", "tokenizers", "numpy"):
        assert name not in vllm.pins and name not in kernels.pins
    # a package in both sites has one version (the DSL's tvm-ffi is vLLM's pin)
    for name in set(vllm.pins) & set(kernels.pins):
        assert vllm.pins[name] == kernels.pins[name], name
    assert all(m.startswith("vllm/") for m in vllm.prune["vllm"])


def test_the_build_script_uses_both_lists_and_the_shared_functions():
    script = (REPO / "scripts" / "vllm_wheels.sh").read_text()
    assert "requirements/gpu-vllm.txt" in script and "requirements/gpu-kernels.txt" in script
    assert "source scripts/gpu_wheels.sh" in script and "download_list" in script and "xz_parts" in script
    assert 'install_site "$WORK/vllm" "$WORK/sites/vllm"' in script and 'install_site "$WORK/kernels" "$WORK/sites/kernels"' in script


@pytest.mark.parametrize("text, message", [
    ("vllm>=0.26\n", "exact pin"),
    ("vllm\n", "exact pin"),
    ("vllm==0.26.0\nVLLM==0.26.0\n", "pinned twice"),
    ("vllm==0.26.0 ; python_version > '3'\n", "exact pin"),
    ("# prune: other x.so\nvllm==0.26.0\n", "unlisted distributions"),
    ("vllm==0.26.0\n# prune: vllm\n", "<dist> <member>"),
])
def test_bad_lines_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        wheels.parse(text, "list.txt")


def test_comments_and_names_are_normalised():
    parsed = wheels.parse("# header\nPydantic_Core==2.50.5   # why\n\nopenai-harmony==0.0.8\n")
    assert parsed.pins == {"pydantic-core": "2.50.5", "openai-harmony": "0.0.8"}


def make_wheel(path: Path) -> None:
    files = {"pkg/__init__.py": "x = 1\n", "pkg/_big.so": "\0" * 1000, "pkg/extra/a.h": "//",
             "pkg/extra/b.h": "//"}
    record = "".join(f"{n},sha256=abc,{len(c)}\n" for n, c in files.items()) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
        z.writestr("pkg-1.0.dist-info/RECORD", record)


def test_prune_drops_members_and_their_record_lines(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel)
    listed = wheels.parse("pkg==1.0\n# prune: pkg pkg/_big.so\n# prune: pkg pkg/extra/\n")
    wheels.prune_dir(tmp_path, listed)
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        assert z.read("pkg/__init__.py") == b"x = 1\n"
    assert [line.split(",")[0] for line in record] == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]


def test_prune_of_a_member_that_is_gone_fails(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel)
    with pytest.raises(ValueError, match="no members"):
        wheels.prune_wheel(wheel, ["pkg/absent.so"])

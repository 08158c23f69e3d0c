"""Which kernel set a CPU run gets: the Triton interpreter cannot run a real model in
useful time, so ``generate`` takes the standard kernels there (saying so in one line,
with an estimate) and ``check`` keeps the unified ones (its point) with a warning."""
from __future__ import annotations

import argparse

import pytest

from areal_tik.commands import validate


def _choose(model: str, command: str, kernels: str | None = None) -> argparse.Namespace:
    args = argparse.Namespace(model=model, kernels=kernels, device="cpu")
    validate.choose_kernels(args, command)
    return args


@pytest.mark.parametrize("model, command, kernels, chosen, says", [
    ("smollm2", "generate", None, "standard", "areal-tik: note: smollm2 on CPU: the unified kernels run in "
                                              "the Triton interpreter (roughly"),
    ("qwen3-0.6b", "generate", None, "standard", "areal-tik: note: qwen3-0.6b on CPU"),
    ("smollm2", "generate", "unified", "unified", "areal-tik: warning: smollm2 with the unified kernels"),
    ("smollm2", "check", None, "unified", "areal-tik: warning: smollm2 with the unified kernels"),
    ("tiny-qwen3", "generate", None, "unified", ""),
    ("tiny-llama", "check", "standard", "standard", ""),
])
def test_the_kernel_set_of_a_cpu_run(model, command, kernels, chosen, says, capsys):
    assert _choose(model, command, kernels).kernels == chosen
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == (1 if says else 0), err


def test_the_estimate_grows_with_the_weights():
    tiny, small = validate.model_parameters("tiny-qwen3"), validate.model_parameters("qwen3-0.6b")
    assert tiny < validate.INTERPRETER_PARAM_LIMIT < small
    assert "135M parameters" in validate._estimate(validate.model_parameters("smollm2"))


def test_a_checkpoint_directory_is_sized_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "intermediate_size": 16, '
                                          '"num_hidden_layers": 2, "vocab_size": 10}')
    assert validate.model_parameters(str(tmp_path)) == 2 * (4 * 64 + 3 * 8 * 16) + 2 * 10 * 8

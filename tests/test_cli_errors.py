"""Bad inputs a user would type, each with the one line ``areal-tik`` answers (exit 2, no
traceback), checked before any model is built. Run in-process (fast); a few go through
a subprocess in ``test_cli_subprocess.py``."""
from __future__ import annotations

import re

import pytest

from areal_tik.cli import main

RECIPE = "recipes/chain_sum_grpo_tiny_cpu.yaml"
SCRIPT = "recipes/reasoning_gym_grpo.py"
GEN = ["generate", "--device", "cpu", "--no-progress"]

# (argv, a regex the one line must match). {tmp} is a temporary directory.
BAD_INPUTS = [
    ([*GEN, "--num-prompts", "1", "--prompt-len", "64", "16"],
     r"--prompt-len 64 16: expected MIN MAX with 1 <= MIN <= MAX"),
    ([*GEN, "--num-prompts", "1", "--prompt-len", "0", "4"], r"--prompt-len 0 4"),
    (["generate", "--device", "cuda", "--num-prompts", "1"], r"--device cuda: no CUDA GPU is visible"),
    (["check", "--device", "tpu", "--num-prompts", "1"], r"--device 'tpu': expected cpu, cuda or cuda:<index>"),
    ([*GEN, "--model", "{tmp}", "--num-prompts", "1"], r"a directory without config\.json is not a model"),
    ([*GEN, "--model", "{tmp}/prompts.jsonl", "--num-prompts", "1"], r"a file that is not \.gguf"),
    ([*GEN, "--model", "qwen4-tiny", "--num-prompts", "1"], r"--model 'qwen4-tiny': not a known name \(tiny-qwen3\|"),
    ([*GEN, "--num-prompts", "-1"], r"--num-prompts must be >= 0, got -1"),
    ([*GEN, "--num-prompts", "1", "--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
    ([*GEN, "--num-prompts", "1", "--top-k", "-2"], r"--top-k must be >= 0, got -2"),
    ([*GEN, "--num-prompts", "1", "--top-p", "1.5"], r"bad sampling option: top_p must be in \(0, 1\], got 1.5"),
    ([*GEN, "--num-prompts", "1", "--temperature", "-1"], r"temperature must be >= 0"),
    (["check", "--device", "cpu", "--num-prompts", "1", "--micro-batch-tokens", "0"],
     r"--micro-batch-tokens must be >= 1, got 0"),
    ([*GEN], r"no prompts: give --prompt, --prompt-ids, --prompts-file or --num-prompts"),
    ([*GEN, "--prompts-file", "{tmp}/missing.jsonl"], r"--prompts-file '.*missing\.jsonl': no such file"),
    ([*GEN, "--prompts-file", "{tmp}/prompts.jsonl", "--kernels", "standard"], r"prompts\.jsonl:1: not a JSON line"),
    ([*GEN, "--prompt-ids", "1,x", "--kernels", "standard", "--model", "tiny-llama"],
     r"--prompt-ids expects comma-separated integers, got '1,x'"),
    ([*GEN, "--prompt", "hi", "--kernels", "standard", "--model", "tiny-llama"], r"this model has no tokenizer"),
    ([*GEN, "--prompt-ids", "1", "--kv-block-size", "24", "--kernels", "standard", "--model", "tiny-llama"],
     r"bad engine option: kv_block_size must be a power of two, got 24"),
    (["demo", "--steps", "0"], r"--steps must be >= 1, got 0"),
    (["demo", "--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
    (["demo", "--task", "chainsum"], r"--task 'chainsum': not a reasoning-gym dataset; did you mean chain_sum"),
    (["demo", "--model", "{tmp}"], r"--model '.*': not a model directory \(no config\.json\)"),
    (["demo", "--recipe", "{tmp}/missing.yaml"], r"--recipe '.*missing\.yaml': no such file"),
    (["launch", "{tmp}/missing.py", "--config", RECIPE], r"launch: entry script '.*missing\.py': no such file"),
    (["launch", SCRIPT, "--config", "{tmp}/missing.yaml"], r"--config '.*missing\.yaml': no such file"),
    (["launch", SCRIPT, "--config", "{tmp}/prompts.jsonl"], r"--config '.*prompts\.jsonl': expected a \.yaml/\.yml file"),
    (["launch", SCRIPT, "--config"], r"--config needs a YAML file after it"),
    (["serve", "--model", "{tmp}"], r"--model '.*': not a model directory \(no config\.json\)"),
    (["serve", "--model", "{tmp}/none.gguf"], r"--model '.*none\.gguf': not a model directory"),
    (["serve", "--model", "{tmp}/tiny", "--port", "70000"], r"--port must be in 0\.\.65535"),
    (["serve", "--model", "{tmp}/tiny", "--max-num-seqs", "0"], r"bad engine option: max_num_seqs must be >= 1, got 0"),
    (["serve", "--model", "{tmp}/tiny", "--device", "cuda"], r"--device cuda: no CUDA GPU is visible"),
]


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("[1, 2\n")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")  # enough for the checks before loading
    return tmp_path


def _answer(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal-tik: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.mark.parametrize("argv, answer", BAD_INPUTS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_INPUTS])
def test_a_bad_input_gets_one_line(argv, answer, tmp, capsys):
    line = _answer(capsys, [a.replace("{tmp}", str(tmp)) for a in argv])
    assert re.search(answer, line), line


def test_debug_keeps_the_traceback():
    from areal_tik.errors import UsageError

    with pytest.raises(UsageError, match="--steps must be >= 1"):
        main(["--debug", "demo", "--steps", "0"])


@pytest.mark.parametrize("override, answer", [
    ("actor.unified_kernal=true", r"has no key 'actor\.unified_kernal'; did you mean actor\.unified_kernels"),
    ("gconfig.max_new_token=3", r"did you mean gconfig\.max_new_tokens"),
    ("task.params.num_terms=3", r"'task\.params' is a mapping .*add it with \+\+task\.params\.num_terms=3"),
])
def test_a_typo_in_an_override_names_the_closest_key(override, answer, capsys, spmd_env):
    # Answered by the patched loader inside the stock script, before AReaL builds anything.
    line = _answer(capsys, ["launch", SCRIPT, "--config", RECIPE, override])
    assert re.search(answer, line), line

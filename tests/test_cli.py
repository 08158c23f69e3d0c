"""The ``areal-tik`` command line: the subcommand table, generate and check, driven
through ``main(argv)``; the engine flags are EngineConfig's fields."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json

import pytest
import torch

from areal_tik.adapter import launch
from areal_tik.cli import COMMANDS, build_parser, main
from areal_tik.commands.flags import add_dataclass_arguments, dataclass_from_args, dataclass_to_argv
from areal_tik.engine import EngineConfig
from areal_tik.errors import UsageError
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


def test_every_command_row_is_a_module_with_the_interface(capsys):
    names = [name for name, _, _ in COMMANDS]
    assert {"generate", "check", "demo", "launch", "serve", "prepare-model"} <= set(names)
    assert len(names) == len(set(names))
    for name, module, _ in COMMANDS:
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None or importlib.util.find_spec(module) is None:
            # A row whose part is not in this tree yet: the command says so by name.
            with pytest.raises(SystemExit, match=f"areal-tik {name}: not available.*{module}"):
                main([name])
            continue
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.main), module
        parser = argparse.ArgumentParser()
        mod.add_arguments(parser)  # no clash among its flags
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in names)


def test_launch_hands_its_remaining_arguments_to_the_script(tmp_path):
    args = build_parser("launch").parse_args(["launch", "train.py", "--config", "x.yaml", "a.b=1"])
    assert args.script == "train.py" and args.script_args == ["--config", "x.yaml", "a.b=1"]
    with pytest.raises(FileNotFoundError, match="entry script not found"):
        launch.run_script(str(tmp_path / "missing.py"), [])


@pytest.mark.parametrize("command", ["generate", "check", "serve"])
def test_engine_flags_are_generated_from_engine_config(command):
    # Every EngineConfig field is a flag of the command (the CLI's one --seed seeds the
    # engine too), and parsing a config's own flags gives that config back.
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {opt for action in sub._actions for opt in action.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags, (command, f.name)
    config = EngineConfig(max_num_seqs=3, max_model_len=100, kv_block_size=32, num_kv_blocks=9,
                          gpu_memory_utilization=0.25, cuda_graphs=False, cuda_graph_sizes=(1, 2), seed=5)
    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, EngineConfig)
    assert dataclass_from_args(EngineConfig, p.parse_args(dataclass_to_argv(config))) == config
    assert dataclass_from_args(EngineConfig, p.parse_args([])) == EngineConfig()
    # None on a field whose default is not None (graph sampling turned off) survives the trip
    off = EngineConfig(graph_sample_temperature=None, max_graph_batch_size=None)
    assert "--graph-sample-temperature" in dataclass_to_argv(off)
    assert dataclass_from_args(EngineConfig, p.parse_args(dataclass_to_argv(off))) == off


def test_a_new_engine_option_needs_one_field():
    @dataclasses.dataclass
    class WithNewOption(EngineConfig):
        prefix_cache: bool = dataclasses.field(default=False, metadata={"help": "reuse cached prefixes"})

    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, WithNewOption)
    assert dataclass_from_args(WithNewOption, p.parse_args(["--prefix-cache"])).prefix_cache is True


def test_kv_block_size_must_fit_the_attention_tile():
    from areal_tik.engine.config import attention_kv_tile

    tile = attention_kv_tile()
    EngineConfig(kv_block_size=tile).check_kernels("unified")
    EngineConfig(kv_block_size=tile // 2).check_kernels("standard")  # torch gathers pages: any size
    with pytest.raises(ValueError, match=rf"kv_block_size={tile // 2} .*KV tile \({tile}"):
        EngineConfig(kv_block_size=tile // 2).check_kernels("unified")
    with pytest.raises(UsageError, match=rf"kv_block_size={tile // 2}.*{tile}"):
        main(["--debug", "generate", "--model", "tiny-llama", *TINY, "--prompt-ids", "1",
              "--kv-block-size", str(tile // 2)])


def test_check_reports_bit_identical_logprobs(tmp_path, capsys):
    missing = missing_ops("unified")
    assert not missing, f"unified kernels unavailable: {missing}"
    report = tmp_path / "check.json"
    rc = main(["check", "--model", "tiny-qwen3", *TINY, "--num-prompts", "2", "--prompt-len", "3", "20",
               "--temperature", "0.7", "--json", str(report)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "6/6 tokens bit-identical (100.00%)" in out
    assert "device qualification passed on cpu" in out
    data = json.loads(report.read_text())
    assert data["fraction_identical"] == 1.0 and data["max_abs_delta"] == 0.0
    assert data["qualification"]["passed"] is True and data["qualification"]["failing_ops"] == []


def test_check_names_the_first_differing_op_on_standard_kernels(capsys):
    # The standard ops (SDPA over gathered pages in decode, a causal SDPA loop in the
    # packed forward) may or may not differ on CPU; when they do, an op must be named.
    rc = main(["check", "--model", "tiny-qwen3", "--kernels", "standard", *TINY, "--num-prompts", "3",
               "--prompt-len", "5", "30", "--no-qualify"])
    out = capsys.readouterr().out
    assert "tokens bit-identical" in out
    if "(100.00%)" in out:
        assert rc == 0
    else:  # any differing token fails the check, with or without --strict
        assert rc == 1 and "first differing op: " in out


def test_check_exits_non_zero_on_a_mismatch_and_on_a_failed_qualification(monkeypatch, capsys):
    from areal_tik import consistency, qualify

    args = ["check", "--model", "tiny-qwen3", *TINY, "--num-prompts", "1", "--prompt-len", "3", "3",
            "--max-new-tokens", "2"]
    original = consistency.packed_logprobs

    def one_ulp_off(*a, **k):  # the training side one bit away on every token
        return [(r.view(torch.int32) ^ 1).view(torch.float32) for r in original(*a, **k)]

    monkeypatch.setattr(consistency, "packed_logprobs", one_ulp_off)
    assert main(args + ["--no-qualify"]) == 1
    assert "0/2 tokens bit-identical" in capsys.readouterr().out
    monkeypatch.setattr(consistency, "packed_logprobs", original)
    failed = qualify.Verdict(qualify.DeviceKey("cpu", 0, "none", "t", "t", "t"),
                             [qualify.Check("linear", False, "rows 3 vs 64 differ")], 0.1)
    monkeypatch.setattr(qualify, "qualify", lambda device=None, refresh=False: failed)
    assert main(args) == 1
    assert "device qualification FAILED on cpu (0 SMs, triton t, torch t): linear: rows 3 vs 64" \
        in capsys.readouterr().out


def test_generate_text_with_smollm2(capsys):
    rc = main(["generate", "--model", "smollm2", "--kernels", "standard", "--device", "cpu", "--no-progress",
               "--prompt", "What is 2+3?", "--temperature", "0", "--max-new-tokens", "12"])
    assert rc == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "5" in record["text"] and record["finish_reason"] == "stop"


def test_interpreter_switch_and_kernel_set_names():
    from areal_tik.model import get_ops
    from areal_tik.runtime import INTERPRET_ENV, KERNEL_SETS, use_interpreter_without_gpu, wants_cpu

    env = {}
    assert use_interpreter_without_gpu(env, force=True) and env == {INTERPRET_ENV: "1"}
    env = {INTERPRET_ENV: "0"}
    assert not use_interpreter_without_gpu(env, force=True) and env[INTERPRET_ENV] == "0"  # never overridden
    assert wants_cpu(["generate", "--device", "cpu"]) and wants_cpu(["check", "--device=cpu"])
    assert not wants_cpu(["generate", "--device", "cuda"]) and not wants_cpu(["generate", "--device"])
    assert [get_ops(k).kind for k in KERNEL_SETS] == ["unified", "standard"]
    with pytest.raises(ValueError, match=r"kernels must be one of \('unified', 'standard'\)"):
        get_ops("fast")

"""The actor.unified_kernels flag and its options through AReaL's own config loader."""
from __future__ import annotations

from pathlib import Path

import pytest


from areal.api.cli_args import GRPOConfig, PPOActorConfig  # noqa: E402

from areal_tik.adapter import apply_patches  # noqa: E402
from areal_tik.adapter.audit import RunState  # noqa: E402
from areal_tik.adapter.config import _parallel, check_server_tensor_parallel  # noqa: E402
from areal_tik.adapter.config import (  # noqa: E402
    ColocatedEngineConfig,
    TikGRPOConfig,
    TikPPOActorConfig,
    engine_mode,
    reuse_refusals,
)
from areal_tik.adapter.tasks import ReasoningGymGRPOConfig  # noqa: E402
from areal_tik.engine import EngineConfig  # noqa: E402
from areal_tik.engine.config import attention_kv_tile  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "chain_sum_grpo_tiny_cpu.yaml"


@pytest.fixture
def areal_patches():
    handle = apply_patches()
    yield handle
    handle.revert()


@pytest.fixture
def load(areal_patches, tmp_path):
    """Load the CPU recipe through AReaL's (patched) loader, writing under tmp_path."""
    import areal.api.cli_args as cli_args

    def load(overrides=(), cls=ReasoningGymGRPOConfig):
        roots = [f"++cluster.fileroot={tmp_path}", f"++cluster.name_resolve.nfs_record_root={tmp_path}/nr"]
        config, _ = cli_args.load_expr_config(["--config", str(RECIPE), *roots, *overrides], cls)
        return config
    return load


def test_recipe_loads_with_flag(load):
    config = load()
    assert isinstance(config, TikGRPOConfig) and isinstance(config, GRPOConfig)
    assert isinstance(config.actor, TikPPOActorConfig) and isinstance(config.actor, PPOActorConfig)
    assert config.actor.unified_kernels is True
    assert config.actor.tik_audit_every == 2
    assert engine_mode(config) == "inprocess"
    assert config.stats_logger.wandb.mode == "offline"
    assert reuse_refusals(config, vocab_size=256) == []
    # the tik: block is an EngineConfig: the recipe's values over the colocated defaults
    assert isinstance(config.tik, EngineConfig)
    assert (config.tik.max_num_seqs, config.tik.max_model_len, config.tik.cuda_graphs) == (16, 256, False)
    assert config.tik.gpu_memory_utilization == ColocatedEngineConfig().gpu_memory_utilization == 0.5
    # limits derived from the recipe's values, not from the colocated defaults (64 sequences)
    assert config.tik.graph_batch_limit == 16
    assert load(["++tik.max_num_seqs=128"]).tik.graph_batch_limit == 128


def test_engine_block_keys_are_engine_config_fields(load):
    config = load(["++tik.num_kv_blocks=40", "++tik.cuda_graph_sizes=[1,4]", "++tik.seed=3"])
    assert (config.tik.num_kv_blocks, config.tik.cuda_graph_sizes, config.tik.seed) == (40, (1, 4), 3)
    with pytest.raises(ValueError, match=r"(?s)unknown key.*'tik.max_num_seq'.*known keys.*'max_num_seqs'"):
        load(["++tik.max_num_seq=8"])
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        load(["++tik.gpu_memory_utilization=1.5"])


def test_kv_block_size_off_the_attention_tile_fails_at_load(load):
    tile = attention_kv_tile()
    with pytest.raises(ValueError, match=rf"tik.kv_block_size={tile // 2} .*KV tile \({tile}"):
        load([f"++tik.kv_block_size={tile // 2}"])
    assert load([f"++tik.kv_block_size={tile // 2}", "++actor.tik_kernels=standard"]).tik.kv_block_size == tile // 2


def test_old_rollout_engine_keys_name_their_new_keys(load):
    with pytest.raises(ValueError, match=r"rollout.tik_max_num_seqs -> tik.max_num_seqs, "
                                         r"rollout.tik_cuda_graphs -> tik.cuda_graphs"):
        load(["++rollout.tik_cuda_graphs=false", "++rollout.tik_max_num_seqs=8"])


def test_stock_config_class_is_substituted(areal_patches, tmp_path):
    # A stock script asks for GRPOConfig; the patched loader returns the areal-tik subclass.
    import areal.api.cli_args as cli_args
    import yaml

    data = yaml.safe_load(RECIPE.read_text())
    del data["task"]  # the recipe's own section; a stock GRPO YAML has none
    data["cluster"]["fileroot"] = str(tmp_path)
    stock = tmp_path / "stock.yaml"
    stock.write_text(yaml.safe_dump(data))
    config, _ = cli_args.load_expr_config(["--config", str(stock)], GRPOConfig)
    assert type(config) is TikGRPOConfig
    assert config.actor.unified_kernels is True


def test_wandb_offline_is_the_default(load):
    assert load(["stats_logger.wandb.mode=disabled"]).stats_logger.wandb.mode == "disabled"
    assert TikGRPOConfig.__dataclass_fields__["stats_logger"].default_factory().wandb.mode == "offline"


def test_unknown_key_is_a_clear_error(load):
    hint = r"(?s)unknown config key.*tik_audit_evry.*Did you mean.*actor.tik_audit_every"
    with pytest.raises(ValueError, match=hint):
        load(["++actor.tik_audit_evry=3"])


@pytest.mark.parametrize("backend", ["megatron:d1", "archon:d1"])
def test_flag_needs_fsdp_backend(load, backend):
    with pytest.raises(ValueError, match="needs the FSDP training backend"):
        load([f"++actor.backend={backend}"])


def test_flag_rejects_tensor_parallel_and_lora(load):
    with pytest.raises(ValueError, match="data parallelism only"):
        load(["++actor.backend=fsdp:d1t2"])
    with pytest.raises(ValueError, match="LoRA"):
        load(["++actor.use_lora=true"])


def test_bad_option_values(load):
    with pytest.raises(ValueError, match="tik_audit_every must be an int >= 0"):
        load(["++actor.tik_audit_every=-1"])
    with pytest.raises(ValueError, match="tik_kernels must be one of"):
        load(["++actor.tik_kernels=fast"])
    with pytest.raises(ValueError, match="tik_engine must be one of"):
        load(["++rollout.tik_engine=remote"])
    with pytest.raises(ValueError, match="needs actor.unified_kernels=true"):
        load(["++actor.unified_kernels=false", "++rollout.tik_engine=inprocess"])
    with pytest.raises(ValueError, match=r"tik_k_groups must be one of \(1, 2, 4, 8\), got 3"):
        load(["++actor.tik_k_groups=3"])
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide k_groups"):
        load(["++tik.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="tik.tensor_parallel_size=2: the inprocess areal-tik engine"):
        load(["++tik.tensor_parallel_size=2", "++tik.k_groups=2"])


def test_same_k_groups_on_both_sides_keeps_reuse(load):
    config = load(["++tik.k_groups=4", "++actor.tik_k_groups=4"])
    assert reuse_refusals(config, vocab_size=256) == []


@pytest.mark.parametrize("overrides, reason", [
    (["++gconfig.temperature=0.7", "++actor.temperature=1.0"], "rollout temperature"),
    (["++gconfig.min_new_tokens=2"], "min_new_tokens"),
    (["++rollout.tik_engine=off"], "not the areal-tik engine"),
    (["++actor.tik_reuse_logprobs=false"], "tik_reuse_logprobs is false"),
    (["++actor.tik_kernels=standard"], "not bitwise across regimes"),
    (["++tik.k_groups=2"], "tik.k_groups=2 differs from actor.tik_k_groups=1"),
    (["++actor.tik_k_groups=4"], "tik.k_groups=1 differs from actor.tik_k_groups=4"),
])
def test_inexact_configs_refuse_reuse(load, overrides, reason):
    config = load(overrides)
    reasons = reuse_refusals(config, vocab_size=256)
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("overrides", [["++gconfig.top_p=0.9"], ["++gconfig.top_k=20"], ["++gconfig.top_k=256"],
                                       ["++gconfig.top_k=0"], ["++gconfig.greedy=true"]])
def test_truncated_sampling_keeps_reuse(load, overrides):
    # the recorded log-prob is the full softmax at the temperature: the recompute's bits
    assert reuse_refusals(load(overrides), vocab_size=256) == []


def test_the_reaction_to_a_mismatch_is_an_option(load):
    assert load().actor.tik_on_mismatch == "recompute"
    assert load(["++actor.tik_on_mismatch=stop"]).actor.tik_on_mismatch == "stop"
    with pytest.raises(ValueError, match=r"tik_on_mismatch must be one of \('recompute', 'warn', 'stop'\), got 'halt'"):
        load(["++actor.tik_on_mismatch=halt"])


def test_refused_reuse_keeps_the_recompute(load):
    # AReaL asks for the recompute pass iff should_compute_prox_logp(); the flag removes it
    # only while reuse is active.
    config = load()
    assert config.actor.should_compute_prox_logp() is True  # no run linked yet: stock answer
    config.actor.skip_recompute_while(lambda: RunState().reuse_active)
    assert config.actor.should_compute_prox_logp() is False
    config.actor.skip_recompute_while(lambda: RunState(refusals=["top-p sampling"]).reuse_active)
    assert config.actor.should_compute_prox_logp() is True
    state = RunState()
    config.actor.skip_recompute_while(lambda: state.reuse_active)
    assert config.actor.should_compute_prox_logp() is False
    with pytest.warns(RuntimeWarning, match="recomputing old log-probs permanently"):
        state.fall_back("test")
    assert config.actor.should_compute_prox_logp() is True


def test_non_ppo_config_classes_pass_through():
    from areal.api.cli_args import SFTConfig

    from areal_tik.adapter.loader import tik_config_class

    assert tik_config_class(SFTConfig) is SFTConfig
    assert tik_config_class(GRPOConfig) is TikGRPOConfig
    with pytest.raises(TypeError, match="derive it from areal_tik"):
        tik_config_class(type("MyPPO", (GRPOConfig,), {}))


def test_sampling_params_follow_gconfig():
    from areal.api.cli_args import GenerationHyperparameters

    from areal_tik.adapter.sampling import sampling_params

    g = GenerationHyperparameters(max_new_tokens=8, temperature=0.7, top_p=0.9, stop_token_ids=[2, 0])
    sp = sampling_params(g, 6, vocab_size=256)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens) == (0.7, 0.9, 0, 6)
    assert sp.stop_token_ids == (2, 0) and not sp.logprobs_match_sampling
    assert sampling_params(g.new(greedy=True), 6, 256).temperature == 0.0
    assert sampling_params(g.new(top_k=20, top_p=1.0), 6, 256).top_k == 20
    assert sampling_params(g.new(top_p=1.0), 6, 256).logprobs_match_sampling
    with pytest.raises(ValueError, match="does not implement.*min_new_tokens"):
        sampling_params(g.new(min_new_tokens=2), 6, 256)
    with pytest.raises(ValueError, match="n_samples=2"):
        sampling_params(g.new(n_samples=2), 6, 256)
    with pytest.raises(ValueError, match="does not implement.*stop"):
        sampling_params(g.new(stop=["\n"]), 6, 256)


def test_the_runs_engine_samples_in_its_graphs_at_the_rollout_temperature(load, tmp_path):
    """The in-process engine's decode graphs draw at gconfig's temperature when its requests
    can be drawn there, and not at all for greedy or filtered requests (whose every step would
    draw again eagerly); ``tik.graph_sample_temperature: null`` keeps them off."""
    import json

    from areal.api.cli_args import GenerationHyperparameters

    from areal_tik.adapter.sampling import graph_temperature
    from areal_tik.adapter.trainer import rollout_engine_config

    g = GenerationHyperparameters(max_new_tokens=8, temperature=0.7)  # AReaL's top_k default: 1e8
    assert graph_temperature(g, 256) == 0.7
    assert graph_temperature(g.new(greedy=True), 256) is None
    assert graph_temperature(g.new(top_k=20), 256) is None and graph_temperature(g.new(top_p=0.9), 256) is None
    assert graph_temperature(g.new(top_k=256), 256) == 0.7  # k >= vocabulary: no filter
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 256}))
    config = load(["++gconfig.temperature=0.7", f"++actor.path={model}"])
    assert rollout_engine_config(config).graph_sample_temperature == 0.7
    assert rollout_engine_config(config).max_num_seqs == config.tik.max_num_seqs
    off = load(["++gconfig.temperature=0.7", f"++actor.path={model}", "++tik.graph_sample_temperature=null"])
    assert rollout_engine_config(off).graph_sample_temperature is None


def test_one_list_of_unsupported_options_for_engine_client_and_server():
    # The client's JSON goes through the same translation and back through the server's
    # parser to the same SamplingParams; each UNSUPPORTED option is refused by both ends.
    from areal.api import ModelRequest
    from areal.api.cli_args import GenerationHyperparameters

    from areal_tik.adapter import sampling
    from areal_tik.adapter.client import TikServerBackend

    g = GenerationHyperparameters(max_new_tokens=5, temperature=0.8, top_k=7, stop_token_ids=[3])
    wire = TikServerBackend().build_generation_request(ModelRequest(input_ids=[1, 2], gconfig=g), False, 0)
    assert sampling.from_json(wire.payload["sampling_params"], 256) == sampling.sampling_params(g, 5, 256)
    assert sampling.from_json({"top_k": 10 ** 8}, 256).top_k == 0  # AReaL's "no top-k" default
    on = {"min_new_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5, "use_beam_search": True,
          "stop": ["x"]}
    assert set(on) == set(sampling.UNSUPPORTED)
    for name, value in on.items():
        with pytest.raises(ValueError, match=name):
            sampling.from_json({name: value}, 256)
        if hasattr(g, name):
            with pytest.raises(ValueError, match=name):
                TikServerBackend().build_generation_request(
                    ModelRequest(input_ids=[1], gconfig=g.new(**{name: value})), False, 0)


def test_server_mode_options(load):
    config = load(["rollout.tik_engine=server", "actor.weight_update_mode=xccl"])
    assert engine_mode(config) == "server" and reuse_refusals(config, vocab_size=256) == []
    config = load(["rollout.tik_engine=server", "+rollout.tik_server_addrs=[a:1,b:2]"])
    assert config.rollout.tik_server_addrs == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="tik_server_addrs"):
        load(["rollout.tik_engine=server", "+rollout.tik_server_addrs=[nohostport]"])
    with pytest.raises(ValueError, match="needs actor.unified_kernels"):
        load(["rollout.tik_engine=server", "actor.unified_kernels=false"])
    # tensor-parallel servers: started apart (serve --tensor-parallel-size) and named
    config = load(["rollout.tik_engine=server", "rollout.backend=sglang:d1t2", "+rollout.tik_server_addrs=[a:1]"])
    assert _parallel(config.rollout.backend).tp_size == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size t"):
        load(["rollout.tik_engine=server", "rollout.backend=sglang:d1t2"])
    # their /health must say the same t: AReaL sizes the weight-update group by it
    check_server_tensor_parallel({"a:1": {"tensor_parallel_size": 2}}, "sglang:d1t2")
    check_server_tensor_parallel({"a:1": {}}, "sglang:d1")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*\{'a:1': 1\}.*--tensor-parallel-size 2"):
        check_server_tensor_parallel({"a:1": {"tensor_parallel_size": 1}}, "sglang:d1t2")


def test_server_on_the_trainers_gpu_refuses_nccl_weight_updates(load, monkeypatch):
    """NCCL cannot broadcast between two processes on one GPU: launching a local server
    beside the trainer with weight_update_mode=xccl is refused before anything starts."""
    import types

    import torch

    from areal_tik.adapter import trainer as trainer_mod

    config = load(["rollout.tik_engine=server", "actor.weight_update_mode=xccl"])
    monkeypatch.setattr(trainer_mod, "_device", lambda: torch.device("cuda", 0))
    launched = []
    monkeypatch.setattr("areal_tik.adapter.client.TikRemoteInfEngine.launch_local_server",
                        lambda self, args: launched.append(args))
    fake_trainer = types.SimpleNamespace(config=config)
    with pytest.raises(ValueError, match="Duplicate GPU detected"):
        trainer_mod._server_engine(fake_trainer, config.rollout, is_eval=False)
    assert not launched

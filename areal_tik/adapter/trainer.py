"""Hooks into AReaL's PPOTrainer (installed by ``patch_list``).

- ``wrap_trainer_init``: W&B offline via the environment when the config asks for it,
  an early error when the in-process engine is asked for outside SPMD mode, and the
  config-level reuse refusals handed to the actor once it exists.
- ``wrap_init_rollout``: the in-process areal-tik engine instead of SGLang/vLLM when
  ``rollout.tik_engine`` resolves to "inprocess" (the eval engine shares its LLM), or
  AReaL's RemoteInfEngine over areal-tik servers for "server". Both take the engine's
  options from the YAML's ``tik:`` block.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from copy import deepcopy

import torch
from areal.infra.platforms import current_platform
from areal.utils.environ import is_single_controller

from .actor import TikFSDPPPOActor
from .config import TikPPOConfig, engine_mode, reuse_refusals
from .inference import TikInferenceEngine

SPMD_HINT = ("run it through `areal-tik launch <script.py> --config <yaml>` "
             "(one process; wrap in torchrun for several GPUs), which sets AREAL_SPMD_MODE=1")


def _device() -> torch.device:
    if current_platform.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(current_platform.device_type, int(os.environ.get("LOCAL_RANK", "0")))


def wrap_trainer_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if isinstance(config, TikPPOConfig):
            if config.stats_logger.wandb.mode == "offline":
                os.environ.setdefault("WANDB_MODE", "offline")
            if engine_mode(config) in ("inprocess", "server") and is_single_controller():
                raise ValueError("the in-process areal-tik rollout engine lives inside the training "
                                 "processes (AReaL's SPMD mode); " + SPMD_HINT)
        original(self, config, *args, **kwargs)
        actor = getattr(self, "actor", None)
        if isinstance(actor, TikFSDPPPOActor) and actor.tik_flag:
            reasons = reuse_refusals(config, actor.model_config.vocab_size, include_engine=False)
            actor.tik_refuse(reasons)
    return __init__


def _server_engine(trainer, rollout_config, is_eval: bool):
    """A TikRemoteInfEngine over ``rollout.tik_server_addrs``, or over one areal-tik server
    launched for this training process on its device (the eval engine shares it)."""
    from .client import TikRemoteInfEngine

    config = deepcopy(rollout_config)
    if is_eval:
        config.max_head_offpolicyness = int(1e12)  # as AReaL: no staleness control in eval
    actor = trainer.config.actor
    engine = TikRemoteInfEngine(config)
    if config.tik_server_addrs:
        addrs = list(config.tik_server_addrs)
    elif is_eval:
        addrs = list(trainer.rollout.addresses)
    else:
        device = _device()
        if device.type == "cuda" and actor.weight_update_mode == "xccl":
            raise ValueError(
                "rollout.tik_engine='server' without tik_server_addrs launches the server on the "
                f"trainer's own GPU ({device}), and NCCL cannot broadcast between two processes on "
                "one GPU ('Duplicate GPU detected'). Use actor.weight_update_mode='disk', "
                "rollout.tik_engine='inprocess' (weights copied in place), or servers on other "
                "GPUs named in rollout.tik_server_addrs.")
        addrs = [engine.launch_local_server({
            "model": actor.path, "dtype": actor.dtype, "kernels": actor.tik_kernels, "device": str(device),
            "engine": rollout_engine_config(trainer.config)})]
    engine.initialize(engine_id=f"{'eval-' if is_eval else ''}rank{os.environ.get('RANK', '0')}", addr=addrs,
                      train_data_parallel_size=trainer.actor_alloc.parallel.dp_size)
    if actor.weight_update_mode == "xccl":
        from .config import check_server_tensor_parallel

        check_server_tensor_parallel(engine.server_health(), trainer.config.rollout.backend)
    return engine


def rollout_engine_config(config):
    """The ``tik:`` block the run's own engine gets (in process, or the server it launches): its decode graphs sample at the
    rollout's temperature (``sampling.graph_temperature``), unless the block turned graph
    sampling off (``tik.graph_sample_temperature: null``)."""
    from transformers import AutoConfig

    from .sampling import graph_temperature

    if config.tik.graph_sample_temperature is None:
        return config.tik
    vocab = AutoConfig.from_pretrained(config.actor.path).vocab_size  # AReaL's top_k default is 1e8
    return dataclasses.replace(config.tik, graph_sample_temperature=graph_temperature(config.gconfig, vocab))


def wrap_init_rollout(original):
    @functools.wraps(original)
    def _init_rollout(self, rollout_config, is_eval: bool = False, lora_path=None):
        mode = engine_mode(self.config) if isinstance(self.config, TikPPOConfig) else "off"
        if mode == "server":
            return _server_engine(self, rollout_config, is_eval)
        if mode != "inprocess":
            return original(self, rollout_config, is_eval=is_eval, lora_path=lora_path)
        config = deepcopy(rollout_config)
        shared = None
        if is_eval:
            config.max_head_offpolicyness = int(1e12)  # as AReaL: no staleness control in eval
            shared = self.rollout.llm
        actor = self.config.actor
        engine = TikInferenceEngine(config, llm=shared, model_path=actor.path,
                                    dtype=getattr(torch, actor.dtype), kernels=actor.tik_kernels,
                                    device=_device(), engine_config=rollout_engine_config(self.config))
        engine.initialize(engine_id=f"{'eval-' if is_eval else ''}rank{os.environ.get('RANK', '0')}",
                          train_data_parallel_size=self.actor_alloc.parallel.dp_size)
        return engine
    return _init_rollout

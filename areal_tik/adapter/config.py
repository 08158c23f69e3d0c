"""Typed configuration: AReaL's config dataclasses plus the areal-tik options.

YAML (loaded by AReaL's own ``load_expr_config``; unknown keys still raise)::

    actor:
      backend: "fsdp:d1"
      unified_kernels: true        # the flag
      tik_reuse_logprobs: true     # rollout log-probs are the old/proximal log-probs
      tik_audit_every: 10          # bitwise audit on step 1 and every N steps (0: step 1 only)
      tik_audit_sequences: 4       # sequences recomputed per audit (0: the whole batch)
      tik_on_mismatch: recompute   # a differing bit: recompute from now on / warn / stop
      tik_kernels: unified         # "standard" runs the same code on stock kernels (baseline)
      tik_training_model: areal_tik  # "hf": AReaL's own forward over the Hugging Face model
                                   # (a baseline: needs tik_kernels standard, no reuse)
    rollout:
      backend: "sglang:d1"         # AReaL's parser needs an inference backend name; with
      tik_engine: auto             # tik_engine auto/inprocess the areal-tik engine serves it;
                                   # "server": areal-tik servers driven by AReaL's RemoteInfEngine
    tik:                           # the areal-tik rollout engine, as AReaL has sglang: / vllm:
      max_num_seqs: 64             # keys: the fields of areal_tik.engine.EngineConfig
      gpu_memory_utilization: 0.5
    stats_logger:
      wandb: {mode: offline}       # offline is the default here

The ``tik`` block is ``ColocatedEngineConfig``: ``EngineConfig`` itself, with the
defaults of an engine that shares its GPU with the trainer; a field added to
``EngineConfig`` is a key of the block with no edit here. ``validate(config)`` raises
``ValueError`` for combinations that cannot run (the KV block size against the
attention tile included); ``reuse_refusals(config, vocab_size)`` lists why log-prob
reuse would not be exact (reuse is then refused, recompute is used, and the reasons are
logged).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from areal.api.alloc_mode import ModelAllocation
from collections.abc import Callable

from areal.api.cli_args import (
    GRPOConfig,
    InferenceEngineConfig,
    PPOActorConfig,
    PPOConfig,
    StatsLoggerConfig,
    WandBConfig,
)

from areal_tik.engine.config import PARALLEL_SIZES, EngineConfig
from areal_tik.runtime import KERNEL_SETS

from .audit import REACTIONS
from .sampling import UNSUPPORTED, unsupported_set

TIK_ENGINE_MODES = ("auto", "inprocess", "server", "off")
TRAINING_MODELS = ("areal_tik", "hf")


@dataclass
class TikPPOActorConfig(PPOActorConfig):
    """PPOActorConfig plus the unified-kernel flag and its options."""

    unified_kernels: bool = field(
        default=False,
        metadata={"help": "Run the actor's training forward on the unified kernels "
                          "(bitwise identical to the areal-tik rollout engine)."})
    tik_reuse_logprobs: bool = field(
        default=True,
        metadata={"help": "Use rollout log-probs as old/proximal log-probs instead of a "
                          "recompute pass, where that is exact."})
    tik_audit_every: int = field(
        default=10,
        metadata={"help": "Recompute a sample and compare bits on step 1 and every N steps; "
                          "0 audits step 1 only."})
    tik_audit_sequences: int = field(
        default=4,
        metadata={"help": "Sequences recomputed per audit; 0 recomputes the whole batch."})
    tik_on_mismatch: str = field(
        default="recompute",
        metadata={"help": "What a differing bit in an audit or the first minibatch does: 'recompute' "
                          "old log-probs from then on, 'warn' and keep reusing, or 'stop' the run.",
                  "choices": list(REACTIONS)})
    tik_kernels: str = field(
        default="unified",
        metadata={"help": "Kernel set of the areal-tik model: 'unified' or 'standard' "
                          "(stock ops on the same code path; never reused).",
                  "choices": list(KERNEL_SETS)})
    tik_k_groups: int = field(
        default=1,
        metadata={"help": "K groups of the training forward's o_proj / down_proj (their fixed fp32 "
                          "tree, 1, 2, 4 or 8): must equal the rollout engine's tik.k_groups for "
                          "its log-probs to be reused (a tensor-parallel rollout needs k_groups a "
                          "multiple of its tensor_parallel_size)."})

    tik_training_model: str = field(
        default="areal_tik",
        metadata={"help": "Whose model code the actor trains and recomputes with: 'areal_tik' (the "
                          "areal-tik model on tik_kernels) or 'hf' (AReaL's own FSDP forward over the "
                          "Hugging Face model, attention by torch's FlashAttention varlen: the stock "
                          "baseline; needs tik_kernels 'standard' and tik_reuse_logprobs false).",
                  "choices": list(TRAINING_MODELS)})

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.unified_kernels, bool):
            raise TypeError(f"actor.unified_kernels must be a bool, got {self.unified_kernels!r}")
        for name in ("tik_audit_every", "tik_audit_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"actor.{name} must be an int >= 0, got {value!r}")
        if self.tik_on_mismatch not in REACTIONS:
            raise ValueError(f"actor.tik_on_mismatch must be one of {REACTIONS}, got {self.tik_on_mismatch!r}")
        if self.tik_kernels not in KERNEL_SETS:
            raise ValueError(f"actor.tik_kernels must be one of {KERNEL_SETS}, got {self.tik_kernels!r}")
        if isinstance(self.tik_k_groups, bool) or self.tik_k_groups not in PARALLEL_SIZES:
            raise ValueError(f"actor.tik_k_groups must be one of {PARALLEL_SIZES}, got {self.tik_k_groups!r}")
        if self.tik_training_model not in TRAINING_MODELS:
            raise ValueError(f"actor.tik_training_model must be one of {TRAINING_MODELS}, "
                             f"got {self.tik_training_model!r}")
        if self.tik_training_model == "hf" and (self.tik_kernels != "standard" or self.tik_reuse_logprobs):
            # the Hugging Face forward's bits are not the engine's: reuse would be a biased ratio
            raise ValueError("actor.tik_training_model='hf' is the stock baseline: it needs "
                             "actor.tik_kernels='standard' and actor.tik_reuse_logprobs=false, got "
                             f"{self.tik_kernels!r} and {self.tik_reuse_logprobs!r}")
        if self.unified_kernels:
            _validate_actor(self)

    def skip_recompute_while(self, reusing: Callable[[], bool] | None) -> None:
        """Link AReaL's recompute switch to a run: while ``reusing()`` is true the rollout
        log-probs stand in for the recompute pass. The actor calls this once it knows
        whether it reuses; the config keeps the question, never the run's state."""
        self._reusing = reusing

    def __getstate__(self):
        # The link belongs to this process's run: a copy sent elsewhere has none.
        return {k: v for k, v in self.__dict__.items() if k != "_reusing"}

    def should_compute_prox_logp(self) -> bool:
        """AReaL's switch for the recompute pass; False while reuse stands in for it."""
        reusing = getattr(self, "_reusing", None)
        if reusing is not None and reusing():
            return False
        return super().should_compute_prox_logp()

    def stock_should_compute_prox_logp(self) -> bool:
        """What stock AReaL would answer for this config (ignores reuse)."""
        return PPOActorConfig.should_compute_prox_logp(self)


@dataclass
class TikInferenceEngineConfig(InferenceEngineConfig):
    """InferenceEngineConfig plus where the areal-tik engine runs (its options: ``tik:``)."""

    tik_engine: str = field(
        default="auto",
        metadata={"help": "'inprocess': the areal-tik engine serves rollouts inside each "
                          "training process; 'server': areal-tik HTTP servers (tik_server_addrs, or "
                          "one launched per training process) driven by AReaL's RemoteInfEngine, "
                          "weights by disk or NCCL as actor.weight_update_mode says; 'off': AReaL's "
                          "backend named in rollout.backend; 'auto': inprocess when "
                          "actor.unified_kernels is on.",
                  "choices": list(TIK_ENGINE_MODES)})
    tik_server_addrs: list[str] | None = field(
        default=None,
        metadata={"help": "tik_engine='server': 'host:port' of running areal-tik servers; None "
                          "launches one per training process on its device."})

    def __post_init__(self):
        super().__post_init__()
        if self.tik_server_addrs is not None:
            addrs = list(self.tik_server_addrs)
            bad = [a for a in addrs if not isinstance(a, str) or ":" not in a]
            if not addrs or bad:
                raise ValueError("rollout.tik_server_addrs must be a non-empty list of 'host:port', "
                                 f"got {self.tik_server_addrs!r}")
            self.tik_server_addrs = addrs
        if self.tik_engine not in TIK_ENGINE_MODES:
            raise ValueError(
                f"rollout.tik_engine must be one of {TIK_ENGINE_MODES}, got {self.tik_engine!r}")


@dataclass
class ColocatedEngineConfig(EngineConfig):
    """The ``tik:`` block: ``EngineConfig`` with the defaults of an engine colocated with
    the trainer (the one place they are set). The trainer shares the GPU, so fewer
    sequences and a lower memory fraction than a standalone engine's 256 / 0.9."""

    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.5


@dataclass
class TikWandBConfig(WandBConfig):
    """W&B offline unless the YAML says otherwise."""

    mode: str = field(
        default="offline",
        metadata={"help": "One of 'online', 'offline', 'disabled', 'shared'.",
                  "choices": ["online", "offline", "disabled", "shared"]})


@dataclass
class TikStatsLoggerConfig(StatsLoggerConfig):
    wandb: TikWandBConfig = field(default_factory=TikWandBConfig)


@dataclass
class TikPPOConfig(PPOConfig):
    actor: TikPPOActorConfig = field(default_factory=TikPPOActorConfig)
    ref: TikPPOActorConfig | None = field(default=None)  # ref.unified_kernels: its logp on the kernels too
    rollout: TikInferenceEngineConfig = field(default_factory=TikInferenceEngineConfig)
    tik: ColocatedEngineConfig = field(default_factory=ColocatedEngineConfig)
    stats_logger: TikStatsLoggerConfig = field(default_factory=TikStatsLoggerConfig)

    def __post_init__(self):
        super().__post_init__()
        validate(self)


@dataclass
class TikGRPOConfig(TikPPOConfig, GRPOConfig):
    """GRPOConfig with the areal-tik actor, rollout and logger options."""


def _parallel(backend: str):
    return ModelAllocation.from_str(backend).parallel


def _validate_actor(actor: TikPPOActorConfig) -> None:
    backend = (actor.backend or "").split(":")[0]
    if backend != "fsdp":
        raise ValueError(
            "actor.unified_kernels needs the FSDP training backend (actor.backend: 'fsdp:d<N>'); "
            f"got actor.backend={actor.backend!r}. The megatron and archon backends run their "
            "own model code, which the unified kernels do not replace.")
    par = _parallel(actor.backend)
    if par.tp_size > 1 or par.cp_size > 1 or par.pp_size > 1:
        raise ValueError(
            "actor.unified_kernels supports data parallelism only (fsdp:d<N>); "
            f"got actor.backend={actor.backend!r}")
    if actor.use_lora:
        raise ValueError("actor.unified_kernels does not support LoRA (actor.use_lora=true)")
    if actor.enable_tree_training:
        raise ValueError("actor.unified_kernels does not support tree training "
                         "(actor.enable_tree_training=true)")
    if actor.is_critic:
        raise ValueError("actor.unified_kernels applies to the policy, not a critic (is_critic=true)")


def engine_mode(config: TikPPOConfig) -> str:
    """'inprocess' or 'off' after resolving 'auto'."""
    mode = config.rollout.tik_engine
    if mode == "auto":
        return "inprocess" if config.actor.unified_kernels else "off"
    return mode


def validate(config: TikPPOConfig) -> None:
    """Raise ValueError for option combinations that cannot run."""
    mode = engine_mode(config)
    if mode in ("inprocess", "server"):
        try:
            config.tik.check_kernels(config.actor.tik_kernels)
        except ValueError as exc:
            raise ValueError(f"tik.{exc}") from None
        if config.tik.tensor_parallel_size != 1:
            raise ValueError(
                f"tik.tensor_parallel_size={config.tik.tensor_parallel_size}: the {mode} areal-tik engine "
                "of a training run is one process (TP = 1); tensor-parallel rollout runs as its own "
                "SPMD processes (areal_tik.engine.tensor_parallel)")
    if mode == "server":
        if not config.actor.unified_kernels:
            raise ValueError("rollout.tik_engine='server' needs actor.unified_kernels=true")
        if config.actor.weight_update_mode not in ("disk", "xccl"):
            raise ValueError("areal-tik servers take weights from disk or by NCCL broadcast; got "
                             f"actor.weight_update_mode={config.actor.weight_update_mode!r}")
        par = _parallel(config.rollout.backend)
        if par.pp_size > 1 or (par.tp_size > 1 and not config.rollout.tik_server_addrs):
            raise ValueError(
                "areal-tik servers run no pipeline parallelism, and a tensor-parallel one (t > 1) is "
                "started as `areal-tik serve --tensor-parallel-size t` on its own GPUs and named in "
                "rollout.tik_server_addrs (a server the trainer launches is one process on its GPU); "
                f"rollout.backend={config.rollout.backend!r}")
    if mode == "inprocess":
        if not config.actor.unified_kernels:
            raise ValueError("rollout.tik_engine='inprocess' needs actor.unified_kernels=true")
        par = _parallel(config.rollout.backend)
        if par.tp_size > 1 or par.pp_size > 1:
            raise ValueError(
                "the in-process areal-tik engine runs one replica per training process; "
                f"rollout.backend={config.rollout.backend!r} asks for tensor/pipeline parallelism")
        if config.rollout.use_lora:
            raise ValueError("the in-process areal-tik engine does not serve LoRA adapters")


def actor_refusals(actor: TikPPOActorConfig) -> list[str]:
    """Reasons in the actor's own options (the actor checks these without the full config)."""
    reasons = []
    if not actor.tik_reuse_logprobs:
        reasons.append("actor.tik_reuse_logprobs is false")
    if actor.tik_kernels != "unified":
        reasons.append(f"actor.tik_kernels={actor.tik_kernels!r} is not bitwise across regimes")
    return reasons


def k_groups_refusals(rollout: dict[str, int | None], trainer: int) -> list[str]:
    """A reason for each rollout (``{name: its k_groups}``; None reads as 1) whose row-parallel
    K-group tree differs from the trainer's ``actor.tik_k_groups``: other sums, other bits."""
    return [f"{name}={groups or 1} differs from actor.tik_k_groups={trainer}: o_proj / down_proj sum "
            "their K groups in another tree, so the rollout log-probs are not the trainer's bits"
            for name, groups in rollout.items() if (groups or 1) != trainer]


def server_refusals(health: dict[str, dict], trainer_k_groups: int) -> list[str]:
    """Reasons in the servers' /health answers (``{address: answer}``): a kernel set other
    than 'unified', a K-group tree other than the trainer's."""
    reasons = [f"areal-tik server {addr} runs {h.get('kernels')!r} kernels, not 'unified'"
               for addr, h in health.items() if h.get("kernels") != "unified"]
    return reasons + k_groups_refusals({f"areal-tik server {addr}'s k_groups": h.get("k_groups")
                                        for addr, h in health.items()}, trainer_k_groups)


def check_server_tensor_parallel(health: dict[str, dict], rollout_backend: str) -> None:
    """ValueError unless every server's /health ``tensor_parallel_size`` is the t of
    ``rollout_backend``: AReaL sizes the weight-update group by it (one rank per server
    rank), so a server with another t would leave the group's rendezvous waiting."""
    want = _parallel(rollout_backend).tp_size
    wrong = {addr: h.get("tensor_parallel_size", 1) for addr, h in health.items()
             if h.get("tensor_parallel_size", 1) != want}
    if wrong:
        raise ValueError(f"rollout.backend={rollout_backend!r} says tensor_parallel_size={want}, but the "
                         f"areal-tik servers {wrong} report another; start them with "
                         f"`areal-tik serve --tensor-parallel-size {want}` or change rollout.backend")


def reuse_refusals(config: TikPPOConfig, vocab_size: int | None = None,
                   include_engine: bool = True) -> list[str]:
    """Why rollout log-probs cannot stand in for the recompute exactly ([] = they can).

    ``include_engine=False`` leaves out the rollout-engine check (the actor makes it
    itself when it is connected to the real engine object)."""
    actor, g = config.actor, config.gconfig
    if not actor.unified_kernels:
        return ["actor.unified_kernels is off"]
    reasons = actor_refusals(actor)
    if include_engine and engine_mode(config) not in ("inprocess", "server"):
        reasons.append(
            f"rollouts come from AReaL's {config.rollout.backend.split(':')[0]!r} backend, not the "
            "areal-tik engine, so their log-probs are not bitwise the trainer's")
    # Greedy, top-k and top-p keep reuse: the recorded log-prob is the full-vocabulary
    # softmax at the temperature, the bits the recompute gives (``exactness`` explains).
    options = {name: getattr(g, name) for name in UNSUPPORTED if hasattr(g, name)}
    reasons += [f"gconfig.{name}={options[name]!r} is not implemented by the areal-tik engine"
                for name in unsupported_set(options)]
    if engine_mode(config) == "inprocess":  # servers report theirs (``server_refusals``)
        reasons += k_groups_refusals({"tik.k_groups": config.tik.k_groups}, actor.tik_k_groups)
    if not g.greedy and g.temperature != actor.temperature:
        reasons.append(
            f"rollout temperature (gconfig.temperature={g.temperature}) differs from the "
            f"actor's (actor.temperature={actor.temperature})")
    return reasons

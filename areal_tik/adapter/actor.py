"""TikFSDPPPOActor: AReaL's FSDP PPO actor with the unified training forward, in-process
weight sync, and the hooks that hand each rollout batch to ``old_logprobs`` (reuse, the
bitwise audit and fallback live there, not here).

With ``actor.unified_kernels`` off it is exactly ``FSDPPPOActor`` (every override starts
by deferring to it), so one class can stand in for AReaL's everywhere (the ref model too).
With ``actor.tik_training_model: hf`` (a stock baseline) the forward, log-prob and loss are
AReaL's own over the Hugging Face model; the in-process engine and its weight sync stay.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from areal.engine import FSDPPPOActor
from areal.infra.dist_rollout import DistRolloutCoordinator
from areal.infra.platforms import current_platform
from areal.utils import stats_tracker
from torch import distributed as dist

from areal_tik.bitwise import compare_bits
from areal_tik.unified_kernels._common import interpreting

from . import exactness
from .audit import REACTIONS, RunState
from .config import actor_refusals, server_refusals
from .log import logger
from .old_logprobs import OldLogprobs
from .processes import all_reduce, refusals_of_every_process
from .training import TikOutput, micro_batch_logprobs


def log_tik_stats(**values: float) -> None:
    """Scalars under ``tik/`` in AReaL's default stats tracker (exported to W&B each step)."""
    tracker = stats_tracker.DEFAULT_TRACKER
    with tracker.disable_scope(), tracker.scope("tik"):
        tracker.scalar(**values)


def is_tik_engine(engine) -> bool:
    """An areal-tik engine (in process or a server): unified kernels, per-token versions."""
    return bool(getattr(engine, "is_areal_tik_engine", False))


def is_in_process_engine(engine) -> bool:
    """The in-process engine, whose weights the actor copies in place."""
    return is_tik_engine(engine) and bool(getattr(engine, "tik_in_process", False))


def qualification_refusals(tik_model) -> list[str]:
    """Device qualification before reuse (``areal_tik.qualify``: the contract probe, its
    verdict cached on disk per device key): [] when it passed, else the reason naming the
    failing ops."""
    from areal_tik.qualify import cache_path, qualify

    verdict = qualify(tik_model.device)
    source = f"cached in {cache_path()}" if verdict.cached else f"probed in {verdict.seconds:.1f} s"
    if verdict.passed:
        logger.info("areal-tik: %s (%s)", verdict.message(), source)
        return []
    pinned = ""
    if verdict.pin_linear:  # linear's per-shape geometry disagreed here: one tile for every shape
        from areal_tik.qualify import pin_linear_tile

        pin_linear_tile()  # for the whole run (trainer and in-process engine share the process)
        pinned = "; linear pinned to its one fixed tile for this run"
    return [f"{verdict.message()} (failing: {', '.join(verdict.failing_ops)}; {source}{pinned}; "
            "python -m areal_tik.qualify --refresh probes again)"]


class TikFSDPPPOActor(FSDPPPOActor):
    """FSDPPPOActor whose forward runs on the areal-tik unified model when the flag is on."""

    def __init__(self, config):
        super().__init__(config)
        self.tik_model = None
        self.old_logprobs: OldLogprobs | None = None
        self._tik_first_minibatch = False
        self._tik_audit_minibatch = True  # this step's first minibatch is an audit
        self._tik_first_tally = [0.0, 0.0, 0.0]  # its tokens, identical tokens, max |delta| here

    @property
    def tik_flag(self) -> bool:
        """``actor.unified_kernels`` as configured."""
        return bool(getattr(self.config, "unified_kernels", False))

    @property
    def tik_state(self) -> RunState | None:
        """The run's reuse / audit state (None without the flag)."""
        return None if self.old_logprobs is None else self.old_logprobs.state

    @property
    def tik_enabled(self) -> bool:
        """The flag is on and the unified model wraps this actor's model."""
        return self.tik_model is not None

    # ------------------------------------------------------------------ setup

    def _unified_supports_model(self) -> bool:
        from areal_tik.model import ModelSpec

        try:
            ModelSpec.from_hf_config(self.model_config)
        except ValueError:
            return False
        return True

    @property
    def hf_training(self) -> bool:
        """The stock baseline's trainer: AReaL's own forward over the Hugging Face model
        (``actor.tik_training_model: hf``), the areal-tik engine still serving rollouts."""
        return self.tik_flag and getattr(self.config, "tik_training_model", "areal_tik") == "hf"

    def _create_llm_actor_or_critic(self):
        if not (self.tik_flag and self._unified_supports_model()):
            return super()._create_llm_actor_or_critic()
        if self.hf_training:  # packed micro-batches need a varlen attention (``hf_attention``)
            from . import hf_attention

            attn = hf_attention.register()
        else:
            # The unified path never calls the HF attention; build the modules with SDPA so
            # that no flash-attention install is needed for a flag that replaces it.
            attn = "sdpa"
        saved, self.config.attn_impl = self.config.attn_impl, attn
        try:
            return super()._create_llm_actor_or_critic()
        finally:
            self.config.attn_impl = saved

    def initialize(self, *args, **kwargs):
        super().initialize(*args, **kwargs)
        if not self.tik_flag:
            return
        from areal_tik.model import UnifiedCausalLM

        helper = self.parallel_helper
        if helper.sp_size > 1 or helper.tp_size > 1:
            raise ValueError("actor.unified_kernels supports data parallelism only; "
                             f"got sequence/tensor parallel sizes {helper.sp_size}/{helper.tp_size}")
        refusals = []
        try:
            self.tik_model = UnifiedCausalLM.from_hf(self.model, kernels=self.config.tik_kernels,
                                                     k_groups=self.config.tik_k_groups)
        except ValueError as exc:  # a model family the unified model does not implement
            refusals.append(f"the unified kernels do not support this model ({exc}); the actor runs "
                            "AReaL's stock forward")
        refusals += actor_refusals(self.config)
        if self.tik_model is not None and not refusals:
            refusals += qualification_refusals(self.tik_model)
        state = RunState(audit_every=self.config.tik_audit_every, on_mismatch=self.config.tik_on_mismatch)
        self.old_logprobs = OldLogprobs(state, self._recompute, self._all_reduce,
                                        audit_sequences=self.config.tik_audit_sequences,
                                        temperature=float(self.config.temperature))
        self.config.skip_recompute_while(lambda: self.old_logprobs.reuse_active)
        self.tik_refuse(refusals)
        if self.hf_training:
            logger.info("areal-tik: the actor trains and recomputes with AReaL's own forward over the Hugging "
                        "Face model (attn_implementation %r), the stock baseline; the rollout engine runs "
                        "the %s kernels", getattr(getattr(self.model, "config", None), "_attn_implementation", "?"),
                        self.config.tik_kernels)
        elif self.tik_model is not None:
            self._warm_training_kernels()
            logger.info("areal-tik: actor forward runs %r; a differing bit in an audit or a first "
                        "minibatch: %s (actor.tik_on_mismatch, tik/on_mismatch=%d)", self.tik_model,
                        state.on_mismatch, REACTIONS.index(state.on_mismatch))

    def _warm_training_kernels(self) -> None:
        """Compile every unified-kernel variant the training forward and backward will
        launch, up to one micro-batch of tokens, before the first step (on CUDA; the
        interpreter compiles nothing). Row counts do not enter the kernels' keys, so no
        later step compiles (bench_train: 0 JIT compiles after this on the H200)."""
        if self.tik_model.device.type != "cuda" or self.config.tik_kernels != "unified":
            return
        import time

        from areal_tik.engine.model_runner import warmup_shapes
        from areal_tik.unified_kernels import warmup

        max_rows = getattr(self.config.mb_spec, "max_tokens_per_mb", None) or 16384
        start = time.perf_counter()
        # The compute dtype, not the fp32 master parameters' (warming fp32 variants compiled
        # kernels no step runs, and the fp32 attention backward at head_dim 128 asks 288 KiB
        # of shared memory: the Qwen2.5-1.5B recipe stopped there on the H200).
        shapes = warmup_shapes(self.tik_model, dtype=getattr(torch, self.config.dtype))
        counts = warmup(shapes, max_rows=int(max_rows), device=self.tik_model.device,
                        training=True, sampling=False)
        logger.info("areal-tik: training kernels compiled for up to %d tokens in %.1f s (%s)",
                    max_rows, time.perf_counter() - start, counts)

    def tik_refuse(self, reasons: list[str]) -> None:
        """Add config-level reasons why reuse would not be exact; logs the refusal."""
        new = [r for r in reasons if r not in self.tik_state.refusals]
        self.tik_state.refusals.extend(new)
        if new:
            logger.warning("areal-tik: log-prob reuse refused, old log-probs are recomputed as AReaL "
                           "does without the flag. Reasons: %s", "; ".join(self.tik_state.refusals))

    def _share_refusals(self) -> None:
        """Every process takes every process's refusals (``refusals_of_every_process``)."""
        state = self.tik_state
        every = refusals_of_every_process(state.refusals, self.cpu_group)
        if every != state.refusals:
            state.refusals[:] = every
            logger.warning("areal-tik: log-prob reuse refused on every training process, as another "
                           "refused it. Reasons: %s", "; ".join(every))

    def connect_engine(self, engine, meta):
        in_process = self.tik_enabled and is_in_process_engine(engine)
        if self.tik_flag and not is_tik_engine(engine):
            self.tik_refuse([f"rollout engine {type(engine).__name__} is not the areal-tik engine"])
        elif self.tik_enabled and not in_process and hasattr(engine, "server_health"):
            self.tik_refuse(server_refusals(engine.server_health(), self.config.tik_k_groups))
        if self.tik_flag:  # every training process connects once: one reuse decision for all
            self._share_refusals()
        if not in_process:
            # areal-tik servers take AReaL's own weight updates (disk or NCCL broadcast)
            return super().connect_engine(engine, meta)
        self.rollout_engine = engine
        self.rollout_coordinator = DistRolloutCoordinator(rollout_engine=engine, train_engine=self)
        self._push_weights(engine, self.get_version())  # same bits from the first rollout on
        current_platform.synchronize()
        dist.barrier(group=self.cpu_group)

    # ------------------------------------------------------------------ weights

    def _compute_weights(self):
        """(name, full parameter in the compute dtype): the bits the forward sees."""
        dtype = getattr(torch, self.config.dtype)
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield name, full.detach().to(dtype)

    def _push_weights(self, engine, version: int) -> None:
        engine.load_weights(self._compute_weights(), version=version)

    def update_weights(self, meta):
        if not (self.tik_enabled and is_in_process_engine(self.rollout_engine)):
            return super().update_weights(meta)
        version = meta.version if meta.version is not None else self.get_version() + 1
        with self._offload_aware_context():
            self._push_weights(self.rollout_engine, version)
        current_platform.synchronize()
        dist.barrier(group=self.cpu_group)

    # ------------------------------------------------------------------ forward

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False) -> None:
        if not self.tik_enabled:
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        if self.hf_training:  # AReaL's own forward, log-prob and loss over the HF model
            with self._exclusive_kernels():
                return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        with self._exclusive_kernels():
            for mb_item in mb_list:
                inputs, ctx = self._prepare_mb_inputs(mb_item)
                out = micro_batch_logprobs(self.tik_model, inputs, self.config.temperature,
                                      return_entropy=not forward_only, pad_length=ctx.pad_length)
                loss = process_output_fn(out, ctx.to_dict())
                if not forward_only and loss is not None:
                    loss.backward()

    def _exclusive_kernels(self):
        """The Triton CPU interpreter keeps launch state in globals, so kernels from the
        training thread and the engine thread must not interleave: hold the engine between
        steps while training. (On a GPU both run concurrently.)"""
        if interpreting() and is_in_process_engine(self.rollout_engine):
            return self.rollout_engine.between_steps()
        return contextlib.nullcontext()

    def _compute_forward_result(self, logits, ctx):
        if not isinstance(logits, TikOutput):
            return super()._compute_forward_result(logits, ctx)
        return logits.logprobs  # already without the pad

    def _compute_logprobs_and_loss(self, logits, ctx, loss_fn, loss_weight_fn, total_loss_weight,
                                   loss_multiplier: float = 1.0):
        if not isinstance(logits, TikOutput):
            return super()._compute_logprobs_and_loss(
                logits, ctx, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier)
        local_weight = loss_weight_fn(ctx.mb_input)
        if local_weight == 0:
            return logits.logprobs.sum() * 0.0
        out = logits  # already without the pad
        if self._tik_first_minibatch:
            self._record_first_minibatch(out.logprobs.detach(), ctx.mb_input)
        # vocab min/max logits are not materialised on the fused path (stats only).
        loss = loss_fn(out.logprobs, out.entropy, ctx.mb_input)
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    # ------------------------------------------------------------------ PPO hooks

    def ppo_update(self, *args, **kwargs) -> None:
        self._tik_first_minibatch = self.tik_enabled
        try:
            super().ppo_update(*args, **kwargs)
        finally:
            self._tik_first_minibatch = False

    def train_batch(self, *args, **kwargs):
        first = self._tik_first_minibatch
        try:
            out = super().train_batch(*args, **kwargs)
        finally:
            self._tik_first_minibatch = False  # the optimizer has stepped
        if first:  # every process trains the same number of minibatches: a collective point
            self._judge_first_minibatch()
        return out

    @torch.no_grad()
    def compute_advantages(self, data, *args, **kwargs):
        if self.tik_enabled and isinstance(data, list) and data:
            self._prepare_old_logprobs(data)
        if isinstance(data, list):
            exactness.pop_fields(data)
        return super().compute_advantages(data, *args, **kwargs)

    def _record_first_minibatch(self, logprobs: torch.Tensor, mb: dict[str, Any]) -> None:
        """The first minibatch is an audit of every step: its forward (before any optimizer
        step) against the ratio's denominator (AReaL's prox), bit for bit, on the tokens
        the current weights sampled; a differing bit triggers ``tik_on_mismatch``."""
        reference = mb["prox_logp"] if mb.get("prox_logp") is not None else mb["logprobs"]
        mask = mb["loss_mask"].bool().reshape(-1)
        if mb.get("versions") is not None:  # stale tokens were sampled by other weights
            fresh = torch.roll(mb["versions"].reshape(-1), shifts=-1, dims=-1) == self.get_version()
            mask = mask & fresh.to(mask.device)
        result = compare_bits([reference.reshape(-1)], [logprobs.reshape(-1)], [mask])
        log_tik_stats(first_minibatch_exact_fraction=result.fraction_identical,
                      first_minibatch_max_abs_log_ratio=result.max_abs_delta)
        self.tik_state.first_minibatch_exact.append(result.fraction_identical)
        if self._tik_audit_minibatch:
            tally = self._tik_first_tally
            tally[0] += result.num_tokens
            tally[1] += result.num_identical
            tally[2] = max(tally[2], result.max_abs_delta)

    def _judge_first_minibatch(self) -> None:
        """One verdict on the first minibatch for all training processes: the counts are
        summed (and the largest delta taken) over them, so a differing bit on one process
        makes every process react together (a lone fallback would leave the others
        skipping the recompute pass whose FSDP collectives it then waits for)."""
        tally, self._tik_first_tally = self._tik_first_tally, [0.0, 0.0, 0.0]
        n_tokens, n_equal = self._all_reduce(tally[:2], "sum")
        (max_delta,) = self._all_reduce(tally[2:], "max")
        state = self.tik_state
        if n_tokens > n_equal and state.reuse_active:
            state.react(f"first minibatch at weights version {self.get_version()}: {int(n_tokens - n_equal)} of "
                        f"{int(n_tokens)} log-probs of the training forward differ from the old log-probs "
                        f"(all training processes; max |delta| {max_delta:.3g})")
            log_tik_stats(mismatches=float(state.mismatches))
            if state.fallback_reason is not None:
                self._recompute_from_now_on()

    # ------------------------------------------------------------------ old log-probs

    def _recompute(self, batch: list[dict]) -> list[torch.Tensor]:
        """AReaL's own recompute (``PPOActor.compute_logp``, our training forward) on ``batch``."""
        out = self.actor.compute_logp(batch)
        current_platform.synchronize()  # so that old_logprobs times the forward, not its launch
        return out

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        """Reduce over the training processes (gloo), so every rank takes the same branch
        and issues the same FSDP collectives."""
        return all_reduce(values, op, self.cpu_group)

    def _prepare_old_logprobs(self, batch: list[dict]) -> None:
        """Reuse, audit and fallback for one step's rollout batch (``old_logprobs``)."""
        needs_prox = self.config.stock_should_compute_prox_logp()
        stats, fell_back = self.old_logprobs.prepare(batch, self.get_version(), needs_prox)
        exactness.pop_fields(batch)
        # Rows whose reuse was refused keep the rollout's log-probs where AReaL's default mode
        # reads them (no prox_logp): another temperature's bits, not an audit failure.
        refused = stats.get("rows_refused_temperature", 0) + stats.get("rows_refused_no_exactness", 0)
        self._tik_audit_minibatch = needs_prox or refused == 0
        if fell_back:
            self._recompute_from_now_on()
        state = self.tik_state
        stats.update(mismatches=float(state.mismatches), on_mismatch=float(REACTIONS.index(state.on_mismatch)),
                     objective_recompute=float(state.fallback_reason is not None and not needs_prox))
        log_tik_stats(**stats)

    def _recompute_from_now_on(self) -> None:
        """AReaL recomputes old log-probs every later step. In AReaL's default mode (recompute
        off, no decoupled loss) that changes the objective, from the rollout's log-probs to
        the trainer's, as old log-probs: said here and in ``tik/objective_recompute``."""
        if not self.config.stock_should_compute_prox_logp():
            logger.warning(
                "areal-tik: the objective of this run changes: AReaL's default mode (recompute_logprob "
                "off, no decoupled loss) takes the rollout log-probs as old log-probs; they differ from "
                "the trainer's, so from this step on the old log-probs are the trainer's recompute "
                "(actor.recompute_logprob=true; actor.tik_on_mismatch=warn keeps the rollout's)")
        self.config.recompute_logprob = True

"""The AReaL adapter: areal-tik inside AReaL 1.0.4, behind the ``actor.unified_kernels`` flag.

Usage (AReaL is not forked; a stock entry script runs unchanged)::

    areal-tik launch examples/math/gsm8k_rl.py --config my.yaml
    # my.yaml: actor.unified_kernels: true (+ actor.tik_* options), a tik: block for the engine

or, in your own script, ``handle = areal_tik.adapter.apply_patches()`` before building
the trainer, and a config class derived from ``TikGRPOConfig``. An entry script that
calls ``areal_tik.adapter.launch.activate()`` at import runs under AReaL's own launchers
(``python3 -m areal.infra.launcher.local script.py --config my.yaml``; Ray, Slurm) with
the patches in every trainer process.

Named ``adapter`` rather than ``areal``: a folder ``areal_tik/areal`` would shadow AReaL
itself whenever ``areal_tik/`` lands on ``sys.path`` (running a file of the package as a
script does that), and "areal" in a traceback or a grep would mean two things.

One job per file: ``config`` (typed configs), ``loader`` (AReaL's config loader with the
areal-tik keys), ``actor`` (the actor's AReaL hooks), ``training`` (the unified forward
over AReaL's micro-batches), ``old_logprobs`` (reuse -> audit -> merge -> account ->
fallback), ``reuse`` and ``audit`` (its pure parts and the run state), ``sampling`` (the
one gconfig -> SamplingParams translation), ``inference`` (the in-process rollout
engine), ``server`` and ``client`` (server mode, side by side), ``trainer`` (PPOTrainer
hooks), ``patch_list`` (what is swapped into AReaL), ``launch``, ``demo``, ``tasks``
(reasoning-gym datasets and rewards), ``log``.

Design: where areal-tik hooks into AReaL (all read from AReaL 1.0.4's source)
------------------------------------------------------------------------------

Config (``config.py``, ``loader.py``). ``load_expr_config(argv, cls)`` merges the YAML
into strict OmegaConf dataclasses, so new keys need subclasses: ``TikPPOActorConfig
(PPOActorConfig)`` (``unified_kernels``, ``tik_reuse_logprobs``, ``tik_audit_every``,
``tik_audit_sequences``, ``tik_kernels``), ``TikInferenceEngineConfig
(InferenceEngineConfig)`` (``tik_engine``, ``tik_server_addrs``: where the engine runs),
the top-level ``tik:`` block (``EngineConfig``'s fields, colocated defaults),
``TikWandBConfig`` (W&B offline by default) and ``TikGRPOConfig``/``TikPPOConfig``. The
patch list swaps ``cli_args.load_expr_config`` for a wrapper that substitutes these for a
stock script's ``GRPOConfig``/``PPOConfig`` and names old and unknown areal-tik keys.

Actor (``actor.py``). ``PPOTrainer._create_train_engine`` does ``from areal.engine
import FSDPPPOActor`` at call time; the patch list points that name at
``TikFSDPPPOActor``. Its swaps, each a no-op without the flag:

- ``forward_backward_batch``: each packed micro-batch (``[1, T]``, ``cu_seq_lens_q``,
  padded to a multiple of 256 by ``pad_mb_list``) goes through
  ``UnifiedCausalLM.forward_logprobs`` over the FSDP-wrapped HF model (parameters read
  at call time inside the model's and each layer's forward, so FSDP2 gathers, casts to
  bf16 and reduce-scatters gradients as usual); AReaL's pad sequence is skipped.
- ``_compute_logprobs_and_loss`` / ``_compute_forward_result``: accept those log-probs
  (``log_softmax(logits.float() / T)[roll(input_ids, -1)]``, AReaL's semantics) and
  entropy in place of logits; the loss is AReaL's ``grpo_loss_fn`` unchanged.
- ``compute_advantages`` (always called by ``PPOTrainer.train``): ``old_logprobs``
  (audit, reuse and fallback), then AReaL's own advantage computation.
- ``connect_engine`` / ``update_weights``: with the in-process engine, weights are copied
  (``full_tensor()`` cast to the compute dtype: the bits FSDP's forward sees) into the
  engine, tagged with AReaL's version; no disk or NCCL. Servers get AReaL's own updates.

Reuse. ``PPOTrainer.train`` runs ``actor.compute_logp`` under ``timeperf/recompute_logp``
iff ``config.actor.should_compute_prox_logp()``; ``TikPPOActorConfig`` answers False
while the run reuses (the actor links the question to its ``OldLogprobs``), so the
recompute pass disappears. ``compute_advantages`` then
sets ``prox_logp = roll(rollout logprobs, -1)`` (AReaL's next-token alignment) for tokens
whose ``versions`` equal the actor's version, recomputing only sequences with stale
tokens and taking the recomputed value at stale positions (``reuse.py``). Reuse is
refused, with a logged reason, for top-k/top-p/greedy sampling, rollout temperature !=
actor temperature, min_new_tokens, frequency penalty, the "standard" kernels, or a
rollout engine other than areal-tik's (in process or a server).

Audit (``audit.py``, run by ``old_logprobs.py``). On step 1 and every ``tik_audit_every`` steps a sample of
sequences is recomputed by AReaL's own ``PPOActor.compute_logp`` (running the unified
training forward) and compared with the rollout log-probs bit for bit. Any difference
switches the run to recompute for good: loud warning, reason kept, that batch
recomputed, and ``recompute_logprob`` set so AReaL recomputes every later step. Metrics
go through AReaL's stats tracker (so to W&B): ``tik/bitwise_fraction``,
``tik/max_abs_delta``, ``tik/tokens_reused``, ``tik/tokens_recomputed``,
``tik/recompute_seconds_saved``, ``tik/reuse_active``, ``tik/fallback``,
``tik/first_minibatch_exact_fraction``; AReaL's own
``ppo_actor/update/compute_logp/kl_div_direct`` reads 0 and
``ppo_actor/update/importance_weight`` 1 on the first minibatch.

Rollout (``inference.py``). ``PPOTrainer._init_rollout`` only knows SGLang/vLLM (and
AReaL's allocation grammar only parses those names), so ``rollout.backend`` keeps a
parseable name and the patched ``_init_rollout`` returns ``TikInferenceEngine`` (sized
by the ``tik:`` block) when ``rollout.tik_engine`` resolves to "inprocess". It subclasses ``RemoteInfEngine`` to
reuse AReaL's WorkflowExecutor (staleness control, submit/wait/prepare_batch,
pause/resume) and replaces the HTTP parts: ``agenerate`` runs on the in-process
``areal_tik.engine.LLM`` and returns ``ModelResponse`` with ``output_logprobs`` and
``output_versions``. It needs AReaL's SPMD mode (``AREAL_SPMD_MODE=1``), which the
launcher sets.

Server mode (``server.py``, ``client.py``; ``serve.py`` is the `areal-tik serve` command, ``server_tp.py`` its tensor-parallel form). ``rollout.tik_engine: server`` returns AReaL's
own ``RemoteInfEngine`` (``TikRemoteInfEngine``: per-token versions from the server) over
areal-tik HTTP servers with SGLang's endpoints and payloads, launched one per training
process or named in ``rollout.tik_server_addrs``. Weights go by AReaL's own path:
``update_weights_from_disk``, or ``xccl`` (``init_weights_update_group`` joins the
trainer's process group through AReaL's ``init_custom_process_group``; buckets arrive by
broadcast and are applied together once they cover the model).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TikGRPOConfig": "config", "TikPPOConfig": "config", "TikPPOActorConfig": "config",
    "TikInferenceEngineConfig": "config", "ColocatedEngineConfig": "config",
    "reuse_refusals": "config", "validate": "config",
    "TikFSDPPPOActor": "actor", "TikInferenceEngine": "inference", "RunState": "audit",
    "OldLogprobs": "old_logprobs",
}


def apply_patches():
    """Install the AReaL patch list (``patch_list.apply``); returns the handle to revert."""
    from .patch_list import apply

    return apply()

__all__ = sorted([*_EXPORTS, "apply_patches"])


def __getattr__(name):
    # Lazy: importing areal_tik.adapter does not import AReaL or torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

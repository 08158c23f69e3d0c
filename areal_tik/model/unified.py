"""UnifiedCausalLM: one decoder implementation over a wrapped transformers *ForCausalLM.

The three entry points (``prefill``, ``decode``, ``forward_packed``) run the same
per-layer code (``layers.decoder_layer``) with the same ops; only the attention callable
differs (varlen / varlen or paged prefill / paged decode), with a ``CacheWrite`` in the
two rollout regimes (the K/V written with rope, ``ops.qk_norm_rope``). With ``kernels="unified"``
their hidden rows, and so the log-probs, are bit-identical for the same tokens,
positions and weights.

Parameters are read from the Hugging Face modules at call time (no copies), so an
optimizer step on ``hf_model`` is seen by the next call, and gradients of
``forward_packed`` land in ``hf_model``'s parameters. ``forward_packed`` and
``forward_logprobs`` run the stack as the forward of ``hf_model`` and each decoder layer
as the forward of its module, so hooks registered on them (FSDP's parameter
gather/reshard, for example) run around the code that reads their parameters; with
gradient checkpointing on (``hf_model.gradient_checkpointing_enable()`` or
``self.gradient_checkpointing = True``) each layer is recomputed in backward by the same
kernels, so the replay has the same bits. (Running a function as a module's forward
sets an instance attribute for the duration of the call: do not run ``forward_packed``
on one ``hf_model`` from two threads at once; ``prefill``/``decode`` do not do this.)
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .fused import FusedProjections, SeparateProjections, fuse_projection_storage, fused_shapes, projection_groups
from .kv_cache import KVCache
from .layers import CacheWrite, decoder_layer, row_parallel_proj
from .ops import get_ops
from .spec import ModelSpec
from .tensor_parallel import check_k_groups

_MISSING = object()


def _call_as_forward(module: torch.nn.Module, fn: Callable, *args):
    """``fn(*args)`` run as ``module``'s forward, so the module's forward hooks run around it.

    ``torch.nn.Module.__call__`` is used directly (not a subclass override such as HF's
    GradientCheckpointingLayer.__call__, whose replay would call the class forward).
    """
    saved = module.__dict__.get("forward", _MISSING)
    module.forward = fn
    try:
        return torch.nn.Module.__call__(module, *args)
    finally:
        if saved is _MISSING:
            del module.forward
        else:
            module.forward = saved


def _check_int(name: str, t, ndim: int, dtypes=(torch.int64, torch.int32)) -> None:
    # Host-side metadata checks only: nothing here reads device memory (decode is captured).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(t.shape)}")


class UnifiedCausalLM:
    """A supported HF decoder run by one code path on the "unified" or "standard" ops.

    ``k_groups``: the K groups of o_proj and down_proj, summed in the fixed tree that a
    tensor-parallel rollout of any size dividing it reproduces (1: the plain K loop).
    ``tensor_parallel`` is None, or the rank's ``TensorParallelShard`` once
    ``tensor_parallel.shard_model`` has cut this model to one rank's heads and columns
    (``spec`` then describes the rank's part, ``full_spec`` the whole model)."""

    def __init__(self, hf_model: torch.nn.Module, kernels="unified", k_groups: int = 1):
        self.hf_model = hf_model
        self.spec = ModelSpec.from_hf_config(hf_model.config)
        self.full_spec = self.spec
        check_k_groups(self.spec, k_groups)
        self.k_groups = k_groups
        self.tensor_parallel = None
        self.ops = get_ops(kernels)
        self.kernels = self.ops.kind
        self.gradient_checkpointing = False
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._check_modules()
        if self.device.type != "meta":
            self.rope_tables(self.device)  # built now, not inside a CUDA-graph capture

    @property
    def config(self) -> ModelSpec:
        """Alias of ``spec`` (the model's shapes and numerics, not a transformers config),
        kept while the engine still reads ``model.config``."""
        return self.spec

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, kernels="unified", k_groups: int = 1) -> "UnifiedCausalLM":
        """Wrap ``hf_model`` in place (no parameter copies)."""
        return cls(hf_model, kernels, k_groups)

    @classmethod
    def from_pretrained(cls, path, dtype=torch.bfloat16, device="cuda", kernels="unified", k_groups: int = 1):
        """Load a local HF checkpoint dir or a ``.gguf`` file (see ``loading.load_hf_model``)."""
        from .loading import load_hf_model
        return cls(load_hf_model(path, dtype=dtype, device=device), kernels, k_groups)

    def __repr__(self):
        extra = "" if self.k_groups == 1 else f", k_groups={self.k_groups}"
        if self.tensor_parallel is not None:
            extra += f", tensor_parallel={self.tensor_parallel.rank}/{self.tensor_parallel.size}"
        return (f"UnifiedCausalLM(family={self.spec.family!r}, kernels={self.kernels!r}, "
                f"dtype={self.dtype}{extra})")

    # ------------------------------------------------------------------ modules

    def _check_modules(self) -> None:
        base = self._base
        if len(base.layers) != self.spec.n_layers:
            raise ValueError(f"hf_model has {len(base.layers)} layers, config says {self.spec.n_layers}")
        attn = base.layers[0].self_attn
        if self.spec.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
            raise ValueError(f"{self.spec.family} attention must have q_norm and k_norm modules")

    @property
    def _base(self):
        return self.hf_model.model

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._base.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]``: the lm_head weight (the embedding itself when tied)."""
        return self.hf_model.get_output_embeddings().weight

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's one ``(cos, sin)`` table pair on ``device`` (built once by ``rope_cos_sin``)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._rope:
            spec = self.spec
            self._rope[device] = self.ops.rope_cos_sin(
                spec.max_positions, spec.head_dim, spec.rope_theta, spec.rope_scaling, device)
        return self._rope[device]

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype=None, device=None, zero=False) -> KVCache:
        """A paged cache for this model: k, v ``[n_layers, num_blocks, block_size, Hk, D]``."""
        spec = self.spec
        return KVCache.allocate(spec.n_layers, num_blocks, block_size, spec.n_kv_heads, spec.head_dim,
                                dtype=dtype or self.dtype, device=device or self.device, zero=zero)

    def decode_attention_path(self, block_size: int, max_model_len: int) -> str:
        """The paged decode attention this model runs over ``block_size``-token KV blocks for
        sequences of up to ``max_model_len`` tokens: "unified" (the Triton kernel),
        "flash-seqused" (the standard set on FlashAttention over each sequence's one block,
        checked here once against the gather path) or "gather-sdpa (why)". The engine asks
        at start-up, before it captures CUDA graphs."""
        if self.kernels == "unified":
            return "unified"
        from .ops import standard_decode_path

        spec = self.spec
        return standard_decode_path(spec.n_heads, spec.n_kv_heads, spec.head_dim, block_size, max_model_len,
                                    self.dtype, self.device)

    def fuse_projections(self) -> int:
        """Lay out every layer's q/k/v and gate/up weights as adjacent rows of one storage
        (in place: same Parameter objects and values), so that rollout runs each group as
        one GEMM (``fused.py``). The engine calls it at start-up. Returns the groups fused;
        a wrapped or sharded parameter is left alone, and that is said (those layers run
        their projections as separate linears: the same bits, more launches)."""
        groups = fuse_projection_storage(self.hf_model)
        expected = len(projection_groups(self.hf_model))
        if groups < expected:
            warnings.warn(f"areal-tik: {groups} of {expected} q|k|v and gate|up groups laid out as one GEMM "
                          "each; the others have wrapped or mismatched parameters and run as separate linears",
                          stacklevel=2)
        return groups

    def rollout_linears(self) -> set[tuple[int, int, bool]]:
        """(N, K, has_bias) of the fused q|k|v and gate|up GEMMs rollout runs (the warm-up's)."""
        return fused_shapes(self.hf_model)

    # ------------------------------------------------------------------ the stack

    def row_proj(self, ops):
        """o_proj / down_proj over ``ops``: ``linear`` with the K-group tree, or on a
        tensor-parallel rank its subtree gathered and combined (same bits)."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.row_proj(ops, self.k_groups)
        return row_parallel_proj(ops, self.k_groups)

    def _layer_fn(self, layer, positions, cos, sin, attend, proj, cache=None):
        ops, spec = self.ops, self.spec
        row_proj = self.row_proj(ops)

        def run(delta, residual):
            return decoder_layer(ops, spec, layer, delta, residual, positions, cos, sin, attend, row_proj, proj,
                                 cache)
        return run

    def _checkpointing(self, layer) -> bool:
        if not torch.is_grad_enabled():
            return False
        hf_on = getattr(layer, "gradient_checkpointing", False) and layer.training
        return bool(self.gradient_checkpointing or hf_on)

    def _stack(self, input_ids, positions, attend_for: Callable[[int], tuple], hooked: bool):
        """Embedding gather and every layer; returns the last ``(mlp_out, residual)``.

        ``attend_for(layer index)``: ``(attend, CacheWrite or None)`` for that layer.

        ``hooked``: run each layer as its module's forward (training path, see module doc),
        with separate projections; otherwise (rollout) q/k/v and gate/up are fused where
        their weights are adjacent (``fused.py``; same bits).
        """
        cos, sin = self.rope_tables(input_ids.device)
        residual = self._embed(input_ids)
        delta = None
        proj = SeparateProjections if hooked else FusedProjections
        for index, layer in enumerate(self._base.layers):
            attend, cache = attend_for(index)
            run = self._layer_fn(layer, positions, cos, sin, attend, proj, cache)
            if not hooked:
                delta, residual = run(delta, residual)
                continue
            if self._checkpointing(layer):
                # The replay in backward runs the same kernels on the same inputs: same bits.
                run = functools.partial(checkpoint, run, use_reentrant=False)
            delta, residual = _call_as_forward(layer, run, delta, residual)
        return delta, residual

    def _vocab_shard(self):
        shard = self.tensor_parallel
        return None if shard is None or shard.vocab is None else shard

    def _embed(self, input_ids):
        shard = self._vocab_shard()
        if shard is None:
            return F.embedding(input_ids, self.embed_weight)
        return shard.vocab.embed(input_ids, self.embed_weight, shard.gather)

    def _final_norm(self, delta, residual):
        return self.ops.add_rms_norm(delta, residual, self._base.norm.weight, self.spec.eps)[0]

    # ------------------------------------------------------------------ entry points

    def forward_packed(self, input_ids, positions, cu_seqlens, max_seqlen: int):
        """Packed varlen forward with autograd: final-normed hidden ``[T, hidden]``.

        Rows past ``cu_seqlens[-1]`` are padding (their rows are computed but meaningless).
        """
        self._check_packed(input_ids, positions, cu_seqlens)
        return _call_as_forward(self.hf_model, self._packed_body(cu_seqlens, max_seqlen), input_ids, positions)

    def forward_logprobs(self, input_ids, positions, cu_seqlens, max_seqlen: int, targets,
                         temperature: float = 1.0, return_entropy: bool = False):
        """``token_logprobs(forward_packed(...), targets)`` inside one call of ``hf_model``
        (so a wrapper that gathers the lm_head weight for the forward covers it too)."""
        self._check_packed(input_ids, positions, cu_seqlens)
        _check_int("targets", targets, 1)
        packed = self._packed_body(cu_seqlens, max_seqlen)

        def body(input_ids, positions, targets):
            return self.token_logprobs(packed(input_ids, positions), targets, temperature, return_entropy)
        return _call_as_forward(self.hf_model, body, input_ids, positions, targets)

    def _packed_body(self, cu_seqlens, max_seqlen):
        ops, scale = self.ops, self.spec.softmax_scale

        def attend_for(index):
            # Metadata checks read tensors on the host: once per forward is enough.
            check = index == 0
            return (lambda q, k, v: ops.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale,
                                                         validate=check)), None

        def body(input_ids, positions):
            return self._final_norm(*self._stack(input_ids, positions, attend_for, hooked=True))
        return body

    def prefill(self, input_ids, positions, cu_seqlens, max_seqlen: int, cache: KVCache,
                slot_mapping, logits_indices, block_tables=None, query_starts=None):
        """Prompt forward that writes K/V to ``cache`` at ``slot_mapping``; returns the
        final-normed hidden ``[S, hidden]`` of the rows ``logits_indices``.

        With ``block_tables`` ``[S, W]`` and ``query_starts`` ``[S]`` (int32) the rows of
        sequence s are positions ``query_starts[s] + [0, n_s)`` (a later chunk, or the part
        after a prefix-cache hit) and attend over the paged cache, which already holds the
        earlier positions."""
        self._check_packed(input_ids, positions, cu_seqlens)
        _check_int("slot_mapping", slot_mapping, 1)
        _check_int("logits_indices", logits_indices, 1)
        if (block_tables is None) != (query_starts is None):
            raise ValueError("block_tables and query_starts must be given together")
        ops, scale = self.ops, self.spec.softmax_scale

        def attend_for(index):
            k_cache, v_cache = cache.layer(index)

            check = index == 0  # metadata checks sync the host: once per forward

            def attend(q, k, v):  # k and v are in the cache already (qk_norm_rope)
                if block_tables is not None:
                    return ops.attention_paged_prefill(q, k_cache, v_cache, cu_seqlens, max_seqlen,
                                                       block_tables, query_starts, scale, validate=check)
                return ops.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, validate=check)
            return attend, CacheWrite(k_cache, v_cache, slot_mapping, check)

        delta, residual = self._stack(input_ids, positions, attend_for, hooked=False)
        return self._final_norm(delta[logits_indices], residual[logits_indices])

    def decode(self, input_ids, positions, cache: KVCache, slot_mapping, block_tables, context_lens):
        """One token per sequence: writes its K/V at ``slot_mapping`` and attends over the
        paged cache (``context_lens`` includes the new token). Returns ``[B, hidden]``.
        Static shapes, no host synchronisation: CUDA-graph capturable."""
        _check_int("input_ids", input_ids, 1)
        _check_int("positions", positions, 1)
        _check_int("slot_mapping", slot_mapping, 1)
        _check_int("block_tables", block_tables, 2, (torch.int32,))
        _check_int("context_lens", context_lens, 1, (torch.int32,))
        ops, scale = self.ops, self.spec.softmax_scale

        def attend_for(index):
            k_cache, v_cache = cache.layer(index)

            check = index == 0  # metadata checks sync the host: once per step

            def attend(q, k, v):  # the new token's k and v are in the cache already (qk_norm_rope)
                return ops.attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                            validate=check)
            return attend, CacheWrite(k_cache, v_cache, slot_mapping, check)

        return self._final_norm(*self._stack(input_ids, positions, attend_for, hooked=False))

    @staticmethod
    def _check_packed(input_ids, positions, cu_seqlens) -> None:
        _check_int("input_ids", input_ids, 1)
        _check_int("positions", positions, 1)
        _check_int("cu_seqlens", cu_seqlens, 1, (torch.int32,))
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions must have shape {tuple(input_ids.shape)}, got {tuple(positions.shape)}")

    # ------------------------------------------------------------------ log-probs

    def token_logprobs(self, hidden, targets, temperature: float = 1.0, return_entropy: bool = False):
        """fp32 ``log_softmax(hidden @ lm_head.T / T)[targets]`` (and entropy) via ``ops.token_logprobs``.
        (A vocabulary-sharded rank has a slice of the LM head: it serves ``logits_lse`` only.)"""
        if self._vocab_shard() is not None:
            raise ValueError("token_logprobs needs the full LM head; this rank is vocabulary-sharded "
                             "(use logits_lse with gather_logprobs, the same bits)")
        return self.ops.token_logprobs(hidden, self.lm_head_weight, targets, temperature, return_entropy)

    def logits_lse(self, hidden, temperature: float = 1.0):
        """``(logits, lse)`` of the lm head at ``temperature`` via ``ops.lm_head_logits_lse``
        (on a vocabulary-sharded rank: the rank's splits, gathered; the same bits)."""
        shard = self._vocab_shard()
        if shard is not None:
            return shard.vocab.logits_lse(hidden, self.lm_head_weight, temperature, shard.gather)
        return self.ops.lm_head_logits_lse(hidden, self.lm_head_weight, temperature)

    def vocab_shard_logits_lse(self, hidden, temperature: float = 1.0):
        """On a vocabulary-sharded rank ``(its logits columns [T, V_r], the full lse [T], its
        first column, the group's rank-ordered gather)``, for sampling without gathering
        the logits (``sampler.sample_sharded``); None on a model holding the full LM head."""
        shard = self._vocab_shard()
        if shard is None:
            return None
        logits, lse = shard.vocab.local_logits_lse(hidden, self.lm_head_weight, temperature, shard.gather)
        return logits, lse, shard.vocab.start, shard.gather

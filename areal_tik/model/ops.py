"""Op backends for the unified model: ``get_ops("unified")`` or ``get_ops("standard")``.

Both expose the functional API of ``areal_tik.unified_kernels`` under the same names and
signatures (``OP_NAMES``), so one model code path runs either:

- ``"unified"``: the Triton kernels of ``areal_tik.unified_kernels``, resolved lazily op
  by op. An op whose kernel module does not exist (yet) raises ``KernelUnavailableError``
  when first used; nothing is ever substituted silently.
- ``"standard"``: what stock Hugging Face / AReaL stacks run, in pure torch (runs on CPU
  without Triton): ``F.linear`` (with ``k_groups`` > 1, the K-group tree over fp32 torch
  matmuls, for tensor-parallel row shards), the HF-style eager RMSNorm / rope / SiLU, attention
  (packed varlen: torch's FlashAttention varlen on CUDA where this torch has it, else
  SDPA in a loop over sequences; decode: SDPA over the gathered paged K/V) and a
  materialised ``log_softmax`` for log-probs. It is the baseline of the benchmarks and
  is NOT batch invariant.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
import types
import warnings

import torch
import torch.nn.functional as F

from areal_tik.runtime import KERNEL_SETS
from areal_tik.unified_kernels import qk_rope, reference
from areal_tik.unified_kernels._ktree import check_k_groups, combine_partials, tree_sum

OP_NAMES = (
    "linear", "linear_partial", "combine_partials", "rms_norm", "add_rms_norm", "rope_cos_sin", "apply_rope", "silu_mul",
    "qk_norm_rope", "token_logprobs", "lm_head_logits_lse", "gather_logprobs",
    "attention_varlen", "store_kv_cache", "attention_decode", "attention_paged_prefill",
)
_KERNEL_PACKAGE = "areal_tik.unified_kernels"


class KernelUnavailableError(NotImplementedError):
    """A unified op was requested whose Triton kernel is not in areal_tik.unified_kernels."""


# --------------------------------------------------------------------------- unified


def _resolve_unified(name: str):
    try:
        package = importlib.import_module(_KERNEL_PACKAGE)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith(_KERNEL_PACKAGE + "."):
            raise  # a third-party import is missing: not a kernel still being written
        raise KernelUnavailableError(
            f"unified op {name!r} is not available: {exc.name} does not exist") from exc
    fn = getattr(package, name, None)
    if not callable(fn) or isinstance(fn, types.ModuleType):
        raise KernelUnavailableError(
            f"unified op {name!r} is not available: {_KERNEL_PACKAGE} has no function {name!r}")
    return fn


class UnifiedOps:
    """The Triton kernels; each op is imported on first use and then cached."""

    kind = "unified"

    def __getattr__(self, name: str):
        if name not in OP_NAMES:
            raise AttributeError(f"{type(self).__name__} has no op {name!r}; ops: {OP_NAMES}")
        fn = _resolve_unified(name)
        setattr(self, name, fn)
        return fn

    def __repr__(self):
        return "UnifiedOps()"


# --------------------------------------------------------------------------- standard


def _std_linear(x, weight, bias=None, *, k_groups=1):
    """F.linear; with k_groups > 1 the unified set's K-group tree over fp32 torch matmuls
    (the same tree and rounding points; the per-group sums are torch's, not bitwise ours)."""
    check_k_groups(k_groups, x.shape[-1])
    if k_groups == 1:
        return F.linear(x, weight, bias)
    return _std_combine_partials([_std_linear_partial(x, weight, k_groups=k_groups)], bias, x.dtype)


def _std_linear_partial(x, weight_shard, *, k_groups):
    """The fp32 tree root over ``k_groups`` contiguous K groups (fp32 matmul per group), no bias."""
    check_k_groups(k_groups, x.shape[-1])
    width = x.shape[-1] // k_groups
    sums = [F.linear(x[..., g * width:(g + 1) * width].float(), weight_shard[:, g * width:(g + 1) * width].float())
            for g in range(k_groups)]
    return tree_sum(sums)


def _std_combine_partials(parts, bias, dtype):
    return combine_partials(parts, bias, dtype, kernel_device=False)


def _std_rms_norm(x, weight, eps):
    return reference.rms_norm(x, weight, eps, compute=None)


def _std_add_rms_norm(x, residual, weight, eps):
    return reference.add_rms_norm(x, residual, weight, eps, compute=None)


def _inv_freq_fp32(head_dim, base, scaling):
    # As transformers computes it: fp32 throughout (reference.rope_inv_freq is the fp64 oracle).
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return torch.where(medium, smoothed, scaled)


def _std_rope_cos_sin(max_positions, head_dim, base, scaling=None, device=None):
    """fp32 ``[max_positions, head_dim // 2]`` tables, as HF's rotary embedding computes them."""
    inv = _inv_freq_fp32(head_dim, float(base), scaling).to(device)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = pos[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


def _rotate(x, c, s):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s


def _std_apply_rope(q, k, positions, cos, sin):
    # HF: cos/sin rounded to the activation dtype, then q*cos + rotate_half(q)*sin in it.
    c = cos[positions.long()].to(q.dtype)
    s = sin[positions.long()].to(q.dtype)
    c = torch.cat([c, c], dim=-1)[:, None, :]
    s = torch.cat([s, s], dim=-1)[:, None, :]
    return _rotate(q, c, s), _rotate(k, c, s)


def _std_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Rows per chunk of the standard log-prob: AReaL 1.0.4's gather_logprobs default.
LOGPROB_CHUNK = 1024


@functools.cache
def _areal_gather():
    """AReaL's (gather_logprobs, gather_logprobs_entropy), or None where AReaL is absent."""
    try:
        from areal.utils.functional import gather_logprobs, gather_logprobs_entropy
    except ImportError:
        return None
    return gather_logprobs, gather_logprobs_entropy


@functools.cache
def _warn_eager_logprobs() -> None:
    warnings.warn("areal-tik: AReaL is not importable, so the standard token log-prob runs its "
                  "chunks eagerly on the GPU, not AReaL's compiled gather_logprobs", RuntimeWarning, stacklevel=3)


def areal_gather_compiled() -> bool:
    """Whether AReaL's gather_logprobs(_entropy) run compiled in this process. AReaL 1.0.4
    wraps them in torch.compile at import (not on NPUs); a process with Dynamo disabled
    (``TORCHDYNAMO_DISABLE=1``, as the CPU tests run) calls the same wrappers eagerly."""
    try:
        from areal.utils.functional import vocab_parallel
    except ImportError:
        return False
    import torch._dynamo

    wrapped = hasattr(getattr(vocab_parallel, "_gather_logprobs_entropy", None), "_torchdynamo_orig_callable")
    return wrapped and not torch._dynamo.config.disable


def areal_gather_label() -> str:
    """The run file's name for AReaL's own ``gather_logprobs_entropy`` (the trainer over the
    Hugging Face model calls it): compiled or eager, outside the parentheses, so that the
    report, which drops them, keeps the two apart."""
    if areal_gather_compiled():
        return "AReaL gather_logprobs_entropy (torch.compile)"
    return "AReaL gather_logprobs_entropy, eager (Dynamo disabled or not available)"


def standard_logprob_path(device) -> str:
    """What ``_std_token_logprobs`` runs on ``device``: the name a run file records."""
    if torch.device(device).type == "cuda" and _areal_gather() is not None:
        if areal_gather_compiled():
            return f"areal-gather-chunked (torch.compile, {LOGPROB_CHUNK} rows)"
        return f"areal-gather-eager (Dynamo disabled, {LOGPROB_CHUNK} rows)"
    return f"chunked-eager ({LOGPROB_CHUNK} rows)"


def _chunked_logprobs(logits, labels, temperature, return_entropy):
    # AReaL's chunk function, eagerly: log_softmax(logits.float() / T), gathered (and entropy).
    lps, ents = [], []
    for i in range(0, logits.shape[0], LOGPROB_CHUNK):
        logp = torch.log_softmax(logits[i:i + LOGPROB_CHUNK].float() / temperature, dim=-1)
        lps.append(logp.gather(-1, labels[i:i + LOGPROB_CHUNK].unsqueeze(-1)).squeeze(-1))
        if return_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    return (torch.cat(lps), torch.cat(ents)) if return_entropy else torch.cat(lps)


def _std_token_logprobs(hidden, weight, targets, temperature=1.0, return_entropy=False):
    """As AReaL's FSDP actor computes them: the LM head's logits in the activation dtype
    (``F.linear``), then AReaL's ``gather_logprobs`` / ``gather_logprobs_entropy``
    (``log_softmax(logits.float() / T)`` per 1024-row chunk, torch.compile'd) on a GPU; the
    same chunked math eagerly elsewhere (a CPU compiles nothing). Until this, the standard
    set materialised fp32 log-softmax over all rows at once: at 16,384 rows and Qwen's
    151,936-entry vocabulary that is 10 GB a tensor, and the stock run of a 1024-token
    recipe ran out of an 80 GB GPU's memory."""
    logits = F.linear(hidden, weight)
    labels = targets.long()
    if logits.is_cuda and _areal_gather() is None:
        _warn_eager_logprobs()
    elif logits.is_cuda:
        gather, gather_entropy = _areal_gather()
        fn = gather_entropy if return_entropy else gather
        return fn(logits, labels, temperature, chunk_size=LOGPROB_CHUNK)
    return _chunked_logprobs(logits, labels, temperature, return_entropy)


def _std_lm_head_logits_lse(hidden, weight, temperature=1.0):
    logits = F.linear(hidden, weight)
    return logits, torch.logsumexp(logits.float() / temperature, dim=-1)


def _std_gather_logprobs(logits, lse, targets, temperature=1.0):
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked.float() / temperature - lse


@functools.cache
def _flash_varlen():
    """torch's FlashAttention varlen entry and the causal keyword this torch spells, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


_flash_varlen_failed: list[str] = []  # why torch's varlen_attn failed: every later call takes SDPA
_flash_varlen_skipped: dict[str, None] = {}  # why some GPU calls took SDPA without trying it (ordered set)


def _skip_flash_varlen(reason: str) -> None:
    """A GPU call goes to SDPA per sequence without trying varlen_attn: said once per reason
    (a RuntimeWarning) and kept for the run file's ``training_attention``."""
    if reason not in _flash_varlen_skipped:
        _flash_varlen_skipped[reason] = None
        warnings.warn(f"standard attention: {reason}; using SDPA per sequence instead", RuntimeWarning, stacklevel=4)


def standard_attention_path(device) -> str:
    """What the standard set's packed attention (training, recompute, the engine's prefill)
    has run in this process on ``device``, as a run file records it after the run
    (``metadata.training_attention``): torch's FlashAttention varlen, or SDPA per sequence
    (a host loop) where it is unavailable or, on a GPU, after it failed once (a fallback
    the stock run's speed depends on, so the report names it)."""
    if torch.device(device).type != "cuda":
        return "sdpa-per-sequence (not on a GPU)"
    if _flash_varlen() is None:
        return "sdpa-per-sequence fallback (this torch has no usable varlen_attn)"
    if _flash_varlen_failed:
        return f"sdpa-per-sequence fallback (varlen_attn failed: {_flash_varlen_failed[0][:200]})"
    if _flash_varlen_skipped:
        return f"sdpa-per-sequence fallback for some calls ({'; '.join(_flash_varlen_skipped)[:200]})"
    return "flash-varlen (torch)"


def _flash_attention_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    """FlashAttention varlen over the packed rows ``[: cu_seqlens[-1]]``, or None if unusable."""
    if not q.is_cuda or _flash_varlen_failed:  # off a GPU, or after a failure (warned then)
        return None
    found = _flash_varlen()
    if found is None:
        _skip_flash_varlen("this torch has no usable torch.nn.attention.varlen.varlen_attn")
        return None
    varlen_attn, kwargs, has_gqa, has_scale = found
    kwargs = dict(kwargs)
    if softmax_scale is not None:
        if not has_scale and softmax_scale != q.shape[-1] ** -0.5:
            _skip_flash_varlen(f"this torch's varlen_attn takes no scale and softmax_scale {softmax_scale} "
                               f"is not head_dim ** -0.5")
            return None
        if has_scale:
            kwargs["scale"] = softmax_scale
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = cu_seqlens.to(torch.int32)
    rows = int(cu[-1])
    max_len = int(max_seqlen)
    try:
        o = varlen_attn(q[:rows], k[:rows], v[:rows], cu, cu, max_len, max_len, **kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:  # an older torch or an unsupported shape
        _flash_varlen_failed.append(str(exc))
        warnings.warn(f"standard attention: torch varlen_attn failed ({exc}); "
                      "using SDPA per sequence instead", RuntimeWarning, stacklevel=3)
        return None
    if isinstance(o, tuple):
        o = o[0]
    if rows == q.shape[0]:
        return o
    return torch.cat([o, o.new_zeros((q.shape[0] - rows, *o.shape[1:]))])


def _std_attention_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, *, validate=True):
    """Causal attention over packed sequences; rows past cu_seqlens[-1] are zeros.

    CUDA: torch's FlashAttention varlen (what stock stacks run for packed training);
    otherwise, or where that entry is missing, SDPA per sequence (host loop).
    """
    flash = _flash_attention_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
    if flash is not None:
        return flash
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                is_causal=True, scale=softmax_scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
    return out


def _std_store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, validate=True):
    """Write k/v ``[T, Hk, D]`` into flat slots of ``[num_blocks, block_size, Hk, D]`` caches;
    slot -1 skips a row (padding), as the unified kernel does.

    Without a host sync (CUDA-graph capturable): skipped rows are redirected to a slot
    that is written anyway (the first valid row's, with that row's values; or slot 0 with
    its own current bits when no row is valid), so duplicate writes carry identical bits.
    """
    slots = slot_mapping.long()
    valid = slots >= 0
    # First valid row (0 when there is none), as a 1-element index tensor: indexing with a
    # 0-d device tensor would read it on the host, which CUDA-graph capture forbids.
    rows = torch.arange(slots.shape[0], device=slots.device)
    first = torch.where(valid, rows, slots.shape[0]).amin().clamp_max(slots.shape[0] - 1).view(1)
    spare = slots.index_select(0, first).clamp_min(0)
    target = torch.where(valid, slots, spare)
    first_valid = valid.index_select(0, first).view(1, 1, 1)
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        fill = torch.where(first_valid, new.index_select(0, first), flat.index_select(0, spare))
        flat.index_copy_(0, target, torch.where(valid[:, None, None], new, fill))


# Decode for the standard set: FlashAttention 2 (torch's ``_flash_attention_forward``, the
# kernel under its SDPA), reading each sequence's used K/V only (``seqused_k``): the bytes a
# stock engine's FlashAttention backend reads. torch 2.11's FlashAttention takes no block
# table, so the stock path keeps each sequence's K/V in ONE block (``kv_block_size`` >=
# ``max_model_len``: a static per-sequence cache, ``one_block_per_sequence``); sequence b's
# K/V are then rows ``[t_b * bs, t_b * bs + len_b)`` of the flattened cache, which the
# varlen kernel takes as that sequence's start (``cu_seqlens_k[b]``) and length
# (``seqused_k[b]``). With more than one block per sequence, on a CPU, or after a failed
# self-check the gather + SDPA path below runs, and ``flash_decode_reason`` says why.
_flash_decode_failed: list[str] = []


def one_block_per_sequence(max_model_len: int) -> int:
    """The KV block size (a power of two) that holds a whole ``max_model_len`` sequence."""
    return 1 << max(int(max_model_len) - 1, 1).bit_length()


def flash_decode_unusable(is_cuda: bool, has_seqused_k: bool, blocks_per_seq: int) -> str | None:
    """Why the standard decode cannot run FlashAttention over each sequence's own rows
    (None: it can)."""
    if not is_cuda:
        return "not on a GPU"
    if _flash_decode_failed:
        return f"its self-check failed: {_flash_decode_failed[0]}"
    if not has_seqused_k:
        return "this torch's _flash_attention_forward takes no seqused_k"
    if blocks_per_seq != 1:
        return (f"{blocks_per_seq} KV blocks per sequence (FlashAttention without a block table "
                f"reads one contiguous range per sequence)")
    return None


@functools.cache
def _flash_forward_has_seqused_k() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and any(a.name == "seqused_k" for a in op.default._schema.arguments)


def flash_decode_reason(q, blocks_per_seq: int) -> str | None:
    """None when the standard decode of ``q`` over tables ``blocks_per_seq`` wide calls
    FlashAttention, else why it gathers the blocks instead."""
    return flash_decode_unusable(q.is_cuda, q.is_cuda and _flash_forward_has_seqused_k(), blocks_per_seq)


def _flash_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale):
    """One query row per sequence against its one block's first ``context_lens`` rows."""
    batch, block = q.shape[0], k_cache.shape[1]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    starts = block_tables[:, 0].clamp(0, k_cache.shape[0] - 1).to(torch.int32) * block  # padding rows: block 0
    cu_k = torch.cat([starts, starts.new_full((1,), flat_k.shape[0])])
    cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.aten._flash_attention_forward(
        q, flat_k, flat_v, cu_q, cu_k, 1, block, 0.0, False, False, scale=scale,
        seqused_k=context_lens.to(torch.int32))[0]


def check_flash_decode(n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, blocks_per_seq: int,
                       dtype, device) -> str | None:
    """Run the FlashAttention decode once, eagerly, against the gather path on a small random
    cache (before any CUDA-graph capture); on an error or a disagreement beyond bf16 rounding
    it is switched off for the process. Returns why it is not used, or None."""
    q = torch.empty(3, n_heads, head_dim, device=device, dtype=dtype)
    reason = flash_decode_reason(q, blocks_per_seq)
    if reason is not None:
        return reason
    gen = torch.Generator(device=device).manual_seed(0)
    q.normal_(generator=gen)
    k_cache = torch.randn(4, block_size, n_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen, device=device, dtype=dtype)
    tables = torch.tensor([[2], [3], [1]], device=device, dtype=torch.int32)  # not in block order
    lens = torch.tensor([min(block_size // 2 + 5, block_size), 1, block_size], device=device, dtype=torch.int32)
    try:
        got = _flash_decode(q, k_cache, v_cache, tables, lens, None).float()
    except (RuntimeError, TypeError, ValueError) as exc:
        _flash_decode_failed.append(f"{type(exc).__name__}: {exc}")
    else:
        want = _gather_attention_decode(q, k_cache, v_cache, tables, lens, None).float()
        err = (got - want).abs().max().item()
        if not err <= 2e-2 * want.abs().max().item() + 1e-3:
            _flash_decode_failed.append(f"max |flash - gathered| {err:.3g}")
    if _flash_decode_failed:
        warnings.warn(f"standard decode: FlashAttention is not used ({_flash_decode_failed[0]}); "
                      f"gathering the blocks instead", RuntimeWarning, stacklevel=2)
        return flash_decode_reason(q, blocks_per_seq)
    return None


def standard_decode_path(n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, max_model_len: int,
                         dtype, device) -> str:
    """The standard set's decode attention at this shape, after the self-check:
    "flash-seqused" or "gather-sdpa (why)"."""
    blocks = -(-max_model_len // block_size)
    reason = check_flash_decode(n_heads, n_kv_heads, head_dim, block_size, blocks, dtype, device)
    return "flash-seqused" if reason is None else f"gather-sdpa ({reason})"


def _std_attention_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale=None, *,
                          validate=True):
    """Paged decode: FlashAttention over each sequence's own rows where it runs
    (``flash_decode_reason``), otherwise the gather path."""
    if flash_decode_reason(q, block_tables.shape[1]) is None:
        return _flash_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale)
    return _gather_attention_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale)


def _gather_attention_decode(q, k_cache, v_cache, block_tables, context_lens, softmax_scale=None):
    """Gather each sequence's paged K/V into a contiguous ``[B, L, Hk, D]`` and call SDPA.

    Static shapes only (L = blocks per table x block_size), so it is CUDA-graph capturable;
    slots past the context are zeroed (they may hold garbage) and masked out.
    """
    batch, n_blocks = block_tables.shape
    tables = block_tables.long().clamp(0, k_cache.shape[0] - 1)
    length = n_blocks * k_cache.shape[1]
    valid = torch.arange(length, device=q.device)[None, :] < context_lens.long()[:, None]  # [B, L]
    keep = valid[:, :, None, None]
    k = torch.where(keep, k_cache[tables].reshape(batch, length, *k_cache.shape[2:]), 0)
    v = torch.where(keep, v_cache[tables].reshape(batch, length, *v_cache.shape[2:]), 0)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=softmax_scale, enable_gqa=True)
    return out[:, :, 0, :]


def _std_attention_paged_prefill(q, k_cache, v_cache, cu_seqlens, max_seqlen, block_tables,
                                 query_starts, softmax_scale=None, *, validate=True):
    """Per sequence: gather its paged K/V of positions [0, start + n) and call SDPA with
    the causal mask shifted by ``start`` (rows past cu_seqlens[-1] are zeros)."""
    out = torch.zeros_like(q)
    cu, starts = cu_seqlens.tolist(), query_starts.tolist()
    bs = k_cache.shape[1]
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        n_ctx = starts[s] + b - a
        pos = torch.arange(n_ctx, device=q.device)
        slots = block_tables[s].long()[pos // bs] * bs + pos % bs
        k = k_cache.view(-1, *k_cache.shape[2:])[slots].transpose(0, 1)
        v = v_cache.view(-1, *v_cache.shape[2:])[slots].transpose(0, 1)
        mask = pos[None, :] <= (starts[s] + torch.arange(b - a, device=q.device))[:, None]
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k, v, attn_mask=mask, scale=softmax_scale,
            enable_gqa=True).transpose(0, 1)
    return out


_STANDARD = {
    "linear": _std_linear,
    "linear_partial": _std_linear_partial,
    "combine_partials": _std_combine_partials,
    "rms_norm": _std_rms_norm,
    "add_rms_norm": _std_add_rms_norm,
    "rope_cos_sin": _std_rope_cos_sin,
    "apply_rope": _std_apply_rope,
    "silu_mul": _std_silu_mul,
    "token_logprobs": _std_token_logprobs,
    "lm_head_logits_lse": _std_lm_head_logits_lse,
    "gather_logprobs": _std_gather_logprobs,
    "attention_varlen": _std_attention_varlen,
    "store_kv_cache": _std_store_kv_cache,
    "attention_decode": _std_attention_decode,
    "attention_paged_prefill": _std_attention_paged_prefill,
}


# Composite ops: bound to their namespace, so that they call its ops (compiled ones included).
_STANDARD_COMPOSITES = {"qk_norm_rope": qk_rope.compose}  # norms, rope, K/V write in sequence
assert set(_STANDARD) | set(_STANDARD_COMPOSITES) == set(OP_NAMES)


def _standard_ops():
    ops = types.SimpleNamespace(kind="standard", **_STANDARD)
    for name, fn in _STANDARD_COMPOSITES.items():
        setattr(ops, name, functools.partial(fn, ops))
    return ops


# The standard ops a stock engine compiles: the elementwise chains between the GEMMs and the
# attention (vLLM compiles its model the same way). Not the KV store: compiled, its in-place
# write into the whole cache (a graph input) made decode 3-4x slower than eager on the H200,
# and one index_copy launch has nothing to fuse.
COMPILED_STANDARD_OPS = ("rms_norm", "add_rms_norm", "apply_rope", "silu_mul")


def compiled_standard_ops(names=COMPILED_STANDARD_OPS):
    """A fresh standard set with ``names`` under ``torch.compile`` (dynamic shapes, one graph
    each): a stock engine whose norms, rope and SiLU-mul run as fused kernels, the rest
    (cuBLAS, FlashAttention, sampling) unchanged. The shared standard set is not touched.
    Compilation happens at each op's first calls (an engine's first prefill, its graph
    captures). Duck shaping is turned off, for the whole process (``torch.fx``'s
    ``use_duck_shape``, read when a graph is traced), so that no guard ties sizes that happen
    to be equal (rows == hidden size) and recompiles when they part."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    ops = _standard_ops()
    for name in names:
        setattr(ops, name, torch.compile(getattr(ops, name), dynamic=True, fullgraph=True))
    return ops


def engine_compiled_ops(kernels: str, compile_standard_ops: bool = False) -> tuple[str, ...]:
    """The ops an engine on ``kernels`` runs under torch.compile: ``COMPILED_STANDARD_OPS`` for
    the standard set with ``compile_standard_ops`` (``EngineConfig.compile_standard_ops``),
    none otherwise."""
    return COMPILED_STANDARD_OPS if compile_standard_ops and kernels == "standard" else ()


def engine_ops(kernels: str, compile_standard_ops: bool = False):
    """The ops an engine runs for ``kernels``: the compiled standard set where
    ``engine_compiled_ops`` names any, otherwise ``kernels`` itself."""
    names = engine_compiled_ops(kernels, compile_standard_ops)
    return compiled_standard_ops(names) if names else kernels


# --------------------------------------------------------------------------- selection


def get_ops(kind="unified"):
    """The op backend ``kind`` ("unified" or "standard"), or ``kind`` itself if it is one.

    A custom backend is any object with a ``kind`` string and every name in OP_NAMES.
    """
    if isinstance(kind, str):
        if kind == "unified":
            return UnifiedOps()
        if kind == "standard":
            return _standard_ops()
        raise ValueError(f"kernels must be one of {KERNEL_SETS} or an ops object, got {kind!r}")
    if isinstance(kind, UnifiedOps):
        return kind
    missing = [n for n in (*OP_NAMES, "kind") if n not in dir(kind)]
    if missing:
        raise TypeError(f"ops object {kind!r} lacks {missing}")
    return kind


def missing_ops(kind="unified", names=OP_NAMES) -> list[str]:
    """The ops of ``names`` that backend ``kind`` cannot provide right now (tests skip on them)."""
    ops = get_ops(kind)
    missing = []
    for name in names:
        try:
            getattr(ops, name)
        except KernelUnavailableError:
            missing.append(name)
    return missing

"""Warm-up: compile every kernel variant a model's rollout and training launch, at start-up.

Triton compiles a kernel the first time it meets a new key: the constexprs, the launch
options and, per runtime argument, its type and a specialisation (an int equal to 1
becomes a constant; an int divisible by 16 and a 16-byte aligned pointer get a
divisibility hint). The ops of linear.py, logprob.py, rms_norm.py, swiglu.py, rope.py and qk_rope.py
keep their data-dependent integers (row and token counts, chunk bounds) out of the key
(``do_not_specialize``) and launch on aligned buffers, so their keys change with the row
count only where the schedule does: linear's row buckets (one tile config per bucket) and
its ``MASK_ROWS`` flag below one tile of rows. ``linear_row_variants`` lists those
exactly; ``warmup`` runs each op once per variant on zero inputs. Attention keeps the
token and sequence counts, the LSE row stride and the block-table width out of the key
too, so one packing per mode (training forward with the LSE and its backward, rollout
prefill without it, paged prefill, decode with one KV split and with several) compiles
every attention kernel a later step launches.

Where compiled kernels live: Triton's on-disk cache, ``$TRITON_CACHE_DIR`` (default
``~/.triton/cache``), one folder per key hash holding the binary and its metadata. A
later process with the same Triton, GPU type, kernel source and key loads the binary from
there instead of compiling, so a second run of the same recipe compiles nothing; keep the
folder on a persistent disk (mount it into containers) to carry it between runs.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import itertools
import os
from typing import Callable

import torch

from ._common import FLOAT_DTYPES, interpreting
from ._ktree import check_k_groups
from ._attention_fwd import attention_config as _attention_config
from .attention import attention_decode, attention_paged_prefill, attention_varlen, store_kv_cache

# The op modules (the package attributes ``linear`` and ``rms_norm`` are the functions).
_linear, _logprob, _rms, _rope, _swiglu, _qk_rope = (
    importlib.import_module(f".{name}", __package__)
    for name in ("linear", "logprob", "rms_norm", "rope", "swiglu", "qk_rope"))

_EPS = 1e-6
_INDEX_DTYPES = (torch.int32, torch.int64)  # positions / targets arrive as either


@dataclasses.dataclass(frozen=True)
class WarmupShapes:
    """What a model launches. ``linears``: every distinct projection weight ``(N, K,
    has_bias)``, or ``(N, K, has_bias, k_groups)`` for one run with the K-group tree
    (row-parallel projections; k_groups 1 is the plain entry); ``partials``: ``(N, K,
    k_groups)`` of each ``linear_partial`` a tensor-parallel rank runs on its K shard
    (fp32 output: other kernel keys); ``norms``: RMSNorm widths (hidden, and head_dim for
    per-head q/k norms' backward); ``intermediates``: SwiGLU widths I; ``heads``: (q heads, kv
    heads, head_dim); ``lm_head``: (V, H); ``head_norms``: (heads, head_dim) of each
    per-head norm's forward (Qwen3 q/k norm: the kernel variant keys on the head count)."""
    linears: tuple[tuple, ...]
    norms: tuple[int, ...]
    intermediates: tuple[int, ...]
    heads: tuple[int, int, int]
    lm_head: tuple[int, int]
    dtype: torch.dtype = torch.bfloat16
    partials: tuple[tuple[int, int, int], ...] = ()
    head_norms: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {self.dtype}")
        if any(len(entry) not in (3, 4) for entry in self.linears) or any(len(p) != 3 for p in self.partials):
            raise ValueError(f"linears are (N, K, has_bias[, k_groups]) and partials (N, K, k_groups), got {self}")
        ints = [v for entry in self.linears for v in entry[:2]] + [v for p in self.partials for v in p[:2]]
        ints += list(self.norms) + list(self.intermediates) + list(self.heads) + list(self.lm_head)
        ints += [v for pair in self.head_norms for v in pair]
        if not self.linears or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in ints):
            raise ValueError(f"every shape must be a positive int (and linears non-empty), got {self}")
        for entry in self.linears:
            check_k_groups(entry[3] if len(entry) == 4 else 1, entry[1])
        for _, k, groups in self.partials:
            check_k_groups(groups, k)
        hq, hk, _ = self.heads
        if hq % hk:
            raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")


def linear_row_variants(n: int, k: int, dtype: torch.dtype, max_rows: int, tma: bool = True,
                        k_groups: int = 1) -> list[int]:
    """The smallest row count of each launch variant of an ``[n, k]`` linear in
    ``[1, max_rows]``: a variant is (tile config, rows < BLOCK_M), all the key sees of M."""
    variants: dict = {}
    for rows in _linear.row_probes(dtype, max_rows):  # every row where the variant can change
        cfg = _linear.linear_config(rows, n, k, dtype, tma=tma, k_groups=k_groups)
        variants.setdefault((cfg, rows < cfg.block_m), rows)
    return sorted(variants.values())


def warm_linear(linears, max_rows: int, dtype, device, partials=()) -> list[Callable]:
    """Forward at every row variant of every weight (the backward is cuBLAS: nothing to
    compile), with its k_groups; and each partial (fp32 output) likewise. K_GROUPS is a
    constexpr of the key: k_groups 1 launches exactly the keys of a plain entry."""
    tasks = []
    entries = [(n, k, has_bias, rest[0] if rest else 1, False) for n, k, has_bias, *rest in linears]
    entries += [(n, k, False, groups, True) for n, k, groups in partials]
    for n, k, has_bias, groups, partial in dict.fromkeys(entries):
        w = torch.zeros(n, k, dtype=dtype, device=device)
        b = torch.zeros(n, dtype=dtype, device=device) if has_bias else None
        x = torch.zeros(max_rows, k, dtype=dtype, device=device)
        for rows in linear_row_variants(n, k, dtype, max_rows, tma=_linear.tma_compatible(x, w), k_groups=groups):
            if partial:
                tasks.append(functools.partial(_linear.partial_forward, x[:rows], w, groups))
            else:
                tasks.append(functools.partial(_linear.linear_forward, x[:rows], w, b, k_groups=groups))
    return tasks


def warm_norms(norms, dtype, device, training: bool, head_norms=()) -> list[Callable]:
    """RMSNorm with and without the residual add; backward with and without the residual
    grad; the per-head form's forward of each (heads, head_dim)."""
    tasks = []
    for heads, d in dict.fromkeys(head_norms):
        x = torch.zeros(2, heads, d, dtype=dtype, device=device)
        tasks.append(functools.partial(_rms._forward, x, None, torch.ones(d, dtype=dtype, device=device), _EPS))
    for h in dict.fromkeys(norms):
        x, r, dy = (torch.zeros(2, h, dtype=dtype, device=device) for _ in range(3))
        w = torch.ones(h, dtype=dtype, device=device)
        tasks += [functools.partial(_rms._forward, x, None, w, _EPS), functools.partial(_rms._forward, x, r, w, _EPS)]
        if training:
            tasks += [functools.partial(_rms._backward, x, dy, None, w, _EPS),
                      functools.partial(_rms._backward, x, dy, r, w, _EPS)]
    return tasks


def warm_swiglu(intermediates, dtype, device, training: bool) -> list[Callable]:
    tasks = []
    for i in dict.fromkeys(intermediates):
        gate_up = torch.zeros(2, 2 * i, dtype=dtype, device=device)
        tasks.append(functools.partial(_swiglu._forward, gate_up))
        if training:
            tasks.append(functools.partial(_swiglu._backward, gate_up, torch.zeros(2, i, dtype=dtype, device=device)))
    return tasks


def warm_rope(heads, dtype, device, training: bool) -> list[Callable]:
    hq, hk, d = heads
    q = torch.zeros(2, hq, d, dtype=dtype, device=device)
    k = torch.zeros(2, hk, d, dtype=dtype, device=device)
    cos = torch.ones(4, d // 2, dtype=torch.float32, device=device)
    return [functools.partial(_rope._launch, q, k, torch.zeros(2, dtype=index_dtype, device=device), cos, cos,
                              backward=backward)
            for index_dtype in _INDEX_DTYPES for backward in ((False, True) if training else (False,))]


def _qk_rope_step(heads, has_norm: bool, dtype, device, block_size: int | None, index_dtype) -> None:
    """qk_norm_rope without autograd on q/k as views of a fused q|k|v output and as contiguous
    tensors (the two layouts differ in a token stride, both multiples of 16 where the fused
    kernel runs: one key, or the composition's kernels where it does not), with the cache
    write when the engine has a cache of ``block_size``."""
    hq, hk, d = heads
    qkv = torch.zeros(2, (hq + 2 * hk) * d, dtype=dtype, device=device)
    q, k, v = qkv[:, :hq * d].view(2, hq, d), qkv[:, hq * d:(hq + hk) * d].view(2, hk, d), qkv[:, (hq + hk) * d:].view(2, hk, d)
    w = torch.ones(d, dtype=dtype, device=device) if has_norm else None
    pos = torch.zeros(2, dtype=index_dtype, device=device)
    cos = torch.ones(4, d // 2, dtype=torch.float32, device=device)
    with torch.no_grad():
        for qq, kk in ((q, k), (q.contiguous(), k.contiguous())):
            _qk_rope.qk_norm_rope(qq, kk, pos, cos, cos, w, w, _EPS, validate=False)
        if block_size is not None:
            kc = torch.zeros(2, block_size, hk, d, dtype=dtype, device=device)
            slots = torch.arange(2, device=device) + block_size
            _qk_rope.qk_norm_rope(q, k, pos, cos, cos, w, w, _EPS, v=v, k_cache=kc, v_cache=kc,
                                  slot_mapping=slots, validate=False)


def warm_qk_rope(heads, has_norm: bool, dtype, device, block_size: int | None) -> list[Callable]:
    return [functools.partial(_qk_rope_step, heads, has_norm, dtype, device, block_size, index_dtype)
            for index_dtype in _INDEX_DTYPES]


def _logprob_step(hidden, weight, targets, entropy: bool, training: bool) -> None:
    _, ent, lse, _ = _logprob._forward(hidden, weight, targets, 1.0, entropy, False)
    if training:
        grad = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        _logprob._backward(hidden, weight, targets, 1.0, lse, ent, grad, grad if entropy else None, True, True)


def warm_logprob(lm_head, dtype, device, training: bool, sampling: bool) -> list[Callable]:
    """token_logprobs with and without entropy (and its backward) for int32 and int64
    targets; the sampler's logits + LSE launch."""
    v, h = lm_head
    hidden = torch.zeros(2, h, dtype=dtype, device=device)
    weight = torch.zeros(v, h, dtype=dtype, device=device)
    tasks = [functools.partial(_logprob_step, hidden, weight, torch.zeros(2, dtype=index_dtype, device=device),
                               entropy, training)
             for index_dtype in _INDEX_DTYPES for entropy in (False, True)]
    if sampling:
        tasks.append(functools.partial(_logprob._forward, hidden, weight, None, 1.0, False, True))
    return tasks


# One packing: the attention key does not see the packing (tests/test_compile_keys.py).
_ATTENTION_PACKINGS = ((2, 3),)


def _attention_step(lengths, heads, dtype, device, training: bool) -> None:
    """attention_varlen over packed ``lengths`` (and its backward when ``training``)."""
    hq, hk, d = heads
    t = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    q = torch.zeros(t, hq, d, dtype=dtype, device=device, requires_grad=training)
    k = torch.zeros(t, hk, d, dtype=dtype, device=device, requires_grad=training)
    v = torch.zeros(t, hk, d, dtype=dtype, device=device, requires_grad=training)
    with torch.set_grad_enabled(training):
        out = attention_varlen(q, k, v, cu, max(lengths), d ** -0.5)
        if training:
            out.sum().backward()


def warm_attention(heads, dtype, device, training: bool) -> list[Callable]:
    """Each packing without autograd (rollout prefill: no LSE stored) and, for training,
    with it (the LSE-storing forward and the backward)."""
    return [functools.partial(_attention_step, lengths, heads, dtype, device, grad)
            for lengths in _ATTENTION_PACKINGS for grad in ((False, True) if training else (False,))]


def _paged_steps(heads, dtype, device, block_size: int) -> None:
    """The KV store, paged prefill at an offset, and decode over a block table of one KV
    split and of two (one launch, or the split programs and their combine)."""
    hq, hk, d = heads
    split_blocks = max(1, _attention_config().kv_split // block_size)
    width = 2 * split_blocks
    kc = torch.zeros(width + 1, block_size, hk, d, dtype=dtype, device=device)
    tables = torch.arange(1, width + 1, dtype=torch.int32, device=device)[None]
    q = torch.zeros(3, hq, d, dtype=dtype, device=device)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    starts = torch.tensor([block_size], dtype=torch.int32, device=device)
    with torch.no_grad():
        kv = torch.zeros(3, hk, d, dtype=dtype, device=device)
        store_kv_cache(kv, kv, kc, kc, torch.arange(3, device=device) + block_size, validate=False)
        attention_paged_prefill(q, kc, kc, cu, 3, tables, starts, d ** -0.5, validate=False)
        ctx = torch.ones(1, dtype=torch.int32, device=device)
        for blocks in (split_blocks, width):
            attention_decode(q[:1], kc, kc, tables[:, :blocks].contiguous(), ctx, d ** -0.5, validate=False)


def warm_paged_attention(heads, dtype, device, block_size: int | None) -> list[Callable]:
    """Rollout's paged attention for a KV cache of ``block_size`` (none when it is None)."""
    return [] if block_size is None else [functools.partial(_paged_steps, heads, dtype, device, block_size)]


def _cuda_index(device) -> int | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def _bind_device(index: int | None) -> None:
    if index is not None:
        torch.cuda.set_device(index)


THREADS_ENV = "AREAL_TIK_COMPILE_THREADS"


def default_workers() -> int:
    """Compile threads: 1 under the interpreter (it patches triton.language while a kernel
    runs); else ``$AREAL_TIK_COMPILE_THREADS`` when set (e.g. several training processes
    on one machine), else one per CPU this process may run on, at most 16. Triton's
    compiler (MLIR, LLVM) and ptxas run outside the GIL: on a 2-core machine two threads
    compiled 8 attention kernels for sm_90 in 5.2 s against 9.8 s on one."""
    asked = os.environ.get(THREADS_ENV)
    if asked and (not asked.isdigit() or int(asked) < 1):  # refused on every machine, not only on GPUs
        raise ValueError(f"${THREADS_ENV} must be a positive int, got {asked!r}")
    if interpreting():
        return 1
    if asked:
        return int(asked)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def run_tasks(tasks: list[Callable], device, workers: int | None = None) -> None:
    """Run ``tasks`` (kernel launches) on ``workers`` threads (default ``default_workers()``),
    so that the compilations they trigger overlap; an error in a task is raised here."""
    workers = default_workers() if workers is None else workers
    if workers == 1:
        for task in tasks:
            task()
    else:
        # A worker thread has no current CUDA context until it makes a runtime call; the
        # persistent linear's TMA descriptor is built through the driver before any launch
        # and failed there ("invalid device context", seen on the H200). Bind it first.
        index = _cuda_index(device)
        with concurrent.futures.ThreadPoolExecutor(workers, initializer=_bind_device, initargs=(index,)) as pool:
            for future in [pool.submit(task) for task in tasks]:
                future.result()  # re-raises a task's error here
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def warmup_tasks(shapes: WarmupShapes, max_rows: int, device, *, training: bool = True,
                 sampling: bool = True, attention: bool = True,
                 block_size: int | None = None) -> dict[str, list[Callable]]:
    """The launches of ``warmup``, by op family, not yet run."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    dtype = shapes.dtype
    return {
        "linear": warm_linear(shapes.linears, max_rows, dtype, device, shapes.partials),
        "rms_norm": warm_norms(shapes.norms, dtype, device, training, shapes.head_norms),
        "swiglu": warm_swiglu(shapes.intermediates, dtype, device, training),
        "rope": warm_rope(shapes.heads, dtype, device, training),
        "qk_rope": warm_qk_rope(shapes.heads, bool(shapes.head_norms), dtype, device, block_size),
        "logprob": warm_logprob(shapes.lm_head, dtype, device, training, sampling),
        "attention": warm_attention(shapes.heads, dtype, device, training) if attention else [],
        "paged_attention": warm_paged_attention(shapes.heads, dtype, device, block_size) if attention else [],
    }


def warmup(shapes: WarmupShapes, max_rows: int, device, *, training: bool = True,
           sampling: bool = True, attention: bool = True, block_size: int | None = None,
           workers: int | None = None) -> dict[str, int]:
    """Run every op of ``shapes`` once per launch variant for 1..``max_rows`` rows
    (``max_rows``: the most tokens one forward will see: micro-batch tokens in training,
    the prefill chunk in rollout). ``block_size``: the paged KV cache's block size, to warm
    rollout's paged prefill and decode too. Returns the number of launches per op family.
    The launches run on ``workers`` threads (``run_tasks``).
    """
    tasks = warmup_tasks(shapes, max_rows, device, training=training, sampling=sampling, attention=attention,
                         block_size=block_size)
    run_tasks([task for family in tasks.values() for task in family], device, workers)
    return {name: len(family) for name, family in tasks.items()}

"""No compilation after start-up: Triton launch keys do not follow the row count, and the
warm-up launches every key a later step uses.

Triton (3.6) keys a compiled kernel on its constexprs, its launch options and, per runtime
argument, a type and a specialisation (an int equal to 1 becomes a constant; an int
divisible by 16 or a 16-byte aligned pointer gets a divisibility hint). Here every launch
of the unified ops is intercepted under the interpreter (the launch itself is skipped:
only its arguments matter) and keyed with Triton's own binder, the function the GPU JIT
computes its cache key with. Row and token counts cross 1, multiples of 16 and others.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from areal_tik import unified_kernels as U

W = importlib.import_module("areal_tik.unified_kernels.warmup")
F = importlib.import_module("areal_tik.unified_kernels._attention_fwd")

MODULES = ("linear", "logprob", "rms_norm", "swiglu", "rope", "qk_rope", "_attention_fwd", "_attention_bwd", "attention")
ENGINE_MODULES = ("areal_tik.engine.sampler",)  # rollout-only kernels
ROWS = (1, 2, 15, 16, 17, 32, 33)
_JIT_OPTIONS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline",
                "repr", "launch_metadata")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # launches are intercepted on either


def _kernels():
    for name in MODULES + ENGINE_MODULES:
        module = importlib.import_module(name if "." in name else f"areal_tik.unified_kernels.{name}")
        for value in vars(module).values():
            if isinstance(value, (InterpretedFunction, JITFunction)):
                yield value


def launch_key(kernel, args, kwargs) -> tuple:
    """The cache key the GPU JIT computes for this launch (kernel name included)."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(
        kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k in _JIT_OPTIONS})
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return kernel.fn.__name__, repr(specialization), repr(sorted(options.items()))


@pytest.fixture
def launches(monkeypatch):
    """A list that receives the key of every unified kernel launch; the launches do not run."""
    seen = []
    for kernel in set(_kernels()):
        def run(*args, grid, warmup, _kernel=kernel, **kwargs):
            seen.append(launch_key(_kernel, args, kwargs))
        monkeypatch.setattr(kernel, "run", run)
    return seen


def _z(*shape, dtype=torch.bfloat16, grad=False):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE, requires_grad=grad)


def _step_ops(rows: int, index_dtype=torch.int64) -> None:
    """Forward + backward of every op whose launch keys must not follow ``rows``."""
    x = _z(rows, 32, grad=True)
    normed, summed = U.add_rms_norm(x, _z(rows, 32), _z(32, grad=True), 1e-6)
    head = U.rms_norm(_z(rows * 2, 16, grad=True), _z(16, grad=True), 1e-6)
    act = U.silu_mul(_z(rows, 48, grad=True))
    cos, sin = U.rope_cos_sin(64, 16, device=DEVICE)
    q, k = U.apply_rope(_z(rows, 4, 16, grad=True), _z(rows, 2, 16, grad=True),
                        torch.arange(rows, dtype=index_dtype, device=DEVICE), cos, sin)
    targets = torch.zeros(rows, dtype=index_dtype, device=DEVICE)
    lp, ent = U.token_logprobs(normed, _z(300, 32, grad=True), targets, 0.7, return_entropy=True)
    loss = lp.sum() + ent.sum() + summed.float().sum() + head.float().sum() + act.float().sum()
    (loss + q.float().sum() + k.float().sum()).backward()
    U.token_logprobs(_z(rows, 32), _z(300, 32), targets)
    U.lm_head_logits_lse(_z(rows, 32), _z(300, 32))


@triton.jit
def _probe_kernel(x_ptr, n):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.float32), mask=tl.arange(0, 16) < n)


@triton.jit(do_not_specialize=["n"])
def _probe_pinned_kernel(x_ptr, n):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.float32), mask=tl.arange(0, 16) < n)


def test_negative_control_the_key_sees_an_unpinned_int_and_alignment():
    x = torch.zeros(32, device=DEVICE)
    keys = {n: launch_key(_probe_kernel, (x, n), {}) for n in (1, 2, 16, 17, 32)}
    assert keys[1] != keys[2] and keys[16] != keys[17] and keys[2] == keys[17] and keys[16] == keys[32]
    assert launch_key(_probe_kernel, (x[1:], 2), {}) != keys[2]  # a pointer off 16-byte alignment
    pinned = {launch_key(_probe_pinned_kernel, (x, n), {}) for n in (1, 2, 16, 17, 32)}
    assert len(pinned) == 1


def assert_same_keys(launches, values, step) -> list:
    """The launch keys of ``step(value)`` for each of ``values``: all equal; returns them."""
    per_value = {}
    for value in values:
        launches.clear()
        step(value)
        per_value[value] = sorted(set(launches))
    first = per_value[values[0]]
    for value, keys in per_value.items():
        assert keys == first, f"{value} launches other keys than {values[0]}: {set(keys) ^ set(first)}"
    return first


def test_sampler_keys_do_not_depend_on_batch_size(launches):
    """The engine passes keys and counters as the rows of one [2, B] tensor (the second row
    is 16-byte aligned only for even B); bf16 logits and filtered fp32 scores."""
    from areal_tik.engine import sampler

    def step(rows):  # the kernel launch of CUDA (the launch is intercepted: it does not run)
        keys = torch.zeros(2, rows, dtype=torch.int64, device=DEVICE)
        sampler.gumbel_argmax(_z(rows, 300), keys[0], keys[1], 0.7, use_kernel=True)
        sampler.gumbel_argmax(_z(rows, 300, dtype=torch.float32), keys[0], keys[1], use_kernel=True)

    first = assert_same_keys(launches, ROWS, step)
    assert {key[0] for key in first} == {"_gumbel_argmax_kernel", "_gumbel_combine_kernel"} and len(first) == 3


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_pointwise_and_logprob_keys_do_not_depend_on_row_count(launches, index_dtype):
    first = assert_same_keys(launches, ROWS, lambda rows: _step_ops(rows, index_dtype))
    names = {key[0] for key in first}
    assert {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_silu_mul_fwd_kernel", "_silu_mul_bwd_kernel",
            "_rope_kernel", "_lse_partial_kernel", "_combine_kernel", "_dz_kernel"} <= names


def test_linear_keys_change_only_with_the_tile_schedule(launches):
    L = importlib.import_module("areal_tik.unified_kernels.linear")
    w, b = _z(24, 40), _z(24)
    by_variant: dict = {}
    for rows in range(1, 41):  # crosses the interpreter's buckets (4, 32 rows) and BLOCK_M
        launches.clear()
        U.linear(_z(rows, 40), w, b)
        cfg = L.linear_config(rows, 24, 40, torch.bfloat16)
        by_variant.setdefault((cfg, rows < cfg.block_m), set()).update(launches)
    assert all(len(keys) == 1 for keys in by_variant.values()), by_variant
    assert len({next(iter(keys)) for keys in by_variant.values()}) == len(by_variant)


def test_warmup_launches_every_key_a_later_step_uses(launches):
    shapes = U.WarmupShapes(linears=((24, 40, True), (40, 24, False)), norms=(32, 16), intermediates=(24,),
                            heads=(4, 2, 16), lm_head=(300, 32))
    counts = U.warmup(shapes, max_rows=40, device=DEVICE, workers=1)
    warmed = set(launches)
    assert counts["linear"] == sum(len(W.linear_row_variants(n, k, torch.bfloat16, 40)) for n, k, _ in shapes.linears)
    w1, b1, w2 = _z(24, 40), _z(24), _z(40, 24)
    for rows in (1, 3, 5, 16, 17, 33, 40):
        launches.clear()
        with torch.no_grad():
            U.linear(U.linear(_z(rows, 40), w1, b1), w2)
        for index_dtype in (torch.int64, torch.int32):
            _step_ops(rows, index_dtype)
        assert set(launches) <= warmed, f"{rows} rows compile new keys: {set(launches) - warmed}"


@pytest.mark.parametrize("lengths", [(3,), (16, 16), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)])
def test_warmup_covers_attention_packings(launches, lengths):
    block_size = 2 * F.attention_config().block_n
    tasks = W.warm_attention((4, 2, 16), torch.bfloat16, DEVICE, training=True)
    for task in tasks + W.warm_paged_attention((4, 2, 16), torch.bfloat16, DEVICE, block_size):
        task()
    warmed = set(launches)
    launches.clear()
    _attention_packing(lengths, block_size)  # training, rollout prefill, paged prefill, decode
    assert launches and set(launches) <= warmed, set(launches) - warmed


def test_warmup_covers_the_k_group_tree_and_partials(launches):
    """A row-parallel weight warmed with its k_groups, and a rank's partial (fp32 output),
    cover every later launch; k_groups = 1 warms exactly the keys of a plain entry."""
    plain = U.WarmupShapes(linears=((24, 48, True),), norms=(32,), intermediates=(24,), heads=(4, 2, 16),
                           lm_head=(300, 32))
    U.warmup(plain, max_rows=40, device=DEVICE, workers=1, training=False, attention=False)
    plain_keys = set(launches)
    launches.clear()
    U.warmup(dataclasses.replace(plain, linears=((24, 48, True, 1),)), max_rows=40, device=DEVICE, workers=1,
             training=False, attention=False)
    assert set(launches) == plain_keys
    launches.clear()
    tp = dataclasses.replace(plain, linears=((24, 48, True, 4),), partials=((24, 24, 2),))
    counts = U.warmup(tp, max_rows=40, device=DEVICE, workers=1, training=False, attention=False)
    assert counts["linear"] == 2 * len(W.linear_row_variants(24, 48, torch.bfloat16, 40))
    warmed = set(launches)
    w, b = _z(24, 48), _z(24)
    for rows in (1, 3, 5, 16, 17, 33, 40):
        launches.clear()
        U.linear(_z(rows, 48), w, b, k_groups=4)
        U.linear_partial(_z(rows, 24), w[:, :24].contiguous(), k_groups=2)
        assert launches and set(launches) <= warmed, f"{rows} rows compile new keys: {set(launches) - warmed}"
    with pytest.raises(ValueError, match="power of two .* got 3"):
        dataclasses.replace(plain, linears=((24, 48, True, 3),))
    with pytest.raises(ValueError, match="K = 20 .* k_groups = 8"):
        dataclasses.replace(plain, partials=((24, 20, 8),))


def test_warmup_on_worker_threads_runs_every_task(monkeypatch):
    # The GPU default runs the tasks on a thread pool. The interpreter cannot run kernels
    # on two threads at once, so here each task is replaced by a recorder: every task runs
    # once, and an error in one reaches the caller.
    calls = []
    shapes = U.WarmupShapes(linears=((24, 40, True),), norms=(32,), intermediates=(24,), heads=(4, 2, 16),
                            lm_head=(300, 32))
    for family in ("warm_linear", "warm_norms", "warm_swiglu", "warm_rope", "warm_qk_rope", "warm_logprob",
                   "warm_attention"):
        original = getattr(W, family)
        monkeypatch.setattr(W, family, lambda *a, _o=original, **k: [
            (lambda _t=t: calls.append(_t)) for t in _o(*a, **k)])
    counts = U.warmup(shapes, max_rows=40, device="cpu", workers=2)
    assert len(calls) == sum(counts.values()) and counts["attention"] == 2 * len(W._ATTENTION_PACKINGS)
    with pytest.raises(ValueError, match="boom"):
        monkeypatch.setattr(W, "warm_rope", lambda *a, **k: [lambda: (_ for _ in ()).throw(ValueError("boom"))])
        U.warmup(shapes, max_rows=4, device="cpu", workers=2)


def test_warmup_rejects_bad_shapes():
    with pytest.raises(ValueError, match="positive int"):
        U.WarmupShapes(linears=((0, 4, False),), norms=(4,), intermediates=(4,), heads=(2, 1, 4), lm_head=(8, 4))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        U.WarmupShapes(linears=((4, 4, False),), norms=(4,), intermediates=(4,), heads=(3, 2, 4), lm_head=(8, 4))
    with pytest.raises(TypeError, match="dtype"):
        U.WarmupShapes(linears=((4, 4, False),), norms=(4,), intermediates=(4,), heads=(2, 1, 4), lm_head=(8, 4),
                       dtype=torch.float16)
    shapes = U.WarmupShapes(linears=((4, 4, False),), norms=(4,), intermediates=(4,), heads=(2, 1, 4), lm_head=(8, 4))
    with pytest.raises(ValueError, match="max_rows"):
        U.warmup(shapes, max_rows=0, device="cpu")


def test_rope_key_does_not_depend_on_the_table_length(launches):
    # warm_rope uses a 4-row table; models use their max_position_embeddings.
    keys = set()
    for max_positions in (4, 17, 32, 40960):
        launches.clear()
        cos, sin = U.rope_cos_sin(max_positions, 16, device=DEVICE)
        U.apply_rope(_z(3, 4, 16), _z(3, 2, 16), torch.arange(3, device=DEVICE), cos, sin)
        keys.update(launches)
    assert len(keys) == 1, keys


def test_qk_rope_keys_do_not_depend_on_the_token_count(launches):
    """The fused q/k norm + rope + K/V store at every token count, on views of a fused q|k|v
    output (the engine's layout), with and without the cache write: one key each."""
    cos, sin = U.rope_cos_sin(64, 16, device=DEVICE)
    kc = _z(4, 16, 2, 16)
    w = _z(16)

    def step(rows):
        qkv = _z(rows, 8 * 16)
        q, k, v = qkv[:, :64].view(rows, 4, 16), qkv[:, 64:96].view(rows, 2, 16), qkv[:, 96:].view(rows, 2, 16)
        pos = torch.arange(rows, device=DEVICE)
        U.qk_norm_rope(q, k, pos, cos, sin, w, w, 1e-6)
        U.qk_norm_rope(q, k, pos, cos, sin, w, w, 1e-6, v=v, k_cache=kc, v_cache=kc, slot_mapping=pos, validate=False)

    keys = assert_same_keys(launches, ROWS, step)
    assert [key[0] for key in keys] == ["_qk_norm_rope_kernel"] * 2, keys


@pytest.mark.gpu
def test_gpu_no_jit_compilation_after_warmup():
    """The real JIT: after ``warmup``, forward + backward at other row counts and packings
    compile nothing (Triton's post-compile hook sees every new key, disk-cached or not)."""
    dev, bf16 = "cuda", torch.bfloat16
    shapes = U.WarmupShapes(linears=((2048, 1024, False), (1024, 2048, True)), norms=(1024, 128),
                            intermediates=(3072,), heads=(16, 8, 128), lm_head=(151936, 1024))
    U.warmup(shapes, max_rows=2048, device=dev)
    # Leaves (scaled first): a scaled requires-grad tensor is a graph node that every
    # iteration's backward would walk again (its saved scalar freed after the first).
    w1, w2, b2 = ((torch.randn(*s, device=dev, dtype=bf16) * 0.02).requires_grad_()
                  for s in ((2048, 1024), (1024, 2048), (1024,)))
    wn, wh = torch.ones(1024, device=dev, dtype=bf16), torch.ones(128, device=dev, dtype=bf16)
    lm = torch.randn(151936, 1024, device=dev, dtype=bf16) * 0.02
    cos, sin = U.rope_cos_sin(40960, 128, base=1e6, device=dev)
    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for rows in (1, 7, 64, 65, 300, 1024, 1025, 2048):
            x = torch.randn(rows, 1024, device=dev, dtype=bf16, requires_grad=True)
            h = U.linear(x, w1)
            y = U.linear(h, w2, b2)
            normed, summed = U.add_rms_norm(y, x, wn, 1e-6)
            head = U.rms_norm(h.reshape(-1, 128), wh, 1e-6)
            act = U.silu_mul(torch.randn(rows, 6144, device=dev, dtype=bf16, requires_grad=True))
            q, k = U.apply_rope(h.view(rows, 16, 128), y.view(rows, 8, 128), torch.arange(rows, device=dev), cos, sin)
            with torch.no_grad():  # the fused q/k rope (no norm weights in these shapes, no cache)
                U.qk_norm_rope(h.view(rows, 16, 128), y.view(rows, 8, 128), torch.arange(rows, device=dev), cos, sin)
            lengths = [rows] if rows == 1 else [rows // 2, rows - rows // 2]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            attn = U.attention_varlen(q, k, y.view(rows, 8, 128), cu, max(lengths), 128 ** -0.5)
            lp, ent = U.token_logprobs(normed, lm, torch.zeros(rows, dtype=torch.int64, device=dev), 1.0, True)
            loss = lp.sum() + ent.sum() + summed.float().sum() + head.float().sum() + act.float().sum()
            (loss + attn.float().sum()).backward()
            U.lm_head_logits_lse(normed.detach(), lm)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert not compiled, f"compiled after warm-up: {compiled}"


# Packings crossing 1, multiples of 16 and other values for T, the number of sequences and
# the longest sequence (which sets the grid only).
PACKINGS = ((3,), (1,), (16,), (17,), (5, 7), (16, 16), (1,) * 17, (2,) + (1,) * 15, tuple(range(1, 18)))


def _attention_packing(lengths, block_size: int) -> None:
    """Every attention launch for one packing: training forward + backward, rollout prefill,
    paged prefill at an offset, the KV store, and decode (a block table of >= 2 KV splits,
    its width following the packing)."""
    cfg = F.attention_config()
    t, s = sum(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = _z(t, 4, 16, grad=True), _z(t, 2, 16, grad=True), _z(t, 2, 16, grad=True)
    U.attention_varlen(q, k, v, cu, max(lengths), 0.25).sum().backward()
    width = -(-2 * cfg.kv_split // block_size) + s % 3
    kc, vc = _z(width + 1, block_size, 2, 16), _z(width + 1, block_size, 2, 16)
    tables = torch.ones(s, width, dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        U.attention_varlen(q, k, v, cu, max(lengths), 0.25)
        U.store_kv_cache(k, v, kc, vc, torch.arange(t, device=DEVICE))
        starts = torch.full((s,), 5, dtype=torch.int32, device=DEVICE)
        U.attention_paged_prefill(q, kc, vc, cu, max(lengths), tables, starts, 0.25)
        ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) + 5
        U.attention_decode(_z(s, 4, 16), kc, vc, tables, ctx, 0.25)


def test_attention_keys_do_not_depend_on_the_packing(launches):
    block_size = 2 * F.attention_config().block_n
    first = assert_same_keys(launches, PACKINGS, lambda lengths: _attention_packing(lengths, block_size))
    names = [key[0] for key in first]
    assert set(names) == {"_prefill_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel",
                          "_store_kv_kernel", "_decode_fwd_kernel", "_decode_combine_kernel"}, names
    assert names.count("_prefill_fwd_kernel") == 3, names  # with the LSE, without, paged


def _every_row_variant(n, k, dtype, max_rows, tma, k_groups):
    """``linear_row_variants`` the slow way: every row count from 1 to ``max_rows``."""
    L = importlib.import_module("areal_tik.unified_kernels.linear")
    variants: dict = {}
    for rows in range(1, max_rows + 1):
        cfg = L.linear_config(rows, n, k, dtype, tma=tma, k_groups=k_groups)
        variants.setdefault((cfg, rows < cfg.block_m), rows)
    return sorted(variants.values())


@pytest.mark.parametrize("table", ["interpreter_table", "h200_table"])
def test_row_variants_from_the_row_probes_equal_every_row(table, monkeypatch):
    """The warm-up visits only ``row_probes`` rows (~500 of 16384); it finds exactly the
    variants that visiting every row finds, for the interpreter's table and the GPU's
    (promoted entries, persistent rungs, the K-group tree's tiles), with TMA and without."""
    L = importlib.import_module("areal_tik.unified_kernels.linear")
    T = importlib.import_module("areal_tik.unified_kernels._linear_tiles")
    if table == "h200_table":  # the GPU's tables, read on this machine
        for module in (L, T):
            monkeypatch.setattr(module, "interpreting", lambda: False)
        shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (2048, 8192),
                  (12288, 2048), (24, 4096), (1000, 4096)]
        max_rows = 16384
    else:
        shapes = [(24, 40), (48, 32), (300, 32), (80, 48)]
        max_rows = 300
    probes = T.row_probes(torch.bfloat16, max_rows)
    assert probes[0] == 1 and probes[-1] <= max_rows and (table != "h200_table" or len(probes) < max_rows / 16)
    for n, k in shapes:
        for tma in (True, False):
            for groups in (1, 4) if k % 256 == 0 else (1,):
                want = _every_row_variant(n, k, torch.bfloat16, max_rows, tma, groups)
                assert W.linear_row_variants(n, k, torch.bfloat16, max_rows, tma=tma, k_groups=groups) == want, \
                    (n, k, tma, groups)
    assert len(_every_row_variant(4096, 1024, torch.bfloat16, max_rows, True, 1)) > 2  # variants exist to miss


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_bad_compile_thread_count_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(W.THREADS_ENV, value)
    with pytest.raises(ValueError, match=f"AREAL_TIK_COMPILE_THREADS must be a positive int, got '{value}'"):
        W.default_workers()
    monkeypatch.setenv(W.THREADS_ENV, "3")
    assert W.default_workers() == 1  # the interpreter runs one kernel at a time whatever is asked

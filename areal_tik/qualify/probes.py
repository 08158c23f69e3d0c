"""The contract probes: linear over row counts and configs, attention prefill vs paged
decode and CUDA-graph replay, a tiny model's rollout vs its packed training forward."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import random
import time

import torch

from .verdict import Check, DeviceKey, Verdict

logger = logging.getLogger(__name__)
linear_kernels = importlib.import_module("areal_tik.unified_kernels.linear")
_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
    """Shapes of the probe. ``for_device`` gives tiny interpreter shapes on CPU."""

    linear_shapes: tuple[tuple[int, int], ...]  # (N, K) weight shapes
    max_rows: int                               # largest batch of the linear probe
    attention_lengths: tuple[int, ...]          # sequences of the attention probe
    heads: tuple[int, int, int]                 # (Hq, Hk, D)
    kv_block_size: int
    model: dict                                 # tiny_config overrides of the model probe
    prompt_lengths: tuple[int, ...]
    new_tokens: int
    temperatures: tuple[float, ...]             # one LM-head group per temperature
    decode_every_row: bool                      # else rows at KV-tile edges only (interpreter)

    @classmethod
    def for_device(cls, device: torch.device) -> "ProbeSizes":
        if device.type == "cuda":
            # N=256 takes the narrow streaming rungs, 2048 the wide ones, 32768 (an LM head)
            # the persistent kernel from 1024 rows; attention crosses the 1024 KV split.
            return cls(((256, 1024), (2048, 1024), (32768, 1024)), 4096, (300, 1100), (8, 2, 128), 64,
                       dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=4096), (5, 70, 130), 24, (1.0, 0.7), True)
        # Interpreter: ~1 s per interpreted model step on a 2-core machine; the decode rows
        # at tile edges (16) and across the KV split (32) stand for all.
        return cls(((48, 32), (80, 48)), 40, (20, 45), (2, 1, 16), 16,
                   dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        num_hidden_layers=1, vocab_size=128), (3, 9), 2, (1.0,), False)


# ----------------------------------------------------------------------------- probes


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _row_counts(max_rows: int) -> list[int]:
    edges = [b for b, _ in linear_kernels.buckets(_DTYPE) if b is not None]
    counts = {1, max_rows} | {r for b in edges for r in (b, b + 1) if r <= max_rows}
    return sorted(counts)


def _row_mismatches(ops, x, w, rows) -> list[str]:
    base = ops.linear(x, w)
    (m_max, k), n = x.shape, w.shape[0]
    return [f"rows {m} vs {m_max} (N={n}, K={k}, {m} rows take {linear_kernels.linear_config(m, n, k, _DTYPE)})"
            for m in rows if not _bits_equal(ops.linear(x[:m], w), base[:m])]


def probe_linear(ops, device, sizes: ProbeSizes) -> list[Check]:
    """Row counts through ``ops.linear``; every table/fixed config through the kernel; when
    the row counts disagree, the row counts again with linear pinned to its fixed tile."""
    rows, bad_rows, bad_cfgs, bad_pinned = _row_counts(sizes.max_rows), [], [], []
    configs = linear_kernels.linear_candidates(_DTYPE, candidates=False)
    gen = torch.Generator(device="cpu").manual_seed(0)
    problems = []
    for n, k in sizes.linear_shapes:
        x = torch.randn(sizes.max_rows, k, generator=gen).to(device, _DTYPE)
        problems.append((x, (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, _DTYPE)))
    for x, w in problems:
        bad_rows += _row_mismatches(ops, x, w, rows)
        reference = linear_kernels.linear_forward(x, w, None)
        bad_cfgs += [f"{cfg} (N={w.shape[0]}, K={w.shape[1]})" for cfg in configs
                     if not _bits_equal(linear_kernels.linear_forward(x, w, None, config=cfg), reference)]
    shapes = len(problems)
    checks = [Check("linear", not bad_rows, "; ".join(bad_rows) or f"{len(rows)} row counts x {shapes} shapes"),
              Check("linear variants", not bad_cfgs, "; ".join(bad_cfgs) or f"{len(configs)} configs x {shapes} shapes")]
    if bad_rows:
        with pin_linear_tile():
            for x, w in problems:
                bad_pinned += _row_mismatches(ops, x, w, rows)
        checks.append(Check("linear (pinned tile)", not bad_pinned,
                            "; ".join(bad_pinned) or "pinning linear to its fixed tile makes every row count agree"))
    return checks


def _paged_setup(lengths, hk, d, block, device, gen):
    """A NaN-filled cache and, per sequence, a shuffled block table (block 0 unused)."""
    need = [-(-n // block) for n in lengths]
    ids = list(range(1, sum(need) + 1))
    random.Random(0).shuffle(ids)
    tables, start = [], 0
    for m in need:
        tables.append(ids[start:start + m])
        start += m
    shape = (sum(need) + 1, block, hk, d)
    kc = torch.full(shape, float("nan"), dtype=_DTYPE, device=device)
    return kc, kc.clone(), tables


def probe_attention(ops, device, sizes: ProbeSizes) -> list[Check]:
    hq, hk, d = sizes.heads
    lengths, block = sizes.attention_lengths, sizes.kv_block_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(device, _DTYPE) for h in (hq, hk, hk))
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    prefill = ops.attention_varlen(q, k, v, cu, max(lengths))
    kc, vc, tables = _paged_setup(lengths, hk, d, block, device, gen)
    width = max(len(t) for t in tables)
    slots, rows, table_rows, ctx = [], [], [], []
    for start, n, table in zip(cu_list, lengths, tables):
        slots += [table[p // block] * block + p % block for p in range(n)]
        edges = {p for e in range(0, n + 1, 16) for p in (e - 1, e) if 0 <= p < n} | {n - 1}
        for p in range(n) if sizes.decode_every_row else sorted(edges):
            rows.append(start + p)
            table_rows.append(table + [0] * (width - len(table)))
            ctx.append(p + 1)
    ops.store_kv_cache(k, v, kc, vc, torch.tensor(slots, dtype=torch.int64, device=device))
    bt = torch.tensor(table_rows, dtype=torch.int32, device=device)
    cl = torch.tensor(ctx, dtype=torch.int32, device=device)
    q_rows = q[torch.tensor(rows, device=device)]
    decode = ops.attention_decode(q_rows, kc, vc, bt, cl)
    bad = [r for i, r in enumerate(rows) if not _bits_equal(decode[i], prefill[r])]
    checks = [Check("attention prefill vs decode", not bad,
                    f"{len(bad)}/{len(rows)} rows differ, first {bad[:3]}" if bad
                    else f"{len(rows)} decode rows of lengths {lengths}")]
    checks.append(_probe_graph_replay(ops, device, q_rows, kc, vc, bt, cl, decode))
    return checks


def _probe_graph_replay(ops, device, q, kc, vc, bt, cl, eager) -> Check:
    if device.type != "cuda":
        return Check("attention CUDA graph", None, "no CUDA graphs on this device")
    rows = torch.arange(0, q.shape[0], max(1, q.shape[0] // 16), device=device)
    static = [t[rows].contiguous() for t in (q, bt, cl)]
    ops.attention_decode(*static[:1], kc, vc, *static[1:], validate=False)  # compile outside capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.attention_decode(static[0], kc, vc, static[1], static[2], validate=False)
    graph.replay()
    torch.cuda.synchronize(device)
    ok = _bits_equal(out, eager[rows])
    return Check("attention CUDA graph", ok, f"{rows.numel()} rows replayed" if ok else "replay differs from eager")


def probe_model(ops, device, sizes: ProbeSizes) -> list[Check]:
    """A tiny random model: engine rollout (graphs on a GPU) vs the packed training forward."""
    from areal_tik.engine import LLM, SamplingParams
    from areal_tik import consistency

    model = _probe_model(ops, device, sizes)
    rng = random.Random(2)
    vocab = sizes.model["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in sizes.prompt_lengths]
    temps = sizes.temperatures
    params = [SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=sizes.new_tokens, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    with LLM(model, _engine_config(device, sizes)) as llm:
        outputs = llm.generate(prompts, params)
    reference = consistency.packed_logprobs(model, outputs, grad=True)
    result = consistency.compare(outputs, reference)
    if result.first_mismatch is None:
        return [Check("model rollout vs training", True, f"{result.num_tokens} tokens bit-identical")]
    div = None
    for request, token in _mismatches_to_diagnose(outputs, reference)[:4]:
        div = consistency.first_divergence(model, outputs, request, token, block_size=sizes.kv_block_size)
        if div.where is not None:
            break
    where = div.where or "no op row differs at batch 1 (a batch-composition effect)"
    return [Check("model rollout vs training", False,
                  f"{result.num_identical}/{result.num_tokens} tokens bit-identical; first divergence "
                  f"(request {div.request}, token {div.token}, {div.regime}): {where}")]


def _probe_model(ops, device, sizes: ProbeSizes):
    from areal_tik.model import UnifiedCausalLM, random_model, tiny_config

    return UnifiedCausalLM.from_hf(random_model(tiny_config("qwen3", **sizes.model), device=device, seed=0),
                                   kernels=ops)


def _engine_config(device, sizes: ProbeSizes):
    from areal_tik.engine import EngineConfig

    max_len = max(sizes.prompt_lengths) + sizes.new_tokens + 1
    return EngineConfig(max_num_seqs=len(sizes.prompt_lengths), max_model_len=max_len,
                        kv_block_size=sizes.kv_block_size, cuda_graphs=device.type == "cuda")


def _mismatches_to_diagnose(outputs, reference) -> list[tuple[int, int]]:
    """Per request, its first mismatching decode token, else its first mismatch. The
    diagnosis replays one request at batch 1, where an effect of the batch's row count
    may not show, so several requests are tried."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        rec = torch.tensor(out.logprobs, dtype=torch.float32)
        differs = (rec.view(torch.int32) != ref.float().cpu().view(torch.int32)).nonzero().flatten().tolist()
        decode = [t for t in differs if t > 0]
        if differs:
            found.append((i, (decode or differs)[0]))
    return found


PROBES = {"linear": probe_linear, "attention": probe_attention, "model": probe_model}


# ----------------------------------------------------------------------------- compilation


def compile_tasks(ops, device, sizes: ProbeSizes, probes: tuple[str, ...]) -> list:
    """The kernel launches of ``probes`` on zero inputs of the probes' shapes, dtypes and
    alignment (the parts of a launch that Triton's key sees), for ``run_tasks``: compiled
    on threads before the probes run, so the probes' own launches, one after another,
    find every kernel compiled. Only the unified set on a GPU compiles anything."""
    warm = importlib.import_module("areal_tik.unified_kernels.warmup")
    from areal_tik.engine import sampler
    from areal_tik.engine.model_runner import warmup_shapes

    tasks = []
    if "linear" in probes:
        # Every row-count variant once (the probe's row counts fall among them: compiling
        # each of those would start several threads on one key), then every config.
        tasks += warm.warm_linear([(n, k, False) for n, k in sizes.linear_shapes], sizes.max_rows, _DTYPE, device)
        configs = linear_kernels.linear_candidates(_DTYPE, candidates=False)
        for n, k in sizes.linear_shapes:
            x = torch.zeros(sizes.max_rows, k, dtype=_DTYPE, device=device)
            w = torch.zeros(n, k, dtype=_DTYPE, device=device)
            tasks += [functools.partial(linear_kernels.linear_forward, x, w, None, config=cfg) for cfg in configs]
    if "attention" in probes:
        tasks += warm.warm_attention(sizes.heads, _DTYPE, device, training=False)
        tasks += warm.warm_paged_attention(sizes.heads, _DTYPE, device, sizes.kv_block_size)
    if "model" in probes:
        model = _probe_model(ops, device, sizes)
        config = _engine_config(device, sizes)
        rows = max(config.batched_tokens_limit, config.max_num_seqs)  # as the engine warms itself
        families = warm.warmup_tasks(warmup_shapes(model, rollout=True), rows, device, training=True,
                                     sampling=True, block_size=sizes.kv_block_size)
        tasks += [task for family in families.values() for task in family]
        tasks += sampler.warmup_tasks(model.config.vocab, model.dtype, device)  # as the engine warms itself
    return tasks


def precompile(ops, device, sizes: ProbeSizes, probes: tuple[str, ...], workers: int | None = None) -> float:
    """Compile the probes' kernels on ``workers`` threads; returns the seconds spent (0
    where nothing compiles: the interpreter, or a kernel set of torch ops)."""
    if device.type != "cuda" or ops.kind != "unified":
        return 0.0
    warm = importlib.import_module("areal_tik.unified_kernels.warmup")
    start = time.perf_counter()
    warm.run_tasks(compile_tasks(ops, device, sizes, probes), device, workers)
    return time.perf_counter() - start


def run_probe(device=None, sizes: ProbeSizes | None = None, ops=None,
              probes: tuple[str, ...] = tuple(PROBES), precompile_workers: int | None = None) -> Verdict:
    """Run ``probes`` now (no cache); ``ops`` defaults to the unified kernels. Their kernels
    are compiled first on ``precompile_workers`` threads (``precompile``; 1: each compiles
    at its first launch inside the probes, as before: the cold probe took 26.8 s so on the
    H200 in a recipe run). A failed compilation is left to the probe that launches it, so
    it is reported under that probe's name."""
    from areal_tik.model.ops import get_ops

    device = as_device(device)
    unknown = [p for p in probes if p not in PROBES]
    if unknown or not probes:
        raise ValueError(f"probes must be a non-empty subset of {tuple(PROBES)}, got {probes!r}")
    sizes = sizes or ProbeSizes.for_device(device)
    ops = get_ops("unified" if ops is None else ops)
    start = time.perf_counter()
    compile_seconds = 0.0
    if precompile_workers != 1:
        try:
            compile_seconds = precompile(ops, device, sizes, probes, precompile_workers)
        except Exception:  # noqa: BLE001 - the probes below launch the same kernels and name the failure
            logger.warning("qualification: compiling the probes' kernels ahead failed; the probes compile "
                           "them one by one", exc_info=True)
    checks: list[Check] = []
    for name in probes:
        try:
            with torch.no_grad() if name != "model" else contextlib.nullcontext():
                checks += PROBES[name](ops, device, sizes)
        except Exception as exc:  # a crash on this device is a failure of that probe, by name
            checks.append(Check(name, False, f"raised {type(exc).__name__}: {exc}"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Verdict(DeviceKey.of(device), checks, time.perf_counter() - start, compile_seconds=compile_seconds)


def as_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or cpu, got {device}")
    return device


# ----------------------------------------------------------------------------- pinning


class LinearPin:
    """Handle of ``pin_linear_tile``: ``revert()`` restores the previous setting."""

    def __init__(self):
        self._saved = linear_kernels.FIXED_TILE
        linear_kernels.FIXED_TILE = True
        self.active = True

    def revert(self) -> None:
        if self.active:
            linear_kernels.FIXED_TILE = self._saved
            self.active = False

    def __enter__(self) -> "LinearPin":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def pin_linear_tile() -> LinearPin:
    """Make linear use its one fixed tile for every shape (``linear_config`` honours the
    module's ``FIXED_TILE``); nest-safe, reverted by the handle."""
    return LinearPin()

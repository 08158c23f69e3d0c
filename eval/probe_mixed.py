"""Probe: where the time of a chunked-prefill step goes (a 2048-token chunk of a 16K prompt
plus the decode rows), kernel by kernel and host against GPU. GPU only, about 60-90 s.

Usage (GPU, repo root):
    python3 -m eval.probe_mixed [--skip-engine]

1. Kernels, Qwen3-0.6B attention (16 query / 8 KV heads, D = 128, bf16, KV blocks of 64
   in shuffled, NaN-poisoned cache blocks): the paged prefill of a 2048-row chunk starting
   at 0, 2K, 8K and 14K of a 16K context, beside the contiguous prefill of the whole 16K
   sequence and of 2K alone, and torch SDPA on the same chunk with a lower-right causal
   mask (each backend that takes it). Kernel times from CUDA-graph replays (L2 flushed,
   no host launch cost; ``eval.bench_attention.graph_us``), after a first call that
   compiles (its seconds printed apart). TFLOP/s count the causal work exactly: a row at
   position p attends p + 1 keys, 4 * D flops each per head (q k^T and p v). Bits: every
   chunk row == the same row of the contiguous 16K prefill, and the paged variant with
   one sub-tile per program (same numerics, other geometry) == the default.
2. The model: one chunk through ``UnifiedCausalLM.prefill`` (all 28 layers, paged path)
   at each start, and the whole 16K prompt in one prefill: host enqueue time, synced wall
   time, and the same call replayed from a CUDA graph (pure GPU time). Wall >> graph
   with enqueue ~ wall means the eager step is bound by the host's launches. Enqueue is
   given with ``_common.HOST_FAST_PATH`` off and on (the host path before and after the launch
   plans), and a cProfile top-25 (tottime) of one eager chunk at 8K names the host's cost.
3. The engine in the ``eval.bench_prefix`` latency setting (32 sequences decoding when a
   16K prompt arrives, chunks of 2048): the wall time of every mixed step by chunk
   start, then one mixed step (the chunk at 8K) under torch.profiler: host wall vs the
   GPU's kernel time and busy span, the top CUDA kernels by total time, and the host
   ranges of the step's parts (input preparation, prefill, decode, sampling).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
from triton.testing import do_bench

from eval.bench_attention import graph_us
from eval.probe_host import profile_top
from eval.probe_attention import _paged, _randn

from areal_tik.unified_kernels import _attention_fwd as F
from areal_tik.unified_kernels.attention import attention_paged_prefill, attention_varlen

HQ, HK, DIM, BLOCK = 16, 8, 128, 64  # Qwen3-0.6B attention, the engine's KV block
CONTEXT, CHUNK = 16384, 2048
STARTS = (0, 2048, 8192, 14336)
DEV = "cuda"


def causal_flops(start: int, rows: int, heads: int = HQ, dim: int = DIM) -> float:
    """Exact flops of rows at positions start .. start + rows - 1, each over p + 1 keys."""
    keys = rows * start + rows * (rows + 1) // 2
    return 4.0 * dim * heads * keys


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _row(name: str, ms: float, flops: float, first_s: float | None = None, extra: str = "") -> None:
    first = f"  first call {first_s:6.2f} s" if first_s is not None else ""
    print(f"  {name:44s} {ms:8.3f} ms  {flops / ms * 1e-9:7.1f} TFLOP/s{first}{extra}", flush=True)


def kernel_ms(fn, reps: int = 5) -> tuple[float, str]:
    """(ms, how): from CUDA-graph replays, or do_bench (eager, L2 cleared) where a call
    cannot be captured."""
    try:
        return graph_us(fn, reps=reps, trials=5) / 1e3, ""
    except RuntimeError:
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=50), " (eager do_bench)"


def _bits(a: torch.Tensor, b: torch.Tensor) -> str:
    return "YES" if torch.equal(a.view(torch.int16), b.view(torch.int16)) else "NO"


# ----------------------------------------------------------------------------- 1. kernels


def _sdpa_calls(q, k, v, start: int):
    """{label: fn} of SDPA on rows [start, start + CHUNK) over keys [0, start + CHUNK),
    lower-right causal, K/V heads repeated (flash takes no GQA), [1, H, L, D] views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    end = start + CHUNK
    group = HQ // HK
    qs = q[start:end].transpose(0, 1)[None]
    ks = k[:end].repeat_interleave(group, 1).transpose(0, 1)[None]
    vs = v[:end].repeat_interleave(group, 1).transpose(0, 1)[None]
    bias = causal_lower_right(CHUNK, end)
    dense = torch.ones(CHUNK, end, dtype=torch.bool, device=DEV).tril(end - CHUNK)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call(backend, mask):
        def fn():
            with sdpa_kernel([backend]):
                return sdpa(qs, ks, vs, attn_mask=mask)
        return fn
    return {"sdpa flash (causal_lower_right)": call(SDPBackend.FLASH_ATTENTION, bias),
            "sdpa efficient (causal_lower_right)": call(SDPBackend.EFFICIENT_ATTENTION, bias),
            "sdpa cudnn (dense lower-right mask)": call(SDPBackend.CUDNN_ATTENTION, dense)}


def _probe_sdpa(q, k, v, start: int, ours: torch.Tensor) -> None:
    for label, fn in _sdpa_calls(q, k, v, start).items():
        try:
            first = first_call_s(fn)
            ref = fn()[0].transpose(0, 1).float()
            err = ((ours.float() - ref).norm() / ref.norm()).item()
            ms, how = kernel_ms(fn, reps=3)
        except RuntimeError as exc:  # a backend that refuses the mask or the shape: say so
            torch.cuda.synchronize()
            print(f"  {label:44s} not run: {str(exc).splitlines()[0][:90]}", flush=True)
            continue
        _row(f"{label} @{start // 1024}K", ms, causal_flops(start, CHUNK), first,
             f"  rel err vs ours {err:.1e}{how}")


def probe_kernels() -> None:
    print(f"1. attention kernels: Hq {HQ}, Hk {HK}, D {DIM}, KV block {BLOCK}, config {F.GPU_CONFIG}", flush=True)
    q, k, v = _randn(CONTEXT, HQ, DIM, seed=1), _randn(CONTEXT, HK, DIM, seed=2), _randn(CONTEXT, HK, DIM, seed=3)
    kc, vc, table = _paged([k], [v], block_size=BLOCK)
    # Index tensors are built outside the timed calls: a CUDA-graph capture takes no host copies.
    cu_full, cu = _i32([0, CONTEXT]), _i32([0, CHUNK])
    full_call = lambda: attention_varlen(q, k, v, cu_full, CONTEXT, validate=False)  # noqa: E731
    first = first_call_s(full_call)
    full = full_call()
    _row("contiguous prefill, 16K sequence", kernel_ms(full_call, reps=3)[0], causal_flops(0, CONTEXT), first)
    short = lambda: attention_varlen(q[:CHUNK], k[:CHUNK], v[:CHUNK], cu, CHUNK, validate=False)  # noqa: E731
    _row("contiguous prefill, 2K sequence", kernel_ms(short, reps=10)[0], causal_flops(0, CHUNK))
    one_sub = dataclasses.replace(F.GPU_CONFIG, prefill_subtiles=1, prefill_pack_heads=1)
    for label, cfg in (("paged chunk (default)", None), ("paged chunk, prefill_subtiles=1", one_sub)):
        for i, start in enumerate(STARTS):
            qs, starts = q[start:start + CHUNK], _i32([start])

            def fn(qs=qs, starts=starts, cfg=cfg):
                return attention_paged_prefill(qs, kc, vc, cu, CHUNK, table, starts, validate=False, config=cfg)
            first = first_call_s(fn) if i == 0 else None
            same = _bits(fn(), full[start:start + CHUNK])
            _row(f"{label} @{start // 1024}K", kernel_ms(fn)[0], causal_flops(start, CHUNK), first,
                 f"  rows == contiguous 16K: {same}")
    for start in (STARTS[2], STARTS[3]):
        _probe_sdpa(q, k, v, start, full[start:start + CHUNK])


# ----------------------------------------------------------------------------- 2. model


def _eager_times(fn, reps: int = 5) -> tuple[float, float]:
    """Medians (host enqueue ms, synced wall ms) of ``fn()``, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    enqueue, wall = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        enqueue.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t)
    return statistics.median(enqueue) * 1e3, statistics.median(wall) * 1e3


def _graph_ms(fn) -> str:
    try:
        return f"{graph_us(fn, reps=2, trials=3) / 1e3:8.2f}"
    except RuntimeError as exc:  # capture refused: the eager numbers still stand
        torch.cuda.synchronize()
        return f"n/a ({str(exc).splitlines()[0][:60]})"


def probe_model(model) -> None:
    print("2. UnifiedCausalLM.prefill, all layers: host enqueue / synced wall (eager) / CUDA-graph replay, ms",
          flush=True)
    vocab = model.spec.vocab
    cache = model.new_kv_cache(CONTEXT // BLOCK + 1, BLOCK)
    table = torch.arange(1, CONTEXT // BLOCK + 1, dtype=torch.int32, device=DEV)[None]  # block 0: scratch
    ids = torch.randint(8, vocab, (CONTEXT,), device=DEV)
    pos = torch.arange(CONTEXT, device=DEV)
    slots = table[0].long()[pos // BLOCK] * BLOCK + pos % BLOCK
    # Index tensors are built outside the timed calls: a CUDA-graph capture takes no host copies.
    cu_full, cu, last_full, last = (_i32([0, CONTEXT]), _i32([0, CHUNK]), torch.tensor([CONTEXT - 1], device=DEV),
                                    torch.tensor([CHUNK - 1], device=DEV))
    cases = {"whole 16K prompt, one step": lambda: model.prefill(ids, pos, cu_full, CONTEXT, cache, slots, last_full)}
    for start in STARTS:
        s, e, qs = start, start + CHUNK, _i32([start])
        cases[f"chunk of 2048 @{start // 1024}K"] = (
            lambda s=s, e=e, qs=qs: model.prefill(ids[s:e], pos[s:e], cu, CHUNK, cache, slots[s:e], last,
                                                  block_tables=table, query_starts=qs))
    from areal_tik.unified_kernels import _common

    print("  (enqueue off: _common.HOST_FAST_PATH = False, the host path before the launch plans and fast checks)",
          flush=True)
    with torch.inference_mode():
        saved = _common.HOST_FAST_PATH
        for label, fn in cases.items():
            try:
                _common.HOST_FAST_PATH = False
                before = _eager_times(fn)[0]
                _common.HOST_FAST_PATH = True
                enqueue, wall = _eager_times(fn)
            finally:
                _common.HOST_FAST_PATH = saved
            print(f"  {label:30s} enqueue off {before:8.2f} on {enqueue:8.2f}  wall {wall:8.2f}  graph {_graph_ms(fn)}",
                  flush=True)
        chunk = cases[f"chunk of 2048 @{STARTS[2] // 1024}K"]
        profile_call(chunk, f"eager chunk @{STARTS[2] // 1024}K (main thread)")
        print(f"  cProfile of one eager chunk @{STARTS[2] // 1024}K, top 25 by tottime (what the host spends on):",
              flush=True)
        torch.cuda.synchronize()
        print(profile_top(chunk, top=25), flush=True)
        torch.cuda.synchronize()


def profile_call(fn, what: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    report_profile(prof, wall, what)


# ----------------------------------------------------------------------------- 3. engine


class MixedSteps:
    """Wraps ``runner.launch`` in place (the engine's own step path; the step loop reads each
    step with ``runner.collect`` after it): the wall time of each mixed step by the long
    prompt's chunk start and of each decode-only step, from its launch to the GPU's end of it
    (the wrapper waits for the device); one mixed step (chunk at ``profile_start``) and one
    decode-only step (the ``DECODE_PROFILED``-th) run under torch.profiler, kept in
    ``profiles`` as label -> (profile, wall s). Time serial steps (``overlap_steps=False``):
    the wait would serialise overlapped ones."""

    DECODE_PROFILED = 4

    def __init__(self, runner, long_len: int, profile_start: int):
        self.runner, self.long_len, self.profile_start = runner, long_len, profile_start
        self.walls: list[tuple[int, float]] = []
        self.decode_walls: list[float] = []
        self.profiles: dict[str, tuple] = {}
        self._launch = runner.launch
        runner.launch = self.launch

    def _chunk_start(self, seqs) -> int | None:
        from areal_tik.engine.sequence import split_step, step_kind

        prefill, decode = split_step(seqs)
        if step_kind(prefill, decode) == "decode":
            return -1
        long = [s for s in prefill if s.num_tokens >= self.long_len]
        return long[0].num_computed_tokens if long and decode else None

    def _run(self, seqs, *args, **kwargs):
        step = self._launch(seqs, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return step

    def launch(self, seqs, *args, **kwargs):
        start = self._chunk_start(seqs)
        if start == self.profile_start and "mixed" not in self.profiles:
            label = f"mixed step, chunk @{start} + {len(seqs) - 1} decode rows (engine thread)"
            return self._profiled("mixed", label, seqs, *args, **kwargs)
        if start == -1 and len(self.decode_walls) == self.DECODE_PROFILED and "decode" not in self.profiles:
            return self._profiled("decode", f"decode-only step, {len(seqs)} rows (engine thread)", seqs,
                                  *args, **kwargs)
        t = time.perf_counter()
        out = self._run(seqs, *args, **kwargs)
        wall = time.perf_counter() - t
        if start == -1:
            self.decode_walls.append(wall)
        elif start is not None:
            self.walls.append((start, wall))
        return out

    def _profiled(self, key: str, label: str, seqs, *args, **kwargs):
        from torch.profiler import ProfilerActivity, profile

        runner = self.runner
        labelled = [(name, getattr(runner, name)) for name in ("prepare_prefill", "_prefill", "_decode", "sample")]
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        try:
            prof.start()
        except Exception as exc:  # noqa: BLE001  (the step must run whatever the profiler does)
            self.profiles[key] = (f"{label}: profiler did not start ({exc})", None, 0.0)
            return self._run(seqs, *args, **kwargs)
        for name, fn in labelled:  # instance attributes shadow the methods while profiling
            setattr(runner, name, _in_range(f"step::{name}", fn))
        try:
            t = time.perf_counter()
            out = self._run(seqs, *args, **kwargs)  # ends in a device synchronise: the step is done
            wall = time.perf_counter() - t
        finally:
            for name, _ in labelled:
                delattr(runner, name)
            try:
                prof.stop()
            except Exception as exc:  # noqa: BLE001
                label, prof = f"{label}: profiler did not stop ({exc})", None
        self.profiles[key] = (label, prof, wall)
        return out


def _in_range(label: str, fn):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapped


def report_profile(prof, wall_s: float, what: str, top: int = 15) -> None:
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3 if kernels else 0
    print(f"  profiled {what}: host wall {wall_s * 1e3:.2f} ms; GPU kernels {len(kernels)}, busy {busy:.2f} ms, "
          f"first kernel start to last kernel end {span:.2f} ms (busy / wall {busy / (wall_s * 1e3):.2f})",
          flush=True)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    print(f"  top CUDA kernels by total time (of {busy:.2f} ms busy):")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        total = sum(times)
        print(f"    {total:8.3f} ms {100 * total / busy:5.1f}%  x{len(times):4d}  mean {total / len(times) * 1e3:8.1f} us"
              f"  {name[:110]}")
    ranges = [e for e in prof.key_averages() if e.key.startswith("step::")]
    if ranges:
        print("  host ranges (CPU ms, calls): " + ", ".join(
            f"{e.key[6:]} {e.cpu_time_total / 1e3:.2f} ({e.count})" for e in ranges), flush=True)


def probe_engine(model, decoders: int = 32, short: int = 512, answer: int = 64, context: int = CONTEXT,
                 chunk: int = CHUNK, block: int = BLOCK) -> None:
    """Part 3 of the module docstring (the sizes are arguments for a CPU smoke run)."""
    from eval.bench_prefix import engine_config
    from areal_tik.engine import LLM, SamplingParams

    print(f"3. engine: {decoders} sequences decoding ({short}-token prompts) when a {context}-token prompt "
          f"arrives, chunks of {chunk} (the bench_prefix latency setting)", flush=True)
    rng = random.Random(3)
    vocab = model.spec.vocab
    max_len = context + block
    blocks = decoders * -(-(short + answer) // block) + -(-max_len // block) + 2
    config = engine_config(dict(block=block), max_len, decoders + 1, num_kv_blocks=blocks,
                           prefill_chunk_tokens=chunk)
    t = time.perf_counter()
    with LLM(model, config) as llm:
        print(f"  engine start (compiles at start) {time.perf_counter() - t:.1f} s", flush=True)
        long_prompt = [rng.randrange(8, vocab) for _ in range(context)]
        t = time.perf_counter()
        llm.generate([long_prompt[:-1]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        print(f"  warm-up: the long prompt once, chunked {time.perf_counter() - t:.1f} s", flush=True)
        steps = MixedSteps(llm.runner, context, profile_start=context // 2)
        params = SamplingParams(temperature=1.0, max_new_tokens=answer, ignore_eos=True)
        llm.pause()  # the decoders are admitted together
        futures = [llm.submit([rng.randrange(8, vocab) for _ in range(short)], params) for _ in range(decoders)]
        target = llm.step_counts.decode + 8
        llm.resume()
        deadline = time.monotonic() + 60
        while llm.step_counts.decode < target and time.monotonic() < deadline:
            time.sleep(0.0005)
        llm.submit(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        for f in futures:
            f.result()
    walls = ", ".join(f"@{s} {w * 1e3:.1f}" for s, w in steps.walls)
    before = statistics.median(steps.decode_walls) * 1e3 if steps.decode_walls else float("nan")
    print(f"  mixed step wall by chunk start (ms, unprofiled): {walls}; median decode-only step {before:.2f} ms",
          flush=True)
    for key in ("decode", "mixed"):
        if key not in steps.profiles:
            print(f"  no {key} step to profile was seen (mixed: the chunk at {context // 2})", flush=True)
            continue
        label, prof, wall = steps.profiles[key]
        if prof is None:
            print(f"  {label}", flush=True)
            continue
        report_profile(prof, wall, label, top=15 if key == "mixed" else 8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-engine", action="store_true", help="kernels only (no model, no engine)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_mixed needs a CUDA GPU")
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    # The profiler's first use registers it with kineto: here, on the main thread (the
    # engine's step thread starts it later; started first there, kineto logged "External
    # init callback must run in same thread as registerClient" in a CPU trial).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        torch.ones(1, device=DEV).add_(1)
        torch.cuda.synchronize()
    probe_kernels()
    print(f"  (kernels done at {time.time() - t0:.0f} s)", flush=True)
    if not args.skip_engine:
        from areal_tik.cli import RANDOM_INIT
        from areal_tik.model import UnifiedCausalLM, published_config, random_model

        kind, key = RANDOM_INIT["qwen3-0.6b"]
        model = UnifiedCausalLM.from_hf(random_model(published_config(key), device=DEV, seed=0), kernels="unified")
        model.fuse_projections()  # the layout the engine gives its model: rollout's fused q|k|v, gate|up
        probe_model(model)
        print(f"  (model done at {time.time() - t0:.0f} s)", flush=True)
        probe_engine(model)  # last: it runs the profiler on the engine's step thread
    print(f"probe done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

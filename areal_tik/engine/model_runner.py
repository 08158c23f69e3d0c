"""Runs the model for one scheduled step: input preparation, prefill / decode, sampling.

Decode on a GPU replays CUDA graphs captured per batch-size bucket and block-table width
(``decode_graphs``); prefill and CPU decode run eagerly. With a graph temperature
(``EngineConfig.graph_sample_temperature``) a graph also draws the tokens and takes their
log-probs, and serves the whole step when every row samples at that temperature
(``graph_samples``); otherwise the step samples eagerly from the graph's hidden states.

Per decode step the host fills one persistent buffer in place and sends it with one copy
(``DecodeInputs``; its device views are the graph inputs), and reads the sampled tokens
and their log-probs back with one copy into a persistent pinned buffer; nothing syncs
per token. A step is ``launch``ed (enqueued, its results' copy back included) and
``collect``ed (waited for and read) separately, with two result slots, so that the step
loop can enqueue the next decode step before reading this one (``EngineConfig.overlap_steps``):
the next step's input tokens then come from this step's device result buffer.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from . import sampler
from .block_manager import BlockManager
from .config import EngineConfig
from .decode_graphs import DecodeGraphs, graph_buckets, table_widths
from .decode_inputs import DecodeInputs
from .prefill_inputs import prefill_inputs
from .sequence import Sequence, split_step, step_kind

logger = logging.getLogger(__name__)


def graph_samples(seqs: list[Sequence], temperature: float | None) -> bool:
    """Whether a decode graph that samples at ``temperature`` draws what ``sample`` would
    for every row of ``seqs``: each row samples at that temperature (its log-probs too),
    over the whole vocabulary (no top-k / top-p)."""
    if temperature is None:
        return False
    return all(s.params.temperature == temperature and s.params.logprobs_match_sampling for s in seqs)


def warmup_shapes(model, rollout: bool = False, dtype: torch.dtype | None = None):
    """``WarmupShapes`` of a ``UnifiedCausalLM``: every projection weight (the LM head
    aside), its norms, MLP width, heads and LM head. o_proj / down_proj run the model's
    K-group tree (``k_groups``): on one device a linear with it, on a tensor-parallel
    rank the ``linear_partial`` of the rank's subtree (other kernel keys, so listed so).
    ``rollout``: also the fused q|k|v and gate|up GEMMs the rollout path runs.
    ``dtype``: the dtype the forward computes in, when it is not the parameters' own
    (AReaL's FSDP engine keeps fp32 master parameters and unshards them in its
    ``dtype``, bf16, for the forward); default: the LM head weight's dtype."""
    from areal_tik.unified_kernels import WarmupShapes

    spec, hf = model.config, model.hf_model
    lm = hf.get_output_embeddings().weight
    groups = getattr(model, "k_groups", 1)
    shard = getattr(model, "tensor_parallel", None)
    ranks = 1 if shard is None else shard.size
    linears, partials = set(), set()
    for name, m in hf.named_modules():
        if not isinstance(m, torch.nn.Linear) or m.weight is lm:
            continue
        entry = (m.out_features, m.in_features, m.bias is not None)
        if name.endswith(("o_proj", "down_proj")) and ranks > 1:
            partials.add((m.out_features, m.in_features, groups // ranks))
        else:
            linears.add(entry + (groups,) if name.endswith(("o_proj", "down_proj")) and groups > 1 else entry)
    if rollout and hasattr(model, "rollout_linears"):
        linears |= model.rollout_linears()
    norms = (spec.hidden, spec.head_dim) if spec.qk_norm else (spec.hidden,)
    head_norms = ((spec.n_heads, spec.head_dim), (spec.n_kv_heads, spec.head_dim)) if spec.qk_norm else ()
    return WarmupShapes(tuple(sorted(linears)), norms, (spec.intermediate,), (spec.n_heads, spec.n_kv_heads, spec.head_dim),
                        tuple(lm.shape), dtype=dtype or lm.dtype, partials=tuple(sorted(partials)), head_norms=head_norms)


@dataclass
class StepResult:
    tokens: list[int]
    logprobs: list[float]


@dataclass(eq=False)
class LaunchedStep:
    """A step enqueued on the GPU whose results are not read yet (``ModelRunner.launch``)."""

    seqs: list[Sequence]   # the step's sequences, as scheduled
    rows: list[Sequence]   # the sequences that sample, in result order
    slot: int              # its result buffer
    done: object | None    # event after the copy back (None on CPU)
    clock: tuple | None    # GpuClock marks (start, end) of a decode step
    indices: list[int] = field(default_factory=list)  # where each row's token goes (overlap)

    def row_of(self) -> dict:
        return {seq: i for i, seq in enumerate(self.rows)}


@dataclass
class StepCounts:
    """Steps by kind, and the decode launches by the graph bucket they pad to.

    Kinds: "prefill" (prompt chunks only), "mixed" (prompt chunks and decode rows: chunked
    prefill), "decode" (decode rows only). ``decode_buckets[(kind, bucket)]`` counts the
    decode launches of steps of that kind by the bucket the graph plan pads them to (0:
    above the largest bucket, or no plan, so eager); a planned bucket replays its CUDA
    graph when one was captured (``ModelRunner.graph_replays``). Chunked prefill must
    leave a decode-only step exactly where it is without chunks: kind "decode", the
    bucket of its batch size.
    """

    prefill: int = 0
    mixed: int = 0
    decode: int = 0
    decode_buckets: Counter = field(default_factory=Counter)

    def add(self, kind: str, bucket: int | None) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if bucket is not None:
            self.decode_buckets[(kind, bucket)] += 1


class ModelRunner:
    def __init__(self, model, config: EngineConfig, tensor_parallel=None):
        self.model = model
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.device = model.device
        self.block_size = config.kv_block_size
        self._check_limits()
        num_blocks = config.num_kv_blocks or self._measure_num_blocks()
        if tensor_parallel is not None:  # every rank's scheduler must see the same cache
            num_blocks = tensor_parallel.min_int(num_blocks)
        self._check_num_blocks(num_blocks)
        self.kv_cache = model.new_kv_cache(num_blocks, self.block_size)
        path = getattr(model, "decode_attention_path", None)  # before any graph is captured
        self.decode_attention = path(self.block_size, config.max_model_len) if path is not None else "unknown"
        if self.device.type == "cuda" and self.decode_attention.startswith("gather-sdpa"):
            # the slow path on a GPU: said where it is seen, with what would avoid it
            logger.warning("decode attention: %s; the standard decode gathers every block of its tables "
                           "(kv_block_size >= max_model_len lets it run FlashAttention)", self.decode_attention)
        else:
            logger.info("decode attention: %s", self.decode_attention)
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        # The graph plan: the decode buckets and table widths to capture on a GPU. On CPU
        # nothing is captured, but the plan still says which bucket a decode batch pads to
        # (what a GPU would replay), and ``step_counts`` records it.
        sizes = tuple(config.cuda_graph_sizes or graph_buckets(config.graph_batch_limit)) if config.cuda_graphs else ()
        self.decode_graphs = DecodeGraphs(
            sizes, table_widths(config.max_blocks_per_seq, getattr(model, "kernels", None)))
        self.step_counts = StepCounts()
        self.graph_sampled = 0  # decode steps whose tokens and log-probs a graph drew
        self.gpu_clock = None  # a ``GpuClock`` when a caller times decode steps on the GPU
        self.decode_inputs = DecodeInputs(config.max_num_seqs, config.max_blocks_per_seq,
                                          self.block_manager, self.device)
        self._init_result_buffers(config.max_num_seqs)
        self.warmup_counts = self._compile_kernels()
        if config.cuda_graphs and self.device.type == "cuda":
            self._capture_graphs()

    # ------------------------------------------------------------------ sizing

    def _check_limits(self) -> None:
        spec = self.model.config
        if self.config.max_model_len > spec.max_positions:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({spec.max_positions})")

    def _block_bytes(self) -> int:
        spec = self.model.config
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * spec.n_layers * self.block_size * spec.n_kv_heads * spec.head_dim * itemsize

    def _check_num_blocks(self, num_blocks: int) -> None:
        need = self.config.max_blocks_per_seq + 1  # one full-length sequence plus scratch
        if num_blocks < need:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {self.block_size} tokens; one sequence of "
                f"max_model_len={self.config.max_model_len} needs {need} (including the scratch block): "
                "lower max_model_len or give more memory")

    def _measure_num_blocks(self) -> int:
        cfg = self.config
        wanted = cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
        if self.device.type != "cuda":
            return max(min(wanted, cfg.cpu_kv_cache_bytes // self._block_bytes()), 2)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        current = torch.cuda.memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - (peak - current)
        num = int(budget // self._block_bytes())
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num, self.block_size,
                    num * self._block_bytes() / 2**30)
        return max(min(num, wanted), 2)

    def _warmup(self) -> None:
        """A prefill at the token budget and a sampling pass at max batch: the activation peak."""
        cfg = self.config
        seq_len = cfg.max_model_len
        num_seqs = max(1, min(cfg.batched_tokens_limit // seq_len, cfg.max_num_seqs))
        tokens = num_seqs * seq_len
        cache = self.model.new_kv_cache(-(-tokens // self.block_size) + 1, self.block_size)
        dev = self.device
        cu = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device=dev)
        positions = torch.arange(seq_len, device=dev).repeat(num_seqs)
        with torch.inference_mode():
            hidden = self.model.prefill(
                torch.zeros(tokens, dtype=torch.int64, device=dev), positions, cu, seq_len, cache,
                torch.arange(tokens, device=dev) + self.block_size, (cu[1:] - 1).long())
            rows = hidden[:1].expand(cfg.max_num_seqs, -1).contiguous()
            logits, _ = self.model.logits_lse(rows, 1.0)
            ids = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=dev)
            sampler.sample(logits, 1.0, ids, ids, top_k=ids + 1, top_p=None)
        del cache, hidden, rows, logits
        torch.cuda.synchronize(dev)

    def _compile_kernels(self) -> dict[str, int] | None:
        """Compile every unified kernel variant rollout launches, before the first request
        (and before graph capture). Skipped on CPU: the Triton interpreter compiles nothing
        (kernels run as Python), so a warm-up there would only spend time."""
        if not (self.config.compile_at_start and self.device.type == "cuda"
                and getattr(self.model, "kernels", None) == "unified"):
            return None
        from areal_tik.unified_kernels.warmup import run_tasks, warmup_tasks  # only the unified set needs it

        cfg = self.config
        # A step holds at most the prefill budget, or a chunk plus one decode row per sequence.
        rows = max(cfg.batched_tokens_limit, cfg.max_num_seqs, (cfg.prefill_chunk_tokens or 0) + cfg.max_num_seqs)
        start = time.perf_counter()
        tasks = warmup_tasks(warmup_shapes(self.model, rollout=True), rows, self.device, training=False,
                             sampling=True, block_size=self.block_size)
        tasks["sampler"] = sampler.warmup_tasks(self.model.config.vocab, self.model.dtype, self.device)
        run_tasks([task for family in tasks.values() for task in family], self.device)  # one pool: one tail
        counts = {name: len(family) for name, family in tasks.items()}
        logger.info("compiled kernels at start-up for up to %d rows in %.1f s: %s", rows,
                    time.perf_counter() - start, counts)
        return counts

    # ------------------------------------------------------------------ inputs

    def _to_device(self, values, dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare_prefill(self, seqs: list[Sequence]) -> dict:
        """Inputs of the chunks [num_computed, num_computed + num_scheduled) of ``seqs``
        (``prefill_inputs``: two transfers, no per-token Python)."""
        return prefill_inputs(seqs, self.block_size, self.device)

    # ------------------------------------------------------------------ forward

    def _init_result_buffers(self, max_rows: int) -> None:
        # [tokens | log-probs] of one step as fp64 (int64 ids < 2^53 and fp32 values are
        # exact in fp64): two slots (a step is enqueued while the one before it is read), each
        # one device buffer and one pinned host twin, one copy per step; an event per slot
        # marks its copy done.
        on_gpu = self.device.type == "cuda"
        self._result_host = [torch.empty(2 * max_rows, dtype=torch.float64, pin_memory=on_gpu)
                             for _ in range(2)]
        self._result_dev = ([torch.empty(2 * max_rows, dtype=torch.float64, device=self.device)
                             for _ in range(2)] if on_gpu else self._result_host)
        self._result_np = [h.numpy() for h in self._result_host]
        self._result_done = [torch.cuda.Event() for _ in range(2)] if on_gpu else [None, None]
        self._slot = 0

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool | None = None,
            timing: dict | None = None) -> StepResult:
        """One step: the prefill chunks, then the decode rows (``split_step``; each
        sequence's ``num_scheduled_tokens`` says what it computes, ``is_prefill`` is not
        needed). Results are in ``sequence.sampling_rows`` order. Adds host seconds to
        ``timing["launch"]`` / ``["wait"]`` when given."""
        return self.collect(self.launch(seqs, timing), timing)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], timing: dict | None = None,
               after: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Enqueue one step (``run`` without reading its results). ``after``: the step
        enqueued before this one whose tokens are not read yet; a decode row whose last
        token is that step's draw (``Sequence.PENDING`` on the host) takes it on the device."""
        start = time.perf_counter()
        prefill, decode = split_step(seqs)
        kind = step_kind(prefill, decode)
        bucket = self.graph_bucket(len(decode)) if decode else None
        self.step_counts.add(kind, (bucket or 0) if decode else None)
        clock = self.gpu_clock
        if clock is not None and kind != "decode":
            clock.break_chain()
            clock = None
        parts, rows = [], []
        if prefill:
            assert after is None, "a prefill step is never enqueued behind an unread one"
            hidden = self._prefill(prefill)
            done = [s for s in prefill if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens]
            if done:
                parts.append(self.sample(hidden, done))
                rows += done
        clock_start = None
        if decode:
            hidden, sampled, clock_start = self._decode(decode, bucket, clock, after)
            parts.append(sampled if sampled is not None
                         else self.sample(hidden, decode, self.decode_inputs.sample_keys(len(decode))))
            rows += decode
        n = len(rows)
        if 2 * n > self._result_host[0].numel():  # prefill batches are bounded by max_num_seqs too
            assert after is None, "result buffers grow only with no step unread"
            self._init_result_buffers(n)
        slot = self._slot
        self._slot ^= 1
        out, host = self._result_dev[slot], self._result_host[slot]
        row = 0
        for tokens, logprobs in parts:
            k = tokens.shape[0]
            out[row:row + k].copy_(tokens)
            out[n + row:n + row + k].copy_(logprobs)
            row += k
        done_event = self._result_done[slot]
        if out is not host and n:
            host[:2 * n].copy_(out[:2 * n], non_blocking=True)
            done_event.record()
        else:
            done_event = None
        clock_marks = (clock_start, clock.mark()) if clock_start is not None else None
        if timing is not None:
            timing["launch"] += time.perf_counter() - start
        return LaunchedStep(seqs, rows, slot, done_event, clock_marks)

    def collect(self, step: "LaunchedStep", timing: dict | None = None) -> StepResult:
        """Wait for ``step``'s results and read them (``sampling_rows`` order)."""
        start = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        n = len(step.rows)
        values = self._result_np[step.slot][:2 * n]
        if step.clock is not None and self.gpu_clock is not None:
            self.gpu_clock.account(*step.clock)
        if timing is not None:
            timing["wait"] += time.perf_counter() - start
        return StepResult(values[:n].astype(np.int64).tolist(), values[n:].tolist())

    def device_tokens(self, step: "LaunchedStep") -> torch.Tensor:
        """``step``'s drawn tokens as its device result buffer holds them (fp64, exact)."""
        return self._result_dev[step.slot][:len(step.rows)]

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        inputs = self.prepare_prefill(seqs)
        return self.model.prefill(cache=self.kv_cache, **inputs)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return self.decode_graphs.sizes

    @property
    def graphs(self) -> dict:
        """The captured decode graphs by (bucket, table width); empty on CPU."""
        return self.decode_graphs.graphs

    @property
    def graph_replays(self) -> int:
        return self.decode_graphs.replays

    def graph_bucket(self, batch: int) -> int | None:
        """The planned graph bucket a decode batch of ``batch`` rows pads to (the smallest
        one that holds it), or None above the largest: the decision to replay, which
        depends on the batch size alone, never on the step's prefill chunks."""
        return self.decode_graphs.bucket(batch)

    def _decode(self, seqs: list[Sequence], bucket: int | None, clock=None, after=None):
        """(hidden [B, H], (tokens, log-probs) when a graph drew them for every row, else None,
        the ``clock``'s start mark once the inputs are staged, else None). ``after``: see ``launch``."""
        batch = len(seqs)
        staging = self.decode_inputs
        width = max(len(s.block_table) for s in seqs)
        key = self.decode_graphs.key(bucket, width)
        pending = None
        if after is not None:
            row_of = after.row_of()
            # a pending input token is always the unread step's draw (KeyError otherwise: a bug)
            pending = (self.device_tokens(after),
                       [row_of[s] if s.token_ids[-1] == Sequence.PENDING else None for s in seqs])
        rows = batch if key is None else bucket  # the graph reads the staging buffer's device views
        staging.stage(seqs, rows, pending)
        mark = clock.mark() if clock is not None else None
        if key is None:  # above the plan, or nothing captured (CPU, failed capture)
            return self.model.decode(cache=self.kv_cache, **staging.model_inputs(batch, width)), None, mark
        out = self.decode_graphs.replay(key, batch)
        if not isinstance(out, tuple):
            return out, None, mark
        hidden, tokens, logprobs = out
        if not graph_samples(seqs, self.graph_sample_temperature):
            return hidden, None, mark
        self.graph_sampled += 1
        return hidden, (tokens, logprobs), mark

    @property
    def graph_sample_temperature(self) -> float | None:
        """The temperature the decode graphs sample at, or None when they end at the hidden
        states (``EngineConfig.graph_sample_temperature``; never with a vocabulary shard)."""
        if self.config.vocab_parallel:
            return None
        return self.config.graph_sample_temperature

    # ------------------------------------------------------------------ sampling

    def sample(self, hidden: torch.Tensor, seqs: list[Sequence],
               keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens [B] and their fp32 log-probs [B], one LM-head pass per temperature.

        The log-prob of a row comes from the same (logits, lse) pass its token is sampled
        from, at its request's temperature (1.0 for greedy) over the full vocabulary.
        Rows are grouped by temperature because the op takes one float; the ops are
        row-invariant, so the grouping changes no bits. ``keys`` are the device (request
        keys, output counters) of the rows when already staged, else built here.
        """
        params = seqs[0].params
        if all(s.params is params for s in seqs):  # one request spec: no grouping pass
            return self._sample_group(hidden, seqs, params.temperature, keys)
        groups: dict[float, list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(seq.params.temperature, []).append(row)
        if len(groups) == 1:
            (temperature, rows), = groups.items()
            return self._sample_group(hidden, seqs, temperature, keys)
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=hidden.device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=hidden.device)
        for temperature, rows in groups.items():
            index = self._to_device(rows, torch.int64)
            group_keys = None if keys is None else (keys[0][index], keys[1][index])
            tok, lp = self._sample_group(hidden[index], [seqs[r] for r in rows], temperature, group_keys)
            tokens[index] = tok
            logprobs[index] = lp
        return tokens, logprobs

    def _sample_group(self, hidden, seqs: list[Sequence], temperature: float, keys=None):
        logprob_t = seqs[0].params.logprob_temperature
        if keys is None:
            keys = self._to_device([[s.sample_key for s in seqs], [s.num_output_tokens for s in seqs]],
                                   torch.int64)
        top_k = top_p = None
        if any(s.params.top_k for s in seqs):
            top_k = self._to_device([s.params.top_k for s in seqs], torch.int64)
        if any(s.params.top_p < 1.0 for s in seqs):
            top_p = self._to_device([s.params.top_p for s in seqs], torch.float32)
        sharded = getattr(self.model, "vocab_shard_logits_lse", None)
        part = sharded(hidden, logprob_t) if sharded is not None and top_k is None and top_p is None else None
        if part is not None:  # a vocabulary shard: candidates gathered, not the logits (same bits)
            logits, lse, col0, gather = part
            tokens, picked = sampler.sample_sharded(logits, col0, gather, temperature, keys[0], keys[1])
            return tokens, self.model.ops.gather_logprobs(picked, lse, torch.zeros_like(tokens), logprob_t)
        return self._draw(hidden, temperature, logprob_t, keys[0], keys[1], top_k, top_p)

    def _draw(self, hidden, temperature: float, logprob_t: float, keys, counters, top_k=None, top_p=None):
        """(tokens, their log-probs at ``logprob_t``) from one LM-head pass over ``hidden``:
        what a step's rows get, eagerly or inside a decode graph."""
        logits, lse = self.model.logits_lse(hidden, logprob_t)
        tokens = sampler.sample(logits, temperature, keys, counters, top_k, top_p)
        return tokens, self.model.ops.gather_logprobs(logits, lse, tokens, logprob_t)

    # ------------------------------------------------------------------ CUDA graphs

    def _capture_graphs(self) -> None:
        # The staging buffer holds padding rows here (scratch block only); its device views
        # are the graph's inputs, so a step's one staging copy feeds the replay. With a graph
        # temperature the graph goes on to draw every row's token and its log-prob from the
        # staged sampling keys: the launches ``sample`` makes eagerly, on the bucket's rows
        # (row-invariant ops; the Gumbel split count follows the rows, the drawn token,
        # the first maximal index, does not).
        temperature = self.graph_sample_temperature

        def decode(**inputs):
            hidden = self.model.decode(cache=self.kv_cache, **inputs)
            if temperature is None:
                return hidden
            keys, counters = self.decode_inputs.sample_keys(hidden.shape[0])
            return (hidden, *self._draw(hidden, temperature, temperature, keys, counters))
        tp = self.tensor_parallel
        agree = None if tp is None else (lambda ok: bool(tp.min_int(int(ok))))
        self.decode_graphs.capture(decode, self.decode_inputs.model_inputs, self.device, agree)

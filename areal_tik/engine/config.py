"""Typed configuration of the rollout engine and of one request's sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check_int(name: str, value, *, minimum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    """The rollout engine's options: the one declaration of each.

    The command line's and the server's flags (``add_engine_arguments``) and the AReaL
    YAML's engine block (``areal_tik.adapter.config``) are generated from these fields,
    so a new option is one field here (with its ``help``) and one check below.
    ``max_model_len`` counts prompt plus generated tokens. Block 0 of the paged KV cache
    is reserved as a scratch block for CUDA-graph padding rows.
    """

    max_num_seqs: int = _option(256, "Sequences decoded at once.")
    max_model_len: int = _option(4096, "Prompt plus generated tokens of one sequence.")
    kv_block_size: int = _option(
        64, "Tokens per paged KV block: a power of two, and for the unified kernels a multiple "
            "of the attention kernel's KV tile (64 on a GPU, 16 under the Triton interpreter).")
    num_kv_blocks: int | None = _option(
        None, "Paged KV blocks; None measures them: on a GPU what is left of "
              "gpu_memory_utilization after a warm-up at maximum batch, on CPU cpu_kv_cache_bytes "
              "worth, capped at what max_num_seqs sequences of max_model_len need.")
    max_num_batched_tokens: int | None = _option(
        None, "Prompt tokens one prefill step may process (>= max_model_len, so that a preempted "
              "sequence can always be recomputed); None: max(max_model_len, 8192).")
    gpu_memory_utilization: float = _option(
        0.9, "GPU memory fraction the process may reach once the KV cache is allocated.")
    cpu_kv_cache_bytes: int = _option(1 << 30, "KV cache bytes on CPU when num_kv_blocks is None.")
    cuda_graphs: bool = _option(True, "Capture decode in CUDA graphs per batch-size bucket (GPU only).")
    max_graph_batch_size: int | None = _option(
        None, "Largest captured bucket; bigger decode batches run eagerly (None: min(max_num_seqs, 512)).")
    cuda_graph_sizes: tuple[int, ...] | None = _option(
        None, "The exact buckets to capture (None: 1, 2, 4, 8, then multiples of 16 up to "
              "max_graph_batch_size).")
    graph_sample_temperature: float | None = _option(
        1.0, "Decode graphs also draw the tokens (Gumbel-max, no top-k / top-p) and take their "
             "log-probs at this temperature (> 0), so a decode step whose every row samples at it "
             "replays one graph, sampling included; other steps sample eagerly from the graph's "
             "hidden states, the graph's own draw then wasted. None: the graphs end at the hidden "
             "states (for engines whose requests mostly sample otherwise). Same bits either way; "
             "off with vocab_parallel (its sampler gathers across ranks).")
    overlap_steps: bool = _option(
        True, "Enqueue the next decode step before reading this one's tokens: its input tokens are "
              "copied on the device from this step's draw, and the host's bookkeeping of this step "
              "(appending tokens, stop checks, futures) runs while the GPU computes the next. Only "
              "between decode-only steps with nothing to admit, no preemption possible, and no "
              "sequence ending on its length at the step in flight; not with chunked prefill or "
              "tensor parallelism. A sequence that stops on a stop token has one wasted row in the "
              "step already enqueued. Same bits and outputs either way.")
    compile_at_start: bool = _option(
        True, "Unified kernels on a GPU: compile every Triton kernel variant rollout launches (prefill "
              "up to the token budget, paged prefill, decode, sampling) when the engine starts, so no "
              "request waits for a compilation. False only to shorten start-up in throwaway runs.")
    compile_standard_ops: bool = _option(
        False, "Standard kernels only: run their elementwise chains (RMSNorm, residual add + RMSNorm, "
               "rope, SiLU-mul) under torch.compile, as vLLM compiles its model, compiled at their first "
               "calls; the recipes' stock mode sets it. The unified kernels refuse it.")
    seed: int = _option(0, "Derives the sampling key of requests that carry no seed.")
    enable_prefix_caching: bool = _option(
        False, "Reuse the K/V of full blocks of earlier sequences with the same token prefix (the n "
               "samples of a GRPO prompt, multi-turn prefixes); dropped on every weight update. "
               "Bits are unchanged.")
    prefill_chunk_tokens: int | None = _option(
        None, "Chunked prefill: prompt tokens one step computes, in the same step as the decode rows "
              "(None: whole prompts, in prefill-only steps). At least kv_block_size. Bits are unchanged.")
    tensor_parallel_size: int = _option(
        1, "Ranks of one tensor-parallel engine (1, 2, 4 or 8; one process each, every rank given the "
           "same requests): heads, KV cache and MLP columns are split over them. Must divide the "
           "model's query and KV heads and k_groups. Bits equal the TP = 1 training forward with the "
           "same k_groups.")
    k_groups: int = _option(
        1, "K groups of the row-parallel linears (o_proj, down_proj): each group an fp32 chain, the "
           "groups summed in a fixed binary tree (1, 2, 4 or 8; 1 is the plain K loop). A multiple "
           "of tensor_parallel_size; the trainer must use the same value (actor.tik_k_groups) for "
           "its log-probs to be reused.")
    vocab_parallel: bool = _option(
        False, "Tensor parallelism: each rank holds 1/tensor_parallel_size of the embedding and LM head "
               "(a run of whole vocabulary splits of the unified log-prob kernel; at most one rank per "
               "split) instead of a full copy. Tokens and log-probs keep the TP = 1 bits: the split "
               "states and each rank's sampling candidate are gathered every step (top-k / top-p rows "
               "gather the logits). Off by default: it adds gathers to every step and needs the "
               "unified kernels; turn it on when the vocabulary's memory matters.")

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("max_model_len", self.max_model_len, minimum=2)
        _check_int("kv_block_size", self.kv_block_size, minimum=1)
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size!r}")
        _check_int("num_kv_blocks", self.num_kv_blocks, minimum=2, allow_none=True)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_model_len ({self.max_model_len}) so that a "
                f"preempted sequence can be recomputed in one step, got {self.max_num_batched_tokens!r}")
        util = _check_float("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes, minimum=1)
        if self.graph_sample_temperature is not None:
            t = _check_float("graph_sample_temperature", self.graph_sample_temperature)
            if not t > 0:
                raise ValueError(f"graph_sample_temperature must be > 0 or None, got {self.graph_sample_temperature!r}")
            self.graph_sample_temperature = t
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.overlap_steps, bool):
            raise TypeError(f"overlap_steps must be a bool, got {self.overlap_steps!r}")
        _check_int("max_graph_batch_size", self.max_graph_batch_size, minimum=1, allow_none=True)
        if self.cuda_graph_sizes is not None:
            sizes = tuple(sorted(set(self.cuda_graph_sizes)))
            for size in sizes:
                _check_int("cuda_graph_sizes entry", size, minimum=1)
            if not sizes or sizes[-1] > self.max_num_seqs:
                raise ValueError(f"cuda_graph_sizes must be non-empty and <= max_num_seqs "
                                 f"({self.max_num_seqs}), got {self.cuda_graph_sizes!r}")
            self.cuda_graph_sizes = sizes
        if not isinstance(self.compile_at_start, bool):
            raise TypeError(f"compile_at_start must be a bool, got {self.compile_at_start!r}")
        if not isinstance(self.compile_standard_ops, bool):
            raise TypeError(f"compile_standard_ops must be a bool, got {self.compile_standard_ops!r}")
        _check_int("seed", self.seed)
        self._check_prefix_and_chunks()
        self._check_parallel()

    def _check_prefix_and_chunks(self) -> None:
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        _check_int("prefill_chunk_tokens", self.prefill_chunk_tokens, allow_none=True)
        chunk = self.prefill_chunk_tokens
        if chunk is not None and chunk < self.kv_block_size:
            raise ValueError(f"prefill_chunk_tokens must be >= kv_block_size ({self.kv_block_size}, a "
                             f"multiple of the attention's KV tile), got {chunk!r}")
        need = self.max_blocks_per_seq + 1
        if self.num_kv_blocks is not None and self.num_kv_blocks < need:
            raise ValueError(f"num_kv_blocks must hold one sequence of max_model_len={self.max_model_len} "
                             f"({need} blocks of {self.kv_block_size} with the scratch block), "
                             f"got {self.num_kv_blocks!r}")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "k_groups"):
            value = getattr(self, name)
            _check_int(name, value, minimum=1)
            if value not in PARALLEL_SIZES:
                raise ValueError(f"{name} must be one of {PARALLEL_SIZES}, got {value!r}")
        check_divides("k_groups", self.k_groups, self.tensor_parallel_size)
        if not isinstance(self.vocab_parallel, bool):
            raise TypeError(f"vocab_parallel must be a bool, got {self.vocab_parallel!r}")

    def check_model(self, spec, dtype=None) -> None:
        """ValueError unless the tensor-parallel split fits the model ``spec`` (a
        ``ModelSpec``): ``tensor_parallel_size`` divides the query and KV heads, and
        ``k_groups`` the K of o_proj (query heads x head_dim) and of down_proj (the MLP
        width), so that every group and every rank's slice is whole."""
        check_divides("the model's query heads", spec.n_heads, self.tensor_parallel_size)
        check_divides("the model's KV heads", spec.n_kv_heads, self.tensor_parallel_size)
        check_divides("o_proj's K (query heads x head_dim)", spec.q_size, self.k_groups, "k_groups")
        check_divides("down_proj's K (intermediate_size)", spec.intermediate, self.k_groups, "k_groups")
        if self.vocab_parallel and self.tensor_parallel_size > 1:  # the splits depend on the dtype
            import torch

            from areal_tik.unified_kernels.logprob_shards import check_vocab_shards
            check_vocab_shards(spec.vocab, spec.hidden, dtype or torch.bfloat16, self.tensor_parallel_size)

    # Derived limits are properties, never written back into the fields: a config built
    # from its defaults first and then given a YAML's values (OmegaConf does exactly that
    # with the ``tik:`` block) kept max_graph_batch_size at the default max_num_seqs' 64
    # while max_num_seqs was 128, so every decode batch above 64 ran without CUDA graphs
    # (the likely cause of 1.7-4.5x slower GRPO rollouts seen on the H200 at 8443ba9).
    @property
    def batched_tokens_limit(self) -> int:
        """``max_num_batched_tokens``, or max(max_model_len, 8192) when it is None."""
        if self.max_num_batched_tokens is None:
            return max(self.max_model_len, 8192)
        return self.max_num_batched_tokens

    @property
    def graph_batch_limit(self) -> int:
        """The largest captured decode bucket: ``max_graph_batch_size`` or
        min(max_num_seqs, 512), never above max_num_seqs."""
        limit = min(self.max_num_seqs, 512) if self.max_graph_batch_size is None else self.max_graph_batch_size
        return min(limit, self.max_num_seqs)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.kv_block_size)

    def check_kernels(self, kernels: str) -> None:
        """ValueError unless ``kv_block_size`` fits ``kernels``' attention: the unified
        decode kernel reads the paged cache in KV tiles that must not straddle a block.
        (The standard ops take any block size; their fast decode, FlashAttention over each
        sequence's rows, wants one block per sequence, which the recipes' stock mode sets.) ``vocab_parallel``
        needs the unified LM head's fixed vocabulary splits; ``compile_standard_ops`` the standard set."""
        if self.vocab_parallel and kernels != "unified":
            raise ValueError(f"vocab_parallel needs the unified kernels, not {kernels!r}")
        if kernels != "unified":
            return
        if self.compile_standard_ops:
            raise ValueError("compile_standard_ops compiles the standard kernels' elementwise ops; "
                             "the unified kernels are Triton kernels already: leave it off")
        tile = attention_kv_tile()
        if self.kv_block_size % tile:
            raise ValueError(
                f"kv_block_size={self.kv_block_size} is not a multiple of the unified attention "
                f"kernel's KV tile ({tile} on this backend): use a multiple of {tile}")


# Row-parallel K groups and tensor-parallel ranks: powers of two up to 8 (TP_DESIGN).
PARALLEL_SIZES = (1, 2, 4, 8)


def check_divides(what: str, value: int, divisor: int, divisor_name: str = "tensor_parallel_size") -> None:
    """ValueError naming both numbers unless ``divisor`` divides ``value``."""
    if value % divisor:
        raise ValueError(f"{divisor_name}={divisor} does not divide {what} ({value}): use a "
                         f"{divisor_name} in {[d for d in PARALLEL_SIZES if value % d == 0]}")


def attention_kv_tile() -> int:
    """The unified attention kernel's KV tile (``BLOCK_N``) on this backend.

    Imported when asked, not with this module: importing a kernel module decides
    interpreter vs GPU for the process (see ``areal_tik.runtime``), and flags and YAML
    blocks are generated from this module before that decision."""
    from areal_tik.unified_kernels import _attention_fwd

    return _attention_fwd.attention_config().block_n


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 switch those filters off.
    Log-probs are always recorded over the full vocabulary at ``temperature`` (at 1.0 for
    greedy): the objective's definition. With greedy, top-k or top-p the sampling
    distribution differs from the recorded one, so ``logprobs_match_sampling`` is False
    and a trainer must not reuse those log-probs as behaviour log-probs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        t = _check_float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check_int("top_k", self.top_k, minimum=0)
        p = _check_float("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for tok in stops:
            _check_int("stop_token_ids entry", tok, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("seed", self.seed, minimum=0, allow_none=True)
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the recorded log-probs (1.0 for greedy, which has no distribution)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def logprobs_match_sampling(self) -> bool:
        """True iff tokens were drawn from exactly the distribution the log-probs describe."""
        return not self.greedy and self.top_k == 0 and self.top_p == 1.0

"""One request's state inside the engine, and what the caller gets back."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from .config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued for (re)prefill
    RUNNING = "running"    # holds KV blocks, decodes one token per step
    FINISHED = "finished"


@dataclass
class GenerationOutput:
    """One finished request.

    logprobs[i] is log_softmax(logits / T)[token_ids[i]] over the full vocabulary at
    T = ``logprob_temperature`` (fp32 values of the unified gather_logprobs op);
    versions[i] is the weight version token i was sampled with. ``logprobs_match_sampling``
    is False when greedy, top-k or top-p sampling drew from a different distribution.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    logprob_temperature: float = 1.0
    logprobs_match_sampling: bool = True
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (last admission)
    text: str | None = None


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens; ``block_table`` lists the KV blocks holding them.

    With overlapped steps (``EngineConfig.overlap_steps``) the token a step draws is
    appended as ``PENDING`` when the step is enqueued (so lengths, slots and counters
    already count it) and written when its results are read."""

    PENDING: ClassVar[int] = -1

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sample_key: int  # 63-bit key of this request's sampling noise
    token_ids: list[int] = field(init=False)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # K/V progress: tokens whose K/V are in the cache (computed or prefix-cache hits), and
    # tokens the current step computes (a prefill chunk, or 1 for a decode row).
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_cached_tokens: int = 0
    # Prefix-cache bookkeeping (BlockManager): chained hashes of the full blocks of
    # token_ids, how many of this sequence's blocks are registered, the hashes it is still
    # to write (others with the same prefix wait for them), the weight version of its K/V.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    pending_hashes: list[bytes] = field(default_factory=list)
    kv_version: int = 0

    def __post_init__(self):
        self.prompt_ids = list(self.prompt_ids)
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def to_output(self) -> GenerationOutput:
        assert self.finish_reason is not None, "sequence has not finished"
        return GenerationOutput(
            prompt_ids=list(self.prompt_ids),
            token_ids=self.output_ids,
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            logprob_temperature=self.params.logprob_temperature,
            logprobs_match_sampling=self.params.logprobs_match_sampling,
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
        )


def is_decode_row(seq: Sequence) -> bool:
    """The step computes only the last token's K/V (a decode row; also the last token of a
    prefill): it runs in the decode batch, whose attention gives the same bits."""
    return seq.num_scheduled_tokens == 1 and seq.num_computed_tokens + 1 == len(seq.token_ids)


def split_step(seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """(prefill chunks, decode rows) of one step's sequences, each in step order."""
    prefill = [s for s in seqs if not is_decode_row(s)]
    if not prefill:
        return [], seqs
    return prefill, [s for s in seqs if is_decode_row(s)]


def step_kind(prefill: list[Sequence], decode: list[Sequence]) -> str:
    """"prefill" (prompt chunks only), "mixed" (prompt chunks and decode rows: chunked
    prefill) or "decode" (decode rows only), from ``split_step``'s two lists."""
    return "decode" if not prefill else "mixed" if decode else "prefill"


def sampling_rows(seqs: list[Sequence]) -> list[Sequence]:
    """The sequences that sample a token this step, in the order of the step's results:
    prefill chunks that end their sequence's tokens, then the decode rows."""
    prefill, decode = split_step(seqs)
    done = [s for s in prefill if s.num_computed_tokens + s.num_scheduled_tokens == len(s.token_ids)]
    return done + decode

"""One request's state inside the engine, and what the caller gets back."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    text: str | None = None


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens; ``block_table`` lists the KV blocks holding them."""

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
        )

"""The bitwise audit and the run's reuse state (reuse on/off, fallback, tik/* metrics).

Every audit recomputes a sample of sequences with the trainer's forward and compares the
bits of the rollout log-probs of fresh tokens with the recomputed ones (``torch.equal``
on integer views, ``areal_tik.bitwise.compare_bits``; no tolerance); the first
minibatch of every PPO update is a second audit (its forward against the reused
log-probs). One differing bit triggers the run's reaction (``actor.tik_on_mismatch``,
``REACTIONS``):

- ``recompute`` (default): the run recomputes old log-probs for good: a loud warning,
  the reason kept in ``RunState.fallback_reason`` and the metric ``tik/fallback`` = 1;
- ``warn``: a warning and ``tik/mismatches`` counts it; reuse continues;
- ``stop``: ``ExactnessError`` ends the run.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from areal_tik.bitwise import BitComparison

from .log import logger

REACTIONS = ("recompute", "warn", "stop")  # index = the tik/on_mismatch code in W&B


class ExactnessError(RuntimeError):
    """A rollout log-prob differs from the trainer's and ``tik_on_mismatch`` is ``stop``."""


def describe_mismatch(result: BitComparison) -> str:
    """Where the first differing log-prob of an audit sits, and its two values."""
    if result.first_mismatch is None:
        return "in another training process's sample"
    (row, k), (rollout, recomputed) = result.first_mismatch, result.first_values
    return f"sampled row {row}, scored token {k}: rollout {rollout!r} vs recompute {recomputed!r}"


@dataclass
class RunState:
    """Whether the run reuses rollout log-probs, and what that has saved so far."""

    refusals: list[str] = field(default_factory=list)  # config-level reasons reuse cannot be exact
    audit_every: int = 10
    fallback_reason: str | None = None
    audits: list[BitComparison] = field(default_factory=list)
    audit_pending: bool = True            # step 1 is always audited
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    seconds_saved: float = 0.0
    recompute_timing: tuple[float, int] | None = None  # (seconds, tokens) of the latest recompute
    first_minibatch_exact: list[float] = field(default_factory=list)
    on_mismatch: str = "recompute"        # one of REACTIONS
    mismatches: int = 0                   # audits (incl. first minibatches) that found a differing bit

    def __post_init__(self):
        if self.on_mismatch not in REACTIONS:
            raise ValueError(f"on_mismatch must be one of {REACTIONS}, got {self.on_mismatch!r}")

    @property
    def reuse_allowed(self) -> bool:
        return not self.refusals

    @property
    def reuse_active(self) -> bool:
        return self.reuse_allowed and self.fallback_reason is None

    def audit_due(self, step: int) -> bool:
        """Step 0 (the first), every ``audit_every`` steps, or after an inconclusive audit."""
        if self.audit_pending:
            return True
        return self.audit_every > 0 and step % self.audit_every == 0

    def record_audit(self, result: BitComparison, step: int) -> None:
        self.audits.append(result)
        if not result.conclusive:
            self.audit_pending = True
            logger.info("areal-tik audit at step %d had no fresh tokens to compare; retrying next step",
                        step + 1)
            return
        self.audit_pending = False
        if result.identical:
            logger.info("areal-tik audit at step %d: %d/%d log-probs bitwise equal",
                        step + 1, result.num_identical, result.num_tokens)
        else:
            self.react(
                f"bitwise audit failed at step {step + 1}: {result.num_tokens - result.num_identical} of "
                f"{result.num_tokens} rollout log-probs differ from the trainer's recompute "
                f"(max |delta| {result.max_abs_delta:.3g}; first: {describe_mismatch(result)})")

    def react(self, reason: str) -> None:
        """A differing bit was found: do what ``on_mismatch`` says."""
        self.mismatches += 1
        if self.on_mismatch == "stop":
            message = f"areal-tik: stopping the run (actor.tik_on_mismatch=stop): {reason}"
            logger.error(message)
            raise ExactnessError(message)
        if self.on_mismatch == "warn":
            message = (f"areal-tik: {reason}. Reuse continues (actor.tik_on_mismatch=warn): the old "
                       f"log-probs of this run are not all the trainer's ({self.mismatches} mismatches so far)")
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        self.fall_back(reason)

    def fall_back(self, reason: str) -> None:
        """Switch the run to recompute for good and say so loudly."""
        if self.fallback_reason is not None:
            return
        self.fallback_reason = reason
        message = (f"areal-tik: switching this run to recomputing old log-probs permanently: {reason}. "
                   "Training continues with AReaL's recompute pass.")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def note_reuse(self, n_reused: int, n_recomputed: int, tokens_skipped: int) -> float:
        """Account one step's reuse; returns a lower bound of the recompute seconds saved.

        The latest audit's recompute ran ``tokens`` tokens in ``seconds``. A forward over the
        ``tokens_skipped`` tokens of the skipped pass takes at least ``seconds`` when it
        covers more tokens (it holds that subset) and is scaled down linearly when it
        covers fewer. Per-token extrapolation would overstate it: a small audit forward is
        mostly fixed cost (on the H200 it gave 977 s "saved" for a 20-step run whose stock
        recompute passes took 3 s in all).
        """
        self.tokens_reused += n_reused
        self.tokens_recomputed += n_recomputed
        saved = 0.0
        if self.recompute_timing is not None and tokens_skipped > 0:
            seconds, tokens = self.recompute_timing
            saved = seconds * min(1.0, tokens_skipped / max(tokens, 1))
        self.seconds_saved += saved
        return saved

    def verdict(self) -> str:
        if not self.reuse_allowed:
            return "reuse refused: " + "; ".join(self.refusals)
        if self.fallback_reason is not None:
            return "FELL BACK to recompute: " + self.fallback_reason
        passed = sum(a.identical for a in self.audits)
        if self.mismatches:
            return (f"{self.mismatches} audits found differing bits; reuse continued "
                    f"(on_mismatch={self.on_mismatch}), {passed} audits bitwise equal")
        if passed == 0:
            return "no conclusive audit yet"
        idle = self.inconclusive_audits
        # An audit that found no fresh (reused) tokens compares nothing: in an asynchronous run
        # every token after the first step can be stale, recomputed rather than reused.
        return f"all {passed} audits bitwise equal" + (
            f"; {idle} more found no fresh tokens to compare" if idle else "")

    @property
    def inconclusive_audits(self) -> int:
        return sum(not a.conclusive for a in self.audits)

    def summary(self) -> dict:
        tokens = sum(a.num_tokens for a in self.audits)
        equal = sum(a.num_identical for a in self.audits)
        return {
            "reuse_active": self.reuse_active,
            "verdict": self.verdict(),
            "audits": len(self.audits),
            "audits_inconclusive": self.inconclusive_audits,
            "audited_tokens": tokens,
            "audited_bitwise_fraction": equal / tokens if tokens else float("nan"),
            "tokens_reused": self.tokens_reused,
            "tokens_recomputed": self.tokens_recomputed,
            "recompute_seconds_saved": self.seconds_saved,
            "refusals": list(self.refusals),
            "fallback_reason": self.fallback_reason,
            "on_mismatch": self.on_mismatch,
            "mismatches": self.mismatches,
        }

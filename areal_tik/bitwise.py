"""The one bit comparison of log-probs: ``compare_bits``, used by ``areal-tik check``, the
adapter's audit and the tests.

Values are compared on integer views of their bits (``torch.equal`` semantics: -0.0 and
0.0 differ, so do NaN payloads); no tolerance. The float64 distance is reported beside
the verdict, never instead of it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from areal_tik.unified_kernels import bits


@dataclass(frozen=True)
class BitComparison:
    """Counts of a bit comparison over aligned rows.

    ``first_mismatch`` is ``(row, index within the row's compared values)`` of the first
    differing value and ``first_values`` its two values; both None when every compared
    value agrees (or, after a reduction over processes, when the first difference lies
    in another process).
    """

    num_tokens: int
    num_identical: int
    max_abs_delta: float
    first_mismatch: tuple[int, int] | None = None
    first_values: tuple[float, float] | None = None

    @property
    def fraction_identical(self) -> float:
        """Identical share of the compared values (NaN when nothing was compared)."""
        return self.num_identical / self.num_tokens if self.num_tokens else float("nan")

    @property
    def conclusive(self) -> bool:
        return self.num_tokens > 0

    @property
    def identical(self) -> bool:
        """At least one value compared, and every one bit-identical."""
        return self.conclusive and self.num_identical == self.num_tokens


def compare_bits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor] | None = None) -> BitComparison:
    """Compare row ``i`` of ``a`` with row ``i`` of ``b`` bit for bit, at ``masks[i]``
    (default: every position). ``b`` is cast to ``a``'s dtype and device first, so
    recorded fp32 log-probs compare with fp32 recomputed ones."""
    masks = [None] * len(a) if masks is None else list(masks)
    if not len(a) == len(b) == len(masks):
        raise ValueError(f"row lists differ in length: {len(a)}, {len(b)}, {len(masks)}")
    total = same = 0
    worst = 0.0
    first = values = None
    for row, (x, y, m) in enumerate(zip(a, b, masks)):
        x, y = x.reshape(-1), y.reshape(-1).to(dtype=x.dtype, device=x.device)
        if x.shape != y.shape or (m is not None and m.numel() != x.numel()):
            shapes = [tuple(x.shape), tuple(y.shape)] + ([] if m is None else [tuple(m.shape)])
            raise ValueError(f"row {row}: shapes differ: {shapes}")
        if m is not None:
            keep = m.reshape(-1).bool().to(x.device)
            x, y = x[keep], y[keep]
        equal = bits(x) == bits(y)
        total += x.numel()
        same += int(equal.sum())
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
        if first is None and not bool(equal.all()):
            k = int((~equal).nonzero()[0])
            first, values = (row, k), (x[k].item(), y[k].item())
    return BitComparison(total, same, worst, first, values)

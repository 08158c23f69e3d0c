"""Decode CUDA graphs: the plan (batch-size buckets x block-table widths), capture, replay.

A graph has static shapes, so a decode batch is padded to a bucket with rows that write
and read only the scratch block 0 (every op is row-invariant: the padding changes no bits
of the real rows), and its block table to a width. Graphs are captured largest first and
share one memory pool.

Widths: the unified decode kernel walks each row's K/V only up to its context length, so
the table's width costs nothing and one width (``max_blocks_per_seq``) serves every step:
one graph per bucket. The standard ops gather every position of the table they are given
(width x block size per row), so with that one width every step read ``max_model_len``
positions per row whatever the sequences held (13x the K/V needed in the SmolLM2 GRPO
run). For them the widths are 1, 2, 4, ... blocks and ``max_blocks_per_seq``, and a step
replays the graph of the smallest width that holds its longest block table: at most twice
the blocks its longest sequence holds, never all of ``max_model_len``.
"""
from __future__ import annotations

import bisect
import warnings

import torch


def graph_buckets(max_bs: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then multiples of 16, and ``max_bs`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


def table_widths(max_blocks: int, kernels: str | None) -> tuple[int, ...]:
    """Captured block-table widths: powers of two below ``max_blocks`` and ``max_blocks``
    for the standard ops (they read the whole table), ``max_blocks`` alone otherwise."""
    if kernels != "standard":
        return (max_blocks,)
    widths = []
    width = 1
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return tuple(widths + [max_blocks])


def smallest_holding(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest of the sorted ``sizes`` that is >= ``n``, or None above the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The plan and the captured graphs, keyed by (bucket, width). With no capture (CPU,
    ``cuda_graphs`` off, a failed capture) the plan still says which graph a step would
    replay on a GPU; ``replay`` is then never called."""

    def __init__(self, sizes: tuple[int, ...], widths: tuple[int, ...]):
        self.sizes = tuple(sizes)
        self.widths = tuple(widths)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.replays = 0  # decode steps served by a graph

    def bucket(self, batch: int) -> int | None:
        return smallest_holding(self.sizes, batch)

    def key(self, bucket: int | None, blocks: int) -> tuple[int, int] | None:
        """The captured graph for ``bucket`` rows whose longest table has ``blocks`` blocks, or None."""
        key = (bucket, smallest_holding(self.widths, blocks))
        return key if key in self.graphs else None

    def capture(self, decode, inputs_for, device: torch.device, agree=None) -> None:
        """Capture every (bucket, width), largest first: ``decode(**inputs_for(bucket, width))``
        runs the model's decode on the staging buffer's device views (the graph's inputs).

        ``agree(ok) -> bool`` (tensor parallel): whether every rank's capture succeeded. A
        bucket's warm-up decode gathers across ranks, so every rank captures the same graphs
        or none does (a rank going on alone would hang)."""
        pool = failure = None
        ok = True
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                for width in reversed(self.widths):
                    try:
                        pool = self._capture_one(decode, inputs_for(bs, width), (bs, width), pool, device)
                    except RuntimeError as exc:  # e.g. an op that syncs or allocates outside the pool
                        failure = exc
                    ok = failure is None if agree is None else agree(failure is None)
                    if not ok:
                        break
                if not ok:
                    break
        if not ok:
            why = failure if failure is not None else "it failed on another tensor-parallel rank"
            warnings.warn(f"CUDA graph capture failed, decoding eagerly: {why}", RuntimeWarning, stacklevel=3)
            self.graphs.clear()
            self.outputs.clear()
        torch.cuda.synchronize(device)

    def _capture_one(self, decode, inputs: dict, key: tuple[int, int], pool, device):
        for _ in range(2):  # warm-up: compiles kernels for this shape (twice: a torch.compile'd
            decode(**inputs)  # op of a custom kernel set may specialise again on its second call)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[key] = decode(**inputs)
        self.graphs[key] = graph
        return graph.pool() if pool is None else pool

    def replay(self, key: tuple[int, int], batch: int):
        """Replay graph ``key`` (its inputs already staged); the first ``batch`` rows of its
        output (of each, when the captured function returned a tuple)."""
        self.graphs[key].replay()
        self.replays += 1
        out = self.outputs[key]
        return tuple(t[:batch] for t in out) if isinstance(out, tuple) else out[:batch]

"""Bitwise assertions used across the contract suite (``compare_bits``, the project's one
bit comparison of log-prob rows, is re-exported from ``areal_tik.bitwise``)."""
import torch

from areal_tik.bitwise import compare_bits  # noqa: F401
from areal_tik.unified_kernels import bits


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Assert equal bits with torch.equal on integer views; report the first difference."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.equal(bits(a), bits(b)):
        return
    diff = (bits(a) != bits(b)).nonzero()
    first = tuple(diff[0].tolist())
    raise AssertionError(
        f"{what}: {diff.shape[0]} of {a.numel()} elements differ in bits; first at {first}: "
        f"{a[first].item()!r} vs {b[first].item()!r}"
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def ulp_distance(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of ``out.dtype`` (0 = same bits).

    ``ref`` (e.g. a float64 oracle) is rounded to ``out.dtype`` first; +0 and -0 count as
    equal. Bits are mapped to a monotone integer line, so 1 means adjacent values.
    """
    ref = ref.to(out.dtype)
    width = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}[out.dtype]
    mask = (1 << (width - 1)) - 1

    def line(t):
        i = bits(t).to(torch.int64)
        mag = i & mask
        return torch.where(i < 0, -mag, mag)

    return (line(out) - line(ref)).abs()

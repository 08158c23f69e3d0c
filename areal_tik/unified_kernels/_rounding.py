"""Round-to-nearest-even casts that behave the same on the GPU and in the interpreter.

On the GPU, ``x.to(tl.bfloat16)`` is ``cvt.rn.bf16.f32``: round to nearest, ties to even,
exactly what torch's ``.to(torch.bfloat16)`` does. The Triton interpreter (triton 3.6)
truncates instead, so CPU tests would see 1-ulp errors on half the elements. Kernels
call ``cast_rne(x, dtype, EMULATE)`` with ``EMULATE = _common.interpreting()``: on the
GPU it is the plain cast; under the interpreter the rounding is done with integer ops
on the fp32 bits and the result is bit-cast (the interpreter's float conversion also
mishandles subnormals, so it is avoided altogether).
"""
import triton
import triton.language as tl


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (round to nearest, ties to even)."""
    if EMULATE and DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        # Add half an ulp of bf16 (minus one when the kept lsb is 0: ties go to even),
        # then keep the 16 high bits. Overflow to inf is the correct result; NaN maps
        # to the canonical quiet NaN 0x7FC0, as torch's conversion does.
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(DTYPE, bitcast=True)
    else:
        return x.to(DTYPE)

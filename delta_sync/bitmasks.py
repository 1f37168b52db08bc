"""Compiled comparisons of 64 bf16 elements at once, into one 64-bit mask.

numba compiles loops over array elements one element at a time; these intrinsics hand LLVM
a comparison of a whole vector of 64 int16 lanes instead (or 64 int32 lanes of fp32 bits,
rounded to bf16 in the vector), which it lowers to a few SIMD instructions (on x86-64 with
AVX2: compare, pack, `vpmovmskb`) on any target it supports.
The compiled passes of [`delta_sync.sparse`] and [`delta_sync.compact`] count and locate
elements through these masks and `popcount`, rather than element by element; where the
machine has a fast one, [`deposit`] places a run of bits onto a mask's set bits.

Call them from `numba.njit` functions only, with `start + 64 <= array.size`: they read 64
elements from `start` without bounds checks.

Example:
    ```python
    >>> @numba.njit
    ... def count_at_least(bits, exponent):
    ...     limits = (np.int16((exponent << 7) - 1),)
    ...     return sum(popcount(above(bits, start, limits)[0]) for start in range(0, bits.size - 63, 64))
    ```
"""

from __future__ import annotations

import numba
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

__all__ = ["FAST_BIT_GATHER", "LANES", "above", "deposit", "differ", "differ_rounded", "popcount"]

#: Elements compared per mask.
LANES = 64

_VECTOR = ir.VectorType(ir.IntType(16), LANES)
_WORDS = ir.VectorType(ir.IntType(32), LANES)


def _contiguous(array, dtype=types.int16) -> bool:
    """Whether a numba type is a contiguous 1-D array of `dtype`: the lanes are read as one vector."""
    return isinstance(array, types.Array) and array.dtype == dtype and array.ndim == 1 and array.layout == "C"


def _load(context, builder, array_type, array, start, vector=_VECTOR):
    """The 64 lanes of `array` from `start`, as an LLVM vector (unaligned load)."""
    data = context.make_array(array_type)(context, builder, value=array).data
    pointer = builder.bitcast(builder.gep(data, [start]), vector.as_pointer())
    return builder.load(pointer, align=vector.element.width // 8)


def _splat(builder, value):
    """An int16 value in all 64 lanes."""
    lanes = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(
        lanes, ir.Constant(_VECTOR, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
    )


def _to_mask(builder, lanes):
    return builder.bitcast(lanes, ir.IntType(LANES))


@intrinsic
def above(typingctx, bits, start, limits):
    """Per limit in the tuple `limits` (int16s from 0 to 0x7FFF), the mask of the 64 bf16
    elements from `start` whose magnitude (bits with the sign cleared) is above it: with
    `limit = (exponent << 7) - 1`, those whose exponent is at least `exponent`; a limit of
    0x7FFF marks none. The elements are read once for all the limits."""
    if not _contiguous(bits) or not (isinstance(limits, types.UniTuple) and limits.dtype == types.int16):
        return None
    signature = types.UniTuple(types.uint64, limits.count)(bits, types.intp, limits)

    def codegen(context, builder, sig, args):
        magnitudes = builder.and_(
            _load(context, builder, sig.args[0], args[0], args[1]), ir.Constant(_VECTOR, [0x7FFF] * LANES)
        )
        masks = [
            _to_mask(builder, builder.icmp_signed(">", magnitudes, _splat(builder, builder.extract_value(args[2], i))))
            for i in range(limits.count)
        ]
        return context.make_tuple(builder, sig.return_type, masks)

    return signature, codegen


@intrinsic
def differ(typingctx, first, second, start):
    """Bit `k` set where int16 element `start + k` of the two arrays differs."""
    if not (_contiguous(first) and _contiguous(second)):
        return None
    signature = types.uint64(first, second, types.intp)

    def codegen(context, builder, sig, args):
        one = _load(context, builder, sig.args[0], args[0], args[2])
        other = _load(context, builder, sig.args[1], args[1], args[2])
        return _to_mask(builder, builder.icmp_unsigned("!=", one, other))

    return signature, codegen


@intrinsic
def differ_rounded(typingctx, words, bits, start, nan_bits):
    """Bit `k` set where fp32 element `start + k` of `words` (its bits, as int32), rounded to
    bf16, differs from int16 element `start + k` of `bits`.

    Rounding is to nearest, ties to even, as `tensor.to(torch.bfloat16)` rounds; every NaN
    becomes the one bf16 pattern `nan_bits` (an int16), as torch's conversion gives it.
    """
    if not (_contiguous(words, types.int32) and _contiguous(bits)) or nan_bits != types.int16:
        return None
    signature = types.uint64(words, bits, types.intp, types.int16)

    def codegen(context, builder, sig, args):
        word = _load(context, builder, sig.args[0], args[0], args[2], _WORDS)

        def splat(value):
            return ir.Constant(_WORDS, [value] * LANES)

        # (word + 0x7FFF + lowest kept bit) >> 16: cannot wrap below the NaNs, which are replaced.
        kept = builder.and_(builder.lshr(word, splat(16)), splat(1))
        rounded = builder.trunc(builder.lshr(builder.add(builder.add(word, splat(0x7FFF)), kept), splat(16)), _VECTOR)
        nan = builder.icmp_signed(">", builder.and_(word, splat(0x7FFFFFFF)), splat(0x7F800000))
        bf16 = builder.select(nan, _splat(builder, args[3]), rounded)
        other = _load(context, builder, sig.args[1], args[1], args[2])
        return _to_mask(builder, builder.icmp_unsigned("!=", bf16, other))

    return signature, codegen


@intrinsic
def popcount(typingctx, mask):
    """Set bits of a uint64."""
    if mask != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


def _fast_bit_gather() -> bool:
    """Whether [`deposit`] compiles to one fast instruction here: x86-64 with BMI2 (`pdep`),
    numba compiling for this machine's CPU, and not AMD Zen 1 or 2, where it is microcoded
    and takes up to hundreds of cycles."""
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    if binding.get_host_cpu_name() in ("znver1", "znver2"):
        return False
    return bool(binding.get_host_cpu_features().get("bmi2", False))


#: Whether [`deposit`] may be called: callers keep a path without it for other machines.
FAST_BIT_GATHER = _fast_bit_gather()


def _bmi2(name: str):
    """The code of an x86-64 BMI2 instruction of two 64-bit words, by its LLVM intrinsic's name."""

    def codegen(context, builder, sig, args):
        word = ir.IntType(64)
        function = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(word, [word, word]))
        return builder.call(function, args)

    return codegen


@intrinsic
def deposit(typingctx, bits, mask):
    """The low bits of `bits` (uint64) placed, in order, at the set bits of `mask`: bit `k`
    of `bits` lands on the `k`-th set bit of `mask` (x86-64 BMI2 `pdep`). Only where
    `FAST_BIT_GATHER`: elsewhere it does not compile."""
    if bits != types.uint64 or mask != types.uint64:
        return None
    return types.uint64(types.uint64, types.uint64), _bmi2("llvm.x86.bmi.pdep.64")

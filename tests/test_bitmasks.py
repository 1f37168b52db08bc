"""The vector comparisons behind the compiled passes, bit for bit against numpy."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from delta_sync.bitmasks import LANES, above, differ, differ_rounded, popcount

pytestmark = pytest.mark.timeout(120)


@numba.njit
def above_masks(bits, limits):
    """Per limit, a row of the masks of every 64 elements."""
    starts = range(0, bits.size - LANES + 1, LANES)
    masks = np.empty((len(limits), len(starts)), np.uint64)
    for column, start in enumerate(starts):
        found = above(bits, start, limits)
        for row in range(len(limits)):
            masks[row, column] = found[row]
    return masks


@numba.njit
def differ_masks(first, second):
    return np.array([differ(first, second, start) for start in range(0, first.size - LANES + 1, LANES)])


@numba.njit
def differ_rounded_masks(words, bits, nan_bits):
    return np.array([differ_rounded(words, bits, start, nan_bits) for start in range(0, bits.size - LANES + 1, LANES)])


@numba.njit
def popcounts(masks):
    return np.array([popcount(mask) for mask in masks])


def packed(flags: np.ndarray) -> np.ndarray:
    """Each row of 64 booleans as a uint64, element k in bit k."""
    return np.packbits(flags.reshape(-1, LANES), axis=1, bitorder="little").view("<u8").reshape(-1)


def every_bit_pattern(offset: int) -> np.ndarray:
    """All 65,536 bf16 bit patterns (NaNs, infinities, -0.0, subnormals included), shuffled,
    in a view that starts `offset` elements into its buffer."""
    patterns = np.random.default_rng(offset).permutation(np.arange(-32768, 32768, dtype=np.int32)).astype(np.int16)
    buffer = np.empty(patterns.size + offset, np.int16)
    buffer[offset:] = patterns
    return buffer[offset:]


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_above_marks_the_magnitudes_above_each_limit_from_one_read(offset):
    bits = every_bit_pattern(offset)
    # Exponent boundaries (`(exponent << 7) - 1`), any magnitude, and 0x7FFF, which marks none.
    limits = tuple(np.int16(limit) for limit in (127, (100 << 7) - 1, (117 << 7) - 1, 16300, (255 << 7) - 1, 0, 0x7FFF))
    masks = above_masks(bits, limits)
    for row, limit in enumerate(limits):
        assert np.array_equal(masks[row], packed((bits.astype(np.int32) & 0x7FFF) > int(limit))), limit
    assert not masks[-1].any()


@pytest.mark.parametrize("offset", [0, 2])
def test_differ_marks_every_bitwise_difference(offset):
    first = every_bit_pattern(offset)
    second = first.copy()
    rng = np.random.default_rng(7)
    second[rng.random(second.size) < 0.03] ^= np.int16(1)  # one ULP
    second[rng.random(second.size) < 0.01] ^= np.int16(-0x8000)  # the sign alone: 0.0 against -0.0
    expected = packed(first != second)
    assert np.array_equal(differ_masks(first, second), expected)
    assert np.array_equal(differ_masks(first, first), np.zeros_like(expected))


def torch_bf16_bits(words: np.ndarray) -> np.ndarray:
    return torch.from_numpy(words).view(torch.float32).to(torch.bfloat16).view(torch.int16).numpy()


@pytest.mark.parametrize("offset", [0, 5])
def test_differ_rounded_rounds_as_torch_does(offset):
    # Every bf16 pattern as the high half, with the low halves where rounding turns: exact,
    # just below, at and just above the tie, and the top; NaNs of every sign and payload.
    highs = every_bit_pattern(0).astype(np.int32) << 16
    lows = np.array([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.int32)
    words = np.empty(highs.size * lows.size + offset, np.int32)[offset:]
    words[:] = (highs[:, None] | lows[None, :]).reshape(-1)
    rounded = torch_bf16_bits(words)
    nan_bits = np.int16(torch_bf16_bits(np.array([0x7FC00000], np.int32))[0])
    assert np.array_equal(differ_rounded_masks(words, rounded, nan_bits), np.zeros(words.size // LANES, np.uint64))
    snapshot = rounded.copy()
    rng = np.random.default_rng(offset)
    snapshot[rng.random(snapshot.size) < 0.03] ^= np.int16(1)
    snapshot[rng.random(snapshot.size) < 0.01] ^= np.int16(-0x8000)
    expected = packed((rounded != snapshot)[: words.size - words.size % LANES])
    assert np.array_equal(differ_rounded_masks(words, snapshot, nan_bits), expected)


def test_popcount_counts_set_bits():
    masks = np.random.default_rng(1).integers(0, 2**64, 1000, dtype=np.uint64)
    masks[:3] = [0, 2**64 - 1, 2**63]
    assert popcounts(masks).tolist() == [bin(int(mask)).count("1") for mask in masks]


def test_a_strided_array_is_refused_at_compile_time():
    bits = np.arange(256, dtype=np.int16)[::2]
    with pytest.raises(numba.TypingError, match=r"above\(array\(int16, 1d, A\)"):  # A: any layout, strided
        above_masks(bits, (np.int16(127),))
    with pytest.raises(numba.TypingError, match=r"differ_rounded\(array\(int32, 1d, A\)"):
        differ_rounded_masks(np.arange(256, dtype=np.int32)[::2], bits, np.int16(-1))

"""A table-driven range ANS (rANS) entropy coder, compiled with numba, that releases the GIL.

The coder codes a sequence of symbols, each with its own model: a static frequency table
(integer frequencies summing to `2^PRECISION`, see [`quantize`] and [`cumulative`]) or
raw bits (a uniform symbol of up to `MAX_RAW_BITS` bits). Symbol `i` of the sequence goes
to lane `i % lanes` (`lanes` from 1 to `LANES`, 4, as the caller chooses): the lanes are
independent coder states that share one word stream, so a CPU overlaps the arithmetic of
consecutive symbols.

Each state is 64 bits wide and kept in `[2^31, 2^63)`; it moves out and in 32 bits at a
time, so coding one symbol emits (or reads) at most one word. The stream, uint32 words,
is: the `lanes` final encoder states (low word, then high word, lane 0 first), then the
words the decoder reads as it goes. The encoder starts every lane at `2^31`, so a decoder
that reaches the end of the symbols must find every lane back at `2^31` with no word
left: a truncated or extended stream, and almost every altered one, fails that check (or
an earlier one). Raw bits carry no redundancy: one changed among them decodes to another
value, so callers check what they decode (a delta's checksums do).

Every function here is compiled (`nogil=True`, cached on disk), so numba code calls them
directly; the decoding ones return an error code (`OK` on success, see [`error_message`])
rather than raise, so compiled callers can stop and report. [`encode`] and [`Decoder`]
are the Python entry points; a compiled caller that makes its symbols as it goes puts them
to the coder one at a time, last to first ([`encoder_start`], [`encoder_put`],
[`encoder_finish`]), with no arrays of them in between.

The costs of a symbol are kept off its lane's chain of dependent operations, so that the
lanes overlap: the encoder divides by a float multiplication with an exact integer
correction (a 64-bit division takes tens of cycles and does not overlap with the next);
both sides renormalize without a branch on the data (whether a state moves a word is a
coin toss per symbol); and the run decoders ([`decode_symbols`], [`decode_pairs`],
[`decode_bit_run`]) keep the lanes' states in registers for a whole run of symbols.

Frequencies are built with exact integer arithmetic only ([`quantize`]): the trainer and
every replica build the same tables on any machine.

Example:
    ```python
    >>> freqs = quantize(np.array([700, 200, 100]), np.ones(3, np.bool_))
    >>> table = cumulative(freqs)
    >>> words = encode(*table_symbols(table, np.array([0, 0, 2, 1])))
    >>> decoder = Decoder(words)
    >>> decoder.symbols(table, 4)
    array([0, 0, 2, 1])
    >>> decoder.finish()
    ```
"""

from __future__ import annotations

import numba
import numpy as np

from .compile_cache import njit_cached
from .errors import FormatError

__all__ = [
    "LANES",
    "MAX_RAW_BITS",
    "PRECISION",
    "Decoder",
    "cumulative",
    "encode",
    "error_message",
    "quantize",
    "table_symbols",
]

# numba's disk cache keys each function on its own file only: compiled callers in other
# modules (delta_sync.compact) inline these functions, so after an edit here their cache
# (`__pycache__/numba-*/compact.*.nbi`, `.nbc`) must be cleared by hand; installed releases are unaffected.

#: Bits of every frequency table's total: frequencies sum to `2^PRECISION`.
PRECISION = 16
#: Interleaved coder states, at most (and by default).
LANES = 4
#: Bits of the slot that [`lookup`] indexes.
LOOKUP_BITS = 10
#: Widest raw-bits symbol.
MAX_RAW_BITS = 24
# States live in [_LOW, _LOW << 32).
_LOW = np.int64(1) << np.int64(31)
_WORD_MASK = (np.int64(1) << np.int64(32)) - np.int64(1)

#: Error codes of the compiled decoder.
OK = 0
ENDS_EARLY = 1
BAD_START = 2
NOT_FINISHED = 3
WORDS_LEFT = 4
BAD_TABLE = 5
BAD_LANES = 6
_MESSAGES = {
    ENDS_EARLY: "the entropy-coded data ends before the last symbol",
    BAD_START: "an initial coder state is out of range",
    NOT_FINISHED: "the coder does not end in its initial state",
    WORDS_LEFT: "words are left over after the last symbol",
    BAD_TABLE: "a frequency table is malformed",
    BAD_LANES: f"the coder's lane count is not 1 to {LANES}",
}


def error_message(code: int) -> str:
    """What decoder error `code` means, worded to follow `"{tensor}: "`; "the stream is damaged" appended."""
    return f"{_MESSAGES.get(code, f'error {code}')}; the stream is damaged"


# -- tables ----------------------------------------------------------------------------------


@njit_cached(nogil=True)
def quantize(weights: np.ndarray, possible: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to `2^PRECISION` from non-negative integer `weights`.

    Every possible symbol gets at least 1 (so any of them can be coded, however small its
    weight), the others 0: `freq = 1 + weight * (2^PRECISION - possible) // total` over the
    possible symbols, and what the floors leave goes to the first of largest weight. Exact
    integer arithmetic: the same table on every machine.

    Args:
        weights: int64, one per symbol, each below 2^40.
        possible: bool, one per symbol: whether it can occur (at most `2^PRECISION` of them,
            at least one).

    Returns:
        int64 frequencies; an empty array when the inputs break these limits.
    """
    n = weights.size
    total = np.int64(0)
    count = np.int64(0)
    best = -1
    for s in range(n):
        if possible[s]:
            if weights[s] < 0 or weights[s] >= np.int64(1) << np.int64(40):
                return np.zeros(0, np.int64)
            total += weights[s]
            count += 1
            if best < 0 or weights[s] > weights[best]:
                best = s
    target = np.int64(1) << np.int64(PRECISION)
    freqs = np.zeros(n, np.int64)
    if count == 0 or count > target:
        return np.zeros(0, np.int64)
    spare = target - count
    used = np.int64(0)
    for s in range(n):
        if possible[s]:
            share = weights[s] * spare // total if total > 0 else np.int64(0)
            freqs[s] = 1 + share
            used += freqs[s]
    freqs[best] += target - used
    return freqs


@njit_cached(nogil=True)
def cumulative(freqs: np.ndarray) -> np.ndarray:
    """The table a model codes with: `table[s]` is the sum of the frequencies below `s`
    (`table[-1] == 2^PRECISION` for a valid table).

    Args:
        freqs: int64 frequencies (from [`quantize`]).
    """
    table = np.zeros(freqs.size + 1, np.int64)
    for s in range(freqs.size):
        table[s + 1] = table[s] + freqs[s]
    return table


@njit_cached(nogil=True)
def table_symbols(table: np.ndarray, symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(starts, freqs, scales)` for [`encode`] of `symbols` coded with `table`.

    Args:
        table: A [`cumulative`] table.
        symbols: Symbols in `[0, table.size - 1)`, each of non-zero frequency.
    """
    starts = np.empty(symbols.size, np.int64)
    freqs = np.empty(symbols.size, np.int64)
    scales = np.full(symbols.size, PRECISION, np.int64)
    for i in range(symbols.size):
        starts[i] = table[symbols[i]]
        freqs[i] = table[symbols[i] + 1] - table[symbols[i]]
    return starts, freqs, scales


# -- encoder ---------------------------------------------------------------------------------


@numba.njit(inline="always")
def _rotate(a, b, c, d, lanes):
    """The lanes' states after one symbol: the next lane's first, for `lanes` from 1 to 4."""
    if lanes == 4:
        return b, c, d, a
    if lanes == 3:
        return b, c, a, d
    if lanes == 2:
        return b, a, c, d
    return a, b, c, d


@numba.njit(inline="always")
def _divide(state, freq, scale):
    """`(state // freq, state % freq)` for a state the encoder has renormalized (below
    `freq << (63 - scale)`, so the quotient is below `2^(63 - scale)`).

    A 64-bit integer division takes tens of cycles and does not overlap with the next; where
    the quotient is below 2^51 (`scale` at least 12, as every table symbol's is), one float
    multiplication gets within one of it (relative error below 2^-51), and one integer
    correction makes it exact.
    """
    if scale < 12:
        quotient = state // freq
        return quotient, state - quotient * freq
    quotient = np.int64(np.float64(state) * (1.0 / np.float64(freq)))
    remainder = state - quotient * freq
    if remainder < 0:
        quotient -= 1
        remainder += freq
    elif remainder >= freq:
        quotient += 1
        remainder -= freq
    return quotient, remainder


@njit_cached(nogil=True)
def encode(starts: np.ndarray, freqs: np.ndarray, scales: np.ndarray, lanes: int = LANES) -> np.ndarray:
    """The words that code symbol `i` as the range `[starts[i], starts[i] + freqs[i])` out of
    `2^scales[i]`, for every `i`, in the order a decoder reads them.

    A table symbol has `scales[i] == PRECISION`; a raw `b`-bit value `v` is `(v, 1, b)`.
    Compiled callers that make their symbols as they go put them one at a time instead
    ([`encoder_start`]).

    Args:
        starts: int64 range starts.
        freqs: int64 range sizes, each at least 1 and `starts[i] + freqs[i] <= 2^scales[i]`.
        scales: int64 bits of each symbol's total, 0 to 31.
        lanes: Interleaved states, 1 to `LANES` (each costs 2 words: few symbols want one).

    Returns:
        uint32 words (the layout in the module's docstring).
    """
    out, run = encoder_start(starts.size, lanes)
    # One loop per lane count, each compiled with its count as a constant: the rotation of
    # the states is then register moves, not a branch per symbol.
    if lanes == 4:
        run = _encode_symbols(starts, freqs, scales, out, run, 4)
    elif lanes == 3:
        run = _encode_symbols(starts, freqs, scales, out, run, 3)
    elif lanes == 2:
        run = _encode_symbols(starts, freqs, scales, out, run, 2)
    else:
        run = _encode_symbols(starts, freqs, scales, out, run, 1)
    return encoder_finish(out, run, lanes)


@numba.njit(inline="always")
def _encode_symbols(starts, freqs, scales, out, run, lanes):
    # The run's fields in locals through the loop: numba compiles a tuple carried from one
    # iteration to the next to code that took 1.5x as long a symbol.
    a, b, c, d, at = run
    for k in range(starts.size):
        # Unsigned indices: numba checks a signed one for a negative value on every access.
        i = np.uint64(starts.size - 1 - k)
        a, b, c, d, at = encoder_put(out, (a, b, c, d, at), starts[i], freqs[i], scales[i], lanes)
    return a, b, c, d, at


# An encoder's position is a run `(a, b, c, d, at)`: `a` the state of the next symbol's lane
# (symbols go last to first, so the lanes after it are those below it: symbol i's is
# i % lanes), `b`, `c`, `d` those of the lanes before it, and where in `out` the last word
# written starts. All lanes start at _LOW, so which is which needs no setting up.


@numba.njit(inline="always")
def encoder_start(symbols, lanes):
    """`(out, run)`: the words of an encoder for at most `symbols` symbols on `lanes` states,
    and its run before the last symbol; put the symbols last to first ([`encoder_put`])."""
    # Each symbol emits at most one word (a state below 2^63 shifted once is below 2^31).
    out = np.empty(symbols + 2 * lanes, np.uint32)
    return out, (_LOW, _LOW, _LOW, _LOW, np.uint64(out.size))


@numba.njit(inline="always")
def encoder_put(out, run, start, freq, scale, lanes):
    """The run after coding the symbol before those already put (as [`encode`] codes
    `(start, freq, scale)`), with `lanes` a constant where the caller can make it one."""
    a, b, c, d, at = run
    freq = np.int64(freq)
    scale = np.int64(scale)
    # state >= ((2^31 >> scale) << 32) * freq, which would overflow where freq == 2^scale.
    # The word is written whether or not it is emitted: an unemitted one is overwritten.
    emit = (a >> np.int64(32)) >= (_LOW >> scale) * freq
    out[at - np.uint64(1)] = np.uint32(a & _WORD_MASK)
    at -= np.uint64(emit)
    state = (a >> np.int64(32)) if emit else a
    if freq == 1:  # raw bits: no division
        a = (state << scale) + np.int64(start)
    else:
        quotient, remainder = _divide(state, freq, scale)
        a = (quotient << scale) + remainder + np.int64(start)
    a, b, c, d = _rotate(a, b, c, d, lanes)
    return a, b, c, d, at


@numba.njit(inline="always")
def encoder_finish(out, run, lanes):
    """The words of an encoder whose every symbol was put: the final states, then the words."""
    a, b, c, d, at = run
    at = np.int64(at)
    states = (a, b, c, d)  # now those of lanes `lanes - 1`, `lanes - 2`, ...
    for lane in range(lanes):
        at -= 2
        out[at] = np.uint32(states[lane] & _WORD_MASK)
        out[at + 1] = np.uint32(states[lane] >> np.int64(32))
    return out[at:].copy()


# -- decoder ---------------------------------------------------------------------------------
#
# A decoder's position is an int64 array `ctx`: the next word, the lane of the next symbol
# (symbol i's is i % lanes, kept rather than divided for), the number of lanes, then the
# lanes' states.

_WORD = 0
_LANE = 1
_LANES = 2
_STATES = 3


@njit_cached(nogil=True)
def decoder_start(words: np.ndarray, lanes: int = LANES) -> tuple[np.ndarray, int]:
    """`(ctx, error)`: a decoder positioned at the first symbol of `words`, coded with `lanes` states."""
    ctx = np.zeros(_STATES + LANES, np.int64)
    if lanes < 1 or lanes > LANES:
        return ctx, BAD_LANES
    if words.size < 2 * lanes:
        return ctx, ENDS_EARLY
    for lane in range(lanes):
        state = np.int64(words[2 * lane]) | (np.int64(words[2 * lane + 1]) << np.int64(32))
        if state < _LOW or (state >> np.int64(32)) >= _LOW:
            return ctx, BAD_START
        ctx[_STATES + lane] = state
    ctx[_WORD] = 2 * lanes
    ctx[_LANES] = lanes
    return ctx, OK


@njit_cached(nogil=True)
def lookup(table: np.ndarray) -> np.ndarray:
    """Where the decoder starts its search for a slot's symbol: for each `2^LOOKUP_BITS`-th
    of the range, the symbol its first slot falls in.

    Args:
        table: A [`cumulative`] table.
    """
    starts = np.zeros(1 << LOOKUP_BITS, np.int32)
    symbol = 0
    for j in range(starts.size):
        slot = np.int64(j) << np.int64(PRECISION - LOOKUP_BITS)
        while symbol < table.size - 2 and table[symbol + 1] <= slot:
            symbol += 1
        starts[j] = symbol
    return starts


# The decoder's steps take scalars only: the run decoders below index the arrays themselves.
# An array handed to a compiled helper inside a loop is reference-counted at each call (two
# atomic operations a symbol, which doubled the time of a run where numba could not prune them).


@numba.njit(inline="always")
def _refill(state, at, word, size):
    """`(state, at, overrun)`: the state with `word`, the stream's word at `at` (of `size`;
    its last word if `at` is past the end), read in if the state fell below `2^31`.

    Without a branch on the data (whether a state needs a word is a coin toss per symbol,
    which a CPU mispredicts half the time): the caller reads the word in any case, at an
    index kept inside the stream, and `overrun` is set where the stream had no word left to give."""
    need = state < _LOW
    overrun = need and at >= size
    state = ((state << np.int64(32)) | np.int64(word)) if need else state
    return state, at + np.int64(need), overrun


@numba.njit(inline="always")
def _table_state(state, slot, low, high):
    """The state before the symbol whose range `[low, high)` holds `slot`, the state's low
    `PRECISION` bits.

    state >> PRECISION < 2^(63 - PRECISION) and slot - low < freq <= 2^PRECISION: no
    overflow, and the result is at least 1, so one word brings it back to [2^31, 2^63)."""
    return (high - low) * (state >> np.int64(PRECISION)) + slot - low


_SLOT_MASK = (np.int64(1) << np.int64(PRECISION)) - np.int64(1)
_LOOKUP_SHIFT = np.int64(PRECISION - LOOKUP_BITS)


# The run decoders below keep the lanes' states in local variables (registers) for a whole
# run of symbols rather than in `ctx` per symbol, where each symbol's state would wait on
# the store of the one before. A run is `(a, b, c, d, at, overrun)`: `a` the state of the
# next symbol's lane, `b`, `c`, `d` those of the lanes after it (rotated after every
# symbol), the next word, and whether the stream ran out of words. A table symbol is the
# `s` with `table[s] <= slot < table[s + 1]`, searched up from `starts[slot >> _LOOKUP_SHIFT]`
# (zero frequencies are never found); indices are unsigned, which numba does not check
# for a negative value on every access.


@numba.njit(inline="always")
def _start_run(ctx):
    lanes = ctx[_LANES]
    lane = ctx[_LANE]
    return (
        ctx[_STATES + lane],
        ctx[_STATES + (lane + 1) % lanes],
        ctx[_STATES + (lane + 2) % lanes],
        ctx[_STATES + (lane + 3) % lanes],
        ctx[_WORD],
        False,
    )


@numba.njit(inline="always")
def _end_run(ctx, run, decoded):
    """Write the run's states back into `ctx` after `decoded` symbols: an error code."""
    a, b, c, d, at, overrun = run
    if overrun:
        return ENDS_EARLY
    lanes = ctx[_LANES]
    lane = (ctx[_LANE] + decoded) % lanes  # the lane of `a` now
    states = (a, b, c, d)
    for i in range(lanes):
        ctx[_STATES + (lane + i) % lanes] = states[i]
    ctx[_LANE] = lane
    ctx[_WORD] = at
    return OK


@njit_cached(nogil=True, inline="always")
def decode_symbols(ctx: np.ndarray, words: np.ndarray, table: np.ndarray, starts: np.ndarray, out: np.ndarray) -> int:
    """Decode `out.size` symbols coded with the [`cumulative`] `table` (trusted: built by this
    module), whose [`lookup`] is `starts`, into `out`: an error code."""
    # The laned streams, compiled with their lane count as a constant (see [`encode`]).
    if ctx[_LANES] == LANES:
        return _decode_symbols(ctx, words, table, starts, out, LANES)
    return _decode_symbols(ctx, words, table, starts, out, ctx[_LANES])


@numba.njit(inline="always")
def _decode_symbols(ctx, words, table, starts, out, lanes):
    a, b, c, d, at, overrun = _start_run(ctx)
    last = words.size - 1
    for i in range(out.size):
        slot = a & _SLOT_MASK
        symbol = np.int64(starts[slot >> _LOOKUP_SHIFT])
        while table[np.uint64(symbol + 1)] <= slot:
            symbol += 1
        a = _table_state(a, slot, table[np.uint64(symbol)], table[np.uint64(symbol + 1)])
        a, at, bad = _refill(a, at, words[np.uint64(min(at, last))], words.size)
        overrun |= bad
        out[i] = symbol
        a, b, c, d = _rotate(a, b, c, d, lanes)
    return _end_run(ctx, (a, b, c, d, at, overrun), out.size)


@njit_cached(nogil=True, inline="always")
def decode_pairs(
    ctx: np.ndarray,
    words: np.ndarray,
    first: np.ndarray,
    first_starts: np.ndarray,
    second: np.ndarray,
    second_starts: np.ndarray,
    first_out: np.ndarray,
    second_out: np.ndarray,
) -> int:
    """Decode `first_out.size` pairs of symbols, coded alternately with the [`cumulative`]
    tables `first` and `second` (trusted, with their [`lookup`]s), into `first_out` and
    `second_out`: an error code."""
    if ctx[_LANES] == LANES:
        return _decode_pairs(ctx, words, first, first_starts, second, second_starts, first_out, second_out, LANES)
    return _decode_pairs(ctx, words, first, first_starts, second, second_starts, first_out, second_out, ctx[_LANES])


@numba.njit(inline="always")
def _decode_pairs(ctx, words, first, first_starts, second, second_starts, first_out, second_out, lanes):
    a, b, c, d, at, overrun = _start_run(ctx)
    last = words.size - 1
    for i in range(first_out.size):
        slot = a & _SLOT_MASK
        symbol = np.int64(first_starts[slot >> _LOOKUP_SHIFT])
        while first[np.uint64(symbol + 1)] <= slot:
            symbol += 1
        a = _table_state(a, slot, first[np.uint64(symbol)], first[np.uint64(symbol + 1)])
        a, at, bad = _refill(a, at, words[np.uint64(min(at, last))], words.size)
        overrun |= bad
        first_out[i] = symbol
        a, b, c, d = _rotate(a, b, c, d, lanes)
        slot = a & _SLOT_MASK
        symbol = np.int64(second_starts[slot >> _LOOKUP_SHIFT])
        while second[np.uint64(symbol + 1)] <= slot:
            symbol += 1
        a = _table_state(a, slot, second[np.uint64(symbol)], second[np.uint64(symbol + 1)])
        a, at, bad = _refill(a, at, words[np.uint64(min(at, last))], words.size)
        overrun |= bad
        second_out[i] = symbol
        a, b, c, d = _rotate(a, b, c, d, lanes)
    return _end_run(ctx, (a, b, c, d, at, overrun), 2 * first_out.size)


@njit_cached(nogil=True, inline="always")
def decode_bit_run(ctx: np.ndarray, words: np.ndarray, width: int, count: int, out: np.ndarray, shift: int) -> int:
    """Decode `count` raw values of `width` bits (0 to `MAX_RAW_BITS`), OR-ing value `i`
    shifted left by `shift` into `out[i]`: an error code."""
    if width < 0 or width > MAX_RAW_BITS:
        return BAD_TABLE
    if ctx[_LANES] == LANES:
        return _decode_bit_run(ctx, words, np.int64(width), count, out, shift, LANES)
    return _decode_bit_run(ctx, words, np.int64(width), count, out, shift, ctx[_LANES])


@numba.njit(inline="always")
def _decode_bit_run(ctx, words, width, count, out, shift, lanes):
    a, b, c, d, at, overrun = _start_run(ctx)
    last = words.size - 1
    mask = (np.int64(1) << width) - np.int64(1)
    for i in range(count):
        out[i] |= (a & mask) << shift
        a, at, bad = _refill(a >> width, at, words[np.uint64(min(at, last))], words.size)
        overrun |= bad
        a, b, c, d = _rotate(a, b, c, d, lanes)
    return _end_run(ctx, (a, b, c, d, at, overrun), count)


@njit_cached(nogil=True, inline="always")
def decode_bits(ctx: np.ndarray, words: np.ndarray, width: int) -> int:
    """The next raw value of `width` bits (0 to `MAX_RAW_BITS`), or minus an error code."""
    if width < 0 or width > MAX_RAW_BITS:
        return -BAD_TABLE
    lane = ctx[_LANE]
    state, at = ctx[_STATES + lane], ctx[_WORD]
    value = state & ((np.int64(1) << width) - np.int64(1))
    state, at, overrun = _refill(state >> width, at, words[np.uint64(min(at, words.size - 1))], words.size)
    if overrun:
        return -ENDS_EARLY
    ctx[_STATES + lane] = state
    ctx[_WORD] = at
    ctx[_LANE] = lane + 1 if lane + 1 < ctx[_LANES] else 0
    return value


@njit_cached(nogil=True)
def valid_table(table: np.ndarray) -> bool:
    """Whether `table` is a [`cumulative`] table: from 0 to `2^PRECISION`, never decreasing."""
    if table.size < 2 or table[0] != 0 or table[-1] != np.int64(1) << np.int64(PRECISION):
        return False
    for s in range(1, table.size):
        if table[s] < table[s - 1]:
            return False
    return True


@njit_cached(nogil=True)
def decode_table(ctx: np.ndarray, words: np.ndarray, table: np.ndarray, out: np.ndarray) -> int:
    """Decode `out.size` symbols coded with the [`cumulative`] `table` into `out`: an error code."""
    if not valid_table(table):
        return BAD_TABLE
    return decode_symbols(ctx, words, table, lookup(table), out)


@njit_cached(nogil=True)
def decode_raw(ctx: np.ndarray, words: np.ndarray, widths: np.ndarray, out: np.ndarray) -> int:
    """Decode `widths.size` raw values of `widths[i]` bits (0 to `MAX_RAW_BITS`) into `out`: an error code."""
    for i in range(widths.size):
        value = decode_bits(ctx, words, widths[i])
        if value < 0:
            return -value
        out[i] = value
    return OK


@njit_cached(nogil=True)
def decoder_finish(ctx: np.ndarray, words: np.ndarray) -> int:
    """OK if every word was read and every lane is back at its initial state, else the error."""
    if ctx[_WORD] != words.size:
        return WORDS_LEFT
    for lane in range(ctx[_LANES]):
        if ctx[_STATES + lane] != _LOW:
            return NOT_FINISHED
    return OK


class Decoder:
    """Decodes a stream of [`encode`] field by field, raising [`FormatError`] on damage.

    Args:
        words: The uint32 words.
        where: Prefix of error messages (the file and tensor).
        lanes: The interleaved states they were coded with.

    Raises:
        FormatError: The stream is too short to hold the coder's states, or one is out of range.
    """

    def __init__(self, words: np.ndarray, where: str = "entropy-coded data", lanes: int = LANES) -> None:
        self.words = np.ascontiguousarray(words, np.uint32)
        self.where = where
        self.ctx, error = decoder_start(self.words, lanes)
        self._check(error)

    def symbols(self, table: np.ndarray, count: int) -> np.ndarray:
        """The next `count` symbols, each coded with the [`cumulative`] `table` (int64)."""
        out = np.empty(count, np.int64)
        self._check(decode_table(self.ctx, self.words, table, out))
        return out

    def raw(self, widths: np.ndarray) -> np.ndarray:
        """The next raw values, `widths[i]` bits each (int64)."""
        widths = np.ascontiguousarray(widths, np.int64)
        out = np.empty(widths.size, np.int64)
        self._check(decode_raw(self.ctx, self.words, widths, out))
        return out

    def finish(self) -> None:
        """Check that the stream ends here, as it began."""
        self._check(decoder_finish(self.ctx, self.words))

    def _check(self, error: int) -> None:
        if error != OK:
            raise FormatError(f"{self.where}: {error_message(error)}")

"""A plain, slow reference of the compact encoding's entropy coder and stream (versions 3 to 5),
written from the format's description with Python integers, independently of
`delta_sync.rans` and `delta_sync.compact`: the tests check that each side decodes what
the other encodes, byte for byte where both encode.

Nothing here is fast or robust; it raises `ValueError` on any stream it cannot read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRECISION = 16
LANES = 4
MIN_LANED_CHANGES = {3: 16384, 4: 16384, 5: 1024}  # per version: a stream with fewer changes codes with one state
LOW = 1 << 31
TOPS = 64
DIRECT_CLASSES = 16
CLASSES = 28
CHUNK_BITS = 16
VERSION = 5  # version 4: one state below 16384 changes; version 3: 4 without the groups' sizes in the header


# -- the coder ----------------------------------------------------------------------------------


def quantize(weights: list[int], possible: list[bool]) -> list[int]:
    """Frequencies summing to 2^PRECISION: 1 + weight * spare // total per possible symbol, the rest to the first largest."""
    target = 1 << PRECISION
    chosen = [s for s, ok in enumerate(possible) if ok]
    total = sum(weights[s] for s in chosen)
    spare = target - len(chosen)
    freqs = [0] * len(weights)
    for s in chosen:
        freqs[s] = 1 + (weights[s] * spare // total if total else 0)
    best = max(chosen, key=lambda s: (weights[s], -s))
    freqs[best] += target - sum(freqs)
    return freqs


def cumulative(freqs: list[int]) -> list[int]:
    table = [0]
    for freq in freqs:
        table.append(table[-1] + freq)
    return table


def encode(symbols: list[tuple[int, int, int]], lanes: int = LANES) -> list[int]:
    """Words coding each `(start, freq, scale)` in order (lane i % lanes), as the decoder reads them."""
    states = [LOW] * lanes
    stack: list[int] = []
    for i in reversed(range(len(symbols))):
        start, freq, scale = symbols[i]
        assert freq >= 1 and start + freq <= 1 << scale
        state = states[i % lanes]
        if state >= ((LOW >> scale) << 32) * freq:
            stack.append(state & 0xFFFFFFFF)
            state >>= 32
        states[i % lanes] = (state // freq << scale) + state % freq + start
    head = []
    for state in states:
        head += [state & 0xFFFFFFFF, state >> 32]
    return head + stack[::-1]


class Decoder:
    """Reads symbols one at a time from the words of `encode`."""

    def __init__(self, words: list[int], lanes: int = LANES) -> None:
        if len(words) < 2 * lanes:
            raise ValueError("too short for the coder's states")
        self.words = [int(w) for w in words]
        self.lanes = lanes
        self.states = [self.words[2 * lane] | self.words[2 * lane + 1] << 32 for lane in range(lanes)]
        if any(not LOW <= state < LOW << 32 for state in self.states):
            raise ValueError("initial state out of range")
        self.at = 2 * lanes
        self.decoded = 0

    def _take(self, start: int, freq: int, scale: int, slot: int) -> None:
        lane = self.decoded % self.lanes
        state = freq * (self.states[lane] >> scale) + slot - start
        if state < LOW:
            if self.at >= len(self.words):
                raise ValueError("stream ends early")
            state = state << 32 | self.words[self.at]
            self.at += 1
        self.states[lane] = state
        self.decoded += 1

    def symbol(self, table: list[int]) -> int:
        slot = self.states[self.decoded % self.lanes] & ((1 << PRECISION) - 1)
        symbol = next(s for s in range(len(table) - 1) if table[s] <= slot < table[s + 1])
        self._take(table[symbol], table[symbol + 1] - table[symbol], PRECISION, slot)
        return symbol

    def bits(self, width: int) -> int:
        value = self.states[self.decoded % self.lanes] & ((1 << width) - 1)
        self._take(value, 1, width, value)
        return value

    def finish(self) -> None:
        if self.at != len(self.words) or self.states != [LOW] * self.lanes:
            raise ValueError("the stream does not end where the symbols do")


# -- the models ---------------------------------------------------------------------------------


def gap_shift(count: int, coded: int) -> int:
    return max(0, ((count - coded) // coded).bit_length() - 3)


def gap_table(count: int, coded: int) -> list[int]:
    """Geometric model of `gap >> shift` below TOPS, escape last, in 31-bit fixed point."""
    one = 1 << 31
    ratio = (count - coded) * one // count
    for _ in range(gap_shift(count, coded)):
        ratio = ratio * ratio >> 31
    weights, power = [], one
    for _ in range(TOPS):
        weights.append(power * (one - ratio) >> 31)
        power = power * ratio >> 31
    weights.append(power)
    return cumulative(quantize(weights, [True] * (TOPS + 1)))


QUARTERS = [round(2**31 * 2 ** (-j / 4)) for j in range(4)]


def class_table(table_bytes: list[int]) -> list[int]:
    top = max(table_bytes)
    weights = [QUARTERS[(top - q) % 4] >> ((top - q) // 4) if q else 0 for q in table_bytes]
    return cumulative(quantize(weights, [q > 0 for q in table_bytes]))


def log_byte(count: int) -> int:
    """round(4 log2(count)) + 1, clipped to 255: k with 2^(2k-1) <= count^8 < 2^(2k+1), exactly."""
    power = count**8
    k = 0
    while power >= 1 << (2 * k + 1):
        k += 1
    return min(k + 1, 255)


def class_of(code: int) -> int:
    return code if code < DIRECT_CLASSES else code.bit_length() + 11


# -- a compact stream ---------------------------------------------------------------------------


def group_of_elements(prev_bits: np.ndarray, boundaries: list[int]) -> np.ndarray:
    exponents = (prev_bits.astype(np.int64) >> 7) & 0xFF
    return np.searchsorted(np.array(boundaries, np.int64), exponents, side="right")


def zigzag_of(new: int, old: int) -> int:
    diff = (new - old + 0x8000) % 0x10000 - 0x8000
    return ((diff << 1) ^ (diff >> 15)) & 0xFFFF


def encode_stream(
    prev_bits: np.ndarray, indices: np.ndarray, new_bits: np.ndarray, boundaries: list[int], version: int = VERSION
) -> bytes:
    """A compact stream of the changes (`indices` ascending, `new_bits` int16) in the groups `boundaries` give."""
    prev = prev_bits.astype(np.int64)
    groups = group_of_elements(prev_bits, boundaries)
    header = bytearray([version, len(boundaries) + 1, *boundaries])
    if version >= 4:
        for group in range(len(boundaries)):
            header += varint(int((groups == group).sum()))
    symbols: list[tuple[int, int, int]] = []
    for group in range(len(boundaries) + 1):
        members = np.flatnonzero(groups == group)
        rank_of = {int(m): r for r, m in enumerate(members)}
        changed = [
            (rank_of[int(i)], zigzag_of(int(n), int(prev[i]))) for i, n in zip(indices, new_bits) if int(i) in rank_of
        ]
        header += varint(len(changed))
        if not changed:
            continue
        class_counts = [0] * CLASSES
        for _, z in changed:
            class_counts[class_of(z)] += 1
        size = max(c for c in range(CLASSES) if class_counts[c]) + 1
        table_bytes = [log_byte(n) if n else 0 for n in class_counts[:size]]
        header += bytes([size - 1, *table_bytes])
        symbols += group_symbols(len(members), changed, table_bytes)
    words = encode(symbols, LANES if len(indices) >= MIN_LANED_CHANGES[version] else 1)
    header += varint(len(words))
    return bytes(header) + b"".join(w.to_bytes(4, "little") for w in words)


def group_symbols(count: int, changed: list[tuple[int, int]], table_bytes: list[int]) -> list[tuple[int, int, int]]:
    k = len(changed)
    complement = 2 * k > count
    ranks = [r for r, _ in changed]
    coded = sorted(set(range(count)) - set(ranks)) if complement else ranks
    values = class_table(table_bytes)
    classes = [class_of(z) for _, z in changed]
    with_classes = len(table_bytes) > 1
    out: list[tuple[int, int, int]] = []

    def table_symbol(table: list[int], s: int) -> tuple[int, int, int]:
        return (table[s], table[s + 1] - table[s], PRECISION)

    shift = gap_shift(count, len(coded)) if coded else 0
    gaps = gap_table(count, len(coded)) if coded else []
    tops, lows, excess = [], [], []
    previous = -1
    for position in coded:
        gap = position - previous - 1
        previous = position
        tops.append(min(gap >> shift, TOPS))
        lows.append(gap & ((1 << shift) - 1))
        if gap >> shift >= TOPS:
            excess.append((gap >> shift) - TOPS + 1)
    if complement:
        out += [table_symbol(gaps, t) for t in tops]
        if with_classes:
            out += [table_symbol(values, c) for c in classes]
    else:
        for t, c in zip(tops, classes):
            out.append(table_symbol(gaps, t))
            if with_classes:
                out.append(table_symbol(values, c))
    for offset in range(0, shift, CHUNK_BITS):
        bits = min(shift - offset, CHUNK_BITS)
        out += [((low >> offset) & ((1 << bits) - 1), 1, bits) for low in lows]
    widths = [e.bit_length() - 1 for e in excess]
    out += [(w, 1, 6) for w in widths]
    out += chunks(excess, widths)
    wide = [(z, class_of(z) - 12) for (_, z) in changed if class_of(z) >= DIRECT_CLASSES]
    out += chunks([z for z, _ in wide], [w for _, w in wide])
    return out


def chunks(values: list[int], widths: list[int]) -> list[tuple[int, int, int]]:
    out = []
    for offset in range(0, max(widths, default=0), CHUNK_BITS):
        for value, width in zip(values, widths):
            if width > offset:
                bits = min(width - offset, CHUNK_BITS)
                out.append(((value >> offset) & ((1 << bits) - 1), 1, bits))
    return out


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value >> 7 else 0))
        value >>= 7
        if not value:
            return bytes(out)


@dataclass
class Reader:
    data: bytes
    at: int = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise ValueError("stream ends inside the header")
        self.at += 1
        return self.data[self.at - 1]

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value


def decode_stream(data: bytes, prev_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(indices, new_bits)` of a compact stream (version 3, 4 or 5) against the previous tensor's bits (int16)."""
    reader = Reader(bytes(data))
    version = reader.byte()
    if version not in MIN_LANED_CHANGES:
        raise ValueError(f"version {version} is not 3, 4 or 5")
    group_count = reader.byte()
    boundaries = [reader.byte() for _ in range(group_count - 1)]
    groups = group_of_elements(prev_bits, boundaries)
    if version >= 4:
        for group in range(group_count - 1):
            if reader.varint() != (groups == group).sum():
                raise ValueError(f"group {group}'s size is not the tensor's")
    changed, tables = [], []
    for _ in range(group_count):
        changed.append(reader.varint())
        tables.append([reader.byte() for _ in range(reader.byte() + 1)] if changed[-1] else None)
    word_count = reader.varint()
    rest = data[reader.at :]
    if len(rest) != 4 * word_count:
        raise ValueError("word count does not match")
    lanes = LANES if sum(changed) >= MIN_LANED_CHANGES[version] else 1
    decoder = Decoder([int.from_bytes(rest[4 * i : 4 * i + 4], "little") for i in range(word_count)], lanes)
    prev = prev_bits.astype(np.int64)
    found: list[tuple[int, int]] = []
    for group, (k, table_bytes) in enumerate(zip(changed, tables)):
        if not k:
            continue
        members = np.flatnonzero(groups == group)
        for rank, zigzag in decode_group(decoder, len(members), k, table_bytes):
            position = int(members[rank])
            diff = (zigzag >> 1) ^ -(zigzag & 1)
            found.append((position, (int(prev[position]) + diff + 0x8000) % 0x10000 - 0x8000))
    decoder.finish()
    found.sort()
    return np.array([p for p, _ in found], np.int64), np.array([v for _, v in found], np.int16)


def decode_group(decoder: Decoder, count: int, k: int, table_bytes: list[int]) -> list[tuple[int, int]]:
    complement = 2 * k > count
    coded = count - k if complement else k
    values = class_table(table_bytes)
    with_classes = len(table_bytes) > 1
    gaps = gap_table(count, coded) if coded else []
    shift = gap_shift(count, coded) if coded else 0
    tops, classes = [], []
    for _ in range(coded):
        tops.append(decoder.symbol(gaps))
        if with_classes and not complement:
            classes.append(decoder.symbol(values))
    if with_classes and complement:
        classes = [decoder.symbol(values) for _ in range(k)]
    if not with_classes:
        classes = [0] * k
    lows = [0] * coded
    for offset in range(0, shift, CHUNK_BITS):
        for j in range(coded):
            lows[j] |= decoder.bits(min(shift - offset, CHUNK_BITS)) << offset
    widths = [decoder.bits(6) for t in tops if t == TOPS]
    excess = read_chunks(decoder, widths)
    escapes = iter(zip(excess, widths))
    positions, previous = [], -1
    for top, low in zip(tops, lows):
        if top == TOPS:
            value, width = next(escapes)
            top = value + (1 << width) + TOPS - 1
        previous += (top << shift) + low + 1
        positions.append(previous)
    if positions and positions[-1] >= count:
        raise ValueError("positions run past the group")
    wide_widths = [c - 12 for c in classes if c >= DIRECT_CLASSES]
    wide = iter(zip(read_chunks(decoder, wide_widths), wide_widths))
    zigzags = []
    for c in classes:
        if c >= DIRECT_CLASSES:
            value, width = next(wide)
            zigzags.append(value + (1 << width))
        else:
            zigzags.append(c)
    ranks = sorted(set(range(count)) - set(positions)) if complement else positions
    return list(zip(ranks, zigzags))


def read_chunks(decoder: Decoder, widths: list[int]) -> list[int]:
    values = [0] * len(widths)
    for offset in range(0, max(widths, default=0), CHUNK_BITS):
        for i, width in enumerate(widths):
            if width > offset:
                values[i] |= decoder.bits(min(width - offset, CHUNK_BITS)) << offset
    return values

"""The compact encoding of a delta: entropy-coded positions and values, conditioned on the
weights the replica already holds.

A raw delta spends 6 bytes per changed element (an int32 position and a bf16 value). Both
are far more predictable than that, given the previous tensor, which the trainer (its
snapshot) and every replica (its held weights) both have:

* **Positions.** Whether an Adam update survives the bf16 rounding depends mostly on the
  weight's magnitude: it must exceed half the bf16 spacing, which is set by the exponent.
  The elements of a tensor are therefore split into groups by the exponent of their
  previous value (sign ignored; adjacent exponents merged where a separate model would not
  pay for itself), and the changed positions of each group are coded as gaps between
  successive changed elements *of that group*, with a geometric model at the group's own
  change rate. That costs about `n * H(k / n)` bits per group of `n` elements with `k`
  changes (`H` the binary entropy), the exponent-conditioned bound, whatever the layout of
  the changes. Groups where most elements change code their unchanged positions instead.
* **Values.** The signed difference of the bf16 bit patterns from the previous value (int16
  arithmetic on the raw bits, so NaN, Inf and -0.0 round-trip exactly), mostly one unit in
  the last place. Each group codes it with its own small histogram, because the size of a
  step in ULPs also follows the exponent.

Both are coded with `constriction`'s ANS coder, whole arrays at a time. The grouping costs
one pass over the previous tensor's bits per group boundary (a compare and a `packbits`),
and everything else O(changed elements), on the encoder and the decoder alike.

Each parameter becomes one uint8 tensor `{name}.compact` (see [`entry_names`]). Its layout,
little-endian, is:

| field | size | meaning |
| --- | --- | --- |
| version | 1 byte | `1` |
| groups | 1 byte | number of exponent groups `G` (1-255) |
| boundaries | `G - 1` bytes | first exponent of groups `1..G-1`, strictly ascending |
| per group: changed | varint | changed elements in the group |
| per group with changes: value table | 1 + `C` bytes | highest value class `C - 1`, then a log-scale frequency per class |
| words | varint | number of ANS words that follow |
| ANS words | rest | uint32 words of the constriction `AnsCoder` |

Decoding validates every count against the tensor's size before allocating anything, so a
damaged stream raises [`FormatError`] (or, at worst, decodes to weights that the
receiver's checksums then refuse); it never hangs or allocates beyond the tensor's size.

Example:
    ```python
    >>> entries = encode_changes(change_set.changes, previous=snapshot)
    >>> entries.keys()
    dict_keys(['model.norm.weight.compact', ...])
    >>> changes = decode_changes(entries, previous=held, shapes=shapes, source="deltas/step_00000002.safetensors")
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import constriction
import numpy as np
import torch

from .errors import ApplyError, FormatError
from .format import SparseChange, index_dtype
from .parallel import parallel_map

__all__ = ["ENCODING", "decode_changes", "encode_changes", "entry_names"]

#: Value of the `encoding` metadata key for files in this encoding.
ENCODING = "compact"
#: Suffix of the one tensor each changed parameter is stored under.
SUFFIX = ".compact"

_VERSION = 1
_MAX_GROUPS = 255
# Top of the gap alphabet: a gap's high part is coded directly below this, escaped above.
_TOPS = 64
# Value classes: zigzag codes below 16 directly, then one class per bit length up to 16.
_DIRECT_CLASSES = 16
_CLASSES = _DIRECT_CLASSES + 12
# The raw low bits of a number are coded in chunks of at most this many bits.
_CHUNK_BITS = 16
# Tensors smaller than this, or with fewer changes, use a single group: the side
# information of more would not pay for itself.
_MIN_GROUPED_NUMEL = 4096
_MIN_GROUPED_CHANGES = 64
# At most this many exponent atoms enter the partition search (coarsened beyond).
_MAX_ATOMS = 32
# Each group costs a pass over the tensor: it must save more than this many bits per element.
_GROUP_PENALTY = 1 / 1024
# Log-scale frequencies: probability of a value class is 2^((q - 1) / 4) for q in 1..255.
_QUARTER_POWERS = np.array([1.0, 1.189207115002721, 1.4142135623730951, 1.681792830507429])

_POP8 = np.array([bin(v).count("1") for v in range(256)], dtype=np.uint8)
_SELECT8 = np.zeros((256, 8), dtype=np.uint8)
for _value in range(256):
    _bits = [bit for bit in range(8) if _value >> bit & 1]
    _SELECT8[_value, : len(_bits)] = _bits
del _value, _bits

_Categorical = constriction.stream.model.Categorical
_UNIFORM = constriction.stream.model.Uniform()


def entry_names(name: str) -> tuple[str, ...]:
    """Names of the tensors a compact delta stores for parameter `name`.

    Example:
        ```python
        >>> entry_names("model.norm.weight")
        ('model.norm.weight.compact',)
        ```
    """
    return (name + SUFFIX,)


def encode_changes(
    changes: Mapping[str, SparseChange], previous: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Encode the changed elements of each parameter in the compact encoding.

    Args:
        changes: Parameter name -> its changed elements (CPU; indices strictly ascending).
        previous: Parameter name -> the full bf16 tensor *before* the change: the trainer's
            snapshot before it advances, which equals what every replica holds.

    Returns:
        The safetensors entries to store: one 1-D uint8 tensor per parameter, named as
        [`entry_names`] says.

    Example:
        ```python
        >>> entries = encode_changes({"w": SparseChange(indices, values)}, {"w": w_before})
        >>> save_file(entries, "delta.safetensors", metadata={"encoding": ENCODING, ...})
        ```
    """
    names = sorted(changes)
    streams = parallel_map(lambda name: _encode_tensor(name, changes[name], previous[name]), names)
    return {entry_names(name)[0]: torch.from_numpy(stream) for name, stream in zip(names, streams)}


def decode_changes(
    entries: Mapping[str, torch.Tensor],
    previous: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    source: str,
) -> dict[str, SparseChange]:
    """Decode compact entries back into the changed elements of each parameter.

    Args:
        entries: The file's tensors: exactly [`entry_names`] of every parameter in `shapes`.
        previous: Parameter name -> the bf16 tensor the delta applies to (the replica's
            held weights, not modified).
        shapes: Parameter name -> shape, for every parameter in the file.
        source: How to name the file in error messages.

    Returns:
        Parameter name -> changed elements: indices ascending (int32, or int64 for tensors
        of 2^31 elements or more) and new bf16 values.

    Raises:
        FormatError: The entries are missing, unexpected, or damaged; the message names the
            file and the tensor.
        ApplyError: `previous` lacks a parameter or holds it with another shape or dtype.

    Example:
        ```python
        >>> changes = decode_changes(entries, held_weights, header.shapes, source=str(path))
        >>> changes["model.norm.weight"].indices
        tensor([   3,   17, 1021], dtype=torch.int32)
        ```
    """
    expected = {entry_names(name)[0]: name for name in shapes}
    if set(entries) != set(expected):
        missing = sorted(set(expected) - set(entries))
        extra = sorted(set(entries) - set(expected))
        raise FormatError(
            f"{source}: compact tensors do not match the file's parameters (missing {missing}, unexpected {extra})"
        )
    for name, shape in shapes.items():
        held = previous.get(name)
        if held is None:
            raise ApplyError(f"{source}: the delta changes {name!r}, which is not among the held weights")
        if tuple(held.shape) != tuple(shape) or held.dtype != torch.bfloat16:
            raise ApplyError(
                f"{source}: {name!r} is held as {held.dtype} {tuple(held.shape)}, the delta is for bfloat16 {tuple(shape)}"
            )
    names = sorted(shapes)
    decoded = parallel_map(lambda name: _decode_tensor(name, entries[name + SUFFIX], previous[name], source), names)
    return dict(zip(names, decoded))


# -- one tensor ------------------------------------------------------------------------------


def _flat_bits(tensor: torch.Tensor) -> np.ndarray:
    """The bf16 bit patterns of a CPU tensor as a flat int16 array (no copy when contiguous)."""
    return tensor.detach().reshape(-1).cpu().contiguous().view(torch.int16).numpy()


def _encode_tensor(name: str, change: SparseChange, previous: torch.Tensor) -> np.ndarray:
    if previous.dtype != torch.bfloat16:
        raise TypeError(f"{name}: previous tensor is {previous.dtype}, expected bfloat16")
    prev_bits = _flat_bits(previous)
    numel = prev_bits.size
    indices = change.indices.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    new_bits = _flat_bits(change.values)
    if indices.size != new_bits.size:
        raise ValueError(f"{name}: {indices.size} indices but {new_bits.size} values")
    if indices.size and (indices[0] < 0 or indices[-1] >= numel or np.any(indices[1:] <= indices[:-1])):
        raise ValueError(f"{name}: indices must be strictly ascending positions in [0, {numel})")

    old_bits = prev_bits[indices]
    zigzag = _zigzag(new_bits, old_bits)
    classes = _value_class(zigzag)
    exponents = (old_bits.view(np.uint16) >> 7).astype(np.uint8)
    boundaries = _choose_boundaries(prev_bits, exponents, classes)
    groups = np.zeros(256, np.uint8)
    groups[boundaries] = 1
    groups = np.cumsum(groups, dtype=np.uint8)[exponents]
    order = np.argsort(groups, kind="stable")  # radix sort: group by group, positions ascending in each
    counts = np.bincount(groups, minlength=len(boundaries) + 1)

    header = bytearray([_VERSION, len(boundaries) + 1, *boundaries])
    ops: list[_Op] = []
    starts = np.concatenate([[0], np.cumsum(counts)])
    tables = []
    for group, members in enumerate(_GroupIndex.iterate(prev_bits, boundaries)):
        chosen = order[starts[group] : starts[group + 1]]
        header += _varint(chosen.size)
        if chosen.size == 0:
            tables.append(None)
            continue
        _encode_positions(ops, members.rank(indices[chosen]), members.count)
        table = _class_table(classes[chosen])
        header += bytes([table.size - 1, *table])
        tables.append(table)
    for group, table in enumerate(tables):
        if table is not None:
            chosen = order[starts[group] : starts[group + 1]]
            _encode_values(ops, zigzag[chosen], classes[chosen], table)

    coder = constriction.stream.stack.AnsCoder()
    for op in reversed(ops):
        op.encode(coder)
    words = coder.get_compressed().astype("<u4", copy=False)
    header += _varint(words.size)
    return np.concatenate([np.frombuffer(bytes(header), dtype=np.uint8), words.view(np.uint8)])


def _decode_tensor(name: str, entry: torch.Tensor, previous: torch.Tensor, source: str) -> SparseChange:
    where = f"{source}: {name}{SUFFIX}"
    if entry.dtype != torch.uint8 or entry.dim() != 1:
        raise FormatError(f"{where} must be a 1-D uint8 tensor, got {entry.dim()}-D {entry.dtype}")
    stream = entry.contiguous().numpy()
    prev_bits = _flat_bits(previous)
    numel = prev_bits.size
    reader = _Reader(stream, where)
    header = _Header.read(reader, numel)
    words = reader.rest_as_words(header.words)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
    except ValueError as exc:
        raise FormatError(f"{where}: damaged entropy-coded data ({exc})") from None

    positions = []
    members_count = []
    for group, members in enumerate(_GroupIndex.iterate(prev_bits, header.boundaries)):
        changed = header.changed[group]
        members_count.append(members.count)
        if changed > members.count:
            raise FormatError(f"{where}: group {group} claims {changed} changes among {members.count} elements")
        if changed:
            ranks = _decode_positions(coder, members.count, changed, where)
            positions.append(members.select(ranks))
    zigzags = [
        _decode_values(coder, header.changed[group], table, where)
        for group, table in enumerate(header.tables)
        if table is not None
    ]
    if not coder.is_empty():
        raise FormatError(f"{where}: entropy-coded data does not end where the changes do; the stream is damaged")

    indices = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    zigzag = np.concatenate(zigzags) if zigzags else np.zeros(0, np.int32)
    order = np.argsort(indices, kind="stable")
    indices = indices[order]
    if indices.size > 1 and np.any(indices[1:] <= indices[:-1]):
        raise FormatError(f"{where}: decoded positions repeat; the stream is damaged")
    new_bits = _unzigzag(zigzag[order], prev_bits[indices])
    return SparseChange(
        indices=torch.from_numpy(indices.astype(np.int32 if index_dtype(numel) == torch.int32 else np.int64)),
        values=torch.from_numpy(new_bits).view(torch.bfloat16),
    )


# -- header ----------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class _Reader:
    """Bounds-checked reads from the front of a stream."""

    def __init__(self, data: np.ndarray, where: str) -> None:
        self.data = data
        self.pos = 0
        self.where = where

    def byte(self, what: str) -> int:
        if self.pos >= self.data.size:
            raise FormatError(f"{self.where}: stream ends inside the header ({what})")
        self.pos += 1
        return int(self.data[self.pos - 1])

    def bytes(self, count: int, what: str) -> np.ndarray:
        if self.pos + count > self.data.size:
            raise FormatError(f"{self.where}: stream ends inside the header ({what})")
        self.pos += count
        return self.data[self.pos - count : self.pos]

    def varint(self, limit: int, what: str) -> int:
        value = 0
        for shift in range(0, 64, 7):
            byte = self.byte(what)
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if value > limit:
                    raise FormatError(f"{self.where}: {what} is {value}, more than the {limit} possible")
                return value
        raise FormatError(f"{self.where}: {what} is not a valid varint")

    def rest_as_words(self, count: int) -> np.ndarray:
        rest = self.data[self.pos :]
        if rest.size != 4 * count:
            raise FormatError(
                f"{self.where}: entropy-coded data is {rest.size} bytes, the header says {4 * count}; "
                "the stream is truncated or damaged"
            )
        return rest.view("<u4").astype(np.uint32)


@dataclass
class _Header:
    boundaries: list[int]
    changed: list[int]
    tables: list[np.ndarray | None] = field(default_factory=list)
    words: int = 0

    @classmethod
    def read(cls, reader: _Reader, numel: int) -> _Header:
        version = reader.byte("version")
        if version != _VERSION:
            raise FormatError(
                f"{reader.where}: compact stream version {version} is not supported (this library reads {_VERSION})"
            )
        groups = reader.byte("group count")
        if groups == 0:
            raise FormatError(f"{reader.where}: group count is 0")
        boundaries = [int(b) for b in reader.bytes(groups - 1, "group boundaries")]
        if any(b <= a for a, b in zip([0, *boundaries], boundaries)):
            raise FormatError(f"{reader.where}: group boundaries {boundaries} are not strictly ascending exponents")
        changed, tables, total = [], [], 0
        for group in range(groups):
            count = reader.varint(numel - total, f"change count of group {group}")
            total += count
            changed.append(count)
            table = None
            if count:
                size = reader.byte(f"value table size of group {group}") + 1
                if size > _CLASSES:
                    raise FormatError(
                        f"{reader.where}: value table of group {group} has {size} classes, at most {_CLASSES} exist"
                    )
                table = reader.bytes(size, f"value table of group {group}").copy()
                if not table.any():
                    raise FormatError(f"{reader.where}: value table of group {group} is empty")
            tables.append(table)
        words = reader.varint(numel * 8 + 8, "length of the entropy-coded data")
        return cls(boundaries=boundaries, changed=changed, tables=tables, words=words)


# -- exponent groups -------------------------------------------------------------------------


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    return _POP8[words.view(np.uint8)].reshape(-1, 8).sum(axis=1, dtype=np.uint8)


@dataclass
class _GroupIndex:
    """The elements of one exponent group as a packed bit set, with rank and select."""

    words: np.ndarray  # little-endian uint64 words, bit b of word w = element 64 w + b
    cumulative: np.ndarray  # members before each word, length len(words) + 1

    @property
    def count(self) -> int:
        return int(self.cumulative[-1])

    @classmethod
    def iterate(cls, prev_bits: np.ndarray, boundaries: list[int]):
        """Yield the index of each group in turn, holding two boundary masks at a time."""
        # One byte per element from here on: each boundary then costs a byte compare and a packbits.
        exponents = _exponents(prev_bits) if boundaries else None
        below = np.zeros(_word_count(prev_bits.size), dtype="<u8")
        for boundary in [*boundaries, None]:
            if boundary is None:
                upper = _all_ones(prev_bits.size)
            else:
                upper = _pack(exponents < np.uint8(boundary))
            words = upper & ~below
            cumulative = np.zeros(words.size + 1, dtype=np.int64)
            np.cumsum(_popcount(words), out=cumulative[1:])
            yield cls(words=words, cumulative=cumulative)
            below = upper

    def rank(self, positions: np.ndarray) -> np.ndarray:
        """Rank of each (member) position among the group's members."""
        word = positions >> 6
        below_bit = (np.uint64(1) << (positions & 63).astype(np.uint64)) - np.uint64(1)
        return self.cumulative[word] + _popcount(self.words[word] & below_bit).astype(np.int64)

    def select(self, ranks: np.ndarray) -> np.ndarray:
        """Position of the members with the given ranks (all below `count`)."""
        octets = self.words.view(np.uint8)
        filled = np.cumsum(_POP8[octets], dtype=np.int64)  # members up to and including each byte
        octet = np.searchsorted(filled, ranks, side="right")
        before = np.where(octet > 0, filled[np.maximum(octet - 1, 0)], 0)
        return (octet << 3) + _SELECT8[octets[octet], ranks - before]


def _exponents(bits: np.ndarray) -> np.ndarray:
    """The exponent field of every bf16 bit pattern, one byte each, in one pass."""
    exponents = np.empty(bits.size, np.uint8)
    np.right_shift(bits.view(np.uint16), np.uint16(7), out=exponents, casting="unsafe")
    return exponents


def _word_count(numel: int) -> int:
    return (numel + 63) // 64


def _pack(mask: np.ndarray) -> np.ndarray:
    packed = np.packbits(mask, bitorder="little")
    padded = np.zeros(_word_count(mask.size) * 8, dtype=np.uint8)
    padded[: packed.size] = packed
    return padded.view("<u8")


def _all_ones(numel: int) -> np.ndarray:
    words = np.full(_word_count(numel), np.uint64(0xFFFFFFFFFFFFFFFF), dtype="<u8")
    if numel % 64:
        words[-1] = (np.uint64(1) << np.uint64(numel % 64)) - np.uint64(1)
    return words


def _choose_boundaries(prev_bits: np.ndarray, changed_exponents: np.ndarray, classes: np.ndarray) -> list[int]:
    """Split the exponent line into groups so that the estimated coded size is smallest.

    A dynamic programme over the exponents present: a group of `n` elements with `k`
    changes costs `n H(k / n)` bits for its positions, the empirical entropy of its value
    classes, and its side information. Element counts are estimated from a regular sample
    of the previous tensor (the boundaries are stored, so the decoder needs no estimate).
    """
    numel = prev_bits.size
    if numel < _MIN_GROUPED_NUMEL or changed_exponents.size < _MIN_GROUPED_CHANGES:
        return []
    stride = max(1, numel // 65536)
    sample = (prev_bits[::stride].view(np.uint16) >> 7).astype(np.uint8)
    elements = np.bincount(sample, minlength=256) * (numel / sample.size)
    changes = np.bincount(changed_exponents, minlength=256).astype(np.float64)
    elements = np.maximum(elements, changes)
    class_counts = np.bincount(changed_exponents.astype(np.int64) * _CLASSES + classes, minlength=256 * _CLASSES)
    class_counts = class_counts.reshape(256, _CLASSES).astype(np.float64)

    atoms = np.flatnonzero(elements > 0)
    if atoms.size <= 1:
        return []
    chunks = np.array_split(np.arange(atoms.size), min(atoms.size, _MAX_ATOMS))
    starts = atoms[[chunk[0] for chunk in chunks]]  # first exponent of each atom
    n = np.add.reduceat(elements, starts)
    k = np.add.reduceat(changes, starts)
    h = np.add.reduceat(class_counts[:, class_counts.any(axis=0)], starts, axis=0)
    cost = _range_costs(n, k, h) + _GROUP_PENALTY * numel
    best = np.zeros(starts.size + 1)
    split = np.zeros(starts.size, dtype=np.int64)
    for j in range(starts.size):
        candidates = best[: j + 1] + cost[: j + 1, j]
        split[j] = int(np.argmin(candidates))
        best[j + 1] = candidates[split[j]]
    boundaries = []
    j = starts.size - 1
    while j >= 0:
        i = split[j]
        if i > 0:
            boundaries.append(int(starts[i]))
        j = i - 1
    return sorted(boundaries)[: _MAX_GROUPS - 1]


def _range_costs(n: np.ndarray, k: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Estimated bits of a group made of atoms `i..j`, as an upper-triangular matrix."""
    cn, ck = np.concatenate([[0], np.cumsum(n)]), np.concatenate([[0], np.cumsum(k)])
    ch = np.concatenate([np.zeros((1, h.shape[1])), np.cumsum(h, axis=0)])
    group_n = cn[None, 1:] - cn[:-1, None]
    group_k = ck[None, 1:] - ck[:-1, None]
    group_h = ch[None, 1:, :] - ch[:-1, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.clip(group_k / np.maximum(group_n, 1), 0, 1)
        entropy = -(np.where(p > 0, p * np.log2(p), 0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0))
        values = np.where(group_h > 0, group_h * np.log2(group_h), 0).sum(axis=2)
        values = np.where(group_k > 0, group_k * np.log2(np.maximum(group_k, 1)) - values, 0)
    table = np.where(group_k > 0, 8 * (2 + (group_h > 0).sum(axis=2)), 0)
    cost = group_n * entropy + values + table + 24
    cost[np.tril_indices(n.size, -1)] = np.inf
    return cost


# -- entropy-coded fields --------------------------------------------------------------------


@dataclass
class _Op:
    """One array of symbols pushed on the ANS stack with one model (or model family)."""

    symbols: np.ndarray
    model: object
    params: tuple = ()

    def encode(self, coder) -> None:
        if self.symbols.size:
            coder.encode_reverse(self.symbols.astype(np.int32), self.model, *self.params)


def _decode(coder, count: int, model, *params) -> np.ndarray:
    if count == 0:
        return np.zeros(0, np.int64)
    try:
        if params:
            return coder.decode(model, *params).astype(np.int64)
        return coder.decode(model, count).astype(np.int64)
    except Exception as exc:  # constriction reports bad data as ValueError, others as its own types
        raise FormatError(f"damaged entropy-coded data ({exc})") from None


def _geometric_model(count: int, coded: int) -> tuple[int, object]:
    """`(shift, model)`: gaps between `coded` marked elements among `count` are geometric;
    `gap >> shift` is coded with the model below `_TOPS` (escape above), the low `shift` bits raw.

    Only exact IEEE operations (division, subtraction, products) enter the probabilities,
    so the trainer and every replica build the same model on any machine.
    """
    mean = (count - coded) // coded
    shift = max(0, mean.bit_length() - 3)
    ratio = 1.0 - coded / count
    for _ in range(shift):
        ratio *= ratio
    # ratio^t by sequential products (np.cumprod): one rounding per step, the same everywhere.
    powers = np.cumprod(np.concatenate([[1.0], np.full(_TOPS, ratio)]))
    probabilities = np.concatenate([powers[:_TOPS] * (1.0 - ratio), powers[_TOPS:]])
    return shift, _Categorical(probabilities, perfect=False)


def _encode_positions(ops: list[_Op], ranks: np.ndarray, count: int) -> None:
    """Gaps between successive ranks (or between the unchanged ones, if most changed)."""
    if 2 * ranks.size > count:
        keep = np.ones(count, dtype=bool)
        keep[ranks] = False
        ranks = np.flatnonzero(keep)
    if ranks.size == 0:
        return
    gaps = np.diff(ranks, prepend=-1) - 1
    shift, model = _geometric_model(count, ranks.size)
    tops = gaps >> shift
    escaped = tops >= _TOPS
    ops.append(_Op(np.minimum(tops, _TOPS), model))
    _encode_raw(ops, gaps & ((1 << shift) - 1), np.full(gaps.size, shift))
    excess = tops[escaped] - _TOPS + 1
    lengths = _bit_length(excess)
    ops.append(_Op(lengths - 1, constriction.stream.model.Uniform(64)))
    _encode_raw(ops, excess - (np.int64(1) << (lengths - 1)), lengths - 1)


def _decode_positions(coder, count: int, changed: int, where: str) -> np.ndarray:
    coded = count - changed if 2 * changed > count else changed
    ranks = np.zeros(0, np.int64)
    if coded:
        shift, model = _geometric_model(count, coded)
        try:
            tops = _decode(coder, coded, model)
            lows = _decode_raw(coder, np.full(coded, shift))
            escaped = tops >= _TOPS
            lengths = _decode(coder, int(escaped.sum()), constriction.stream.model.Uniform(64)) + 1
            if lengths.size and lengths.max() > 48:
                raise FormatError("an escaped gap is longer than 2^48")
            excess = _decode_raw(coder, lengths - 1) + (np.int64(1) << (lengths - 1))
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
        tops[escaped] = excess + _TOPS - 1
        limit = count >> shift
        if tops.max() > limit:
            raise FormatError(f"{where}: a decoded gap runs past the end of its group; the stream is damaged")
        gaps = (tops << shift) + lows
        ranks = np.cumsum(gaps + 1) - 1
        if ranks[-1] >= count:
            raise FormatError(f"{where}: decoded positions run past the end of their group; the stream is damaged")
    if coded != changed:
        keep = np.ones(count, dtype=bool)
        keep[ranks] = False
        ranks = np.flatnonzero(keep)
    return ranks


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Bit length of non-negative int64 values below 2^53 (exact: their float64 is exact)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


def _encode_raw(ops: list[_Op], values: np.ndarray, widths: np.ndarray) -> None:
    """Low `widths` bits of each value, uniformly, in chunks of up to 16 bits."""
    for offset in range(0, int(widths.max(initial=0)), _CHUNK_BITS):
        chosen = widths > offset
        bits = np.minimum(widths[chosen] - offset, _CHUNK_BITS)
        chunk = (values[chosen] >> offset) & ((np.int64(1) << bits) - 1)
        ops.append(_Op(chunk, _UNIFORM, ((np.int64(1) << bits).astype(np.int32),)))


def _decode_raw(coder, widths: np.ndarray) -> np.ndarray:
    values = np.zeros(widths.size, np.int64)
    for offset in range(0, int(widths.max(initial=0)), _CHUNK_BITS):
        chosen = widths > offset
        bits = np.minimum(widths[chosen] - offset, _CHUNK_BITS)
        chunk = _decode(coder, int(chosen.sum()), _UNIFORM, (np.int64(1) << bits).astype(np.int32))
        values[chosen] |= chunk << offset
    return values


def _zigzag(new_bits: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
    """Signed int16 difference of bit patterns, wrapped, folded to 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    diff = (new_bits.astype(np.int32) - old_bits.astype(np.int32) + 32768) % 65536 - 32768
    return ((diff << 1) ^ (diff >> 31)).astype(np.int64)


def _unzigzag(zigzag: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
    diff = (zigzag >> 1) ^ -(zigzag & 1)
    return ((old_bits.astype(np.int64) + diff) & 0xFFFF).astype(np.uint16).view(np.int16)


def _value_class(zigzag: np.ndarray) -> np.ndarray:
    """Codes below 16 are their own class; above, one class per bit length (low bits raw)."""
    classes = zigzag.copy()
    wide = zigzag >= _DIRECT_CLASSES
    classes[wide] = _bit_length(zigzag[wide]) + 11
    return classes


def _class_table(classes: np.ndarray) -> np.ndarray:
    """Log-scale frequencies of the classes present (0 = absent), one byte each."""
    counts = np.bincount(classes, minlength=classes.max() + 1)
    with np.errstate(divide="ignore"):
        quantized = np.where(counts > 0, np.clip(np.rint(4 * np.log2(np.maximum(counts, 1))) + 1, 1, 255), 0)
    return quantized.astype(np.uint8)


def _class_model(table: np.ndarray):
    present = table.astype(np.int64)
    probabilities = np.where(present > 0, np.ldexp(_QUARTER_POWERS[(present - 1) % 4], (present - 1) // 4), 0.0)
    return _Categorical(probabilities, perfect=False)


def _encode_values(ops: list[_Op], zigzag: np.ndarray, classes: np.ndarray, table: np.ndarray) -> None:
    if table.size > 1:
        ops.append(_Op(classes, _class_model(table)))
    wide = classes >= _DIRECT_CLASSES
    widths = classes[wide] - 12
    _encode_raw(ops, zigzag[wide] - (np.int64(1) << widths), widths)


def _decode_values(coder, count: int, table: np.ndarray, where: str) -> np.ndarray:
    try:
        if table.size > 1:
            classes = _decode(coder, count, _class_model(table))
        else:
            classes = np.zeros(count, np.int64)
        wide = classes >= _DIRECT_CLASSES
        widths = classes[wide] - 12
        zigzag = classes.copy()
        zigzag[wide] = _decode_raw(coder, widths) + (np.int64(1) << widths)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    return zigzag

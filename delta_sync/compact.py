"""The compact encoding of a delta: entropy-coded positions and values, conditioned on the
weights the replica already holds.

A raw delta spends 6 bytes per changed element (an int32 position and a bf16 value). Both
are far more predictable than that, given the previous tensor, which the trainer (its
snapshot) and every replica (its held weights) both have:

* **Positions.** Whether an Adam update survives the bf16 rounding depends mostly on the
  weight's magnitude: it must exceed half the bf16 spacing, which is set by the exponent.
  The elements of a tensor are therefore split into at most 8 groups by ranges of the
  exponent of their previous value (sign ignored), chosen per tensor: a run of single
  exponents (or pairs) where the change rate moves, and one group for each tail. The
  changed positions of each group are coded as gaps between successive changed elements
  *of that group*, with a geometric model at the group's own change rate. That costs
  about `n * H(k / n)` bits per group of `n` elements with `k` changes (`H` the binary
  entropy), close to the exponent-conditioned bound, whatever the layout of the changes.
  Groups where most elements change code their unchanged positions instead.
* **Values.** The signed difference of the bf16 bit patterns from the previous value (int16
  arithmetic on the raw bits, so NaN, Inf and -0.0 round-trip exactly), mostly one unit in
  the last place. Each group codes it with its own small histogram, because the size of a
  step in ULPs also follows the exponent. Where a group's changed elements are coded, the
  gap before each and its value form one symbol of a joint model.

Both are coded with `constriction`'s ANS coder, a few calls per group. The passes over
whole tensors are compiled (numba, cached on disk: the first call in a process loads them in
about a second, the very first on a machine compiles them in a few). They read 64
elements at a time into one mask per group boundary (the elements whose exponent is at
least the boundary, a vector compare: [`delta_sync.bitmasks`]), so that counting a group's
members is a `popcount`: the encoder reads the previous tensor once and takes each change's
rank from the masks below it; the decoder counts the groups' sizes in one pass and finds
the element of every decoded rank, all groups at once and in ascending order, in a second.
Everything else is O(changed elements). The encoder can read the
previous tensor as the tensor after the change plus the old values of the changed elements
(`old_values`), so a trainer codes against its advanced snapshot without copying it.

Each parameter becomes one uint8 tensor `{name}.compact` (see [`entry_names`]). Its layout,
little-endian, is:

| field | size | meaning |
| --- | --- | --- |
| version | 1 byte | `2` |
| groups | 1 byte | number of exponent groups `G` (1-8) |
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

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import constriction
import numba
import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from .bitmasks import LANES, popcount
from .bitmasks import at_least as at_least_mask
from .changes import Encoding, SparseChange, index_dtype
from .errors import ApplyError, FormatError
from .parallel import parallel_map

__all__ = ["ENCODING", "decode_changes", "encode_changes", "entry_names"]

#: Value of the `encoding` metadata key for files in this encoding (its codec: `delta_sync.encodings`).
ENCODING = Encoding.COMPACT
#: Suffix of the one tensor each changed parameter is stored under.
SUFFIX = ".compact"

_VERSION = 2
# Each group boundary costs a pass over the tensor on both sides; 8 groups keep all but ~1%
# of the gain of one group per exponent on real training streams.
_MAX_GROUPS = 8
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
_MIN_GROUPED_CHANGES = 256
# At most this many exponent atoms enter the search for group boundaries (coarsened beyond).
_MAX_ATOMS = 48
# A group boundary costs a pass over the tensor: it must save more than this many bits per element.
_GROUP_PENALTY = 1 / 1024
# Boundaries are chosen from the exponents of a sample: one element in _SAMPLE_EVERY, in runs
# of _SAMPLE_RUN, and at least _SAMPLE_RUNS runs.
_SAMPLE_EVERY = 32
_SAMPLE_RUNS = 16
_SAMPLE_RUN = 1024
# Log-scale frequencies: probability of a value class is 2^((q - 1) / 4) for q in 1..255.
_QUARTER_POWERS = np.array([1.0, 1.189207115002721, 1.4142135623730951, 1.681792830507429])

_Categorical = constriction.stream.model.Categorical
_UNIFORM = constriction.stream.model.Uniform()
_UNIFORM_64 = constriction.stream.model.Uniform(64)


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
    changes: Mapping[str, SparseChange],
    previous: Mapping[str, torch.Tensor],
    *,
    old_values: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Encode the changed elements of each parameter in the compact encoding.

    Args:
        changes: Parameter name -> its changed elements (CPU; indices strictly ascending).
        previous: Parameter name -> the full bf16 tensor *before* the change: the trainer's
            snapshot before it advances, which equals what every replica holds. With
            `old_values`, the tensor *after* the change instead (e.g. the snapshot once
            advanced), read as before through `old_values`: no copy of it is made.
        old_values: Parameter name -> the bf16 values the changed elements had before,
            aligned with `changes[name].indices` (as `ChangeSet.old_values` holds them).

    Returns:
        The safetensors entries to store: one 1-D uint8 tensor per parameter, named as
        [`entry_names`] says.

    Example:
        ```python
        >>> entries = encode_changes({"w": SparseChange(indices, values)}, {"w": w_before})
        >>> entries = encode_changes(change_set.changes, detector.snapshot, old_values=change_set.old_values)
        >>> save_file(entries, "delta.safetensors", metadata={"encoding": ENCODING, ...})
        ```
    """
    # By changed count: `previous` may build each tensor on access.
    names = _largest_first(changes, lambda name: len(changes[name]))
    streams = parallel_map(
        lambda name: _encode_tensor(
            name, changes[name], previous[name], None if old_values is None else old_values[name]
        ),
        names,
    )
    encoded = dict(zip(names, streams))
    return {entry_names(name)[0]: torch.from_numpy(encoded[name]) for name in sorted(changes)}


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
    names = _largest_first(shapes, lambda name: math.prod(shapes[name]))
    decoded = parallel_map(lambda name: _decode_tensor(name, entries[name + SUFFIX], previous[name], source), names)
    by_name = dict(zip(names, decoded))
    return {name: by_name[name] for name in sorted(shapes)}


def _largest_first(names: Iterable[str], size: Callable[[str], int]) -> list[str]:
    # Large tensors first, so that the thread pool does not end on one long task.
    return sorted(names, key=lambda name: (-size(name), name))


# -- one tensor ------------------------------------------------------------------------------


def _flat_bits(tensor: torch.Tensor, dtype: torch.dtype = torch.int16) -> np.ndarray:
    """The bit patterns of a CPU tensor as a flat array (no copy when contiguous).

    Reshaped by numpy: a torch `reshape` costs more than the rest of a small tensor's encode.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.cpu().contiguous()
    return tensor.view(dtype).numpy().reshape(-1)


def _position_dtype(numel: int) -> type:
    # int32 positions wherever they fit: half the memory traffic of int64.
    return np.int32 if numel < 2**31 else np.int64


def _encode_tensor(
    name: str, change: SparseChange, previous: torch.Tensor, old_values: torch.Tensor | None = None
) -> np.ndarray:
    bits, indices, new_bits, old_bits = _encoder_inputs(name, change, previous, old_values)
    # One pass over the changes: value codes, their classes, and changes per (exponent, class),
    # from which every choice of the encoder is made.
    zigzag, classes, class_counts = _classify(new_bits, old_bits)
    boundaries = _choose_boundaries(
        bits, class_counts, lambda: _sample_counts(bits, indices, old_bits, patched=old_values is not None)
    )
    edges = np.array(boundaries, np.int64)
    quantized, sizes, changed = _group_tables(class_counts, edges)
    tables = [row[:size] if size else None for row, size in zip(quantized, sizes.tolist())]
    ops: list[_Op] = []
    if not boundaries:
        groups = _Groups([bits.size], changed.tolist(), tables)
        if indices.size:
            groups.encode(0, ops, indices, classes, zigzag)
        return _assemble(edges, changed, quantized, sizes, ops)
    # One pass over the tensor: each change's rank among its group, and the groups' sizes,
    # with the changes ordered by group (stable).
    counts = np.zeros(len(boundaries) + 1, np.int64)
    ranks, classes, zigzag = _rank_changes(bits, edges, indices, old_bits, classes, zigzag, changed, counts)
    groups = _Groups(counts.tolist(), changed.tolist(), tables)
    start = 0
    for group, count in enumerate(groups.changed):
        if count:
            chosen = slice(start, start + count)
            groups.encode(group, ops, ranks[chosen], classes[chosen], zigzag[chosen])
            start += count
    return _assemble(edges, changed, quantized, sizes, ops)


def _encoder_inputs(
    name: str, change: SparseChange, previous: torch.Tensor, old_values: torch.Tensor | None
) -> tuple[np.ndarray, ...]:
    """`(tensor bits, indices, new bits, old bits)` as flat arrays, checked."""
    if previous.dtype != torch.bfloat16:
        raise TypeError(f"{name}: previous tensor is {previous.dtype}, expected bfloat16")
    bits = _flat_bits(previous)
    numel = bits.size
    indices = _flat_bits(change.indices, change.indices.dtype).astype(_position_dtype(numel), copy=False)
    new_bits = _flat_bits(change.values)
    if indices.size != new_bits.size:
        raise ValueError(f"{name}: {indices.size} indices but {new_bits.size} values")
    if indices.size and not _strictly_ascending(indices, numel):
        raise ValueError(f"{name}: indices must be strictly ascending positions in [0, {numel})")
    if old_values is None:
        return bits, indices, new_bits, bits[indices]
    old_bits = _flat_bits(old_values)
    if old_bits.size != indices.size:
        raise ValueError(f"{name}: {indices.size} indices but {old_bits.size} old values")
    return bits, indices, new_bits, old_bits


@numba.njit(nogil=True, cache=True)
def _strictly_ascending(indices: np.ndarray, numel: int) -> bool:
    if indices[0] < 0 or indices[-1] >= numel:
        return False
    for i in range(1, indices.size):
        if indices[i] <= indices[i - 1]:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _classify(new_bits: np.ndarray, old_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(zigzag values, their classes, changes per (old exponent, class))` in one pass."""
    zigzag = np.empty(new_bits.size, np.uint16)
    classes = np.empty(new_bits.size, np.uint8)
    counts = np.zeros((256, _CLASSES), np.int64)
    for i in range(new_bits.size):
        diff = np.int16(new_bits[i] - old_bits[i])  # wraps, as the bit patterns do
        code = np.uint16((np.int32(diff) << 1) ^ (np.int32(diff) >> 15))
        value_class = _class_of(code)
        zigzag[i] = code
        classes[i] = value_class
        counts[(old_bits[i] >> 7) & 0xFF, value_class] += 1
    return zigzag, classes, counts


@numba.njit(inline="always")
def _class_of(code):
    """Value class of a zigzag code: codes below 16 are their own class; above, one class per
    bit length (the bits below the leading one are coded raw)."""
    if code < _DIRECT_CLASSES:
        return np.uint8(code)
    length = 0
    while code:
        code >>= 1
        length += 1
    return np.uint8(length + 11)


def _sample_counts(bits: np.ndarray, indices: np.ndarray, old_bits: np.ndarray, *, patched: bool) -> np.ndarray:
    """Elements per exponent in a sample of the previous tensor: one element in
    `_SAMPLE_EVERY` (at least `_SAMPLE_RUNS * _SAMPLE_RUN`), in runs spread evenly over the
    tensor (runs rather than a stride, so that the sample reads a few cache lines rather
    than one per element). With `patched`, `bits` is the tensor after the change, and its
    changed elements count with their old exponent."""
    runs = max(_SAMPLE_RUNS, bits.size // (_SAMPLE_EVERY * _SAMPLE_RUN))
    if bits.size <= runs * _SAMPLE_RUN:
        runs, step, length = 1, 0, bits.size
    else:
        step, length = (bits.size - _SAMPLE_RUN) // (runs - 1), _SAMPLE_RUN
    return _run_histogram(bits, runs, step, length, indices, old_bits, patched)


@numba.njit(nogil=True, cache=True)
def _run_histogram(bits, runs, step, length, indices, old_bits, patched):
    counts = np.zeros(256, np.int64)
    for run in range(runs):
        for i in range(run * step, run * step + length):
            counts[(bits[i] >> 7) & 0xFF] += 1
    if patched:
        j = 0
        for run in range(runs):
            start = run * step
            while j < indices.size and indices[j] < start:
                j += 1
            while j < indices.size and indices[j] < start + length:
                counts[(bits[indices[j]] >> 7) & 0xFF] -= 1
                counts[(old_bits[j] >> 7) & 0xFF] += 1
                j += 1
    return counts


@numba.njit(nogil=True, cache=True)
def _rank_changes(bits, boundaries, indices, old_bits, classes, zigzag, changed, counts):
    """Rank of each change among the members of its group (by previous exponent), and the
    group sizes (into `counts`): `(ranks, classes, zigzag)` ordered by group, stable.

    `bits` is the previous tensor, except that at the changed positions the old values
    come from `old_bits`; `changed` holds the changes per group. Per 64 elements, one mask
    per group boundary marks the elements whose exponent is at least the boundary (a
    vector compare, [`delta_sync.bitmasks.at_least`]); the members of group `g` before a
    position are those at least its lower boundary less those at least its upper one, so
    a change's rank is two `popcount`s of its masks below it plus the counts before its
    64 elements.
    """
    numel = bits.size
    groups = counts.size
    group_of = _group_table(boundaries)
    ranks = np.empty(indices.size, indices.dtype)
    sorted_classes = np.empty_like(classes)
    sorted_zigzag = np.empty_like(zigzag)
    slots = np.zeros(groups, np.int64)
    for group in range(1, groups):
        slots[group] = slots[group - 1] + changed[group - 1]
    # Edge e is the lower boundary of group e: edge 0 holds every element, edge `groups`
    # none. `at_least[e]`: elements before the current 64 whose exponent is at least edge e,
    # counted as the tensor holds them (new values at changed positions); `corrections[e]`
    # turns that into the count of their old values, for the changes seen so far.
    thresholds = _thresholds(boundaries)
    at_least = np.zeros(groups + 1, np.int64)
    corrections = np.zeros(groups + 1, np.int64)
    masks = np.zeros(groups + 1, np.uint64)
    masks[0] = ~np.uint64(0)
    whole = numel - numel % LANES
    j = 0
    for start in range(0, whole, LANES):
        at_least[0] = start
        for edge in range(1, groups):
            masks[edge] = at_least_mask(bits, start, thresholds[edge])
        while j < indices.size and indices[j] < start + LANES:
            i = np.int64(indices[j])
            below = (np.uint64(1) << np.uint64(i - start)) - np.uint64(1)
            old = (old_bits[j] >> 7) & 0xFF
            group = group_of[old]
            lower = at_least[group] + corrections[group] + np.int64(popcount(masks[group] & below))
            upper = at_least[group + 1] + corrections[group + 1] + np.int64(popcount(masks[group + 1] & below))
            _place(j, group, lower - upper, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag)
            new = (bits[i] >> 7) & 0xFF
            if new != old:
                for edge in range(1, groups):
                    corrections[edge] += np.int64(old >= boundaries[edge - 1]) - np.int64(new >= boundaries[edge - 1])
            j += 1
        for edge in range(1, groups):
            at_least[edge] += np.int64(popcount(masks[edge]))
    for i in range(whole, numel):  # the last elements, fewer than 64: one at a time
        at_least[0] = i
        if j < indices.size and indices[j] == i:
            exponent = (old_bits[j] >> 7) & 0xFF
            group = group_of[exponent]
            lower = at_least[group] + corrections[group]
            upper = at_least[group + 1] + corrections[group + 1]
            _place(j, group, lower - upper, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag)
            j += 1
        else:
            exponent = (bits[i] >> 7) & 0xFF
        for edge in range(1, groups):
            at_least[edge] += np.int64(exponent >= boundaries[edge - 1])
    at_least[0] = numel
    for group in range(groups):
        counts[group] = at_least[group] + corrections[group] - at_least[group + 1] - corrections[group + 1]
    return ranks, sorted_classes, sorted_zigzag


@numba.njit(inline="always")
def _place(j, group, rank, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag):
    """Put change `j`, of `rank` in `group`, in the group's next slot."""
    slot = slots[group]
    ranks[slot] = rank
    sorted_classes[slot] = classes[j]
    sorted_zigzag[slot] = zigzag[j]
    slots[group] = slot + 1


def _assemble(
    boundaries: np.ndarray, changed: np.ndarray, tables: np.ndarray, sizes: np.ndarray, ops: list[_Op]
) -> np.ndarray:
    """The stream: the header (`_group_tables`' `tables`, `sizes` and `changed`), then the ANS
    words of `ops` (pushed in reverse: ANS is a stack)."""
    coder = constriction.stream.stack.AnsCoder()
    for op in reversed(ops):
        op.encode(coder)
    return _stream(boundaries, changed, tables, sizes, coder.get_compressed())


@numba.njit(nogil=True, cache=True)
def _stream(boundaries, changed, tables, sizes, words):
    """Header and words as bytes (the layout in the module's docstring)."""
    groups = changed.size
    out = np.empty(2 + boundaries.size + groups * (10 + 1 + _CLASSES) + 10 + 4 * words.size, np.uint8)
    out[0] = _VERSION
    out[1] = groups
    at = 2
    for boundary in boundaries:
        out[at] = boundary
        at += 1
    for group in range(groups):
        at = _put_varint(out, at, changed[group])
        if changed[group]:
            out[at] = sizes[group] - 1
            out[at + 1 : at + 1 + sizes[group]] = tables[group, : sizes[group]]
            at += 1 + sizes[group]
    at = _put_varint(out, at, words.size)
    for word in words:  # little-endian, whatever the machine
        for byte in range(4):
            out[at] = (word >> np.uint32(8 * byte)) & np.uint32(0xFF)
            at += 1
    return out[:at].copy()


@numba.njit(inline="always")
def _put_varint(out, at, value):
    while value >= 0x80:
        out[at] = (value & 0x7F) | 0x80
        value >>= 7
        at += 1
    out[at] = value
    return at + 1


def _decode_tensor(name: str, entry: torch.Tensor, previous: torch.Tensor, source: str) -> SparseChange:
    where = f"{source}: {name}{SUFFIX}"
    if entry.dtype != torch.uint8 or entry.dim() != 1:
        raise FormatError(f"{where} must be a 1-D uint8 tensor, got {entry.dim()}-D {entry.dtype}")
    prev_bits = _flat_bits(previous)
    numel = prev_bits.size
    reader = _Reader(entry.contiguous().numpy(), where)
    header = _Header.read(reader, numel)
    words = reader.rest_as_words(header.words)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
    except ValueError as exc:
        raise FormatError(f"{where}: damaged entropy-coded data ({exc})") from None
    boundaries = np.array(header.boundaries, np.int64)
    counts = _group_counts(prev_bits, boundaries).tolist()
    for group, (changed, count) in enumerate(zip(header.changed, counts)):
        if changed > count:
            raise FormatError(f"{where}: group {group} claims {changed} changes among {count} elements")
    try:
        indices, zigzag = _decode_groups(prev_bits, boundaries, _Groups(counts, header.changed, header.tables), coder)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if not coder.is_empty():
        raise FormatError(f"{where}: entropy-coded data does not end where the changes do; the stream is damaged")
    return SparseChange(
        indices=torch.from_numpy(indices.astype(np.int32 if index_dtype(numel) == torch.int32 else np.int64)),
        values=torch.from_numpy(_unzigzag(zigzag, prev_bits[indices])).view(torch.bfloat16),
    )


def _decode_groups(
    prev_bits: np.ndarray, boundaries: np.ndarray, groups: _Groups, coder
) -> tuple[np.ndarray, np.ndarray]:
    """`(indices, zigzag)` of all changes, ascending, from the groups' streams."""
    ranks, zigzags = [], []
    for group, changed in enumerate(groups.changed):
        group_ranks, zigzag = (
            groups.decode(group, coder) if changed else (np.zeros(0, np.int64), np.zeros(0, np.uint16))
        )
        ranks.append(group_ranks.astype(np.int64, copy=False))
        zigzags.append(zigzag)
    if len(ranks) == 1:
        return ranks[0], zigzags[0]
    ends = np.cumsum([r.size for r in ranks])
    positions, sources = _select(prev_bits, boundaries, np.concatenate(ranks), ends - [r.size for r in ranks], ends)
    if positions.size != ends[-1]:  # cannot happen: every rank was checked against its group's size
        raise FormatError("decoded positions fall outside their groups; the stream is damaged")
    return positions, np.concatenate(zigzags)[sources]


@numba.njit(nogil=True, cache=True)
def _group_counts(bits, boundaries):
    """Members of each exponent group, from one mask per group boundary per 64 elements."""
    groups = boundaries.size + 1
    group_of = _group_table(boundaries)
    at_least = np.zeros(groups + 1, np.int64)  # per edge, as in `_rank_changes`
    thresholds = _thresholds(boundaries)
    whole = bits.size - bits.size % LANES
    for start in range(0, whole, LANES):
        for edge in range(1, groups):
            at_least[edge] += np.int64(popcount(at_least_mask(bits, start, thresholds[edge])))
    at_least[0] = whole
    counts = np.empty(groups, np.int64)
    for group in range(groups):
        counts[group] = at_least[group] - at_least[group + 1]
    for i in range(whole, bits.size):  # the last elements, fewer than 64
        counts[group_of[(bits[i] >> 7) & 0xFF]] += 1
    return counts


@numba.njit(nogil=True, cache=True)
def _select(bits, boundaries, ranks, starts, ends):
    """Positions of the members of each group with the given ranks, in one pass, ascending.

    `ranks[starts[g]:ends[g]]` are group `g`'s, ascending and each below its size. Returns
    `(positions, sources)`: the positions found, ascending, and for each the index into
    `ranks` it answers (fewer only if a rank is out of range).

    Per 64 elements, the members of group `g` are the mask of its lower boundary less that
    of its upper one; where a group's wanted rank falls among them, the member is found by
    clearing the mask's lowest bits, and the members found are written out in position order.
    """
    groups = starts.size
    group_of = _group_table(boundaries)
    positions = np.empty(ranks.size, np.int64)
    sources = np.empty(ranks.size, np.int64)
    thresholds = _thresholds(boundaries)
    masks = np.zeros(groups + 1, np.uint64)
    masks[0] = ~np.uint64(0)
    following = starts.copy()
    members = np.zeros(groups, np.int64)  # members of each group before the current 64
    source_at = np.empty(LANES, np.int64)  # for each element found here, its index into `ranks`
    found = 0
    whole = bits.size - bits.size % LANES
    for start in range(0, whole, LANES):
        for edge in range(1, groups):
            masks[edge] = at_least_mask(bits, start, thresholds[edge])
        hits = np.uint64(0)
        for group in range(groups):
            mine = masks[group] & ~masks[group + 1]
            here = np.int64(popcount(mine))
            while following[group] < ends[group] and ranks[following[group]] < members[group] + here:
                skip = ranks[following[group]] - members[group]
                if skip < 0:  # not ascending: the stream is damaged, and so is this group
                    following[group] = ends[group]
                    break
                rest = mine
                for _ in range(skip):
                    rest &= rest - np.uint64(1)
                bit = trailing_zeros(rest)
                hits |= np.uint64(1) << np.uint64(bit)
                source_at[bit] = following[group]
                following[group] += 1
            members[group] += here
        while hits:
            bit = trailing_zeros(hits)
            positions[found] = start + bit
            sources[found] = source_at[bit]
            found += 1
            hits &= hits - np.uint64(1)
    for i in range(whole, bits.size):  # the last elements, fewer than 64
        group = group_of[(bits[i] >> 7) & 0xFF]
        if following[group] < ends[group] and ranks[following[group]] == members[group]:
            positions[found] = i
            sources[found] = following[group]
            found += 1
            following[group] += 1
        members[group] += 1
    return positions[:found], sources[:found]


@numba.njit(inline="always")
def _group_table(boundaries):
    """Group of each exponent, as a 256-entry table."""
    table = np.zeros(256, np.uint8)
    group = 0
    for exponent in range(256):
        while group < boundaries.size and boundaries[group] <= exponent:
            group += 1
        table[exponent] = group
    return table


@numba.njit(inline="always")
def _thresholds(boundaries):
    """Per edge (the lower boundary of each group, and one past the last), the magnitude
    `exponent << 7` that [`at_least_mask`] compares with; unused at the first and last."""
    thresholds = np.zeros(boundaries.size + 2, np.int16)
    for edge in range(1, boundaries.size + 1):
        thresholds[edge] = np.int16(boundaries[edge - 1] << 7)
    return thresholds


# -- header ----------------------------------------------------------------------------------


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
        if not 1 <= groups <= _MAX_GROUPS:
            raise FormatError(f"{reader.where}: group count is {groups}, expected 1 to {_MAX_GROUPS}")
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


def _choose_boundaries(
    prev_bits: np.ndarray, class_counts: np.ndarray, sample_counts: Callable[[], np.ndarray]
) -> list[int]:
    """Split the exponent line into at most `_MAX_GROUPS` groups so that the estimated coded
    size, plus a pass over the tensor per boundary, is smallest.

    The candidates are runs of single exponents (or of pairs) between two tails, which is
    where the change rate moves: every bound measured on real training streams is within
    1% of that of the best split into as many groups. A group of `n` elements with `k`
    changes costs `n H(k / n)` bits for its positions, the empirical entropy of its value
    classes, and its side information. Element counts are estimated from a sample of the
    previous tensor, `sample_counts()` (the boundaries are stored, so the decoder needs no estimate).
    """
    numel = prev_bits.size
    if numel < _MIN_GROUPED_NUMEL or class_counts.sum() < _MIN_GROUPED_CHANGES:
        return []
    atoms, n, h = _atoms(sample_counts(), class_counts, numel)
    if atoms.size <= 1:
        return []
    windows = _windows(atoms.size)
    best = _best_split(n, h, windows.starts, windows.ends, windows.ranges, windows.groups, _GROUP_PENALTY * numel)
    return atoms[windows.firsts[best, 1 : windows.groups[best]]].tolist()


@numba.njit(nogil=True, cache=True)
def _atoms(sampled, class_counts, numel):
    """`(atoms, n, h)`: the first exponent of each atom, and its estimated elements and its
    changes per value class present (an atom runs to the next one's first exponent).

    Atoms are the exponents present; runs without changes at either end are one atom each
    (a boundary inside them never pays); coarsened to at most `_MAX_ATOMS` runs. Element
    counts scale the sample's to the tensor, and are at least the changes.
    """
    exponents, classes = class_counts.shape
    changes = np.zeros(exponents, np.int64)
    present = np.zeros(classes, np.bool_)
    for exponent in range(exponents):
        for c in range(classes):
            changes[exponent] += class_counts[exponent, c]
            present[c] |= class_counts[exponent, c] > 0
    elements = np.maximum(sampled * (numel / sampled.sum()), changes)
    candidates = np.flatnonzero(elements)
    changed = np.flatnonzero(changes)
    low = np.searchsorted(candidates, changed[0])
    high = np.searchsorted(candidates, changed[-1] + 1)
    atoms = np.concatenate((candidates[:low][:1], candidates[low:high], candidates[high:][:1]))
    if atoms.size > _MAX_ATOMS:
        atoms = atoms[np.arange(_MAX_ATOMS) * atoms.size // _MAX_ATOMS]
    columns = np.flatnonzero(present)
    n = np.zeros(atoms.size)
    h = np.zeros((atoms.size, columns.size))
    for atom in range(atoms.size):
        end = atoms[atom + 1] if atom + 1 < atoms.size else exponents
        for exponent in range(atoms[atom], end):
            n[atom] += elements[exponent]
            for column in range(columns.size):
                h[atom, column] += class_counts[exponent, columns[column]]
    return atoms, n, h


@dataclass(frozen=True)
class _Windows:
    """The candidate splits of a run of atoms, and the atom ranges their groups are made of."""

    starts: np.ndarray  # first atom of each range
    ends: np.ndarray  # one past its last atom
    ranges: np.ndarray  # (splits, _MAX_GROUPS): the range of each group, padded with len(starts)
    firsts: np.ndarray  # (splits, _MAX_GROUPS): the first atom of each group
    groups: np.ndarray  # groups in each split


@functools.cache
def _windows(atoms: int) -> _Windows:
    """Splits of `atoms` atoms into a low tail, a run of single atoms (or of pairs), and a high tail."""
    splits = [[0]]  # first atom of each group
    for groups in range(2, _MAX_GROUPS + 1):
        for stride in (1, 2) if groups > 2 else (1,):
            for low in range(1, atoms - (groups - 2) * stride):
                splits.append([0, *range(low, low + (groups - 1) * stride, stride)])
    ranges: dict[tuple[int, int], int] = {}
    rows = np.zeros((len(splits), _MAX_GROUPS), np.intp)
    firsts = np.zeros((len(splits), _MAX_GROUPS), np.intp)
    for row, split in enumerate(splits):
        spans = list(zip(split, [*split[1:], atoms]))
        rows[row] = [*(ranges.setdefault(span, len(ranges)) for span in spans), *[-1] * (_MAX_GROUPS - len(spans))]
        firsts[row, : len(split)] = split
    rows[rows < 0] = len(ranges)  # an empty slot: the extra zero cost at the end
    starts, ends = (np.array(side, np.intp) for side in zip(*ranges))
    return _Windows(starts, ends, rows, firsts, np.array([len(split) for split in splits]))


@numba.njit(inline="always")
def _xlogx(x):
    return x * np.log2(x) if x > 1.0 else 0.0


@numba.njit(nogil=True, cache=True)
def _best_split(n, h, starts, ends, ranges, groups, boundary_bits):
    """The split of least estimated size: row of `ranges` (the atom ranges of its groups).

    A group of atoms `starts[i]..ends[i] - 1` (with `n` elements and `h` changes per value
    class, per atom) costs `n H(k / n)` bits for its positions plus `k` times the
    empirical entropy of its classes, which sum to `xlogx(n) - xlogx(n - k) -
    sum(xlogx(h))`, plus its value table; each boundary costs `boundary_bits`.
    """
    atoms, classes = h.shape
    cn = np.zeros(atoms + 1)
    ch = np.zeros((atoms + 1, classes))
    for atom in range(atoms):
        cn[atom + 1] = cn[atom] + n[atom]
        for c in range(classes):
            ch[atom + 1, c] = ch[atom, c] + h[atom, c]
    cost = np.zeros(starts.size + 1)  # the last: an empty slot of a split with fewer groups
    for r in range(starts.size):
        group_n = cn[ends[r]] - cn[starts[r]]
        group_k, present, entropy = 0.0, 0, 0.0
        for c in range(classes):
            count = ch[ends[r], c] - ch[starts[r], c]
            group_k += count
            present += count > 0
            entropy += _xlogx(count)
        bits = _xlogx(group_n) - _xlogx(max(group_n - group_k, 0.0)) - entropy + 24.0
        cost[r] = bits + 8.0 * (2 + present) if group_k > 0 else bits
    best, best_total = 0, np.inf
    for split in range(ranges.shape[0]):
        total = boundary_bits * (groups[split] - 1)
        for slot in range(ranges.shape[1]):
            total += cost[ranges[split, slot]]
        if total < best_total:
            best, best_total = split, total
    return best


# -- entropy-coded fields --------------------------------------------------------------------


@dataclass
class _Op:
    """One array of symbols pushed on the ANS stack with one model (or model family)."""

    symbols: np.ndarray
    model: object
    params: tuple = ()

    def encode(self, coder) -> None:
        if self.symbols.size:
            coder.encode_reverse(self.symbols.astype(np.int32, copy=False), self.model, *self.params)


def _decode(coder, count: int, model, *params) -> np.ndarray:
    if count == 0:
        return np.zeros(0, np.int32)
    try:
        if params:
            return coder.decode(model, *params)
        return coder.decode(model, count)
    except Exception as exc:  # constriction reports bad data as ValueError, others as its own types
        raise FormatError(f"damaged entropy-coded data ({exc})") from None


class _Groups:
    """The coding of a tensor's changes, group by group; the encoder and the decoder derive
    it alike from the group sizes, change counts and value tables.

    Per group with changes, the stream holds, in order: one joint symbol (the gap before the
    change, its value class) per changed element or, where more than half the group
    changed, the gaps between the unchanged elements and then the classes of the changed
    ones; the low bits of the gaps; the escaped gaps' lengths and bits; the low bits of the
    wide values.
    """

    def __init__(self, counts: list[int], changed: list[int], tables: list[np.ndarray | None]) -> None:
        self.counts = counts
        self.changed = changed
        self.tables = tables
        self.complement = [2 * k > n for n, k in zip(counts, changed)]
        # Elements whose gaps are coded: the changed ones, or the unchanged ones.
        self.coded = [n - k if flip else k for n, k, flip in zip(counts, changed, self.complement)]
        self.shifts = [_gap_shift(n, c) for n, c in zip(counts, self.coded)]
        self._gap_probabilities = _geometric(np.array(counts), np.array(self.coded), np.array(self.shifts))
        self._class_probabilities = _class_probabilities(tables)

    def encode(self, group: int, ops: list[_Op], ranks: np.ndarray, classes: np.ndarray, zigzag: np.ndarray) -> None:
        """Push the ops of one group's changes: `ranks` among the group, value `classes`, `zigzag` values."""
        shift, complement, table_size = self.shifts[group], self.complement[group], self.tables[group].size
        symbols, lows, lengths, raw, sizes = _group_fields(
            ranks, classes, zigzag, self.counts[group], complement, shift, table_size
        )
        if symbols.size:
            ops.append(_Op(symbols, self._positions_model(group)))
        if complement and table_size > 1:
            ops.append(_Op(classes, self._classes_model(group)))
        if symbols.size:
            _encode_bits(ops, lows, shift)
        # The lengths of the escaped tops' excess, then the raw bits of the excess and of the
        # wide values (one op: the decoder reads them chunk by chunk, in the same order).
        ops.append(_Op(lengths, _UNIFORM_64))
        ops.append(_Op(raw, _UNIFORM, (sizes,)))

    def decode(self, group: int, coder) -> tuple[np.ndarray, np.ndarray]:
        """`(ranks, zigzag)` of one group's changes, mirroring [`encode`]."""
        tops, classes = self._decode_symbols(group, coder)
        ranks = self._decode_ranks(group, coder, tops)
        return ranks, self._decode_values(group, coder, classes)

    def _decode_symbols(self, group: int, coder) -> tuple[np.ndarray, np.ndarray]:
        """`(tops, classes)`: the high parts of the coded gaps, the value classes of the changes."""
        table, changed, coded = self.tables[group], self.changed[group], self.coded[group]
        tops = _decode(coder, coded, self._positions_model(group)) if coded else np.zeros(0, np.int32)
        if not self.complement[group]:
            return np.divmod(tops, table.size)
        classes = _decode(coder, changed, self._classes_model(group)) if table.size > 1 else np.zeros(changed, np.int32)
        return tops, classes

    def _decode_ranks(self, group: int, coder, tops: np.ndarray) -> np.ndarray:
        """Ranks of the changed elements among the group, from the tops, low bits and escapes of the gaps."""
        count, shift = self.counts[group], self.shifts[group]
        lows = np.zeros(0, np.int64)
        if tops.size:
            lows = _decode_bits(coder, tops.size, shift)
            escaped = tops >= _TOPS
            if escaped.any():
                tops = tops.astype(np.int64)
                lengths = _decode(coder, int(escaped.sum()), _UNIFORM_64).astype(np.int64) + 1
                if lengths.max() > 48:
                    raise FormatError(f"an escaped gap of group {group} is longer than 2^48; the stream is damaged")
                tops[escaped] = _decode_raw(coder, lengths - 1) + (np.int64(1) << (lengths - 1)) + _TOPS - 1
        ranks = _ranks_of(tops.astype(np.int64, copy=False), lows, shift, count, self.complement[group])
        if ranks is None:
            raise FormatError(f"decoded positions run past the end of group {group}; the stream is damaged")
        return ranks

    def _decode_values(self, group: int, coder, classes: np.ndarray) -> np.ndarray:
        """Zigzag values from their classes and, for the wide classes, their raw low bits."""
        zigzag = classes.astype(np.uint16)
        if self.tables[group].size > _DIRECT_CLASSES:
            wide = classes >= _DIRECT_CLASSES
            widths = classes[wide].astype(np.int64) - 12
            zigzag[wide] = _decode_raw(coder, widths) + (np.int64(1) << widths)
        return zigzag

    def _positions_model(self, group: int):
        gaps = self._gap_probabilities[group]
        if self.complement[group]:
            return _Categorical(gaps, perfect=False)
        classes = self._class_probabilities[group, : self.tables[group].size]
        return _Categorical((gaps[:, None] * classes).reshape(-1), perfect=False)

    def _classes_model(self, group: int):
        return _Categorical(self._class_probabilities[group, : self.tables[group].size], perfect=False)


@numba.njit(nogil=True, cache=True)
def _group_fields(ranks, classes, zigzag, count, complement, shift, table_size):
    """Every field one group codes, in one pass: `(symbols, lows, lengths, raw, sizes)`.

    `symbols` and `lows` are those of [`_position_symbols`]. Each escaped top's excess is
    coded as its bit length less one (`lengths`) and the bits below its leading one; each
    wide value (class 16 and up) as the bits below its leading one. Those bits, the
    escapes' and then the wide values', are cut into chunks of at most `_CHUNK_BITS` (all
    first chunks, then all second chunks, ...): `raw` holds the chunks and `sizes` the
    range of each (`2^bits`).
    """
    symbols, lows, excess = _position_symbols(ranks, classes, count, complement, shift, table_size)
    escaped_widths = np.empty(excess.size, np.int64)  # bit length less one
    for e in range(excess.size):
        width, rest = -1, excess[e]
        while rest:
            rest >>= 1
            width += 1
        escaped_widths[e] = width
    lengths = escaped_widths.astype(np.int32)
    escaped_values = excess - (np.int64(1) << escaped_widths)
    wide = classes >= _DIRECT_CLASSES
    wide_widths = classes[wide].astype(np.int64) - 12
    wide_values = zigzag[wide].astype(np.int64) - (np.int64(1) << wide_widths)
    total = _chunk_count(escaped_widths) + _chunk_count(wide_widths)
    raw = np.empty(total, np.int32)
    sizes = np.empty(total, np.int32)
    filled = _put_chunks(escaped_values, escaped_widths, raw, sizes, 0)
    _put_chunks(wide_values, wide_widths, raw, sizes, filled)
    return symbols, lows, lengths, raw, sizes


@numba.njit(inline="always")
def _chunk_count(widths):
    total = 0
    for width in widths:
        total += (width + _CHUNK_BITS - 1) // _CHUNK_BITS
    return total


@numba.njit(inline="always")
def _put_chunks(values, widths, raw, sizes, filled):
    """The low `widths` bits of `values` as chunks, from `filled`: returns where they end."""
    widest = 0
    for width in widths:
        widest = max(widest, width)
    for offset in range(0, widest, _CHUNK_BITS):
        for i in range(values.size):
            if widths[i] > offset:
                bits = min(widths[i] - offset, _CHUNK_BITS)
                raw[filled] = np.int32((values[i] >> offset) & ((np.int64(1) << bits) - 1))
                sizes[filled] = np.int32(1 << bits)
                filled += 1
    return filled


@numba.njit(nogil=True, cache=True)
def _position_symbols(ranks, classes, count, complement, shift, table_size):
    """The coded fields of one group's positions, in one pass: `(symbols, lows, excess)`.

    The coded elements are the changed ones (`ranks`, ascending) or, with `complement`, the
    group's other members. For each, the gap since the previous one splits into its top
    (`gap >> shift`) and its `shift` low bits; a symbol is the top, or `_TOPS` (an escape)
    with `top - _TOPS + 1` in `excess`, joined with the value class where changed elements
    are coded.
    """
    coded = count - ranks.size if complement else ranks.size
    symbols = np.empty(coded, np.int32)
    lows = np.empty(coded if shift else 0, np.int64)
    excess = np.empty(coded, np.int64)
    escaped = 0
    mask = (np.int64(1) << shift) - 1
    previous = np.int64(-1)
    r = 0
    position = np.int64(-1)
    for j in range(coded):
        if complement:  # the next member that is not among the ranks
            position += 1
            while r < ranks.size and ranks[r] == position:
                position += 1
                r += 1
        else:
            position = np.int64(ranks[j])
        gap = position - previous - 1
        previous = position
        top = gap >> shift
        if shift:
            lows[j] = gap & mask
        if top >= _TOPS:
            excess[escaped] = top - _TOPS + 1
            escaped += 1
            top = _TOPS
        symbols[j] = top if complement else top * table_size + classes[j]
    return symbols, lows, excess[:escaped]


@numba.njit(nogil=True, cache=True)
def _ranks_of(tops, lows, shift, count, complement):
    """Ranks among the group of its changed elements, from the coded gaps (`(top << shift) +
    low` before each coded element), which are the changed elements or, with `complement`,
    the others; None where they run past the group's `count` members."""
    coded = np.empty(tops.size, np.int64)
    position = -1
    for j in range(tops.size):
        if tops[j] > count >> shift:  # also keeps the shift below from overflowing
            return None
        position += (tops[j] << shift) + lows[j] + 1
        if position >= count:
            return None
        coded[j] = position
    if not complement:
        return coded
    others = np.empty(count - coded.size, np.int64)
    j = 0
    for member in range(count):
        if j < coded.size and coded[j] == member:
            j += 1
        else:
            others[member - j] = member
    return others


def _gap_shift(count: int, coded: int) -> int:
    """Low bits of a gap coded raw: the mean gap's bit length less 3 (so the coded top part
    of a typical gap falls in 4..8)."""
    return max(0, ((count - coded) // coded).bit_length() - 3) if coded else 0


@numba.njit(nogil=True, cache=True)
def _geometric(counts, coded, shifts):
    """Per group, the probabilities of `gap >> shift` below `_TOPS` (the last entry escapes
    larger ones): gaps between `coded` marked elements among `count` are geometric.

    Only exact IEEE operations (division, subtraction, products, one rounding each, none
    fused) enter the probabilities, so the trainer and every replica build the same models
    on any machine: `ratio = (1 - coded / count)` squared `shift` times, `ratio^t` by
    sequential products, times `1 - ratio` below `_TOPS`.
    """
    powers = np.empty((counts.size, _TOPS + 1))
    for group in range(counts.size):
        ratio = 1.0 - coded[group] / counts[group] if coded[group] else 0.0
        for _ in range(shifts[group]):
            ratio *= ratio
        power = 1.0
        for top in range(_TOPS):
            powers[group, top] = power * (1.0 - ratio)
            power *= ratio
        powers[group, _TOPS] = power
    return powers


def _encode_bits(ops: list[_Op], values: np.ndarray, width: int) -> None:
    """The low `width` bits of each value, uniformly, in chunks of up to 16 bits."""
    for offset in range(0, width, _CHUNK_BITS):
        bits = min(width - offset, _CHUNK_BITS)
        chunk = (values >> offset) & ((1 << bits) - 1) if width > _CHUNK_BITS else values
        ops.append(_Op(chunk, constriction.stream.model.Uniform(1 << bits)))


def _decode_bits(coder, count: int, width: int) -> np.ndarray:
    values = np.zeros(count, np.int64)
    for offset in range(0, width, _CHUNK_BITS):
        bits = min(width - offset, _CHUNK_BITS)
        values |= _decode(coder, count, constriction.stream.model.Uniform(1 << bits)).astype(np.int64) << offset
    return values


def _decode_raw(coder, widths: np.ndarray) -> np.ndarray:
    values = np.zeros(widths.size, np.int64)
    for offset in range(0, int(widths.max(initial=0)), _CHUNK_BITS):
        chosen = widths > offset
        bits = np.minimum(widths[chosen] - offset, _CHUNK_BITS)
        chunk = _decode(coder, int(chosen.sum()), _UNIFORM, (np.int64(1) << bits).astype(np.int32))
        values[chosen] |= chunk.astype(np.int64) << offset
    return values


def _unzigzag(zigzag: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
    diff = (zigzag >> 1).view(np.int16) ^ -(zigzag & 1).view(np.int16)
    return old_bits + diff


@numba.njit(nogil=True, cache=True)
def _group_tables(class_counts, boundaries):
    """Per exponent group: its value table and its changes, `(quantized, sizes, changed)`.

    A group's table holds, for each value class up to the highest present (`sizes`), a
    log-scale frequency `round(4 log2(count)) + 1` clipped to a byte, 0 for an absent class.
    """
    groups = boundaries.size + 1
    exponents, classes = class_counts.shape
    group_of = _group_table(boundaries)
    counts = np.zeros((groups, classes), np.int64)
    for exponent in range(exponents):
        for c in range(classes):
            counts[group_of[exponent], c] += class_counts[exponent, c]
    quantized = np.zeros((groups, classes), np.uint8)
    sizes = np.zeros(groups, np.int64)
    changed = np.zeros(groups, np.int64)
    for group in range(groups):
        for c in range(classes):
            if counts[group, c] > 0:
                quantized[group, c] = np.uint8(min(np.rint(4 * np.log2(counts[group, c])) + 1, 255))
                sizes[group] = c + 1
                changed[group] += counts[group, c]
    return quantized, sizes, changed


def _class_probabilities(tables: list[np.ndarray | None]) -> np.ndarray:
    """Per group, the probability of each value class (up to `_CLASSES`) from its table."""
    quantized = np.zeros((len(tables), _CLASSES), np.uint8)
    for row, table in zip(quantized, tables):
        if table is not None:
            row[: table.size] = table
    return _QUANTIZED_PROBABILITY[quantized]


# Probability of a value class from its byte in a value table: 2^((q - 1) / 4), 0 for absent.
_QUANTIZED_PROBABILITY = np.concatenate([[0.0], np.ldexp(_QUARTER_POWERS[np.arange(255) % 4], np.arange(255) // 4)])

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
  step in ULPs also follows the exponent.

Both are coded with this package's own range ANS coder ([`delta_sync.rans`]: static integer
frequency tables, 4 interleaved states where a tensor has 1024 changes or more, else 1;
compiled, and run without the GIL). Encoding and decoding are one compiled call per thread,
each for its share of the tensors (handed over by address, [`delta_sync.addresses`]): a
call returns to Python, and so waits for the GIL, once for its whole share, rather than
once per pass per tensor, which costs most where another thread runs Python (a trainer's
training loop, a replica's vLLM). The tables are not sent: each side builds them from the header with integer
arithmetic only, so the trainer and every replica build the same ones on any machine (the
gap model from the group's size and change count, in 31-bit fixed point; the value model
from the value table's log-scale bytes). The passes over whole tensors are compiled too
(numba, cached on disk: the first call in a process loads them in about a second, the very
first on a machine compiles them in about a minute on 2 cores). They read 64
elements at a time into one mask per group boundary (the elements whose exponent is at
least the boundary, a vector compare: [`delta_sync.bitmasks`]), so that counting a group's
members is a `popcount`: the encoder reads the previous tensor once and takes each change's
rank from the masks below it; the decoder takes the groups' sizes from the header (they set
its gap models) and finds the element of every decoded rank, all groups at once and in
ascending order, in one pass that counts the groups' members too, so that a stream coded
against other weights is refused. Where the machine has a fast bit deposit (x86-64 BMI2),
that pass deposits each group's wanted ranks onto its members rather than branching on
them ([`delta_sync.bitmasks.deposit`]).
Everything else is O(changed elements). The encoder can read the
previous tensor as the tensor after the change plus the old values of the changed elements
(`old_values`), so a trainer codes against its advanced snapshot without copying it.

Each parameter becomes one uint8 tensor `{name}.compact` (see [`entry_names`]). Its layout,
little-endian, is:

| field | size | meaning |
| --- | --- | --- |
| version | 1 byte | `5` (read too: version 4, the same with one coder state below 16384 changes rather than 1024, and version 3, version 4 without the group sizes; version 2, coded with the `constriction` library, is refused with an error naming it) |
| groups | 1 byte | number of exponent groups `G` (1-8) |
| boundaries | `G - 1` bytes | first exponent of groups `1..G-1`, strictly ascending |
| group sizes | `G - 1` varints | elements in groups `0..G-2` of the previous tensor (the last group holds the rest) |
| per group: changed | varint | changed elements in the group |
| per group with changes: value table | 1 + `C` bytes | highest value class `C - 1`, then a log-scale frequency per class (`round(4 log2(count)) + 1`, 0 for an absent class) |
| words | varint | number of coder words that follow |
| coder words | rest | uint32 words of [`delta_sync.rans`]: the final coder states, then the words in decoding order |

The coder's symbols, group after group (those with changes), are (see [`_encode_groups`]):

| symbols | model |
| --- | --- |
| per changed element: the top of the gap since the previous one (`gap >> shift`, `64` escapes), then its value class | the group's gap table (65 symbols), its value table (`C` symbols; no class symbol where `C` is 1) |
| or, where more than half the group changed: the tops of the gaps between the unchanged elements, then the classes of the changed ones | the same tables |
| the `shift` low bits of every gap, in chunks of at most 16 bits (all first chunks, then all second ones, ...) | raw bits |
| per escaped top: the bit length less one of `top - 63` (6 bits), then the bits below its leading one (chunked) | raw bits |
| per wide value (class 16 and up, zigzag code `z`): the bits below the leading one of `z` (chunked) | raw bits |

`shift` is the bit length of the group's mean gap less 3; value class `c < 16` is the zigzag
code `c` itself (0 never occurs), `c >= 16` a code of bit length `c - 11`.

Decoding validates every count against the tensor's size before allocating anything, so a
damaged stream raises [`FormatError`] (or, at worst, decodes to weights that the
receiver's checksums then refuse); it never hangs or allocates beyond the tensor's size.
The compiled functions that read a stream's bytes (anyone who can write the bucket writes
them) are [`_read_headers`] (every read checked against the stream's length, every count
against the tensor's size), [`_decode_tensors`] and what it calls: [`_decode_groups`] and
`rans`' decoders (each symbol written into an array of the count the header gives, each
word read checked against the words' count), [`_ranks_of`] (a gap past the group's members,
or past the slots its changes leave, is an error before anything is written: a stream
coding the unchanged members once wrote past its group's slots, a heap overflow), and the
select passes (each rank below its group's claimed size, the writes bounded by the ranks'
count). CI runs the codec's tests and the decoder fuzzer with `NUMBA_BOUNDSCHECK=1` too.

Example:
    ```python
    >>> entries = encode_changes(change_set.changes, previous=snapshot)
    >>> entries.keys()
    dict_keys(['model.norm.weight.compact', ...])
    >>> changes = decode_changes(entries, previous=held, shapes=shapes, source="deltas/step_00000002.safetensors")
    ```
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from . import rans
from .addresses import address_of, on_host, view
from .bitmasks import FAST_BIT_GATHER, LANES, above, deposit, popcount
from .changes import Encoding, SparseChange, index_dtype
from .compile_cache import njit_cached
from .errors import ApplyError, FormatError
from .parallel import parallel_map, shares

__all__ = ["ENCODING", "decode_changes", "encode_changes", "entry_names"]

#: Value of the `encoding` metadata key for files in this encoding (its codec: `delta_sync.encodings`).
ENCODING = Encoding.COMPACT
#: Suffix of the one tensor each changed parameter is stored under.
SUFFIX = ".compact"

_VERSION = 5
# Versions 3 and 4 are read too: version 4 is version 5 with one coder state up to
# `_MIN_LANED_CHANGES_V4` changes, and version 3 is version 4 without the group sizes,
# which the decoder counts.
_READ_VERSIONS = (3, 4, 5)
# Each group boundary costs a pass over the tensor on both sides; 8 groups keep all but ~1%
# of the gain of one group per exponent on real training streams. (`_limits` spells out the
# 7 edges between them.)
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
# What a tensor costs the decoder, to share the tensors out among threads evenly: a change
# costs about as much as this many elements of the pass over the tensor (on the benchmark's
# training streams, about 0.2 ns per element and 40-50 ns per change), and a stream holds
# about this many changes per byte (0.4-0.8 bytes per change). The encoder shares them out
# by their changes alone, which balanced it as well on those streams.
_CHANGE_WORK = 200
_CHANGES_PER_BYTE = 2
# Tensors with fewer changes code with one coder state rather than `rans.LANES`: the other
# states cost 24 bytes, and one state codes a symbol about 2.7x slower than four.
_MIN_LANED_CHANGES = 1024
_MIN_LANED_CHANGES_V4 = 16384
# The decoder's select pass writes out this many changed elements of each 64 without a
# branch on how many there are (about 2 at a 3% change rate; more go through a loop).
_UNROLLED = 4
# At most this many exponent atoms enter the search for group boundaries (coarsened beyond).
_MAX_ATOMS = 48
# A group boundary costs a pass over the tensor: it must save more than this many bits per element.
_GROUP_PENALTY = 1 / 1024
# Boundaries are chosen from the exponents of a sample: one element in _SAMPLE_EVERY, in runs
# of _SAMPLE_RUN, and at least _SAMPLE_RUNS runs.
_SAMPLE_EVERY = 32
_SAMPLE_RUNS = 16
_SAMPLE_RUN = 1024


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

    def encode(names: list[str]) -> dict[str, np.ndarray]:
        # `previous` may build each tensor on access: here, on every thread at once.
        inputs = [
            _encoder_inputs(name, changes[name], previous[name], None if old_values is None else old_values[name])
            for name in names
        ]
        return _encode_batch(names, inputs)

    encoded: dict[str, np.ndarray] = {}
    for part in parallel_map(encode, shares(changes, lambda name: len(changes[name]))):
        encoded.update(part)
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
    decoded: dict[str, SparseChange] = {}
    work = shares(
        shapes, lambda name: _work(math.prod(shapes[name]), _CHANGES_PER_BYTE * entries[name + SUFFIX].numel())
    )
    for part in parallel_map(lambda names: _decode_batch(names, entries, previous, source), work):
        decoded.update(part)
    return {name: decoded[name] for name in sorted(shapes)}


def _work(numel: int, changes: int) -> int:
    """The decoder's work on one tensor, in elements of a pass over it: a tensor coded in
    one group is not passed over, and each change costs about `_CHANGE_WORK` elements."""
    grouped = numel >= _MIN_GROUPED_NUMEL and changes >= _MIN_GROUPED_CHANGES
    return (numel if grouped else 0) + _CHANGE_WORK * changes


# -- one tensor ------------------------------------------------------------------------------


def _encode_batch(names: list[str], inputs: list[tuple[torch.Tensor, ...]]) -> dict[str, np.ndarray]:
    """The streams of the named tensors, from their [`_encoder_inputs`]: one compiled call
    for those with int32 positions, one for those with int64 ones."""
    streams: dict[str, np.ndarray] = {}
    for wide in (False, True):
        chosen = [i for i, (_, positions, _, _) in enumerate(inputs) if (positions.dtype == torch.int64) == wide]
        if not chosen:
            continue
        table = np.array(
            [
                [
                    previous.data_ptr(),
                    previous.numel(),
                    positions.data_ptr(),
                    positions.numel(),
                    values.data_ptr(),
                    0 if old_values is None else old_values.data_ptr(),
                ]
                for previous, positions, values, old_values in (inputs[i] for i in chosen)
            ],
            np.int64,
        )
        # `inputs` keeps every tensor alive through the call.
        encoded, errors = _encode_tensors(table, wide)
        for i, stream, error in zip(chosen, encoded, errors.tolist()):
            if error:
                raise ValueError(
                    f"{names[i]}: indices must be strictly ascending positions in [0, {inputs[i][0].numel()})"
                )
            streams[names[i]] = stream
    return streams


@njit_cached(nogil=True)
def _encode_tensors(table, wide):
    """`(streams, errors)` of the tensors in `table` (per row: the addresses and sizes of
    their previous bits, positions, new bits and old bits, 0 for none), positions int64 if
    `wide` else int32; an error is 1 where the positions are not strictly ascending in range."""
    streams = []
    errors = np.zeros(table.shape[0], np.int64)
    for t in range(table.shape[0]):
        bits = view(table[t, 0], table[t, 1], np.int16)
        new_bits = view(table[t, 4], table[t, 3], np.int16)
        patched = table[t, 5] != 0
        old_bits = view(table[t, 5], table[t, 3] if patched else 0, np.int16)
        if wide:
            stream = _encode_tensor(bits, view(table[t, 2], table[t, 3], np.int64), new_bits, old_bits, patched)
        else:
            stream = _encode_tensor(bits, view(table[t, 2], table[t, 3], np.int32), new_bits, old_bits, patched)
        errors[t] = stream.size == 0
        streams.append(stream)
    return streams, errors


@njit_cached(nogil=True)
def _encode_tensor(bits, positions, new_bits, old_bits, patched):
    """One tensor's stream (empty where `positions` are not strictly ascending in range).

    `bits` is the previous tensor or, with `patched`, the tensor after the change, whose
    changed elements had `old_bits` before it."""
    if not patched:  # the positions are checked before they are read, else as they are classified
        if positions.size and not _strictly_ascending(positions, bits.size):
            return np.empty(0, np.uint8)
        old_bits = bits[positions]
    # One pass over the changes: value codes, their classes, and changes per (exponent, class),
    # from which every choice of the encoder is made.
    ascending, zigzag, classes, class_counts = _classify(positions, bits.size, new_bits, old_bits)
    if not ascending:
        return np.empty(0, np.uint8)
    boundaries = _choose_boundaries(bits, positions, old_bits, class_counts, patched)
    quantized, sizes, changed = _group_tables(class_counts, boundaries)
    if boundaries.size:
        # One pass over the tensor: each change's rank among its group, and the groups' sizes,
        # with the changes ordered by group (stable).
        counts = np.zeros(boundaries.size + 1, np.int64)
        limits = _limits(boundaries)
        if boundaries.size == 1:  # one edge to compare with (see `_limits`)
            ranks, classes, zigzag = _rank_changes(
                bits, boundaries, positions, old_bits, classes, zigzag, changed, counts, (limits[0],)
            )
        else:
            ranks, classes, zigzag = _rank_changes(
                bits, boundaries, positions, old_bits, classes, zigzag, changed, counts, limits
            )
    else:  # one group: a change's rank is its position
        counts = np.full(1, bits.size, np.int64)
        ranks = positions.astype(np.int64)
    words = _encode_groups(ranks, classes, zigzag, counts, changed, quantized, sizes)
    return _stream(boundaries, counts, changed, quantized, sizes, words)


def _encoder_inputs(
    name: str, change: SparseChange, previous: torch.Tensor, old_values: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """`(previous, positions, values, old values or None)` as contiguous CPU tensors,
    checked (but for the order of the positions, which the compiled encoder checks)."""
    if previous.dtype != torch.bfloat16:
        raise TypeError(f"{name}: previous tensor is {previous.dtype}, expected bfloat16")
    if change.indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: indices are {change.indices.dtype}, expected int32 or int64")
    for what, values in (("values", change.values), ("old values", old_values)):
        if values is not None and values.dtype != torch.bfloat16:
            raise TypeError(f"{name}: {what} are {values.dtype}, expected bfloat16")
    indices, values = change.indices, change.values
    if indices.numel() != values.numel():
        raise ValueError(f"{name}: {indices.numel()} indices but {values.numel()} values")
    if old_values is not None and old_values.numel() != indices.numel():
        raise ValueError(f"{name}: {indices.numel()} indices but {old_values.numel()} old values")
    return (
        on_host(previous),
        on_host(indices),
        on_host(values),
        None if old_values is None else on_host(old_values),
    )


@njit_cached(nogil=True)
def _strictly_ascending(indices: np.ndarray, numel: int) -> bool:
    if indices[0] < 0 or indices[-1] >= numel:
        return False
    for i in range(1, indices.size):
        if indices[i] <= indices[i - 1]:
            return False
    return True


@njit_cached(nogil=True)
def _classify(positions, numel, new_bits, old_bits):
    """`(ascending, zigzag values, their classes, changes per (old exponent, class))` in one
    pass over the changes: `ascending` whether `positions` are strictly ascending in
    `[0, numel)` (the rest is meaningless where they are not)."""
    zigzag = np.empty(new_bits.size, np.uint16)
    classes = np.empty(new_bits.size, np.uint8)
    counts = np.zeros((256, _CLASSES), np.int64)
    previous = np.int64(-1)
    ascending = True
    for i in range(new_bits.size):
        # Strictly ascending from above -1, and below `numel` at the end: all in range.
        position = np.int64(positions[i])
        ascending &= position > previous
        previous = position
        diff = np.int16(new_bits[i] - old_bits[i])  # wraps, as the bit patterns do
        code = np.uint16((np.int32(diff) << 1) ^ (np.int32(diff) >> 15))
        value_class = _class_of(code)
        zigzag[i] = code
        classes[i] = value_class
        counts[(old_bits[i] >> 7) & 0xFF, value_class] += 1
    return ascending and previous < numel, zigzag, classes, counts


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


@numba.njit(inline="always")
def _sample_counts(bits, indices, old_bits, patched):
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


@njit_cached(nogil=True)
def _run_histogram(bits, runs, step, length, indices, old_bits, patched):
    # Weights share a few exponents: counted into one histogram, each element waits for the
    # element before it to store the same count. Four, one per element in turn, overlap.
    partial = np.zeros((4, 256), np.int64)
    for run in range(runs):
        begin, end = run * step, run * step + length
        whole = end - (end - begin) % 4
        for i in range(begin, whole, 4):
            partial[0, (bits[i] >> 7) & 0xFF] += 1
            partial[1, (bits[i + 1] >> 7) & 0xFF] += 1
            partial[2, (bits[i + 2] >> 7) & 0xFF] += 1
            partial[3, (bits[i + 3] >> 7) & 0xFF] += 1
        for i in range(whole, end):
            partial[0, (bits[i] >> 7) & 0xFF] += 1
    counts = partial.sum(axis=0)
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


@njit_cached(nogil=True)
def _rank_changes(bits, boundaries, indices, old_bits, classes, zigzag, changed, counts, limits):
    """Rank of each change among the members of its group (by previous exponent), and the
    group sizes (into `counts`): `(ranks, classes, zigzag)` ordered by group, stable.

    `bits` is the previous tensor, except that at the changed positions the old values
    come from `old_bits`; `changed` holds the changes per group. Per 64 elements, one mask
    per group boundary marks the elements whose exponent is at least the boundary (a
    vector compare, [`delta_sync.bitmasks.above`]); the members of group `g` before a
    position are those at least its lower boundary less those at least its upper one, so
    a change's rank is two `popcount`s of its masks below it plus the counts before its
    64 elements.
    """
    numel = bits.size
    groups = counts.size
    group_of = _group_table(boundaries)
    ranks = np.empty(indices.size, np.int64)
    sorted_classes = np.empty_like(classes)
    sorted_zigzag = np.empty_like(zigzag)
    slots = np.zeros(groups, np.int64)
    for group in range(1, groups):
        slots[group] = slots[group - 1] + changed[group - 1]
    # Edge e is the lower boundary of group e: edge 0 holds every element, edge `groups`
    # none. `at_least[e]`: elements before the current 64 whose old exponent is at least
    # edge e. The masks see the tensor as it is (new values at the changed positions), so
    # a change that moved an element across an edge corrects the count once it is seen.
    # Every edge of `limits` (see [`_limits`]): those past the last group count no
    # element, and a loop of known length over them compiles to straight-line code.
    edges = len(limits)
    at_least = np.zeros(edges + 2, np.int64)
    masks = _edge_masks(limits)
    whole = numel - numel % LANES
    j = 0
    for start in range(0, whole, LANES):
        at_least[0] = start
        _mask_edges(bits, start, limits, masks)
        # Unsigned indices below: numba checks a signed one for a negative value on every access.
        while j < indices.size and indices[np.uint64(j)] < start + LANES:
            change = np.uint64(j)
            i = np.int64(indices[change])
            below = (np.uint64(1) << np.uint64(i - start)) - np.uint64(1)
            old = (old_bits[change] >> 7) & 0xFF
            group = group_of[old]
            lower = at_least[group] + np.int64(popcount(masks[group] & below))
            upper = at_least[group + 1] + np.int64(popcount(masks[group + 1] & below))
            _place(change, group, lower - upper, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag)
            new = (bits[np.uint64(i)] >> 7) & 0xFF
            if new != old:
                for edge in range(1, groups):
                    at_least[edge] += np.int64(old >= boundaries[edge - 1]) - np.int64(new >= boundaries[edge - 1])
            j += 1
        for edge in range(1, edges + 1):
            at_least[edge] += np.int64(popcount(masks[edge]))
    for i in range(whole, numel):  # the last elements, fewer than 64: one at a time
        at_least[0] = i
        if j < indices.size and indices[j] == i:
            exponent = (old_bits[j] >> 7) & 0xFF
            group = group_of[exponent]
            rank = at_least[group] - at_least[group + 1]
            _place(j, group, rank, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag)
            j += 1
        else:
            exponent = (bits[i] >> 7) & 0xFF
        for edge in range(1, groups):
            at_least[edge] += np.int64(exponent >= boundaries[edge - 1])
    at_least[0] = numel
    for group in range(groups):
        counts[group] = at_least[group] - at_least[group + 1]
    return ranks, sorted_classes, sorted_zigzag


@numba.njit(inline="always")
def _place(j, group, rank, slots, ranks, classes, zigzag, sorted_classes, sorted_zigzag):
    """Put change `j`, of `rank` in `group`, in the group's next slot."""
    slot = slots[group]
    at = np.uint64(slot)
    ranks[at] = rank
    sorted_classes[at] = classes[j]
    sorted_zigzag[at] = zigzag[j]
    slots[group] = slot + 1


@njit_cached(nogil=True)
def _stream(boundaries, counts, changed, tables, sizes, words):
    """Header and words as bytes (the layout in the module's docstring)."""
    groups = changed.size
    out = np.empty(2 + boundaries.size + groups * (20 + 1 + _CLASSES) + 10 + 4 * words.size, np.uint8)
    out[0] = _VERSION
    out[1] = groups
    at = 2
    for boundary in boundaries:
        out[at] = boundary
        at += 1
    for group in range(groups - 1):  # the last group holds the rest of the tensor
        at = _put_varint(out, at, counts[group])
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


def _decode_batch(
    names: list[str], entries: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor], source: str
) -> dict[str, SparseChange]:
    """The changes of the named tensors: their headers read in one compiled call, the rest
    in another (with no torch call per tensor, see [`delta_sync.addresses.on_host`]).

    A header the compiled reader does not take is read again by [`_Header`], which names
    what is wrong with it (or reads the rare header the compiled reader leaves to it: a
    varint of more than 9 bytes)."""
    count = len(names)
    streams, held = [], []  # what the compiled calls read by address
    for name in names:
        entry = entries[name + SUFFIX]
        if entry.dtype != torch.uint8 or entry.dim() != 1:
            raise FormatError(f"{source}: {name}{SUFFIX} must be a 1-D uint8 tensor, got {entry.dim()}-D {entry.dtype}")
        streams.append(on_host(entry).numpy())
        held.append(on_host(previous[name]))
    numels = np.array([tensor.numel() for tensor in held], np.int64)
    boundaries = np.zeros((count, _MAX_GROUPS - 1), np.int64)
    groups = np.zeros(count, np.int64)
    changed = np.zeros((count, _MAX_GROUPS), np.int64)
    quantized = np.zeros((count, _MAX_GROUPS, _CLASSES), np.uint8)
    sizes = np.zeros((count, _MAX_GROUPS), np.int64)
    members = np.full((count, _MAX_GROUPS), -1, np.int64)  # -1: to be counted (version 3)
    lanes = np.ones(count, np.int64)
    words = np.zeros((count, 2), np.int64)  # where the coder words start, and how many
    located = np.array([(address_of(stream), stream.size) for stream in streams], np.int64).reshape(count, 2)
    read = _read_headers(located, numels, boundaries, groups, members, changed, quantized, sizes, lanes, words)
    for t in np.flatnonzero(~read):
        reader = _Reader(streams[t], f"{source}: {names[t]}{SUFFIX}")
        header = _Header.read(reader, int(numels[t]))
        reader.check_words(header.words)
        groups[t], lanes[t], words[t] = len(header.changed), header.lanes, (reader.pos, header.words)
        if header.members is not None:
            members[t, : groups[t]] = header.members
        boundaries[t, : len(header.boundaries)] = header.boundaries
        changed[t, : groups[t]] = header.changed
        for group, table_bytes in enumerate(header.tables):
            if table_bytes is not None:
                quantized[t, group, : table_bytes.size] = table_bytes
                sizes[t, group] = table_bytes.size
    wide = np.array([index_dtype(numel) == torch.int64 for numel in numels.tolist()], np.bool_)
    totals = changed.sum(axis=1)
    outputs = [
        (np.empty(total, np.int64 if is_wide else np.int32), np.empty(total, np.int16))
        for total, is_wide in zip(totals.tolist(), wide.tolist())
    ]
    table = np.array(
        [
            (address + at, words_count, tensor.data_ptr(), numel, address_of(positions), address_of(values))
            for (address, _), (at, words_count), tensor, numel, (positions, values) in zip(
                located.tolist(), words.tolist(), held, numels.tolist(), outputs
            )
        ],
        np.int64,
    ).reshape(count, 6)
    errors = _decode_tensors(table, wide, lanes, groups, boundaries, members, changed, quantized, sizes)
    decoded = {}
    for t, name in enumerate(names):
        code, group, found = errors[t].tolist()
        if code != rans.OK:
            message = _decode_error(code, group, int(changed[t, group]), found)
            raise FormatError(f"{source}: {name}{SUFFIX}: {message}")
        positions, values = outputs[t]
        decoded[name] = SparseChange(
            indices=torch.from_numpy(positions),
            values=torch.frombuffer(values, dtype=torch.bfloat16)
            if values.size
            else torch.empty(0, dtype=torch.bfloat16),
        )
    return decoded


@njit_cached(nogil=True)
def _read_headers(located, numels, boundaries, groups, members, changed, quantized, sizes, lanes, words):
    """The headers of the streams at `located` (per row: address and bytes) into the rows of
    the other arrays, as [`_Header`] reads them; per stream whether it was read (False: a
    damaged header, or one for [`_Header`] to read, which writes its rows again)."""
    read = np.zeros(located.shape[0], np.bool_)
    for t in range(located.shape[0]):
        data = view(located[t, 0], located[t, 1], np.uint8)
        found, states, at, count = _read_header(
            data, numels[t], boundaries[t], members[t], changed[t], quantized[t], sizes[t]
        )
        if found:
            groups[t], lanes[t], words[t, 0], words[t, 1] = found, states, at, count
            read[t] = True
    return read


@numba.njit(inline="always")
def _read_header(data, numel, boundaries, members, changed, quantized, sizes):
    """One header's per-group fields into the given rows, and `(groups, coder states, where
    its coder words start, how many)`; groups 0 where it did not check out (the rows then
    hold partial fields)."""
    unread = (np.int64(0), np.int64(0), np.int64(0), np.int64(0))
    if data.size < 2:
        return unread
    version, groups = np.int64(data[0]), np.int64(data[1])
    at = np.int64(2)
    if version < _READ_VERSIONS[0] or version > _READ_VERSIONS[-1] or groups < 1 or groups > _MAX_GROUPS:
        return unread
    if at + groups - 1 > data.size:
        return unread
    previous = np.int64(0)
    for edge in range(groups - 1):
        boundary = np.int64(data[at + edge])
        if boundary <= previous:
            return unread
        boundaries[edge] = previous = boundary
    at += groups - 1
    if version >= 4:
        rest = numel
        for group in range(groups - 1):
            size, at = _read_varint(data, at, rest)
            if size < 0:
                return unread
            members[group] = size
            rest -= size
        members[groups - 1] = rest
    total = np.int64(0)
    for group in range(groups):
        count, at = _read_varint(data, at, numel - total)
        if count < 0:
            return unread
        total += count
        changed[group] = count
        if count:
            if at >= data.size:
                return unread
            size = np.int64(data[at]) + 1
            at += 1
            if size > _CLASSES or at + size > data.size:
                return unread
            present = False
            for c in range(size):
                quantized[group, c] = data[at + c]
                present |= data[at + c] != 0
            if not present:
                return unread
            sizes[group] = size
            at += size
    count, at = _read_varint(data, at, numel * 8 + 8)
    if count < 0 or data.size - at != 4 * count:
        return unread
    return groups, np.int64(_lanes_of(version, total)), at, count


@numba.njit(inline="always")
def _read_varint(data, at, limit):
    """`(value, where the next field starts)` of the LEB128 varint at `at`, or -1 where it runs
    past the data, is above `limit`, or is longer than 9 bytes (left to [`_Reader.varint`])."""
    value = np.int64(0)
    for shift in range(0, 63, 7):
        if at >= data.size:
            return np.int64(-1), at
        byte = np.int64(data[at])
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (value if value <= limit else np.int64(-1)), at
    return np.int64(-1), at


@njit_cached(nogil=True)
def _decode_tensors(table, wide, lanes, groups, boundaries, members, changed, quantized, sizes):
    """Decode the tensors of `table` (per row: the address of their coder words' first byte
    and their count, the address and size of their previous bits, and the addresses of the
    positions, int64 where `wide` else int32, and values to write), with their coder states
    (`lanes`) and headers' fields per row (`members`: the groups' sizes, -1 where the stream
    does not give them):
    per tensor `(error, group, members)`, an error code (`rans.OK`: decoded), and for a
    group claiming more changes than it has members, or another size than it has, the
    group and its members."""
    errors = np.zeros((table.shape[0], 3), np.int64)
    for t in range(table.shape[0]):
        g = groups[t]
        k = 0
        for group in range(g):
            k += changed[t, group]
        words = _words(view(table[t, 0], 4 * table[t, 1], np.uint8))
        bits = view(table[t, 2], table[t, 3], np.int16)
        header = (
            lanes[t],
            boundaries[t, : g - 1].copy(),
            members[t, :g].copy(),
            changed[t, :g].copy(),
            quantized[t, :g],
            sizes[t, :g].copy(),
        )
        values = view(table[t, 5], k, np.int16)
        if wide[t]:
            result = _decode_tensor(words, bits, *header, view(table[t, 4], k, np.int64), values)
        else:
            result = _decode_tensor(words, bits, *header, view(table[t, 4], k, np.int32), values)
        errors[t, 0], errors[t, 1], errors[t, 2] = result
    return errors


@numba.njit(inline="always")
def _words(data):
    """The little-endian uint32 words of `data`, whatever the machine (and however aligned)."""
    words = np.empty(data.size // 4, np.uint32)
    for w in range(words.size):
        word = np.uint32(0)
        for byte in range(4):
            word |= np.uint32(data[4 * w + byte]) << np.uint32(8 * byte)
        words[w] = word
    return words


@njit_cached(nogil=True)
def _decode_tensor(words, bits, lanes, boundaries, claimed, changed, quantized, sizes, positions_out, values_out):
    """One tensor's changes, coded with `lanes` coder states, into `positions_out` and
    `values_out`: `(error, group, members)` as [`_decode_tensors`] returns them. The groups'
    sizes are those the header `claimed` (checked against the tensor by the select pass,
    which counts them as it goes), or counted here first (version 3)."""
    if claimed.size == 1:
        counts = np.full(1, bits.size, np.int64)
    elif claimed[0] >= 0:
        counts = claimed
    else:
        counts = _group_counts(bits, boundaries)
    for group in range(counts.size):
        if changed[group] > counts[group]:
            return _TOO_MANY_CHANGES, group, counts[group]
    ranks, zigzag, error = _decode_groups(words, lanes, counts, changed, quantized, sizes, positions_out)
    if error != rans.OK:
        return error, 0, 0
    if counts.size == 1:  # one group: a change's rank is its position
        for j in range(ranks.size):
            position = ranks[np.uint64(j)]
            positions_out[j] = position
            values_out[j] = _applied(bits[np.uint64(position)], zigzag[np.uint64(j)])
        return rans.OK, 0, 0
    ends = np.cumsum(changed)
    limits = _limits(boundaries)
    if boundaries.size == 1:  # one edge to compare with (see `_limits`)
        found, members = _select_members(
            bits, boundaries, (limits[0],), ranks, zigzag, ends - changed, ends, counts, positions_out, values_out
        )
    else:
        found, members = _select_members(
            bits, boundaries, limits, ranks, zigzag, ends - changed, ends, counts, positions_out, values_out
        )
    for group in range(counts.size):
        if members[group] != counts[group]:
            return _WRONG_SIZES, group, members[group]
    if found != ranks.size:  # cannot happen: every rank was checked against its group's size
        return _OUTSIDE_GROUPS, 0, 0
    return rans.OK, 0, 0


@numba.njit(inline="always")
def _applied(held, code):
    """The new bits of an element that held `held`, from the zigzag code of its change: the
    signed difference of the bit patterns, added as the encoder took it (wrapping)."""
    code = np.int32(code)
    return np.int16(np.int32(held) + ((code >> 1) ^ -(code & 1)))


@njit_cached(nogil=True)
def _group_counts(bits, boundaries):
    """Members of each exponent group, from one mask per group boundary per 64 elements."""
    groups = boundaries.size + 1
    group_of = _group_table(boundaries)
    at_least = np.zeros(groups + 1, np.int64)  # per edge, as in `_rank_changes`
    limits = _limits(boundaries)
    masks = _edge_masks(limits)
    whole = bits.size - bits.size % LANES
    for start in range(0, whole, LANES):
        _mask_edges(bits, start, limits, masks)
        for edge in range(1, groups):
            at_least[edge] += np.int64(popcount(masks[edge]))
    at_least[0] = whole
    counts = np.empty(groups, np.int64)
    for group in range(groups):
        counts[group] = at_least[group] - at_least[group + 1]
    for i in range(whole, bits.size):  # the last elements, fewer than 64
        counts[group_of[(bits[i] >> 7) & 0xFF]] += 1
    return counts


@njit_cached(nogil=True)
def _select(bits, boundaries, limits, ranks, zigzag, starts, ends, counts, positions_out, values_out):
    """The changes at the members of each group with the given ranks, in one pass, ascending.

    `ranks[starts[g]:ends[g]]` are group `g`'s, ascending and each below its size
    (`counts[g]`, as the header claims it: unused here, see [`_select_by_deposit`]), and
    `zigzag` holds the code of each rank's change. Writes each element found, ascending,
    into `positions_out` and its new bits (its held bits, read here where the pass has them
    at hand, changed by its code: [`_applied`]) into `values_out`. Returns `(found,
    members)`: how many were found (fewer than `ranks` only if a rank is out of range) and
    the members of each group, counted.

    Per 64 elements, the members of group `g` are the mask of its lower boundary less that
    of its upper one; where a group's wanted rank falls among them, the member is found by
    clearing the mask's lowest bits, and the members found are written out in position
    order. The branches on whether a group has a wanted member among the 64, and how many,
    go either way at random: [`_select_by_deposit`] has none, where the machine allows it.
    """
    groups = starts.size
    group_of = _group_table(boundaries)
    masks = _edge_masks(limits)
    following = starts.copy()
    members = np.zeros(groups, np.int64)  # members of each group before the current 64
    source_at = np.empty(LANES, np.int64)  # for each element found here, its index into `ranks`
    found = 0
    whole = bits.size - bits.size % LANES
    for start in range(0, whole, LANES):
        _mask_edges(bits, start, limits, masks)
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
            positions_out[found] = start + bit
            values_out[found] = _applied(bits[start + bit], zigzag[source_at[bit]])
            found += 1
            hits &= hits - np.uint64(1)
    for i in range(whole, bits.size):  # the last elements, fewer than 64
        group = group_of[(bits[i] >> 7) & 0xFF]
        if following[group] < ends[group] and ranks[following[group]] == members[group]:
            positions_out[found] = i
            values_out[found] = _applied(bits[i], zigzag[following[group]])
            found += 1
            following[group] += 1
        members[group] += 1
    return found, members


@njit_cached(nogil=True)
def _rank_bitmaps(ranks, starts, ends, counts):
    """`(words, bases)`: per group `g`, a bitmap of its members with bit `r` set where rank
    `r` is among `ranks[starts[g]:ends[g]]` (each below `counts[g]`), starting at bit
    `bases[g]` of `words` (a multiple of 64), with a spare zero word after each."""
    groups = starts.size
    bases = np.zeros(groups + 1, np.int64)
    for group in range(groups):
        bases[group + 1] = bases[group] + LANES * ((counts[group] + LANES - 1) // LANES + 1)
    words = np.zeros(bases[groups] // LANES + 1, np.uint64)
    for group in range(groups):
        for j in range(starts[group], ends[group]):
            bit = bases[group] + ranks[j]
            words[bit >> 6] |= np.uint64(1) << np.uint64(bit & 63)
    return words, bases


@njit_cached(nogil=True)
def _select_by_deposit(bits, boundaries, limits, ranks, zigzag, starts, ends, counts, positions_out, values_out):
    """[`_select`] without a branch per group: each group's wanted ranks as a bitmap of its
    members ([`_rank_bitmaps`]); per 64 elements, the next bits of each group's bitmap, as
    many as it has members here, are deposited onto their positions ([`deposit`]) and the
    changed elements are the union over the groups.

    The changed elements among 64 (about two, at random) are written out without a branch
    on how many there are: always the first `_UNROLLED` of them, their position and held
    bits (the slots past the last one are written over by the next 64's), and only the
    rare rest in a loop. A second loop, over the changes, then takes each one's group from
    its exponent and applies its group's next code."""
    groups = starts.size
    words, bases = _rank_bitmaps(ranks, starts, ends, counts)
    last = words.size - 2  # a group larger than the header claims reads no further
    # nor files a code past the last (the decoder then refuses the stream: wrong sizes)
    last_code = np.uint64(max(zigzag.size - 1, 0))
    group_of = _group_table(boundaries)
    masks = _edge_masks(limits)
    at = bases[:groups].copy()  # each group's bit for its next member
    room = ranks.size
    found = 0
    whole = bits.size - bits.size % LANES
    for start in range(0, whole, LANES):
        _mask_edges(bits, start, limits, masks)
        hits = np.uint64(0)
        for group in range(groups):
            mine = masks[group] & ~masks[group + 1]
            bit = at[group]
            # Unsigned indices: numba checks a signed one for a negative value on every access.
            word, offset = np.uint64(min(bit >> 6, last)), np.uint64(bit & 63)
            # The 64 bits from `at`; `<< 1 << (63 - offset)` is `<< (64 - offset)`, 0 at offset 0.
            after = words[word + np.uint64(1)]
            wanted = (words[word] >> offset) | ((after << np.uint64(1)) << (np.uint64(63) - offset))
            hits |= deposit(wanted, mine)
            at[group] = bit + np.int64(popcount(mine))
        if found + _UNROLLED <= room:
            here = np.int64(popcount(hits))
            for slot in range(_UNROLLED):  # past the last change: element `start`, written over later
                i = start + np.int64(trailing_zeros(hits) & 63)
                positions_out[np.uint64(found + slot)] = i
                values_out[np.uint64(found + slot)] = bits[np.uint64(i)]
                hits &= hits - np.uint64(1)
            found += min(here, _UNROLLED)
        while hits and found < room:
            i = start + trailing_zeros(hits)
            positions_out[np.uint64(found)] = i
            values_out[np.uint64(found)] = bits[np.uint64(i)]
            found += 1
            hits &= hits - np.uint64(1)
    following = starts.copy()
    for j in range(found):
        held = values_out[np.uint64(j)]
        group = group_of[(held >> 7) & 0xFF]
        source = following[group]
        values_out[np.uint64(j)] = _applied(held, zigzag[min(np.uint64(source), last_code)])
        following[group] = source + 1
    for i in range(whole, bits.size):  # the last elements, fewer than 64
        group = group_of[(bits[i] >> 7) & 0xFF]
        if (words[min(at[group] >> 6, last)] >> np.uint64(at[group] & 63)) & np.uint64(1) and found < room:
            positions_out[found] = i
            values_out[found] = _applied(bits[i], zigzag[min(np.uint64(following[group]), last_code)])
            following[group] += 1
            found += 1
        at[group] += 1
    return found, at - bases[:groups]


# Where the machine deposits bits in one instruction, the decoder's select pass has no
# branch per group (numba binds this when it compiles `_decode_tensor`).
_select_members = _select_by_deposit if FAST_BIT_GATHER else _select


@numba.njit(inline="always")
def _edge_masks(limits):
    """Per edge (the lower boundary of each group, one per limit of `limits` after the
    first, and one past the last), the mask of the 64 current elements whose exponent is at
    least it: edge 0 holds every element, the edges from the last group's upper one on
    none; [`_mask_edges`] sets the others."""
    masks = np.zeros(len(limits) + 2, np.uint64)
    masks[0] = ~np.uint64(0)
    return masks


@numba.njit(inline="always")
def _mask_edges(bits, start, limits, masks):
    """The [`_edge_masks`] of the 64 elements from `start`, from one read of them."""
    found = above(bits, start, limits)
    for edge in range(len(limits)):
        masks[edge + 1] = found[edge]


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
def _limits(boundaries):
    """Per edge from 1 to `_MAX_GROUPS - 1`, the magnitude that [`above`] compares with:
    `(exponent << 7) - 1` for the lower boundary of each group but the first, and 0x7FFF
    (no element) for edges past the last group.

    The passes over a tensor are compiled once per number of limits, all seven as a rule.
    A tensor in two groups passes its first alone: those are the large tensors with few
    changes (an embedding), whose pass then compares once per 64 elements rather than
    seven times, in about 0.4x the time."""
    limits = np.full(_MAX_GROUPS - 1, 0x7FFF, np.int16)
    for edge in range(boundaries.size):
        limits[edge] = np.int16((boundaries[edge] << 7) - 1)
    return (limits[0], limits[1], limits[2], limits[3], limits[4], limits[5], limits[6])


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

    def check_words(self, count: int) -> None:
        """That the rest of the stream is `count` coder words."""
        rest = self.data.size - self.pos
        if rest != 4 * count:
            raise FormatError(
                f"{self.where}: entropy-coded data is {rest} bytes, the header says {4 * count}; "
                "the stream is truncated or damaged"
            )


@dataclass
class _Header:
    boundaries: list[int]
    members: list[int] | None  # the groups' sizes (None in version 3: counted)
    changed: list[int]
    lanes: int
    tables: list[np.ndarray | None] = field(default_factory=list)
    words: int = 0

    @classmethod
    def read(cls, reader: _Reader, numel: int) -> _Header:
        version = reader.byte("version")
        if version not in _READ_VERSIONS:
            *others, newest = _READ_VERSIONS
            readable = f"{', '.join(map(str, others))} and {newest}"
            raise FormatError(
                f"{reader.where}: compact stream version {version} is not supported (this library reads {readable})"
            )
        groups = reader.byte("group count")
        if not 1 <= groups <= _MAX_GROUPS:
            raise FormatError(f"{reader.where}: group count is {groups}, expected 1 to {_MAX_GROUPS}")
        boundaries = [int(b) for b in reader.bytes(groups - 1, "group boundaries")]
        if any(b <= a for a, b in zip([0, *boundaries], boundaries)):
            raise FormatError(f"{reader.where}: group boundaries {boundaries} are not strictly ascending exponents")
        members = None
        if version >= 4:
            members, rest = [], numel
            for group in range(groups - 1):
                members.append(reader.varint(rest, f"size of group {group}"))
                rest -= members[-1]
            members.append(rest)
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
        lanes = _lanes_of(version, total)
        return cls(boundaries=boundaries, members=members, changed=changed, lanes=lanes, tables=tables, words=words)


# -- exponent groups -------------------------------------------------------------------------


@njit_cached(nogil=True)
def _choose_boundaries(bits, positions, old_bits, class_counts, patched):
    """Split the exponent line into at most `_MAX_GROUPS` groups so that the estimated coded
    size, plus a pass over the tensor per boundary, is smallest: the first exponent of each
    group but the first (none: one group).

    The candidates are runs of single exponents (or of pairs) between two tails, which is
    where the change rate moves: every bound measured on real training streams is within
    1% of that of the best split into as many groups. A group of `n` elements with `k`
    changes costs `n H(k / n)` bits for its positions, the empirical entropy of its value
    classes, and its side information. Element counts are estimated from a sample of the
    previous tensor, [`_sample_counts`] (the boundaries are stored, so the decoder needs no
    estimate).
    """
    none = np.empty(0, np.int64)
    numel = bits.size
    if numel < _MIN_GROUPED_NUMEL or class_counts.sum() < _MIN_GROUPED_CHANGES:
        return none
    atoms, n, h = _atoms(_sample_counts(bits, positions, old_bits, patched), class_counts, numel)
    if atoms.size <= 1:
        return none
    starts, ends, ranges, firsts, groups = _windows(atoms.size)
    best = _best_split(n, h, starts, ends, ranges, groups, _GROUP_PENALTY * numel)
    return atoms[firsts[best, 1 : groups[best]]].astype(np.int64)


@njit_cached(nogil=True)
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


@njit_cached(nogil=True)
def _windows(atoms):
    """The splits of `atoms` atoms into a low tail, a run of single atoms (or of pairs) and a
    high tail, and the atom ranges their groups are made of: `(starts, ends, ranges, firsts,
    groups)`. Range `r` runs from atom `starts[r]` to one before `ends[r]`; split `s` has
    `groups[s]` groups, the first atom of each in `firsts[s]` and its range in `ranges[s]`
    (padded with `starts.size`, an empty range)."""
    splits = 1
    for group_count in range(2, _MAX_GROUPS + 1):
        for stride in range(1, 3 if group_count > 2 else 2):
            splits += max(0, atoms - (group_count - 2) * stride - 1)
    firsts = np.zeros((splits, _MAX_GROUPS), np.intp)
    groups = np.ones(splits, np.intp)
    row = 1
    for group_count in range(2, _MAX_GROUPS + 1):
        for stride in range(1, 3 if group_count > 2 else 2):
            for low in range(1, atoms - (group_count - 2) * stride):
                for group in range(1, group_count):
                    firsts[row, group] = low + (group - 1) * stride
                groups[row] = group_count
                row += 1
    # Number each distinct (first, end) range in the order the splits meet it.
    number = np.full((atoms + 1, atoms + 1), -1, np.intp)
    starts = np.empty(splits * _MAX_GROUPS, np.intp)
    ends = np.empty(splits * _MAX_GROUPS, np.intp)
    ranges = np.empty((splits, _MAX_GROUPS), np.intp)
    found = 0
    for row in range(splits):
        for group in range(groups[row]):
            first = firsts[row, group]
            end = firsts[row, group + 1] if group + 1 < groups[row] else atoms
            if number[first, end] < 0:
                number[first, end] = found
                starts[found], ends[found] = first, end
                found += 1
            ranges[row, group] = number[first, end]
    for row in range(splits):
        ranges[row, groups[row] :] = found
    return starts[:found].copy(), ends[:found].copy(), ranges, firsts, groups


@numba.njit(inline="always")
def _xlogx(x):
    return x * np.log2(x) if x > 1.0 else 0.0


@njit_cached(nogil=True)
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


# Thresholds of the quarter-bit rounding of log2: ceil(2^30 * 2^((2i + 1) / 8)) for i in 0..3.
_ROUNDING_THRESHOLDS = np.array([1170923762, 1392470869, 1655936265, 1969251188], np.int64)
# 2^31 * 2^(-j / 4) for j in 0..3, rounded: the weight of a value class a quarter bit apart.
_QUARTER_WEIGHTS = np.array([2147483648, 1805811301, 1518500250, 1276901417], np.int64)
# Fixed-point fraction bits of the gap model's arithmetic.
_FRACTION = 31


@numba.njit(inline="always")
def _log_byte(count):
    """`round(4 log2(count)) + 1` for `count >= 1`, clipped to 255, in integers only: the
    mantissa of `count`, scaled to [2^30, 2^31), against the quarter-bit rounding thresholds."""
    exponent = 0
    while (count >> exponent) > 1:
        exponent += 1
    mantissa = count << (30 - exponent) if exponent <= 30 else count >> (exponent - 30)
    quarter = 0
    for threshold in _ROUNDING_THRESHOLDS:
        quarter += mantissa >= threshold
    return min(4 * exponent + quarter + 1, 255)


@njit_cached(nogil=True)
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
                quantized[group, c] = np.uint8(_log_byte(counts[group, c]))
                sizes[group] = c + 1
                changed[group] += counts[group, c]
    return quantized, sizes, changed


@njit_cached(nogil=True)
def _class_table(quantized):
    """The [`rans.cumulative`] table of a group's value classes, from its value table bytes:
    class `c` weighs `2^((q_c - 1) / 4)` (in integers: relative to the largest, a quarter
    bit at a time), an absent class (`q_c == 0`) cannot occur."""
    top = 0
    for q in quantized:
        top = max(top, np.int64(q))
    weights = np.zeros(quantized.size, np.int64)
    possible = np.zeros(quantized.size, np.bool_)
    for c in range(quantized.size):
        if quantized[c]:
            below = top - np.int64(quantized[c])
            weights[c] = _QUARTER_WEIGHTS[below % 4] >> (below // 4)
            possible[c] = True
    return rans.cumulative(rans.quantize(weights, possible))


# The gap table of a group whose every member changed (no gap is coded): one certain symbol.
_NO_GAPS = np.array([0, 1 << rans.PRECISION], np.int64)


@numba.njit(inline="always")
def _gap_shift(count, coded):
    """Low bits of a gap coded raw, for `coded >= 1` marked elements among `count`: the mean
    gap's bit length less 3 (so the coded top part of a typical gap falls in 4..8)."""
    mean_gap = (count - coded) // coded
    length = 0
    while mean_gap >> length:
        length += 1
    return max(0, length - 3)


@njit_cached(nogil=True)
def _gap_table(count, coded):
    """`(table, shift)`: the [`rans.cumulative`] table of `gap >> shift` below `_TOPS` (the
    last symbol escapes larger ones) for `coded` marked elements among `count`, and `shift`.

    The gaps are geometric: `ratio = 1 - coded / count`, squared `shift` times,
    `P(top) = ratio^top (1 - ratio)` below `_TOPS`, the rest escapes; computed in
    31-bit fixed point with integer products only, so that the trainer and every replica
    build the same table on any machine. `shift` is [`_gap_shift`]'s.
    """
    shift = _gap_shift(count, coded)
    one = np.int64(1) << _FRACTION
    # ratio = floor(2^31 (count - coded) / count) by long division: count may be 2^33 or more.
    rest, ratio = count - coded, np.int64(0)
    for _ in range(_FRACTION):
        rest <<= 1
        ratio <<= 1
        if rest >= count:
            rest -= count
            ratio |= 1
    for _ in range(shift):
        ratio = (ratio * ratio) >> _FRACTION
    weights = np.empty(_TOPS + 1, np.int64)
    power = one
    for top in range(_TOPS):
        weights[top] = (power * (one - ratio)) >> _FRACTION
        power = (power * ratio) >> _FRACTION
    weights[_TOPS] = power
    return rans.cumulative(rans.quantize(weights, np.ones(_TOPS + 1, np.bool_))), shift


@numba.njit(inline="always")
def _lanes(changed):
    """Interleaved coder states of a tensor with `changed` changes per group: each costs 8
    bytes of stream, so a tensor with few changes codes with one."""
    total = 0
    for k in changed:
        total += k
    return _lanes_of(_VERSION, total)


@njit_cached()
def _lanes_of(version, changes):
    """The coder states a stream of `version` with `changes` changes was coded with."""
    least = _MIN_LANED_CHANGES if version >= 5 else _MIN_LANED_CHANGES_V4
    return rans.LANES if changes >= least else 1


@numba.njit(inline="always")
def _bit_length_less_one(value):
    width = -1
    while value:
        value >>= 1
        width += 1
    return width


@numba.njit(inline="always")
def _chunks(width):
    return (width + _CHUNK_BITS - 1) // _CHUNK_BITS


@njit_cached(nogil=True)
def _encode_groups(ranks, classes, zigzag, counts, changed, quantized, sizes):
    """The ANS words of every group's changes: `ranks` among its group, value `classes` and
    `zigzag` values, ordered by group (`changed[g]` of group `g`).

    Per group with changes, the symbols are, in order: the top of the gap before each
    changed element and its value class or, where more than half the group changed, the
    tops of the gaps between the unchanged elements and then the classes of the changed
    ones (no class where the group has one value class); the `shift` low bits of the gaps
    (in chunks of at most `_CHUNK_BITS`: all first chunks, then all second chunks, ...); the
    escaped tops' excess (`top - _TOPS + 1`) as its bit length less one (6 bits) and then
    the bits below its leading one (chunked); the bits below the leading one of each wide
    value (class 16 and up; chunked).

    The coder takes the symbols last to first: they are put as they are made, group by
    group from the last ([`_put_group`]), with no array of them in between.
    """
    groups = counts.size
    # Symbols of each group, at most: a top and its low chunks per coded element; a class per
    # change; per escape (a gap of at least `_TOPS << shift`, so at most `count // (_TOPS <<
    # shift)` of them) its length and up to 3 chunks; per change, a chunk if its value is wide.
    capacity = 0
    for group in range(groups):
        k = changed[group]
        if k:
            coded = counts[group] - k if 2 * k > counts[group] else k
            shift = _gap_shift(counts[group], coded) if coded else 0
            escapes = min(coded, counts[group] // (_TOPS << shift))
            capacity += coded * (1 + _chunks(shift)) + 2 * k + 4 * escapes
    lanes = _lanes(changed)
    out, run = rans.encoder_start(capacity, lanes)
    end = ranks.size
    for group in range(groups - 1, -1, -1):
        k = changed[group]
        if k == 0:
            continue
        first = end - k
        group_ranks, group_classes, group_zigzag = ranks[first:end], classes[first:end], zigzag[first:end]
        table = quantized[group, : sizes[group]]
        # The coder's lanes rotate as constants (registers) in each of the two copies.
        if lanes == rans.LANES:
            run = _put_group(out, run, group_ranks, group_classes, group_zigzag, counts[group], table, rans.LANES)
        else:
            run = _put_group(out, run, group_ranks, group_classes, group_zigzag, counts[group], table, 1)
        end = first
    return rans.encoder_finish(out, run, lanes)


@numba.njit(inline="always")
def _put_group(out, run, ranks, classes, zigzag, count, quantized, lanes):
    """The coder's run after putting one group's symbols (see [`_encode_groups`]), last to first."""
    k = ranks.size
    complement = 2 * k > count
    coded = count - k if complement else k
    values = _class_table(quantized)
    with_classes = quantized.size > 1
    gaps, shift = _gap_table(count, coded) if coded else (_NO_GAPS, 0)
    tops, lows, excess = _position_tops(ranks, count, complement, shift)
    # The run in locals through the loops: a tuple carried from one iteration to the next
    # compiled to slower code (see `rans._encode_symbols`).
    a, b, c, d, at = run
    # A wide value has at most 15 bits below its leading one: one chunk, in the changes' order.
    for j in range(k - 1, -1, -1):
        if classes[j] >= _DIRECT_CLASSES:
            width = np.int64(classes[j]) - 12
            a, b, c, d, at = rans.encoder_put(
                out, (a, b, c, d, at), np.int64(zigzag[j]) & ((np.int64(1) << width) - 1), 1, width, lanes
            )
    widths = np.empty(excess.size, np.int64)
    widest = 0
    for e in range(excess.size):
        widths[e] = _bit_length_less_one(excess[e])
        widest = max(widest, widths[e])
    # The bits below each escape's leading one, chunk by chunk (all first chunks, then all second ones, ...).
    for offset in range((_chunks(widest) - 1) * _CHUNK_BITS, -1, -_CHUNK_BITS):
        for e in range(excess.size - 1, -1, -1):
            if widths[e] > offset:
                bits = min(widths[e] - offset, _CHUNK_BITS)
                a, b, c, d, at = rans.encoder_put(
                    out, (a, b, c, d, at), (excess[e] >> offset) & ((np.int64(1) << bits) - 1), 1, bits, lanes
                )
    for e in range(excess.size - 1, -1, -1):
        a, b, c, d, at = rans.encoder_put(out, (a, b, c, d, at), widths[e], 1, 6, lanes)
    for offset in range((_chunks(shift) - 1) * _CHUNK_BITS, -1, -_CHUNK_BITS):
        bits = min(shift - offset, _CHUNK_BITS)
        for j in range(coded - 1, -1, -1):
            a, b, c, d, at = rans.encoder_put(
                out, (a, b, c, d, at), (lows[j] >> offset) & ((np.int64(1) << bits) - 1), 1, bits, lanes
            )
    if complement:
        if with_classes:
            for j in range(k - 1, -1, -1):
                v = classes[j]
                a, b, c, d, at = rans.encoder_put(
                    out, (a, b, c, d, at), values[v], values[v + 1] - values[v], rans.PRECISION, lanes
                )
        for j in range(coded - 1, -1, -1):
            t = tops[j]
            a, b, c, d, at = rans.encoder_put(
                out, (a, b, c, d, at), gaps[t], gaps[t + 1] - gaps[t], rans.PRECISION, lanes
            )
    else:
        for j in range(coded - 1, -1, -1):
            if with_classes:
                v = classes[j]
                a, b, c, d, at = rans.encoder_put(
                    out, (a, b, c, d, at), values[v], values[v + 1] - values[v], rans.PRECISION, lanes
                )
            t = tops[j]
            a, b, c, d, at = rans.encoder_put(
                out, (a, b, c, d, at), gaps[t], gaps[t + 1] - gaps[t], rans.PRECISION, lanes
            )
    return a, b, c, d, at


@njit_cached(nogil=True)
def _position_tops(ranks, count, complement, shift):
    """The coded fields of one group's positions: `(tops, lows, excess)`.

    The coded elements are the changed ones (`ranks`, ascending) or, with `complement`, the
    group's other members. For each, the gap since the previous one splits into its top
    (`gap >> shift`) and its `shift` low bits; a top of `_TOPS` or more is coded as `_TOPS`
    (an escape) with `top - _TOPS + 1` in `excess`.
    """
    coded = count - ranks.size if complement else ranks.size
    tops = np.empty(coded, np.int64)
    lows = np.empty(coded if shift else 0, np.int64)
    excess = np.empty(coded, np.int64)
    if complement:
        # The gap before the m-th unchanged member is the number of changes with m unchanged
        # members below them (rank less index): counted without a branch on the data
        # (walking the members took one per run of changes, at random), into two counts in
        # turn, as consecutive changes mostly add to the same one. Those after the last
        # unchanged member count at `coded`, which is not coded.
        between = np.zeros((2, coded + 1), np.int64)
        for j in range(ranks.size):
            between[j & 1, min(np.int64(ranks[j]) - j, coded)] += 1
    escaped = 0
    mask = (np.int64(1) << shift) - 1
    previous = np.int64(-1)
    for j in range(coded):
        if complement:
            gap = between[0, j] + between[1, j]
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
        tops[j] = top
    return tops, lows, excess[:escaped]


# Error codes of the compiled decoder, beyond those of `rans`.
_GAP_TOO_LONG = 101
_PAST_GROUP = 102
_TOO_MANY_CHANGES = 103
_OUTSIDE_GROUPS = 104
_WRONG_SIZES = 105
_PAST_SLOTS = 106
_GROUP_MESSAGES = {
    _GAP_TOO_LONG: "an escaped gap is longer than 2^48",
    _PAST_GROUP: "decoded positions run past the end of their group",
    _OUTSIDE_GROUPS: "decoded positions fall outside their groups",
    _PAST_SLOTS: "the unchanged members coded leave more changed members than the group claims",
}


def _decode_error(code: int, group: int, changed: int, members: int) -> str:
    if code == _WRONG_SIZES:
        return (
            f"group {group} has {members} members in the held tensor, not the size the header gives; "
            "the stream is damaged or was coded against other weights"
        )
    if code == _TOO_MANY_CHANGES:
        return f"group {group} claims {changed} changes among {members} elements"
    if code in _GROUP_MESSAGES:
        return f"{_GROUP_MESSAGES[code]}; the stream is damaged"
    return rans.error_message(code)


@njit_cached(nogil=True)
def _decode_groups(words, lanes, counts, changed, quantized, sizes, positions):
    """`(ranks, zigzag, error)`: every group's changes (ranks among the group, zigzag values)
    ordered by group, from the words [`_encode_groups`] codes with `lanes` coder states;
    `error` a `rans` or group error code (`rans.OK` when the stream checked out to its end).
    The ranks have the dtype of `positions`, the array their elements' positions go to
    (as many as the changes): int32 for all but the largest tensors."""
    total = positions.size
    ranks = np.empty_like(positions)
    zigzag = np.empty(total, np.uint16)
    ctx, error = rans.decoder_start(words, lanes)
    if error != rans.OK:
        return ranks, zigzag, error
    first = 0
    for group in range(counts.size):
        k = changed[group]
        if k == 0:
            continue
        error = _decode_group(
            ctx,
            words,
            counts[group],
            k,
            quantized[group, : sizes[group]],
            ranks[first : first + k],
            zigzag[first : first + k],
        )
        if error != rans.OK:
            return ranks, zigzag, error
        first += k
    return ranks, zigzag, rans.decoder_finish(ctx, words)


@njit_cached(nogil=True)
def _decode_group(ctx, words, count, k, quantized, ranks, zigzag):
    """One group's `k` changes among `count` members into `ranks` and `zigzag`, mirroring
    [`_encode_groups`]: an error code. Every loop is bounded by `count` (checked against the
    tensor) or `k`, and nothing larger than the group is allocated."""
    complement = 2 * k > count
    coded = count - k if complement else k
    values = _class_table(quantized)
    with_classes = quantized.size > 1
    gaps, shift = _gap_table(count, coded) if coded else (_NO_GAPS, 0)
    if not (rans.valid_table(gaps) and rans.valid_table(values)):  # cannot happen for a header that was read
        return rans.BAD_TABLE
    gap_starts = rans.lookup(gaps)
    value_starts = rans.lookup(values)
    tops = np.empty(coded, np.uint8)  # symbols of at most `_TOPS`: escaped tops are in `excess`
    classes = np.zeros(k, np.uint8)
    if with_classes and not complement:
        error = rans.decode_pairs(ctx, words, gaps, gap_starts, values, value_starts, tops, classes)
    else:
        error = rans.decode_symbols(ctx, words, gaps, gap_starts, tops)
        if error == rans.OK and with_classes:
            error = rans.decode_symbols(ctx, words, values, value_starts, classes)
    if error != rans.OK:
        return error
    lows = np.zeros(coded, np.int64)
    for offset in range(0, shift, _CHUNK_BITS):
        error = rans.decode_bit_run(ctx, words, min(shift - offset, _CHUNK_BITS), coded, lows, offset)
        if error != rans.OK:
            return error
    escaped = 0
    for j in range(coded):
        escaped += tops[j] == _TOPS
    widths = np.empty(escaped, np.int64)
    for e in range(escaped):
        width = rans.decode_bits(ctx, words, 6)
        if width < 0:
            return -width
        if width > 47:
            return _GAP_TOO_LONG
        widths[e] = width
    excess = np.zeros(escaped, np.int64)
    error = _decode_chunks(ctx, words, widths, excess)
    if error != rans.OK:
        return error
    for j in range(k):  # a wide value's bits below its leading one: one chunk (at most 15 bits)
        if classes[j] >= _DIRECT_CLASSES:
            width = np.int64(classes[j]) - 12
            value = rans.decode_bits(ctx, words, width)
            if value < 0:
                return -value
            zigzag[j] = np.uint16(value | (np.int64(1) << width))
        else:
            zigzag[j] = np.uint16(classes[j])
    return _ranks_of(tops, excess, lows, shift, count, complement, ranks)


@numba.njit(inline="always")
def _decode_chunks(ctx, words, widths, values):
    """Values of `widths[i] + 1` bits into `values`: their leading one, and the bits below it
    read chunk by chunk as [`_put_group`] codes them."""
    widest = 0
    for width in widths:
        widest = max(widest, width)
    for offset in range(0, widest, _CHUNK_BITS):
        for i in range(widths.size):
            if widths[i] > offset:
                value = rans.decode_bits(ctx, words, min(widths[i] - offset, _CHUNK_BITS))
                if value < 0:
                    return -value
                values[i] |= value << offset
    for i in range(widths.size):
        values[i] |= np.int64(1) << widths[i]
    return rans.OK


@numba.njit(inline="always")
def _ranks_of(tops, excess, lows, shift, count, complement, ranks):
    """Ranks among the group of its changed elements into `ranks`, from the coded gaps
    (`(top << shift) + low` before each coded element, where a top of `_TOPS` is an escape,
    `_TOPS - 1` plus the next of `excess`), which are the changed elements or, with
    `complement`, the others: an error code where they run past the group's `count` members,
    or (with `complement`) leave more changed members than `ranks` has slots."""
    position = np.int64(-1)
    r = 0
    e = 0
    for j in range(tops.size):
        top = np.int64(tops[j])
        if top == _TOPS:
            top = excess[e] + _TOPS - 1
            e += 1
        if top > count >> shift:  # also keeps the shift below from overflowing
            return _PAST_GROUP
        low = lows[j] if shift else 0
        next_position = position + (top << shift) + low + 1
        # The `j` coded members so far leave `next_position - j` uncoded ones below this one:
        # with `complement` each takes a slot of `ranks`, which has `count - tops.size` of them.
        if next_position >= count:
            return _PAST_GROUP
        if complement and next_position - j > count - tops.size:
            return _PAST_SLOTS
        if complement:  # the members between two coded ones are the changed ones
            for member in range(position + 1, next_position):
                ranks[r] = member
                r += 1
        else:
            ranks[j] = next_position
        position = next_position
    if complement:
        for member in range(position + 1, count):
            ranks[r] = member
            r += 1
    return rans.OK

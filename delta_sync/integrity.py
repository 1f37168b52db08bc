"""Checksums that prove a receiver holds exactly the trainer's weights, bit for bit.

Two kinds of integrity data travel in every file:

* A *payload digest*: xxh3-64 over the raw bytes of every tensor in the file, in key
  order. It catches a file damaged in storage or in transit, at the cost of hashing the
  file once.
* *State checksums*: one 64-bit checksum per parameter of the full tensor **after** the
  file is applied, plus a model checksum over all of them. A state checksum is the sum,
  modulo 2^64, of a mixed hash of every element's (flat index, bit pattern): of
  `index << 16 | bits` for a bf16 tensor, of `index << 32 | bits` for a float32 one.
  Because it is a sum, a delta that changes `k` elements updates it in O(k): subtract
  the hashes of the old elements, add those of the new ones. A receiver therefore checks
  that a delta reproduces the trainer's weights bit for bit without reading the rest of
  the model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence

import numba
import numpy as np
import torch
import xxhash
from numba.extending import overload

from .addresses import on_host, view
from .compile_cache import njit_cached

__all__ = [
    "PayloadHasher",
    "add_checksums",
    "apply_checksums",
    "format_checksum",
    "model_checksum",
    "parse_checksum",
    "payload_digest",
    "tensor_checksum",
    "updated_checksum",
    "updated_checksums",
]

# Positions computed per call of a shard's `position_of`: 64K of them stay in the L2 cache.
_CHUNK = 1 << 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
#: The dtypes whose elements are checksummed, and the unsigned integers their bits are read as.
_BITS = {torch.bfloat16: np.uint16, torch.float32: np.uint32}


def _width(bits):
    """The number of bits in `bits` (an unsigned integer): 16 or 32 (from compiled code only)."""


@overload(_width, inline="always")
def _width_of(bits):
    width = np.uint64(bits.bitwidth)
    return lambda bits: width


@numba.njit(inline="always")
def _element_hash(position, bits):
    """splitmix64's finalizer of `position << width | bits`, `width` the bits' own (16 for
    a bf16 pattern read as uint16, 32 for a float32 one read as uint32)."""
    z = ((np.uint64(position) << _width(bits)) | np.uint64(bits)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit_cached(nogil=True)
def _hash_run(bits, first):
    """Sum mod 2^64 of the hashes of `(first + i, bits[i])`."""
    total = np.uint64(0)
    for i in range(bits.size):
        total += _element_hash(first + i, bits[i])
    return total


@njit_cached(nogil=True)
def _hash_at(bits, positions):
    """Sum mod 2^64 of the hashes of `(positions[i], bits[i])`."""
    total = np.uint64(0)
    for i in range(bits.size):
        total += _element_hash(positions[i], bits[i])
    return total


@njit_cached(nogil=True)
def _apply_one(bits, positions, new_bits, old_bits):
    """One row of [`_apply_changes`]: `(index of the first position out of range or -1, hash difference)`."""
    total = np.uint64(0)
    for i in range(positions.size):
        position = positions[i]
        if position < 0 or position >= bits.size:
            return i, total
        old = bits[position]
        old_bits[i] = old
        total += _element_hash(position, new_bits[i]) - _element_hash(position, old)
    return -1, total


@njit_cached(nogil=True)
def _apply_changes(table):
    """For each row of `table` (the addresses of a tensor's bits, its changes' positions,
    their new bits and a buffer for the old ones, the tensor's and the changes' sizes, 1 if
    the positions are int64 (else int32), and the bytes per element, 2 or 4): copies the
    bits at the positions into the buffer and returns, per row, the sum of the hashes of the
    new elements less that of the old ones, and the index of the first change whose position
    is out of range (-1: none)."""
    rows = table.shape[0]
    differences = np.zeros(rows, np.uint64)
    errors = np.full(rows, -1, np.int64)
    for t in range(rows):
        if table[t, 7] == 4:
            errors[t], differences[t] = _apply_row(table[t], np.uint32)
        else:
            errors[t], differences[t] = _apply_row(table[t], np.uint16)
    return differences, errors


@numba.njit(inline="always")
def _apply_row(row, bits_type):
    """[`_apply_one`] of a row of [`_apply_changes`]'s table, its bits read as `bits_type`."""
    numel, count = row[4], row[5]
    bits = view(row[0], numel, bits_type)
    new_bits, old_bits = view(row[2], count, bits_type), view(row[3], count, bits_type)
    if row[6] == 1:
        return _apply_one(bits, view(row[1], count, np.int64), new_bits, old_bits)
    return _apply_one(bits, view(row[1], count, np.int32), new_bits, old_bits)


@njit_cached(nogil=True)
def _hash_difference(positions, old_bits, new_bits):
    """The sum of the hashes of `(positions[i], new_bits[i])` less that of `(positions[i], old_bits[i])`."""
    total = np.uint64(0)
    for i in range(positions.size):
        total += _element_hash(positions[i], new_bits[i]) - _element_hash(positions[i], old_bits[i])
    return total


@njit_cached(nogil=True)
def _hash_differences(table):
    """[`_hash_difference`] of each row of `table` (the addresses of a tensor's changed
    positions, their old and new bits, their count, 1 if the positions are int64 (else
    int32), and the bytes per element, 2 or 4)."""
    differences = np.zeros(table.shape[0], np.uint64)
    for t in range(table.shape[0]):
        if table[t, 5] == 4:
            differences[t] = _difference_of_row(table[t], np.uint32)
        else:
            differences[t] = _difference_of_row(table[t], np.uint16)
    return differences


@numba.njit(inline="always")
def _difference_of_row(row, bits_type):
    """[`_hash_difference`] of a row of [`_hash_differences`]'s table, its bits read as `bits_type`."""
    count = row[3]
    old_bits, new_bits = view(row[1], count, bits_type), view(row[2], count, bits_type)
    if row[4] == 1:
        return _hash_difference(view(row[0], count, np.int64), old_bits, new_bits)
    return _hash_difference(view(row[0], count, np.int32), old_bits, new_bits)


def _hash_sum(bits: np.ndarray, position_of: Callable[[int, int], np.ndarray] | None = None) -> int:
    """Sum mod 2^64 of the element hashes of `(position, bits)` pairs.

    Positions are `0, 1, 2, ...` (a whole tensor), or `position_of(start, stop)` computes
    them chunk by chunk (a shard's positions in the full tensor). Each compiled call runs
    without the GIL.
    """
    bits = np.ascontiguousarray(bits)
    if position_of is None:
        return int(_hash_run(bits, 0))
    total = 0
    for start in range(0, bits.size, _CHUNK):
        chunk = np.ascontiguousarray(position_of(start, min(start + _CHUNK, bits.size)), np.int64)
        total += int(_hash_at(bits[start : start + chunk.size], chunk))
    return total & _MASK64


def _check_dtype(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype not in _BITS:
            raise TypeError(f"expected a bfloat16 or float32 tensor, got {tensor.dtype}")


def _bits(values: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns, flat, as unsigned integers of its width."""
    _check_dtype(values)
    flat = values.detach().reshape(-1).cpu()
    # Through a torch view: numpy has no bf16.
    return flat.view(torch.int16 if values.dtype == torch.bfloat16 else torch.int32).numpy().view(_BITS[values.dtype])


def tensor_checksum(tensor: torch.Tensor, positions: Callable[[int, int], np.ndarray] | None = None) -> int:
    """State checksum of a whole bf16 or float32 tensor, or the part of it a shard contributes.

    Checksums are sums, so the checksums of the shards of a parameter, each taken with the
    shard's positions in the full tensor, add up (mod 2^64) to the full tensor's.

    Args:
        tensor: A `torch.bfloat16` or `torch.float32` tensor on any device.
        positions: For a shard, `positions(start, stop)` returns the flat positions in the
            full tensor of the shard's flat elements `start..stop-1` (uint64 or int64).

    Returns:
        The checksum as an unsigned 64-bit integer.

    Example:
        ```python
        >>> a = torch.zeros(4, dtype=torch.bfloat16)
        >>> tensor_checksum(a) == tensor_checksum(a.clone())
        True
        ```
    """
    return _hash_sum(_bits(tensor), position_of=positions)


def add_checksums(*checksums: int) -> int:
    """The checksum of a parameter from the checksums of its disjoint shards."""
    return sum(checksums) & _MASK64


def updated_checksum(checksum: int, indices: torch.Tensor, old_values: torch.Tensor, new_values: torch.Tensor) -> int:
    """Checksum of a tensor after the elements at `indices` change from `old_values` to `new_values`.

    Costs O(len(indices)), independent of the tensor's size. For many tensors at once use
    [`updated_checksums`] (one compiled call for all).

    Args:
        checksum: The tensor's checksum before the change.
        indices: Flat (row-major) positions of the changed elements.
        old_values: Values at `indices` before the change (bf16, or float32 for a float32 tensor).
        new_values: Values at `indices` after the change, of the same dtype.
    """
    return updated_checksums([(checksum, indices, old_values, new_values)])[0]


def updated_checksums(changes: Sequence[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[int]:
    """[`updated_checksum`] of many tensors in one compiled call that runs without the GIL.

    A trainer's writer updates the checksum of every changed parameter each step, on a
    thread beside the training loop: one call per tensor would return to Python, and wait
    for the training thread's GIL switch interval, hundreds of times a step (measured: 300
    tensors, 11 ms alone, 9.7 s beside a thread running Python).

    Args:
        changes: Per tensor `(checksum, indices, old_values, new_values)`: its checksum
            before the change, the flat positions that change (int32 or int64) and the
            values there before and after (bf16, or both float32 for a float32 tensor).

    Returns:
        The checksum after the change, per tensor.

    Example:
        ```python
        >>> (checksum,) = updated_checksums([(tensor_checksum(a), indices, a.view(-1)[indices], values)])
        ```
    """
    held = []  # keeps every tensor alive through the call
    for _, indices, old_values, new_values in changes:
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {indices.dtype}")
        _check_dtype(old_values, new_values)
        if old_values.dtype != new_values.dtype:
            raise TypeError(f"old and new values of one tensor differ in dtype: {old_values.dtype}, {new_values.dtype}")
        if not indices.numel() == old_values.numel() == new_values.numel():
            raise ValueError(
                f"{indices.numel()} positions but {old_values.numel()} old and {new_values.numel()} new values"
            )
        held.append((on_host(indices), on_host(old_values), on_host(new_values)))
    if not held:
        return []
    table = np.array(
        [
            [*(t.data_ptr() for t in row), row[0].numel(), row[0].dtype == torch.int64, row[1].element_size()]
            for row in held
        ],
        np.int64,
    )
    differences = _hash_differences(table).tolist()
    return [(checksum + d) & _MASK64 for (checksum, *_), d in zip(changes, differences)]


def apply_checksums(
    changes: Sequence[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[int]]:
    """The values a set of changes overwrites, and the checksums after them, in one
    compiled call that runs without the GIL (nothing is written to the tensors).

    [`updated_checksum`] of many tensors, with the gather of their old values: a replica
    checks every delta this way while vLLM's thread generates, and each torch or numpy
    call per tensor would hand the GIL back and forth between the two.

    Args:
        changes: Per tensor `(checksum, tensor, indices, new_values)`: its checksum now,
            the tensor (bf16 or float32), the flat positions that change (int32 or int64)
            and the values they take (of the tensor's dtype).

    Returns:
        The old values at `indices` (1-D, of the tensor's dtype) and the new checksum, per tensor.

    Raises:
        IndexError: A position is outside its tensor (the error names which).

    Example:
        ```python
        >>> old, (checksum,) = apply_checksums([(tensor_checksum(a), a, indices, values)])
        >>> checksum == updated_checksum(tensor_checksum(a), indices, old[0], values)
        True
        ```
    """
    if not changes:
        return [], []
    held = []  # keeps every tensor alive through the call
    for _, tensor, indices, values in changes:
        _check_dtype(tensor, values)
        if values.dtype != tensor.dtype:
            raise TypeError(f"{values.dtype} values cannot change a {tensor.dtype} tensor bit for bit")
        tensor, indices, values = on_host(tensor), on_host(indices), on_host(values)
        if indices.numel() != values.numel():
            raise ValueError(f"{indices.numel()} positions but {values.numel()} values")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {indices.dtype}")
        held.append((tensor, indices, values))
    # One buffer per dtype for every tensor's old values, sliced (a slice is made without
    # dropping the GIL).
    olds: list[torch.Tensor | None] = [None] * len(held)
    for dtype in _BITS:
        rows = [r for r, (tensor, _, _) in enumerate(held) if tensor.dtype == dtype]
        buffer = torch.empty(sum(held[r][1].numel() for r in rows), dtype=dtype)
        at = 0
        for r in rows:
            olds[r], at = buffer[at : at + held[r][1].numel()], at + held[r][1].numel()
    held = [(*row, old) for row, old in zip(held, olds)]
    table = np.array(
        [
            [t.data_ptr(), i.data_ptr(), v.data_ptr(), o.data_ptr(), t.numel(), i.numel()]
            + [i.dtype == torch.int64, t.element_size()]
            for t, i, v, o in held
        ],
        np.int64,
    )
    found, errors = _apply_changes(table)
    for (tensor, indices, _, _), error in zip(held, errors.tolist()):
        if error != -1:
            raise IndexError(f"position {int(indices[error])} is outside a tensor of {tensor.numel()} elements")
    checksums = [(checksum + d) & _MASK64 for (checksum, *_), d in zip(changes, found.tolist())]
    return [old for *_, old in held], checksums


def format_checksum(checksum: int) -> str:
    """The 16-hex-digit form in which checksums are stored in file metadata."""
    return f"{checksum:016x}"


def parse_checksum(text: str) -> int:
    """Inverse of [`format_checksum`]; raises `ValueError` on anything else."""
    if len(text) != 16:
        raise ValueError(f"checksum {text!r} is not 16 hex digits")
    return int(text, 16)


def model_checksum(checksums: Mapping[str, int]) -> str:
    """Digest of a whole model from its per-parameter checksums (O(number of parameters)).

    Args:
        checksums: Parameter name -> state checksum, for every parameter of the model.

    Returns:
        A 16-hex-digit xxh3-64 digest; equal digests mean equal weights, bit for bit.
    """
    hasher = xxhash.xxh3_64()
    for name in sorted(checksums):
        hasher.update(f"{name}\t{format_checksum(checksums[name])}\n".encode())
    return hasher.hexdigest()


class PayloadHasher:
    """Incremental form of [`payload_digest`]: feed `(name, tensor)` pairs in ascending name order."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()
        self._last: str | None = None

    def update(self, name: str, tensor: torch.Tensor) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"payload entries must come in ascending name order ({name!r} after {self._last!r})")
        self._last = name
        self._hasher.update(name.encode() + b"\0")
        if tensor.numel():
            # The bytes by address: torch's own views would each drop the GIL and wait for it
            # back, which beside a training loop running Python costs milliseconds per tensor.
            tensor = on_host(tensor)
            self._hasher.update(
                (ctypes.c_ubyte * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
            )

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def payload_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-64 over the names and raw bytes of `tensors`, taken in ascending name order.

    Args:
        tensors: `(name, tensor)` pairs, as stored in a file.

    Returns:
        A 16-hex-digit digest.
    """
    hasher = PayloadHasher()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        hasher.update(name, tensor)
    return hasher.hexdigest()

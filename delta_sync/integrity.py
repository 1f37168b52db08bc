"""Checksums that prove a receiver holds exactly the trainer's bf16 weights.

Two kinds of integrity data travel in every file:

* A *payload digest*: xxh3-64 over the raw bytes of every tensor in the file, in key
  order. It catches a file damaged in storage or in transit, at the cost of hashing the
  file once.
* *State checksums*: one 64-bit checksum per parameter of the full bf16 tensor **after**
  the file is applied, plus a model checksum over all of them. A state checksum is the
  sum, modulo 2^64, of a mixed hash of every element's (flat index, bf16 bit pattern).
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


@numba.njit(inline="always")
def _element_hash(position, bits):
    """splitmix64's finalizer of `position << 16 | bits` (bits: the bf16 pattern, as uint16)."""
    z = ((np.uint64(position) << np.uint64(16)) | np.uint64(bits)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit_cached(nogil=True)
def _hash_run(bits, first):
    """Sum mod 2^64 of the hashes of `(first + i, bits[i])`."""
    total = np.uint64(0)
    for i in range(bits.size):
        total += _element_hash(first + i, np.uint16(bits[i]))
    return total


@njit_cached(nogil=True)
def _hash_at(bits, positions):
    """Sum mod 2^64 of the hashes of `(positions[i], bits[i])`."""
    total = np.uint64(0)
    for i in range(bits.size):
        total += _element_hash(positions[i], np.uint16(bits[i]))
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
def _apply_changes(table, wide):
    """For each row of `table` (the addresses of a tensor's bits, its changes' positions,
    their new bits and a buffer for the old ones, the tensor's and the changes' sizes):
    copies the bits at the positions into the buffer and returns, per row, the sum of the
    hashes of the new elements less that of the old ones, and the index of the first
    change whose position is out of range (-1: none). Positions are int64 if `wide`, else int32."""
    rows = table.shape[0]
    differences = np.zeros(rows, np.uint64)
    errors = np.full(rows, -1, np.int64)
    for t in range(rows):
        numel, count = table[t, 4], table[t, 5]
        bits = view(table[t, 0], numel, np.uint16)
        new_bits = view(table[t, 2], count, np.uint16)
        old_bits = view(table[t, 3], count, np.uint16)
        if wide:
            error, difference = _apply_one(bits, view(table[t, 1], count, np.int64), new_bits, old_bits)
        else:
            error, difference = _apply_one(bits, view(table[t, 1], count, np.int32), new_bits, old_bits)
        errors[t], differences[t] = error, difference
    return differences, errors


@njit_cached(nogil=True)
def _hash_difference(positions, old_bits, new_bits):
    """The sum of the hashes of `(positions[i], new_bits[i])` less that of `(positions[i], old_bits[i])`."""
    total = np.uint64(0)
    for i in range(positions.size):
        total += _element_hash(positions[i], new_bits[i]) - _element_hash(positions[i], old_bits[i])
    return total


@njit_cached(nogil=True)
def _hash_differences(table, wide):
    """[`_hash_difference`] of each row of `table` (the addresses of a tensor's changed
    positions, their old and new bits, and their count). Positions are int64 if `wide`,
    else int32."""
    differences = np.zeros(table.shape[0], np.uint64)
    for t in range(table.shape[0]):
        count = table[t, 3]
        old_bits = view(table[t, 1], count, np.uint16)
        new_bits = view(table[t, 2], count, np.uint16)
        if wide:
            differences[t] = _hash_difference(view(table[t, 0], count, np.int64), old_bits, new_bits)
        else:
            differences[t] = _hash_difference(view(table[t, 0], count, np.int32), old_bits, new_bits)
    return differences


def _hash_sum(bits: np.ndarray, position_of: Callable[[int, int], np.ndarray] | None = None) -> int:
    """Sum mod 2^64 of the element hashes of `(position, bits)` pairs.

    Positions are `0, 1, 2, ...` (a whole tensor), or `position_of(start, stop)` computes
    them chunk by chunk (a shard's positions in the full tensor). Each compiled call runs
    without the GIL.
    """
    bits = np.ascontiguousarray(bits.view(np.uint16))
    if position_of is None:
        return int(_hash_run(bits, 0))
    total = 0
    for start in range(0, bits.size, _CHUNK):
        chunk = np.ascontiguousarray(position_of(start, min(start + _CHUNK, bits.size)), np.int64)
        total += int(_hash_at(bits[start : start + chunk.size], chunk))
    return total & _MASK64


def _bits(values: torch.Tensor) -> np.ndarray:
    if values.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {values.dtype}")
    return values.detach().reshape(-1).cpu().view(torch.int16).numpy()


def tensor_checksum(tensor: torch.Tensor, positions: Callable[[int, int], np.ndarray] | None = None) -> int:
    """State checksum of a whole bf16 tensor, or the part of it a shard contributes.

    Checksums are sums, so the checksums of the shards of a parameter, each taken with the
    shard's positions in the full tensor, add up (mod 2^64) to the full tensor's.

    Args:
        tensor: A `torch.bfloat16` tensor on any device.
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
        old_values: bf16 values at `indices` before the change.
        new_values: bf16 values at `indices` after the change.
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
            bf16 values there before and after.

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
        if old_values.dtype != torch.bfloat16 or new_values.dtype != torch.bfloat16:
            raise TypeError(f"expected bfloat16 values, got {old_values.dtype} and {new_values.dtype}")
        if not indices.numel() == old_values.numel() == new_values.numel():
            raise ValueError(
                f"{indices.numel()} positions but {old_values.numel()} old and {new_values.numel()} new values"
            )
        held.append((on_host(indices), on_host(old_values), on_host(new_values)))
    differences = [0] * len(held)
    for wide in (False, True):
        rows = [r for r, (positions, _, _) in enumerate(held) if (positions.dtype == torch.int64) == wide]
        if rows:
            table = np.array([[*(t.data_ptr() for t in held[r]), held[r][0].numel()] for r in rows], np.int64)
            for r, difference in zip(rows, _hash_differences(table, wide).tolist()):
                differences[r] = difference
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
            the bf16 tensor, the flat positions that change (int32 or int64) and the
            bf16 values they take.

    Returns:
        The old values at `indices` (bf16, 1-D) and the new checksum, per tensor.

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
        if tensor.dtype != torch.bfloat16 or values.dtype != torch.bfloat16:
            raise TypeError(f"expected bfloat16 tensors, got {tensor.dtype} and {values.dtype}")
        tensor, indices, values = on_host(tensor), on_host(indices), on_host(values)
        if indices.numel() != values.numel():
            raise ValueError(f"{indices.numel()} positions but {values.numel()} values")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {indices.dtype}")
        held.append((tensor, indices, values))
    # One buffer for every tensor's old values, sliced (a slice is made without dropping the GIL).
    buffer = torch.empty(sum(indices.numel() for _, indices, _ in held), dtype=torch.bfloat16)
    at = np.cumsum([0] + [indices.numel() for _, indices, _ in held]).tolist()
    held = [(*row, buffer[at[r] : at[r + 1]]) for r, row in enumerate(held)]
    table = np.array(
        [[t.data_ptr(), i.data_ptr(), v.data_ptr(), o.data_ptr(), t.numel(), i.numel()] for t, i, v, o in held],
        np.int64,
    )
    differences = [0] * len(held)
    for wide in (False, True):
        rows = [r for r, (_, indices, _, _) in enumerate(held) if (indices.dtype == torch.int64) == wide]
        if not rows:
            continue
        found, errors = _apply_changes(table[rows], wide)
        for r, difference, error in zip(rows, found.tolist(), errors.tolist()):
            if error != -1:
                tensor, indices = held[r][0], held[r][1]
                raise IndexError(f"position {int(indices[error])} is outside a tensor of {tensor.numel()} elements")
            differences[r] = difference
    checksums = [(checksum + d) & _MASK64 for (checksum, *_), d in zip(changes, differences)]
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
        A 16-hex-digit xxh3-64 digest; equal digests mean equal bf16 weights.
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

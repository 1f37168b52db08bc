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

import functools
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import xxhash

__all__ = [
    "PayloadHasher",
    "add_checksums",
    "format_checksum",
    "model_checksum",
    "parse_checksum",
    "payload_digest",
    "tensor_checksum",
    "updated_checksum",
]

# Elements hashed per numpy call. 64K uint64 temporaries stay in the L2 cache, which
# makes a full-tensor checksum about twice as fast as with large chunks.
_CHUNK = 1 << 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix_into(z: np.ndarray, scratch: np.ndarray) -> None:
    """splitmix64's finalizer, in place on `z` (uint64), using `scratch` as temporary."""
    np.multiply(z, _GOLDEN, out=z)
    for shift, factor in ((30, _MIX1), (27, _MIX2)):
        np.right_shift(z, np.uint64(shift), out=scratch)
        np.bitwise_xor(z, scratch, out=z)
        np.multiply(z, factor, out=z)
    np.right_shift(z, np.uint64(31), out=scratch)
    np.bitwise_xor(z, scratch, out=z)


def _hash_sum(
    bits: np.ndarray,
    positions: np.ndarray | None = None,
    position_of: Callable[[int, int], np.ndarray] | None = None,
) -> int:
    """Sum mod 2^64 of the element hashes of `(position, bits)` pairs.

    `positions` defaults to `0, 1, 2, ...` (a whole tensor); `position_of(start, stop)`
    computes them chunk by chunk instead (a shard's positions in the full tensor). Works
    through the input in cache-sized chunks with preallocated buffers.
    """
    bits = bits.view(np.uint16)
    size = min(_CHUNK, bits.size)
    z = np.empty(size, np.uint64)
    scratch = np.empty(size, np.uint64)
    total = 0
    for start in range(0, bits.size, _CHUNK):
        chunk = bits[start : start + _CHUNK]
        n = chunk.size
        if position_of is not None:
            z[:n] = position_of(start, start + n)
            np.left_shift(z[:n], np.uint64(16), out=z[:n])
        elif positions is None:
            np.add(_shifted_arange(size)[:n], np.uint64(start << 16), out=z[:n])
        else:
            z[:n] = positions[start : start + n]
            np.left_shift(z[:n], np.uint64(16), out=z[:n])
        np.bitwise_or(z[:n], chunk, out=z[:n], casting="unsafe")
        _mix_into(z[:n], scratch[:n])
        # numpy's uint64 sum wraps modulo 2^64, the group the checksum lives in.
        total += int(z[:n].sum(dtype=np.uint64))
    return total & _MASK64


@functools.lru_cache(maxsize=4)
def _shifted_arange(size: int) -> np.ndarray:
    return np.arange(size, dtype=np.uint64) << np.uint64(16)


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

    Costs O(len(indices)), independent of the tensor's size.

    Args:
        checksum: The tensor's checksum before the change.
        indices: Flat (row-major) positions of the changed elements.
        old_values: bf16 values at `indices` before the change.
        new_values: bf16 values at `indices` after the change.
    """
    positions = indices.detach().reshape(-1).cpu().numpy()
    removed = _hash_sum(_bits(old_values), positions)
    added = _hash_sum(_bits(new_values), positions)
    return (checksum - removed + added) & _MASK64


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
            data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            self._hasher.update(memoryview(data))

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

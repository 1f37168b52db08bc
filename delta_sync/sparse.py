"""Flat-index operations on bf16 tensors: find, gather and scatter changed elements.

Gathering and scattering also take float32 tensors (those a model keeps in float32, which
travel as float32): every element is moved as its bit pattern, whatever its width.

On CPU these go through numpy views of the bit patterns: `np.flatnonzero` and numpy
fancy indexing are 5-20x faster than `torch.nonzero` and `tensor[indices]` on CPU
tensors (both single pass, no TensorIterator set-up per call). Other devices use torch.

[`extract_changes_`] is the trainer's hot path: it compares the current weights with the
snapshot, lists the changed elements with their old and new values, and advances the
snapshot at those positions only, in one compiled pass (numba) with no full-size
temporary: the weights are compared 64 elements at a time in one vector compare, fp32
weights rounded to bf16 on the fly; [`extract_changes_many_`] does many tensors in one
compiled call (the detector's path). numba loads the passes from its on-disk cache on
first use in a process (about a second; compiling them the very first time on a machine takes
tens of seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numba
import numpy as np
import torch
from numba import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import overload

from .addresses import as_bfloat16, view
from .bitmasks import LANES, differ, differ_rounded
from .compile_cache import njit_cached
from .staging import HostBuffers

__all__ = [
    "changed_positions",
    "extract_float32_changes_",
    "extract_changes_",
    "extract_changes_batched_",
    "extract_changes_many_",
    "gather",
    "scatter_",
    "scatter_many_",
]


#: The integer dtype of each width of element: what a tensor's bit patterns are read as.
_BITS = {2: torch.int16, 4: torch.int32}


def changed_positions(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Flat positions where two same-shaped tensors of one dtype (2 or 4 bytes per element)
    differ bitwise: ascending int64, on their device. NaNs compare by bit pattern, so no
    change is ever missed."""
    _check_same_dtype(current, previous)
    if current.device.type == "cpu" and previous.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(_bits(current) != _bits(previous)))
    return (_bit_view(current) != _bit_view(previous)).reshape(-1).nonzero().squeeze(1)


def _bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: a view as the integer dtype of its width."""
    bits = _BITS.get(tensor.element_size())
    if bits is None:
        raise TypeError(f"expected a tensor of 2 or 4 bytes per element (bf16, float32), got {tensor.dtype}")
    return tensor.detach().view(bits)


def _bits(tensor: torch.Tensor) -> np.ndarray:
    return _bit_view(tensor).reshape(-1).numpy()


def _check_same_dtype(tensor: torch.Tensor, values: torch.Tensor) -> None:
    # Bit patterns of one dtype written into another would be other numbers, silently.
    if values.dtype != tensor.dtype:
        raise TypeError(f"{values.dtype} values cannot be written bit for bit into a {tensor.dtype} tensor")


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`tensor.view(-1)[indices]` for a bf16 or float32 tensor (a new tensor)."""
    if tensor.device.type == "cpu" and indices.device.type == "cpu":
        return torch.from_numpy(_bits(tensor)[indices.numpy()]).view(tensor.dtype)
    return tensor.reshape(-1)[indices.to(tensor.device, torch.long)]


def scatter_(tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """`tensor.view(-1)[indices] = values` in place, for a contiguous bf16 or float32 tensor
    and values of its dtype.

    Raises:
        TypeError: The values are of another dtype than the tensor.
    """
    if not tensor.is_contiguous():
        raise ValueError("scatter_ writes through a flat view and needs a contiguous tensor")
    _check_same_dtype(tensor, values)
    if tensor.device.type == "cpu" and indices.device.type == "cpu" and values.device.type == "cpu":
        _bits(tensor)[indices.numpy()] = _bits(values)
    else:
        tensor.view(-1)[indices.to(tensor.device, torch.long)] = values.to(tensor.device)


def scatter_many_(changes: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """[`scatter_`] of many tensors: `(tensor, indices, values)` each.

    Contiguous bf16 and float32 CPU tensors with int32 or int64 positions are written in
    one compiled call that runs without the GIL (a replica writes every delta into its
    snapshot while vLLM's thread generates, and a call per tensor would hand the GIL back
    and forth); any other goes through [`scatter_`].

    Raises:
        IndexError: A position is outside its tensor; nothing is written to that tensor or
            to those after it.
        TypeError: Values are of another dtype than their tensor; nothing is written.
    """
    changes = list(changes)
    for tensor, indices, values in changes:
        _check_same_dtype(tensor, values)
        if indices.numel() != values.numel():
            raise ValueError(f"{indices.numel()} positions but {values.numel()} values")
    rows: list[list[int]] = []
    held = []  # keeps every tensor alive through the call
    for tensor, indices, values in changes:
        compiled = (
            tensor.device.type == indices.device.type == values.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.element_size() in _BITS
            and indices.dtype in (torch.int32, torch.int64)
        )
        if not compiled:
            scatter_(tensor, indices, values)
            continue
        indices, values = indices.contiguous(), values.contiguous()
        held.append((indices, values))
        rows.append(
            [
                tensor.data_ptr(),
                tensor.numel(),
                indices.data_ptr(),
                indices.numel(),
                values.data_ptr(),
                indices.dtype == torch.int64,
                tensor.element_size(),
            ]
        )
    if rows:
        error = _scatter_rows(np.array(rows, np.int64))
        if error != -1:
            raise IndexError(f"a position is outside the tensor of {rows[error][1]} elements it is written to")


@njit_cached(nogil=True)
def _scatter_rows(table):
    """Per row of `table` (a tensor's address and size, its positions' address and count,
    its values' address, 1 if the positions are int64 (else int32), and the bytes per
    element, 2 or 4), the values written at the positions; the first row with a position
    out of range (-1: none), which is not written."""
    for t in range(table.shape[0]):
        written = _scatter_row(table[t], np.uint32) if table[t, 6] == 4 else _scatter_row(table[t], np.uint16)
        if not written:
            return t
    return -1


@numba.njit(inline="always")
def _scatter_row(row, bits_type):
    """[`_scatter_bits`] of a row of [`_scatter_rows`]'s table, its bits read as `bits_type`."""
    count = row[3]
    bits, values = view(row[0], row[1], bits_type), view(row[4], count, bits_type)
    if row[5] == 1:
        return _scatter_bits(bits, view(row[2], count, np.int64), values)
    return _scatter_bits(bits, view(row[2], count, np.int32), values)


@njit_cached(nogil=True)
def _scatter_bits(bits, positions, values):
    """`bits[positions] = values` if every position is in range (else False, nothing written)."""
    for i in range(positions.size):
        if positions[i] < 0 or positions[i] >= bits.size:
            return False
    for i in range(positions.size):
        bits[positions[i]] = values[i]
    return True


def extract_changes_(
    current: torch.Tensor, snapshot: torch.Tensor, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The elements where `current`, rounded to bf16, differs bitwise from the bf16
    `snapshot`; advances the snapshot to the new values at those positions only.

    `current` (bf16, or fp32 rounded as `tensor.to(torch.bfloat16)` rounds it) is read
    once, the snapshot once, and only changed positions are written, in one compiled pass
    with no bf16 copy of the tensor.

    Args:
        current: The weights now: a contiguous CPU tensor, bf16 or fp32.
        snapshot: The bf16 weights as last published: contiguous, CPU, as many elements.
        index_dtype: dtype of the positions returned (int32 or int64).

    Returns:
        `(positions, new values, old values)`: ascending flat positions and the bf16 values
        after and before, or None where this path does not apply (another device or dtype,
        a non-contiguous tensor): the caller then compares with torch.

    Example:
        ```python
        >>> positions, new, old = extract_changes_(param.detach(), snapshot[name])
        ```
    """
    return extract_changes_many_([(current, snapshot, index_dtype)])[0]


def extract_float32_changes_(
    current: torch.Tensor, snapshot: torch.Tensor, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The elements whose float32 bits differ between `current` and the float32 `snapshot`
    (a tensor that travels in float32); advances the snapshot at those positions only.

    Through torch, on the snapshot's device: these tensors are few and small (a MoE
    layer's router), beside the bf16 ones the compiled pass takes.

    Args:
        current: The weights now (float32, any device).
        snapshot: The float32 weights as last published, as many elements, contiguous.
        index_dtype: dtype of the positions returned (int32 or int64).

    Returns:
        `(positions, new values, old values)` on the host: ascending flat positions and the
        float32 values after and before.
    """
    if current.dtype != torch.float32 or snapshot.dtype != torch.float32:
        raise TypeError(f"expected float32 weights and snapshot, got {current.dtype} and {snapshot.dtype}")
    flat, held = current.detach().reshape(-1).to(snapshot.device), snapshot.view(-1)
    positions = (flat.view(torch.int32) != held.view(torch.int32)).nonzero().squeeze(1)
    new, old = flat[positions], held[positions]
    held[positions] = new
    return positions.to("cpu", index_dtype), new.cpu(), old.cpu()


def extract_changes_many_(
    triples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.dtype]],
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """[`extract_changes_`] of many tensors: one compiled call for all those the compiled
    pass takes (per dtype of positions), which returns to Python once rather than once per
    tensor. Each return waits for the GIL, which on a trainer the training thread holds: on
    a model of hundreds of tensors, the returns cost more than the small tensors' passes.

    Args:
        triples: `(current, snapshot, index dtype)` per tensor, as [`extract_changes_`] takes them.

    Returns:
        Per triple, what [`extract_changes_`] returns for it.

    Example:
        ```python
        >>> found = extract_changes_many_([(param.detach(), snapshot[name], torch.int32) for name, param in params])
        ```
    """
    results: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(triples)
    for position_dtype in (np.int32, np.int64):
        chosen = [
            i
            for i, (current, snapshot, index_dtype) in enumerate(triples)
            if _fast_path(current, snapshot) and (position_dtype == np.int32) == (index_dtype == torch.int32)
        ]
        if not chosen:
            continue
        # Read by address: on a trainer this runs beside the training thread, and each torch
        # call that drops the GIL would wait for it back.
        table = np.array(
            [
                [current.data_ptr(), snapshot.data_ptr(), snapshot.numel(), current.dtype == torch.float32]
                for current, snapshot, _ in (triples[i] for i in chosen)
            ],
            np.int64,
        )
        # `triples` keeps every tensor alive through the call.
        positions, new, old = _extract_rows(table, np.empty(0, position_dtype), np.int16(_NAN_BF16 or 0))
        for i, found in zip(chosen, zip(positions, new, old)):
            results[i] = (torch.from_numpy(found[0]), as_bfloat16(found[1]), as_bfloat16(found[2]))
    return results


@njit_cached(nogil=True)
def _extract_rows(table, like, nan_bits):
    """[`_extract`] of every tensor in `table` (per row: the addresses of the weights and of
    the snapshot, their elements, and 1 where the weights are fp32, 0 where bf16), to the
    end: `(positions, new, old)`, one array each per row, positions of `like`'s dtype."""
    positions, new, old = [], [], []
    for t in range(table.shape[0]):
        numel = table[t, 2]
        snapshot = view(table[t, 1], numel, np.int16)
        if table[t, 3]:
            found = _extract_all(view(table[t, 0], numel, np.int32), snapshot, like, nan_bits)
        else:
            found = _extract_all(view(table[t, 0], numel, np.int16), snapshot, like, np.int16(0))
        positions.append(found[0])
        new.append(found[1])
        old.append(found[2])
    return positions, new, old


@numba.njit(inline="always")
def _extract_all(current, snapshot, like, nan_bits):
    """[`_extract`] of one tensor to its end, into buffers that grow as needed: changes are
    usually a few percent, so they start there (a full-size one would be a second copy of
    the model)."""
    numel = snapshot.size
    capacity = max(LANES, numel // 16)
    positions = np.empty(capacity, like.dtype)
    new, old = np.empty(capacity, np.int16), np.empty(capacity, np.int16)
    count, start = 0, 0
    while True:
        found, start = _extract(current, snapshot, start, positions[count:], new[count:], old[count:], nan_bits)
        count += found
        if start >= numel:
            return positions[:count], new[:count], old[:count]
        capacity = count + max(LANES, min(numel - start, capacity))
        positions = _grown(positions, count, capacity)
        new, old = _grown(new, count, capacity), _grown(old, count, capacity)


@numba.njit(inline="always")
def _grown(array, count, capacity):
    """A buffer of `capacity` elements holding the first `count` of `array`."""
    grown = np.empty(capacity, array.dtype)
    grown[:count] = array[:count]
    return grown


def _torch_nan_bits() -> int | None:
    """The bf16 bit pattern torch rounds every fp32 NaN to (one pattern, whatever the NaN's
    sign and payload, in both its vectorised and its scalar loops), or None if this build
    is not consistent about it: fp32 tensors then go through torch."""
    found = set()
    for size in (1, 3, 64, 1027):
        words = torch.full((size,), 0x7FC00000, dtype=torch.int32)
        words[::2] = -0x3F000000  # 0xC1000000 + payloads: a negative NaN, every other
        words[::2] |= 0x7F812345
        found.update(words.view(torch.float32).to(torch.bfloat16).view(torch.int16).tolist())
    return found.pop() if len(found) == 1 else None


def _fast_path(current: torch.Tensor, snapshot: torch.Tensor) -> bool:
    return (
        current.device.type == "cpu"
        and snapshot.device.type == "cpu"
        and (current.dtype == torch.bfloat16 or (current.dtype == torch.float32 and _NAN_BF16 is not None))
        and snapshot.dtype == torch.bfloat16
        and current.is_contiguous()
        and snapshot.is_contiguous()
        and current.numel() == snapshot.numel()
    )


_NAN_BF16 = _torch_nan_bits()


def _bf16_bits(current, i, nan_bits):
    """bf16 bits of element `i` of the weights as compared (int16 bf16 bits, or int32 fp32
    bits, rounded to nearest even as torch does, NaN to torch's pattern)."""


@overload(_bf16_bits, inline="always")
def _bf16_bits_of(current, i, nan_bits):
    if current.dtype == types.int16:
        return lambda current, i, nan_bits: current[i]

    def rounded(current, i, nan_bits):
        word = np.uint32(current[i])
        if word & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
            return np.int16(nan_bits)
        return np.int16((word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    return rounded


def _differ(current, snapshot, start, nan_bits):
    """Mask of the 64 elements from `start` whose bf16 bits differ from the snapshot's."""


@overload(_differ, inline="always")
def _differ_of(current, snapshot, start, nan_bits):
    if current.dtype == types.int16:
        return lambda current, snapshot, start, nan_bits: differ(current, snapshot, start)
    return lambda current, snapshot, start, nan_bits: differ_rounded(current, snapshot, start, nan_bits)


@njit_cached(nogil=True)
def _extract(current, snapshot, start, positions, new, old, nan_bits):
    """Compare from `start` (a multiple of 64), 64 elements at a time, until the end or
    until the buffers could overflow; record and apply the changes. `current` holds bf16
    bits (int16) or fp32 bits (int32), rounded on the fly.

    Returns `(changes recorded, where to resume)`. Each 64 elements are compared in one
    vector compare into a 64-bit mask ([`delta_sync.bitmasks.differ`],
    [`delta_sync.bitmasks.differ_rounded`]); only the changed elements are visited, by its
    set bits.
    """
    numel = snapshot.size
    capacity = positions.size
    count = 0
    whole = numel - numel % LANES
    chunk = start
    while chunk < whole:
        # As many chunks as the buffers hold even if every element changed.
        end = min(whole, chunk + LANES * ((capacity - count) // LANES))
        if end == chunk:
            return count, chunk
        for group in range(chunk, end, LANES):
            mask = _differ(current, snapshot, group, nan_bits)
            while mask:
                i = group + trailing_zeros(mask)
                _record(snapshot, i, _bf16_bits(current, i, nan_bits), positions, new, old, count)
                count += 1
                mask &= mask - np.uint64(1)
        chunk = end
    if count + LANES > capacity:
        return count, whole
    for i in range(whole, numel):  # the last elements, fewer than 64
        value = _bf16_bits(current, i, nan_bits)
        if value != snapshot[i]:
            _record(snapshot, i, value, positions, new, old, count)
            count += 1
    return count, numel


@numba.njit(inline="always")
def _record(snapshot, i, value, positions, new, old, count):
    """Record the change of element `i` to the bf16 bits `value` as the `count`-th, and apply
    it to the snapshot."""
    positions[count] = i
    new[count] = value
    old[count] = snapshot[i]
    snapshot[i] = value


def extract_changes_batched_(
    pairs: Sequence[tuple[torch.Tensor | Callable[[], torch.Tensor], torch.Tensor, torch.dtype]],
    *,
    old_values: bool = True,
    host_buffers: HostBuffers | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]:
    """[`extract_changes_`] for many tensors at once, with torch operations only: the path
    for tensors the compiled pass does not take (on a GPU, non-contiguous, other dtypes),
    with a fixed number of host synchronisations per device, whatever the number of tensors.

    Each current tensor is rounded to bf16 as `tensor.to(torch.bfloat16)` does and compared
    bitwise with its snapshot twice: once to count the changes of every tensor (one
    synchronisation per device for all its counts), once to list them (`nonzero_static` of
    exactly that size). The counts size one host buffer for the whole call; each tensor's
    positions, new and old values are copied into it as soon as they are listed (from a GPU
    into pinned memory, without blocking) and the snapshot advanced at those positions
    only, so its device temporaries are freed before the next tensor's are made. One more
    synchronisation per device ends the call. A model spread over several devices
    (`device_map="auto"`, parts on the CPU) is counted and synchronised device by device.

    Memory, beyond the weights and the snapshot: on the device, one tensor at a time, its
    mask (1 byte per element), its bf16 rounding where the weights are not bf16 on the
    snapshot's device (2 bytes per element) and 16 bytes per changed element of that tensor
    (int64 positions, their int32 copy, new and old values); nothing that grows with the
    step's changes. On the host, the one buffer: per changed element 4 bytes of positions
    (8 where a tensor has 2^31 elements or more), 2 of new values and 2 of old values with
    `old_values`.

    Args:
        pairs: `(current, snapshot, index dtype)` per tensor: the weights now (any float
            dtype, any layout, as many elements as the snapshot), or a function that
            computes them (a PEFT merge), called once per pass, so that no computed weight
            outlives its turn (it must give the same bits each time), the contiguous bf16
            snapshot on the weights' device or the host, and the dtype of the positions
            (int32 or int64).
        old_values: Bring the old values to the host too; without them (a caller that
            has them on the host already, e.g. a host mirror) 2 bytes less cross per change.
        host_buffers: Where the host buffer comes from when a snapshot is on a GPU (a
            bounded pool of pinned buffers); by default pinned by torch's allocator.

    Returns:
        Per pair, `(positions, new values, old values)` as host tensors, views of the one
        host buffer (ascending flat positions of the dtype asked for, bf16 values; old
        values None without `old_values`), or None where nothing changed.

    Example:
        ```python
        >>> found = extract_changes_batched_([(param.detach(), snapshot[name], torch.int32)])
        ```
    """
    if not pairs:
        return []
    devices = list(dict.fromkeys(snapshot.device for _, snapshot, _ in pairs))
    counts = [0] * len(pairs)
    stacked = {
        device: torch.stack(
            [_changed(current, snapshot).sum() for current, snapshot, _ in pairs if snapshot.device == device]
        )
        for device in devices
    }
    for device, device_counts in stacked.items():  # the first synchronisation, per device
        chosen = (i for i, (_, snapshot, _) in enumerate(pairs) if snapshot.device == device)
        for i, count in zip(chosen, device_counts.tolist()):
            counts[i] = count
    total = sum(counts)
    if not total:
        return [None] * len(pairs)
    # Positions cross as int32 unless a tensor is too large for it: 4 bytes a change, not 8.
    wide = any(snapshot.numel() > torch.iinfo(torch.int32).max for _, snapshot, _ in pairs)
    position_dtype = torch.int64 if wide else torch.int32
    host_positions, host_new, host_old = _host_buffer(
        total, position_dtype, old_values, any(d.type == "cuda" for d in devices), host_buffers
    )
    start = 0
    for (current, snapshot, _), count in zip(pairs, counts):
        if not count:
            continue
        end = start + count
        bits, snap = _rounded(current, snapshot), snapshot.view(-1).view(torch.int16)
        found = torch.nonzero_static(bits != snap, size=count).squeeze(1)
        values = bits[found]
        _copy_to_host(host_positions[start:end], found)
        _copy_to_host(host_new[start:end], values)
        if host_old is not None:
            _copy_to_host(host_old[start:end], snap[found])
        snap[found] = values
        start = end
        # Freed before the next tensor's are made, not when the names are bound again.
        del bits, snap, found, values
    for device in devices:  # the second synchronisation, per device
        _synchronize(device)
    results: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None] = []
    start = 0
    for (_, _, dtype), count in zip(pairs, counts):
        if not count:
            results.append(None)
            continue
        end = start + count
        positions = host_positions[start:end]
        results.append(
            (
                positions if positions.dtype == dtype else positions.to(dtype),
                host_new[start:end].view(torch.bfloat16),
                None if host_old is None else host_old[start:end].view(torch.bfloat16),
            )
        )
        start = end
    return results


def _rounded(current: torch.Tensor | Callable[[], torch.Tensor], snapshot: torch.Tensor) -> torch.Tensor:
    """The weights' bf16 bits, flat, on the snapshot's device: rounded where the weights
    live, then moved (2 bytes an element cross, not 4); the weights themselves when they are
    contiguous bf16 there already."""
    if callable(current):
        current = current()
    return current.detach().reshape(-1).to(torch.bfloat16).to(snapshot.device).view(torch.int16)


def _changed(current: torch.Tensor | Callable[[], torch.Tensor], snapshot: torch.Tensor) -> torch.Tensor:
    """Mask of the elements whose bf16 bits differ from the snapshot's."""
    return _rounded(current, snapshot) != snapshot.view(-1).view(torch.int16)


def _host_buffer(
    total: int, position_dtype: torch.dtype, old_values: bool, pinned: bool, host_buffers: HostBuffers | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One host buffer for `total` changes, cut into positions, new values and (with
    `old_values`) old values; positions first, so that they are aligned for any width."""
    position_bytes = torch.empty(0, dtype=position_dtype).element_size()
    sizes = [total * position_bytes, 2 * total] + ([2 * total] if old_values else [])
    if pinned and host_buffers is not None:
        buffer = host_buffers.take(sum(sizes))
    else:
        # Pinned only where CUDA is: a placed stand-in of a device on a host without one.
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
    parts = buffer.split(sizes)
    return parts[0].view(position_dtype), parts[1].view(torch.int16), parts[2].view(torch.int16) if old_values else None


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _copy_to_host(destination: torch.Tensor, source: torch.Tensor) -> None:
    """`destination.copy_(source)`: from a GPU without blocking (the caller synchronises
    each device once), narrowed to the destination's dtype on the device first, so that
    the narrow form is what crosses."""
    if source.device.type == "cpu":
        destination.copy_(source)
        return
    destination.copy_(source.to(destination.dtype), non_blocking=True)

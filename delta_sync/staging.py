"""[`HostBuffers`]: the host memory a step's changes cross into from a device, reused.

Changes found on a GPU cross to the host into page-locked (pinned) memory, so that the
copies run without blocking and one synchronisation covers them all. torch's caching host
allocator (`torch.empty(..., pin_memory=True)`) rounds every request up to a power of two
and keeps what is freed cached for the life of the process: a step of 5 GB of changes
takes 8 GB of pinned memory, and each change set the publisher still holds (up to
`max_pending` + 2) keeps its own. Page-locked memory is taken from what the whole machine
can swap, so that waste is not free.

[`HostBuffers`] holds at most `limit` buffers of the size asked (plus a little headroom,
so that the next step's slightly larger set fits), each pinned once, and lends one per
step: a buffer is free again once no tensor made from it is alive (the change set and every
view of it are gone). A request that no free buffer fits replaces the smallest free one;
with every buffer lent, it gets a buffer of its own that is not kept.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["HostBuffers"]

#: Extra room a new buffer gets over the request: the next steps' sets are rarely equal.
HEADROOM = 1.125


def _pin(array: np.ndarray) -> Callable[[], None]:
    """Page-lock `array`'s memory for CUDA copies; returns what unlocks it."""
    from torch.cuda import _pin_memory_utils

    address = array.ctypes.data
    _pin_memory_utils.pin_memory(address, array.nbytes)
    return lambda: _pin_memory_utils.unpin_memory(address)


class _Buffer:
    """One host allocation, pinned while the pool keeps it."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.array = np.empty(max(nbytes, 1), np.uint8)
        self._unpin = _pin(self.array) if pinned else None
        #: The lent view while a tensor made from it is alive.
        self.lent: weakref.ref | None = None

    @property
    def free(self) -> bool:
        return self.lent is None or self.lent() is None

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None

    def __del__(self) -> None:
        self.release()


class HostBuffers:
    """A bounded pool of host buffers, one lent per step (see the module's docstring).

    Args:
        limit: Buffers kept at most (the change sets alive at once: `max_pending` + 2 for
            the publisher).
        pinned: Page-lock the buffers (for copies from a CUDA device); False on a host
            without one.

    Host memory kept: at most `limit` buffers of 1.125x the largest request each; a request
    made while all of them are lent gets an unpinned buffer of exactly its size, freed with
    the tensors made from it.

    Example:
        ```python
        >>> buffers = HostBuffers(limit=4, pinned=torch.cuda.is_available())
        >>> staged = buffers.take(6 * changed)  # uint8, exactly that many bytes
        ```
    """

    def __init__(self, limit: int = 4, *, pinned: bool = False) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self.pinned = pinned
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Host bytes the pool keeps (lent or free)."""
        return sum(buffer.array.nbytes for buffer in self._buffers)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of exactly `nbytes`, lent until every tensor made from it
        (views included) is gone."""
        with self._lock:
            buffer = self._choose(nbytes)
            # The lent view is what torch's storage holds: it dies with the last tensor
            # that shares that storage, and the buffer is free again.
            lent = buffer.array[:nbytes]
            tensor = torch.from_numpy(lent)
            buffer.lent = weakref.ref(lent)
            return tensor

    def _choose(self, nbytes: int) -> _Buffer:
        free = [buffer for buffer in self._buffers if buffer.free]
        fitting = [buffer for buffer in free if buffer.array.nbytes >= nbytes]
        if fitting:
            return min(fitting, key=lambda buffer: buffer.array.nbytes)
        if len(self._buffers) >= self.limit and free:
            dropped = min(free, key=lambda buffer: buffer.array.nbytes)
            self._buffers.remove(dropped)
            dropped.release()
        if len(self._buffers) >= self.limit:
            # Every kept buffer is lent: one of its own, not pinned (unpinning it when the
            # pool lets go would race the copies into it), so its copies block instead.
            return _Buffer(nbytes, pinned=False)
        fresh = _Buffer(int(nbytes * HEADROOM), self.pinned)
        self._buffers.append(fresh)
        return fresh

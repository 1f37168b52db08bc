"""[`SnapshotLease`]: the publisher's hold on the detector's snapshot while it encodes a version.

An anchor is written from the detector's snapshot and a compact delta is coded against
it, so the snapshot must not move (the next `changes()` advances it) until the files of
that version are encoded. The lease is taken on the training thread when the version is
published and released exactly once, on whichever thread writes it: as soon as the
version's files are encoded and staged, before any upload begins (an upload needs the
encoded bytes, not the snapshot), or when the version fails or is dropped.
"""

from __future__ import annotations

import threading

__all__ = ["SnapshotLease"]


class SnapshotLease:
    """Holds a lock from [`take`] until the first [`release`]; later releases do nothing.

    Example:
        ```python
        >>> lease = SnapshotLease.take(detector.snapshot_lock)  # the training thread
        >>> ...  # the writer thread encodes from detector.snapshot
        >>> lease.release()  # next changes() may run; the uploads go on
        >>> lease.release()  # no-op
        ```
    """

    def __init__(self, lock: threading.Lock | None) -> None:
        # The lock this lease holds, None once released (or for a lease that holds nothing).
        self._lock = lock
        self._guard = threading.Lock()

    @classmethod
    def take(cls, lock: threading.Lock) -> SnapshotLease:
        """Acquire `lock` (blocking) and hold it in a new lease."""
        lock.acquire()
        return cls(lock)

    @classmethod
    def none(cls) -> SnapshotLease:
        """A lease that holds nothing (a version that needs no snapshot, e.g. a raw delta)."""
        return cls(None)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        """Release the lock if this lease still holds it."""
        with self._guard:
            lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

"""[`AnchorSchedule`]: which versions the publisher stores as anchors, by count and by bytes.

Pure bookkeeping, no I/O: the publisher asks it what to store for each version
([`AnchorSchedule.plan`], on the training thread) and tells it what was stored
([`AnchorSchedule.stored_anchor`] / [`AnchorSchedule.stored_delta`], on the thread that
writes). Its state is behind a lock of its own, so the two may be different threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["AnchorSchedule", "Plan"]


@dataclass(frozen=True)
class Plan:
    """What to store for one version.

    Args:
        delta: Store a delta against the version before.
        anchor: Store an anchor (the full weights) of this version.
    """

    delta: bool
    anchor: bool


class AnchorSchedule:
    """Decides, version by version, whether to store a delta, an anchor, or both.

    The first version, and the first after [`restart`] (a failed version), is an anchor
    alone: there is nothing stored to be a delta against. Every later version has a delta,
    and also an anchor when any of these holds:

    * it is the `every`-th version since the last anchor;
    * the deltas stored since the last anchor outweigh `bytes_ratio` times that anchor,
      so that a replica joining late downloads at most about `1 + bytes_ratio` anchors'
      worth to catch up;
    * more than a third of the model changed: a raw delta costs 6 bytes per changed
      element and an anchor 2 per element, so the anchor alone is smaller (and cheaper to
      apply), and the delta is left out.

    Args:
        every: Store an anchor every this many versions (>= 1, as `PublisherOptions`
            checks; 1 stores one with every version).
        bytes_ratio: The bytes rule's fraction (> 0), or None to count versions only.

    Example:
        ```python
        >>> schedule = AnchorSchedule(every=3, bytes_ratio=None)
        >>> schedule.plan(changed=0, total=100)
        Plan(delta=False, anchor=True)
        >>> schedule.stored_anchor(200)
        >>> schedule.plan(changed=1, total=100)
        Plan(delta=True, anchor=False)
        ```
    """

    def __init__(self, every: int, bytes_ratio: float | None) -> None:
        self.every = every
        self.bytes_ratio = bytes_ratio
        self._lock = threading.Lock()
        self._restart = True  # the next version is an anchor alone
        self._since_anchor = 0  # versions planned since the last planned anchor
        self._anchor_bytes = 0  # the newest stored anchor (all of its parts)
        self._delta_bytes = 0  # the deltas stored since it

    @property
    def catch_up_heavy(self) -> bool:
        """Whether the deltas stored since the last anchor outweigh `bytes_ratio` of it."""
        with self._lock:
            return self._heavy()

    def _heavy(self) -> bool:
        return self.bytes_ratio is not None and self._delta_bytes > self.bytes_ratio * self._anchor_bytes > 0

    @property
    def catch_up_bytes(self) -> int:
        """What a replica joining now downloads: the newest stored anchor and the deltas after it."""
        with self._lock:
            return self._anchor_bytes + self._delta_bytes

    def plan(self, changed: int, total: int, *, catch_up_heavy: bool | None = None) -> Plan:
        """Decide the next version, and count it.

        Args:
            changed: Elements that changed since the version before (all ranks').
            total: Elements of the model.
            catch_up_heavy: The bytes rule's verdict to use instead of this schedule's own
                [`catch_up_heavy`] (with parts: rank 0's, so that every rank decides alike).
        """
        with self._lock:
            if catch_up_heavy is None:
                catch_up_heavy = self._heavy()
            dense = 3 * changed > total
            anchor = self._restart or dense or catch_up_heavy or self._since_anchor + 1 >= self.every
            delta = not (self._restart or dense)
            self._since_anchor = 0 if anchor else self._since_anchor + 1
            self._restart = False
            return Plan(delta=delta, anchor=anchor)

    def restart(self) -> None:
        """A version failed: the next one is an anchor alone, for replicas to recover from."""
        with self._lock:
            self._restart = True

    def stored_anchor(self, size: int) -> None:
        """An anchor of `size` bytes (all parts) is stored; the deltas before it no longer count."""
        with self._lock:
            self._anchor_bytes, self._delta_bytes = size, 0

    def stored_delta(self, size: int) -> None:
        """A delta of `size` bytes (all parts), with no anchor of its version, is stored."""
        with self._lock:
            self._delta_bytes += size

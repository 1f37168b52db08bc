"""What a [`Receiver`] reports and keeps of an update: [`ApplyResult`] (what a request
did), [`Prepared`] (what one `prepare` call did), [`PendingUpdate`] (the open update, from
`prepare` until its commit or abort) and [`Freshness`] (how old the pointer followed is).

`Receiver` is `delta_sync.replica.receiver.Receiver`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..version import HeldVersion
from .loaders import LoadWeights
from .store import DeltaUndo

__all__ = [
    "MAX_STALENESS_ENV",
    "ApplyResult",
    "Freshness",
    "PendingUpdate",
    "Prepared",
    "UpdateOwner",
    "max_staleness_from_env",
]

#: Seconds after which a replica whose `latest.json` is no newer calls itself stale.
MAX_STALENESS_ENV = "DELTA_SYNC_MAX_STALENESS"


@dataclass(frozen=True)
class ApplyResult:
    """What a receiver did for one request.

    Args:
        version: The version held afterwards.
        applied: Sources of the files applied, in order (empty for a no-op).
        changed_elements: Elements changed in total.
        loaded_tensors: Tensors handed to `load_weights`.
        seconds: Wall time, download included.
    """

    version: int | None
    applied: tuple[str, ...]
    changed_elements: int
    loaded_tensors: int
    seconds: float

    @property
    def noop(self) -> bool:
        return not self.applied


@dataclass(frozen=True)
class Freshness:
    """How fresh the `latest.json` a receiver follows is.

    Args:
        age: Seconds since the trainer wrote (or refreshed) the newest pointer this
            receiver accepted; None before it read one, or for a pointer without a time.
        max_age: The age past which it is stale (`DELTA_SYNC_MAX_STALENESS`), or None.
    """

    age: float | None
    max_age: float | None

    @property
    def stale(self) -> bool:
        """The pointer is older than `max_age`: the trainer stopped, or someone holds the
        bucket's pointer back."""
        return self.max_age is not None and self.age is not None and self.age > self.max_age


@dataclass(frozen=True)
class Prepared:
    """What one [`Receiver.prepare`] call did.

    Args:
        version: The version the receiver holds afterwards (what a commit loads).
        applied: Sources of the files this call checked and applied to the snapshot.
        snapshot_version: The version the snapshot holds: ahead of `version` when another
            process sharing it has moved it further.
    """

    version: int | None
    applied: tuple[str, ...]
    snapshot_version: int | None


class UpdateOwner(Protocol):
    """What a [`PendingUpdate`] calls back: the receiver that opened it (a `Receiver`)."""

    @property
    def version(self) -> int | None: ...

    def commit(self, pending: PendingUpdate, load_weights: LoadWeights | None = None) -> ApplyResult: ...

    def abort(self, pending: PendingUpdate) -> None: ...


@dataclass(eq=False)
class PendingUpdate:
    """Files applied to a [`Receiver`]'s snapshot but not yet loaded into the model: a
    record the receiver keeps while an update is open.

    [`Receiver.prepare`] returns it; end it with exactly one [`Receiver.commit`] (load the
    changed tensors) or [`Receiver.abort`] (undo the snapshot changes); `commit()` and
    `abort()` here say the same. While it is open the receiver's `version`, `weights` and
    `checksums` already describe the prepared version, and further `prepare` calls on the
    receiver extend this same update.

    Undoing a delta costs O(changed elements): its old values are kept. An anchor replaces
    every tensor and is not undone in a private snapshot (that would take a second full
    copy of the model), so aborting an update that holds an anchor leaves such a receiver
    with no trustworthy version: its next update loads an anchor.

    Args:
        receiver: The receiver it belongs to.
        served: What the model held when the update opened.

    Example:
        ```python
        >>> pending = receiver.prepare("./deltas", "deltas/step_00000007.safetensors")
        >>> pending.version, len(pending.names)
        (7, 12)
        >>> pending.commit()  # or pending.abort()
        ```
    """

    receiver: UpdateOwner
    served: HeldVersion | None
    #: Elements the applied files changed.
    changed_elements: int = 0
    #: How to undo the deltas applied since the last anchor, oldest first.
    undo: list[DeltaUndo] = field(default_factory=list)
    #: Whether an anchor was applied (nothing before it can be undone in a private snapshot).
    anchored: bool = False
    #: What each `prepare` call did, in order.
    steps: list[Prepared] = field(default_factory=list)
    #: "open", "committed" or "aborted".
    state: Literal["open", "committed", "aborted"] = "open"
    started: float = field(default_factory=time.perf_counter)
    _names: set[str] = field(default_factory=set)
    _applied: list[str] = field(default_factory=list)

    @property
    def applied(self) -> tuple[str, ...]:
        """Sources of the files applied so far, in order."""
        return tuple(self._applied)

    @property
    def names(self) -> frozenset[str]:
        """Parameters the model must load to reach the prepared version: what a commit loads."""
        return frozenset(self._names)

    @property
    def version(self) -> int | None:
        """The version prepared."""
        return self.receiver.version

    @property
    def is_open(self) -> bool:
        """Neither committed nor aborted yet."""
        return self.state == "open"

    @property
    def last(self) -> Prepared | None:
        """What the latest `prepare` call did."""
        return self.steps[-1] if self.steps else None

    def commit(self, load_weights: LoadWeights | None = None) -> ApplyResult:
        """[`Receiver.commit`] this update."""
        return self.receiver.commit(self, load_weights)

    def abort(self) -> None:
        """[`Receiver.abort`] this update."""
        self.receiver.abort(self)

    def record(self, source: str, names: Iterable[str], changed_elements: int, undo: DeltaUndo | None) -> None:
        """Note one file about to be applied; `undo` is None for an anchor."""
        if undo is None:
            self.anchored = True
            self.undo.clear()
        else:
            self.undo.append(undo)
        self._names.update(names)
        self._applied.append(source)
        self.changed_elements += changed_elements

    def need(self, names: Iterable[str]) -> None:
        """Parameters the model must load besides those the applied files changed."""
        self._names.update(names)

    def close(self, state: Literal["committed", "aborted"]) -> None:
        if self.state != "open":
            raise RuntimeError(f"this pending update was already {self.state}")
        self.state = state


def max_staleness_from_env() -> float | None:
    """The staleness bound `DELTA_SYNC_MAX_STALENESS` sets, in seconds; None when unset.

    Raises:
        ValueError: It is not a positive number.
    """
    value = os.environ.get(MAX_STALENESS_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{MAX_STALENESS_ENV} must be a positive number of seconds, got {value!r}")
    return seconds

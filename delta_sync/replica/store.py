"""Where a `Receiver` keeps the weights of the versions it checks: a snapshot store.

A [`Receiver`](receiver) checks every file against the version its store holds and writes
what it accepts into the store; it never holds weights itself. Two stores exist:

| store | where the weights live | who advances it |
| --- | --- | --- |
| [`PrivateSnapshot`] | tensors of this process | this receiver alone |
| `NodeStore` (`delta_sync.replica.shared`) | the machine's memory-mapped node snapshot | every receiver of the machine, one at a time |

The receiver tracks separately which of the store's versions its own model holds: with a
shared store, another process may have moved the data past it, and the store rebuilds the
tensors of a recent version on request ([`SnapshotStore.tensors`]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import SnapshotMovedError
from ..format import Anchor, FileHeader, SparseChange
from ..sparse import scatter_
from ..version import HeldVersion
from .snapshot import HistoryEntry

__all__ = [
    "DeltaUndo",
    "PrivateSnapshot",
    "SnapshotMemory",
    "SnapshotStore",
    "changed_between",
    "deltas_between",
    "union_positions",
]


@dataclass(frozen=True)
class SnapshotMemory:
    """Where a receiver's snapshot lives, and what this process holds of it.

    Args:
        shared_path: The node snapshot's file, or None for a private snapshot.
        shared_bytes: Size of that file (one copy per machine, however many map it).
        private_bytes: Bytes of the snapshot this process holds as its own copy: a private
            snapshot's tensors, or copy-on-write pages of the shared file (none while it is
            mapped shared, as it is).
        resident_bytes: Pages of the shared file resident in this process's mapping.
        proportional_bytes: This process's share of them (the kernel's PSS: pages mapped by
            `n` processes count `1/n`), so the shares of a machine's workers add up to
            what the machine holds.
    """

    shared_path: str | None
    shared_bytes: int
    private_bytes: int
    resident_bytes: int = 0
    proportional_bytes: int = 0


@dataclass(frozen=True)
class DeltaUndo:
    """What undoes one delta in a store: O(changed elements).

    Args:
        previous: Parameter name -> (flat indices, the values there before the delta).
        before: The version held before the delta.
    """

    previous: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    before: HeldVersion


class SnapshotStore(Protocol):
    """The weights a [`Receiver`](receiver) checks files against and writes them into.

    Every read and write happens inside [`session`]; writes come only after the receiver
    checked the file, with the version they produce.
    """

    #: Whether other processes advance the same data. A shared store keeps the versions it
    #: checked when one receiver aborts, and a model out of step with it is repaired by
    #: loading every tensor again; a private store undoes an aborted delta, and after a
    #: failed load it demands an anchor.
    shared: bool

    @property
    def held(self) -> HeldVersion | None:
        """The version the data holds, or None."""

    @property
    def last_seen(self) -> HeldVersion | None:
        """The version the data held when this process last used it; readable outside a
        session, without a lock."""

    @property
    def anchor_needed(self) -> str | None:
        """Why only an anchor may change the data next, or None."""

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        """Every parameter at the version the data holds."""

    def session(self, bucket_url: str | None, shapes: Mapping[str, tuple[int, ...]] | None) -> Iterator[None]:
        """A context manager: exclusive use of the data for the bucket's files."""

    def is_for(self, bucket_url: str) -> bool:
        """Whether the data is that bucket's, or no bucket's yet (a store kept per bucket
        moves to another bucket's data only when an update asks for it)."""

    def write_delta(self, header: FileHeader, changes: Mapping[str, SparseChange], undo: DeltaUndo, held: HeldVersion):
        """Write a checked delta's values; the data then holds `held`."""

    def write_anchor(self, header: FileHeader, anchor: Anchor, held: HeldVersion) -> None:
        """Write a checked anchor's tensors; the data then holds `held`."""

    def restore(self, undo: DeltaUndo) -> None:
        """Undo the newest delta (private stores only)."""

    def distrust(self, reason: str) -> None:
        """Only an anchor may change the data next."""

    def forget(self, reason: str) -> None:
        """The data holds no version any more (an anchor written and then given up)."""

    def version(self, version: int) -> HeldVersion | None:
        """A version whose tensors [`tensors`] can give, or None."""

    def recent(self) -> list[HistoryEntry]:
        """The versions held recently, oldest first, ending with the one held."""

    def moved_past(self, version: int) -> SnapshotMovedError:
        """The error for a version the store cannot give any more."""

    def tensors(self, held: HeldVersion, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
        """A context manager yielding the tensors `names` at `held`, for the model to load."""

    def changed_positions(
        self, base: HeldVersion | None, target: HeldVersion, names: Iterable[str]
    ) -> dict[str, torch.Tensor] | None:
        """The flat positions of `names` whose values differ between `base` and `target`
        (see [`union_positions`]), or None when the store cannot tell."""

    def memory(self) -> SnapshotMemory:
        """Where the data lives, and what this process holds of it."""


def changed_between(store: SnapshotStore, base: HeldVersion | None, target: HeldVersion) -> set[str] | None:
    """What a model holding `base` must load to hold `target`: the union of the names the
    versions between them changed, or None (everything) when the store's history cannot
    tell (another run or start, an anchor between them, a gap, other weights at `base`)."""
    between = deltas_between(store.recent(), base, target)
    return None if between is None else {name for entry in between for name in entry.names}


def deltas_between(
    recent: Iterable[HistoryEntry], base: HeldVersion | None, target: HeldVersion
) -> list[HistoryEntry] | None:
    """The deltas that lead from `base` to `target` (either way), from a store's recent
    versions; None when they cannot tell."""
    if base is None or not base.id.same_start(target.id):
        return None
    recent = list(recent)
    low, high = sorted((base.version, target.version))
    between = [entry for entry in recent if low < entry.version <= high]
    known = next((entry.held for entry in recent if entry.version == base.version), None)
    if (
        known is None
        or known.model_checksum != base.model_checksum
        or len(between) != high - low
        or any(entry.kind == "anchor" for entry in between)
    ):
        return None
    return between


def union_positions(per_version: Iterable[Mapping[str, torch.Tensor]], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Every flat position any of the versions changed, per parameter, ascending (int64)."""
    found: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for positions in per_version:
        for name, indices in positions.items():
            if name in found:
                found[name].append(indices.to(torch.int64))
    return {
        name: torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.int64)
        for name, parts in found.items()
    }


class PrivateSnapshot:
    """A snapshot in this process's memory: one copy of the model, as the bucket carries it
    (bf16, and float32 where it travels in float32), for one receiver.

    Args:
        history: Recent versions remembered (their names and checksums, not their
            weights), so that a commit loads only what the versions since the model's
            changed.
    """

    shared = False

    def __init__(self, *, history: int = 64, positions: int = 8) -> None:
        self._weights: dict[str, torch.Tensor] = {}
        self._held: HeldVersion | None = None
        self._anchor_needed: str | None = None
        self._recent: list[HistoryEntry] = []
        self._history = history
        # The positions each recent delta changed, for loaders that patch: O(changed) each.
        self._positions: dict[int, dict[str, torch.Tensor]] = {}
        self._positions_kept = positions

    @property
    def held(self) -> HeldVersion | None:
        return self._held

    @property
    def last_seen(self) -> HeldVersion | None:
        return self._held

    @property
    def anchor_needed(self) -> str | None:
        return self._anchor_needed

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        return self._weights

    @contextlib.contextmanager
    def session(self, bucket_url: str | None, shapes: Mapping[str, tuple[int, ...]] | None) -> Iterator[None]:
        yield  # the receiver's lock is the only one needed

    def is_for(self, bucket_url: str) -> bool:
        return True

    def write_delta(
        self, header: FileHeader, changes: Mapping[str, SparseChange], undo: DeltaUndo, held: HeldVersion
    ) -> None:
        for name, change in changes.items():
            scatter_(self._weights[name], change.indices, change.values)
        self._positions[held.version] = {name: change.indices for name, change in changes.items()}
        for version in sorted(self._positions)[: -self._positions_kept]:
            del self._positions[version]
        self._remember(HistoryEntry(held, "delta", tuple(sorted(changes))))

    def write_anchor(self, header: FileHeader, anchor: Anchor, held: HeldVersion) -> None:
        if set(self._weights) != set(header.shapes) or any(
            tuple(t.shape) != header.shapes[n] or t.dtype != header.dtype(n) for n, t in self._weights.items()
        ):
            self._weights = {}  # another parameter set (the first anchor, or an anchor of another model)
        # Copy into the held tensors so memory stays at one snapshot.
        for name, tensor in anchor.items():
            target = self._weights.get(name)
            if target is None:
                self._weights[name] = tensor.clone() if not tensor.is_contiguous() else tensor
            else:
                target.copy_(tensor)
        self._anchor_needed = None
        self._recent, self._positions = [], {}
        self._remember(HistoryEntry(held, "anchor", tuple(header.names)))

    def restore(self, undo: DeltaUndo) -> None:
        for name, (indices, values) in undo.previous.items():
            scatter_(self._weights[name], indices, values)
        self._held = undo.before
        self._recent = [entry for entry in self._recent if entry.version <= undo.before.version]
        self._positions = {v: found for v, found in self._positions.items() if v <= undo.before.version}

    def distrust(self, reason: str) -> None:
        self._anchor_needed = reason

    def forget(self, reason: str) -> None:
        self._held, self._recent, self._positions = None, [], {}
        self._anchor_needed = reason

    def version(self, version: int) -> HeldVersion | None:
        return self._held if self._held is not None and self._held.version == version else None

    def recent(self) -> list[HistoryEntry]:
        return list(self._recent)

    def moved_past(self, version: int) -> SnapshotMovedError:
        held = "nothing" if self._held is None else f"version {self._held.version}"
        return SnapshotMovedError(
            f"the snapshot holds {held}, not version {version}",
            held=None if self._held is None else self._held.version,
            wanted=version,
        )

    @contextlib.contextmanager
    def tensors(self, held: HeldVersion, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
        if self.version(held.version) != held:
            raise self.moved_past(held.version)
        yield {name: self._weights[name] for name in names}

    def changed_positions(
        self, base: HeldVersion | None, target: HeldVersion, names: Iterable[str]
    ) -> dict[str, torch.Tensor] | None:
        between = deltas_between(self._recent, base, target)
        if between is None or any(entry.version not in self._positions for entry in between):
            return None
        return union_positions((self._positions[entry.version] for entry in between), names)

    def memory(self) -> SnapshotMemory:
        return SnapshotMemory(None, 0, sum(t.numel() * t.element_size() for t in self._weights.values()))

    def _remember(self, entry: HistoryEntry) -> None:
        self._held = entry.held
        self._recent = [*self._recent, entry][-self._history :]

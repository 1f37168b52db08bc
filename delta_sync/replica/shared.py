"""`NodeStore`: a receiver's snapshot store that is the machine's one `NodeSnapshot`.

Every process on a machine (the tensor-parallel workers of a vLLM server, several servers)
checks and applies a bucket's files to the same memory-mapped snapshot, one at a time; a
process that finds the snapshot already at the version it was asked for applies nothing
and loads from it. Each receiver still tracks the version *its* model serves, and loads
exactly the version it is asked for: when the snapshot has moved further, the tensors it
loads are rebuilt at its version from the snapshot's undo records (see
`delta_sync.replica.snapshot`).

Example:
    ```python
    >>> receiver = Receiver(store=NodeStore("/var/cache/delta-sync/snapshots"), expected_shapes=shapes,
    ...                     load_weights=model.load_weights)
    >>> receiver.update("s3://ckpts/run-1")
    >>> receiver.memory().private_bytes
    0
    ```
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from ..errors import ApplyError, SnapshotMovedError
from ..format import Anchor, FileHeader, SparseChange
from ..sparse import scatter_many_
from ..version import HeldVersion
from .snapshot import HistoryEntry, NodeSnapshot, SnapshotState, mapped_memory, snapshot_directory
from .store import DeltaUndo, SnapshotMemory, deltas_between, union_positions

__all__ = ["NodeStore"]

logger = logging.getLogger(__name__)


class NodeStore:
    """A snapshot store shared with every process of the machine: one copy of the model per
    machine (bf16, and float32 where the bucket carries it so), however many workers and
    servers follow the same bucket with the same model.

    A request for a version the snapshot has moved past more than `history` versions ago
    (or across an anchor) raises `SnapshotMovedError` and changes nothing; a catch-up then
    reaches the snapshot's version.

    Args:
        snapshot_dir: Directory holding node snapshots, one per bucket and model layout.
        history: Versions the snapshot can rebuild behind its newest.
    """

    shared = True

    def __init__(self, snapshot_dir: str | os.PathLike, *, history: int = 8) -> None:
        self.snapshot_dir = Path(snapshot_dir)
        self.history = history
        self._node: NodeSnapshot | None = None
        # The node's state while this process holds it exclusively (inside `session`), and
        # the version it held when this process last let go of it.
        self._state: SnapshotState | None = None
        self._seen: HeldVersion | None = None
        self._bucket_url: str | None = None

    @property
    def held(self) -> HeldVersion | None:
        return self._session_state().held

    @property
    def last_seen(self) -> HeldVersion | None:
        return self._seen

    @property
    def anchor_needed(self) -> str | None:
        return self._session_state().anchor_needed

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        return {} if self._node is None else self._node.tensors

    @contextlib.contextmanager
    def session(self, bucket_url: str | None, shapes: Mapping[str, tuple[int, ...]] | None) -> Iterator[None]:
        if bucket_url is None:
            raise ValueError("a node snapshot is kept per bucket: apply its files with prepare() or update()")
        if shapes is None:
            raise ValueError("a node snapshot needs the model's parameter shapes (expected_shapes)")
        node = self._node_for(bucket_url, shapes)
        self._bucket_url = bucket_url
        with node.exclusive() as state:
            self._state = state
            try:
                yield
            finally:
                node.save(anchor_needed=state.anchor_needed)
                self._state, self._seen = None, state.held

    def is_for(self, bucket_url: str) -> bool:
        return self._bucket_url is None or self._bucket_url == bucket_url

    def write_delta(
        self, header: FileHeader, changes: Mapping[str, SparseChange], undo: DeltaUndo, held: HeldVersion
    ) -> None:
        node = self._node
        node.begin_delta(held.version, undo.previous)
        views = node.tensors
        scatter_many_((views[name], change.indices, change.values) for name, change in changes.items())
        self._finish(held, "delta", changes)

    def write_anchor(self, header: FileHeader, anchor: Anchor, held: HeldVersion) -> None:
        node = self._node
        node.begin_anchor(held.version, header.dtypes)
        views = node.tensors
        for name, tensor in anchor.items():
            if views[name].dtype != tensor.dtype:  # copy_ would cast
                raise ApplyError(
                    f"{header.source}: {name!r} is {tensor.dtype}, the node snapshot holds {views[name].dtype}"
                )
            views[name].copy_(tensor)
        self._session_state().anchor_needed = None
        self._finish(held, "anchor", header.shapes)

    def restore(self, undo: DeltaUndo) -> None:
        raise RuntimeError("the node snapshot keeps every version it checked; nothing is undone in it")

    def distrust(self, reason: str) -> None:
        self._session_state().anchor_needed = reason

    def forget(self, reason: str) -> None:
        raise RuntimeError("the node snapshot keeps every version it checked; nothing is forgotten in it")

    def version(self, version: int) -> HeldVersion | None:
        entry = self._session_state().entry(version)
        return None if entry is None else entry.held

    def recent(self) -> list[HistoryEntry]:
        return list(self._session_state().history)

    def moved_past(self, version: int) -> SnapshotMovedError:
        return self._node.moved_past(self._session_state(), version)

    @contextlib.contextmanager
    def tensors(self, held: HeldVersion, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
        if self._node is None:
            raise SnapshotMovedError("no node snapshot is open yet", held=None, wanted=held.version)
        with self._node.shared() as state:
            # Held until loaded: no writer moves the views meanwhile.
            yield self._node.tensors_at(state, held.version, names, held.checksums)

    def changed_positions(
        self, base: HeldVersion | None, target: HeldVersion, names: Iterable[str]
    ) -> dict[str, torch.Tensor] | None:
        if self._node is None:
            return None
        with self._node.shared() as state:
            between = deltas_between(state.history, base, target)
            if between is None:
                return None
            try:
                return union_positions((self._node.positions(entry.version) for entry in between), names)
            except SnapshotMovedError:
                return None

    def memory(self) -> SnapshotMemory:
        """The shared file, and what the kernel says this process holds of it (Linux; zeros
        where `/proc/self/smaps` cannot be read)."""
        if self._node is None:
            return SnapshotMemory(None, 0, 0)
        mapped = mapped_memory(self._node.path)
        return SnapshotMemory(str(self._node.path), self._node.nbytes, mapped["private"], mapped["rss"], mapped["pss"])

    def _node_for(self, bucket_url: str, shapes: Mapping[str, tuple[int, ...]]) -> NodeSnapshot:
        directory = snapshot_directory(self.snapshot_dir, bucket_url, shapes)
        if self._node is None or self._node.directory != directory:
            if self._node is not None:
                self._node.close()
            self._node = NodeSnapshot(directory, shapes, history=self.history)
            logger.info("delta-sync: node snapshot %s (%.1f MB, shared)", self._node.path, self._node.nbytes / 1e6)
        return self._node

    def _session_state(self) -> SnapshotState:
        if self._state is None:
            raise RuntimeError("the node snapshot is read and changed only inside a session")
        return self._state

    def _finish(self, held: HeldVersion, kind: str, names: Iterable[str]) -> None:
        self._node.finish(held, kind=kind, names=names)

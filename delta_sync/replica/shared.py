"""`SharedReceiver`: a `Receiver` whose snapshot is the machine's one `NodeSnapshot`.

Every process on a machine (the tensor-parallel workers of a vLLM server, several servers)
checks and applies a bucket's files to the same memory-mapped snapshot, one at a time; a
process that finds the snapshot already at the version it was asked for applies nothing
and loads from it. Each receiver still tracks the version *its* model serves, and loads
exactly the version it is asked for: when the snapshot has moved further, the tensors it
loads are rebuilt at its version from the snapshot's undo records (see
`delta_sync.replica.snapshot`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..format import Anchor, Delta, FileHeader
from ..integrity import model_checksum
from ..layout import Latest, parse_step_path
from ..storage import Bucket
from .receiver import ApplyResult, LoadWeights, PendingUpdate, Receiver, SnapshotMemory
from .snapshot import NodeSnapshot, SnapshotState, mapped_memory, snapshot_directory

__all__ = ["SharedReceiver"]

logger = logging.getLogger("delta_sync")


@dataclass(frozen=True)
class _Fields:
    """The version a receiver holds, as its fields describe it."""

    version: int | None = None
    anchor_version: int | None = None
    run_id: str | None = None
    epoch: str | None = None
    checksums: dict[str, int] = field(default_factory=dict)


class SharedReceiver(Receiver):
    """A [`Receiver`] that shares one bf16 snapshot with every process of the machine.

    Host memory per machine is one copy of the model, however many workers and servers
    follow the same bucket with the same model; each keeps only its own version's
    checksums. A request for a version the snapshot has moved past more than `history`
    versions ago (or across an anchor) raises `SnapshotMovedError` and changes nothing; a
    catch-up then reaches the snapshot's version.

    Args:
        snapshot_dir: Directory holding node snapshots, one per bucket and model layout.
        expected_shapes: Parameter name -> shape: required, it is the snapshot's layout.
        history: Versions the snapshot can rebuild behind its newest.
        **kwargs: As for [`Receiver`].

    Example:
        ```python
        >>> receiver = SharedReceiver(snapshot_dir="/var/cache/delta-sync/snapshots", expected_shapes=shapes,
        ...                           load_weights=model.load_weights)
        >>> receiver.update("s3://ckpts/run-1")
        >>> receiver.memory().private_bytes
        0
        ```
    """

    def __init__(
        self,
        *,
        snapshot_dir: str | os.PathLike,
        expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
        history: int = 8,
        **kwargs,
    ) -> None:
        super().__init__(expected_shapes=expected_shapes, **kwargs)
        if self.expected_shapes is None:
            raise ValueError("a shared snapshot needs the model's parameter shapes (expected_shapes)")
        self.snapshot_dir = Path(snapshot_dir)
        self.history = history
        self._node: NodeSnapshot | None = None
        self._served = _Fields()
        # The model may hold weights of no version (a load failed): load every tensor next time.
        self._reload_all = False
        # Whether the open update has handed anything to `load_weights` yet.
        self._model_touched = False

    def memory(self) -> SnapshotMemory:
        """Where the snapshot lives: the shared file, and what the kernel says this process
        holds of it (Linux; zeros where `/proc/self/smaps` cannot be read)."""
        if self._node is None:
            return SnapshotMemory(None, 0, 0)
        mapped = mapped_memory(self._node.path)
        return SnapshotMemory(str(self._node.path), self._node.nbytes, mapped["private"], mapped["rss"], mapped["pss"])

    def apply(self, file: Anchor | Delta) -> ApplyResult:
        raise TypeError("a SharedReceiver applies versions from a bucket: use prepare() or update()")

    # -- the node transaction ---------------------------------------------------------------

    def _advance(self, bucket: Bucket, path: str | None, pending: PendingUpdate) -> Latest:
        """Bring the node snapshot to the version asked for (if nobody has yet), then make
        that version this receiver's, with what its model must load to reach it."""
        node = self._node_for(bucket)
        worker = self._fields()
        with node.exclusive() as state:
            self._adopt(state)
            try:
                latest = super()._advance(bucket, path, pending)
                target = self._target(state, path, worker)
            finally:
                node.save(anchor_needed=self._anchor_needed)
                self._set_fields(worker)
            names = self._names_between(state, self._served, target)
        self._set_fields(target)
        pending._names.update(names)
        if target.version != state.version:
            logger.info("delta-sync: the node snapshot is at v%s; loading v%s from it", state.version, target.version)
        return latest

    def _node_for(self, bucket: Bucket) -> NodeSnapshot:
        directory = snapshot_directory(self.snapshot_dir, bucket.url, self.expected_shapes)
        if self._node is None or self._node.directory != directory:
            if self._node is not None:
                self._node.close()
            self._node = NodeSnapshot(directory, self.expected_shapes, history=self.history)
            logger.info("delta-sync: node snapshot %s (%.1f MB, shared)", self._node.path, self._node.nbytes / 1e6)
        return self._node

    def _adopt(self, state: SnapshotState) -> None:
        """Take the node's version as the one held, for the checks and writes that follow."""
        self._set_fields(_Fields(state.version, state.anchor_version, state.run_id, state.epoch, state.checksums))
        self._anchor_needed = state.anchor_needed
        self.weights = self._node.tensors

    def _target(self, state: SnapshotState, path: str | None, worker: _Fields) -> _Fields:
        """The version this receiver was asked for, now that the node holds it or more."""
        step = None if path is None else parse_step_path(path)
        version = state.version if step is None else step[1]
        if (worker.run_id, worker.epoch) == (state.run_id, state.epoch) and worker.version is not None:
            if version <= worker.version:
                return worker  # asked for what it holds, or older: nothing to do
        entry = state.entry(version)
        if entry is None:
            raise self._node.moved_past(state, version)  # before anything is loaded
        return _Fields(version, entry.anchor_version, state.run_id, state.epoch, entry.checksums)

    def _names_between(self, state: SnapshotState, base: _Fields, target: _Fields) -> set[str]:
        """What a model holding `base` must load to hold `target`: the union of the names the
        versions between them changed, or everything when the history cannot tell."""
        everything = set(self.expected_shapes)
        if self._reload_all or base.version is None or (base.run_id, base.epoch) != (target.run_id, target.epoch):
            return everything
        low, high = sorted((base.version, target.version))
        entries = [entry for entry in state.history if low < entry.version <= high]
        base_entry = state.entry(base.version)
        if (
            base_entry is None
            or base_entry.model_checksum != model_checksum(base.checksums)
            or len(entries) != high - low
            or any(entry.kind == "anchor" for entry in entries)
        ):
            return everything
        return {name for entry in entries for name in entry.names}

    # -- hooks of the Receiver ----------------------------------------------------------------

    def _open_pending(self) -> PendingUpdate:
        self._served = self._fields()
        self._model_touched = False
        return super()._open_pending()

    def _before_write(
        self, header: FileHeader, previous: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        if previous is None:
            self._node.begin_anchor(header.version)
        else:
            self._node.begin_delta(header.version, previous)

    def _after_write(self, header: FileHeader, names: Iterable[str]) -> None:
        self._node.finish(
            version=self.version,
            kind=header.kind,
            anchor_version=self.anchor_version,
            run_id=self.run_id,
            epoch=self.epoch,
            checksums=self.checksums,
            names=names,
        )

    def _load(self, load: LoadWeights | None, names: list[str]) -> None:
        if load is None or not names:
            return
        names = self._with_companions(names)
        with self._node.shared() as state:
            # Held until loaded: no writer moves the views meanwhile.
            tensors = self._node.tensors_at(state, self.version, names, self.checksums)
            self._model_touched = True
            load(sorted(tensors.items()))
        if names >= set(self.expected_shapes):
            self._reload_all = False

    def _abort_pending(self, pending: PendingUpdate) -> None:
        # The node keeps the versions it checked; only this receiver goes back.
        self._set_fields(self._served)

    def _roll_back_pending(self, pending: PendingUpdate, load: LoadWeights | None, names: list[str]) -> None:
        self._set_fields(self._served)
        if self._model_touched:  # else the version could not be read: the model is as it was
            self._reload(load, names)

    def _model_diverged(self, reason: str) -> None:
        logger.warning("delta-sync: %s; the next update reloads every tensor", reason)
        self._reload_all = True

    def _fields(self) -> _Fields:
        return _Fields(self.version, self.anchor_version, self.run_id, self.epoch, dict(self.checksums))

    def _set_fields(self, fields: _Fields) -> None:
        self.version, self.anchor_version = fields.version, fields.anchor_version
        self.run_id, self.epoch, self.checksums = fields.run_id, fields.epoch, dict(fields.checksums)

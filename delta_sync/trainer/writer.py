"""[`VersionWriter`]: stores the versions a `Publisher` plans, on the thread that writes them.

For each version: encode this rank's files (a delta, an anchor, or both) into a staging
directory, release the [`SnapshotLease`] (the uploads need the encoded bytes, not the
snapshot), upload them, and then, with parts, agree with the other ranks and write the
manifests; finally move `latest.json` and apply retention. The writer's state (the
checksums kept up delta by delta, the version stored last, the anchor it descends from)
belongs to the one thread that runs jobs: the publisher's worker thread, or the training
thread itself when the publisher is not in the background.

What every kind of version is stored with ([`PointerWriter`]), and claiming and resuming
a bucket prefix, are in `delta_sync.trainer.prefix`.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..changes import Encoding
from ..errors import PublishError, UnsupportedLayoutError
from ..format import FileHeader, SparseChange, write_anchor, write_delta
from ..integrity import add_checksums, model_checksum, tensor_checksum, updated_checksums
from ..layout import (
    Latest,
    anchor_path,
    delta_path,
    manifest_path,
    parse_step_path,
    part_path,
    step_versions,
)
from ..manifest import Manifest, PartRecord
from ..parallel import parallel_map
from ..signing import SigningKey, file_sha256
from ..storage import Bucket
from ..version import VersionId, sparsity
from .detector import BF16ChangeDetector, ChangeSet
from .lease import SnapshotLease
from .prefix import PointerWriter, resume_at
from .ranks import RankGroup, ThreadRole
from .schedule import AnchorSchedule, Plan

__all__ = [
    "PublishReport",
    "VersionJob",
    "VersionWriter",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishReport:
    """What one publish stored.

    Args:
        version: The published version.
        files: Bucket paths written, in order (`latest.json` excluded).
        delta: Path of the delta, or None for an anchor-only version.
        anchor: Path of the anchor written at this version, or None.
        changed_elements: Elements that differ from the previous version.
        total_elements: Elements in the model.
        bytes_written: Bytes of all files written, `latest.json` included.
        delta_bytes: Bytes of the delta file (0 for an anchor-only version).
        steps: Optimizer steps folded into this version.
        detect_seconds: Time the training thread spent detecting and extracting changes.
        publish_seconds: Time spent encoding, writing and uploading (in the background
            when the publisher is asynchronous).
        model_checksum: Digest of the published weights.
        catch_up_bytes: What a replica joining now downloads to reach this version: the
            newest anchor and the deltas after it.
        adapter: The directory of the adapter stored as this version (adapter mode, see
            `delta_sync.trainer.adapter`), or None.
    """

    version: int
    files: tuple[str, ...]
    delta: str | None
    anchor: str | None
    changed_elements: int
    total_elements: int
    bytes_written: int
    delta_bytes: int
    steps: int
    detect_seconds: float
    publish_seconds: float
    model_checksum: str
    catch_up_bytes: int = 0
    adapter: str | None = None

    @property
    def kind(self) -> str:
        kinds = (("delta", self.delta), ("anchor", self.anchor), ("adapter", self.adapter))
        return "+".join(kind for kind, path in kinds if path)

    @property
    def sparsity(self) -> float:
        return sparsity(self.changed_elements, self.total_elements)


@dataclass(frozen=True)
class VersionJob:
    """One version handed from the training thread to the writer.

    Args:
        version: The version.
        change_set: What changed since the version before.
        plan: What to store (see [`AnchorSchedule.plan`]).
        detect_seconds: Time the training thread spent on it.
        lease: The hold on the detector's snapshot, if encoding this version needs it;
            the writer releases it once the files are encoded ([`release`] again, in any
            case, when the job ends: `delta_sync.trainer.background`).
    """

    version: int
    change_set: ChangeSet
    plan: Plan
    detect_seconds: float
    lease: SnapshotLease

    def release(self) -> None:
        """Release the snapshot lease, if the writer did not get as far (once only)."""
        self.lease.release()


@dataclass(frozen=True)
class _Stored:
    """A file this rank stored for a version: a single file, or this rank's part."""

    path: str
    bytes: int
    payload_digest: str
    sha256: str | None = None


@dataclass(frozen=True)
class _Staged:
    """A file encoded into the staging directory, not uploaded yet."""

    kind: str
    local: Path
    stored: _Stored
    id: VersionId


@dataclass
class _RankResult:
    """What one rank tells the others about a version it stored (never weights)."""

    error: str | None = None
    delta: _Stored | None = None
    anchor: _Stored | None = None
    changed: dict[str, int] | None = None  # parameter -> elements changed on this rank
    checksums: dict[str, int] | None = None  # this rank's share of each parameter's checksum


class VersionWriter(PointerWriter):
    """Encodes, uploads and points `latest.json` at each version, in order, from one thread.

    Args:
        bucket: Where to write.
        detector: The change detector (its snapshot is what anchors and compact deltas
            are encoded from, under the job's lease).
        ranks: The ranks writing parts together ([`ThreadRole.WORKER`] collectives).
        schedule: Told the bytes of every version stored (for its bytes rule and the
            reports' `catch_up_bytes`).
        version_id: Makes the identity of a version, given it and its anchor's.
        encoding: The deltas' encoding.
        keep_anchors: Anchors to keep; retention deletes older files.
        signing_key: Signs every file replicas act on, or None.
        resumed_files: Files of this run found in the bucket, to replace from the first
            version stored (see `delta_sync.trainer.prefix.claim_prefix`).
        bucket_id: The bucket's name in signed statements (see
            `delta_sync.signing.bucket_identity`).
    """

    def __init__(
        self,
        bucket: Bucket,
        detector: BF16ChangeDetector,
        ranks: RankGroup,
        schedule: AnchorSchedule,
        *,
        version_id: Callable[[int, int], VersionId],
        encoding: Encoding,
        keep_anchors: int,
        signing_key: SigningKey | None,
        resumed_files: list[str],
        bucket_id: str | None = None,
    ) -> None:
        super().__init__(bucket, signing_key=signing_key, bucket_id=bucket_id, rank=ranks.rank)
        self.detector = detector
        #: The checkpoint each version is written as: the detector tracks run-time parameters,
        #: files hold checkpoint tensors (see `delta_sync.checkpoint`).
        self.checkpoint = detector.checkpoint
        self.layout = self.checkpoint.published_layout(detector.layout)
        self.parted = self.layout.sharded
        self._ranks = ranks
        self._schedule = schedule
        self._version_id = version_id
        self.encoding = encoding
        self.keep_anchors = keep_anchors
        self._resumed_files = resumed_files
        self._staging = Path(tempfile.mkdtemp(prefix="delta-sync-staging-"))
        self._checksums: dict[str, int] = {}  # this rank's share, per parameter it publishes
        self._model_checksums: dict[str, int] = {}  # the whole model's, per parameter
        self._stored_version: int | None = None
        self._anchor_version: int | None = None
        self._epoch_start: int | None = None  # the first version this start stored

    def close(self) -> None:
        """Remove the staging directory."""
        shutil.rmtree(self._staging, ignore_errors=True)

    def store(self, job: VersionJob, earlier_failure: BaseException | None = None) -> PublishReport:
        """Store one version: this rank's files, then (rank 0) the manifests and `latest.json`.

        Args:
            job: The version.
            earlier_failure: A failure of an earlier version not yet raised on the training
                thread. With parts this rank still takes part in the exchange, reporting the
                version dropped, so that no rank waits for it.

        Raises:
            PublishError: The version is not stored (on any rank, with parts).
        """
        started = time.perf_counter()
        if self._resumed_files:
            resumed, self._resumed_files = self._resumed_files, []
            resume_at(self, resumed, job.version)
        mine = self._store_own_files(job, earlier_failure)
        if self.parted:
            results = self._ranks.gather(mine, thread=ThreadRole.WORKER)
            failed = [f"rank {rank}: {r.error}" for rank, r in enumerate(results) if r.error]
            if failed:
                raise PublishError(f"version {job.version} is not stored: {'; '.join(failed)}")
        else:
            results = [mine]
        delta, anchor = self._finish_version(job, results)
        written = sum(stored.bytes for r in results for stored in (r.delta, r.anchor) if stored is not None)
        if self.rank == 0:
            assert self._anchor_version is not None
            written += self._point(
                Latest(
                    id=self._version_id(job.version, self._anchor_version),
                    anchor=self._version_path("anchor", self._anchor_version),
                    delta=delta,
                    model_checksum=model_checksum(self._model_checksums),
                    epoch_start=self._epoch_start or job.version,
                )
            )
            if anchor is not None:
                self._apply_retention()
        self._stored_version = job.version
        self._epoch_start = self._epoch_start or job.version
        delta_bytes = sum(r.delta.bytes for r in results if r.delta is not None)
        if anchor is not None:
            self._schedule.stored_anchor(sum(r.anchor.bytes for r in results if r.anchor is not None))
        else:
            self._schedule.stored_delta(delta_bytes)
        return PublishReport(
            version=job.version,
            files=tuple(path for path in (delta, anchor) if path is not None),
            delta=delta,
            anchor=anchor,
            changed_elements=sum(sum(r.changed.values()) for r in results if r.changed),
            total_elements=self.layout.total_elements,
            bytes_written=written,
            delta_bytes=delta_bytes,
            steps=job.change_set.steps,
            detect_seconds=job.detect_seconds,
            publish_seconds=time.perf_counter() - started,
            model_checksum=model_checksum(self._model_checksums),
            catch_up_bytes=self._schedule.catch_up_bytes,
        )

    # -- this rank's files -----------------------------------------------------------------

    def _store_own_files(self, job: VersionJob, earlier_failure: BaseException | None) -> _RankResult:
        """Write this rank's files of a version: the single files, or this rank's parts.

        Every file is encoded before the first upload begins, and the snapshot lease is
        released in between. With parts, a failure is returned rather than raised so that
        the other ranks learn of it in the same exchange instead of waiting for this rank
        forever.
        """
        change_set = self._in_checkpoint(job.change_set)
        result = _RankResult(changed={n: len(c) for n, c in change_set.changes.items()})
        staged: list[_Staged] = []
        try:
            if earlier_failure is not None:  # an earlier version failed here: this one is dropped
                raise PublishError(f"dropped after an earlier failure: {earlier_failure}")
            if job.plan.delta:
                staged += self._encode_delta(job.version, change_set)
            if job.plan.anchor:
                staged += self._encode_anchor(job.version, check_chain=job.plan.delta)
            # Everything this version needs of the snapshot is encoded: training moves on
            # while the files upload.
            job.lease.release()
            for file in staged:
                self._upload(file)
                if file.kind == "delta":
                    result.delta = file.stored
                else:
                    result.anchor = file.stored
        except BaseException as exc:
            if not self.parted:
                raise
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            for file in staged:
                file.local.unlink(missing_ok=True)
        result.checksums = dict(self._checksums)
        return result

    def _in_checkpoint(self, change_set: ChangeSet) -> ChangeSet:
        """A detector's changes (in run-time parameters) as changes of checkpoint tensors:
        positions mapped, old values kept aligned; O(changed elements)."""
        if self.checkpoint.identity:
            return change_set
        changes, old_values = self.checkpoint.map_changes(change_set.changes, change_set.old_values)
        local_indices = {}
        if self.parted:  # positions in this rank's block of each checkpoint tensor it changed
            for name, change in changes.items():
                source = self.checkpoint.boxes[name].source
                if self.checkpoint.boxes[name].whole and source in change_set.local_indices:
                    local_indices[name] = change_set.local_indices[source]  # renamed: the same block
                elif self.layout.shards[name].block.shape != self.layout.shapes[name]:
                    local_indices[name] = self.checkpoint.block_positions(name, change.indices, self.layout)
        return replace(
            change_set,
            changes=changes,
            old_values=old_values,
            shapes=dict(self.layout.shapes),
            local_indices=local_indices,
        )

    def _host_values(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Checkpoint tensors `names` (default: all this rank publishes; with parts, this
        rank's blocks of them) from the detector's host snapshot: views of it, copied only
        where a checkpoint tensor is permuted."""
        if self.checkpoint.identity:
            return self.detector.host_snapshot(names)
        if names is None:
            names = [name for name in self.layout.shards]
        names = list(names)
        held = self.detector.host_snapshot(self.checkpoint.sources(names))
        if self.parted:  # this rank's blocks of the parameters, as blocks of checkpoint tensors
            return self.checkpoint.block_values(held, self.detector.layout, self.layout, names)
        return self.checkpoint.values(held, names)

    def _encode_delta(self, version: int, change_set: ChangeSet) -> list[_Staged]:
        assert self._stored_version is not None and self._anchor_version is not None
        if self.parted and not change_set.changes:
            return []  # nothing changed on this rank: no part
        base_checksums = {name: self._checksums[name] for name in change_set.changes}
        names = list(change_set.changes)
        updated = updated_checksums(
            [
                (base_checksums[name], change.indices, change_set.old_values[name], change.values)
                for name, change in change_set.changes.items()
            ]
        )
        new_checksums = dict(zip(names, updated))
        self._checksums.update(new_checksums)
        path = self._own_path("delta", version)
        header = FileHeader(
            source=path,
            kind="delta",
            id=self._version_id(version, self._anchor_version),
            base_version=self._stored_version,
            encoding=self.encoding,
            shapes={name: change_set.shapes[name] for name in change_set.changes},
            checksums=new_checksums,
            base_checksums=base_checksums,
            model_checksum="" if self.parted else model_checksum(self._checksums),
            changed_elements=change_set.changed_elements,
            total_elements=change_set.total_elements,
            part=self._part(),
        )
        # A compact delta is coded against the weights before the change: the snapshot (now
        # advanced) read through the old values of the changed elements, with no copy. A
        # part is coded in this rank's blocks, against its own snapshot of them: the same
        # values a replica cuts out of the full tensors it holds.
        changes, previous = change_set.changes, None
        if self.encoding == Encoding.COMPACT:
            previous = self._host_values(changes)
            if self.parted:
                shards = self.layout.shards
                changes = {
                    name: SparseChange(change_set.local_indices.get(name, change.indices), change.values)
                    for name, change in changes.items()
                }
                header = replace(
                    header,
                    blocks={name: shards[name].block.offset for name in changes},
                    block_shapes={name: shards[name].block.shape for name in changes},
                )
        return [
            self._stage(
                "delta",
                path,
                lambda dest: write_delta(dest, changes, header, previous, old_values=change_set.old_values),
            )
        ]

    def _encode_anchor(self, version: int, *, check_chain: bool) -> list[_Staged]:
        shards = self.layout.shards
        tensors = self._host_values()
        self._check_publishable(version, tensors)
        checksums = dict(
            zip(
                tensors,
                parallel_map(
                    lambda name: tensor_checksum(
                        tensors[name], shards[name].block.position_of(shards[name].global_shape)
                    ),
                    tensors,
                ),
            )
        )
        # With a delta of the same version just encoded, the checksums kept up delta by
        # delta must equal those of the weights: a free end-to-end check of the chain.
        if check_chain and checksums != self._checksums:
            drifted = sorted(name for name in checksums if checksums[name] != self._checksums.get(name))
            raise PublishError(
                f"version {version}: checksums kept up by deltas disagree with the weights for {drifted[:5]}; "
                "the delta chain would not reproduce the model"
            )
        self._checksums = checksums
        if self.parted and not tensors:
            return []  # this rank holds no element of any parameter
        path = self._own_path("anchor", version)
        total = sum(t.numel() for t in tensors.values())
        header = FileHeader(
            source=path,
            kind="anchor",
            id=self._version_id(version, version),
            base_version=None,
            encoding=Encoding.DENSE,
            shapes={name: shards[name].global_shape for name in tensors},
            checksums=checksums,
            base_checksums={},
            model_checksum="" if self.parted else model_checksum(checksums),
            changed_elements=total,
            total_elements=self.layout.total_elements,
            part=self._part(),
            blocks={name: shards[name].block.offset for name in tensors} if self.parted else {},
        )
        return [self._stage("anchor", path, lambda dest: write_anchor(dest, tensors, header))]

    def _check_publishable(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The guard against a bucket that passes its own checks but holds the wrong model:
        every parameter at its checkpoint shape (or this rank's block of it), all of them."""
        shards = self.layout.shards
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != shards[name].block.shape:
                raise UnsupportedLayoutError(
                    f"version {version}: parameter {name!r} has shape {list(tensor.shape)}, but its checkpoint "
                    f"shape (this rank's block) is {list(shards[name].block.shape)}; refusing to write a wrong anchor"
                )
        if not self.parted and (
            set(tensors) != set(self.layout.shapes)
            or self.layout.total_elements != sum(t.numel() for t in tensors.values())
        ):
            missing = sorted(set(self.layout.shapes) - set(tensors))
            raise UnsupportedLayoutError(
                f"version {version}: the anchor would hold {sum(t.numel() for t in tensors.values())} of the "
                f"model's {self.layout.total_elements} elements (missing {missing[:5]}); refusing to write it"
            )

    def _stage(self, kind: str, path: str, write: Callable[[Path], FileHeader]) -> _Staged:
        """Encode one file into the staging directory (removed again if that fails)."""
        local = self._staging / path.replace("/", "_")
        try:
            header = write(local)
            size = local.stat().st_size
            sha256 = file_sha256(local) if self.signing_key is not None else None
        except BaseException:
            local.unlink(missing_ok=True)
            raise
        return _Staged(kind, local, _Stored(path, size, header.payload_digest, sha256), header.id)

    def _upload(self, file: _Staged) -> None:
        # The signature lands first, so that no stored version file is ever unsigned (a
        # signature alone names nothing replicas act on). A part is signed through its manifest.
        if file.stored.sha256 is not None and not self.parted:
            self._upload_signature(file.stored.path, file.stored.sha256, file.stored.bytes, file.id)
        # Version files are written once: a second trainer on the same prefix fails loudly.
        self.bucket.upload(file.stored.path, file.local, overwrite=False)
        file.local.unlink(missing_ok=True)

    # -- the version as a whole ------------------------------------------------------------

    def _finish_version(self, job: VersionJob, results: list[_RankResult]) -> tuple[str | None, str | None]:
        """Bring the whole model's checksums up to this version; with parts, rank 0 writes the
        manifests. Returns the paths replicas apply: the delta's and the anchor's (or None)."""
        previous = dict(self._model_checksums)
        for name in self.layout.shapes:
            shares = [r.checksums[name] for r in results if r.checksums and name in r.checksums]
            if shares:
                self._model_checksums[name] = add_checksums(*shares)
        delta = anchor = None
        if job.plan.delta:
            changed = sorted({name for r in results for name in (r.changed or {})})
            delta = self._version_path("delta", job.version)
            if self.parted:
                self._write_manifest("delta", job, results, changed, base=previous)
        if job.plan.anchor:
            # A delta of this version still descends from the previous anchor.
            self._anchor_version = job.version
            anchor = self._version_path("anchor", job.version)
            if self.parted:
                self._write_manifest("anchor", job, results, sorted(self.layout.shapes), base=None)
        return delta, anchor

    def _write_manifest(
        self, kind: str, job: VersionJob, results: list[_RankResult], names: list[str], *, base: dict[str, int] | None
    ) -> None:
        if self.rank != 0:
            return
        assert self._anchor_version is not None
        parts = []
        for rank, result in enumerate(results):
            stored = result.delta if kind == "delta" else result.anchor
            if stored is not None:
                parts.append(PartRecord(stored.path, rank, stored.bytes, stored.payload_digest, stored.sha256))
        manifest = Manifest(
            kind=kind,
            id=self._version_id(job.version, self._anchor_version),
            base_version=self._stored_version if kind == "delta" else None,
            encoding=self.encoding if kind == "delta" else Encoding.DENSE,
            world_size=self.layout.world_size,
            parts=tuple(parts),
            shapes={name: self.layout.shapes[name] for name in names},
            checksums={name: self._model_checksums[name] for name in names},
            base_checksums={name: base[name] for name in names} if base is not None else {},
            model_checksum=model_checksum(self._model_checksums),
            changed_elements=(
                sum(sum(r.changed.values()) for r in results if r.changed)
                if kind == "delta"
                else self.layout.total_elements
            ),
            total_elements=self.layout.total_elements,
        )
        data = manifest.to_json()
        if self.signing_key is not None:
            self._upload_signature(
                manifest_path(kind, job.version), hashlib.sha256(data).hexdigest(), len(data), manifest.id
            )
        self.bucket.upload(manifest_path(kind, job.version), data, overwrite=False)

    def _version_path(self, kind: str, version: int) -> str:
        if self.parted:
            return manifest_path(kind, version)
        return anchor_path(version) if kind == "anchor" else delta_path(version)

    def _own_path(self, kind: str, version: int) -> str:
        if self.parted:
            return part_path(kind, version, self.rank)
        return anchor_path(version) if kind == "anchor" else delta_path(version)

    def _part(self) -> tuple[int, int] | None:
        return (self.rank, self.layout.world_size) if self.parted else None

    def _apply_retention(self) -> None:
        stored_anchors = self.bucket.list("anchors")
        anchors = step_versions(stored_anchors, "anchor")
        if len(anchors) <= self.keep_anchors:
            return
        oldest_kept = anchors[-self.keep_anchors]

        def doomed(path: str) -> bool:
            kind, version = parse_step_path(path) or ("", oldest_kept)
            return version < oldest_kept if kind == "anchor" else version <= oldest_kept

        paths = [path for path in stored_anchors + self.bucket.list("deltas") if doomed(path)]
        self.bucket.delete(paths)
        logger.info("delta-sync: retention removed %d file(s) older than anchor v%d", len(paths), oldest_kept)

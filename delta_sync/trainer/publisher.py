"""`Publisher`: turns a detector's changes into anchors, deltas and `latest.json` in a bucket."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import DeltaSyncError, PublishError, UnsupportedLayoutError
from ..format import FileHeader, SparseChange, read_file, write_anchor, write_delta
from ..integrity import add_checksums, model_checksum, tensor_checksum, updated_checksum
from ..layout import (
    LATEST,
    Latest,
    anchor_path,
    delta_path,
    is_manifest,
    manifest_path,
    parse_step_path,
    part_path,
    step_versions,
    version_files,
)
from ..manifest import Manifest, PartRecord
from ..parallel import parallel_map
from ..signing import SIGNATURE_SUFFIX, SigningKey, file_sha256
from ..storage import Bucket, open_bucket
from .detector import BF16ChangeDetector, ChangeSet
from .ranks import RankGroup

__all__ = ["PublishReport", "Publisher"]

logger = logging.getLogger("delta_sync")


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

    @property
    def kind(self) -> str:
        return "+".join(kind for kind, path in (("delta", self.delta), ("anchor", self.anchor)) if path)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.changed_elements / self.total_elements if self.total_elements else 1.0


@dataclass
class _Job:
    version: int
    change_set: ChangeSet
    write_delta: bool
    write_anchor: bool
    detect_seconds: float
    holds_snapshot_lock: bool


@dataclass(frozen=True)
class _Stored:
    """A file this rank stored for a version: a single file, or this rank's part."""

    path: str
    bytes: int
    payload_digest: str
    sha256: str | None = None


@dataclass
class _RankResult:
    """What one rank tells the others about a version it stored (never weights)."""

    error: str | None = None
    delta: _Stored | None = None
    anchor: _Stored | None = None
    changed: dict[str, int] | None = None  # parameter -> elements changed on this rank
    checksums: dict[str, int] | None = None  # this rank's share of each parameter's checksum


class Publisher:
    """Writes every version of a model's weights to a bucket as an anchor or a delta.

    Version by version: the first version published is an anchor (full bf16 weights);
    every later version has a delta against the version before it, so a replica that
    keeps up never downloads the full model again; and every `anchor_every` versions an
    anchor of the same version is written as well, for replicas that join late or lose
    their place. `latest.json` moves to a version only after all of its files are stored.
    Only the newest `keep_anchors` anchors are kept, with the deltas that follow them.

    With `background=True` (the default) encoding and uploading run on a worker thread
    so the next training step overlaps them; versions are still stored strictly in
    order, and at most `max_pending` versions wait. A failure is raised as
    [`PublishError`] by the next [`publish`], [`flush`] or [`close`]; versions queued
    behind a failed one are dropped, and the next version published after the error
    is written as an anchor so replicas can recover.

    With a sharded model (FSDP2: the detector's layout is sharded) every rank builds a
    Publisher at the same point and calls [`publish`], [`flush`] and [`close`] in step:
    each rank writes its own part of every version straight to the bucket, then rank 0
    writes the version's manifest and moves `latest.json` (see `delta_sync.manifest`). The
    ranks exchange only part names, digests, counts and checksums. A failure on any rank
    fails the version on every rank.

    Args:
        bucket: Where to write: a [`Bucket`] or a URL (`./dir`, `file://...`, `hf://buckets/...`,
            `s3://...`).
        detector: The change detector of the model being trained.
        anchor_every: Write an anchor every this many versions (and at the first).
        anchor_bytes_ratio: Also write an anchor once the deltas since the last one add up to
            more than this fraction of its size, so that a replica joining late never
            downloads more than about `1 + anchor_bytes_ratio` anchors' worth to catch up.
            None to count versions only.
        keep_anchors: How many anchors to keep; older anchors and the deltas before the
            oldest kept anchor are deleted.
        background: Encode and upload on a worker thread.
        max_pending: Versions that may wait for the worker before `publish` blocks.
        run_id: Identifier of this training run, recorded in every file; random by default
            (rank 0's, with a sharded model).
        on_published: Called (on the worker thread) with each [`PublishReport`] after its
            files and `latest.json` are stored.
        overwrite: If the bucket prefix already holds another run's files, delete them
            (otherwise that is an error: runs must not share a prefix). A run resumed
            with the same `run_id` continues in place.
        signing_key: Sign every file replicas act on with this Ed25519 key (a
            `delta_sync.signing.SigningKey`, or the path or PEM text of one); default: the
            key `DELTA_SYNC_SIGNING_KEY` names, else unsigned.
        encoding: How deltas store their changes: `"raw"` (int32 positions and bf16
            values, the published TRL format) or `"compact"` (entropy-coded against the
            weights replicas hold; several times smaller, see `delta_sync.compact`).

    Example:
        ```python
        >>> detector = BF16ChangeDetector(model, optimizer)
        >>> publisher = Publisher("./deltas", detector)
        >>> for step in range(1, 101):
        ...     train_step()
        ...     publisher.publish(version=step)
        >>> publisher.close()
        ```
    """

    def __init__(
        self,
        bucket: Bucket | str | os.PathLike,
        detector: BF16ChangeDetector,
        *,
        anchor_every: int = 10,
        anchor_bytes_ratio: float | None = 1.0,
        keep_anchors: int = 2,
        background: bool = True,
        max_pending: int = 2,
        run_id: str | None = None,
        on_published: Iterable[Callable[[PublishReport], None]] = (),
        overwrite: bool = False,
        signing_key: SigningKey | str | os.PathLike | None = None,
        encoding: str = "raw",
    ) -> None:
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        if keep_anchors < 1:
            raise ValueError(f"keep_anchors must be >= 1, got {keep_anchors}")
        self.bucket = open_bucket(bucket)
        self.detector = detector
        self.anchor_every = anchor_every
        if anchor_bytes_ratio is not None and anchor_bytes_ratio <= 0:
            raise ValueError(f"anchor_bytes_ratio must be > 0 or None, got {anchor_bytes_ratio}")
        self.anchor_bytes_ratio = anchor_bytes_ratio
        # Bytes of the newest anchor and of the deltas stored since (all ranks' parts).
        self._anchor_bytes = 0
        self._delta_bytes_since_anchor = 0
        self.keep_anchors = keep_anchors
        self.on_published = list(on_published)
        if encoding not in ("raw", "compact"):
            raise ValueError(f"encoding must be 'raw' or 'compact', got {encoding!r}")
        self.encoding = encoding
        self.layout = detector.layout
        #: Whether versions are written as one part per rank plus a manifest.
        self.parted = self.layout.sharded
        self._ranks = RankGroup(self.layout.world_size if self.parted else 1)
        self.rank = self._ranks.rank
        self.run_id = run_id or uuid.uuid4().hex[:12]
        #: This start of the publisher: a run resumed in place rewrites versions under a new
        #: epoch, so replicas and caches never mistake them for the abandoned ones.
        self.epoch = uuid.uuid4().hex[:8]
        if signing_key is None:
            self.signing_key = SigningKey.from_env()
        else:
            self.signing_key = signing_key if isinstance(signing_key, SigningKey) else SigningKey.load(signing_key)
        self._resumed_files: list[str] = []
        self._join_prefix(overwrite)
        self._staging = Path(tempfile.mkdtemp(prefix="delta-sync-staging-"))
        # Worker-side state: touched only by whichever thread runs jobs, one at a time.
        self._checksums: dict[str, int] = {}  # this rank's share, per parameter it publishes
        self._model_checksums: dict[str, int] = {}  # the whole model's, per parameter
        self._stored_version: int | None = None
        self._anchor_version: int | None = None
        self._epoch_start: int | None = None  # the first version this start stored
        # Caller-side state.
        self._last_version: int | None = None
        self._since_anchor = 0
        self._needs_anchor = True
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self.reports: list[PublishReport] = []
        self._queue: queue.Queue[_Job | None] | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max(1, max_pending))
            self._worker = threading.Thread(target=self._run_worker, name="delta-sync-publisher", daemon=True)
            self._worker.start()

    def _join_prefix(self, overwrite: bool) -> None:
        """Rank 0 claims the prefix; every rank adopts its run id or its refusal."""
        refusal = None
        if self.rank == 0:
            try:
                self._claim_prefix(overwrite)
            except PublishError as exc:
                refusal = str(exc)
        self.run_id, self.epoch, refusal = self._ranks.broadcast((self.run_id, self.epoch, refusal))
        if refusal is not None:
            raise PublishError(refusal)

    def _claim_prefix(self, overwrite: bool) -> None:
        existing = [path for path in self.bucket.list() if path == LATEST or parse_step_path(path)]
        if not existing:
            return
        owner = self._owner(existing)
        if owner == self.run_id:
            # Resuming this run: files of versions at or after the first one published now
            # belong to an abandoned trajectory and are replaced then (see `_rewind`).
            self._resumed_files = [path for path in existing if path != LATEST]
            return
        if not overwrite:
            raise PublishError(
                f"{self.bucket.url} already holds {len(existing)} file(s) of run {owner or 'unknown'}; "
                "use another prefix, pass the same run_id to resume that run, or overwrite=True to delete them"
            )
        logger.warning("delta-sync: deleting %d file(s) of run %s from %s", len(existing), owner, self.bucket.url)
        self.bucket.delete([path for path in existing if path != LATEST])
        self.bucket.delete([LATEST])

    def _owner(self, existing: list[str]) -> str | None:
        """The run that wrote a prefix's files: `latest.json`'s, or, when a crash came before
        the first pointer, that of a version file itself."""
        try:
            return Latest.from_json(self.bucket.read_bytes(LATEST)).run_id
        except DeltaSyncError:
            pass
        for kind in ("delta", "anchor"):  # deltas first: they are the small ones
            for path in version_files(existing, kind).values():
                try:
                    return self._stored_header(path).run_id
                except DeltaSyncError:
                    continue
        return None

    def _stored_header(self, path: str) -> Manifest | FileHeader:
        """The header of a stored version file (a manifest, or a single file's metadata)."""
        if is_manifest(path):
            return Manifest.from_json(self.bucket.read_bytes(path), source=f"{self.bucket.url}/{path}")
        with tempfile.TemporaryDirectory(prefix="delta-sync-header-") as tmp:
            local = Path(tmp) / "file"
            self.bucket.download(path, local)
            with read_file(local, source=f"{self.bucket.url}/{path}") as file:
                return file.header

    def _rewind(self, version: int) -> None:
        """Delete a resumed run's files of `version` and later, before writing `version` again.

        `latest.json` first steps back to the newest complete version before `version` (or
        goes, if there is none), so that a crash in the middle of the deletions never leaves
        it naming a file that is gone.
        """
        stale = [path for path in self._resumed_files if (parse_step_path(path) or ("", 0))[1] >= version]
        kept = [path for path in self._resumed_files if path not in stale]
        self._resumed_files = []
        if not stale:
            return
        logger.warning("delta-sync: resuming at v%d, deleting %d later file(s) of this run", version, len(stale))
        retreat = self._newest_complete(kept)
        if retreat is None:
            self.bucket.delete([LATEST])
        else:
            self.bucket.upload(LATEST, retreat.to_json(self.signing_key))
        self.bucket.delete(stale)

    def _newest_complete(self, paths: list[str]) -> Latest | None:
        """The pointer to the newest version that `paths` hold completely (its anchor and the
        unbroken chain of deltas after it), or None."""
        anchors, deltas = version_files(paths, "anchor"), version_files(paths, "delta")
        if not anchors:
            return None
        anchor = max(anchors)
        version = anchor
        while version + 1 in deltas:
            version += 1
        path = deltas[version] if version > anchor else anchors[anchor]
        header = self._stored_header(path)
        return Latest(
            version=version,
            anchor_version=anchor,
            anchor=anchors[anchor],
            delta=deltas[version] if version > anchor else None,
            model_checksum=header.model_checksum,
            run_id=header.run_id,
            epoch=header.epoch,
        )

    # -- caller side -----------------------------------------------------------------

    @property
    def last_version(self) -> int | None:
        """The last version handed to [`publish`]."""
        return self._last_version

    @property
    def pending_error(self) -> BaseException | None:
        """A background failure not yet raised (it will be, by the next publish, flush or close)."""
        return self._error

    def publish(self, version: int) -> None:
        """Publish the model's current weights as `version`.

        Args:
            version: Must be greater than every version published before.

        Raises:
            PublishError: An earlier background publish failed (on any rank).
            ValueError: `version` does not increase.
        """
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version {version} must be greater than the last published {self._last_version}")
        started = time.perf_counter()
        change_set = self.detector.changes()
        changed, catch_up_heavy = self._raise_pending_error(change_set.changed_elements)
        # A delta costs 6 bytes per changed element, an anchor 2 per element: past a third
        # of the model changed, the anchor alone is smaller (and cheaper to apply).
        dense = 3 * changed > self.layout.total_elements
        write_anchor = self._needs_anchor or dense or catch_up_heavy or self._since_anchor + 1 >= self.anchor_every
        write_delta = not (self._needs_anchor or dense)
        holds_snapshot = write_anchor or (write_delta and self.encoding == "compact")
        if holds_snapshot:
            # An anchor is written from the detector's snapshot, and a compact delta is coded
            # against it; hold it until then so that the next `changes()` cannot move it on.
            self.detector.snapshot_lock.acquire()
        job = _Job(
            version=version,
            change_set=change_set,
            write_delta=write_delta,
            write_anchor=write_anchor,
            detect_seconds=time.perf_counter() - started,
            holds_snapshot_lock=holds_snapshot,
        )
        self._last_version = version
        self._since_anchor = 0 if write_anchor else self._since_anchor + 1
        self._needs_anchor = False
        if self._queue is None:
            self._run_job(job)
            self._raise_pending_error()
        else:
            self._queue.put(job)

    def flush(self) -> None:
        """Wait until every published version is stored; raise [`PublishError`] if one failed."""
        if self._queue is not None:
            self._queue.join()
        self._raise_pending_error()

    def close(self) -> None:
        """Flush, stop the worker and remove staging files. Raises a pending [`PublishError`]."""
        try:
            self.flush()
        finally:
            if self._queue is not None and self._worker is not None and self._worker.is_alive():
                self._queue.put(None)
                self._worker.join()
            shutil.rmtree(self._staging, ignore_errors=True)

    def _raise_pending_error(self, changed: int = 0) -> tuple[int, bool]:
        """Raise a failure of an earlier version; return the elements changed on all ranks,
        and whether the deltas since the last anchor outweigh it (time for an anchor).

        With parts, every rank must take the same decisions (raise; write an anchor), so the
        ranks pool what they know: a failure any rank knows of counts for all, and rank 0's
        byte count (the one that sees every part) decides.
        """
        with self._error_lock:
            error, self._error = self._error, None
        heavy = self.anchor_bytes_ratio is not None and (
            self._delta_bytes_since_anchor > self.anchor_bytes_ratio * self._anchor_bytes > 0
        )
        if self.parted:
            pooled = self._ranks.gather((error and str(error), changed, heavy), thread="caller")
            failures = [failure for failure, _, _ in pooled if failure]
            changed = sum(count for _, count, _ in pooled)
            heavy = pooled[0][2]
            if failures and error is None:
                error = PublishError(failures[0])
        if error is not None:
            self._needs_anchor = True
            raise PublishError(f"publishing to {self.bucket.url} failed: {error}") from error
        return changed, heavy

    # -- worker side -----------------------------------------------------------------

    def _run_worker(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is not None and not self.parted:
                    logger.error("delta-sync: version %d dropped after an earlier publish failure", job.version)
                    if job.holds_snapshot_lock:
                        self.detector.snapshot_lock.release()
                    continue
                self._run_job(job)
            finally:
                self._queue.task_done()

    def _run_job(self, job: _Job) -> None:
        started = time.perf_counter()
        try:
            report = self._store(job, started)
        except BaseException as exc:  # reported to the training thread, never dropped
            logger.error("delta-sync: publishing version %d to %s failed: %s", job.version, self.bucket.url, exc)
            with self._error_lock:
                self._error = exc
            return
        finally:
            if job.holds_snapshot_lock:
                job.holds_snapshot_lock = False
                self.detector.snapshot_lock.release()
        self.reports.append(report)
        logger.info(
            "delta-sync: v%d %s: %d changed (sparsity %.4f%%), %s in %.3f s",
            report.version,
            report.kind,
            report.changed_elements,
            100 * report.sparsity,
            _human_bytes(report.bytes_written),
            report.detect_seconds + report.publish_seconds,
        )
        for callback in self.on_published:
            callback(report)

    def _store(self, job: _Job, started: float) -> PublishReport:
        if self._resumed_files:
            self._rewind(job.version)
        mine = self._store_own_files(job)
        if self.parted:
            results = self._ranks.gather(mine, thread="worker")
            failed = [f"rank {rank}: {r.error}" for rank, r in enumerate(results) if r.error]
            if failed:
                raise PublishError(f"version {job.version} is not stored: {'; '.join(failed)}")
        else:
            results = [mine]
        delta, anchor = self._finish_version(job, results)
        written = sum(stored.bytes for r in results for stored in (r.delta, r.anchor) if stored is not None)
        if self.rank == 0:
            latest = Latest(
                version=job.version,
                anchor_version=self._anchor_version,
                anchor=self._version_path("anchor", self._anchor_version),
                delta=delta,
                model_checksum=model_checksum(self._model_checksums),
                run_id=self.run_id,
                epoch=self.epoch,
                epoch_start=self._epoch_start or job.version,
            ).to_json(self.signing_key)
            self.bucket.upload(LATEST, latest)
            written += len(latest)
            if anchor is not None:
                self._apply_retention()
        self._stored_version = job.version
        self._epoch_start = self._epoch_start or job.version
        delta_bytes = sum(r.delta.bytes for r in results if r.delta is not None)
        if anchor is not None:
            self._anchor_bytes = sum(r.anchor.bytes for r in results if r.anchor is not None)
            self._delta_bytes_since_anchor = 0
        else:
            self._delta_bytes_since_anchor += delta_bytes
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
            catch_up_bytes=self._anchor_bytes + self._delta_bytes_since_anchor,
        )

    def _store_own_files(self, job: _Job) -> _RankResult:
        """Write this rank's files of a version: the single files, or this rank's parts.

        With parts, a failure is returned rather than raised so that the other ranks learn
        of it in the same exchange instead of waiting for this rank forever.
        """
        result = _RankResult(changed={n: len(c) for n, c in job.change_set.changes.items()})
        try:
            if self._error is not None:  # an earlier version failed here: this one is dropped
                raise PublishError(f"dropped after an earlier failure: {self._error}")
            if job.write_delta:
                result.delta = self._store_delta(job.version, job.change_set)
                if not job.write_anchor and job.holds_snapshot_lock:
                    job.holds_snapshot_lock = False
                    self.detector.snapshot_lock.release()
            if job.write_anchor:
                result.anchor = self._store_anchor(job.version, check_chain=job.write_delta)
                # The snapshot is no longer needed: let training move on before the uploads end.
                job.holds_snapshot_lock = False
                self.detector.snapshot_lock.release()
        except BaseException as exc:
            if not self.parted:
                raise
            result.error = f"{type(exc).__name__}: {exc}"
        result.checksums = dict(self._checksums)
        return result

    def _finish_version(self, job: _Job, results: list[_RankResult]) -> tuple[str | None, str | None]:
        """Bring the whole model's checksums up to this version; with parts, rank 0 writes the
        manifests. Returns the paths replicas apply: the delta's and the anchor's (or None)."""
        previous = dict(self._model_checksums)
        for name in self.layout.shapes:
            shares = [r.checksums[name] for r in results if r.checksums and name in r.checksums]
            if shares:
                self._model_checksums[name] = add_checksums(*shares)
        delta = anchor = None
        if job.write_delta:
            changed = sorted({name for r in results for name in (r.changed or {})})
            delta = self._version_path("delta", job.version)
            if self.parted:
                self._write_manifest("delta", job, results, changed, base=previous)
        if job.write_anchor:
            # A delta of this version still descends from the previous anchor.
            self._anchor_version = job.version
            anchor = self._version_path("anchor", job.version)
            if self.parted:
                self._write_manifest("anchor", job, results, sorted(self.layout.shapes), base=None)
        return delta, anchor

    def _write_manifest(
        self, kind: str, job: _Job, results: list[_RankResult], names: list[str], *, base: dict[str, int] | None
    ) -> None:
        if self.rank != 0:
            return
        parts = []
        for rank, result in enumerate(results):
            stored = result.delta if kind == "delta" else result.anchor
            if stored is not None:
                parts.append(PartRecord(stored.path, rank, stored.bytes, stored.payload_digest, stored.sha256))
        manifest = Manifest(
            kind=kind,
            version=job.version,
            base_version=self._stored_version if kind == "delta" else None,
            anchor_version=self._anchor_version,
            run_id=self.run_id,
            epoch=self.epoch,
            encoding=self.encoding if kind == "delta" else "dense",
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
        self.bucket.upload(manifest_path(kind, job.version), data, overwrite=False)
        if self.signing_key is not None:
            self._upload_signature(manifest_path(kind, job.version), hashlib.sha256(data).hexdigest())

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

    def _store_delta(self, version: int, change_set: ChangeSet) -> _Stored | None:
        assert self._stored_version is not None and self._anchor_version is not None
        if self.parted and not change_set.changes:
            return None  # nothing changed on this rank: no part
        base_checksums = {name: self._checksums[name] for name in change_set.changes}
        new_checksums = {
            name: updated_checksum(base_checksums[name], change.indices, change_set.old_values[name], change.values)
            for name, change in change_set.changes.items()
        }
        self._checksums.update(new_checksums)
        path = self._own_path("delta", version)
        header = FileHeader(
            source=path,
            kind="delta",
            version=version,
            base_version=self._stored_version,
            anchor_version=self._anchor_version,
            encoding=self.encoding,
            run_id=self.run_id,
            epoch=self.epoch,
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
        if self.encoding == "compact":
            previous = self.detector.snapshot
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
        return self._write_and_upload(
            path, lambda dest: write_delta(dest, changes, header, previous, old_values=change_set.old_values)
        )

    def _store_anchor(self, version: int, *, check_chain: bool) -> _Stored | None:
        shards = self.layout.shards
        tensors = {name: tensor.cpu() for name, tensor in self.detector.snapshot.items()}
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
        # With a delta of the same version just written, the checksums kept up delta by
        # delta must equal those of the weights: a free end-to-end check of the chain.
        if check_chain and checksums != self._checksums:
            drifted = sorted(name for name in checksums if checksums[name] != self._checksums.get(name))
            raise PublishError(
                f"version {version}: checksums kept up by deltas disagree with the weights for {drifted[:5]}; "
                "the delta chain would not reproduce the model"
            )
        self._checksums = checksums
        if self.parted and not tensors:
            return None  # this rank holds no element of any parameter
        path = self._own_path("anchor", version)
        total = sum(t.numel() for t in tensors.values())
        header = FileHeader(
            source=path,
            kind="anchor",
            version=version,
            base_version=None,
            anchor_version=version,
            encoding="dense",
            run_id=self.run_id,
            epoch=self.epoch,
            shapes={name: shards[name].global_shape for name in tensors},
            checksums=checksums,
            base_checksums={},
            model_checksum="" if self.parted else model_checksum(checksums),
            changed_elements=total,
            total_elements=self.layout.total_elements,
            part=self._part(),
            blocks={name: shards[name].block.offset for name in tensors} if self.parted else {},
        )
        return self._write_and_upload(path, lambda dest: write_anchor(dest, tensors, header))

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

    def _write_and_upload(self, path: str, write: Callable[[Path], FileHeader]) -> _Stored:
        staged = self._staging / path.replace("/", "_")
        try:
            header = write(staged)
            size = staged.stat().st_size
            sha256 = file_sha256(staged) if self.signing_key is not None else None
            # Version files are written once: a second trainer on the same prefix fails loudly.
            self.bucket.upload(path, staged, overwrite=False)
        finally:
            staged.unlink(missing_ok=True)
        if sha256 is not None and not self.parted:  # a part is signed through its manifest
            self._upload_signature(path, sha256)
        return _Stored(path, size, header.payload_digest, sha256)

    def _upload_signature(self, path: str, sha256: str) -> None:
        assert self.signing_key is not None
        self.bucket.upload(path + SIGNATURE_SUFFIX, self.signing_key.sign(path, sha256).to_json(), overwrite=False)

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


def _human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"

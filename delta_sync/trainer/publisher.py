"""`Publisher`: turns a detector's changes into anchors, deltas and `latest.json` in a bucket.

Four parts, each with one owner:

* [`AnchorSchedule`] (`delta_sync.trainer.schedule`) decides what each version stores;
  the training thread asks it, the writer tells it what was stored (it locks its state).
* [`VersionWriter`] (`delta_sync.trainer.writer`) encodes, uploads, writes manifests and
  `latest.json`, and applies retention; its state belongs to the thread that runs jobs
  (the worker thread, or the training thread when `background=False`).
* [`BackgroundWriter`] (`delta_sync.trainer.background`, shared with adapter mode) runs
  the jobs through the writer in order: the queue and its worker, the failure kept for
  the training thread, and the refresh of `latest.json` while there is nothing to publish.
* [`SnapshotLease`] (`delta_sync.trainer.lease`) holds the detector's snapshot from
  [`Publisher.publish`] until the version's files are encoded, released exactly once
  and before any upload begins.

The publisher itself is what is left: planning each version on the training thread, and
the one exchange among ranks at each publish, flush or close. Its options
([`PublisherOptions`]) live in `delta_sync.trainer.options`, shared with adapter mode,
and are re-exported here.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..changes import Encoding
from ..errors import PublishError
from ..storage import Bucket, open_bucket
from ..version import VersionId
from .background import BackgroundWriter
from .detector import BF16ChangeDetector
from .lease import SnapshotLease
from .options import PublisherOptions, signing_key_of
from .prefix import claim_prefix
from .ranks import RankGroup, ThreadRole
from .schedule import AnchorSchedule
from .writer import PublishReport, VersionJob, VersionWriter

__all__ = ["PublishReport", "Publisher", "PublisherOptions"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pooled:
    """What the ranks know at a publish, flush or close: the same on every rank.

    Args:
        failure: A failure of an earlier version that any rank knows of, or None.
        changed: Elements changed since the last version, all ranks together.
        catch_up_heavy: With parts, rank 0's verdict of the bytes rule (it counts every
            part; see [`AnchorSchedule.catch_up_heavy`]); None: the schedule's own.
    """

    failure: BaseException | None
    changed: int
    catch_up_heavy: bool | None


class Publisher:
    """Writes every version of a model's weights to a bucket as an anchor or a delta.

    Version by version: the first version published is an anchor (full bf16 weights);
    every later version has a delta against the version before it, so a replica that
    keeps up never downloads the full model again; and every `anchor_every` versions an
    anchor of the same version is written as well, for replicas that join late or lose
    their place (see [`AnchorSchedule`]). `latest.json` moves to a version only after all
    of its files are stored. Only the newest `keep_anchors` anchors are kept, with the
    deltas that follow them.

    With `background=True` (the default) encoding and uploading run on a worker thread
    so the next training step overlaps them; versions are still stored strictly in
    order, and at most `max_pending` versions wait. The detector's snapshot is held only
    while a version that needs it (an anchor, a compact delta) is encoded, never during
    its upload, so the next [`publish`] detects changes while the previous version
    uploads. A failure is raised as [`PublishError`] by the next [`publish`], [`flush`] or
    [`close`]; versions queued behind a failed one are dropped, and the next version
    published after the error is written as an anchor so replicas can recover.

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
        options: A [`PublisherOptions`] (default: its defaults).
        on_published: Called (on the worker thread) with each [`PublishReport`] after its
            files and `latest.json` are stored.
        **overrides: Fields of [`PublisherOptions`] to set on top of `options`, e.g.
            `anchor_every=5`.

    Example:
        ```python
        >>> detector = BF16ChangeDetector(model, optimizer)
        >>> publisher = Publisher("./deltas", detector, anchor_every=10)
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
        options: PublisherOptions | None = None,
        *,
        on_published: Iterable[Callable[[PublishReport], None]] = (),
        **overrides: Any,
    ) -> None:
        self.options = options = replace(options or PublisherOptions(), **overrides)
        self.bucket = open_bucket(bucket)
        self.detector = detector
        self.layout = detector.layout
        #: Whether versions are written as one part per rank plus a manifest.
        self.parted = self.layout.sharded
        self._ranks = RankGroup(self.layout.world_size if self.parted else 1)
        self.rank = self._ranks.rank
        self.signing_key = signing_key_of(options.signing_key)
        self.run_id = options.run_id or uuid.uuid4().hex[:12]
        #: This start of the publisher: a run resumed in place rewrites versions under a new
        #: epoch, so replicas and caches never mistake them for the abandoned ones.
        self.epoch = uuid.uuid4().hex[:8]
        resumed_files = self._join_prefix(options.overwrite)
        # Shared by the two threads, each behind its own lock.
        self._schedule = AnchorSchedule(options.anchor_every, options.anchor_bytes_ratio)
        # The thread that runs jobs owns the writer.
        writer = VersionWriter(
            self.bucket,
            detector,
            self._ranks,
            self._schedule,
            # Not a bound method of this publisher: the writer holds the detector, so a cycle
            # through it would keep the model and optimizer alive after close() until a full
            # garbage collection (on a GPU, device memory that empty_cache() cannot free).
            # The run id and epoch are final once the prefix is joined, above.
            version_id=functools.partial(VersionId, run_id=self.run_id, epoch=self.epoch),
            encoding=options.encoding,
            keep_anchors=options.keep_anchors,
            signing_key=self.signing_key,
            resumed_files=resumed_files,
            bucket_id=options.bucket_id,
        )
        self._jobs = BackgroundWriter(
            writer,
            background=options.background,
            max_pending=options.max_pending,
            pointer_refresh=options.pointer_refresh,
            # With parts, a rank that dropped a version would leave the others waiting for it.
            keep_in_step=self.parted,
            describe=_describe,
            on_published=on_published,
            bucket_url=self.bucket.url,
            thread_name="delta-sync-publisher",
        )
        #: Every version stored, in order (appended by the thread that writes).
        self.reports: list[PublishReport] = self._jobs.reports
        #: Called with each report once stored (see `on_published` above).
        self.on_published: list[Callable[[PublishReport], None]] = self._jobs.on_published
        # The training thread's.
        self._last_version: int | None = None

    def _join_prefix(self, overwrite: bool) -> list[str]:
        """Rank 0 claims the prefix; every rank adopts its run id or its refusal. Returns the
        files of a resumed run that rank 0 replaces (none on other ranks)."""
        refusal, resumed = None, []
        if self.rank == 0:
            try:
                resumed = claim_prefix(self.bucket, self.run_id, overwrite=overwrite)
            except PublishError as exc:
                refusal = str(exc)
        self.run_id, self.epoch, refusal = self._ranks.broadcast((self.run_id, self.epoch, refusal))
        if refusal is not None:
            raise PublishError(refusal)
        return resumed

    # -- caller side -----------------------------------------------------------------

    @property
    def last_version(self) -> int | None:
        """The last version handed to [`publish`]."""
        return self._last_version

    @property
    def pending_error(self) -> BaseException | None:
        """A background failure not yet raised (it will be, by the next publish, flush or close)."""
        return self._jobs.pending_failure

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
        pooled = self._pool(change_set.changed_elements)
        self._raise(pooled.failure)
        plan = self._schedule.plan(pooled.changed, self.layout.total_elements, catch_up_heavy=pooled.catch_up_heavy)
        # An anchor is written from the detector's snapshot, and a compact delta is coded
        # against it: hold it until they are encoded, so that the next `changes()` cannot
        # move it on meanwhile.
        if plan.anchor or (plan.delta and self.options.encoding == Encoding.COMPACT):
            lease = SnapshotLease.take(self.detector.snapshot_lock)
        else:
            lease = SnapshotLease.none()
        job = VersionJob(version, change_set, plan, time.perf_counter() - started, lease)
        self._last_version = version
        self._jobs.submit(job)
        if not self._jobs.background:
            self._raise(self._pool().failure)

    def flush(self) -> None:
        """Wait until every published version is stored; raise [`PublishError`] if one failed."""
        self._jobs.flush()
        self._raise(self._pool().failure)

    def close(self) -> None:
        """Flush, stop the worker and remove staging files. Raises a pending [`PublishError`]."""
        try:
            self.flush()
        finally:
            self._jobs.close()

    def _pool(self, changed: int = 0) -> _Pooled:
        """Take this rank's pending failure and pool it, with `changed`, across the ranks.

        With parts every rank must take the same decisions (raise; store an anchor), so the
        ranks tell each other what they know in one exchange: a failure any rank knows of
        counts for all, the changed counts add up, and rank 0's bytes verdict stands.
        """
        failure = self._jobs.take_failure()
        if not self.parted:
            return _Pooled(failure, changed, None)
        pooled = self._ranks.gather(
            (failure and str(failure), changed, self._schedule.catch_up_heavy), thread=ThreadRole.CALLER
        )
        failures = [message for message, _, _ in pooled if message]
        if failures and failure is None:
            failure = PublishError(failures[0])
        return _Pooled(failure, sum(count for _, count, _ in pooled), pooled[0][2])

    def _raise(self, failure: BaseException | None) -> None:
        """Raise a failure of an earlier version; the next version is then an anchor alone."""
        if failure is not None:
            self._schedule.restart()
            raise PublishError(f"publishing to {self.bucket.url} failed: {failure}") from failure


def _describe(report: PublishReport) -> str:
    """The line logged for a stored version."""
    return (
        f"v{report.version} {report.kind}: {report.changed_elements} changed (sparsity "
        f"{100 * report.sparsity:.4f}%), {_human_bytes(report.bytes_written)} in "
        f"{report.detect_seconds + report.publish_seconds:.3f} s"
    )


def _human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"

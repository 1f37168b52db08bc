"""[`BackgroundWriter`]: stores a publisher's versions in order, off the training thread.

Both publishers hand it each version as a job: the anchor-and-delta `Publisher`
(`delta_sync.trainer.publisher`, through a `VersionWriter`) and adapter mode's
`AdapterPublisher` (`delta_sync.trainer.adapter`). It owns what they have in common:

* the queue and its worker thread: versions are stored strictly in order, at most
  `max_pending` wait (a further publish blocks), and without `background` each is stored
  on the caller's thread instead;
* failures: the first one is kept for the training thread, which raises it at its next
  publish, flush or close; versions queued behind it are dropped (or, with ranks that
  must stay in step, still handed to the writer with the failure);
* the pointer refresh: with nothing to store for `pointer_refresh` seconds, the worker
  writes `latest.json` again (same version, a newer counter and time), so that replicas
  with a staleness bound (`DELTA_SYNC_MAX_STALENESS`) can tell a live trainer from a
  pointer held back.

The writer belongs to the thread that runs jobs (the worker, or the caller without
`background`); the training thread only submits, waits and takes the failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from .writer import PublishReport

__all__ = ["BackgroundWriter", "Job", "JobStore"]

logger = logging.getLogger(__name__)


class Job(Protocol):
    """One version handed from the training thread to the thread that stores it."""

    @property
    def version(self) -> int: ...

    def release(self) -> None:
        """Let go of what the job holds from the training thread (e.g. a snapshot lease);
        called once the job is stored, failed or dropped, and harmless if already done."""


J = TypeVar("J", bound=Job)
J_contra = TypeVar("J_contra", bound=Job, contravariant=True)


class JobStore(Protocol[J_contra]):
    """What a [`BackgroundWriter`] stores jobs with: a `delta_sync.trainer.prefix.PointerWriter`
    that also stores versions."""

    #: This process's rank among those writing each version (only rank 0 points).
    rank: int
    #: When `latest.json` was last written (`time.monotonic()`), or None.
    pointer_written: float | None

    def store(self, job: J_contra, earlier_failure: BaseException | None) -> PublishReport:
        """Store one version; `earlier_failure` is a failure not yet raised, when the
        writer is asked to take part in a version all the same."""
        ...

    def refresh_pointer(self) -> bool:
        """Write the last pointer again, with a new counter and time."""
        ...

    def close(self) -> None:
        """Remove what the writer staged locally."""
        ...


class BackgroundWriter(Generic[J]):
    """Stores a publisher's versions in order through its writer, on a worker thread or the caller's.

    Args:
        writer: Stores each job; owned by this object from now on (closed by [`close`]).
        background: Store on a worker thread; otherwise [`submit`] stores on the caller's.
        max_pending: Jobs that may wait for the worker before [`submit`] blocks (at least 1).
        pointer_refresh: With nothing to store for this many seconds, have the writer
            write `latest.json` again; None never. Only the worker refreshes (with
            `background`), and only rank 0's writer points.
        keep_in_step: After a failure, still hand later jobs to the writer (with the
            failure) instead of dropping them: ranks that exchange results at every version
            must all take part in it, or their peers wait forever.
        describe: The line logged for each stored version, given its report.
        on_published: Called on the storing thread with each report, after its files
            and `latest.json` are stored.
        bucket_url: Names the bucket in log lines.
        noun: What a job is called in log lines (e.g. `"version"`).
        thread_name: The worker thread's name.
    """

    def __init__(
        self,
        writer: JobStore[J],
        *,
        background: bool,
        max_pending: int,
        pointer_refresh: float | None,
        keep_in_step: bool = False,
        describe: Callable[[PublishReport], str],
        on_published: Iterable[Callable[[PublishReport], None]] = (),
        bucket_url: str,
        noun: str = "version",
        thread_name: str = "delta-sync-publisher",
    ) -> None:
        self.writer = writer
        self.pointer_refresh = pointer_refresh
        self.keep_in_step = keep_in_step
        self.describe = describe
        self.on_published = list(on_published)
        self.bucket_url = bucket_url
        self.noun = noun
        #: Every version stored, in order (appended by the thread that stores).
        self.reports: list[PublishReport] = []
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()
        self._queue: queue.Queue[J | None] | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max(1, max_pending))
            self._worker = threading.Thread(target=self._run_worker, name=thread_name, daemon=True)
            self._worker.start()

    # -- the training thread ---------------------------------------------------------------

    @property
    def background(self) -> bool:
        """Whether jobs are stored on the worker thread (else by [`submit`] itself)."""
        return self._queue is not None

    @property
    def pending_failure(self) -> BaseException | None:
        """The failure the training thread has not taken yet, or None."""
        with self._failure_lock:
            return self._failure

    def take_failure(self) -> BaseException | None:
        """The failure not taken yet (now taken), or None."""
        with self._failure_lock:
            failure, self._failure = self._failure, None
        return failure

    def submit(self, job: J) -> None:
        """Store `job` after those submitted before: queue it (blocking while `max_pending`
        wait), or, without `background`, store it now. A failure is kept, never raised here."""
        if self._queue is None:
            self._run(job)
        else:
            self._queue.put(job)

    def flush(self) -> None:
        """Wait until every job submitted is stored, failed or dropped."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Stop the worker once the jobs queued before are done, then close the writer."""
        try:
            if self._queue is not None and self._worker is not None and self._worker.is_alive():
                self._queue.put(None)  # after every job queued before it
                self._worker.join()
        finally:
            self.writer.close()

    # -- the thread that stores ------------------------------------------------------------

    def _run_worker(self) -> None:
        assert self._queue is not None
        while True:
            try:
                job = self._queue.get(timeout=self._refresh_due())
            except queue.Empty:
                self._refresh_pointer()
                continue
            try:
                if job is None:
                    return
                self._run(job)
            finally:
                self._queue.task_done()

    def _refresh_due(self) -> float | None:
        """Seconds until the pointer is due a refresh (None: wait for a job however long)."""
        every, written = self.pointer_refresh, self.writer.pointer_written
        if every is None or written is None or self.writer.rank != 0:
            return None
        if self.pending_failure is not None:
            # No refresh until the training thread takes the failure; look again a period
            # later rather than at once, which would spin this thread against training.
            return every
        return max(0.0, written + every - time.monotonic())

    def _refresh_pointer(self) -> None:
        if self.pending_failure is not None:
            return  # the training thread hears of the failure first; the next version points anew
        try:
            if self.writer.refresh_pointer():
                logger.debug("delta-sync: refreshed latest.json (nothing new to publish)")
        except BaseException as exc:  # refreshing is best effort: the next one, or the next version, retries
            logger.warning("delta-sync: could not refresh latest.json on %s: %s", self.bucket_url, exc)

    def _run(self, job: J) -> None:
        """Store one job and report it; a failure is kept for the training thread."""
        earlier = self.pending_failure
        try:
            if earlier is not None and not self.keep_in_step:
                logger.error("delta-sync: %s %d dropped after an earlier publish failure", self.noun, job.version)
                return
            report = self.writer.store(job, earlier)
        except BaseException as exc:  # reported to the training thread, never dropped
            logger.error("delta-sync: publishing %s %d to %s failed: %s", self.noun, job.version, self.bucket_url, exc)
            with self._failure_lock:
                self._failure = exc
            return
        finally:
            job.release()  # if the writer did not get as far
        self.reports.append(report)
        logger.info("delta-sync: %s", self.describe(report))
        for callback in self.on_published:
            callback(report)

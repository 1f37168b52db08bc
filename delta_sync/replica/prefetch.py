"""`Prefetcher`: prepares new versions in a shared snapshot before anyone asks for them.

vLLM runs weight-update requests inside its engine loop, so whatever `/update_weights`
does, nothing generates meanwhile. A prefetcher runs on a thread of its own in the
replica's process: whenever a watched bucket's `latest.json` moves (or the trainer hints
that it did), it downloads, verifies, decodes and applies the new versions to the node
snapshot ([`Receiver.prefetch`]) while the server keeps generating. The update the trainer
posts then finds its version prepared and only loads what changed.

Example:
    ```python
    >>> prefetcher = Prefetcher(receiver, interval=2.0)
    >>> prefetcher.watch("s3://ckpts/run-1")
    >>> prefetcher.start()
    >>> prefetcher.hint()  # the trainer published: look now
    >>> prefetcher.stop()
    ```
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Collection

from ..errors import BucketFileNotFoundError
from ..layout import LATEST
from ..storage import Bucket, open_bucket
from .receiver import Receiver

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Keeps a receiver's shared snapshot at the newest version of the buckets it watches.

    Each poll costs one small conditional read of each watched bucket's `latest.json`
    (see `Bucket.read_if_changed`). Failures are logged once per distinct message and
    retried at later polls, after waits that double from `interval` up to `max_backoff`;
    they never stop the thread. A bucket with no `latest.json` yet is skipped quietly.

    The thread runs at a lower scheduling priority than the rest of the process (on
    Linux, where a thread has a nice value of its own; the threads it starts inherit it):
    on a machine whose cores the server's engine keeps busy, preparing a version then
    takes the cores generation leaves idle rather than a share of those it uses. Where
    the server binds its compute threads to some cores, pass the others as `cpus`: a
    thread otherwise inherits the cores of the thread that starts it.

    Args:
        receiver: The receiver whose snapshot to prepare; its store must be shared (a
            `NodeStore`).
        interval: Seconds between polls while all is well.
        max_backoff: Longest wait, in seconds, between polls that fail.
        niceness: How much lower the thread's priority is than the process's (added to
            its nice value, 0-19; 0 leaves it as it is).
        cpus: The CPUs the thread runs on (Linux); None: those of the thread that calls
            [`start`].
    """

    def __init__(
        self,
        receiver: Receiver,
        *,
        interval: float = 2.0,
        max_backoff: float = 60.0,
        niceness: int = 10,
        cpus: Collection[int] | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be in 0-19, got {niceness}")
        self.receiver = receiver
        self.interval = interval
        self.max_backoff = max(max_backoff, interval)
        self.niceness = niceness
        self.cpus = None if cpus is None else frozenset(cpus)
        if self.cpus is not None and not self.cpus:
            raise ValueError("cpus must name at least one CPU (or be None)")
        #: The polling thread's id in the operating system, once it runs.
        self.native_id: int | None = None
        self._buckets: dict[str, Bucket] = {}
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem: str | None = None

    @property
    def running_on(self) -> list[int] | None:
        """The CPUs the thread may run on, as the operating system has them; None before it
        runs or where that cannot be read."""
        if self.native_id is None or not hasattr(os, "sched_getaffinity"):
            return None
        try:
            return sorted(os.sched_getaffinity(self.native_id))
        except OSError:  # the thread has ended
            return None

    @property
    def watched(self) -> list[str]:
        """The bucket URLs polled."""
        with self._lock:
            return list(self._buckets)

    def watch(self, bucket: Bucket | str) -> None:
        """Poll `bucket` too, from the next poll on (its URL, or an open bucket); watching it
        again changes nothing."""
        opened = bucket if isinstance(bucket, Bucket) else open_bucket(bucket)
        with self._lock:
            if opened.url in self._buckets:
                return
            self._buckets[opened.url] = opened
        logger.info("delta-sync: prefetching new versions of %s", opened.url)

    def hint(self, bucket: Bucket | str | None = None) -> None:
        """Look at the watched buckets (and `bucket`, watched from now on) now rather than
        at the next poll. Returns at once."""
        if bucket is not None:
            self.watch(bucket)
        with self._lock:
            self._tags.clear()  # read latest.json even if its tag did not change
        self._wake.set()

    def start(self) -> None:
        """Start the polling thread (a daemon: it never keeps the process alive)."""
        if self._thread is not None:
            raise RuntimeError("the prefetcher was already started")
        self._thread = threading.Thread(target=self._run, name="delta-sync-prefetch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop polling; waits up to `timeout` seconds for a prefetch in progress."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def poll_once(self) -> bool:
        """Prefetch every watched bucket whose `latest.json` moved; True when all succeeded."""
        with self._lock:
            buckets = list(self._buckets.values())
        return all([self._prefetch(bucket) for bucket in buckets])

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self._lower_priority()
        self._move_to_cpus()
        delay = self.interval
        while not self._stopping.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopping.is_set():
                return
            delay = self.interval if self.poll_once() else min(2 * delay, self.max_backoff)

    def _lower_priority(self) -> None:
        if not self.niceness or not sys.platform.startswith("linux"):
            return  # elsewhere a thread has no nice value of its own: it would lower the process's
        try:
            current = os.getpriority(os.PRIO_PROCESS, self.native_id)
            os.setpriority(os.PRIO_PROCESS, self.native_id, min(19, current + self.niceness))
        except OSError as exc:  # e.g. a sandbox that forbids it: prefetching still works
            logger.info("delta-sync: cannot lower the prefetch thread's priority: %s", exc)

    def _move_to_cpus(self) -> None:
        if self.cpus is None:
            return
        try:
            os.sched_setaffinity(0, self.cpus)  # 0: this thread
        except (AttributeError, OSError) as exc:  # not Linux, or CPUs this process may not use
            logger.info(
                "delta-sync: the prefetch thread stays on its CPUs (cannot move to %s: %s)", sorted(self.cpus), exc
            )

    def _prefetch(self, bucket: Bucket) -> bool:
        with self._lock:
            tag = self._tags.get(bucket.url)
        try:
            content, new_tag = bucket.read_if_changed(LATEST, tag)
            if content is not None:
                self.receiver.prefetch(bucket)
        except BucketFileNotFoundError:
            return True  # nothing published there yet
        except Exception as exc:  # a prefetch that fails is retried; the update posted later says why
            problem = f"{bucket.url}: {type(exc).__name__}: {exc}"
            if problem != self._last_problem:
                logger.warning("delta-sync: prefetching %s failed (retrying): %s", bucket.url, problem)
            self._last_problem = problem
            return False
        with self._lock:
            self._tags[bucket.url] = new_tag  # only once its versions are in the snapshot
        self._last_problem = None
        return True

"""Follow mode: keep a vLLM server at the newest version of a bucket, with no request from
the trainer.

The trainer's push ([`Replica`], `ReplicaSet`) reaches only servers it knows and can reach.
A [`Follower`] runs beside a server instead (`delta-sync follow BUCKET --vllm-url URL`):
it polls the bucket's `latest.json` and, whenever the server serves something else, asks
the server to catch up by itself (the newest anchor and the deltas after it, or only the
deltas when they chain from what it holds). Push and follow may run at once: a version
the server already holds is a no-op, and each client waits for the other's weight-update
session instead of ending it (see [`Replica`]'s `stale_session_seconds`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..control import AdapterStatus, ReplicaStatus
from ..control.client import Replica, ReplicaOptions
from ..errors import BucketFileNotFoundError, DeltaSyncError, ReplicaError
from ..layout import LATEST, Latest
from ..storage import Bucket, open_bucket

__all__ = ["Follower"]

logger = logging.getLogger(__name__)


class Follower:
    """Keeps one vLLM server at the version the bucket's `latest.json` names.

    Every poll costs one small request to the bucket (a conditional one where the store
    has them: S3 answers 304, the Hub a paths-info entry; see `Bucket.read_if_changed`)
    and one status request to the server. When the server serves another version, run or
    checksum than `latest.json` names, the follower drives it through start / update /
    finish with no filename: the server catches up by itself. A version it already holds
    is never applied twice. Failures (a server that is down, a bucket that cannot be read,
    a refused update) are logged and retried at the next poll, after waits that double
    from `interval` up to `max_backoff`; they never end [`run`].

    Args:
        bucket: The bucket the trainer publishes to: a URL, a local directory, or an open
            [`Bucket`]. The server reads it by its URL (`bucket.url`), so the server must
            trust that URL (`DELTA_SYNC_ALLOWED_BUCKETS`) and reach it with its own
            credentials.
        replica_url: Base URL of the vLLM server, e.g. `http://127.0.0.1:8000`.
        interval: Seconds between polls while all is well.
        max_backoff: Longest wait, in seconds, between polls that fail.
        options: How to talk to the server (a [`ReplicaOptions`]: `timeout`,
            `retry_seconds`, `pause_mode`, `headers`, `stale_session_seconds`, ...).
        adapter_name: For a bucket published in adapter mode (`latest.json` names an
            adapter): the name the server serves it under. Each new version is fetched and
            loaded in place under it ([`Replica.load_adapter`]); what the server serves is
            read from the adapter's path in `/v1/models`, so a restarted server, which
            serves no adapter, is given the newest.
        **replica_options: Fields of [`ReplicaOptions`] to set on top of `options`.

    Example:
        ```python
        >>> follower = Follower("s3://my-bucket/run1", "http://127.0.0.1:8000", interval=5)
        >>> follower.poll_once()  # one check; the status after a catch-up, None if in step
        ReplicaStatus(version=12, anchor_version=10, run_id='...', model_checksum='3f0c...', pending=0, updating=False)
        >>> stop = threading.Event()
        >>> follower.run(stop)  # until stop.set(), e.g. from a signal handler
        ```
    """

    def __init__(
        self,
        bucket: str | os.PathLike | Bucket,
        replica_url: str,
        *,
        interval: float = 5.0,
        max_backoff: float = 120.0,
        options: ReplicaOptions | None = None,
        adapter_name: str | None = None,
        **replica_options: Any,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if max_backoff < interval:
            raise ValueError(f"max_backoff must be >= interval ({interval}), got {max_backoff}")
        self.bucket = open_bucket(bucket)
        self.replica = Replica(replica_url, options, **replica_options)
        self.interval = interval
        self.adapter_name = adapter_name
        self.max_backoff = max_backoff
        #: The newest `latest.json` read, and the tag it was read with.
        self.latest: Latest | None = None
        self._tag: str | None = None

    def close(self) -> None:
        self.replica.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Poll until `stop` is set (forever without one), surviving every failure.

        Args:
            stop: Ends the loop when set; a wait between polls ends at once, an update in
                flight is completed first.
        """
        stop = stop or threading.Event()
        failures = 0
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:
                failures += 1
                wait = self._backoff(failures)
                # Our own errors say what happened; anything else is a bug worth a traceback.
                logger.warning(
                    "delta-sync: follow %s -> %s: %s; next try in %.1f s",
                    self.bucket.url,
                    self.replica.url,
                    exc,
                    wait,
                    exc_info=not isinstance(exc, DeltaSyncError),
                )
            else:
                failures, wait = 0, self.interval
            stop.wait(wait)

    def _backoff(self, failures: int) -> float:
        """The wait after `failures` polls in a row failed: doubling, bounded."""
        return min(self.interval * 2.0**failures, self.max_backoff)

    # -- one poll -------------------------------------------------------------------------

    def poll_once(self) -> ReplicaStatus | AdapterStatus | None:
        """Compare the server with `latest.json` once; catch the server up if they differ.

        Returns:
            The server's status after a catch-up, or None when there was nothing to do
            (in step already, or nothing published yet).

        Raises:
            DeltaSyncError: The bucket or the server failed (after their own retries), the
                server refused the update, or it serves something else afterwards.
        """
        latest = self._read_latest()
        if latest is None:
            return None
        if latest.adapter is not None:
            return self._poll_adapter(latest)
        served = self.replica.status()
        if not _behind(served, latest):
            return None
        started = time.perf_counter()
        status = self.replica.update(self.bucket.url, version=latest.version)
        self._check(status, latest)
        logger.info(
            "delta-sync: %s serves version %s of run %s (checksum %s; was version %s), caught up in %.2f s",
            self.replica.url,
            status.version,
            status.run_id,
            status.model_checksum,
            served.version,
            time.perf_counter() - started,
        )
        return status

    def _poll_adapter(self, latest: Latest) -> AdapterStatus | None:
        """Adapter mode: load `latest`'s adapter under `adapter_name` unless the server
        serves it (or a newer version of its run) there already."""
        if self.adapter_name is None:
            raise ReplicaError(
                f"{self.bucket.url}/{LATEST} names an adapter ({latest.adapter}): the bucket is published in "
                "adapter mode; follow it with the name the server serves the adapter under "
                "(Follower(adapter_name=...), `delta-sync follow --adapter-name NAME`)",
                url=self.replica.url,
            )
        served = self.replica.adapter_status(self.adapter_name)
        if served is not None and served.version >= latest.version:
            if AdapterStatus.is_version(served.path, latest.run_id, latest.epoch, served.version):
                return None
        started = time.perf_counter()
        status = self.replica.load_adapter(self.bucket.url, self.adapter_name, version=latest.version)
        if status.version != latest.version or status.model_checksum != latest.model_checksum:
            raise ReplicaError(
                f"{self.replica.url}: fetched adapter v{status.version} ({status.model_checksum}) for "
                f"{self.bucket.url}/{LATEST}, which names v{latest.version} ({latest.model_checksum})",
                url=self.replica.url,
            )
        logger.info(
            "delta-sync: %s serves adapter v%d of run %s as %r (was %s), loaded in %.2f s",
            self.replica.url,
            status.version,
            status.run_id,
            self.adapter_name,
            "none" if served is None else f"v{served.version}",
            time.perf_counter() - started,
        )
        return status

    def _read_latest(self) -> Latest | None:
        """The bucket's `latest.json` (the last one read when unchanged), or None before the first publish."""
        try:
            content, self._tag = self.bucket.read_if_changed(LATEST, self._tag)
        except BucketFileNotFoundError:
            self.latest, self._tag = None, None
            return None
        if content is not None:
            self.latest = Latest.from_json(content, source=f"{self.bucket.url}/{LATEST}")
        return self.latest

    def _check(self, status: ReplicaStatus, latest: Latest) -> None:
        """After a catch-up the server serves `latest` (or a newer version of its run)."""
        if _behind(status, latest):
            raise ReplicaError(
                f"{self.replica.url}: serves version {status.version} of run {status.run_id} "
                f"(checksum {status.model_checksum}) after catching up to {self.bucket.url}/{LATEST}: "
                f"version {latest.version} of run {latest.run_id} (checksum {latest.model_checksum})",
                url=self.replica.url,
            )


def _behind(served: ReplicaStatus, latest: Latest) -> bool:
    """Whether the server must catch up to `latest`: another run, an older version, or the
    same version with other weights. A newer version of the same run (pushed before
    `latest.json` was read again) is left alone."""
    if served.run_id != latest.run_id or served.version is None or served.version < latest.version:
        return True
    return served.version == latest.version and served.model_checksum != latest.model_checksum

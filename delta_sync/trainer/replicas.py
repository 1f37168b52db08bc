"""Trainer-side control plane: keep vLLM replicas at the newest version.

The only message a replica gets is a small HTTP POST naming a file in the bucket; the
weights themselves travel through the bucket. [`ReplicaSet`] keeps several replicas at the
newest version, driving each through `delta_sync.control.client.Replica` (the routes of
`delta_sync.control`: start, update, then finish with generation paused, then the status
of every worker).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..control import AdapterStatus, ReplicaStatus, UpdateInfo
from ..control.client import Replica, ReplicaOptions
from ..errors import DeltaSyncError, ReplicaError

__all__ = ["ReplicaSet", "ReplicaState"]

logger = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    """What the trainer knows about one replica.

    Args:
        url: The replica's base URL.
        version: Version it confirmed serving, or None before its first update.
        model_checksum: Checksum it reported with that version.
        error: The last failure, cleared by the next success.
        seconds: Duration of the last successful update.
    """

    url: str
    version: int | None = None
    model_checksum: str | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class _Target:
    version: int
    filename: str | None


class ReplicaSet:
    """Keeps several vLLM replicas at the newest published version, each on its own thread.

    [`announce`] tells every replica a new version exists (it returns at once); each
    replica's thread applies it: the delta's file when the replica holds the version
    before, a catch-up to `latest.json` otherwise (after a restart or a missed version).
    A replica that fails is reported and retried at the next version; it never blocks
    training or the other replicas. [`wait`] blocks until the live replicas reach a version.

    Args:
        urls: Base URLs of the replicas.
        bucket: The bucket URL replicas read from (absolute: replicas resolve it themselves).
        options: How each [`Replica`] talks to its server (a `ReplicaOptions`: `timeout`,
            `retry_seconds`, `pause_mode`, `headers`, `token`, ...); default: its defaults.
        adapter_name: Adapter mode (`delta_sync.trainer.adapter`): every version is an
            adapter, which each replica fetches and serves under this name
            ([`Replica.load_adapter`]) instead of updating its weights.
        **overrides: Fields of `ReplicaOptions` to set on top of `options`, e.g.
            `retry_seconds=5`.

    Example:
        ```python
        >>> replicas = ReplicaSet(["http://10.0.0.5:8000", "http://10.0.0.6:8000"], "s3://deltas/run1")
        >>> replicas.announce(report.version, report.delta, report.model_checksum)
        >>> behind = replicas.wait(report.version, timeout=60)
        >>> replicas.close()
        ```
    """

    def __init__(
        self,
        urls: Iterable[str],
        bucket: str,
        options: ReplicaOptions | None = None,
        *,
        adapter_name: str | None = None,
        **overrides: Any,
    ) -> None:
        UpdateInfo(bucket)  # fail here, not in every replica's thread, on an unusable bucket
        self.bucket = bucket
        self.adapter_name = adapter_name
        self.options = replace(options or ReplicaOptions(), **overrides)
        self.replicas = [Replica(url, self.options) for url in urls]
        if not self.replicas:
            raise ValueError("ReplicaSet needs at least one replica URL")
        self.states = {replica.url: ReplicaState(replica.url) for replica in self.replicas}
        # version -> (path of its delta or None, model checksum)
        self._published: dict[int, tuple[str | None, str]] = {}
        self._newest: int | None = None
        # url -> the version a replica last failed to reach
        self._failed_at: dict[str, int] = {}
        self._condition = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._follow, args=(replica,), name=f"delta-sync-replica-{i}", daemon=True)
            for i, replica in enumerate(self.replicas)
        ]
        for thread in self._threads:
            thread.start()

    def announce(self, version: int, delta: str | None, model_checksum: str) -> None:
        """A new version is fully stored in the bucket; replicas should move to it.

        Args:
            version: The version published.
            delta: Bucket path of its delta (against the version announced before), or None.
            model_checksum: The trainer's checksum of that version, which replicas must report.
        """
        with self._condition:
            self._published[version] = (delta, model_checksum)
            self._newest = version
            self._condition.notify_all()

    def wait(self, version: int, timeout: float | None = None) -> list[ReplicaState]:
        """Block until every replica serves `version` or later, or has failed since it was announced.

        Args:
            version: The version to wait for.
            timeout: Longest wait in seconds; None waits as long as replicas keep trying.

        Returns:
            The states of the replicas that did not reach `version` (failed or timed out).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while True:
                behind = [s for s in self.states.values() if s.version is None or s.version < version]
                if all(self._gave_up(state) for state in behind):
                    return behind
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return behind
                self._condition.wait(remaining)

    def _gave_up(self, state: ReplicaState) -> bool:
        # A replica that failed an older version retries the newest one: still pending.
        return state.error is not None and self._failed_at.get(state.url) == self._newest

    def close(self) -> None:
        """Stop every replica's thread (after its request in flight) and close the connections."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        for thread in self._threads:
            thread.join()
        for replica in self.replicas:
            replica.close()

    # -- each replica's thread ----------------------------------------------------------------

    def _follow(self, replica: Replica) -> None:
        state = self.states[replica.url]
        while (target := self._next_target(state)) is not None:
            started = time.perf_counter()
            try:
                if self.adapter_name is not None:
                    status = replica.load_adapter(self.bucket, self.adapter_name, version=target.version)
                else:
                    status = replica.update(self.bucket, target.filename, version=target.version)
                self._confirm(replica, status, target.version)
            except Exception as exc:
                self._failed(state, target.version, exc)
            else:
                self._reached(state, status, time.perf_counter() - started)

    def _next_target(self, state: ReplicaState) -> _Target | None:
        """Wait for a version newer than the replica's (None once closed), and pick its file."""
        with self._condition:
            # A replica that serves nothing yet is behind any version, 0 included (adapter
            # mode publishes the adapter as training starts as version 0).
            while not self._closed and (
                self._newest is None or (state.version is not None and state.version >= self._newest)
            ):
                self._condition.wait()
            if self._closed:
                return None
            assert self._newest is not None
            delta = self._published[self._newest][0]
            previous = max((v for v in self._published if v < self._newest), default=None)
            state.error = None  # a new attempt: wait() waits for it again
            # The delta alone suffices only from the version right before it.
            if state.version is not None and state.version == previous:
                return _Target(self._newest, delta)
            return _Target(self._newest, None)

    def _confirm(self, replica: Replica, status: ReplicaStatus | AdapterStatus, target: int) -> None:
        """The replica serves `target` or later, with the trainer's checksum of what it serves."""
        if status.version is None or status.version < target:
            raise ReplicaError(
                f"{replica.url}: serves version {status.version} after updating to {target}", url=replica.url
            )
        with self._condition:
            expected = self._published.get(status.version, (None, None))[1]
        if expected is not None and status.model_checksum != expected:
            raise ReplicaError(
                f"{replica.url}: serves version {status.version} with checksum {status.model_checksum}, "
                f"the trainer's is {expected}",
                url=replica.url,
            )

    def _reached(self, state: ReplicaState, status: ReplicaStatus | AdapterStatus, seconds: float) -> None:
        with self._condition:
            state.version = status.version
            state.model_checksum = status.model_checksum
            state.error = None
            state.seconds = seconds
            self._condition.notify_all()
        logger.info("delta-sync: replica %s serves version %s (%.2f s)", state.url, status.version, seconds)

    def _failed(self, state: ReplicaState, target: int, exc: Exception) -> None:
        # Our own errors say what happened; anything else is a bug worth a traceback.
        logger.error(
            "delta-sync: replica %s did not reach version %d: %s",
            state.url,
            target,
            exc,
            exc_info=not isinstance(exc, DeltaSyncError),
        )
        with self._condition:
            state.error = str(exc)
            state.version = None  # unknown: catch up next time
            self._failed_at[state.url] = target
            self._condition.notify_all()
            # Try again only once a newer version is announced.
            while not self._closed and self._newest == target:
                self._condition.wait()

"""Trainer-side control plane: tell vLLM replicas which file to apply.

The only message a replica gets is a small HTTP POST naming a file in the bucket; the
weights themselves travel through the bucket. [`Replica`] drives one server through the
routes of `delta_sync.control` (start, update, then finish with generation paused, then
the status of every worker); [`ReplicaSet`] keeps several replicas at the newest version.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from ..control import API_TOKEN_ENV, STATUS_METHOD, TOKEN_HEADER, ReplicaStatus, Route, UpdateInfo
from ..errors import DeltaSyncError, ReplicaError
from ..retry import RetryPolicy

__all__ = ["Replica", "ReplicaSet", "ReplicaState"]

logger = logging.getLogger("delta_sync")

#: HTTP answers that may go away by themselves (a busy or restarting server, a proxy timeout).
_TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})

_PAUSE_MODES = ("keep", "wait", "abort")

#: First and longest wait between looks at another client's open session, in seconds.
_SESSION_POLL_FIRST, _SESSION_POLL_MAX = 0.1, 2.0


def _is_transient(exc: BaseException) -> bool:
    """Whether a request to a replica may succeed if repeated: a connection or timeout
    failure, or HTTP 408, 429, 502, 503 or 504."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in _TRANSIENT_STATUS


def _retry_policy(retry_seconds: float) -> RetryPolicy:
    """The retries of a [`Replica`]: bounded by time alone, as `retry_seconds` always was;
    0 sends every request once."""
    if retry_seconds < 0:
        raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
    if retry_seconds == 0:
        return RetryPolicy(max_attempts=1)
    return RetryPolicy(max_seconds=retry_seconds, max_attempts=sys.maxsize, initial_wait=0.2, max_wait=5.0)


class Replica:
    """Drives one vLLM server's weight-update routes (see `delta_sync.control`).

    Args:
        url: Base URL of the server, e.g. `http://10.0.0.5:8000`.
        timeout: Seconds allowed for one request; [`Route.UPDATE`] downloads the file,
            so give large anchors time.
        retry_seconds: How long to keep retrying requests that fail transiently
            (connection errors, HTTP 408/429/502/503/504), with exponential backoff;
            0 disables retries.
        pause_mode: How [`Route.PAUSE`] treats requests in flight while tensors load:
            `"keep"` (hold them, then continue), `"wait"` (let them finish first),
            `"abort"`, or None to not pause.
        headers: Sent with every request, e.g. `{"Authorization": "Bearer hf_..."}` for a
            private Space.
        token: The server's weight-route token (`vllm_ext.auth`), sent as
            `X-Delta-Sync-Token`; default: `DELTA_SYNC_API_TOKEN`, if set.
        stale_session_seconds: vLLM allows one weight-update session at a time. When
            another client's session is open (a trainer pushing while `delta-sync follow`
            catches up), [`update`] waits for it to end, up to `timeout` seconds; only a
            session that stays open with no progress (the same status) for this long is
            taken for one left by a client that died, and finished. Keep it above the
            longest pause of a live client between its requests.

    Example:
        ```python
        >>> replica = Replica("http://127.0.0.1:8000")
        >>> replica.update("file:///data/deltas", "deltas/step_00000002.safetensors")
        ReplicaStatus(version=2, anchor_version=1, run_id='...', model_checksum='3f0c...', pending=0, updating=False)
        ```
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        retry_seconds: float = 30.0,
        pause_mode: str | None = "keep",
        headers: dict[str, str] | None = None,
        stale_session_seconds: float = 60.0,
        token: str | None = None,
    ) -> None:
        if pause_mode is not None and pause_mode not in _PAUSE_MODES:
            raise ValueError(f"pause_mode must be 'keep', 'wait', 'abort' or None, got {pause_mode!r}")
        if stale_session_seconds < 0:
            raise ValueError(f"stale_session_seconds must be >= 0, got {stale_session_seconds}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.stale_session_seconds = stale_session_seconds
        self.retry_seconds = retry_seconds
        self.retry = _retry_policy(retry_seconds)
        self.pause_mode = pause_mode
        token = os.environ.get(API_TOKEN_ENV) if token is None else token
        headers = {**({TOKEN_HEADER: token} if token else {}), **(headers or {})}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    # -- the update lifecycle ---------------------------------------------------------------

    def update(self, bucket: str, filename: str | None = None) -> ReplicaStatus:
        """Apply one file (or catch up to `latest.json` when `filename` is None) and confirm.

        Args:
            bucket: The bucket URL, as the replica resolves it.
            filename: Path of an anchor or delta inside the bucket.

        Returns:
            The replica's status afterwards (see [`status`]).

        Raises:
            ReplicaError: The replica refused the file or could not be reached. A refused
                file leaves the replica serving its previous weights.
        """
        self._start()
        self._post(Route.UPDATE, json={"update_info": UpdateInfo(bucket, filename).to_dict()})
        self._finish()
        return self.status()

    def _start(self) -> None:
        """Open a session; wait for another client's open session to end rather than end it."""
        session = _SessionWait(self.timeout, self.stale_session_seconds)
        while True:
            try:
                self._post(Route.START)
                return
            except ReplicaError as refused:
                if refused.status is None:
                    raise
                held = self._open_session()
                if held is None and session.first_refusal_without_session():
                    continue  # the session that refused us may have closed since: one more try
                if held is None:
                    raise
                if session.is_stale(held) and not session.expired():
                    self._finish_stale_session(session)
                    continue
                if session.expired():
                    raise ReplicaError(
                        f"{self.url}: another client's weight update is still open after "
                        f"{session.elapsed():.0f} s ({refused.server_message})",
                        url=self.url,
                        route=Route.START,
                        status=refused.status,
                        server_message=refused.server_message,
                    ) from refused
            session.pause()

    def _open_session(self) -> ReplicaStatus | None:
        """The server's status while a weight-update session is open on it, else None."""
        try:
            status = self.status()
        except ReplicaError as exc:
            logger.debug("delta-sync: %s: cannot read its status: %s", self.url, exc)
            return None
        return status if status.updating else None

    def _finish_stale_session(self, session: _SessionWait) -> None:
        # No client is driving it any more (it died between start and finish): finishing it
        # loads what it prepared, so the replica stays consistent, and frees the server.
        logger.warning(
            "delta-sync: %s had an open weight update with no progress for %.0f s; finishing it first",
            self.url,
            session.stalled(),
        )
        self._finish()
        session.restart()

    def _finish(self) -> None:
        """Load the new tensors, with generation paused only meanwhile."""
        paused = False
        try:
            if self.pause_mode is not None:
                self._post(Route.PAUSE, params={"mode": self.pause_mode})
                paused = True
            self._post(Route.FINISH)
            self._post(Route.RESET_PREFIX_CACHE)
        finally:
            if paused:
                self._post(Route.RESUME)

    def status(self) -> ReplicaStatus:
        """What the replica serves, checked to agree across its workers.

        Returns:
            The first worker's status; `updating` is True when any worker's session is open.

        Raises:
            ReplicaError: The replica could not be reached, a worker's answer is not a
                [`ReplicaStatus`] (is `vllm_ext` loaded?), or workers serve different
                weights.
        """
        answer = self._post(Route.COLLECTIVE_RPC, json={"method": STATUS_METHOD})
        statuses = self._parse_statuses(answer.get("results"))
        first = statuses[0]
        if any(status.served != first.served for status in statuses):
            served = [status.served for status in statuses]
            raise ReplicaError(
                f"{self.url}: workers disagree on (version, run_id, model_checksum): {served}",
                url=self.url,
                route=Route.COLLECTIVE_RPC,
            )
        return replace(first, updating=any(status.updating for status in statuses))

    def _parse_statuses(self, results: Any) -> list[ReplicaStatus]:
        try:
            if not isinstance(results, list) or not results:
                raise ValueError(f"expected one status per worker, got {results!r}")
            return [ReplicaStatus.from_dict(result) for result in results]
        except ValueError as exc:
            raise ReplicaError(
                f"{self.url}: {STATUS_METHOD} answered {exc}; is vllm_ext loaded?",
                url=self.url,
                route=Route.COLLECTIVE_RPC,
            ) from exc

    # -- one request --------------------------------------------------------------------------

    def _post(self, route: str, *, json: dict[str, Any] | None = None, params: dict[str, str] | None = None) -> dict:
        """POST to `route`, retrying transient failures; the answer's JSON object ({} if empty)."""

        def send() -> dict:
            response = self._http.post(route, json=json, params=params)
            response.raise_for_status()
            return response.json() if response.content else {}

        return self.retry.call(
            send,
            transient=_is_transient,
            what=f"{self.url}{route}",
            translate=lambda exc: self._error(route, exc),
            unavailable=lambda message: ReplicaError(f"replica unreachable: {message}", url=self.url, route=route),
        )

    def _error(self, route: str, exc: Exception) -> ReplicaError:
        """A permanent failure of one request, as a [`ReplicaError`] carrying its fields."""
        if isinstance(exc, httpx.HTTPStatusError):
            status = exc.response.status_code
            message = _server_message(exc.response)
            return ReplicaError(
                f"{self.url}{route}: HTTP {status}: {message}",
                url=self.url,
                route=route,
                status=status,
                server_message=message,
            )
        return ReplicaError(f"{self.url}{route}: {type(exc).__name__}: {exc}", url=self.url, route=route)


def _server_message(response: httpx.Response) -> str:
    """The error message of a vLLM answer: `{"error": {"message": ...}}` from its exception
    handlers, `{"error": "..."}` from `/pause` and `/resume`, FastAPI's `{"detail": ...}`."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
    return response.text[:500]


class _SessionWait:
    """How long [`Replica._start`] has waited for another client's session, and whether that
    session still makes progress.

    Args:
        limit: Longest wait in all, in seconds.
        stale_after: Seconds an open session may show the same status before it counts as
            left behind by a client that died.
    """

    def __init__(self, limit: float, stale_after: float) -> None:
        self.limit, self.stale_after = limit, stale_after
        self.started = time.monotonic()
        self._seen: ReplicaStatus | None = None
        self._seen_at = self.started
        self._wait = _SESSION_POLL_FIRST
        self._refused_without_session = False

    def first_refusal_without_session(self) -> bool:
        """True the first time START is refused with no session open, False after that."""
        first, self._refused_without_session = not self._refused_without_session, True
        return first

    def is_stale(self, status: ReplicaStatus) -> bool:
        """Record what the open session looks like now; True once it has not changed for `stale_after`."""
        if status != self._seen:
            self._seen, self._seen_at = status, time.monotonic()
        return self.stalled() >= self.stale_after

    def stalled(self) -> float:
        """Seconds the open session has shown the same status."""
        return time.monotonic() - self._seen_at

    def restart(self) -> None:
        """A stale session was finished: the next one seen is judged afresh."""
        self._seen = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        return self.elapsed() >= self.limit

    def pause(self) -> None:
        """Wait before the next look, longer each time, never past the limit."""
        time.sleep(max(0.0, min(self._wait, self.limit - self.elapsed())))
        self._wait = min(self._wait * 2, _SESSION_POLL_MAX)


# -- several replicas ---------------------------------------------------------------------------


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
        **replica_options: Passed to each [`Replica`] (`timeout`, `retry_seconds`,
            `pause_mode`, `headers`).

    Example:
        ```python
        >>> replicas = ReplicaSet(["http://10.0.0.5:8000", "http://10.0.0.6:8000"], "s3://deltas/run1")
        >>> replicas.announce(report.version, report.delta, report.model_checksum)
        >>> behind = replicas.wait(report.version, timeout=60)
        >>> replicas.close()
        ```
    """

    def __init__(self, urls: Iterable[str], bucket: str, **replica_options: Any) -> None:
        UpdateInfo(bucket)  # fail here, not in every replica's thread, on an unusable bucket
        self.bucket = bucket
        self.replicas = [Replica(url, **replica_options) for url in urls]
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
                status = replica.update(self.bucket, target.filename)
                self._confirm(replica, status, target.version)
            except Exception as exc:
                self._failed(state, target.version, exc)
            else:
                self._reached(state, status, time.perf_counter() - started)

    def _next_target(self, state: ReplicaState) -> _Target | None:
        """Wait for a version newer than the replica's (None once closed), and pick its file."""
        with self._condition:
            while not self._closed and (self._newest is None or (state.version or 0) >= self._newest):
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

    def _confirm(self, replica: Replica, status: ReplicaStatus, target: int) -> None:
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

    def _reached(self, state: ReplicaState, status: ReplicaStatus, seconds: float) -> None:
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

"""The HTTP client of the control plane: [`Replica`] drives one vLLM server's weight-update
routes (start, update, then finish with generation paused, then the status of every worker),
as its [`ReplicaOptions`] say.

The trainer's `ReplicaSet` and `delta-sync follow` both drive servers through it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, TypeVar

import httpx

from ..errors import ReplicaError
from ..layout import parse_step_path
from ..retry import RetryPolicy
from . import (
    API_TOKEN_ENV,
    FETCH_ADAPTER_METHOD,
    LOAD_LORA_ROUTE,
    MODELS_ROUTE,
    PREFETCH_METHOD,
    STATUS_METHOD,
    TOKEN_HEADER,
    AdapterStatus,
    ReplicaStatus,
    Route,
    UpdateInfo,
)

__all__ = ["PauseMode", "Replica", "ReplicaOptions"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP answers that may go away by themselves (a busy or restarting server, a proxy timeout).
_TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})

#: First and longest wait between looks at another client's open session, in seconds.
_SESSION_POLL_FIRST, _SESSION_POLL_MAX = 0.1, 2.0

#: First and longest wait between looks at a version being prepared, in seconds.
_PREPARE_POLL_FIRST, _PREPARE_POLL_MAX = 0.02, 0.5


def _is_transient(exc: BaseException) -> bool:
    """Whether a request to a replica may succeed if repeated: a connection or timeout
    failure, or HTTP 408, 429, 502, 503 or 504."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in _TRANSIENT_STATUS


class PauseMode(str, Enum):
    """How [`Route.PAUSE`] treats requests in flight while tensors load (vLLM's `/pause` modes).

    A `str`, so that it compares equal to (and is sent as) its value.
    """

    #: Hold them, then continue.
    KEEP = "keep"
    #: Let them finish first.
    WAIT = "wait"
    #: Abort them.
    ABORT = "abort"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class ReplicaOptions:
    """How a [`Replica`] talks to its server; checked once, when made.

    Args:
        timeout: Seconds allowed for one request (> 0); [`Route.UPDATE`] downloads the
            file, so give large anchors time.
        retry_seconds: How long to keep retrying requests that fail transiently
            (connection errors, HTTP 408/429/502/503/504), with exponential backoff;
            0 disables retries.
        pause_mode: How [`Route.PAUSE`] treats requests in flight while tensors load (a
            [`PauseMode`] or its value: `"keep"`, `"wait"`, `"abort"`), or None to not pause.
        headers: Sent with every request, e.g. `{"Authorization": "Bearer hf_..."}` for a
            private Space.
        token: The server's weight-route token (`vllm_ext.auth`), sent as
            `X-Delta-Sync-Token`; default: `DELTA_SYNC_API_TOKEN`, if set.
        stale_session_seconds: vLLM allows one weight-update session at a time. When
            another client's session is open (a trainer pushing while `delta-sync follow`
            catches up), [`Replica.update`] waits for it to end, up to `timeout` seconds;
            only a session that stays open with no progress (the same status) for this long
            is taken for one left by a client that died, and finished. Keep it above the
            longest pause of a live client between its requests.
        prepare_timeout: Before an update of a known version, how long to wait for the
            server to report it prepared (downloaded, verified and applied to its snapshot
            on the server's prefetch thread, while it keeps generating); past it, the update
            goes ahead and the server prepares inline. 0 does not wait.

    Raises:
        ValueError: An option is out of range; the message names it.
    """

    timeout: float = 600.0
    retry_seconds: float = 30.0
    pause_mode: PauseMode | None = PauseMode.KEEP
    headers: Mapping[str, str] | None = None
    token: str | None = None
    stale_session_seconds: float = 60.0
    prepare_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.retry_seconds < 0:
            raise ValueError(f"retry_seconds must be >= 0, got {self.retry_seconds}")
        if self.stale_session_seconds < 0:
            raise ValueError(f"stale_session_seconds must be >= 0, got {self.stale_session_seconds}")
        if self.prepare_timeout < 0:
            raise ValueError(f"prepare_timeout must be >= 0, got {self.prepare_timeout}")
        if self.pause_mode is not None:
            try:
                object.__setattr__(self, "pause_mode", PauseMode(self.pause_mode))
            except ValueError:
                raise ValueError(
                    f"pause_mode must be 'keep', 'wait', 'abort' or None, got {self.pause_mode!r}"
                ) from None

    def request_headers(self) -> dict[str, str]:
        """The headers of every request: the token as `X-Delta-Sync-Token` (`token`, else
        `$DELTA_SYNC_API_TOKEN`, if set), then `headers`, which win over it."""
        token = os.environ.get(API_TOKEN_ENV) if self.token is None else self.token
        return {**({TOKEN_HEADER: token} if token else {}), **(self.headers or {})}


def _retry_policy(retry_seconds: float) -> RetryPolicy:
    """The retries of a [`Replica`]: bounded by time alone, as `retry_seconds` always was;
    0 sends every request once."""
    if retry_seconds == 0:
        return RetryPolicy(max_attempts=1)
    return RetryPolicy(max_seconds=retry_seconds, max_attempts=sys.maxsize, initial_wait=0.2, max_wait=5.0)


class Replica:
    """Drives one vLLM server's weight-update routes (see `delta_sync.control`).

    Args:
        url: Base URL of the server, e.g. `http://10.0.0.5:8000`.
        options: A [`ReplicaOptions`] (default: its defaults).
        **overrides: Fields of [`ReplicaOptions`] to set on top of `options`, e.g.
            `timeout=60`.

    Example:
        ```python
        >>> replica = Replica("http://127.0.0.1:8000")
        >>> replica.update("file:///data/deltas", "deltas/step_00000002.safetensors")
        ReplicaStatus(version=2, anchor_version=1, run_id='...', model_checksum='3f0c...', pending=0, updating=False)
        ```
    """

    def __init__(self, url: str, options: ReplicaOptions | None = None, **overrides: Any) -> None:
        self.options = options = replace(options or ReplicaOptions(), **overrides)
        self.url = url.rstrip("/")
        self.timeout = options.timeout
        self.stale_session_seconds = options.stale_session_seconds
        self.retry_seconds = options.retry_seconds
        self.retry = _retry_policy(options.retry_seconds)
        self.pause_mode = options.pause_mode
        self._http = httpx.Client(base_url=self.url, timeout=options.timeout, headers=options.request_headers())

    def close(self) -> None:
        self._http.close()

    # -- the update lifecycle ---------------------------------------------------------------

    def update(self, bucket: str, filename: str | None = None, *, version: int | None = None) -> ReplicaStatus:
        """Apply one file (or catch up to `latest.json` when `filename` is None) and confirm.

        When the version is known (from `filename`, or `version` for a catch-up), the server
        is first asked to prepare it off its engine loop, and the update waits (up to
        `prepare_timeout`) until it is ([`prepare`]); the finish then names it as vLLM's
        weight version (`/weight_info`, and each completion's metadata).

        Args:
            bucket: The bucket URL, as the replica resolves it.
            filename: Path of an anchor or delta inside the bucket.
            version: The version a catch-up reaches (`latest.json`'s), when known.

        Returns:
            The replica's status afterwards (see [`status`]).

        Raises:
            ReplicaError: The replica refused the file or could not be reached. A refused
                file leaves the replica serving its previous weights.
        """
        step = None if filename is None else parse_step_path(filename)
        target = step[1] if step is not None else version
        if target is not None:
            self.prepare(bucket, target)
        self._start()
        self._post(Route.UPDATE, json={"update_info": UpdateInfo(bucket, filename).to_dict()})
        self._finish(None if target is None else str(target))
        return self.status()

    def prepare(self, bucket: str, version: int, *, timeout: float | None = None) -> ReplicaStatus | None:
        """Ask the server to prepare `version` of `bucket` now (a hint its prefetch thread
        acts on while the server keeps generating), and wait until every worker reports it
        prepared, or has passed it.

        Args:
            bucket: The bucket URL, as the replica resolves it.
            version: The version to prepare.
            timeout: Seconds to wait at most; default `prepare_timeout`.

        Returns:
            The status once prepared; None when the server does not prepare ahead (no
            prefetch thread: `DELTA_SYNC_PREFETCH=off`, a private snapshot, or a server
            without `delta_sync_prefetch`) or did not within `timeout` (then the update
            prepares inline, as it always may).
        """
        limit = self.options.prepare_timeout if timeout is None else timeout
        if limit == 0:
            return None
        try:
            answer = self._post(Route.COLLECTIVE_RPC, json={"method": PREFETCH_METHOD, "kwargs": {"bucket": bucket}})
            results = answer.get("results")
            prefetching = isinstance(results, list) and all(
                isinstance(result, dict) and result.get("prefetching") is True for result in results
            )
        except ReplicaError as exc:
            logger.debug("delta-sync: %s does not prepare versions ahead: %s", self.url, exc)
            return None
        if not prefetching:
            return None
        deadline, wait = time.monotonic() + limit, _PREPARE_POLL_FIRST
        while True:
            statuses = self._parse_statuses(
                self._post(Route.COLLECTIVE_RPC, json={"method": STATUS_METHOD}).get("results")
            )
            if all((s.prepared_version or 0) >= version or (s.version or 0) >= version for s in statuses):
                return statuses[0]
            if time.monotonic() + wait > deadline:
                logger.info(
                    "delta-sync: %s has not prepared version %d after %.0f s; it prepares inline",
                    self.url,
                    version,
                    limit,
                )
                return None
            time.sleep(wait)
            wait = min(2 * wait, _PREPARE_POLL_MAX)

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

    def _finish(self, weight_version: str | None = None) -> None:
        """Load the new tensors, with generation paused only meanwhile; `weight_version`
        becomes vLLM's weight version."""
        paused = False
        try:
            if self.pause_mode is not None:
                self._post(Route.PAUSE, params={"mode": self.pause_mode.value})
                paused = True
            self._post(Route.FINISH, json=None if weight_version is None else {"weight_version": weight_version})
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
        return self._parse_results(results, STATUS_METHOD, ReplicaStatus.from_dict)

    def _parse_results(self, results: Any, method: str, parse: Callable[[Any], T]) -> list[T]:
        """Each worker's answer to a `/collective_rpc` of `method`, parsed by `parse`."""
        try:
            if not isinstance(results, list) or not results:
                raise ValueError(f"expected one answer per worker, got {results!r}")
            return [parse(result) for result in results]
        except ValueError as exc:
            raise ReplicaError(
                f"{self.url}: {method} answered {exc}; is vllm_ext loaded?",
                url=self.url,
                route=Route.COLLECTIVE_RPC,
            ) from exc

    # -- adapter mode -------------------------------------------------------------------------

    def load_adapter(self, bucket: str, name: str, *, version: int | None = None) -> AdapterStatus:
        """Serve an adapter version (adapter mode) under `name`: every worker fetches and
        checks it ([`FETCH_ADAPTER_METHOD`]), then vLLM loads it in place of the adapter
        `name` served before (`/v1/load_lora_adapter` with `load_inplace`). Requests that
        name `name` as their `model` use it from then on.

        The server must run with `--enable-lora --max-lora-rank R` (R at least the
        adapter's rank) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.

        Args:
            bucket: The bucket URL, as the replica resolves it.
            name: The adapter's name on the server (vLLM's `lora_name`).
            version: The version; None: the one `latest.json` names.

        Returns:
            The version loaded and its local directory.

        Raises:
            ReplicaError: The replica refused the adapter (the message says why), could
                not be reached, or its workers fetched different versions.
        """
        answer = self._post(
            Route.COLLECTIVE_RPC,
            json={"method": FETCH_ADAPTER_METHOD, "kwargs": {"bucket": bucket, "version": version}},
        )
        fetched = self._parse_results(answer.get("results"), FETCH_ADAPTER_METHOD, AdapterStatus.from_dict)
        first = fetched[0]
        if any(status != first for status in fetched):
            raise ReplicaError(
                f"{self.url}: workers fetched different adapter versions: {[s.to_dict() for s in fetched]}",
                url=self.url,
                route=Route.COLLECTIVE_RPC,
            )
        self._post(
            LOAD_LORA_ROUTE,
            json={"lora_name": name, "lora_path": first.path, "load_inplace": True},
            expect_json=False,
        )
        return first

    def adapter_status(self, name: str) -> AdapterStatus | None:
        """The adapter the server serves under `name` (from vLLM's `/v1/models`), as far as
        its path tells (no `model_checksum`); None when it serves none by that name, or one
        that was not fetched from a bucket.

        Raises:
            ReplicaError: The replica could not be reached.
        """
        listing = self._post(MODELS_ROUTE, method="GET")
        for card in listing.get("data") or []:
            if isinstance(card, dict) and card.get("id") == name and isinstance(card.get("root"), str):
                return _loaded_adapter(card["root"])
        return None

    # -- one request --------------------------------------------------------------------------

    def _post(
        self,
        route: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        expect_json: bool = True,
        method: str = "POST",
    ) -> dict:
        """POST (or `method`) to `route`, retrying transient failures; the answer's JSON
        object ({} if empty, or when not `expect_json`: vLLM's adapter routes answer plain text)."""

        def send() -> dict:
            response = self._http.request(method, route, json=json, params=params)
            response.raise_for_status()
            return response.json() if response.content and expect_json else {}

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


def _loaded_adapter(path: str) -> AdapterStatus | None:
    """What a loaded adapter's directory says of its version (see `AdapterStatus.local_name`)."""
    parts = path.rstrip("/").split("/")
    if len(parts) < 3 or not parts[-1].startswith("step_") or not parts[-1][5:].isdigit():
        return None
    return AdapterStatus(int(parts[-1][5:]), parts[-3], "" if parts[-2] == "_" else parts[-2], path)


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

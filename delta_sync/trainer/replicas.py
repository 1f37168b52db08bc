"""Trainer-side control plane: tell vLLM replicas which file to apply.

The only message a replica gets is a small HTTP POST naming a file in the bucket; the
weights themselves travel through the bucket. Each replica is driven through vLLM's
dev-mode endpoints (`VLLM_SERVER_DEV_MODE=1`):

1. `/start_weight_update`, `/update_weights` with `update_info = {"bucket", "filename"}`:
   the replica downloads and verifies the file while it keeps generating;
2. `/pause?mode=keep`, `/finish_weight_update`, `/reset_prefix_cache`, `/resume`:
   generation stops only while the new tensors are loaded;
3. `/collective_rpc` `delta_sync_status`: every worker reports its version and model
   checksum, which must equal the trainer's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from ..errors import DeltaSyncError, ReplicaError

__all__ = ["Replica", "ReplicaSet", "ReplicaState"]

logger = logging.getLogger("delta_sync")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (408, 429, 502, 503, 504)


class Replica:
    """Drives one vLLM server's weight-update endpoints.

    Args:
        url: Base URL of the server, e.g. `http://10.0.0.5:8000`.
        timeout: Seconds allowed for one request; `/update_weights` downloads the file,
            so give large anchors time.
        retry_seconds: How long to keep retrying requests that fail transiently
            (connection errors, 408/429/502/503/504), with exponential backoff.
        pause_mode: How `/pause` treats requests in flight while tensors load: `"keep"`
            (hold them, then continue), `"wait"` (let them finish first), `"abort"`, or
            None to not pause.
        headers: Sent with every request, e.g. `{"Authorization": "Bearer hf_..."}` for a
            private Space.

    Example:
        ```python
        >>> replica = Replica("http://127.0.0.1:8000")
        >>> replica.update("file:///data/deltas", "deltas/step_00000002.safetensors")
        {'version': 2, 'model_checksum': '3f0c...', ...}
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
    ) -> None:
        if pause_mode not in ("keep", "wait", "abort", None):
            raise ValueError(f"pause_mode must be 'keep', 'wait', 'abort' or None, got {pause_mode!r}")
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.pause_mode = pause_mode
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def _post(self, route: str, *, json: dict | None = None, params: dict | None = None) -> dict:
        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_delay(self.retry_seconds),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    response = self._http.post(route, json=json, params=params)
                    response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise ReplicaError(
                f"{self.url}{route}: HTTP {exc.response.status_code}: {_error_message(exc.response)}"
            ) from exc
        except httpx.TransportError as exc:
            raise ReplicaError(f"{self.url}{route}: unreachable after {self.retry_seconds:.0f} s: {exc}") from exc
        return response.json() if response.content else {}

    def update(self, bucket: str, filename: str | None = None) -> dict:
        """Apply one file (or catch up to `latest.json` when `filename` is None) and confirm.

        Returns:
            The replica's status afterwards (see [`status`]).

        Raises:
            ReplicaError: The replica refused the file or could not be reached. A refused
                file leaves the replica serving its previous weights.
        """
        self._start()
        update_info = {"bucket": bucket} if filename is None else {"bucket": bucket, "filename": filename}
        self._post("/update_weights", json={"update_info": update_info})
        paused = False
        try:
            if self.pause_mode is not None:
                self._post("/pause", params={"mode": self.pause_mode})
                paused = True
            self._post("/finish_weight_update")
            self._post("/reset_prefix_cache")
        finally:
            if paused:
                self._post("/resume")
        return self.status()

    def _start(self) -> None:
        try:
            self._post("/start_weight_update")
        except ReplicaError as exc:
            if "already" not in str(exc):
                raise
            # A session left open by an interrupted update: close it, then start afresh.
            logger.warning("delta-sync: %s had an open weight update; finishing it first", self.url)
            self._post("/finish_weight_update")
            self._post("/start_weight_update")

    def status(self) -> dict:
        """Version and model checksum the replica serves, checked to agree across its workers.

        Returns:
            `{"version", "anchor_version", "run_id", "model_checksum", "pending"}`.
        """
        results = self._post("/collective_rpc", json={"method": "delta_sync_status"}).get("results") or []
        if not results or not all(isinstance(r, dict) for r in results):
            raise ReplicaError(f"{self.url}: delta_sync_status returned {results!r}; is vllm_ext loaded?")
        keys = ("version", "run_id", "model_checksum")
        if any(tuple(r.get(k) for k in keys) != tuple(results[0].get(k) for k in keys) for r in results):
            raise ReplicaError(f"{self.url}: workers disagree: {results}")
        return results[0]


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


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
        **replica_options: Passed to each [`Replica`].
    """

    def __init__(self, urls: Iterable[str], bucket: str, **replica_options) -> None:
        self.bucket = bucket
        self.replicas = [Replica(url, **replica_options) for url in urls]
        if not self.replicas:
            raise ValueError("ReplicaSet needs at least one replica URL")
        self.states = {replica.url: ReplicaState(replica.url) for replica in self.replicas}
        # version -> (path of its delta or None, model checksum)
        self._published: dict[int, tuple[str | None, str]] = {}
        self._newest: int | None = None
        self._condition = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._follow, args=(replica,), name=f"delta-sync-replica-{i}", daemon=True)
            for i, replica in enumerate(self.replicas)
        ]
        for thread in self._threads:
            thread.start()

    def announce(self, version: int, delta: str | None, model_checksum: str) -> None:
        """A new version is fully stored in the bucket; replicas should move to it."""
        with self._condition:
            self._published[version] = (delta, model_checksum)
            self._newest = version
            self._condition.notify_all()

    def wait(self, version: int, timeout: float | None = None) -> list[ReplicaState]:
        """Block until every replica serves `version` or later, or has failed since it was announced.

        Returns:
            The states of the replicas that did not reach `version` (failed or timed out).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while True:
                behind = [s for s in self.states.values() if s.version is None or s.version < version]
                pending = [s for s in behind if s.error is None]
                if not pending:
                    return behind
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return behind
                self._condition.wait(remaining)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        for thread in self._threads:
            thread.join()
        for replica in self.replicas:
            replica.close()

    def _follow(self, replica: Replica) -> None:
        state = self.states[replica.url]
        while True:
            with self._condition:
                while not self._closed and (self._newest is None or (state.version or 0) >= self._newest):
                    self._condition.wait()
                if self._closed:
                    return
                target = self._newest
                delta, checksum = self._published[target]
                previous = max((v for v in self._published if v < target), default=None)
                # The delta alone suffices only from the version right before it.
                filename = delta if state.version is not None and state.version == previous else None
                state.error = None  # a new attempt: wait() waits for it again
            started = time.perf_counter()
            try:
                status = replica.update(self.bucket, filename)
                if status.get("version") is None or status["version"] < target:
                    raise ReplicaError(
                        f"{replica.url}: serves version {status.get('version')} after updating to {target}"
                    )
                expected = self._published.get(status["version"], (None, None))[1]
                if expected is not None and status.get("model_checksum") != expected:
                    raise ReplicaError(
                        f"{replica.url}: serves version {status['version']} with checksum "
                        f"{status.get('model_checksum')}, the trainer's is {expected}"
                    )
            except DeltaSyncError as exc:
                logger.error("delta-sync: replica %s did not reach version %d: %s", replica.url, target, exc)
                with self._condition:
                    state.error = str(exc)
                    state.version = None  # unknown: catch up next time
                    self._condition.notify_all()
                    # Try again only once a newer version is announced.
                    while not self._closed and self._newest == target:
                        self._condition.wait()
                continue
            with self._condition:
                state.version = status["version"]
                state.model_checksum = status.get("model_checksum")
                state.error = None
                state.seconds = time.perf_counter() - started
                self._condition.notify_all()
            logger.info("delta-sync: replica %s serves version %d (%.2f s)", replica.url, state.version, state.seconds)

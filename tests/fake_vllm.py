"""A test double for a vLLM server's weight-update routes.

A real `vllm serve` takes about a minute to start, so the unit tests of the trainer's
control plane (`delta_sync.control.client`, `delta_sync.trainer.replicas`) talk to this small stdlib HTTP server
instead. It answers the routes of `delta_sync.control.Route` as vLLM 0.32 does with
`VLLM_SERVER_DEV_MODE=1` and the `delta` weight-transfer engine:

    POST /start_weight_update     {"message": ...}; 500 if a session is already open
    POST /update_weights          {"update_info": {...}}: a real `delta_sync.Receiver` applies
                                  the file; 500 without a session or when the receiver refuses
                                  it, 400 for a malformed update_info (both close the session)
    POST /finish_weight_update    {"message": ...}; 500 without a session
    POST /pause?mode=keep|wait|abort, /resume, /reset_prefix_cache
    POST /collective_rpc          {"method": STATUS_METHOD} -> {"results": [status per worker]}

Errors have vLLM's shape, `{"error": {"message", "type", "param", "code"}}` with that
HTTP status (a RuntimeError of an engine is a 500). The status every worker
reports is genuine: version, anchor, run id and model checksum come from the receiver,
`updating` from the session flag. Tests inject failures: [`FakeVLLM.add_fault`] (e.g. two
503s on `/update_weights`, or a 500 with a message), [`FakeVLLM.set_worker_status`] (workers
that disagree), [`FakeVLLM.open_session`] (an update interrupted between start and finish),
and [`FakeVLLM.stop`] (a dead server). [`FakeVLLM.calls`] logs every request answered.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from delta_sync import Receiver
from delta_sync.control import PREFETCH_METHOD, STATUS_METHOD, ReplicaStatus, Route, UpdateInfo
from delta_sync.errors import DeltaSyncError
from delta_sync.storage.cache import DownloadCache

from helpers import LoopbackHTTPServer

PAUSE_MODES = ("abort", "wait", "keep")


class _HttpError(Exception):
    """An error answer in vLLM's shape; `type` is vLLM's error type for the status."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, HTTPStatus(self.status).phrase)
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.status}}


@dataclass
class Fault:
    """Answer the next `remaining` requests to `route` (None: all of them) with `status`."""

    route: str
    status: int
    remaining: int | None
    message: str
    hits: int = 0


@dataclass(frozen=True)
class Call:
    """One request the server answered."""

    route: str
    params: dict[str, str]
    body: Any
    status: int


class FakeVLLM(LoopbackHTTPServer):
    """The fake vLLM server, on 127.0.0.1 on a free port, from a thread of this process.

    Args:
        workers: How many workers answer `/collective_rpc` (tensor-parallel ranks).
        allowed_buckets: The receiver's allow list; None trusts any bucket.

    Example:
        ```python
        >>> with FakeVLLM() as server:
        ...     server.add_fault(Route.UPDATE, 503, count=2)
        ...     Replica(server.url).update(bucket_url, "deltas/step_00000002.safetensors")
        ```
    """

    def __init__(self, *, workers: int = 1, allowed_buckets: list[str] | None = None) -> None:
        self.workers = workers
        self._cache_dir = tempfile.mkdtemp(prefix="fake-vllm-")
        # No model behind it: the receiver's snapshot is what this server "serves".
        self.receiver = Receiver(
            load_weights=None, allowed_buckets=allowed_buckets, cache=DownloadCache(self._cache_dir)
        )
        self.lock = threading.RLock()
        self.updating = False
        self.paused = False
        self.faults: list[Fault] = []
        self.calls: list[Call] = []
        self._worker_fields: dict[int, dict[str, Any]] = {}

    # -- lifecycle (start, stop, url: LoopbackHTTPServer) -------------------------------------

    thread_name = "fake-vllm"
    poll_interval = 0.05

    def handler(self) -> type[_Handler]:
        server = self

        class Handler(_Handler):
            fake = server

        return Handler

    def cleanup(self) -> None:
        shutil.rmtree(self._cache_dir, ignore_errors=True)

    # -- test controls ------------------------------------------------------------------------

    def add_fault(self, route: str, status: int = 503, count: int | None = 1, *, message: str | None = None) -> Fault:
        """Answer the next `count` requests to `route` (None: all) with HTTP `status`,
        before the route does anything.

        Args:
            route: A [`Route`] member.
            status: The HTTP status, e.g. 503 (transient) or 500 (an engine's RuntimeError).
            message: The error message; a default names the fault.
        """
        fault = Fault(route, status, count, message or f"injected fault {status}")
        with self.lock:
            self.faults.append(fault)
        return fault

    def set_worker_status(self, worker: int, **fields: Any) -> None:
        """Make worker `worker` report `fields` instead of the receiver's values."""
        with self.lock:
            self._worker_fields.setdefault(worker, {}).update(fields)

    def open_session(self) -> None:
        """Leave a weight-update session open, as a trainer that died after START would."""
        with self.lock:
            self.updating = True

    def routes(self) -> list[str]:
        """The routes called so far, in order, less the prefetch hints ([`hints`])."""
        with self.lock:
            return [call.route for call in self.calls if not _is_hint(call)]

    def hints(self) -> list[dict[str, Any]]:
        """The kwargs of every prefetch hint (`/collective_rpc` `PREFETCH_METHOD`) received."""
        with self.lock:
            return [call.body.get("kwargs", {}) for call in self.calls if _is_hint(call)]

    def update_infos(self) -> list[dict[str, Any]]:
        """The `update_info` of every `/update_weights` request answered with 200."""
        with self.lock:
            return [
                call.body["update_info"] for call in self.calls if call.route == Route.UPDATE and call.status == 200
            ]

    def worker_statuses(self) -> list[dict[str, Any]]:
        """What `/collective_rpc` [`STATUS_METHOD`] answers: one status per worker."""
        served = self.receiver.serving  # as the real worker reports: what the model holds
        # pending=0: nothing to load, the snapshot is the served model
        genuine = ReplicaStatus.of(
            served, updating=self.updating, prepared_version=self.receiver.prepared_version
        ).to_dict()
        return [{**genuine, **self._worker_fields.get(i, {})} for i in range(self.workers)]

    # -- routes (called with the lock held, like vLLM's single engine core) -------------------

    def start_weight_update(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        if self.updating:
            raise _HttpError(
                500,
                "start_weight_update called while a weight update is already active. Call finish_weight_update first.",
            )
        self.updating = True
        return {"message": "Weight update started"}

    def update_weights(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        if not isinstance(body, dict) or "update_info" not in body:
            raise _HttpError(
                400, "1 validation error:\n  {'type': 'missing', 'loc': 'body.update_info', 'msg': 'Field required'}"
            )
        if not self.updating:
            raise _HttpError(500, "start_weight_update must be called before update_weights.")
        try:
            info = UpdateInfo.from_dict(body["update_info"])
            self.receiver.update(info.bucket, info.filename)
        except ValueError as exc:
            self.updating = False  # vLLM's worker closes the session on any failed update
            raise _HttpError(400, str(exc)) from exc
        except DeltaSyncError as exc:
            self.updating = False
            raise _HttpError(500, f"delta-sync refused the update: {type(exc).__name__}: {exc}") from exc
        return {"message": "Weights updated"}

    def finish_weight_update(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        if not self.updating:
            raise _HttpError(500, "finish_weight_update called without a matching start_weight_update.")
        self.updating = False
        return {"message": "Weight update finished"}

    def pause(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        mode = params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise _HttpError(
                400, f"1 validation error:\n  {{'type': 'literal_error', 'loc': 'query.mode', 'input': {mode!r}}}"
            )
        self.paused = True
        return {"status": "paused"}

    def resume(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        self.paused = False
        return {"status": "resumed"}

    def reset_prefix_cache(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        return {"success": True}

    def collective_rpc(self, body: Any, params: dict[str, str]) -> dict[str, Any]:
        if not isinstance(body, dict) or body.get("method") is None:
            raise _HttpError(400, "Missing 'method' in request body")
        if body["method"] == PREFETCH_METHOD:
            # Its snapshot is its model's own: it prepares nothing ahead, as a real worker with
            # a private snapshot answers.
            return {"results": [{"prefetching": False, **status} for status in self.worker_statuses()]}
        if body["method"] != STATUS_METHOD:
            raise _HttpError(500, f"'Worker' object has no attribute '{body['method']}'")
        return {"results": self.worker_statuses()}

    ROUTES = {
        Route.START: start_weight_update,
        Route.UPDATE: update_weights,
        Route.FINISH: finish_weight_update,
        Route.PAUSE: pause,
        Route.RESUME: resume,
        Route.RESET_PREFIX_CACHE: reset_prefix_cache,
        Route.COLLECTIVE_RPC: collective_rpc,
    }

    def handle(self, route: str, params: dict[str, str], body: Any) -> tuple[int, dict[str, Any]]:
        """Answer one POST: (HTTP status, JSON body), logged in [`calls`]."""
        with self.lock:
            try:
                fault = self._fault_for(route)
                if fault is not None:
                    raise _HttpError(fault.status, fault.message)
                handler = self.ROUTES.get(route)
                if handler is None:
                    raise _HttpError(404, "Not Found")
                status, answer = 200, handler(self, body, params)
            except _HttpError as exc:
                status, answer = exc.status, exc.body()
            self.calls.append(Call(route, params, body, status))
            return status, answer

    def _fault_for(self, route: str) -> Fault | None:
        for fault in self.faults:
            if fault.route == route and (fault.remaining is None or fault.remaining > 0):
                if fault.remaining is not None:
                    fault.remaining -= 1
                fault.hits += 1
                return fault
        return None


class _Handler(BaseHTTPRequestHandler):
    fake: FakeVLLM

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean

    def do_POST(self) -> None:
        split = urlsplit(self.path)
        params = {key: values[-1] for key, values in parse_qs(split.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(400, _HttpError(400, "Invalid JSON format").body())
        status, answer = self.fake.handle(split.path, params, body)
        self._send(status, answer)

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _is_hint(call: Any) -> bool:
    return (
        call.route == Route.COLLECTIVE_RPC
        and isinstance(call.body, dict)
        and call.body.get("method") == PREFETCH_METHOD
    )

"""A test double for the Hugging Face Hub's Storage Bucket API.

Hugging Face Buckets cannot be reached from CI, so the tests run the real
huggingface_hub + hf_xet client code against this small stdlib HTTP server instead. It
answers the routes huggingface_hub's bucket API calls, and hands out Xet tokens whose
storage endpoint is a `local://DIR` store, so hf_xet moves the bytes for real:

    POST   /api/buckets/{ns}/{name}                   create (409 if it exists)
    GET    /api/buckets/{ns}/{name}                   bucket info
    DELETE /api/buckets/{ns}/{name}                   delete the bucket
    GET    /api/buckets/{ns}/{name}/tree[/{prefix}]   list files (?recursive=true, paginated)
    POST   /api/buckets/{ns}/{name}/paths-info        {"paths": [...]} -> entries of the files that exist
    POST   /api/buckets/{ns}/{name}/batch             ndjson addFile / copyFile / deleteFile
    GET    /api/buckets/{ns}/{name}/xet-{read,write}-token
    HEAD   /buckets/{ns}/{name}/resolve/{path}        Xet hash, size and token refresh route
    GET    /api/whoami-v2

Requests need `Authorization: Bearer <token>` when the server has a token. Tests inject
failures with [`HubServer.add_fault`] (e.g. two 429s on `/batch`) and read what the
client sent in [`HubServer.requests`].

The `local://` store is a database that one process at a time may open for writing
("Database already open. Cannot acquire lock"). The server never opens it: it reads
file sizes from the store's shard files, and every read token gets a fresh snapshot of
the store (the index copied, the immutable data files hard-linked), so downloads from
other processes (e.g. the `delta-sync` CLI) never collide with the uploading process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from helpers import LoopbackHTTPServer

EMPTY_XET_HASH = "0" * 64

# -- Xet shard files: file hash -> size, read without opening the locked store ---------------------
_BOOKEND = b"\xff" * 32
_FLAG_WITH_VERIFICATION = 0x80000000
_FLAG_WITH_METADATA_EXT = 0x40000000


def _merkle_hex(raw: bytes) -> str:
    # A Xet MerkleHash is 4 little-endian u64 words, printed as 4 x 16 hex digits.
    return "".join(f"{int.from_bytes(raw[i * 8 : (i + 1) * 8], 'little'):016x}" for i in range(4))


def shard_file_sizes(path: str) -> dict[str, int]:
    """{Xet file hash: size} of every file reconstruction listed in an MDB shard file."""
    with open(path, "rb") as f:
        data = f.read()
    sizes: dict[str, int] = {}
    offset = 48  # header: 32-byte tag, u64 version, u64 footer size
    while offset + 48 <= len(data):
        file_hash = data[offset : offset + 32]
        if file_hash == _BOOKEND:
            break
        flags, entries, _ = struct.unpack_from("<IIQ", data, offset + 32)
        offset += 48
        size = 0
        for _ in range(entries):  # FileDataSequenceEntry: cas hash (32), flags u32, unpacked bytes u32, ...
            size += struct.unpack_from("<I", data, offset + 36)[0]
            offset += 48
        if flags & _FLAG_WITH_VERIFICATION:
            offset += 48 * entries
        if flags & _FLAG_WITH_METADATA_EXT:
            offset += 48
        sizes[_merkle_hex(file_hash)] = size
    return sizes


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code


@dataclass
class Fault:
    """Answer the next `remaining` matching requests (None: all of them) with `status`."""

    status: int
    remaining: int | None
    method: str | None = None
    path: str | None = None
    bucket: str | None = None
    error_code: str | None = None
    retry_after: int | None = None
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.method and self.method.upper() != method:
            return False
        if self.path and not re.search(self.path, path):
            return False
        if self.bucket and not re.match(rf"^(/api)?/buckets/{re.escape(self.bucket)}(/|$)", path):
            return False
        return True


@dataclass
class Request:
    """One request the server answered (admin-free log for assertions and cost counts)."""

    method: str
    path: str
    status: int
    body_bytes: int
    time: float = field(default_factory=time.time)


class HubServer(LoopbackHTTPServer):
    """The fake Hub, serving on 127.0.0.1 on a free port from a thread of this process.

    Args:
        token: Bearer token every request must carry; None accepts any request.
        namespace: The user that the `me` namespace and whoami stand for.

    Example:
        ```python
        >>> with HubServer(token="hf_test") as hub:
        ...     api = HfApi(endpoint=hub.endpoint, token="hf_test")
        ...     api.create_bucket("user/deltas")
        ...     hub.add_fault(429, count=2, path="/batch$")
        ```
    """

    def __init__(self, *, token: str | None = None, namespace: str = "user", page_size: int = 1000) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="hub-server-")
        self.store_dir = os.path.join(self.data_dir, "xet_store")
        self.snapshot_root = os.path.join(self.data_dir, "snapshots")
        os.makedirs(self.store_dir)
        os.makedirs(self.snapshot_root)
        self.token = token
        self.namespace = namespace
        self.page_size = page_size
        self.lock = threading.RLock()
        self.buckets: dict[str, dict[str, Any]] = {}
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self._shards_read: set[str] = set()
        self._sizes: dict[str, int] = {EMPTY_XET_HASH: 0}

    # -- lifecycle (start, stop, url: LoopbackHTTPServer) -------------------------------------

    thread_name = "hub-server"

    @property
    def endpoint(self) -> str:
        """The `HF_ENDPOINT` that reaches this server."""
        return self.url

    def handler(self) -> type[_Handler]:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        return Handler

    def cleanup(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- test controls ------------------------------------------------------------------------

    def add_fault(
        self,
        status: int,
        count: int | None = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        bucket: str | None = None,
        error_code: str | None = None,
        retry_after: int | None = None,
    ) -> Fault:
        """Answer the next `count` matching requests (None: all) with HTTP `status`.

        Args:
            method: "GET", "POST", "HEAD", ...; None matches any.
            path: Regular expression searched in the unquoted request path, e.g. "/batch$".
            bucket: "ns/name": only requests about that bucket.
            error_code: `X-Error-Code` header; a 404 defaults to "RepoNotFound" (no such bucket).
            retry_after: `Retry-After` header, in seconds.
        """
        if error_code is None and status == 404:
            error_code = "RepoNotFound"
        fault = Fault(status, count, method, path, bucket, error_code or None, retry_after)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def requests_since(self, mark: int) -> list[Request]:
        """Requests answered after `mark` (a previous `len(server.requests)`)."""
        with self.lock:
            return list(self.requests[mark:])

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    fault.hits += 1
                    return fault
        return None

    # -- store --------------------------------------------------------------------------------

    def bucket(self, bucket_id: str) -> dict[str, Any]:
        found = self.buckets.get(bucket_id)
        if found is None:
            raise _HttpError(404, f"Bucket {bucket_id} not found", "RepoNotFound")
        return found

    def xet_size(self, xet_hash: str) -> int | None:
        """Size of a file in the store, read from its shard files."""
        with self.lock:
            if xet_hash not in self._sizes:
                shards = os.path.join(self.store_dir, "xet", "xorbs", "shards")
                if os.path.isdir(shards):
                    for entry in os.scandir(shards):
                        if entry.name.endswith(".mdb") and entry.path not in self._shards_read:
                            try:
                                self._sizes.update(shard_file_sizes(entry.path))
                            except (OSError, struct.error):  # still being written: read it next time
                                continue
                            self._shards_read.add(entry.path)
            return self._sizes.get(xet_hash)

    def read_store(self) -> str:
        """A private snapshot of the store for one reader: the index copied, data files linked."""
        snapshot = os.path.join(self.snapshot_root, uuid.uuid4().hex)
        source = os.path.join(self.store_dir, "xet", "xorbs")
        target = os.path.join(snapshot, "xet", "xorbs")
        os.makedirs(target)
        if os.path.isdir(source):
            with self.lock:
                for entry in os.scandir(source):
                    if entry.is_file() and entry.name.endswith(".redb"):
                        _stable_copy(entry.path, os.path.join(target, entry.name))
            for sub in ("xorbs", "shards"):
                if not os.path.isdir(os.path.join(source, sub)):
                    continue
                os.makedirs(os.path.join(target, sub), exist_ok=True)
                for entry in os.scandir(os.path.join(source, sub)):
                    if entry.is_file() and not entry.name.startswith("."):
                        try:
                            os.link(entry.path, os.path.join(target, sub, entry.name))
                        except OSError:
                            shutil.copy2(entry.path, os.path.join(target, sub, entry.name))
        return snapshot


def _stable_copy(source: str, dest: str, attempts: int = 50) -> None:
    """Copy a file another process may be writing: read it until two reads in a row agree."""
    with open(source, "rb") as f:
        data = f.read()
    for _ in range(attempts):
        with open(source, "rb") as f:
            again = f.read()
        if again == data:
            break
        data = again
    with open(dest + ".tmp", "wb") as f:
        f.write(data)
    os.replace(dest + ".tmp", dest)


def _file_entry(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "file",
        "path": path,
        "size": entry["size"],
        "xetHash": entry["xetHash"],
        "mtime": _iso(entry["mtime"] / 1000),
        "uploadedAt": _iso(entry["uploadedAt"]),
    }


_BUCKET = r"/api/buckets/(?P<ns>[^/?]+)/(?P<name>[^/?]+)"


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    # -- plumbing -----------------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: Any = b"", headers: dict[str, str] | None = None) -> None:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        # Logged before the client can see the answer, so a test reading the log after a
        # call returns finds every request of that call.
        hub = self.server_hub
        with hub.lock:
            hub.requests.append(Request(self.command, self._path, status, self._body_bytes))
        self.send_response(status)
        headers = headers or {}
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Type" not in headers:
            self.send_header("Content-Type", "application/json")
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, status: int, message: str, error_code: str | None = None, extra: dict | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._send(status, {"error": message}, headers)

    def _handle(self) -> None:
        hub = self.server_hub
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        body = self._body() if self.command in ("POST", "PUT", "PATCH", "DELETE") else b""
        self._path, self._body_bytes = path, len(body)
        try:
            fault = hub._fault_for(self.command, unquote(path))
            if fault is not None:
                extra = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                return self._error(fault.status, f"injected fault {fault.status}", fault.error_code, extra)
            if hub.token is not None and self.headers.get("Authorization", "") != f"Bearer {hub.token}":
                return self._error(401, "Invalid credentials in Authorization header")
            self._route(path, query, body)
        except _HttpError as exc:
            self._error(exc.status, exc.message, exc.error_code)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

    # -- routes -------------------------------------------------------------------------------

    def _route(self, path: str, query: dict[str, list[str]], body: bytes) -> None:
        command = self.command
        if path == "/api/whoami-v2" and command == "GET":
            return self._send(200, {"type": "user", "name": self.server_hub.namespace, "orgs": []})
        if (match := re.fullmatch(_BUCKET + r"/tree(?:/(?P<rest>.*))?", path)) and command == "GET":
            return self._tree(self._bucket_id(match), unquote(match["rest"] or ""), query)
        if (match := re.fullmatch(_BUCKET + r"/paths-info", path)) and command == "POST":
            return self._paths_info(self._bucket_id(match), body)
        if (match := re.fullmatch(_BUCKET + r"/batch", path)) and command == "POST":
            return self._batch(self._bucket_id(match), body)
        if (match := re.fullmatch(_BUCKET + r"/xet-(?P<kind>read|write)-token(?:/.*)?", path)) and command == "GET":
            return self._xet_token(self._bucket_id(match), match["kind"])
        if match := re.fullmatch(_BUCKET, path):
            if command == "POST":
                return self._create(self._bucket_id(match), body)
            if command == "GET":
                return self._info(self._bucket_id(match))
            if command == "DELETE":
                return self._delete_bucket(self._bucket_id(match))
        match = re.fullmatch(r"/buckets/(?P<ns>[^/?]+)/(?P<name>[^/?]+)/resolve/(?P<rest>.+)", path)
        if match and command == "HEAD":
            return self._resolve(self._bucket_id(match), unquote(match["rest"]))
        raise _HttpError(404, f"Route not found: {command} {path}")

    def _bucket_id(self, match: re.Match) -> str:
        namespace = unquote(match["ns"])
        if namespace == "me":
            namespace = self.server_hub.namespace
        return f"{namespace}/{unquote(match['name'])}"

    def _create(self, bucket_id: str, body: bytes) -> None:
        hub = self.server_hub
        payload = json.loads(body or b"{}")
        with hub.lock:
            if bucket_id in hub.buckets:
                return self._error(409, "You already created this bucket")
            hub.buckets[bucket_id] = {
                "private": payload.get("visibility") == "private",
                "createdAt": time.time(),
                "files": {},
            }
        self._send(200, {"url": f"{hub.endpoint}/buckets/{bucket_id}", "id": bucket_id, "name": bucket_id})

    def _info(self, bucket_id: str) -> None:
        with self.server_hub.lock:
            bucket = self.server_hub.bucket(bucket_id)
            files = bucket["files"].values()
            info = {
                "id": bucket_id,
                "private": bucket["private"],
                "createdAt": _iso(bucket["createdAt"]),
                "size": sum(f["size"] for f in files),
                "totalFiles": len(files),
            }
        self._send(200, info)

    def _delete_bucket(self, bucket_id: str) -> None:
        with self.server_hub.lock:
            self.server_hub.bucket(bucket_id)
            del self.server_hub.buckets[bucket_id]
        self._send(200, {})

    def _tree(self, bucket_id: str, prefix: str, query: dict[str, list[str]]) -> None:
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("true", "1")
        with self.server_hub.lock:
            files = dict(self.server_hub.bucket(bucket_id)["files"])
        # Like the Hub, the prefix matches lexically ("logs" also matches "logs_old/x").
        depth = len([p for p in prefix.rstrip("/").split("/") if p])
        entries, folders = [], {}
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            parts = path.split("/")
            if recursive or len(parts) <= depth + 1:
                entries.append(_file_entry(path, files[path]))
            else:
                folder = "/".join(parts[: depth + 1])
                folders[folder] = max(folders.get(folder, 0), files[path]["uploadedAt"])
        entries += [{"type": "directory", "path": p, "uploadedAt": _iso(t)} for p, t in folders.items()]
        entries.sort(key=lambda e: e["path"])
        cursor = int((query.get("cursor") or ["0"])[0])
        limit = int((query.get("limit") or [str(self.server_hub.page_size)])[0])
        headers = {}
        if cursor + limit < len(entries):
            next_query = {k: v[0] for k, v in query.items()} | {"cursor": str(cursor + limit)}
            next_url = f"{self.server_hub.endpoint}{urlsplit(self.path).path}?{urlencode(next_query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._send(200, entries[cursor : cursor + limit], headers)

    def _paths_info(self, bucket_id: str, body: bytes) -> None:
        paths = json.loads(body or b"{}").get("paths", [])
        with self.server_hub.lock:
            files = self.server_hub.bucket(bucket_id)["files"]
            found = [_file_entry(p, files[p]) for p in paths if p in files]
        self._send(200, found)

    def _batch(self, bucket_id: str, body: bytes) -> None:
        hub = self.server_hub
        with hub.lock:
            hub.bucket(bucket_id)
        operations = [json.loads(line) for line in body.splitlines() if line.strip()]
        failed, now = [], time.time()
        for op in operations:
            path = op.get("path")
            try:
                if op["type"] in ("addFile", "copyFile"):
                    size = hub.xet_size(op["xetHash"])
                    if size is None:
                        raise ValueError(f"Xet hash {op['xetHash']} not found in storage")
                    entry = {
                        "size": size,
                        "xetHash": op["xetHash"],
                        "mtime": int(op.get("mtime") or now * 1000),
                        "uploadedAt": now,
                    }
                    with hub.lock:
                        hub.bucket(bucket_id)["files"][path] = entry
                elif op["type"] == "deleteFile":
                    with hub.lock:
                        hub.bucket(bucket_id)["files"].pop(path, None)
                else:
                    raise ValueError(f"Unknown operation type {op['type']!r}")
            except (KeyError, ValueError) as exc:
                failed.append({"path": path, "error": str(exc)})
        status = 422 if operations and len(failed) == len(operations) else 200
        self._send(status, {"success": not failed, "failed": failed})

    def _xet_token(self, bucket_id: str, kind: str) -> None:
        hub = self.server_hub
        with hub.lock:
            hub.bucket(bucket_id)
        store = hub.store_dir if kind == "write" else hub.read_store()
        expires = int(time.time()) + 3600
        token, cas_url = f"xet-{kind}-{uuid.uuid4().hex[:12]}", f"local://{store}"
        headers = {"X-Xet-Cas-Url": cas_url, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(expires)}
        self._send(200, {"accessToken": token, "exp": expires, "casUrl": cas_url}, headers)

    def _resolve(self, bucket_id: str, path: str) -> None:
        hub = self.server_hub
        with hub.lock:
            entry = hub.bucket(bucket_id)["files"].get(path)
        if entry is None:
            raise _HttpError(404, "Entry not found", "EntryNotFound")
        refresh = f"{hub.endpoint}/api/buckets/{bucket_id}/xet-read-token"
        self._send(
            200,
            b"",
            {
                "X-Xet-Hash": entry["xetHash"],
                "X-Xet-Refresh-Route": refresh,
                "Link": f'<{refresh}>; rel="xet-auth"',
                "X-Linked-Size": str(entry["size"]),
                "ETag": f'"{entry["xetHash"]}"',
                "Content-Length": str(entry["size"]),
                "Content-Type": "application/octet-stream",
            },
        )

"""`S3Bucket`: an S3 or S3-compatible bucket, through boto3."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

import xxhash

from ..errors import (
    BucketConflictError,
    BucketError,
    BucketFileNotFoundError,
    BucketNotFoundError,
    BucketPathError,
    BucketPermissionError,
    IncompleteTransfer,
)
from ..retry import RetryPolicy
from .base import Bucket, clean_path
from .progress import transfer_progress

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

__all__ = ["S3Bucket", "parse_s3_url"]

T = TypeVar("T")

#: Object metadata holding the xxh3-128 of the content, to recognise our own earlier write.
DIGEST_KEY = "delta-sync-xxh3-128"
_CHUNK = 8 << 20
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",  # a concurrent conditional write is in flight: retry, then see who won
}
_PERMISSION_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AccountProblem",
}


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split `s3://<bucket>[/prefix]` into the bucket name and the prefix ("" for none).

    Raises:
        BucketPathError: The URL is not of that form, or its prefix escapes the bucket.

    Example:
        ```python
        >>> parse_s3_url("s3://my-bucket/runs/run1")
        ('my-bucket', 'runs/run1')
        ```
    """
    if not url.startswith("s3://"):
        raise BucketPathError(f"not an S3 URL: {url!r} (expected s3://<bucket>[/prefix])")
    name, _, prefix = url[len("s3://") :].rstrip("/").partition("/")
    if not name:
        raise BucketPathError(f"{url!r} lacks a bucket name (s3://<bucket>[/prefix])")
    return name, clean_path(prefix) if prefix else ""


class S3Bucket(Bucket):
    """A prefix inside an S3 bucket, or a bucket of any S3-compatible store.

    Configuration is boto3's standard one: credentials and region from the environment
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, ...), `~/.aws` profiles
    (`AWS_PROFILE` or `profile`), instance and container roles. Other providers (MinIO,
    Cloudflare R2, SeaweedFS, ...) are reached with `AWS_ENDPOINT_URL` (or
    `AWS_ENDPOINT_URL_S3`, or `endpoint_url`), addressed path-style.

    An S3 object appears whole when its PUT (or multipart completion) succeeds, so readers
    never see a partial file. Files of `multipart_bytes` or more go up in parts, from disk.
    `upload(..., overwrite=False)` is a conditional write (`If-None-Match: *`): of two
    writers racing for the same new path exactly one wins and the other gets
    [`BucketConflictError`], so two trainers on one prefix cannot silently overwrite each
    other's versions. Every object records the xxh3-128 of its content in its metadata,
    so a retried upload that meets its own earlier write (whose answer was lost) succeeds
    instead of reporting a conflict. Stores without conditional writes ignore the header;
    there, as on Hugging Face Buckets, a single writer per prefix is assumed.

    boto3's own retries are turned off: each operation is retried as a whole under one
    bounded [`RetryPolicy`].

    Args:
        url: `s3://<bucket>[/prefix]`.
        endpoint_url: The S3 endpoint; default: `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, or AWS.
        profile: A profile of `~/.aws/config`; default: `AWS_PROFILE` or the default profile.
        region: The region; default: from the environment or profile.
        create: Create the bucket if it does not exist.
        retry: Retry policy; [`RetryPolicy.from_env`] by default.
        multipart_bytes: Files at least this large are uploaded in parts of this size
            (more when a file would need over 10,000 parts).

    Example:
        ```python
        >>> bucket = S3Bucket("s3://my-bucket/run1")
        >>> bucket.upload("latest.json", b"{}")
        >>> bucket.list()
        ['latest.json']
        ```
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        profile: str | None = None,
        region: str | None = None,
        create: bool = False,
        retry: RetryPolicy | None = None,
        multipart_bytes: int = 64 << 20,
    ) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("s3:// buckets need boto3: pip install 'delta-sync[s3]'") from exc
        if multipart_bytes < 5 << 20:
            raise ValueError(f"multipart_bytes must be at least 5 MiB (the S3 minimum part), got {multipart_bytes}")
        self.name, prefix = parse_s3_url(url)
        self.prefix = prefix + "/" if prefix else ""
        self.url = f"s3://{self.name}" + ("/" + prefix if prefix else "")
        self.retry = retry or RetryPolicy.from_env()
        self.multipart_bytes = multipart_bytes
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.endpoint_url = endpoint_url
        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
            # Path-style addressing works with every S3-compatible store; AWS picks its own.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        with _sessions_lock:
            session = _session(boto3, profile, region)
            self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        if create:
            self._create(session.region_name)

    # -- Bucket interface -----------------------------------------------------------------

    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        key = self._key(path)
        if isinstance(source, (bytes, bytearray, memoryview)):
            data: bytes | None = bytes(source)
            file = None
            size = len(data)
            digest = xxhash.xxh3_128_hexdigest(data)
        else:
            data, file = None, Path(source)
            if not file.is_file():
                raise FileNotFoundError(f"no local file {str(file)!r} to upload to {self.url}/{path}")
            size = file.stat().st_size
            digest = _file_digest(file)
        conditions = {} if overwrite else {"IfNoneMatch": "*"}
        metadata = {DIGEST_KEY: digest}

        def put() -> None:
            body = data if data is not None else file.read_bytes()
            self._client.put_object(Bucket=self.name, Key=key, Body=body, Metadata=metadata, **conditions)

        try:
            if file is not None and size >= self.multipart_bytes:
                self._upload_parts(path, key, file, size, metadata, conditions)
            else:
                self._run("upload", path, put)
        except BucketError as exc:
            if not (isinstance(exc.__cause__, Exception) and _is_precondition_failed(exc.__cause__)):
                raise
            if self._stored_digest(path, key) != digest:
                raise BucketConflictError(f"{self.url}: {path!r} already exists") from None
            # The object holds exactly our content: an earlier attempt stored it and its answer was lost.

    def download(self, path: str, dest: os.PathLike) -> None:
        key = self._key(path)
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"

        def get() -> None:
            response = self._client.get_object(Bucket=self.name, Key=key)
            expected = response["ContentLength"]
            written = 0
            with open(tmp, "wb") as out, transfer_progress(f"download {path}", expected) as update:
                for chunk in response["Body"].iter_chunks(_CHUNK):
                    out.write(chunk)
                    written += len(chunk)
                    update(len(chunk))
            if written != expected:
                raise IncompleteTransfer(f"got {written} of {expected} bytes")

        try:
            self._run("download", path, get)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, path: str) -> bytes:
        key = self._key(path)
        return self._run("read", path, lambda: self._client.get_object(Bucket=self.name, Key=key)["Body"].read())

    def list(self, prefix: str = "") -> list[str]:
        under = self.prefix + (clean_path(prefix) + "/" if prefix else "")

        def attempt() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=under)
            return [item["Key"] for page in pages for item in page.get("Contents", [])]

        return sorted(key[len(self.prefix) :] for key in self._run("list", prefix or None, attempt))

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(path) for path in paths]
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]

            def attempt(chunk: list[str] = chunk) -> None:
                response = self._client.delete_objects(
                    Bucket=self.name, Delete={"Objects": [{"Key": key} for key in chunk], "Quiet": True}
                )
                errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    failed = ", ".join(f"{e['Key'][len(self.prefix) :]!r} ({e.get('Code')})" for e in errors[:5])
                    raise BucketError(f"{self.url}: could not delete {len(errors)} file(s): {failed}")

            self._run("delete", chunk[0][len(self.prefix) :] if len(chunk) == 1 else f"{len(chunk)} files", attempt)

    # -- helpers --------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return self.prefix + clean_path(path)

    def _create(self, region: str | None) -> None:
        from botocore.exceptions import ClientError

        def attempt() -> None:
            try:
                self._client.head_bucket(Bucket=self.name)
                return
            except ClientError as exc:
                if _error_status(exc) != 404:
                    raise
            location = (
                {}
                if not region or region == "us-east-1"
                else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            )
            try:
                self._client.create_bucket(Bucket=self.name, **location)
            except ClientError as exc:
                if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._run("create the bucket", None, attempt)

    def _upload_parts(
        self, path: str, key: str, file: Path, size: int, metadata: dict[str, str], conditions: dict[str, str]
    ) -> None:
        part_size = max(self.multipart_bytes, -(-size // 10_000))
        upload_id = self._run(
            "start multipart upload",
            path,
            lambda: self._client.create_multipart_upload(Bucket=self.name, Key=key, Metadata=metadata)["UploadId"],
        )
        try:
            with open(file, "rb") as handle, transfer_progress(f"upload {path}", size) as update:

                def send(number: int) -> dict:
                    offset = (number - 1) * part_size
                    body = _read_at(handle, offset, min(part_size, size - offset))
                    etag = self._run(
                        f"upload part {number} of",
                        path,
                        lambda: self._client.upload_part(
                            Bucket=self.name, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                        )["ETag"],
                    )
                    update(len(body))
                    return {"ETag": etag, "PartNumber": number}

                with ThreadPoolExecutor(max_workers=4, thread_name_prefix="delta-sync-s3") as pool:
                    parts = list(pool.map(send, range(1, -(-size // part_size) + 1)))
            self._run(
                "complete multipart upload",
                path,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.name, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **conditions
                ),
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
            except Exception:  # the upload may be complete or already gone; nothing else to undo
                pass
            raise

    def _stored_digest(self, path: str, key: str) -> str | None:
        try:
            head = self._run("check", path, lambda: self._client.head_object(Bucket=self.name, Key=key))
        except BucketFileNotFoundError:
            return None
        return head.get("Metadata", {}).get(DIGEST_KEY)

    def _run(self, op: str, path: str | None, fn: Callable[[], T]) -> T:
        what = f"{self.url}: {op}" + (f" {path!r}" if path else "")
        return self.retry.call(
            fn, transient=_is_transient, what=what, translate=lambda exc: _translate(exc, self, what, path)
        )


_sessions: dict[tuple, object] = {}
_sessions_lock = threading.Lock()


def _session(boto3, profile: str | None, region: str | None):
    """A boto3 session per configuration, reused: a new one costs about 0.15 s (and, with
    instance roles, a credentials request), which a replica would pay on every update."""
    key = (profile, region, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    session = _sessions.get(key)
    if session is None:
        session = _sessions[key] = boto3.session.Session(profile_name=profile, region_name=region)
    return session


def _file_digest(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _read_at(handle: IO[bytes], offset: int, length: int) -> bytes:
    return os.pread(handle.fileno(), length, offset)


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _error_status(exc: ClientError) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _is_precondition_failed(exc: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and (_error_code(exc) == "PreconditionFailed" or _error_status(exc) == 412)


def _is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        ResponseStreamingError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(exc, ClientError):
        status = _error_status(exc) or 0
        return _error_code(exc) in _TRANSIENT_CODES or status in (408, 429) or status >= 500
    network = (BotoConnectionError, HTTPClientError, IncompleteReadError, ResponseStreamingError)
    return isinstance(exc, (*network, ConnectionError, TimeoutError))


def _translate(exc: Exception, bucket: S3Bucket, what: str, path: str | None) -> BucketError:
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    where = f" at {bucket.endpoint_url}" if bucket.endpoint_url else ""
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return BucketPermissionError(
            f"{what}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or a role"
        )
    if not isinstance(exc, ClientError):
        return BucketError(f"{what}: {type(exc).__name__}: {exc}")
    code, status = _error_code(exc), _error_status(exc)
    if code == "NoSuchBucket":
        return BucketNotFoundError(f"{what}: bucket {bucket.name!r} does not exist{where}")
    if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
        return BucketFileNotFoundError(f"{bucket.url}: no file {path!r}")
    if code in _PERMISSION_CODES or status == 403:
        return BucketPermissionError(
            f"{what}: permission denied ({code or status}); check the credentials may access bucket {bucket.name!r}"
        )
    return BucketError(f"{what}: {code or status}: {exc}")

"""`S3Bucket`: an S3 or S3-compatible bucket, through boto3."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING

import xxhash

from ..errors import BucketError, BucketFileNotFoundError, BucketNotFoundError, BucketPermissionError
from ..retry import RetryPolicy
from .base import RemoteBucket, split_bucket_url
from .progress import transfer_progress

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

__all__ = ["S3Bucket", "parse_s3_url"]

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
    return split_bucket_url(url, "s3://<bucket>[/prefix]", kind="an S3 URL", name="a bucket name")


class S3Bucket(RemoteBucket):
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

    #: DeleteObjects takes at most 1,000 keys.
    delete_batch = 1000

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
            raise ImportError("s3:// buckets need boto3: pip install 'delta-weight-sync[s3]'") from exc
        if multipart_bytes < 5 << 20:
            raise ValueError(f"multipart_bytes must be at least 5 MiB (the S3 minimum part), got {multipart_bytes}")
        self.name, prefix = parse_s3_url(url)
        super().__init__(f"s3://{self.name}", prefix, retry)
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

    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        key = self._key(path)
        content, size = self._source(path, source)
        digest = _file_digest(content) if isinstance(content, Path) else xxhash.xxh3_128_hexdigest(content)
        conditions = {} if overwrite else {"IfNoneMatch": "*"}
        metadata = {DIGEST_KEY: digest}

        def put() -> None:
            body = content.read_bytes() if isinstance(content, Path) else content
            self._client.put_object(Bucket=self.name, Key=key, Body=body, Metadata=metadata, **conditions)

        try:
            if isinstance(content, Path) and size >= self.multipart_bytes:
                self._upload_parts(path, key, content, size, metadata, conditions)
            else:
                self._run("upload", path, put)
        except BucketError as exc:
            if not (isinstance(exc.__cause__, Exception) and _is_precondition_failed(exc.__cause__)):
                raise
            if self._stored_digest(path, key) != digest:
                raise self._conflict(path) from None
            # The object holds exactly our content: an earlier attempt stored it and its answer was lost.

    def read_bytes(self, path: str) -> bytes:
        key = self._key(path)
        return self._run("read", path, lambda: self._client.get_object(Bucket=self.name, Key=key)["Body"].read())

    def read_if_changed(self, path: str, tag: str | None) -> tuple[bytes | None, str]:
        """One GET with `If-None-Match: <ETag>`: an unchanged object is answered 304, with no body."""
        from botocore.exceptions import ClientError

        key = self._key(path)
        conditions = {"IfNoneMatch": tag} if tag else {}

        def get() -> tuple[bytes | None, str]:
            try:
                response = self._client.get_object(Bucket=self.name, Key=key, **conditions)
            except ClientError as exc:
                if _error_status(exc) == 304:
                    return None, tag
                raise
            return response["Body"].read(), response["ETag"]

        return self._run("read", path, get)

    # -- store calls ----------------------------------------------------------------------

    def _get(self, key: str, tmp: Path, path: str, max_bytes: int | None) -> int:
        response = self._client.get_object(Bucket=self.name, Key=key)
        expected = response["ContentLength"]
        if max_bytes is not None and expected > max_bytes:
            response["Body"].close()
            self.check_size(path, expected, max_bytes)
        with open(tmp, "wb") as out, transfer_progress(f"download {path}", expected) as update:
            for chunk in response["Body"].iter_chunks(_CHUNK):
                out.write(chunk)
                update(len(chunk))
        return expected

    def _list_keys(self, under: str) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=under)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def _delete_keys(self, keys: list[str]) -> None:
        response = self._client.delete_objects(
            Bucket=self.name, Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True}
        )
        errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            failed = ", ".join(f"{self._path(e['Key'])!r} ({e.get('Code')})" for e in errors[:5])
            raise BucketError(f"{self.url}: could not delete {len(errors)} file(s): {failed}")

    # -- what S3's errors mean -------------------------------------------------------------

    @staticmethod
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

    def _translate(self, exc: Exception, what: str, path: str | None) -> BucketError:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return BucketPermissionError(
                f"{what}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or a role"
            )
        if not isinstance(exc, ClientError):
            return BucketError(f"{what}: {type(exc).__name__}: {exc}")
        code, status = _error_code(exc), _error_status(exc)
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: bucket {self.name!r} does not exist{where}")
        if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
            return self._not_found(path)
        if code in _PERMISSION_CODES or status == 403:
            return BucketPermissionError(
                f"{what}: permission denied ({code or status}); check the credentials may access bucket {self.name!r}"
            )
        return BucketError(f"{what}: {code or status}: {exc}")

    # -- helpers --------------------------------------------------------------------------

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

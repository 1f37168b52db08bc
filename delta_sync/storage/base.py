"""The `Bucket` interface every storage backend implements, and `RemoteBucket`, the part
that the object-store backends share."""

from __future__ import annotations

import os
import posixpath
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, TypeVar

import xxhash

from ..errors import (
    BucketConflictError,
    BucketError,
    BucketFileNotFoundError,
    BucketPathError,
    IncompleteTransfer,
    OversizedFileError,
)
from ..retry import RetryPolicy

__all__ = ["Bucket", "RemoteBucket", "clean_path", "replace_when_complete", "split_bucket_url"]

T = TypeVar("T")


def clean_path(path: str) -> str:
    """Normalise a path inside a bucket and refuse one that could escape the bucket's prefix.

    Args:
        path: A relative, `/`-separated path such as `deltas/step_00000002.safetensors`.

    Returns:
        The normalised path.

    Raises:
        BucketPathError: The path is empty, absolute, contains `..` or a backslash, or is
            not a string.
    """
    if not isinstance(path, str) or not path or path.strip() != path:
        raise BucketPathError(f"invalid path in bucket: {path!r}")
    if path.startswith("/") or "\\" in path or "\0" in path:
        raise BucketPathError(f"path {path!r} must be relative to the bucket prefix")
    parts = path.split("/")
    if any(part in ("..", ".", "") for part in parts):
        raise BucketPathError(f"path {path!r} must not contain '..', '.' or empty segments")
    return posixpath.join(*parts)


def split_bucket_url(url: str, form: str, *, kind: str, name: str) -> tuple[str, str]:
    """Split a remote bucket's URL into the bucket's name and the prefix ("" for none).

    Args:
        url: The URL, e.g. `s3://my-bucket/runs/run1`.
        form: What the backend's URLs look like, e.g. `s3://<bucket>[/prefix]`: the text
            before the first `<` is the scheme, and each `<...>` is one `/`-separated
            segment of the bucket's name.
        kind: What such a URL is called, for errors (e.g. "an S3 URL").
        name: What its name segments are called, for errors (e.g. "a bucket name").

    Raises:
        BucketPathError: The URL is not of that form, or its prefix escapes the bucket.
    """
    scheme, segments = form.partition("<")[0], form.count("<")
    if not url.startswith(scheme):
        raise BucketPathError(f"not {kind}: {url!r} (expected {form})")
    parts = url[len(scheme) :].rstrip("/").split("/")
    if len(parts) < segments or not all(parts[:segments]):
        raise BucketPathError(f"{url!r} lacks {name} ({form})")
    prefix = clean_path("/".join(parts[segments:])) if len(parts) > segments else ""
    return "/".join(parts[:segments]), prefix


class Bucket(ABC):
    """A flat namespace of files under a prefix, in some object store.

    Implementations make every write atomic: a reader sees either the previous content
    or the complete new file, never a partial one. Paths are relative to the bucket's
    prefix and checked with [`clean_path`].
    """

    #: Canonical URL of the bucket and prefix, e.g. `file:///data/run1`.
    url: str

    @abstractmethod
    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        """Store `source` (bytes, or a local file to copy from) at `path`, atomically.

        Args:
            path: Destination inside the bucket.
            source: The content, or a local file holding it.
            overwrite: With False, refuse to replace an existing file: raise
                [`BucketConflictError`], unless it already holds exactly this content (a
                retried write that meets its own earlier success). Where the store supports
                conditional writes this check is atomic; see each backend for its guarantee.

        Raises:
            BucketConflictError: `overwrite` is False and another content is at `path`.
            BucketUnavailableError: Transient failures outlasted the retry budget.
        """

    @abstractmethod
    def download(self, path: str, dest: os.PathLike, *, max_bytes: int | None = None) -> None:
        """Copy the file at `path` to the local file `dest`, which appears only when complete.

        Args:
            path: The file inside the bucket.
            dest: The local file to write.
            max_bytes: Refuse a file larger than this, before copying more of it.

        Raises:
            BucketFileNotFoundError: No file at `path`.
            OversizedFileError: The file is larger than `max_bytes`.
        """

    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """Return the content of the (small) file at `path`.

        Raises:
            BucketFileNotFoundError: No file at `path`.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Paths of all files under `prefix` (a directory inside the bucket, or "" for all), sorted."""

    @abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Delete files; paths that do not exist are ignored."""

    def read_if_changed(self, path: str, tag: str | None) -> tuple[bytes | None, str]:
        """Return the content of the (small) file at `path`, unless it still has `tag`.

        For pollers such as `delta-sync follow`: keep the tag returned with the content and
        pass it back next time. Where the store answers conditional requests (S3's ETag,
        the Hub's Xet hash) an unchanged file costs one small request and no content;
        elsewhere (this default) the file is read and compared by its digest. Tags are
        opaque, comparable only with tags of the same bucket and path.

        Args:
            path: The file, e.g. `latest.json`.
            tag: The tag returned with the content read last, or None to read in any case.

        Returns:
            `(None, tag)` when the file is unchanged, else `(content, its tag)`.

        Raises:
            BucketFileNotFoundError: No file at `path`.

        Example:
            ```python
            >>> content, tag = bucket.read_if_changed("latest.json", None)
            >>> bucket.read_if_changed("latest.json", tag)
            (None, '...')
            ```
        """
        content = self.read_bytes(path)
        digest = xxhash.xxh3_128_hexdigest(content)
        return (None, tag) if digest == tag else (content, digest)

    def local_path(self, path: str) -> Path | None:
        """A local filesystem path holding the file, when the bucket is a local directory."""
        return None

    def check_size(self, path: str, size: int, max_bytes: int | None) -> None:
        """Raise [`OversizedFileError`] when a file of `size` bytes exceeds `max_bytes`."""
        if max_bytes is not None and size > max_bytes:
            raise OversizedFileError(
                f"{self.url}/{path}: {size:,} bytes, more than the {max_bytes:,} its signature or the model's "
                "shapes allow; refused before downloading it"
            )

    def _not_found(self, path: str | None) -> BucketFileNotFoundError:
        return BucketFileNotFoundError(f"{self.url}: no file {path!r}")

    def _conflict(self, path: str) -> BucketConflictError:
        return BucketConflictError(f"{self.url}: {path!r} already exists")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


@contextmanager
def replace_when_complete(dest: os.PathLike) -> Iterator[Path]:
    """A temporary path next to `dest` that becomes `dest` when the block succeeds.

    The temporary file is in `dest`'s directory (so the rename is atomic) and is removed
    whatever happens; readers of `dest` never see a partial file.

    Args:
        dest: The local file to produce; its directory is created if missing.

    Example:
        ```python
        >>> with replace_when_complete("cache/anchor.safetensors") as tmp:
        ...     tmp.write_bytes(content)
        ```
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A leading dot and a .tmp ending: bucket listings and caches pass over such names.
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


class RemoteBucket(Bucket):
    """The part every object-store backend shares: keys under a prefix, retried operations,
    downloads that appear only when complete.

    A backend sets `url`, `prefix` and `retry` (through `__init__`) and supplies its
    store's calls and what its client's errors mean:

    - `_get(key, tmp, path)`: write one object's bytes to a local file, return its size;
    - `_list_keys(under)`: the keys that start with `under`;
    - `_delete_keys(keys)`: delete objects, absent ones ignored;
    - `upload(...)`, with the conditional write the store offers;
    - `_is_transient(exc)`: whether an error of its client may pass by retrying (the one
      place per transport that says so);
    - `_translate(exc, what, path)`: the [`BucketError`] a permanent client error becomes.

    Every store call runs through `_run`, so it is retried under the bucket's
    [`RetryPolicy`] and fails with this library's errors.

    Args:
        root: The URL of the bucket itself, e.g. `s3://my-bucket`.
        prefix: The bucket's prefix, already checked with [`clean_path`] ("" for none).
        retry: Retry policy; [`RetryPolicy.from_env`] by default.
    """

    #: The most keys one `_delete_keys` call may take (None: no limit).
    delete_batch: ClassVar[int | None] = None

    def __init__(self, root: str, prefix: str, retry: RetryPolicy | None) -> None:
        #: "" or the prefix with a trailing "/": every key starts with it.
        self.prefix = prefix + "/" if prefix else ""
        self.url = root + ("/" + prefix if prefix else "")
        self.retry = retry or RetryPolicy.from_env()

    # -- Bucket interface -----------------------------------------------------------------

    def download(self, path: str, dest: os.PathLike, *, max_bytes: int | None = None) -> None:
        key = self._key(path)

        with replace_when_complete(dest) as tmp:

            def attempt() -> None:
                tmp.unlink(missing_ok=True)  # what an earlier attempt left
                expected = self._get(key, tmp, path, max_bytes)
                got = tmp.stat().st_size if tmp.is_file() else None
                if got != expected:
                    raise IncompleteTransfer(f"got {got} of {expected} bytes")

            self._run("download", path, attempt)

    def read_bytes(self, path: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="delta-sync-read-") as tmp:
            local = Path(tmp) / "file"
            self.download(path, local)
            return local.read_bytes()

    def list(self, prefix: str = "") -> list[str]:
        under = self.prefix + (clean_path(prefix) + "/" if prefix else "")
        keys = self._run("list", prefix or None, lambda: self._list_keys(under))
        return sorted(self._path(key) for key in keys if key.startswith(under))

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(path) for path in paths]
        size = self.delete_batch or max(len(keys), 1)
        for start in range(0, len(keys), size):
            batch = keys[start : start + size]
            what = self._path(batch[0]) if len(batch) == 1 else f"{len(batch)} files"
            self._run("delete", what, lambda batch=batch: self._delete_keys(batch))

    # -- what a backend supplies ----------------------------------------------------------

    @abstractmethod
    def _get(self, key: str, tmp: Path, path: str, max_bytes: int | None) -> int:
        """Write the object at `key` to the local file `tmp` (absent when called); return the object's size.

        Args:
            key: The object's key, prefix included.
            tmp: The file to write.
            path: The bucket path, for progress bars and errors.
            max_bytes: Raise [`oversized`] before writing an object larger than this.

        Raises:
            BucketFileNotFoundError: No object at `key`.
            OversizedFileError: The object is larger than `max_bytes`.
        """

    @abstractmethod
    def _list_keys(self, under: str) -> Iterable[str]:
        """The keys of all objects whose key starts with `under` (more are passed over)."""

    @abstractmethod
    def _delete_keys(self, keys: list[str]) -> None:
        """Delete the objects at `keys` (at most `delete_batch`); absent ones are no error."""

    @staticmethod
    @abstractmethod
    def _is_transient(exc: BaseException) -> bool:
        """Whether an error of the client may pass by itself, so the operation is retried."""

    @abstractmethod
    def _translate(self, exc: Exception, what: str, path: str | None) -> BucketError:
        """The error a permanent client error becomes.

        Args:
            exc: The client's error.
            what: The operation and its target, e.g. `s3://b/run: upload 'latest.json'`.
            path: The bucket path concerned, or None.
        """

    # -- shared helpers -------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return self.prefix + clean_path(path)

    def _path(self, key: str) -> str:
        """The bucket path of a key under the prefix."""
        return key[len(self.prefix) :]

    def _source(self, path: str, source: bytes | os.PathLike) -> tuple[bytes | Path, int]:
        """What `upload(path, source)` sends, and its size; checks a local file exists before any request."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            return data, len(data)
        file = Path(source)
        if not file.is_file():
            raise FileNotFoundError(f"no local file {os.fspath(source)!r} to upload to {self.url}/{path}")
        return file, file.stat().st_size

    def _run(self, op: str, path: str | None, fn: Callable[[], T]) -> T:
        """Run one store operation under the retry policy, with this library's errors.

        Args:
            op: The operation, for messages (`upload`, `create the bucket`, ...).
            path: The bucket path (or a description such as "3 files"), or None.
            fn: The operation; safe to repeat.
        """
        what = f"{self.url}: {op}" + (f" {path!r}" if path else "")
        return self.retry.call(
            fn, transient=self._is_transient, what=what, translate=lambda exc: self._translate(exc, what, path)
        )

"""The `Bucket` interface every storage backend implements."""

from __future__ import annotations

import os
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from ..errors import BucketPathError

__all__ = ["Bucket", "clean_path"]


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
    def download(self, path: str, dest: os.PathLike) -> None:
        """Copy the file at `path` to the local file `dest`, which appears only when complete.

        Raises:
            BucketFileNotFoundError: No file at `path`.
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

    def local_path(self, path: str) -> Path | None:
        """A local filesystem path holding the file, when the bucket is a local directory."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

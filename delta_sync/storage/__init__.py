"""Object storage backends, chosen by URL.

| URL | backend |
| --- | --- |
| `./dir`, `/abs/dir`, `file:///abs/dir` | [`LocalBucket`] (the embedded default) |
"""

from __future__ import annotations

import os

from ..errors import BucketError
from .base import Bucket, clean_path
from .local import LocalBucket

__all__ = ["Bucket", "LocalBucket", "clean_path", "open_bucket"]


def open_bucket(url: str | os.PathLike | Bucket) -> Bucket:
    """Return the bucket a URL names.

    Args:
        url: A local directory path, a `file://` URL, or an already open [`Bucket`]
            (returned as is).

    Raises:
        BucketError: The URL's scheme names no supported backend.

    Example:
        ```python
        >>> open_bucket("./deltas")
        LocalBucket('file:///home/me/deltas')
        ```
    """
    if isinstance(url, Bucket):
        return url
    text = os.fspath(url)
    scheme, sep, _ = text.partition("://")
    if not sep or scheme == "file":
        return LocalBucket(text)
    raise BucketError(f"unsupported bucket URL {text!r}: expected a local path or file://")

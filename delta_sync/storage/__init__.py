"""Object storage backends, chosen by URL.

| URL | backend | needs |
| --- | --- | --- |
| `./dir`, `/abs/dir`, `file:///abs/dir` | [`LocalBucket`] (the embedded default) | nothing |
| `hf://buckets/<namespace>/<name>[/prefix]` | `delta_sync.storage.hf.HFBucket` | `pip install 'delta-weight-sync[hf]'` |
| `s3://<bucket>[/prefix]` | `delta_sync.storage.s3.S3Bucket` | `pip install 'delta-weight-sync[s3]'` |

The remote backends import their client library only when a URL of theirs is opened;
they share [`RemoteBucket`] (keys under a prefix, retried operations, downloads that
appear only when complete) and add their store's calls and what its errors mean.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import BucketError
from ..retry import RetryPolicy
from .base import Bucket, RemoteBucket, clean_path
from .local import LocalBucket

__all__ = ["Bucket", "LocalBucket", "RemoteBucket", "RetryPolicy", "clean_path", "open_bucket"]


def open_bucket(url: str | os.PathLike | Bucket, **options: Any) -> Bucket:
    """Return the bucket a URL names.

    Args:
        url: A local directory path, a `file://`, `hf://buckets/...` or `s3://...` URL, or
            an already open [`Bucket`] (returned as is).
        **options: Passed to the backend's constructor, e.g. `create=True`, `token=...`
            ([`HFBucket`]), `endpoint_url=...` ([`S3Bucket`]), `retry=RetryPolicy(...)`.

    Raises:
        BucketError: The URL's scheme names no supported backend.
        ImportError: The backend's client library is not installed.

    Example:
        ```python
        >>> open_bucket("./deltas")
        LocalBucket('file:///home/me/deltas')
        >>> open_bucket("s3://my-bucket/run1")
        S3Bucket('s3://my-bucket/run1')
        ```
    """
    if isinstance(url, Bucket):
        if options:
            raise TypeError(f"options {sorted(options)} given for an already open bucket {url!r}")
        return url
    text = os.fspath(url)
    scheme, sep, _ = text.partition("://")
    if not sep or scheme == "file":
        if options:
            raise TypeError(f"a local bucket takes no options, got {sorted(options)}")
        return LocalBucket(text)
    if scheme == "hf":
        from .hf import HFBucket

        return HFBucket(text, **options)
    if scheme == "s3":
        from .s3 import S3Bucket

        return S3Bucket(text, **options)
    raise BucketError(
        f"unsupported bucket URL {text!r}: expected a local path, file://, hf://buckets/<namespace>/<name> or s3://<bucket>"
    )

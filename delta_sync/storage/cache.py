"""`DownloadCache`: a per-machine directory of files fetched from buckets."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from .base import Bucket, clean_path

__all__ = ["DownloadCache", "default_cache_dir"]


def default_cache_dir() -> Path:
    """`$DELTA_SYNC_CACHE`, else `$XDG_CACHE_HOME/delta-sync`, else `~/.cache/delta-sync`."""
    if os.environ.get("DELTA_SYNC_CACHE"):
        return Path(os.environ["DELTA_SYNC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "delta-sync"


class DownloadCache:
    """Fetches bucket files to local disk once per machine.

    Several processes on one machine (e.g. the tensor-parallel workers of one vLLM
    server) that fetch the same file wait on a file lock, so only the first downloads
    it. Files appear in the cache only when complete. Files of a local bucket are used
    in place, without a copy.

    Args:
        root: Cache directory; defaults to [`default_cache_dir`].
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def _bucket_dir(self, bucket: Bucket) -> Path:
        return self.root / hashlib.sha256(bucket.url.encode()).hexdigest()[:16]

    def fetch(self, bucket: Bucket, path: str) -> Path:
        """Local path of the bucket file `path`, downloading it if the cache lacks it.

        Raises:
            BucketFileNotFoundError: The bucket has no such file.
        """
        path = clean_path(path)
        local = bucket.local_path(path)
        if local is not None:
            if not local.is_file():
                bucket.read_bytes(path)  # raises the bucket's own not-found error
            return local
        dest = self._bucket_dir(bucket) / path
        if dest.is_file():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(dest) + ".lock"):
            if not dest.is_file():
                bucket.download(path, dest)
        return dest

    def prune(self, bucket: Bucket, keep: Callable[[str], bool]) -> int:
        """Delete cached files of `bucket` whose bucket path `keep` rejects; returns how many.

        A file another process still has open stays readable until closed (POSIX), and a
        later `fetch` downloads it again, so pruning never breaks a concurrent reader.
        """
        base = self._bucket_dir(bucket)
        if bucket.local_path("latest.json") is not None or not base.is_dir():
            return 0
        removed = 0
        for file in base.rglob("*"):
            if not file.is_file() or file.name.endswith(".lock"):
                continue
            if not keep(file.relative_to(base).as_posix()):
                file.unlink(missing_ok=True)
                Path(str(file) + ".lock").unlink(missing_ok=True)
                removed += 1
        return removed

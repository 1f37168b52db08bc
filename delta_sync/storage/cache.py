"""`DownloadCache`: a per-machine directory of files fetched from buckets."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import BucketPathError
from .base import Bucket, clean_path

__all__ = ["DownloadCache", "default_cache_dir"]

_LOCK_SUFFIX = ".lock"


def default_cache_dir() -> Path:
    """`$DELTA_SYNC_CACHE`, else `$XDG_CACHE_HOME/delta-sync`, else `~/.cache/delta-sync`."""
    if os.environ.get("DELTA_SYNC_CACHE"):
        return Path(os.environ["DELTA_SYNC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "delta-sync"


class DownloadCache:
    """Fetches bucket files to local disk once per machine, safely shared by processes.

    Several processes on one machine (e.g. the tensor-parallel workers of one vLLM
    server, or several replicas) that fetch the same file wait on a lock, so only the
    first downloads it. Files appear in the cache only when complete. Files of a local
    bucket are copied in too: a replica then reads, checks and applies a private copy that
    nobody who can write the bucket can change under it (or truncate: no SIGBUS).

    A `namespace` separates files that share a path but not an identity: a run resumed in
    place rewrites versions under the same paths, so the receiver fetches under its
    run and start ("epoch"), and a prune drops other namespaces.

    A fetched file is pinned: no process's [`prune`] deletes it until this cache object
    releases it, at its own next [`prune`] or [`release`]. Each cached file has a lock
    file next to it (`<file>.lock`); a pin is a shared `flock` on it, and pruning takes it
    exclusively without waiting, passing over files that are pinned. Locks die with their
    process, so a crashed reader pins nothing. This relies on POSIX `flock`, which local
    filesystems and NFS support.

    Args:
        root: Cache directory; defaults to [`default_cache_dir`].

    Example:
        ```python
        >>> cache = DownloadCache()
        >>> local = cache.fetch(bucket, "deltas/step_00000002.safetensors")
        >>> data = local.read_bytes()  # stays on disk whatever other processes prune
        >>> cache.release()
        ```
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        # Cached file -> descriptor of its lock file, held shared while pinned.
        self._pins: dict[Path, int] = {}
        self._pins_lock = threading.Lock()

    def _bucket_dir(self, bucket: Bucket) -> Path:
        return self.root / hashlib.sha256(bucket.url.encode()).hexdigest()[:16]

    def _namespace_dir(self, bucket: Bucket, namespace: str) -> Path:
        base = self._bucket_dir(bucket)
        return base / (_NAMESPACE_PREFIX + hashlib.sha256(namespace.encode()).hexdigest()[:12]) if namespace else base

    def fetch(self, bucket: Bucket, path: str, namespace: str = "", *, max_bytes: int | None = None) -> Path:
        """Local path of the bucket file `path`, downloading it if the cache lacks it.

        The file stays on disk until this cache's next [`prune`] or [`release`], whatever
        other processes sharing the directory prune meanwhile.

        Args:
            bucket: The bucket holding the file.
            path: The file's path inside the bucket.
            namespace: Which identity of the path is meant (e.g. a run and its start).
            max_bytes: Refuse a file larger than this, before downloading more of it.

        Raises:
            BucketFileNotFoundError: The bucket has no such file.
            OversizedFileError: It is larger than `max_bytes` (a cached copy too).
            BucketPathError: The path escapes the bucket (or, for a local bucket, is not
                a regular file inside it).
        """
        path = clean_path(path)
        bucket.local_path(path)  # a local bucket refuses what is not a regular file inside it
        if any(len(part.encode()) > _MAX_NAME_BYTES for part in path.split("/")):
            raise BucketPathError(f"{bucket.url}: {path[:80]!r}... has a name longer than {_MAX_NAME_BYTES} bytes")
        dest = self._namespace_dir(bucket, namespace) / path
        with self._pins_lock:
            pinned = dest in self._pins
        if pinned:
            bucket.check_size(path, dest.stat().st_size, max_bytes)  # fetched before, maybe under a looser bound
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock_path(dest)
        while True:
            fd = _lock(lock, fcntl.LOCK_SH)
            if not dest.is_file():
                # Absent (or pruned since): download under the exclusive lock, then read shared.
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                fd = _lock(lock, fcntl.LOCK_EX)
                try:
                    if not dest.is_file():
                        bucket.download(path, dest, max_bytes=max_bytes)
                except BaseException:
                    lock.unlink(missing_ok=True)  # held exclusively: nobody is left pinning it
                    raise
                finally:
                    os.close(fd)
                continue
            self._pin(dest, fd)
            bucket.check_size(
                path, dest.stat().st_size, max_bytes
            )  # cached by another process, maybe under a looser bound
            return dest

    def release(self) -> None:
        """Unpin every file this cache fetched, so that any process's prune may delete it."""
        with self._pins_lock:
            pins, self._pins = self._pins, {}
        for fd in pins.values():
            os.close(fd)

    def prune(self, bucket: Bucket, keep: Callable[[str], bool], namespace: str = "") -> int:
        """Delete cached files of `bucket` whose bucket path `keep` rejects, and those of
        other namespaces; returns how many.

        Releases this cache's own pins first (call it once done with what was fetched).
        Files that another cache object, in this process or another, still pins are
        passed over; a later prune deletes them.

        Args:
            bucket: The bucket whose cached files to consider.
            keep: Given a file's path inside the bucket, whether to keep it.
            namespace: The namespace in use; cached files of any other are deleted.
        """
        self.release()
        base = self._bucket_dir(bucket)
        current = self._namespace_dir(bucket, namespace)
        if not base.is_dir():  # nothing cached
            return 0
        removed = 0
        for file in sorted(base.rglob("*")):
            if file.name.startswith(".") or not file.is_file():
                continue  # a download in progress
            if file.name.endswith(_LOCK_SUFFIX):
                data = file.with_name(file.name[: -len(_LOCK_SUFFIX)])
                if not data.exists():  # left by a process that died downloading
                    _remove_unpinned(data)
            elif not _kept(file, base, current, keep) and _remove_unpinned(file):
                removed += 1
        return removed

    def _pin(self, dest: Path, fd: int) -> None:
        with self._pins_lock:
            if dest in self._pins:  # pinned meanwhile by another thread
                os.close(fd)
            else:
                self._pins[dest] = fd


_NAMESPACE_PREFIX = "ns-"
# File systems allow 255 bytes per name; the lock file adds its suffix.
_MAX_NAME_BYTES = 255 - len(_LOCK_SUFFIX)


def _kept(file: Path, base: Path, current: Path, keep: Callable[[str], bool]) -> bool:
    if current != base and not file.is_relative_to(current):
        return False  # another namespace: a rewritten past
    if current == base and file.relative_to(base).parts[0].startswith(_NAMESPACE_PREFIX):
        return False
    return keep(file.relative_to(current).as_posix())


def _lock_path(file: Path) -> Path:
    return file.with_name(file.name + _LOCK_SUFFIX)


def _lock(lock: Path, operation: int) -> int:
    """A descriptor of `lock` (created if absent) holding `operation` (`LOCK_SH`, `LOCK_EX`,
    optionally `| LOCK_NB`) on the file that is at that path once the lock is held.

    A pruner deletes a lock file while holding it exclusively; whoever opened the deleted
    file meanwhile gets the lock on an orphan, sees it, and starts over.

    Raises:
        BlockingIOError: `LOCK_NB` was given and the lock is held by someone else.
    """
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the umask decides
        try:
            fcntl.flock(fd, operation)
            held = os.fstat(fd)
            try:
                current = os.stat(lock)
            except FileNotFoundError:
                current = None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


def _remove_unpinned(file: Path) -> bool:
    """Delete a cached file and its lock file unless some process pins it; whether it did."""
    try:
        fd = _lock(_lock_path(file), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        file.unlink(missing_ok=True)
        _lock_path(file).unlink()
    finally:
        os.close(fd)
    return True

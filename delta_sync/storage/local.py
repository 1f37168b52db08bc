"""`LocalBucket`: a directory on a local or shared filesystem; the embedded default."""

from __future__ import annotations

import errno
import filecmp
import os
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import BucketError, BucketPathError, BucketPermissionError
from .base import Bucket, clean_path, replace_when_complete
from .progress import copy_with_progress

__all__ = ["MAX_READ_BYTES", "LocalBucket"]

#: The most bytes [`LocalBucket.read_bytes`] returns: `latest.json` and manifests are a few
#: kilobytes, so a larger file is refused before it is read (a link to `/dev/zero` or a
#: huge file must not exhaust memory).
MAX_READ_BYTES = 16 << 20

# The longest name of one path segment local filesystems accept (NAME_MAX).
_NAME_MAX = 255

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
# A FIFO opened without O_NONBLOCK waits for a writer; refused anyway once opened.
_FILE_FLAGS = _READ_FLAGS | os.O_NOFOLLOW | os.O_NONBLOCK
_DIR_FLAGS = _READ_FLAGS | os.O_NOFOLLOW | os.O_DIRECTORY


class LocalBucket(Bucket):
    """A bucket stored in a local directory.

    Writes go to a temporary file in the destination's directory and are renamed into
    place, so readers never see a partial file, even on a shared filesystem.

    Reads accept only regular files inside the directory: a symbolic link (anywhere below
    the root), a FIFO, a device or a directory where a file is expected is refused with a
    [`BucketPathError`] naming the path, without reading from it. [`read_bytes`] refuses
    files larger than `max_read_bytes`.

    Args:
        root: A directory path or a `file://` URL. Created on first write.

    Example:
        ```python
        >>> bucket = LocalBucket("./deltas")
        >>> bucket.upload("latest.json", b"{}")
        >>> bucket.list()
        ['latest.json']
        ```
    """

    def __init__(self, root: str | os.PathLike) -> None:
        root = os.fspath(root)
        if root.startswith("file://"):
            parsed = urlparse(root)
            root = unquote(parsed.netloc + parsed.path)
        self.root = Path(root).expanduser().resolve()
        self.url = self.root.as_uri()
        #: The largest file [`read_bytes`] returns, in bytes.
        self.max_read_bytes = MAX_READ_BYTES

    def _file(self, path: str) -> Path:
        return self.root.joinpath(*self._segments(path))

    def _segments(self, path: str) -> list[str]:
        """The checked segments of `path`; each must fit in one directory entry."""
        segments = clean_path(path).split("/")
        for segment in segments:
            if len(os.fsencode(segment)) > _NAME_MAX:
                raise BucketPathError(f"{self.url}: {path!r} has a name longer than {_NAME_MAX} bytes")
        return segments

    def local_path(self, path: str) -> Path:
        """The file's path on disk, once checked to be a regular file inside the bucket.

        Raises:
            BucketFileNotFoundError: No file at `path`.
            BucketPathError: `path` is a symbolic link, passes through one, or is not a
                regular file.
        """
        os.close(self._open(path))
        return self._file(path)

    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        dest = self._file(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # A fresh name opened O_EXCL, as mkstemp does, but 0666 less the umask (0644 by
        # default) rather than mkstemp's 0600, which replicas running as another user cannot read.
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            with os.fdopen(fd, "wb") as out:
                if isinstance(source, (bytes, bytearray, memoryview)):
                    out.write(source)
                else:
                    with open(source, "rb") as src:
                        copy_with_progress(src, out, f"upload {path}", os.fstat(src.fileno()).st_size)
                out.flush()
                os.fsync(out.fileno())
            if overwrite:
                os.replace(tmp, dest)
            else:
                # link() fails if dest exists: an atomic create-if-absent, even between processes.
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    # The same content is not a conflict: a retried write meeting its own first try.
                    if not filecmp.cmp(tmp, dest, shallow=False):
                        raise self._conflict(path) from None
                Path(tmp).unlink()
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def download(self, path: str, dest: os.PathLike, *, max_bytes: int | None = None) -> None:
        with os.fdopen(self._open(path), "rb") as source, replace_when_complete(dest) as tmp:
            size = os.fstat(source.fileno()).st_size
            self.check_size(path, size, max_bytes)
            with open(tmp, "wb") as out:
                copied = copy_with_progress(source, out, f"download {path}", size, limit=max_bytes)
            self.check_size(path, copied, max_bytes)  # it grew while being copied

    def read_bytes(self, path: str) -> bytes:
        """Return the content of the file at `path`.

        Raises:
            BucketFileNotFoundError: No file at `path`.
            BucketPathError: `path` is not a regular file inside the bucket.
            BucketError: The file is larger than `max_read_bytes`.
        """
        with os.fdopen(self._open(path), "rb") as source:
            size = os.fstat(source.fileno()).st_size
            # Read one byte more than allowed: a file that grows after fstat is caught too.
            data = source.read(self.max_read_bytes + 1) if size <= self.max_read_bytes else b""
        if size > self.max_read_bytes or len(data) > self.max_read_bytes:
            raise BucketError(f"{self.url}: {path!r} is larger than {self.max_read_bytes:,} bytes ({size:,}); refused")
        return data

    def list(self, prefix: str = "") -> list[str]:
        base = self._file(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        found = []
        for dirpath, _, filenames in os.walk(base):
            for filename in filenames:
                if filename.startswith(".") and filename.endswith(".tmp"):
                    continue
                found.append((Path(dirpath) / filename).relative_to(self.root).as_posix())
        return sorted(found)

    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._file(path).unlink(missing_ok=True)

    # -- reading only regular files inside the root -----------------------------------------

    def _open(self, path: str) -> int:
        """A read-only descriptor of the regular file at `path`.

        Each directory below the root is opened relative to its parent without following
        symbolic links, so nothing outside the root is reached. Each entry's type is
        checked before it is opened (a device or FIFO is never opened) and again on the
        open descriptor (the entry may have been replaced in between).
        """
        segments = self._segments(path)
        try:
            directory = os.open(self.root, _READ_FLAGS | os.O_DIRECTORY)
        except FileNotFoundError:
            raise self._not_found(path) from None
        except OSError as exc:
            raise self._refused(path, exc) from None
        try:
            for depth, segment in enumerate(segments):
                last = depth == len(segments) - 1
                self._check_type(path, segment, os.stat(segment, dir_fd=directory, follow_symlinks=False).st_mode, last)
                fd = os.open(segment, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=directory)
                os.close(directory)
                directory = fd
                self._check_type(path, segment, os.fstat(fd).st_mode, last)
        except BaseException as exc:
            os.close(directory)
            if isinstance(exc, FileNotFoundError):
                raise self._not_found(path) from None
            if isinstance(exc, OSError):
                raise self._refused(path, exc) from None
            raise
        return directory

    def _check_type(self, path: str, segment: str, mode: int, last: bool) -> None:
        """Refuse anything but a directory on the way and a regular file at the end."""
        if last and not stat.S_ISREG(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise BucketPathError(f"{self.url}: {path!r} is {kind}; a local bucket serves only regular files")
        if not last and not stat.S_ISDIR(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a directory")
            raise BucketPathError(f"{self.url}: {path!r} passes through {segment!r}, {kind}, not a directory")

    def _refused(self, path: str, exc: OSError) -> BucketError:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced by a link or file after the check
            return BucketPathError(f"{self.url}: {path!r} changed into a symbolic link or file while opened")
        if isinstance(exc, PermissionError):
            return BucketPermissionError(f"{self.url}: may not read {path!r}: {exc.strerror}")
        return BucketError(f"{self.url}: cannot read {path!r}: {exc.strerror or exc}")


_FILE_KINDS = {
    stat.S_IFREG: "a file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}

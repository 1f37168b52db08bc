"""`LocalBucket`: a directory on a local or shared filesystem; the embedded default."""

from __future__ import annotations

import filecmp
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

from .base import Bucket, clean_path, replace_when_complete
from .progress import copy_with_progress

__all__ = ["LocalBucket"]


class LocalBucket(Bucket):
    """A bucket stored in a local directory.

    Writes go to a temporary file in the destination's directory and are renamed into
    place, so readers never see a partial file, even on a shared filesystem.

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

    def _file(self, path: str) -> Path:
        return self.root / clean_path(path)

    def local_path(self, path: str) -> Path | None:
        return self._file(path)

    def upload(self, path: str, source: bytes | os.PathLike, *, overwrite: bool = True) -> None:
        dest = self._file(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
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

    def download(self, path: str, dest: os.PathLike) -> None:
        src = self._file(path)
        with replace_when_complete(dest) as tmp:
            try:
                with open(src, "rb") as source, open(tmp, "wb") as out:
                    copy_with_progress(source, out, f"download {path}", os.fstat(source.fileno()).st_size)
            except FileNotFoundError:
                raise self._not_found(path) from None

    def read_bytes(self, path: str) -> bytes:
        try:
            return self._file(path).read_bytes()
        except FileNotFoundError:
            raise self._not_found(path) from None

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

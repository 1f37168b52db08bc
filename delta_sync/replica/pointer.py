"""The newest `latest.json` a replica accepted from each bucket: pointers only move forward.

A signature proves that the trainer wrote a pointer, not that it is the newest one: an
attacker who can write the bucket could put an older, genuinely signed `latest.json` back
(a rollback, or the abandoned epoch of a resumed run). Every pointer carries a `sequence`
that only increases over the life of a bucket prefix; a replica remembers the highest it
accepted, per bucket, on disk next to its download cache (so a restart does not forget,
and the tensor-parallel workers of one server share it), and refuses anything lower. A
legitimate resume is a *newer* pointer naming the rewind (its `epoch_start`), which
replicas follow.

Example:
    ```python
    >>> ledger = PointerLedger(Path("~/.cache/delta-sync").expanduser())
    >>> ledger.accept("hf://buckets/me/run1", latest)   # raises ReplayError if older than the last
    >>> ledger.newest("hf://buckets/me/run1").sequence
    1764590000123456
    ```
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ReplayError
from ..layout import Latest

__all__ = ["AcceptedPointer", "PointerLedger"]

_DIRECTORY = "pointers"
# What each field of a stored record must be: a record of other types is refused, not compared.
_FIELD_TYPES = {
    "bucket": (str,),
    "sequence": (int,),
    "digest": (str,),
    "version": (int,),
    "run_id": (str,),
    "epoch": (str,),
    "written_at": (int, float),
}


@dataclass(frozen=True)
class AcceptedPointer:
    """What a replica remembers of the newest pointer it accepted from a bucket.

    Args:
        bucket: The bucket (see `delta_sync.signing.bucket_identity`).
        sequence: The pointer's `sequence`.
        digest: SHA-256 of what the pointer says ([`Latest.digest`]).
        version: The version it named.
        run_id: Its run.
        epoch: Its run's start.
        written_at: When the trainer wrote it.
    """

    bucket: str
    sequence: int
    digest: str
    version: int
    run_id: str
    epoch: str
    written_at: float

    @classmethod
    def of(cls, bucket: str, latest: Latest) -> AcceptedPointer:
        return cls(
            bucket, latest.sequence, latest.digest(), latest.version, latest.run_id, latest.epoch, latest.written_at
        )


class PointerLedger:
    """Remembers, per bucket, the newest pointer accepted, and refuses older ones.

    Args:
        root: The directory to keep the record in (a `pointers/` directory is made under
            it); None keeps it in this process only.
    """

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = None if root is None else Path(root) / _DIRECTORY
        self._memory: dict[str, AcceptedPointer] = {}
        self._lock = threading.Lock()

    def newest(self, bucket: str) -> AcceptedPointer | None:
        """The newest pointer accepted from `bucket` by any process sharing the record."""
        with self._lock:
            return self._load(bucket)

    def accept(self, bucket: str, latest: Latest, *, source: str = "latest.json") -> None:
        """Record `latest` as the bucket's newest pointer, unless an accepted one is newer.

        Args:
            bucket: The bucket it was read from.
            latest: The pointer, its signature already checked.
            source: Names the file in errors.

        Raises:
            ReplayError: `latest` is older than the newest accepted, or says something else
                under the same sequence; the record is unchanged.
        """
        with self._lock, self._locked(bucket):
            current = self._load(bucket)
            if current is not None:
                if latest.sequence < current.sequence:
                    raise ReplayError(
                        f"{source}: a pointer older than one this replica already accepted (sequence "
                        f"{latest.sequence} naming v{latest.version} of run {latest.run_id}, epoch "
                        f"{latest.epoch or '-'}; accepted: sequence {current.sequence} naming v{current.version} "
                        f"of run {current.run_id}, epoch {current.epoch or '-'}): an old latest.json was put back, "
                        "refused; the replica keeps what it serves (the trainer's next pointer is newer)"
                    )
                if latest.sequence == current.sequence:
                    if latest.digest() != current.digest:
                        raise ReplayError(
                            f"{source}: says something else than the pointer this replica accepted under the "
                            f"same sequence {latest.sequence}: refused"
                        )
                    return
            self._store(AcceptedPointer.of(bucket, latest))

    # -- the record on disk ---------------------------------------------------------------

    def _file(self, bucket: str) -> Path | None:
        if self.root is None:
            return None
        return self.root / f"{hashlib.sha256(bucket.encode()).hexdigest()[:16]}.json"

    def _locked(self, bucket: str):
        return _FileLock(None if (file := self._file(bucket)) is None else file.with_suffix(".lock"))

    def _load(self, bucket: str) -> AcceptedPointer | None:
        remembered = self._memory.get(bucket)
        file = self._file(bucket)
        if file is None:
            return remembered
        try:
            fields = json.loads(file.read_bytes())
            stored = AcceptedPointer(**fields)
            for name, kinds in _FIELD_TYPES.items():
                if type(getattr(stored, name)) not in kinds:
                    raise TypeError(f"{name!r} is a {type(getattr(stored, name)).__name__}")
        except FileNotFoundError:
            return remembered
        except (ValueError, TypeError, RecursionError) as exc:
            # A record this library did not write: never forget forward, so refuse to guess.
            raise ReplayError(
                f"{file}: the record of accepted pointers is unreadable ({exc}); remove it to reset"
            ) from None
        if stored.bucket != bucket:
            raise ReplayError(f"{file}: records bucket {stored.bucket!r}, not {bucket!r}; remove it to reset")
        if remembered is not None and remembered.sequence > stored.sequence:
            return remembered  # the file went back (restored from a backup?): this process knows better
        return stored

    def _store(self, accepted: AcceptedPointer) -> None:
        self._memory[accepted.bucket] = accepted
        file = self._file(accepted.bucket)
        if file is None:
            return
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(asdict(accepted), sort_keys=True) + "\n")
        os.replace(tmp, file)


class _FileLock:
    """An exclusive `flock` on a lock file (nothing when there is no file): one writer of a
    bucket's record at a time among the processes sharing it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> _FileLock:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None

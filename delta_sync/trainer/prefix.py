"""The bucket prefix a run writes to: claiming it, resuming in it, and [`PointerWriter`].

A bucket prefix belongs to one run. [`claim_prefix`] runs first, on the training thread,
before any version is written: a prefix that holds another run's files is refused (or
emptied, with `overwrite`), and one that holds this run's files is a resumed run. A resumed
run writes its versions again from the first one it publishes: [`resume_at`] first steps
`latest.json` back to the newest version still complete before that one, then deletes the
abandoned files, so that the pointer never names a file that is gone.

[`PointerWriter`] is what every kind of version is stored with, whichever publisher
writes it: signed uploads, and `latest.json` under a counter that only increases, carried
on from the pointer already stored (replicas refuse an older counter; see
`delta_sync.replica.pointer`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ..errors import DeltaSyncError, PublishError
from ..format import FileHeader, read_file
from ..layout import LATEST, Latest, is_manifest, parse_step_path, version_files
from ..manifest import Manifest
from ..signing import SIGNATURE_SUFFIX, SignedFile, SigningKey, bucket_identity, file_sha256
from ..storage import Bucket
from ..version import VersionId

__all__ = ["PointerWriter", "claim_prefix", "resume_at"]

logger = logging.getLogger(__name__)


class PointerWriter:
    """What every kind of version is stored with: signed uploads, and `latest.json` with a
    counter that only increases (rank 0 writes the pointer). [`VersionWriter`] stores
    anchors and deltas with it (`delta_sync.trainer.writer`); `delta_sync.trainer.adapter` stores
    PEFT adapters.

    Args:
        bucket: Where to write.
        signing_key: Signs every file replicas act on, or None.
        bucket_id: The bucket's name in signed statements (see
            `delta_sync.signing.bucket_identity`).
        rank: This process's rank among those writing the version (only rank 0 points).
    """

    def __init__(
        self, bucket: Bucket, *, signing_key: SigningKey | None, bucket_id: str | None = None, rank: int = 0
    ) -> None:
        self.bucket = bucket
        self.signing_key = signing_key
        self.rank = rank
        self.bucket_identity = bucket_identity(bucket.url, bucket_id)
        # The pointer's counter goes on from the one stored, whoever wrote it.
        self._sequence = _stored_sequence(bucket) if rank == 0 else 0
        self._pointer: Latest | None = None
        #: When `latest.json` was last written (time.monotonic()), or None.
        self.pointer_written: float | None = None

    def _upload_signature(self, path: str, sha256: str, size: int, id: VersionId) -> None:
        assert self.signing_key is not None
        about = SignedFile(path, sha256, size, self.bucket_identity, id.run_id, id.epoch)
        # Overwritable: a retry of a version whose file never landed signs it again.
        self.bucket.upload(path + SIGNATURE_SUFFIX, self.signing_key.sign(about).to_json())

    def _point(self, latest: Latest) -> int:
        """Write `latest.json` (rank 0), counted on from the last pointer and timed now; returns its size."""
        self._sequence = max(self._sequence + 1, time.time_ns() // 1000)
        latest = replace(latest, sequence=self._sequence, written_at=time.time(), bucket=self.bucket_identity)
        data = latest.to_json(self.signing_key)
        self.bucket.upload(LATEST, data)
        self._pointer = latest
        self.pointer_written = time.monotonic()
        return len(data)

    def refresh_pointer(self) -> bool:
        """Write the last pointer again with a new counter and time, so replicas can tell a
        live trainer with nothing to publish from a pointer held back (rank 0; returns
        whether it wrote one)."""
        if self.rank != 0 or self._pointer is None:
            return False
        self._point(self._pointer)
        return True

    def withdraw_pointer(self) -> None:
        """Delete `latest.json` (a resumed run's pointer, before the files it names go); the
        next version stored points anew."""
        self.bucket.delete([LATEST])
        self._pointer = None

    def store_signed(self, path: str, local: Path, id: VersionId) -> int:
        """Store one file replicas act on, written once: its signature first (with a key), so
        that no stored file is ever unsigned. Returns the file's size.

        Args:
            path: Its path in the bucket.
            local: The file to upload.
            id: The version it belongs to (its run and epoch are signed).
        """
        size = local.stat().st_size
        if self.signing_key is not None:
            self._upload_signature(path, file_sha256(local), size, id)
        self.bucket.upload(path, local, overwrite=False)
        return size


def claim_prefix(bucket: Bucket, run_id: str, *, overwrite: bool) -> list[str]:
    """Claim a bucket prefix for run `run_id`; return the files of this run found there.

    A prefix holding no version file is free. One holding files of `run_id` is a resumed
    run: its files (returned) are replaced from the first version stored now. Another run's
    files are deleted with `overwrite`, else refused.

    Raises:
        PublishError: The prefix holds another run's files and `overwrite` is False.
    """
    existing = [path for path in bucket.list() if path == LATEST or parse_step_path(path)]
    if not existing:
        return []
    owner = _owner(bucket, existing)
    if owner == run_id:
        # Resuming this run: files of versions at or after the first one published now
        # belong to an abandoned trajectory and are replaced then (see `_rewind`).
        return [path for path in existing if path != LATEST]
    if not overwrite:
        raise PublishError(
            f"{bucket.url} already holds {len(existing)} file(s) of run {owner or 'unknown'}; "
            "use another prefix, pass the same run_id to resume that run, or overwrite=True to delete them"
        )
    logger.warning("delta-sync: deleting %d file(s) of run %s from %s", len(existing), owner, bucket.url)
    bucket.delete([path for path in existing if path != LATEST])
    bucket.delete([LATEST])
    return []


def resume_at(writer: PointerWriter, resumed: list[str], version: int) -> None:
    """Delete a resumed run's anchors and deltas of `version` and later, before `version` is written again.

    `latest.json` first steps back to the newest complete version before `version` (or
    goes, if there is none), so that a crash in the middle of the deletions never leaves
    it naming a file that is gone.

    Args:
        writer: The writer of the resumed run (rank 0's: it moves the pointer).
        resumed: The run's files [`claim_prefix`] found.
        version: The first version this start of the run stores.
    """
    stale = [path for path in resumed if (parse_step_path(path) or ("", 0))[1] >= version]
    if not stale:
        return
    kept = [path for path in resumed if path not in stale]
    logger.warning("delta-sync: resuming at v%d, deleting %d later file(s) of this run", version, len(stale))
    retreat = _newest_complete(writer.bucket, kept)
    if retreat is None:
        writer.withdraw_pointer()
    else:
        writer._point(retreat)
    writer.bucket.delete(stale)


def _owner(bucket: Bucket, existing: list[str]) -> str | None:
    """The run that wrote a prefix's files: `latest.json`'s, or, when a crash came before
    the first pointer, that of a version file itself."""
    try:
        return Latest.from_json(bucket.read_bytes(LATEST)).run_id
    except DeltaSyncError:
        pass
    for kind in ("delta", "anchor"):  # deltas first: they are the small ones
        for path in version_files(existing, kind).values():
            try:
                return _stored_header(bucket, path).run_id
            except DeltaSyncError:
                continue
    return None


def _stored_sequence(bucket: Bucket) -> int:
    """The counter of the bucket's `latest.json`, or 0 (none, or unreadable)."""
    try:
        return Latest.from_json(bucket.read_bytes(LATEST)).sequence
    except DeltaSyncError:
        return 0


def _stored_header(bucket: Bucket, path: str) -> Manifest | FileHeader:
    """The header of a stored version file (a manifest, or a single file's metadata)."""
    if is_manifest(path):
        return Manifest.from_json(bucket.read_bytes(path), source=f"{bucket.url}/{path}")
    with tempfile.TemporaryDirectory(prefix="delta-sync-header-") as tmp:
        local = Path(tmp) / "file"
        bucket.download(path, local)
        with read_file(local, source=f"{bucket.url}/{path}") as file:
            return file.header


def _newest_complete(bucket: Bucket, paths: list[str]) -> Latest | None:
    """The pointer to the newest version that `paths` hold completely (its anchor and the
    unbroken chain of deltas after it), or None."""
    anchors, deltas = version_files(paths, "anchor"), version_files(paths, "delta")
    if not anchors:
        return None
    anchor = max(anchors)
    version = anchor
    while version + 1 in deltas:
        version += 1
    path = deltas[version] if version > anchor else anchors[anchor]
    header = _stored_header(bucket, path)
    return Latest(
        id=VersionId(version, anchor, header.run_id, header.epoch),
        anchor=anchors[anchor],
        delta=deltas[version] if version > anchor else None,
        model_checksum=header.model_checksum,
    )

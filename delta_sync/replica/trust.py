"""[`BucketReader`]: what a replica reads from a bucket, and what it trusts of it.

One object holds a replica's trust configuration and every read that depends on it, so
that the receiver (anchors, deltas, versions in parts) and the adapter fetcher (adapter
mode) follow the same rules:

* the bucket must be on the allow list ([`BucketReader.open`]);
* with a verify key, `latest.json` must be signed for this bucket and be no older than
  the newest pointer accepted from it ([`BucketReader.read_latest`]), and every file must
  carry its signature, by that key, for its path in this bucket; a signed file is
  downloaded no further than its signed size and its SHA-256 checked
  ([`BucketReader.read_signature`], [`BucketReader.download`]);
* without a key, a file is downloaded no further than the model's shapes allow (a full
  anchor, or every element changed for a delta, plus a bounded header), once the shapes
  are known ([`BucketReader.open_version`]).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote

from ..control import ALLOWED_BUCKETS_ENV
from ..errors import BucketFileNotFoundError, FormatError, OversizedFileError, SignatureError, UntrustedBucketError
from ..format import Anchor, DeltaFile, read_file
from ..layout import LATEST, Latest, is_manifest, is_part, parse_step_path
from ..manifest import MAX_MANIFEST_BYTES, Manifest, PartRecord, read_version
from ..signing import SIGNATURE_SUFFIX, VERIFY_KEY_ENV, FileSignature, VerifyKey, bucket_identity, file_sha256
from ..storage import Bucket, open_bucket
from ..storage.cache import DownloadCache
from .pointer import PointerLedger

__all__ = ["BucketReader"]

logger = logging.getLogger(__name__)

# What a file may hold besides its tensors' bytes (safetensors header, metadata), when
# its size is bounded from the model's shapes rather than a signature.
_HEADER_ALLOWANCE = 1 << 20
_HEADER_PER_TENSOR = 4 << 10
# A delta of every element, with int64 positions: more than any encoding of it takes.
_DELTA_BYTES_PER_ELEMENT = 8 + 2
_MAX_SIGNATURE_BYTES = 4096


class BucketReader:
    """Reads pointers and versions from the buckets a replica trusts, as it trusts them.

    Args:
        allowed_buckets: Bucket URL prefixes that may be read; None allows any.
        verify_key: Read only what the trainer's key signed; None trusts the bucket as is
            (said once in the log).
        cache: Where downloads go.
        bucket_id: The name the trainer's signatures give the bucket; None: its URL (see
            `delta_sync.signing.bucket_identity`).
        pointers: Where the newest pointer accepted from each bucket is remembered (with a
            verify key, an older one is refused).
        shapes: The model's checkpoint shapes when known (empty until the first anchor
            defines them), which bound what an unsigned file may weigh.

    Example:
        ```python
        >>> reader = BucketReader(allowed_buckets=["s3://ckpts"], verify_key=None, cache=DownloadCache(),
        ...                       bucket_id=None, pointers=PointerLedger(cache_root), shapes=lambda: {})
        >>> bucket = reader.open("s3://ckpts/run1")
        >>> reader.read_latest(bucket).version
        12
        ```
    """

    def __init__(
        self,
        *,
        allowed_buckets: Iterable[str] | None,
        verify_key: VerifyKey | None,
        cache: DownloadCache,
        bucket_id: str | None,
        pointers: PointerLedger,
        shapes: Callable[[], Mapping[str, tuple[int, ...]]],
    ) -> None:
        self.allowed_buckets = None if allowed_buckets is None else [_normalise_url(u) for u in allowed_buckets]
        self.verify_key = verify_key
        if verify_key is None:
            _warn_unsigned_once()
        self.cache = cache
        self.bucket_id = bucket_id
        self.pointers = pointers
        self._shapes = shapes

    def open(self, bucket: Bucket | str | os.PathLike) -> Bucket:
        """Open `bucket` (an open [`Bucket`] is returned as is), refusing it unless it is on
        the allow list.

        Raises:
            UntrustedBucketError: It is not on the allow list, or its path has a dot segment.
        """
        opened = open_bucket(bucket)
        if self.allowed_buckets is not None:
            url = _normalise_url(opened.url)
            if not self.allowed_buckets:
                raise UntrustedBucketError(
                    f"bucket {_shown(opened.url)} refused: this receiver trusts no bucket yet "
                    f"(for a vLLM server, set {ALLOWED_BUCKETS_ENV})"
                )
            if not any(url == allowed or url.startswith(allowed + "/") for allowed in self.allowed_buckets):
                raise UntrustedBucketError(
                    f"bucket {_shown(opened.url)} is not on this receiver's allow list "
                    f"({', '.join(_shown(allowed) for allowed in self.allowed_buckets)}): "
                    f"publish to one of those, or add it to the list ({ALLOWED_BUCKETS_ENV} on a vLLM server, "
                    "comma-separated; relative paths there resolve against the server's working directory)"
                )
        return opened

    def identity(self, bucket: Bucket) -> str:
        """The name signatures give `bucket` (see `delta_sync.signing.bucket_identity`)."""
        return bucket_identity(bucket.url, self.bucket_id)

    def read_latest(self, bucket: Bucket) -> Latest:
        """The bucket's pointer; with a verify key, only one signed for this bucket and no
        older than the newest accepted from it (which it then becomes).

        Raises:
            DeltaSyncError: `latest.json` is missing, malformed, unsigned, signed for
                another bucket, or older than a pointer accepted before.
        """
        source = f"{bucket.url}/{LATEST}"
        identity = self.identity(bucket)
        latest = Latest.from_json(bucket.read_bytes(LATEST), source=source, verify_key=self.verify_key, bucket=identity)
        if self.verify_key is not None:
            self.pointers.accept(identity, latest, source=source)
        return latest

    def read_signature(self, bucket: Bucket, path: str) -> FileSignature | None:
        """With a verify key: the signature of `bucket`'s file `path`, read (at most a few
        KiB) and checked against the key, the path and this bucket (the file's own digest
        is for the caller to check once it is fetched); None without a key.

        Raises:
            SignatureError: The file is not signed, or not by this key for this path and bucket.
        """
        if self.verify_key is None:
            return None
        source = f"{bucket.url}/{path}{SIGNATURE_SUFFIX}"
        with tempfile.TemporaryDirectory(prefix="delta-sync-sig-") as tmp:
            local = Path(tmp) / "sig"
            try:
                bucket.download(path + SIGNATURE_SUFFIX, local, max_bytes=_MAX_SIGNATURE_BYTES)
            except BucketFileNotFoundError:
                raise SignatureError(
                    f"{bucket.url}/{path}: not signed, but this replica only trusts signed versions"
                ) from None
            signature = FileSignature.from_json(local.read_bytes(), source=source)
        self.verify_key.verify(signature, path=path, bucket=self.identity(bucket))
        return signature

    def download(
        self, bucket: Bucket, path: str, local: Path, *, signature: FileSignature | None, unsigned_limit: int | None
    ) -> None:
        """Download one file to `local`: no further than its signed size and checked against
        its signed digest when `signature` is given (from [`read_signature`]), else no
        further than `unsigned_limit` bytes (None: no bound).

        Raises:
            SignatureError: The file is larger than signed, or not the file signed.
            OversizedFileError: An unsigned file is larger than `unsigned_limit`.
            BucketFileNotFoundError: The file is not there.
        """
        limit = signature.size if signature is not None else unsigned_limit
        try:
            bucket.download(path, local, max_bytes=limit)
        except OversizedFileError as exc:
            if signature is None:
                raise
            raise SignatureError(
                f"{bucket.url}/{path}: larger than the {limit:,} bytes signed: not the one signed"
            ) from exc
        if signature is not None:
            signature.check_digest(file_sha256(local))

    def open_version(self, bucket: Bucket, path: str, namespace: str = "") -> Anchor | DeltaFile:
        """Fetch (through the download cache) and read one version of `bucket`: a single file,
        or a manifest and all its parts, checked by the format gate but not applied.

        Use it as a context manager. Raises what `delta_sync.format.read_file` and
        `delta_sync.manifest.read_version` raise, and `BucketFileNotFoundError`.

        Args:
            bucket: The bucket.
            path: A single file's or a manifest's path in it.
            namespace: The download cache's namespace (see `DownloadCache.fetch`).
        """
        source = f"{bucket.url}/{path}"
        if not (path.endswith(".safetensors") or is_manifest(path)):
            raise FormatError(f"{source}: not an anchor, delta or manifest (expected .safetensors or .manifest.json)")
        step = None if is_part(path) else parse_step_path(path)
        # The signature comes first: it says how large the file may be.
        signature = self.read_signature(bucket, path)
        if signature is not None:
            limit = signature.size
        elif is_manifest(path):
            limit = MAX_MANIFEST_BYTES
        else:
            limit = self._size_limit("anchor" if step is None else step[0])
        try:
            local = self.cache.fetch(bucket, path, namespace, max_bytes=limit)
        except OversizedFileError as exc:
            if signature is None:
                raise
            raise SignatureError(f"{source}: larger than the {limit:,} bytes signed: not the one signed") from exc
        if signature is not None:
            signature.check_digest(file_sha256(local))
        if is_manifest(path):
            manifest = Manifest.from_json(local.read_bytes(), source=source)
            part_limit = self._size_limit(manifest.kind)
            parts = [
                (
                    record,
                    self.cache.fetch(bucket, record.path, namespace, max_bytes=self._part_limit(record, part_limit)),
                )
                for record in manifest.parts
            ]
            self._check_parts_signed(parts, source)
            file = read_version(manifest, parts, source=source, base_url=bucket.url)
        else:
            file = read_file(local, source=source)
        if step is not None and (file.header.kind, file.header.version) != step:
            file.close()
            raise FormatError(
                f"{source}: holds {file.header.kind} v{file.header.version}, but its path names {step[0]} v{step[1]}"
            )
        if signature is not None and (signature.about.run_id, signature.about.epoch) != (
            file.header.run_id,
            file.header.epoch,
        ):
            file.close()
            raise SignatureError(
                f"{source}: signed for run {signature.about.run_id} (epoch {signature.about.epoch or '-'}), "
                f"but it holds run {file.header.run_id} (epoch {file.header.epoch or '-'})"
            )
        return file

    def _size_limit(self, kind: str) -> int | None:
        """The most bytes an unsigned file of `kind` may have: its parameters' full bytes
        (an anchor), or every element changed (a delta), plus a bounded header; None while
        the model's shapes are unknown (the first anchor defines them)."""
        shapes = self._shapes()
        if not shapes:
            return None
        elements = sum(math.prod(shape) for shape in shapes.values())
        per_element = 2 if kind == "anchor" else _DELTA_BYTES_PER_ELEMENT
        return elements * per_element + _HEADER_ALLOWANCE + _HEADER_PER_TENSOR * len(shapes)

    def _part_limit(self, record: PartRecord, unsigned_limit: int | None) -> int | None:
        # A signed manifest's sizes are the trainer's; an unsigned one's are anybody's.
        return record.bytes if self.verify_key is not None else unsigned_limit

    def _check_parts_signed(self, parts: list[tuple[PartRecord, Path]], source: str) -> None:
        if self.verify_key is None:
            return
        for record, local in parts:
            if record.sha256 is None or file_sha256(local) != record.sha256:
                raise SignatureError(f"{source}: part {record.path} is not the one the signed manifest names")


_warned_unsigned = False


def _warn_unsigned_once() -> None:
    global _warned_unsigned
    if not _warned_unsigned:
        _warned_unsigned = True
        logger.info(
            "delta-sync: no verify key (%s): files are trusted as the bucket serves them; set it to accept "
            "only versions the trainer signed",
            VERIFY_KEY_ENV,
        )


def _shown(url: str) -> str:
    """A bucket URL as a refusal names it. vLLM's HTTP error answers replace anything that
    looks like a local path with `<path>`, so a local bucket also gets its last two
    components, written so that they survive that (no leading slash): the trainer can still
    tell which of its directories was refused, and what the allow list holds instead."""
    if not url.startswith("file://"):
        return url
    tail = "/".join(url.rstrip("/").split("/")[-2:])
    return f"{url} (ending {tail!r})"


def _normalise_url(url: str) -> str:
    """The URL compared against the allow list: percent-escapes decoded (a store may decode
    them itself), no dot segments, no trailing slash."""
    url = str(url).rstrip("/")
    if "://" not in url:
        return open_bucket(url).url.rstrip("/")
    scheme, _, rest = url.partition("://")
    segments = unquote(rest).split("/")
    if any(segment in (".", "..") for segment in segments):
        raise UntrustedBucketError(
            f"bucket {url} refused: its path has a '.' or '..' segment (decoded: {unquote(rest)})"
        )
    return f"{scheme}://{'/'.join(segments)}"

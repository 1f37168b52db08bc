"""Signed versions: only the holder of the trainer's key can change what replicas serve.

The trainer signs, with an Ed25519 private key, a statement about every file a replica
acts on: its path, SHA-256 and size, and the bucket, run and epoch it was written for.
Each anchor, delta and manifest gets a small signature file next to it
(`deltas/step_00000002.safetensors.sig`), stored before the file itself, and `latest.json`
carries its own signature. A manifest records the SHA-256 of each of its parts, so one
signature covers a whole version. A replica configured with the matching public key reads
the signature first (so a file is never downloaded past its signed size), then checks the
file's digest before it reads anything else from it, and refuses unsigned files, files
signed by another key, and files signed for another bucket. Replicas hold only the public
key: they cannot sign.

A bucket is named in signed statements by its URL (`hf://buckets/me/run1`,
`s3://weights/run1`, `file:///data/run1`), or by the name `DELTA_SYNC_BUCKET_ID` gives it,
on the trainer and on replicas alike (for a directory that trainer and replicas mount at
different paths).

Keys are plain PEM files made by `delta-sync keygen DIR` (`delta-sync.key`, private, and
`delta-sync.pub`), passed by path, or as PEM text in an environment variable (a Space
secret): `DELTA_SYNC_SIGNING_KEY` on the trainer, `DELTA_SYNC_VERIFY_KEY` on replicas.

Example:
    ```python
    >>> signing_key = SigningKey.generate()
    >>> path, local = "deltas/step_00000002.safetensors", "step_00000002.safetensors"
    >>> about = SignedFile(path, file_sha256(local), os.path.getsize(local), "file:///data/run1", "run-a", "e1")
    >>> signature = signing_key.sign(about)
    >>> signing_key.verify_key.verify(signature, path=path, bucket="file:///data/run1")
    >>> signature.check_digest(file_sha256(local))
    ```
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import FormatError, SignatureError

__all__ = [
    "BUCKET_ID_ENV",
    "SIGNATURE_SUFFIX",
    "SIGNING_KEY_ENV",
    "VERIFY_KEY_ENV",
    "FileSignature",
    "SignedFile",
    "SigningKey",
    "VerifyKey",
    "bucket_identity",
    "file_sha256",
]

SIGNING_KEY_ENV = "DELTA_SYNC_SIGNING_KEY"
VERIFY_KEY_ENV = "DELTA_SYNC_VERIFY_KEY"
BUCKET_ID_ENV = "DELTA_SYNC_BUCKET_ID"
SIGNATURE_SUFFIX = ".sig"
# v2 statements name the bucket, run, epoch and size; v1 (path and digest only) let a
# signed file be replayed into another bucket, so they are no longer accepted.
_DOMAIN = b"delta-sync signed file v2\n"
_MAX_SIGNATURE_BYTES = 4096
_STATEMENT_FIELDS = ("path", "sha256", "size", "bucket", "run_id", "epoch")


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def bucket_identity(url: str, name: str | None = None) -> str:
    """The name signed statements give a bucket: `name`, else `DELTA_SYNC_BUCKET_ID`, else
    the bucket's URL (without a trailing slash).

    Args:
        url: The bucket's canonical URL (`Bucket.url`).
        name: An explicit name, as `PublisherOptions.bucket_id` or `Receiver(bucket_id=...)` give it.
    """
    chosen = name or os.environ.get(BUCKET_ID_ENV, "").strip()
    return chosen or url.rstrip("/")


def _key_id(public_bytes: bytes) -> str:
    return hashlib.sha256(public_bytes).hexdigest()[:16]


@dataclass(frozen=True)
class SignedFile:
    """What the trainer states about one file it wrote.

    Args:
        path: The file's path inside the bucket.
        sha256: SHA-256 of the file's bytes.
        size: The file's size in bytes: a replica downloads no more than this.
        bucket: The bucket it was written to (see [`bucket_identity`]).
        run_id: The training run that wrote it.
        epoch: The start of the run's publisher that wrote it ("" for none).
    """

    path: str
    sha256: str
    size: int
    bucket: str
    run_id: str
    epoch: str

    def statement(self) -> bytes:
        return _DOMAIN + json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class FileSignature:
    """The signature of one file: what is in a `.sig` file, or in `latest.json`'s `signature`.

    Args:
        about: What is signed: path, digest, size, bucket, run and epoch.
        key_id: Identifies the public key that verifies it.
        signature: Ed25519 signature of `about`'s statement (base64).
    """

    about: SignedFile
    key_id: str
    signature: str

    @property
    def path(self) -> str:
        return self.about.path

    @property
    def size(self) -> int:
        return self.about.size

    def to_dict(self) -> dict:
        return {**asdict(self.about), "key_id": self.key_id, "signature": self.signature}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode() + b"\n"

    def check_digest(self, sha256: str) -> None:
        """Check that the file read has the signed digest.

        Raises:
            SignatureError: It has another.
        """
        if sha256 != self.about.sha256:
            raise SignatureError(f"{self.path}: the file's SHA-256 {sha256[:16]}... is not the one signed")

    @classmethod
    def from_dict(cls, fields: object, *, source: str) -> FileSignature:
        """Parse a signature's fields, strictly.

        Raises:
            FormatError: A field is missing or of the wrong type (the message names it),
                or the signature is of the older format that named no bucket.
        """
        if not isinstance(fields, dict):
            raise FormatError(f"{source}: not a signature (not a JSON object)")
        if "signature" in fields and "bucket" not in fields:
            raise FormatError(
                f"{source}: a signature of the older format, which names no bucket, run or size; "
                "republish with this version of delta-sync (its signatures bind each file to its bucket)"
            )
        for name in (*_STATEMENT_FIELDS, "key_id", "signature"):
            value = fields.get(name)
            expected = int if name == "size" else str
            if type(value) is not expected or (name == "size" and value < 0):
                kind = "a non-negative integer" if expected is int else "a string"
                raise FormatError(f"{source}: the signature's {name!r} must be {kind}")
        about = SignedFile(**{name: fields[name] for name in _STATEMENT_FIELDS})
        return cls(about, fields["key_id"], fields["signature"])

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> FileSignature:
        if len(data) > _MAX_SIGNATURE_BYTES:
            raise FormatError(f"{source}: {len(data)} bytes is too large for a signature")
        try:
            fields = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"{source}: not a signature file ({exc})") from None
        return cls.from_dict(fields, source=source)


class VerifyKey:
    """An Ed25519 public key that checks the trainer's signatures.

    Args:
        pem: The public key, PEM-encoded (`delta-sync.pub`).
    """

    def __init__(self, pem: bytes) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError as exc:
            raise SignatureError(f"not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SignatureError(f"expected an Ed25519 public key, got {type(key).__name__}")
        self._key = key
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = _key_id(raw)
        #: The key as PEM text: what `delta-sync.pub` and `DELTA_SYNC_VERIFY_KEY` hold.
        self.pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    @classmethod
    def load(cls, source: str | os.PathLike) -> VerifyKey:
        """From a PEM file's path, or PEM text itself (as an environment variable holds it)."""
        return cls(_pem(source))

    @classmethod
    def from_env(cls) -> VerifyKey | None:
        """The key `DELTA_SYNC_VERIFY_KEY` names (a path or PEM text), or None when unset."""
        value = os.environ.get(VERIFY_KEY_ENV, "").strip()
        return cls.load(value) if value else None

    def verify(self, signature: FileSignature, *, path: str, bucket: str) -> None:
        """Check that `signature` is ours, for the file at `path` of `bucket`. The file's
        digest is checked separately ([`FileSignature.check_digest`]), once it is read: a
        replica checks the signature first and downloads no more than its signed size.

        Raises:
            SignatureError: Another key signed it, it is for another path or bucket, or
                the signature does not verify.
        """
        from cryptography.exceptions import InvalidSignature

        if signature.key_id != self.key_id:
            raise SignatureError(f"{path}: signed by key {signature.key_id}, not by the trusted key {self.key_id}")
        if signature.path != path:
            raise SignatureError(f"{path}: the signature is for {signature.path!r}")
        try:
            self._key.verify(base64.b64decode(signature.signature, validate=True), signature.about.statement())
        except (InvalidSignature, ValueError):
            raise SignatureError(f"{path}: the signature does not verify") from None
        if signature.about.bucket != bucket:
            raise SignatureError(
                f"{path}: signed for bucket {signature.about.bucket!r}, but it was read from {bucket!r} "
                f"(a file copied from another bucket; if trainer and replica name one bucket differently, "
                f"set {BUCKET_ID_ENV} to the same name on both)"
            )

    def verify_file(self, signature: FileSignature, *, path: str, bucket: str, sha256: str) -> None:
        """[`verify`] and [`FileSignature.check_digest`] at once, for a file already read."""
        self.verify(signature, path=path, bucket=bucket)
        signature.check_digest(sha256)

    def __repr__(self) -> str:
        return f"VerifyKey({self.key_id})"


class SigningKey:
    """The trainer's Ed25519 private key.

    Args:
        pem: The private key, PEM-encoded (`delta-sync.key`), unencrypted.
    """

    def __init__(self, pem: bytes) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise SignatureError(f"not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"expected an Ed25519 private key, got {type(key).__name__}")
        self._key = key
        self.verify_key = VerifyKey(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )

    @classmethod
    def generate(cls) -> SigningKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(pem)

    @classmethod
    def load(cls, source: str | os.PathLike) -> SigningKey:
        """From a PEM file's path, or PEM text itself."""
        return cls(_pem(source))

    @classmethod
    def from_env(cls) -> SigningKey | None:
        """The key `DELTA_SYNC_SIGNING_KEY` names (a path or PEM text), or None when unset."""
        value = os.environ.get(SIGNING_KEY_ENV, "").strip()
        return cls.load(value) if value else None

    @property
    def key_id(self) -> str:
        return self.verify_key.key_id

    def sign(self, about: SignedFile) -> FileSignature:
        """Sign what the trainer states about a file."""
        signature = self._key.sign(about.statement())
        return FileSignature(about, self.key_id, base64.b64encode(signature).decode())

    def save(self, directory: str | os.PathLike) -> tuple[Path, Path]:
        """Write `delta-sync.key` (readable by its owner only) and `delta-sync.pub` into `directory`.

        Raises:
            FileExistsError: Either file exists already (keys are never overwritten).
        """
        from cryptography.hazmat.primitives import serialization

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        private, public = directory / "delta-sync.key", directory / "delta-sync.pub"
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        with open(public, "xb") as handle:
            handle.write(self.verify_key.pem)
        return private, public


def _pem(source: str | os.PathLike) -> bytes:
    text = os.fspath(source)
    if text.lstrip().startswith("-----BEGIN"):
        return text.encode()
    try:
        return Path(text).expanduser().read_bytes()
    except OSError as exc:
        raise SignatureError(f"cannot read key file {text!r}: {exc}") from None

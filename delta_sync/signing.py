"""Signed versions: only the holder of the trainer's key can change what replicas serve.

The trainer signs, with an Ed25519 private key, the SHA-256 of every file a replica acts
on: each anchor, delta and manifest gets a small signature file next to it
(`deltas/step_00000002.safetensors.sig`), and `latest.json` carries its own signature. A
manifest records the SHA-256 of each of its parts, so one signature covers a whole
version. A replica configured with the matching public key checks the signature and the
file's digest before it reads anything else from the file, and refuses unsigned files and
files signed by another key. Replicas hold only the public key: they cannot sign.

Keys are plain PEM files made by `delta-sync keygen DIR` (`delta-sync.key`, private, and
`delta-sync.pub`), passed by path, or as PEM text in an environment variable (a Space
secret): `DELTA_SYNC_SIGNING_KEY` on the trainer, `DELTA_SYNC_VERIFY_KEY` on replicas.

Example:
    ```python
    >>> signing_key = SigningKey.generate()
    >>> digest = file_sha256("deltas/step_00000002.safetensors")
    >>> signature = signing_key.sign("deltas/step_00000002.safetensors", digest)
    >>> signing_key.verify_key.verify_file("deltas/step_00000002.safetensors", digest, signature)
    ```
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import FormatError, SignatureError

__all__ = [
    "SIGNATURE_SUFFIX",
    "SIGNING_KEY_ENV",
    "VERIFY_KEY_ENV",
    "FileSignature",
    "SigningKey",
    "VerifyKey",
    "file_sha256",
]

SIGNING_KEY_ENV = "DELTA_SYNC_SIGNING_KEY"
VERIFY_KEY_ENV = "DELTA_SYNC_VERIFY_KEY"
SIGNATURE_SUFFIX = ".sig"
_DOMAIN = b"delta-sync signed file v1\n"
_MAX_SIGNATURE_BYTES = 4096


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _statement(path: str, sha256: str) -> bytes:
    # The path is signed with the digest: a signed delta cannot be replayed at another version's path.
    return _DOMAIN + path.encode() + b"\n" + sha256.encode() + b"\n"


def _key_id(public_bytes: bytes) -> str:
    return hashlib.sha256(public_bytes).hexdigest()[:16]


@dataclass(frozen=True)
class FileSignature:
    """The signature of one file: what is in a `.sig` file, or in `latest.json`'s `signature`.

    Args:
        path: The file's path inside the bucket.
        sha256: SHA-256 of the file's bytes.
        key_id: Identifies the public key that verifies it.
        signature: Ed25519 signature of the path and digest (base64).
    """

    path: str
    sha256: str
    key_id: str
    signature: str

    def to_json(self) -> bytes:
        return json.dumps(vars(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> FileSignature:
        if len(data) > _MAX_SIGNATURE_BYTES:
            raise FormatError(f"{source}: {len(data)} bytes is too large for a signature")
        try:
            fields = json.loads(data)
            values = {name: fields[name] for name in ("path", "sha256", "key_id", "signature")}
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise FormatError(f"{source}: not a signature file ({exc})") from None
        if not all(isinstance(value, str) for value in values.values()):
            raise FormatError(f"{source}: signature fields must be strings")
        return cls(**values)


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

    def verify_file(self, path: str, sha256: str, signature: FileSignature) -> None:
        """Check that `signature` is ours, for this path, over this digest.

        Raises:
            SignatureError: Another key signed it, it is for another path or digest, or the
                signature does not verify.
        """
        from cryptography.exceptions import InvalidSignature

        if signature.key_id != self.key_id:
            raise SignatureError(f"{path}: signed by key {signature.key_id}, not by the trusted key {self.key_id}")
        if signature.path != path:
            raise SignatureError(f"{path}: the signature is for {signature.path!r}")
        if signature.sha256 != sha256:
            raise SignatureError(f"{path}: the file's SHA-256 {sha256[:16]}... is not the one signed")
        try:
            self._key.verify(base64.b64decode(signature.signature, validate=True), _statement(path, sha256))
        except (InvalidSignature, ValueError):
            raise SignatureError(f"{path}: the signature does not verify") from None

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

    def sign(self, path: str, sha256: str) -> FileSignature:
        """Sign a file's path and SHA-256."""
        signature = self._key.sign(_statement(path, sha256))
        return FileSignature(path, sha256, self.key_id, base64.b64encode(signature).decode())

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

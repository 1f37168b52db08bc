"""Where files live inside a bucket prefix, and the `latest.json` pointer.

```
anchors/step_00000001.safetensors          full bf16 weights of version 1
deltas/step_00000002.safetensors           sparse changes from version 1 to version 2
latest.json                                the newest version whose files are fully stored
```

A sharded trainer writes each version as one part per rank plus a manifest naming them
(the manifest is what a replica is pointed at, and what `latest.json` names):

```
deltas/step_00000003.manifest.json
deltas/step_00000003/part_00000.safetensors
deltas/step_00000003/part_00001.safetensors
```
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import asdict, dataclass

from .errors import FormatError, SignatureError
from .signing import FileSignature, SignedFile, SigningKey, VerifyKey
from .version import Identified, VersionId

ANCHOR_DIR = "anchors"
DELTA_DIR = "deltas"
LATEST = "latest.json"

MANIFEST_SUFFIX = ".manifest.json"

_STEP_FILE = re.compile(r"^(anchors|deltas)/step_(\d{8,})(\.safetensors|\.manifest\.json)$")
_PART_FILE = re.compile(r"^(anchors|deltas)/step_(\d{8,})/part_(\d{5,})\.safetensors$")
_SIGNATURE_FILE = re.compile(r"^(anchors|deltas)/step_(\d{8,})(\.safetensors|\.manifest\.json)\.sig$")


def anchor_path(version: int) -> str:
    """Path of the anchor of `version`, relative to the bucket prefix."""
    return f"{ANCHOR_DIR}/step_{version:08d}.safetensors"


def delta_path(version: int) -> str:
    """Path of the delta that produces `version`, relative to the bucket prefix."""
    return f"{DELTA_DIR}/step_{version:08d}.safetensors"


def manifest_path(kind: str, version: int) -> str:
    """Path of the manifest of a version written in parts (`kind` is "anchor" or "delta")."""
    return f"{_directory(kind)}/step_{version:08d}{MANIFEST_SUFFIX}"


def part_path(kind: str, version: int, rank: int) -> str:
    """Path of one rank's part of a version written in parts."""
    return f"{_directory(kind)}/step_{version:08d}/part_{rank:05d}.safetensors"


def is_manifest(path: str) -> bool:
    return path.endswith(MANIFEST_SUFFIX)


def is_part(path: str) -> bool:
    """Whether `path` is one rank's part of a version (applied only through its manifest)."""
    return _PART_FILE.match(path) is not None


def parse_step_path(path: str) -> tuple[str, int] | None:
    """Return `("anchor" | "delta", version)` for any file of a version (single file,
    manifest, part or signature), or None for anything else."""
    match = _STEP_FILE.match(path) or _PART_FILE.match(path) or _SIGNATURE_FILE.match(path)
    if match is None:
        return None
    kind = "anchor" if match.group(1) == ANCHOR_DIR else "delta"
    return kind, int(match.group(2))


def step_versions(paths: list[str], kind: str) -> list[int]:
    """Sorted versions of `kind` ("anchor" or "delta") among `paths` that a replica can
    apply: those with a single file or a manifest (parts alone do not make a version)."""
    return sorted(version_files(paths, kind))


def version_files(paths: list[str], kind: str) -> dict[int, str]:
    """Version -> the path a replica applies (the single file, or the manifest of a
    version written in parts), for the `kind` ("anchor" or "delta") among `paths`."""
    found: dict[int, str] = {}
    for path in paths:
        match = _STEP_FILE.match(path)
        if match is not None and match.group(1) == _directory(kind):
            found[int(match.group(2))] = path
    return found


def _directory(kind: str) -> str:
    if kind not in ("anchor", "delta"):
        raise ValueError(f"kind must be 'anchor' or 'delta', got {kind!r}")
    return ANCHOR_DIR if kind == "anchor" else DELTA_DIR


# -- adapter mode -------------------------------------------------------------------------

ADAPTER_DIR = "adapters"
#: The files of one adapter version, as `peft`'s `save_pretrained` names them.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)

_ADAPTER_FILE = re.compile(r"^adapters/step_(\d{8,})/(adapter_config\.json|adapter_model\.safetensors)(\.sig)?$")


def adapter_dir(version: int) -> str:
    """Directory of the adapter published as `version` (adapter mode), relative to the bucket prefix."""
    return f"{ADAPTER_DIR}/step_{version:08d}"


def parse_adapter_path(path: str) -> int | None:
    """The version of an adapter version's file (or its signature), or None for anything else."""
    match = _ADAPTER_FILE.match(path)
    return None if match is None else int(match.group(1))


#: `latest.json` is a small pointer; anything much larger is not one.
MAX_LATEST_BYTES = 64 << 10


@dataclass(frozen=True)
class Latest(Identified):
    """Contents of `latest.json`: the newest fully stored version and how to reach it.

    Args:
        id: The newest version whose files are completely stored: its number (`version`
            in the file), the newest anchor at or before it (`anchor_version`), the run
            (`run_id`) and the start of the publisher that wrote it (`epoch`, "" in files
            written before epochs existed).
        anchor: Path of the newest anchor at or before `version`.
        delta: Path of the delta producing `version`, or None when `version` has only an anchor.
        model_checksum: Digest of the full bf16 state at `version` (see `delta_sync.integrity`).
        epoch_start: The first version that start wrote: files of earlier versions are the
            run's history (any epoch); from it on, only files of `epoch` belong to the run.
            0 puts no constraint.
        sequence: Counts the pointer's writes over the life of the bucket prefix, across
            resumes (the trainer takes at least its microsecond clock, so a new start of a
            run counts on from the old one): a replica with a verify key never accepts a
            lower one than it has (a replayed, older pointer). 0 in pointers written
            before it existed.
        written_at: When the trainer wrote (or refreshed) the pointer, in seconds since the
            epoch: how fresh what a replica follows is. 0.0 in older pointers.
        bucket: The bucket the pointer was written for (see
            `delta_sync.signing.bucket_identity`); "" in older pointers.
        adapter: For a version published as a PEFT adapter (adapter mode, see
            `delta_sync.trainer.adapter`): its directory ([`adapter_dir`]); then `anchor`
            is "", `delta` None and `model_checksum` the SHA-256 of its
            `adapter_model.safetensors`. None (and absent from the file) otherwise.
    """

    id: VersionId
    anchor: str
    delta: str | None
    model_checksum: str
    epoch_start: int = 0
    sequence: int = 0
    written_at: float = 0.0
    bucket: str = ""
    adapter: str | None = None

    def _fields(self) -> dict:
        fields = {**asdict(self.id), "anchor": self.anchor, "delta": self.delta}
        fields.update(model_checksum=self.model_checksum, epoch_start=self.epoch_start)
        fields.update(sequence=self.sequence, written_at=self.written_at, bucket=self.bucket)
        fields.update(adapter=self.adapter)
        for optional in ("epoch", "epoch_start", "sequence", "written_at", "bucket", "adapter"):
            if not fields[optional]:
                del fields[optional]
        return fields

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the trainer wrote the pointer (None for a pointer without a time)."""
        if not self.written_at:
            return None
        return max(0.0, (time.time() if now is None else now) - self.written_at)

    def digest(self) -> str:
        """SHA-256 of what the pointer says (its signature aside)."""
        return hashlib.sha256(self._signed_bytes()).hexdigest()

    def owns(self, version: int, epoch: str) -> bool:
        """Whether a file of `version` written by publisher start `epoch` is part of the
        trajectory this pointer ends: history before `epoch_start`, this epoch's from it on."""
        return not self.epoch or epoch == self.epoch or version < self.epoch_start

    def _signed_bytes(self) -> bytes:
        return json.dumps(self._fields(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self, signing_key: SigningKey | None = None) -> bytes:
        """The file's bytes; with a key, they carry a signature of the other fields."""
        fields = self._fields()
        if signing_key is not None:
            signed = self._signed_bytes()
            about = SignedFile(LATEST, self.digest(), len(signed), self.bucket, self.run_id, self.epoch)
            fields["signature"] = signing_key.sign(about).to_dict()
        return json.dumps(fields, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(
        cls,
        data: bytes,
        *,
        source: str = LATEST,
        verify_key: VerifyKey | None = None,
        bucket: str | None = None,
    ) -> Latest:
        """Parse `latest.json`, strictly; with a key, check its signature first.

        Args:
            data: The file's bytes.
            source: Names the file in errors.
            verify_key: Accept only a pointer this key signed.
            bucket: The bucket the pointer is read from (see
                `delta_sync.signing.bucket_identity`); with a key, the pointer must be
                signed for it.

        Raises:
            FormatError: Not a valid pointer (the message names the field).
            SignatureError: `verify_key` is given and the pointer is unsigned, not signed
                by it, signed for another bucket, or lacks the counter and time that make
                a replayed pointer detectable.
        """
        if len(data) > MAX_LATEST_BYTES:
            raise FormatError(f"{source}: {len(data)} bytes is too large for a latest.json pointer")
        try:
            fields = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"{source}: not a valid latest.json pointer ({type(exc).__name__})") from None
        if not isinstance(fields, dict):
            raise FormatError(f"{source}: not a valid latest.json pointer (not a JSON object)")
        signature = fields.pop("signature", None)
        latest = cls(
            id=VersionId(
                version=_count(fields, "version", source),
                anchor_version=_count(fields, "anchor_version", source),
                run_id=_text(fields, "run_id", source),
                epoch=_text(fields, "epoch", source) if "epoch" in fields else "",
            ),
            anchor=_text(fields, "anchor", source),
            delta=None if fields.get("delta") is None else _text(fields, "delta", source),
            model_checksum=_text(fields, "model_checksum", source),
            epoch_start=_count(fields, "epoch_start", source) if "epoch_start" in fields else 0,
            sequence=_count(fields, "sequence", source) if "sequence" in fields else 0,
            written_at=_seconds(fields, "written_at", source) if "written_at" in fields else 0.0,
            bucket=_text(fields, "bucket", source) if "bucket" in fields else "",
            adapter=_text(fields, "adapter", source) if fields.get("adapter") is not None else None,
        )
        if verify_key is not None:
            if not isinstance(signature, dict):
                raise SignatureError(f"{source}: not signed, but this replica only trusts signed versions")
            if bucket is None:
                raise ValueError("checking a signed latest.json needs the bucket it is read from")
            parsed = FileSignature.from_dict(signature, source=f"{source} (its 'signature')")
            verify_key.verify(parsed, path=LATEST, bucket=bucket)
            parsed.check_digest(latest.digest())
            if not latest.sequence or not latest.written_at:
                raise SignatureError(
                    f"{source}: signed, but without the 'sequence' and 'written_at' that let a replica refuse "
                    "an older pointer put back; republish with this version of delta-sync"
                )
        return latest


def _count(fields: dict, key: str, source: str) -> int:
    value = fields.get(key)
    if type(value) is not int or value < 0:
        raise FormatError(f"{source}: not a valid latest.json pointer ('{key}' must be a non-negative integer)")
    return value


def _seconds(fields: dict, key: str, source: str) -> float:
    value = fields.get(key)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise FormatError(f"{source}: not a valid latest.json pointer ('{key}' must be a non-negative number)")
    return float(value)


def _text(fields: dict, key: str, source: str) -> str:
    value = fields.get(key)
    if not isinstance(value, str):
        raise FormatError(f"{source}: not a valid latest.json pointer ('{key}' must be a string)")
    return value

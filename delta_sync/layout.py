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

import json
import re
from dataclasses import asdict, dataclass

from .errors import FormatError

ANCHOR_DIR = "anchors"
DELTA_DIR = "deltas"
LATEST = "latest.json"

MANIFEST_SUFFIX = ".manifest.json"

_STEP_FILE = re.compile(r"^(anchors|deltas)/step_(\d{8,})(\.safetensors|\.manifest\.json)$")
_PART_FILE = re.compile(r"^(anchors|deltas)/step_(\d{8,})/part_(\d{5,})\.safetensors$")


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


def parse_step_path(path: str) -> tuple[str, int] | None:
    """Return `("anchor" | "delta", version)` for any file of a version (single file,
    manifest or part), or None for anything else."""
    match = _STEP_FILE.match(path) or _PART_FILE.match(path)
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


@dataclass(frozen=True)
class Latest:
    """Contents of `latest.json`: the newest fully stored version and how to reach it.

    Args:
        version: The newest version whose files are completely stored.
        anchor_version: Version of the newest anchor at or before `version`.
        delta: Path of the delta producing `version`, or None when `version` has only an anchor.
        anchor: Path of the newest anchor at or before `version`.
        model_checksum: Digest of the full bf16 state at `version` (see `delta_sync.integrity`).
        run_id: Identifier of the training run that wrote the files.
    """

    version: int
    anchor_version: int
    anchor: str
    delta: str | None
    model_checksum: str
    run_id: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, source: str = LATEST) -> Latest:
        try:
            fields = json.loads(data)
            return cls(
                version=int(fields["version"]),
                anchor_version=int(fields["anchor_version"]),
                anchor=str(fields["anchor"]),
                delta=None if fields.get("delta") is None else str(fields["delta"]),
                model_checksum=str(fields["model_checksum"]),
                run_id=str(fields["run_id"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{source}: not a valid latest.json pointer ({exc})") from exc

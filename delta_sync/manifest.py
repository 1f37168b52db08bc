"""Manifests: a version written as several parts, one per trainer rank.

A sharded trainer never gathers weights: each rank writes the elements it holds as a part
(`deltas/step_00000003/part_00001.safetensors`), and one rank then writes the version's
manifest (`deltas/step_00000003.manifest.json`) naming every part with its payload digest,
plus what the single-file layout keeps in a file's metadata: versions, shapes, per-parameter
state checksums of the whole model and the model checksum. A replica is pointed at the
manifest, needs no knowledge of the trainer's world size, and applies all parts as one
update. The manifest is JSON:

| key | meaning |
| --- | --- |
| `format`, `format_version` | `"delta-sync-manifest"`, `"1"` |
| `kind` | `"anchor"` or `"delta"` |
| `model_version`, `base_version`, `anchor_version` | as in a single file's metadata |
| `run_id`, `epoch`, `encoding` | as in a single file's metadata |
| `world_size` | ranks that wrote the version (informational) |
| `parts` | list of `{"path", "rank", "bytes", "payload_xxh3"}`, plus `"sha256"` of the file when signed |
| `shapes`, `checksums`, `base_checksums` | of the parameters in the version, whole-model values |
| `model_checksum`, `changed_elements`, `total_elements` | as in a single file's metadata |

Parts of a raw delta hold positions in the full tensors. Parts of a compact delta are each
coded in the rank's block of every parameter (metadata `blocks` and `block_shapes`), against
that block of the weights before the delta: a replica cuts the same block out of the weights
it holds to decode a part ([`PartedDelta`]).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .blocks import Block
from .changes import Encoding, SparseChange, index_dtype
from .errors import ApplyError, FormatError, IntegrityError
from .format import Anchor, CodedDelta, Delta, DeltaFile, FileHeader, VersionFile, read_file
from .integrity import add_checksums, format_checksum, model_checksum, parse_checksum
from .layout import parse_step_path
from .version import Identified, VersionId

__all__ = ["MANIFEST_FORMAT", "Manifest", "PartRecord", "PartedAnchor", "PartedDelta", "read_version"]

MANIFEST_FORMAT = "delta-sync-manifest"
MANIFEST_FORMAT_VERSION = "1"
# A manifest names parts and lists parameters; nothing legitimate comes near this.
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class PartRecord:
    """One part of a version, as its manifest records it.

    Args:
        path: Bucket path of the part file.
        rank: The trainer rank that wrote it.
        bytes: Size of the file.
        payload_xxh3: The payload digest recorded in the part's own metadata.
        sha256: SHA-256 of the whole file, when the version is signed (the manifest's
            signature then covers every part).
    """

    path: str
    rank: int
    bytes: int
    payload_xxh3: str
    sha256: str | None = None


@dataclass(frozen=True)
class Manifest(Identified):
    """The parts of one version and what the whole version must reproduce.

    Args:
        kind: `"anchor"` or `"delta"`.
        id: The version after it is applied (number, anchor, run, start of the publisher).
        base_version: Version a delta applies on top of; None for anchors.
        encoding: Encoding of the delta parts (`"dense"` for anchors).
        world_size: Ranks of the trainer that wrote the parts.
        parts: The parts, by rank.
        shapes: Full shape of every parameter in the version.
        checksums: State checksum of each of those parameters after applying.
        base_checksums: For deltas, the same before applying.
        model_checksum: Digest of the whole model after applying.
        changed_elements: Elements stored over all parts.
        total_elements: Elements of the whole model.
    """

    kind: Literal["anchor", "delta"]
    id: VersionId
    base_version: int | None
    encoding: str
    world_size: int
    parts: tuple[PartRecord, ...]
    shapes: dict[str, tuple[int, ...]]
    checksums: dict[str, int]
    base_checksums: dict[str, int] = field(default_factory=dict)
    model_checksum: str = ""
    changed_elements: int = 0
    total_elements: int = 0

    def to_json(self) -> bytes:
        document = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": self.kind,
            "model_version": self.id.version,
            "base_version": self.base_version,
            "anchor_version": self.id.anchor_version,
            "run_id": self.id.run_id,
            "epoch": self.id.epoch,
            "encoding": self.encoding,
            "world_size": self.world_size,
            "parts": [{key: value for key, value in vars(part).items() if value is not None} for part in self.parts],
            "shapes": {name: list(shape) for name, shape in sorted(self.shapes.items())},
            "checksums": {name: format_checksum(v) for name, v in sorted(self.checksums.items())},
            "base_checksums": {name: format_checksum(v) for name, v in sorted(self.base_checksums.items())},
            "model_checksum": self.model_checksum,
            "changed_elements": self.changed_elements,
            "total_elements": self.total_elements,
        }
        return json.dumps(document, indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> Manifest:
        """Parse and check a manifest.

        Raises:
            FormatError: Not a manifest, a field missing or of the wrong type, parts that
                are not of this version, or checksums that do not cover `shapes`; the
                message names the file and the field.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"{source}: {len(data)} bytes is too large for a manifest")
        try:
            document = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"{source}: not a JSON manifest ({exc})") from None
        reader = _Fields(document, source)
        if reader.text("format") != MANIFEST_FORMAT:
            raise FormatError(f"{source}: 'format' is not {MANIFEST_FORMAT!r}")
        if reader.text("format_version") != MANIFEST_FORMAT_VERSION:
            raise FormatError(f"{source}: unsupported manifest format_version (this library reads '1')")
        kind = reader.text("kind")
        if kind not in ("anchor", "delta"):
            raise FormatError(f"{source}: 'kind' must be 'anchor' or 'delta', got {kind!r}")
        manifest = cls(
            kind=kind,
            id=VersionId(
                version=reader.count("model_version"),
                anchor_version=reader.count("anchor_version"),
                run_id=reader.text("run_id"),
                epoch=reader.text("epoch"),
            ),
            base_version=reader.count("base_version") if kind == "delta" else None,
            encoding=reader.text("encoding"),
            world_size=reader.count("world_size"),
            parts=tuple(reader.parts()),
            shapes=reader.shapes(),
            checksums=reader.checksums("checksums"),
            base_checksums=reader.checksums("base_checksums") if kind == "delta" else {},
            model_checksum=reader.text("model_checksum"),
            changed_elements=reader.count("changed_elements"),
            total_elements=reader.count("total_elements"),
        )
        manifest._check(source)
        return manifest

    def _check(self, source: str) -> None:
        for field_name, table in (("checksums", self.checksums), ("base_checksums", self.base_checksums)):
            if (table or field_name == "checksums") and set(table) != set(self.shapes):
                raise FormatError(f"{source}: '{field_name}' does not cover exactly the parameters of 'shapes'")
        ranks = [part.rank for part in self.parts]
        if len(set(ranks)) != len(ranks) or any(not 0 <= rank < self.world_size for rank in ranks):
            raise FormatError(f"{source}: 'parts' ranks {ranks} are repeated or outside world_size {self.world_size}")
        for part in self.parts:
            if parse_step_path(part.path) != (self.kind, self.version) or part.path.endswith(".json"):
                raise FormatError(f"{source}: part {part.path!r} is not a part of {self.kind} v{self.version}")


class _Fields:
    """Strict readers of a manifest's JSON fields; errors name the file and the field."""

    def __init__(self, document: Any, source: str) -> None:
        if not isinstance(document, Mapping):
            raise FormatError(f"{source}: a manifest is a JSON object")
        self.document = document
        self.source = source

    def _get(self, key: str) -> Any:
        if key not in self.document:
            raise FormatError(f"{self.source}: manifest field {key!r} is missing")
        return self.document[key]

    def _bad(self, key: str, what: str) -> FormatError:
        return FormatError(f"{self.source}: manifest field {key!r} must be {what}")

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def count(self, key: str) -> int:
        value = self._get(key)
        if type(value) is not int or value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def shapes(self) -> dict[str, tuple[int, ...]]:
        value = self._get("shapes")
        if not isinstance(value, Mapping) or not all(
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) for shape in value.values()
        ):
            raise self._bad("shapes", "an object of lists of non-negative integers")
        return {str(name): tuple(shape) for name, shape in value.items()}

    def checksums(self, key: str) -> dict[str, int]:
        value = self._get(key)
        if not isinstance(value, Mapping):
            raise self._bad(key, "an object of 16-hex-digit checksums")
        try:
            return {str(name): parse_checksum(text) for name, text in value.items()}
        except (ValueError, TypeError):
            raise self._bad(key, "an object of 16-hex-digit checksums") from None

    def parts(self) -> list[PartRecord]:
        value = self._get("parts")
        if not isinstance(value, list):
            raise self._bad("parts", "a list")
        records = []
        for entry in value:
            fields = _Fields(entry, self.source)
            try:
                records.append(
                    PartRecord(
                        path=fields.text("path"),
                        rank=fields.count("rank"),
                        bytes=fields.count("bytes"),
                        payload_xxh3=fields.text("payload_xxh3"),
                        sha256=fields.text("sha256") if "sha256" in entry else None,
                    )
                )
            except FormatError as exc:
                raise FormatError(f"{self.source}: a part of manifest field 'parts' is malformed ({exc})") from None
        return records


def _header(manifest: Manifest, source: str, parts: Sequence[FileHeader]) -> FileHeader:
    """The header of the whole version, as if it were one file: the manifest's fields, and
    the dtypes its parts travel in.

    Raises:
        FormatError: Two parts carry one parameter in different dtypes.
    """
    dtypes: dict[str, torch.dtype] = {}
    for part in parts:
        for name in part.shapes:
            dtype = dtypes.setdefault(name, part.dtype(name))
            if dtype != part.dtype(name):
                raise FormatError(
                    f"{part.source}: carries {name!r} as {part.dtype(name)}, another part of {source} as {dtype}"
                )
    return FileHeader(
        source=source,
        kind=manifest.kind,
        id=manifest.id,
        base_version=manifest.base_version,
        encoding=manifest.encoding,
        shapes=dict(manifest.shapes),
        checksums=dict(manifest.checksums),
        base_checksums=dict(manifest.base_checksums),
        model_checksum=manifest.model_checksum,
        changed_elements=manifest.changed_elements,
        total_elements=manifest.total_elements,
        dtypes={name: dtype for name, dtype in dtypes.items() if dtype != torch.bfloat16},
    )


def read_version(
    manifest: Manifest, parts: Sequence[tuple[PartRecord, str | os.PathLike]], *, source: str, base_url: str = ""
) -> Anchor | DeltaFile:
    """Read every part of a version and check that together they are the version the
    manifest describes; the result is applied like a single file.

    Args:
        manifest: The version's manifest.
        parts: Each part record with the local path of its file, for every part of the manifest.
        source: How to name the manifest in error messages (e.g. its bucket URL).
        base_url: Prefix of part paths in error messages (the bucket's URL).

    Returns:
        A [`Delta`] holding every part's changes (a [`PartedDelta`] to decode, for the
        compact encoding), or an anchor whose tensors are put together from the parts'
        blocks ([`PartedAnchor`]).

    Raises:
        FormatError: A part is missing, malformed, of another version or run, has another
            payload digest than the manifest records, or the parts overlap or leave
            elements out.
    """
    if sorted(record.path for record, _ in parts) != sorted(record.path for record in manifest.parts):
        raise FormatError(f"{source}: the parts given are not the manifest's parts")
    files: list[Anchor | DeltaFile] = []
    try:
        for record, local in parts:
            file = read_file(local, source=f"{base_url}/{record.path}" if base_url else record.path, part_of=source)
            files.append(file)
            _check_part(manifest, record, file.header, source)
        header = _header(manifest, source, [file.header for file in files])
        if manifest.kind == "delta":
            if manifest.encoding == Encoding.COMPACT:
                return PartedDelta(header=header, parts=_check_disjoint(files, source))
            changes = _merge_changes([file.changes for file in files], header)
            return Delta(header=header, changes=changes)
        anchor = PartedAnchor(header=header, parts=files)
        anchor.check_cover()
        files = []  # the anchor closes them now
        return anchor
    finally:
        for file in files:
            file.close()


def _check_part(manifest: Manifest, record: PartRecord, header: FileHeader, source: str) -> None:
    checks = (
        ("version", header.id, manifest.id),
        ("kind", header.kind, manifest.kind),
        ("base_version", header.base_version, manifest.base_version),
        ("encoding", header.encoding, manifest.encoding),
        ("part", header.part, (record.rank, manifest.world_size)),
        ("payload_digest", header.payload_digest, record.payload_xxh3),
    )
    for what, found, recorded in checks:
        if found != recorded:
            raise FormatError(f"{header.source}: its {what} is {found!r}, but {source} records {recorded!r}")
    for name, shape in header.shapes.items():
        if manifest.shapes.get(name) != shape:
            raise FormatError(f"{header.source}: parameter {name!r} is not in {source} with shape {list(shape)}")


def _merge_changes(parts: Sequence[Mapping[str, SparseChange]], header: FileHeader) -> dict[str, SparseChange]:
    """Each parameter's changes from all parts, in ascending position; parts never overlap."""
    source = header.source
    by_name: dict[str, list[SparseChange]] = {}
    for part in parts:
        for name, change in part.items():
            by_name.setdefault(name, []).append(change)
    if sorted(by_name) != sorted(header.shapes):
        raise FormatError(f"{source}: the parts change {sorted(by_name)[:5]}..., not the manifest's parameters")
    merged = {}
    for name, changes in by_name.items():
        indices = torch.cat([c.indices for c in changes])
        values = torch.cat([c.values for c in changes])
        if len(changes) > 1:
            order = torch.argsort(indices, stable=True)
            indices, values = indices[order], values[order]
            if bool((indices[1:] <= indices[:-1]).any()):
                raise FormatError(f"{source}: two parts change the same element of {name!r}")
        merged[name] = SparseChange(indices=indices, values=values)
    total = sum(len(change) for change in merged.values())
    if total != header.changed_elements:
        raise FormatError(
            f"{source}: the parts hold {total} changed elements, the manifest says {header.changed_elements}"
        )
    return merged


def _check_disjoint(parts: list[CodedDelta], source: str) -> list[CodedDelta]:
    """Compact parts (`_check_part` saw their encoding), each coded in its own blocks: no two
    blocks of a parameter share an element."""
    blocks: dict[str, list[Block]] = {}
    for part in parts:
        for name in part.header.shapes:
            block = part.header.block(name)
            if any(block.overlaps(other) for other in blocks.get(name, [])):
                raise FormatError(f"{source}: two parts are coded in overlapping blocks of {name!r}")
            blocks.setdefault(name, []).append(block)
    return parts


@dataclass
class PartedDelta(DeltaFile):
    """A compact delta written in parts, each coded in its rank's blocks; decoded, it is
    applied like a single file.

    Args:
        header: The whole version's header (from the manifest).
        parts: The compact delta parts, read and checked.
    """

    header: FileHeader
    parts: list[CodedDelta]

    def decoded(self, previous: Mapping[str, torch.Tensor]) -> Delta:
        """The version's changes: each part decoded against its blocks of `previous` (the
        weights before the delta), at positions of the full tensors, merged.

        Raises:
            FormatError: A part's coded stream is damaged, or the parts disagree with the manifest.
            ApplyError: `previous` lacks a parameter or holds it with another shape or dtype.
        """
        shapes = self.header.shapes
        changes = []
        for part in self.parts:
            blocks = {name: part.header.block(name) for name in part.header.shapes}
            held = {}
            for name, block in blocks.items():
                full, dtype = previous.get(name), self.header.dtype(name)
                if full is None or tuple(full.shape) != shapes[name] or full.dtype != dtype:
                    raise ApplyError(
                        f"{part.header.source}: the delta changes {str(dtype).removeprefix('torch.')} {name!r} of shape "
                        f"{list(shapes[name])}, held as {None if full is None else (full.dtype, tuple(full.shape))}"
                    )
                held[name] = block.region(full if full.is_contiguous() else full.contiguous())
            local = part.decoded(held)
            changes.append(
                {
                    name: SparseChange(
                        indices=blocks[name]
                        .full_positions(shapes[name], change.indices)
                        .to(index_dtype(math.prod(shapes[name]))),
                        values=change.values,
                    )
                    for name, change in local.changes.items()
                }
            )
        return Delta(header=self.header, changes=_merge_changes(changes, self.header))


@dataclass
class PartedAnchor(VersionFile):
    """An anchor written in parts: each parameter is put together from the parts' blocks
    when asked for. Same interface as [`Anchor`].

    Args:
        header: The whole version's header (from the manifest).
        parts: The anchor parts, open.
    """

    header: FileHeader
    parts: list[Anchor]

    def check_cover(self) -> None:
        """Every element of every parameter is in exactly one part's block."""
        source = self.header.source
        blocks: dict[str, list[Block]] = {name: [] for name in self.header.shapes}
        for part in self.parts:
            for name in part.header.shapes:
                blocks[name].append(part.header.block(name, part.stored_shape(name)))
        for name, shape in self.header.shapes.items():
            found = blocks[name]
            if sum(block.numel for block in found) != math.prod(shape) or any(
                a.overlaps(b) for i, a in enumerate(found) for b in found[i + 1 :]
            ):
                raise FormatError(f"{source}: the parts do not cover parameter {name!r} exactly once")

    def tensor(self, name: str) -> torch.Tensor:
        full = torch.empty(self.header.shapes[name], dtype=self.header.dtype(name))
        for part in self.parts:
            if name in part.header.shapes:
                stored = part.tensor(name)
                part.header.block(name, tuple(stored.shape)).region(full).copy_(stored)
        return full

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.header.names:
            yield name, self.tensor(name)

    def verify(self) -> None:
        """Each part against its own digest and checksum shares; their sum against the manifest.

        Raises:
            IntegrityError: A part is damaged, or the parts' checksums do not add up to the
                manifest's.
        """
        header = self.header
        if model_checksum(header.checksums) != header.model_checksum:
            raise IntegrityError(f"{header.source}: model checksum does not match the per-parameter checksums")
        shares: dict[str, list[int]] = {name: [] for name in header.shapes}
        for part in self.parts:
            part.verify()
            for name, checksum in part.header.checksums.items():
                shares[name].append(checksum)
        for name, checksum in header.checksums.items():
            if add_checksums(*shares[name]) != checksum:
                raise IntegrityError(f"{header.source}: the parts of {name!r} do not add up to its recorded checksum")

    def close(self) -> None:
        for part in self.parts:
            part.close()

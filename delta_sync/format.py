"""The file format: anchors (full weights) and raw deltas, both plain safetensors.

An **anchor** holds one bf16 tensor per parameter, keyed by the checkpoint name that
vLLM's `load_weights` accepts, with metadata `sparse="False"`.

A **raw delta** holds, for every parameter with at least one changed bf16 element,
`{name}.indices` (flat row-major positions, ascending; int32, or int64 for tensors of
2^31 elements or more) and `{name}.values` (the new bf16 values), with metadata
`sparse="True"`, `model_version`, `sparsity` (fraction of elements unchanged) and
`changed_params` (JSON list of names). These are the keys of the published TRL delta
format, so a receiver written against it reads our deltas with `safetensors.safe_open`
alone.

A parameter the model itself keeps in float32 (a MoE router, which transformers keeps
in float32 in a bf16 model and `save_pretrained` stores as F32) travels in float32 instead:
its anchor tensor and its delta values are F32, its changes are those of its float32 bits,
and the file's `dtypes` names it. Every other parameter is bf16, as above.

Both carry further metadata (all values are strings, as safetensors requires):

| key | meaning |
| --- | --- |
| `format` | `"delta-sync"` |
| `format_version` | `"1"` |
| `kind` | `"anchor"` or `"delta"` |
| `model_version` | version the weights have after this file is applied |
| `base_version` | (delta) version the delta applies on top of |
| `anchor_version` | version of the newest anchor at or before `base_version` (anchor: its own) |
| `encoding` | `"dense"` for anchors, `"raw"` or `"compact"` (see `delta_sync.encodings`) for deltas |
| `run_id` | identifier of the training run; deltas never cross runs |
| `epoch` | identifies one start of the publisher (a resumed run gets a new one) |
| `part`, `blocks` | (parts of a sharded version) `rank/world_size`; the offset of each parameter's block in an anchor part or a compact delta part |
| `block_shapes` | (compact delta parts) the shape of each parameter's block, which the part is coded in |
| `shapes` | JSON `{name: shape}` of every parameter in the file |
| `checksums` | JSON `{name: hex}`: state checksum of each parameter in the file *after* applying |
| `base_checksums` | (delta) JSON `{name: hex}`: the same, *before* applying |
| `model_checksum` | digest of the whole model after applying |
| `payload_xxh3` | xxh3-64 of the tensor bytes (see `delta_sync.integrity.payload_digest`) |
| `changed_elements` / `total_elements` | element counts behind `sparsity` |
| `dtypes` | JSON `{name: "F32"}` of every parameter in the file that travels in float32; absent when none does |
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import safetensors.numpy
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .blocks import Block
from .changes import WIRE_DTYPES, Encoding, SparseChange, index_dtype, wire_name
from .encodings import CODECS, Codec
from .errors import FormatError, IntegrityError
from .integrity import (
    PayloadHasher,
    format_checksum,
    model_checksum,
    parse_checksum,
    payload_digest,
    tensor_checksum,
)
from .parallel import parallel_map
from .version import Identified, VersionId, sparsity

__all__ = [
    "Anchor",
    "CodedDelta",
    "Delta",
    "DeltaFile",
    "Encoding",
    "FileHeader",
    "SparseChange",
    "index_dtype",
    "read_file",
    "write_anchor",
    "write_delta",
]

FORMAT_NAME = "delta-sync"
FORMAT_VERSION = "1"
#: For messages: the delta encodings this library reads and writes.
_KNOWN_ENCODINGS = ", ".join(repr(str(encoding)) for encoding in CODECS)


@dataclass(frozen=True)
class FileHeader(Identified):
    """Parsed metadata of an anchor or delta file.

    Args:
        source: Where the file came from (a path or bucket URL), used in error messages.
        kind: `"anchor"` or `"delta"`.
        id: The version the weights have after the file is applied: its number, the anchor
            it descends from, the run and the start of the run's publisher (`epoch`) that
            wrote it (`model_version`, `anchor_version`, `run_id`, `epoch` in the metadata).
        base_version: Version a delta applies on top of; None for anchors.
        encoding: `"dense"` (anchors), `"raw"` or `"compact"` (deltas).
        shapes: Shape of every parameter present in the file.
        checksums: State checksum of every parameter present in the file, after applying.
        base_checksums: For deltas, the same checksums before applying.
        model_checksum: Digest of the whole model after applying.
        payload_digest: xxh3-64 of the tensor payload.
        changed_elements: Number of elements stored (all of them, for an anchor).
        total_elements: Number of elements in the whole model.
        part: `(rank, world_size)` for one rank's part of a version written in parts
            (see `delta_sync.manifest`); None for a whole file. A part's `checksums` are
            its share of each parameter's checksum, and it has no `model_checksum`.
        blocks: For an anchor part or a compact delta part, the offset in each parameter's
            full tensor of the block stored. A single offset with a 1-D block, for a
            parameter of another rank, is a range of the flattened parameter (a DeepSpeed
            ZeRO-3 partition).
        block_shapes: For a compact delta part, the shape of each parameter's block: the part
            codes the block's changes against the block's previous values, at positions
            inside the block. (An anchor part's block has its stored tensor's shape.)
        dtypes: The parameters in the file that travel in float32, with that dtype; every
            other one is bf16 (see [`dtype`]). Computed from the tensors when written.
    """

    source: str
    kind: Literal["anchor", "delta"]
    id: VersionId
    base_version: int | None
    encoding: str
    shapes: dict[str, tuple[int, ...]]
    checksums: dict[str, int]
    base_checksums: dict[str, int]
    model_checksum: str
    changed_elements: int
    total_elements: int
    payload_digest: str = ""
    part: tuple[int, int] | None = None
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    block_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype parameter `name` travels in: bf16, unless the file says float32."""
        return self.dtypes.get(name, torch.bfloat16)

    @property
    def sparsity(self) -> float:
        """Fraction of the model's elements this file leaves unchanged."""
        return sparsity(self.changed_elements, self.total_elements)

    @property
    def names(self) -> list[str]:
        """Parameters present in the file, sorted."""
        return sorted(self.shapes)

    def block(self, name: str, stored_shape: tuple[int, ...] | None = None) -> Block:
        """Where this file's data for `name` sits in the full parameter: an anchor's stored
        tensor (of `stored_shape`), or the block a compact delta part is coded in; the
        whole parameter for a file that is not a part."""
        shape = self.block_shapes.get(name, self.shapes[name] if stored_shape is None else stored_shape)
        return Block(self.blocks.get(name, (0,) * len(shape)), shape)

    def to_metadata(self) -> dict[str, str]:
        metadata = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "sparse": "True" if self.kind == "delta" else "False",
            "model_version": str(self.version),
            "anchor_version": str(self.anchor_version),
            "encoding": self.encoding,
            "run_id": self.run_id,
            "shapes": json.dumps({name: list(shape) for name, shape in sorted(self.shapes.items())}),
            "checksums": _dump_checksums(self.checksums),
            "model_checksum": self.model_checksum,
            "payload_xxh3": self.payload_digest,
            "changed_elements": str(self.changed_elements),
            "total_elements": str(self.total_elements),
        }
        if self.epoch:
            metadata["epoch"] = self.epoch
        if self.part is not None:
            metadata["part"] = f"{self.part[0]}/{self.part[1]}"
        if self.blocks:
            metadata["blocks"] = json.dumps({name: list(offset) for name, offset in sorted(self.blocks.items())})
        if self.block_shapes:
            metadata["block_shapes"] = json.dumps(
                {name: list(shape) for name, shape in sorted(self.block_shapes.items())}
            )
        if self.dtypes:
            metadata["dtypes"] = json.dumps({name: wire_name(dtype) for name, dtype in sorted(self.dtypes.items())})
        if self.kind == "delta":
            metadata.update(
                base_version=str(self.base_version),
                base_checksums=_dump_checksums(self.base_checksums),
                sparsity=f"{self.sparsity:.8f}",
                changed_params=json.dumps(self.names),
            )
        return metadata

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str] | None, *, source: str) -> FileHeader:
        """Parse and check a file's safetensors metadata.

        Args:
            metadata: The metadata as `safe_open(...).metadata()` returns it.
            source: How to name the file in error messages.

        Raises:
            FormatError: Not a delta-sync file of a version this library reads, or a field
                is missing, malformed or contradicts another; the message names the field.
        """
        if not metadata:
            raise FormatError(f"{source}: no safetensors metadata; not a delta-sync file")
        if metadata.get("format") != FORMAT_NAME:
            raise FormatError(f"{source}: metadata 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
        if metadata.get("format_version") != FORMAT_VERSION:
            raise FormatError(
                f"{source}: unsupported format_version {metadata.get('format_version')!r} "
                f"(this library reads {FORMAT_VERSION!r})"
            )
        kind = _KIND_FIELD.read(metadata, source)
        values = {
            spec.key: spec.read(metadata, source)
            for spec in _METADATA_FIELDS
            if kind in spec.kinds and (spec.required or spec.key in metadata)
        }
        _check_consistency(kind, values, source)
        attributes: dict[str, Any] = {"base_version": None, "base_checksums": {}}  # what an anchor lacks
        attributes.update(
            (spec.attribute, values[spec.key]) for spec in _METADATA_FIELDS if spec.attribute and spec.key in values
        )
        identity = VersionId(
            version=values["model_version"],
            anchor_version=values["anchor_version"],
            run_id=values["run_id"],
            epoch=values.get("epoch", ""),
        )
        return cls(source=source, kind=kind, id=identity, **attributes)


@dataclass(frozen=True)
class _Field:
    """One metadata entry: where it goes in [`FileHeader`] and how to parse it.

    Args:
        key: The metadata key.
        attribute: The `FileHeader` attribute it fills; None for entries that are only checked
            or that make up its `id`.
        parse: Turns the stored string into a value; raises `ValueError` (or `TypeError`,
            for a JSON value of the wrong type) if it is malformed.
        kinds: The kinds of file that carry it.
        required: Whether every file of those kinds must carry it.
    """

    key: str
    attribute: str | None
    parse: Callable[[str], Any]
    kinds: tuple[str, ...] = ("anchor", "delta")
    required: bool = True

    def read(self, metadata: Mapping[str, str], source: str) -> Any:
        if self.key not in metadata:
            raise FormatError(f"{source}: metadata field {self.key!r} is missing")
        try:
            return self.parse(metadata[self.key])
        except (ValueError, TypeError, RecursionError, OverflowError) as exc:
            raise _malformed(source, self.key, type(exc).__name__ if isinstance(exc, RecursionError) else exc) from None


def _malformed(source: str, key: str, reason: object) -> FormatError:
    return FormatError(f"{source}: metadata field {key!r} is malformed: {reason}")


_COUNT = re.compile(r"0|[1-9][0-9]{0,18}")


def _parse_count(text: str) -> int:
    """A non-negative decimal integer, written plainly (no sign, spaces, `_` or exponent)."""
    if not isinstance(text, str) or not _COUNT.fullmatch(text):
        raise ValueError(f"{text!r} is not a non-negative integer")
    return int(text)


def _parse_kind(text: str) -> str:
    if text not in ("anchor", "delta"):
        raise ValueError(f"unknown kind {text!r}")
    return text


def _parse_sparse(text: str) -> str:
    if text not in ("True", "False"):
        raise ValueError(f"{text!r} is neither 'True' nor 'False'")
    return text


def _parse_json(text: str, kind: type) -> Any:
    value = json.loads(text)
    if not isinstance(value, kind):
        raise ValueError(f"expected a JSON {'object' if kind is dict else 'list'}, got {type(value).__name__}")
    return value


def _parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name, shape in _parse_json(text, dict).items():
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise ValueError(f"shape of {name!r} is not a list of non-negative integers: {shape!r}")
        shapes[name] = tuple(shape)
    return shapes


def _parse_checksums(text: str) -> dict[str, int]:
    checksums = {}
    for name, value in _parse_json(text, dict).items():
        if not isinstance(value, str):
            raise ValueError(f"checksum of {name!r} is not a string: {value!r}")
        checksums[name] = parse_checksum(value)
    return checksums


def _parse_part(text: str) -> tuple[int, int]:
    rank, sep, world = text.partition("/")
    if not (sep and rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(f"expected 'rank/world_size' with rank < world_size, got {text!r}")
    return int(rank), int(world)


def _parse_blocks(text: str) -> dict[str, tuple[int, ...]]:
    blocks = {}
    for name, offset in _parse_json(text, dict).items():
        if not isinstance(offset, list) or not all(type(d) is int and d >= 0 for d in offset):
            raise ValueError(f"offset of {name!r} is not a list of non-negative integers: {offset!r}")
        blocks[name] = tuple(offset)
    return blocks


def _parse_dtypes(text: str) -> dict[str, torch.dtype]:
    dtypes = {}
    for name, dtype in _parse_json(text, dict).items():
        # bf16 is what a parameter the field does not name travels in; only the others are named.
        if not isinstance(dtype, str) or dtype == "BF16" or dtype not in WIRE_DTYPES:
            others = sorted(set(WIRE_DTYPES) - {"BF16"})
            raise ValueError(f"dtype of {name!r} is {dtype!r}; the field names only parameters in {others}")
        dtypes[name] = WIRE_DTYPES[dtype]
    return dtypes


def _parse_names(text: str) -> list[str]:
    names = _parse_json(text, list)
    if not all(isinstance(name, str) for name in names):
        raise ValueError("expected a JSON list of strings")
    return names


_KIND_FIELD = _Field("kind", "kind", _parse_kind)

#: Every metadata entry a reader checks, in the order errors are reported.
_METADATA_FIELDS = (
    _Field("sparse", None, _parse_sparse),
    _Field("shapes", "shapes", _parse_shapes),
    _Field("checksums", "checksums", _parse_checksums),
    _Field("base_checksums", "base_checksums", _parse_checksums, ("delta",)),
    _Field("base_version", "base_version", _parse_count, ("delta",)),
    _Field("changed_params", None, _parse_names, ("delta",)),
    _Field("model_version", None, _parse_count),
    _Field("anchor_version", None, _parse_count),
    _Field("changed_elements", "changed_elements", _parse_count),
    _Field("total_elements", "total_elements", _parse_count),
    _Field("encoding", "encoding", str),
    _Field("run_id", None, str),
    _Field("model_checksum", "model_checksum", str),
    _Field("payload_xxh3", "payload_digest", str),
    _Field("epoch", None, str, required=False),
    _Field("part", "part", _parse_part, required=False),
    _Field("blocks", "blocks", _parse_blocks, required=False),
    _Field("block_shapes", "block_shapes", _parse_shapes, ("delta",), required=False),
    _Field("dtypes", "dtypes", _parse_dtypes, required=False),
)


def _check_consistency(kind: str, values: Mapping[str, Any], source: str) -> None:
    """Checks across fields: `sparse` agrees with `kind`, and every parameter has its entries."""
    if values["sparse"] != ("True" if kind == "delta" else "False"):
        raise _malformed(source, "sparse", f"{values['sparse']!r} contradicts kind {kind!r}")
    shapes = values["shapes"]
    if kind == "delta" and sorted(values["changed_params"]) != sorted(shapes):
        raise _malformed(source, "changed_params", "does not list the same parameters as 'shapes'")
    for key in ("checksums", "base_checksums") if kind == "delta" else ("checksums",):
        missing = [name for name in shapes if name not in values[key]]
        if missing:
            raise FormatError(f"{source}: metadata {key!r} has no entry for {missing[0]!r}")
    if "dtypes" in values and not set(values["dtypes"]) <= set(shapes):
        stray = sorted(set(values["dtypes"]) - set(shapes))[0]
        raise _malformed(source, "dtypes", f"names {stray!r}, which 'shapes' does not")
    if "blocks" in values and ("part" not in values or sorted(values["blocks"]) != sorted(shapes)):
        raise _malformed(source, "blocks", "only a part has blocks, one per parameter of 'shapes'")
    # A compact delta part is coded in blocks; any other delta holds positions in full tensors.
    coded_in_blocks = kind == "delta" and "part" in values and values["encoding"] == Encoding.COMPACT
    if kind == "delta" and ("blocks" in values) != coded_in_blocks:
        raise _malformed(source, "blocks", "a compact delta part has blocks, and no other delta has")
    if ("block_shapes" in values) != coded_in_blocks:
        raise _malformed(source, "block_shapes", "a compact delta part has block shapes, and no other file has")
    if coded_in_blocks:
        if sorted(values["block_shapes"]) != sorted(shapes):
            raise _malformed(source, "block_shapes", "does not list the same parameters as 'shapes'")
        for name, shape in shapes.items():
            block = Block(values["blocks"][name], values["block_shapes"][name])
            if not block.fits(shape):
                raise _malformed(source, "blocks", f"the block of {name!r} does not lie inside its shape {list(shape)}")


def _dump_checksums(checksums: Mapping[str, int]) -> str:
    return json.dumps({name: format_checksum(value) for name, value in sorted(checksums.items())})


_File = TypeVar("_File", bound="VersionFile")


class VersionFile:
    """What [`read_file`] returns: an anchor or a delta, open until closed (`with
    read_file(path) as file:` closes what it holds open)."""

    def close(self) -> None:
        """Release the file's handle; idempotent."""

    def __enter__(self: _File) -> _File:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class Anchor(VersionFile):
    """A full-weights file, read lazily: each tensor is loaded from disk when asked for.

    [`read_file`] checks its structure; [`Anchor.verify`] reads the tensors and checks them
    against the recorded checksums and payload digest. Use it as a context manager (or call
    `close`) to release the open file.

    Args:
        header: The parsed metadata.
        path: Local path of the file.

    Example:
        ```python
        >>> with read_file("anchors/step_00000001.safetensors") as anchor:
        ...     anchor.verify()
        ...     embed = anchor.tensor("model.embed_tokens.weight")
        ```
    """

    header: FileHeader
    path: Path
    _handle: safe_open | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        """Load one parameter (CPU; bf16, or float32 where the header's `dtypes` says).

        Raises:
            FormatError: The tensor cannot be read.
            ValueError: The anchor is closed.
        """
        try:
            return self._reader().get_tensor(name)
        except SafetensorError as exc:
            raise FormatError(f"{self.header.source}: cannot read tensor {name!r}: {exc}") from exc

    def _reader(self) -> safe_open:
        if self._closed:
            raise ValueError(f"{self.header.source}: the anchor is closed")
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the tensor stored for `name` (a block's, for an anchor part)."""
        return tuple(self._reader().get_slice(name).get_shape())

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` for every parameter, in sorted name order, one at a time."""
        for name in self.header.names:
            yield name, self.tensor(name)

    def verify(self) -> None:
        """Check that the stored tensors are the ones the trainer recorded.

        Reads every tensor twice (per-parameter checksums on all cores, then the payload
        digest), holding one tensor per core at a time.

        Raises:
            IntegrityError: A parameter, the payload digest or the model checksum does not
                match the recorded value; the message names the file and the parameter.
        """
        header = self.header
        if header.part is None and model_checksum(header.checksums) != header.model_checksum:
            raise IntegrityError(f"{header.source}: model checksum does not match the per-parameter checksums")
        self._reader()  # open once, before the threads read through it
        names = header.names

        def checksum_of(name: str) -> int:
            tensor = self.tensor(name)
            block = header.block(name, tuple(tensor.shape))
            return tensor_checksum(tensor, block.position_of(header.shapes[name]))

        for name, checksum in zip(names, parallel_map(checksum_of, names)):
            if checksum != header.checksums[name]:
                raise IntegrityError(f"{header.source}: parameter {name!r} does not match its recorded checksum")
        hasher = PayloadHasher()
        for name, tensor in self.items():
            hasher.update(name, tensor)
        if hasher.hexdigest() != header.payload_digest:
            raise IntegrityError(f"{header.source}: payload digest does not match; the file is damaged")

    def close(self) -> None:
        """Close the file. Tensors already loaded stay valid."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._closed = None, True


class DeltaFile(VersionFile):
    """A delta as [`read_file`] gives it, fully loaded and checked (deltas are small): a
    [`Delta`], whose changes are stored as they are, or a delta coded against the weights
    before it ([`CodedDelta`]; `delta_sync.manifest.PartedDelta`). Either way,
    `decoded(previous)` is the [`Delta`] to apply.

    It holds no open file; it is a context manager only so that code reading either kind of
    file can say `with read_file(path) as file:`.
    """

    header: FileHeader
    #: Whether [`decoded`] needs the weights before the delta.
    coded: ClassVar[bool] = True

    def decoded(self, previous: Mapping[str, torch.Tensor]) -> Delta:
        """The delta's changes, decoded against `previous` (the weights before it)."""
        raise NotImplementedError


@dataclass
class Delta(DeltaFile):
    """A delta with its changes: a raw delta as read, or any delta once decoded.

    Args:
        header: The parsed metadata.
        changes: Parameter name -> the changed elements.
    """

    header: FileHeader
    changes: dict[str, SparseChange]
    coded: ClassVar[bool] = False

    def decoded(self, previous: Mapping[str, torch.Tensor]) -> Delta:
        """The delta itself: its changes need no decoding."""
        return self


@dataclass
class CodedDelta(DeltaFile):
    """A delta whose positions and values are coded against the weights the replica holds
    (the compact encoding, see `delta_sync.compact`): [`decoded`] gives its changes, given
    those weights.

    Args:
        header: The parsed metadata.
        encoded: The stored entries by name, checked against the header and payload digest.
    """

    header: FileHeader
    encoded: dict[str, torch.Tensor]

    def decoded(self, previous: Mapping[str, torch.Tensor]) -> Delta:
        """The delta with its changes decoded against `previous` (the weights before it).

        Raises:
            FormatError: A coded stream is damaged; the message names the file and tensor.
        """
        # A part is coded in its blocks (`previous` then holds those blocks); a file, in whole tensors.
        changes = CODECS[self.header.encoding].decode(
            self.encoded, previous, _coded_shapes(self.header), self.header.dtypes, self.header.source
        )
        _check_count(changes, self.header, "the coded streams hold")
        return Delta(header=self.header, changes=changes)


def _check_count(changes: Mapping[str, SparseChange], header: FileHeader, holds: str) -> None:
    total = sum(len(change) for change in changes.values())
    if total != header.changed_elements:
        raise FormatError(
            f"{header.source}: metadata 'changed_elements' is {header.changed_elements} but {holds} {total}"
        )


def write_anchor(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], header: FileHeader) -> FileHeader:
    """Write an anchor file.

    Args:
        path: Destination on the local filesystem.
        tensors: Parameter name -> full tensor (CPU, contiguous): bf16, or float32 for a
            parameter that travels in float32.
        header: Metadata; its `kind` must be `"anchor"` and its `shapes` must match
            `tensors`. Its `payload_digest` and `dtypes` are computed here.

    Returns:
        The header as written.
    """
    if header.kind != "anchor":
        raise ValueError("write_anchor needs a header of kind 'anchor'")
    return _write(path, dict(tensors), replace(header, dtypes=_dtypes_of(tensors)))


def write_delta(
    path: str | os.PathLike,
    changes: Mapping[str, SparseChange],
    header: FileHeader,
    previous: Mapping[str, torch.Tensor] | None = None,
    *,
    old_values: Mapping[str, torch.Tensor] | None = None,
) -> FileHeader:
    """Write a delta file in the header's encoding.

    Args:
        path: Destination on the local filesystem.
        changes: Parameter name -> changed elements (CPU), their values bf16, or float32 for
            a parameter that travels in float32. Raw deltas store indices as int32, or
            int64 for parameters of 2^31 elements or more.
        header: Metadata; its `kind` must be `"delta"` and its `shapes` must cover
            `changes`. Its `encoding` is one of `delta_sync.encodings.CODECS` (`"raw"` or
            `"compact"`). Its `payload_digest` and `dtypes` are computed here.
        previous: For the compact encoding, the full bf16 tensors before the change (the
            replica decodes against the same); with `old_values`, the tensors after it.
        old_values: For the compact encoding, the values the changed elements had before
            (aligned with the indices), when `previous` holds the tensors after the change:
            see [`delta_sync.compact.encode_changes`].

    Returns:
        The header as written.
    """
    if header.kind != "delta":
        raise ValueError("write_delta needs a header of kind 'delta'")
    codec = CODECS.get(header.encoding)
    if codec is None:
        raise ValueError(f"unknown delta encoding {str(header.encoding)!r} (known: {_KNOWN_ENCODINGS})")
    header = replace(header, dtypes=_dtypes_of({name: change.values for name, change in changes.items()}))
    return _write(path, codec.encode(changes, _coded_shapes(header), previous, old_values), header)


def _coded_shapes(header: FileHeader) -> dict[str, tuple[int, ...]]:
    """The shape of what a delta's entries hold positions in, per parameter: the block a
    compact part is coded in, the whole parameter otherwise."""
    return {name: header.block(name).shape for name in header.shapes}


def _dtypes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """The header's `dtypes` of a file of `tensors`: those not bf16 (float32, as
    [`WIRE_DTYPES`] allows: anything else raises `TypeError`, naming the tensor)."""
    dtypes = {}
    for name, tensor in tensors.items():
        try:
            wire_name(tensor.dtype)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        if tensor.dtype != torch.bfloat16:
            dtypes[name] = tensor.dtype
    return dtypes


def _write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: FileHeader) -> FileHeader:
    header = replace(header, payload_digest=payload_digest(tensors.items()))
    if all(tensor.dtype == torch.uint8 for tensor in tensors.values()):
        # A compact delta (one uint8 tensor per parameter): safetensors' numpy writer makes
        # the same file at about a third of its torch writer's cost per tensor.
        safetensors.numpy.save_file(
            {name: tensor.numpy() for name, tensor in tensors.items()}, str(path), metadata=header.to_metadata()
        )
    else:
        save_file(tensors, str(path), metadata=header.to_metadata())
    return header


def read_file(path: str | os.PathLike, *, source: str | None = None, part_of: str | None = None) -> Anchor | DeltaFile:
    """Open an anchor or a delta and check that it is well formed.

    This is the one gate that decides whether a file is valid. For a delta it loads every
    tensor and checks dtypes, lengths, index order and range, and the payload digest. For
    an anchor it checks that the stored tensors' names, dtypes and shapes match the
    metadata; tensor data is loaded on access and checked by [`Anchor.verify`]. An anchor
    keeps its file open until closed: use `with read_file(path) as file:`.

    Args:
        path: Local path of the file.
        source: How to name the file in error messages (e.g. its bucket URL); defaults to `path`.
        part_of: The manifest this file is read for, when it is one rank's part of a version
            (see `delta_sync.manifest`). A part read on its own is refused: it holds only
            some of the version's elements.

    Returns:
        An [`Anchor`], or a delta: a [`Delta`] (raw), or a [`CodedDelta`] (compact) to decode
        against the weights before it.

    Raises:
        FormatError: The file is not a well-formed delta-sync file; the message names the
            file and the field or tensor at fault.

    Example:
        ```python
        >>> from delta_sync import read_file
        >>> with read_file("deltas/step_00000002.safetensors") as delta:
        ...     delta.header.version, delta.header.sparsity
        (2, 0.9921)
        >>> indices, values = delta.changes["model.norm.weight"].indices, delta.changes["model.norm.weight"].values
        ```
    """
    source = source or str(path)
    with ExitStack() as stack:
        handle = stack.enter_context(_open(path, source))
        header = FileHeader.from_metadata(handle.metadata(), source=source)
        if header.part is not None and part_of is None:
            rank, world = header.part
            raise FormatError(
                f"{source}: is part {rank + 1} of {world} of {header.kind} v{header.version}, written by a sharded "
                "trainer; apply the version's manifest instead"
            )
        if header.part is None and part_of is not None:
            raise FormatError(f"{source}: is named by {part_of} as a part, but is a whole file")
        if header.kind == "delta":
            return _read_delta(handle, header)
        _check_anchor_layout(handle, header)
        stack.pop_all()  # the anchor closes the handle
        return Anchor(header=header, path=Path(path), _handle=handle)


def _open(path: str | os.PathLike, source: str) -> safe_open:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise FormatError(f"{source}: not a readable safetensors file: {exc}") from exc


def _check_anchor_layout(handle: safe_open, header: FileHeader) -> None:
    keys = set(handle.keys())
    if keys != set(header.shapes):
        missing = sorted(set(header.shapes) - keys)
        extra = sorted(keys - set(header.shapes))
        raise FormatError(
            f"{header.source}: tensors do not match metadata 'shapes' (missing {missing}, unexpected {extra})"
        )
    stored = 0
    for name in sorted(keys):
        view = handle.get_slice(name)
        if view.get_dtype() != wire_name(header.dtype(name)):
            raise FormatError(
                f"{header.source}: tensor {name!r} is {view.get_dtype()}, expected {wire_name(header.dtype(name))}"
                + ("" if name in header.dtypes else " (metadata 'dtypes' does not name it)")
            )
        block = header.block(name, tuple(view.get_shape()))
        if not block.fits(header.shapes[name]) or (header.part is None and block.shape != header.shapes[name]):
            raise FormatError(
                f"{header.source}: tensor {name!r} has shape {tuple(view.get_shape())}"
                + (f" at offset {block.offset}" if header.blocks else "")
                + f", metadata says {header.shapes[name]}"
            )
        stored += block.numel
    if header.changed_elements != stored:
        raise FormatError(f"{header.source}: metadata 'changed_elements' does not match the anchor's tensors")


def _read_delta(handle: safe_open, header: FileHeader) -> DeltaFile:
    codec = CODECS.get(header.encoding)
    if codec is None:
        raise FormatError(
            f"{header.source}: delta encoding {header.encoding!r} is not supported (known: {_KNOWN_ENCODINGS})"
        )
    entries = _read_entries(handle, header, codec)
    codec.check(entries, _coded_shapes(header), header.dtypes, header.source)
    if codec.coded:
        _check_payload(entries, header)
        return CodedDelta(header=header, encoded=entries)
    changes = codec.decode(entries, {}, header.shapes, header.dtypes, header.source)
    _check_count(changes, header, "the file holds")
    _check_payload(entries, header)
    return Delta(header=header, changes=changes)


def _read_entries(handle: safe_open, header: FileHeader, codec: Codec) -> dict[str, torch.Tensor]:
    """Every stored tensor, once the names are exactly the codec's entries of the file's parameters."""
    keys = set(handle.keys())
    expected = {entry for name in header.shapes for entry in codec.entry_names(name, header.dtype(name))}
    if keys != expected:
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        raise FormatError(
            f"{header.source}: tensors do not match 'changed_params' (missing {missing}, unexpected {extra})"
        )
    return {key: handle.get_tensor(key) for key in sorted(keys)}


def _check_payload(tensors: Mapping[str, torch.Tensor], header: FileHeader) -> None:
    digest = payload_digest(tensors.items())
    if digest != header.payload_digest:
        raise FormatError(
            f"{header.source}: payload digest {digest} does not match the recorded {header.payload_digest}; "
            "the file is damaged"
        )

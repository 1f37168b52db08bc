"""The file format: anchors (full bf16 weights) and raw deltas, both plain safetensors.

An **anchor** holds one bf16 tensor per parameter, keyed by the checkpoint name that
vLLM's `load_weights` accepts, with metadata `sparse="False"`.

A **raw delta** holds, for every parameter with at least one changed bf16 element,
`{name}.indices` (flat row-major positions, ascending; int32, or int64 for tensors of
2^31 elements or more) and `{name}.values` (the new bf16 values), with metadata
`sparse="True"`, `model_version`, `sparsity` (fraction of elements unchanged) and
`changed_params` (JSON list of names). These are the keys of the published TRL delta
format, so a receiver written against it reads our deltas with `safetensors.safe_open`
alone.

Both carry further metadata (all values are strings, as safetensors requires):

| key | meaning |
| --- | --- |
| `format` | `"delta-sync"` |
| `format_version` | `"1"` |
| `kind` | `"anchor"` or `"delta"` |
| `model_version` | version the weights have after this file is applied |
| `base_version` | (delta) version the delta applies on top of |
| `anchor_version` | version of the newest anchor at or before `base_version` (anchor: its own) |
| `encoding` | `"dense"` for anchors, `"raw"` for raw deltas |
| `run_id` | identifier of the training run; deltas never cross runs |
| `shapes` | JSON `{name: shape}` of every parameter in the file |
| `checksums` | JSON `{name: hex}`: state checksum of each parameter in the file *after* applying |
| `base_checksums` | (delta) JSON `{name: hex}`: the same, *before* applying |
| `model_checksum` | digest of the whole model after applying |
| `payload_xxh3` | xxh3-64 of the tensor bytes (see `delta_sync.integrity.payload_digest`) |
| `changed_elements` / `total_elements` | element counts behind `sparsity` |
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import FormatError
from .integrity import format_checksum, parse_checksum, payload_digest

__all__ = [
    "Anchor",
    "Delta",
    "FileHeader",
    "SparseChange",
    "index_dtype",
    "read_file",
    "write_anchor",
    "write_delta",
]

FORMAT_NAME = "delta-sync"
FORMAT_VERSION = "1"
INDICES_SUFFIX = ".indices"
VALUES_SUFFIX = ".values"


def index_dtype(numel: int) -> torch.dtype:
    """Index dtype for a tensor of `numel` elements: int32 below 2^31 elements, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass(frozen=True)
class SparseChange:
    """The changed elements of one parameter.

    Args:
        indices: Flat row-major positions, 1-D, strictly ascending.
        values: New bf16 values at `indices`, 1-D, same length.
    """

    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.indices.numel()


@dataclass(frozen=True)
class FileHeader:
    """Parsed metadata of an anchor or delta file.

    Args:
        source: Where the file came from (a path or bucket URL), used in error messages.
        kind: `"anchor"` or `"delta"`.
        version: Model version after the file is applied.
        base_version: Version a delta applies on top of; None for anchors.
        anchor_version: Version of the anchor this file descends from (an anchor's own version).
        encoding: `"dense"` (anchors) or `"raw"` (raw deltas).
        run_id: Identifier of the training run that wrote the file.
        shapes: Shape of every parameter present in the file.
        checksums: State checksum of every parameter present in the file, after applying.
        base_checksums: For deltas, the same checksums before applying.
        model_checksum: Digest of the whole model after applying.
        payload_digest: xxh3-64 of the tensor payload.
        changed_elements: Number of elements stored (all of them, for an anchor).
        total_elements: Number of elements in the whole model.
    """

    source: str
    kind: Literal["anchor", "delta"]
    version: int
    base_version: int | None
    anchor_version: int
    encoding: str
    run_id: str
    shapes: dict[str, tuple[int, ...]]
    checksums: dict[str, int]
    base_checksums: dict[str, int]
    model_checksum: str
    changed_elements: int
    total_elements: int
    payload_digest: str = ""

    @property
    def sparsity(self) -> float:
        """Fraction of the model's elements this file leaves unchanged."""
        if self.total_elements == 0:
            return 1.0
        return 1.0 - self.changed_elements / self.total_elements

    @property
    def names(self) -> list[str]:
        """Parameters present in the file, sorted."""
        return sorted(self.shapes)

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
        if not metadata:
            raise FormatError(f"{source}: no safetensors metadata; not a delta-sync file")
        if metadata.get("format") != FORMAT_NAME:
            raise FormatError(f"{source}: metadata 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
        if metadata.get("format_version") != FORMAT_VERSION:
            raise FormatError(
                f"{source}: unsupported format_version {metadata.get('format_version')!r} "
                f"(this library reads {FORMAT_VERSION!r})"
            )
        field_name = "kind"
        try:
            kind = metadata["kind"]
            if kind not in ("anchor", "delta"):
                raise ValueError(f"unknown kind {kind!r}")
            expected_sparse = "True" if kind == "delta" else "False"
            field_name = "sparse"
            if metadata["sparse"] != expected_sparse:
                raise ValueError(f"{metadata['sparse']!r} contradicts kind {kind!r}")
            field_name = "shapes"
            shapes = {name: tuple(int(d) for d in shape) for name, shape in json.loads(metadata["shapes"]).items()}
            field_name = "checksums"
            checksums = _load_checksums(metadata["checksums"])
            base_checksums: dict[str, int] = {}
            base_version = None
            if kind == "delta":
                field_name = "base_checksums"
                base_checksums = _load_checksums(metadata["base_checksums"])
                field_name = "base_version"
                base_version = int(metadata["base_version"])
                field_name = "changed_params"
                changed_params = json.loads(metadata["changed_params"])
                if sorted(changed_params) != sorted(shapes):
                    raise ValueError("does not list the same parameters as 'shapes'")
            header_fields = {}
            for field_name in ("model_version", "anchor_version", "changed_elements", "total_elements"):
                header_fields[field_name] = int(metadata[field_name])
            for field_name in ("encoding", "run_id", "model_checksum", "payload_xxh3"):
                header_fields[field_name] = str(metadata[field_name])
        except KeyError:
            raise FormatError(f"{source}: metadata field {field_name!r} is missing") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise FormatError(f"{source}: metadata field {field_name!r} is malformed: {exc}") from None
        for name in shapes:
            if name not in checksums:
                raise FormatError(f"{source}: metadata 'checksums' has no entry for {name!r}")
            if kind == "delta" and name not in base_checksums:
                raise FormatError(f"{source}: metadata 'base_checksums' has no entry for {name!r}")
        return cls(
            source=source,
            kind=kind,
            version=header_fields["model_version"],
            base_version=base_version,
            anchor_version=header_fields["anchor_version"],
            encoding=header_fields["encoding"],
            run_id=header_fields["run_id"],
            shapes=shapes,
            checksums=checksums,
            base_checksums=base_checksums,
            model_checksum=header_fields["model_checksum"],
            payload_digest=header_fields["payload_xxh3"],
            changed_elements=header_fields["changed_elements"],
            total_elements=header_fields["total_elements"],
        )


def _dump_checksums(checksums: Mapping[str, int]) -> str:
    return json.dumps({name: format_checksum(value) for name, value in sorted(checksums.items())})


def _load_checksums(text: str) -> dict[str, int]:
    return {name: parse_checksum(value) for name, value in json.loads(text).items()}


@dataclass
class Anchor:
    """A full-weights file. `tensors` loads each tensor from disk on first access.

    Args:
        header: The parsed metadata.
        path: Local path of the file.
    """

    header: FileHeader
    path: Path
    _handle: object = field(default=None, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        """Load one parameter (CPU, bf16)."""
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt")
        try:
            return self._handle.get_tensor(name)  # type: ignore[attr-defined]
        except SafetensorError as exc:
            raise FormatError(f"{self.header.source}: cannot read tensor {name!r}: {exc}") from exc

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` for every parameter, in sorted name order, one at a time."""
        for name in self.header.names:
            yield name, self.tensor(name)


@dataclass
class Delta:
    """A raw delta, fully loaded (deltas are small).

    Args:
        header: The parsed metadata.
        changes: Parameter name -> the changed elements.
    """

    header: FileHeader
    changes: dict[str, SparseChange]


def write_anchor(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], header: FileHeader) -> FileHeader:
    """Write an anchor file.

    Args:
        path: Destination on the local filesystem.
        tensors: Parameter name -> full bf16 tensor (CPU, contiguous).
        header: Metadata; its `kind` must be `"anchor"` and its `shapes` must match
            `tensors`. Its `payload_digest` is computed here.

    Returns:
        The header as written.
    """
    if header.kind != "anchor":
        raise ValueError("write_anchor needs a header of kind 'anchor'")
    return _write(path, dict(tensors), header)


def write_delta(path: str | os.PathLike, changes: Mapping[str, SparseChange], header: FileHeader) -> FileHeader:
    """Write a raw delta file.

    Args:
        path: Destination on the local filesystem.
        changes: Parameter name -> changed elements (CPU). Indices are stored as int32, or
            int64 for parameters of 2^31 elements or more.
        header: Metadata; its `kind` must be `"delta"` and its `shapes` must cover
            `changes`. Its `payload_digest` is computed here.

    Returns:
        The header as written.
    """
    if header.kind != "delta":
        raise ValueError("write_delta needs a header of kind 'delta'")
    return _write(path, raw_delta_tensors(changes, header.shapes), header)


def _write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: FileHeader) -> FileHeader:
    header = replace(header, payload_digest=payload_digest(tensors.items()))
    save_file(tensors, str(path), metadata=header.to_metadata())
    return header


def raw_delta_tensors(
    changes: Mapping[str, SparseChange], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The safetensors entries of a raw delta: `{name}.indices` and `{name}.values` per parameter."""
    tensors = {}
    for name, change in changes.items():
        dtype = index_dtype(math.prod(shapes[name]))
        tensors[name + INDICES_SUFFIX] = change.indices.to(dtype).contiguous()
        tensors[name + VALUES_SUFFIX] = change.values.contiguous()
    return tensors


def read_file(path: str | os.PathLike, *, source: str | None = None) -> Anchor | Delta:
    """Open an anchor or a delta and check that it is well formed.

    For a delta this loads every tensor and checks dtypes, lengths, index order and
    range, and the payload digest. For an anchor it reads the header and checks that the
    stored tensors match it; tensor data is loaded on access (see [`Anchor`]).

    Args:
        path: Local path of the file.
        source: How to name the file in error messages (e.g. its bucket URL); defaults to `path`.

    Returns:
        An [`Anchor`] or a [`Delta`].

    Raises:
        FormatError: The file is not a well-formed delta-sync file; the message names the
            file and the field or tensor at fault.

    Example:
        ```python
        >>> from delta_sync import read_file
        >>> delta = read_file("deltas/step_00000002.safetensors")
        >>> delta.header.version, delta.header.sparsity
        (2, 0.9921)
        >>> indices, values = delta.changes["model.norm.weight"].indices, delta.changes["model.norm.weight"].values
        ```
    """
    source = source or str(path)
    try:
        handle = safe_open(str(path), framework="pt")
        metadata = handle.metadata()
        keys = set(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise FormatError(f"{source}: not a readable safetensors file: {exc}") from exc
    header = FileHeader.from_metadata(metadata, source=source)
    if header.kind == "anchor":
        _check_anchor_layout(handle, keys, header)
        return Anchor(header=header, path=Path(path), _handle=handle)
    if header.encoding != "raw":
        raise FormatError(f"{source}: delta encoding {header.encoding!r} is not supported (known: 'raw')")
    return Delta(header=header, changes=_read_raw_changes(handle, keys, header))


def _check_anchor_layout(handle, keys: set[str], header: FileHeader) -> None:
    if keys != set(header.shapes):
        missing = sorted(set(header.shapes) - keys)
        extra = sorted(keys - set(header.shapes))
        raise FormatError(
            f"{header.source}: tensors do not match metadata 'shapes' (missing {missing}, unexpected {extra})"
        )
    for name in keys:
        view = handle.get_slice(name)
        if view.get_dtype() != "BF16":
            raise FormatError(f"{header.source}: tensor {name!r} is {view.get_dtype()}, expected BF16")
        if tuple(view.get_shape()) != header.shapes[name]:
            raise FormatError(
                f"{header.source}: tensor {name!r} has shape {tuple(view.get_shape())}, "
                f"metadata says {header.shapes[name]}"
            )
    if header.changed_elements != sum(math.prod(shape) for shape in header.shapes.values()):
        raise FormatError(f"{header.source}: metadata 'changed_elements' does not match the anchor's tensors")


def _read_raw_changes(handle, keys: set[str], header: FileHeader) -> dict[str, SparseChange]:
    source = header.source
    expected = {name + suffix for name in header.shapes for suffix in (INDICES_SUFFIX, VALUES_SUFFIX)}
    if keys != expected:
        missing = sorted(expected - keys)
        extra = sorted(keys - expected)
        raise FormatError(f"{source}: tensors do not match 'changed_params' (missing {missing}, unexpected {extra})")
    tensors = {key: handle.get_tensor(key) for key in sorted(keys)}
    changes = {}
    total = 0
    for name, shape in header.shapes.items():
        indices = tensors[name + INDICES_SUFFIX]
        values = tensors[name + VALUES_SUFFIX]
        numel = math.prod(shape)
        if indices.dtype != index_dtype(numel) or indices.dim() != 1:
            raise FormatError(
                f"{source}: {name}{INDICES_SUFFIX} must be 1-D {index_dtype(numel)}, "
                f"got {indices.dim()}-D {indices.dtype}"
            )
        if values.dtype != torch.bfloat16 or values.dim() != 1:
            raise FormatError(
                f"{source}: {name}{VALUES_SUFFIX} must be 1-D bfloat16, got {values.dim()}-D {values.dtype}"
            )
        if values.numel() != indices.numel():
            raise FormatError(f"{source}: {name} has {indices.numel()} indices but {values.numel()} values")
        if indices.numel():
            if int(indices[0]) < 0 or int(indices[-1]) >= numel:
                raise FormatError(
                    f"{source}: {name}{INDICES_SUFFIX} has positions outside [0, {numel}) for shape {list(shape)}"
                )
            if not bool((indices[1:] > indices[:-1]).all()):
                raise FormatError(f"{source}: {name}{INDICES_SUFFIX} is not strictly ascending")
        total += indices.numel()
        changes[name] = SparseChange(indices=indices, values=values)
    if total != header.changed_elements:
        raise FormatError(
            f"{source}: metadata 'changed_elements' is {header.changed_elements} but the file holds {total}"
        )
    digest = payload_digest(tensors.items())
    if digest != header.payload_digest:
        raise FormatError(
            f"{source}: payload digest {digest} does not match the recorded {header.payload_digest}; "
            "the file is damaged"
        )
    return changes

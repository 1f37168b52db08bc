"""Delta encodings: how a delta's changes become safetensors entries and back, in one table.

| [`Encoding`] | entries per changed parameter | decoding needs |
| --- | --- | --- |
| `raw` | `{name}.indices` (int32, or int64 for 2^31 elements or more), `{name}.values` (bf16): the published TRL format | nothing |
| `compact` | `{name}.compact` (uint8, see `delta_sync.compact`) | the weights before the delta |

A parameter that travels in float32 (see `delta_sync.changes.WIRE_DTYPES`) is stored as
raw entries in either encoding, its values F32: the compact coder models bf16 bit patterns,
and these parameters are few and small (a MoE layer's router).

[`CODECS`] maps each delta encoding to its [`Codec`]; `delta_sync.format` writes, checks
and decodes every delta through it. Anchors (`Encoding.DENSE`) store each parameter's full
tensor under its own name and have no codec.

Example:
    ```python
    >>> codec = CODECS[Encoding.RAW]
    >>> change = SparseChange(torch.tensor([1, 5]), torch.tensor([0.5, -1.0], dtype=torch.bfloat16))
    >>> entries = codec.encode({"w": change}, {"w": (4, 4)}, None, None)
    >>> sorted(entries)
    ['w.indices', 'w.values']
    >>> codec.decode(entries, {}, {"w": (4, 4)}, {}, "delta.safetensors")["w"].indices
    tensor([1, 5], dtype=torch.int32)
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from . import compact
from .changes import Encoding, SparseChange, index_dtype
from .errors import FormatError

__all__ = ["CODECS", "INDICES_SUFFIX", "VALUES_SUFFIX", "Codec", "Encoding", "raw_delta_tensors"]

INDICES_SUFFIX = ".indices"
VALUES_SUFFIX = ".values"

Shapes = Mapping[str, tuple[int, ...]]
Entries = Mapping[str, torch.Tensor]
#: Parameter name -> the dtype it travels in, for those that are not bf16 (a header's `dtypes`).
Dtypes = Mapping[str, torch.dtype]


@dataclass(frozen=True)
class Codec:
    """How one delta encoding stores changes.

    Args:
        entry_names: `(name, dtype) -> names`: the entries stored for one parameter that
            travels in `dtype`.
        encode: `(changes, shapes, previous, old_values) -> entries`: the entries to store
            for `changes` (parameter shapes in `shapes`); `previous` and `old_values` as
            `delta_sync.format.write_delta` takes them.
        check: `(entries, shapes, dtypes, source)`: raises `FormatError` unless every entry is
            as the encoding stores it (dtypes, lengths, for raw positions in range and
            ascending); what can be checked without the weights before the delta.
        decode: `(entries, previous, shapes, dtypes, source) -> changes`, `previous` the
            weights before the delta (unused when `coded` is False).
        coded: Whether decoding needs the weights before the delta: a file in this
            encoding is read as a `CodedDelta`, decoded once those weights are at hand.
    """

    entry_names: Callable[[str, torch.dtype], tuple[str, ...]]
    encode: Callable[[Mapping[str, SparseChange], Shapes, Entries | None, Entries | None], dict[str, torch.Tensor]]
    check: Callable[[Entries, Shapes, Dtypes, str], None]
    decode: Callable[[Entries, Entries, Shapes, Dtypes, str], dict[str, SparseChange]]
    coded: bool


# -- raw --------------------------------------------------------------------------------------


def _raw_entry_names(name: str, dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    return name + INDICES_SUFFIX, name + VALUES_SUFFIX


def raw_delta_tensors(changes: Mapping[str, SparseChange], shapes: Shapes) -> dict[str, torch.Tensor]:
    """The safetensors entries of a raw delta: `{name}.indices` and `{name}.values` per parameter."""
    tensors = {}
    for name, change in changes.items():
        dtype = index_dtype(math.prod(shapes[name]))
        indices = change.indices if change.indices.dtype == dtype else change.indices.to(dtype)  # `to` drops the GIL
        tensors[name + INDICES_SUFFIX] = indices.contiguous()
        tensors[name + VALUES_SUFFIX] = change.values.contiguous()
    return tensors


def _check_raw(entries: Entries, shapes: Shapes, dtypes: Dtypes, source: str) -> None:
    for name, shape in shapes.items():
        indices = entries[name + INDICES_SUFFIX]
        values = entries[name + VALUES_SUFFIX]
        numel = math.prod(shape)
        if indices.dtype != index_dtype(numel) or indices.dim() != 1:
            raise FormatError(
                f"{source}: {name}{INDICES_SUFFIX} must be 1-D {index_dtype(numel)}, "
                f"got {indices.dim()}-D {indices.dtype}"
            )
        dtype = dtypes.get(name, torch.bfloat16)
        if values.dtype != dtype or values.dim() != 1:
            raise FormatError(
                f"{source}: {name}{VALUES_SUFFIX} must be 1-D {str(dtype).removeprefix('torch.')}, "
                f"got {values.dim()}-D {values.dtype}"
                + ("" if values.dtype == torch.bfloat16 or name in dtypes else " (metadata 'dtypes' does not name it)")
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


def _decode_raw(
    entries: Entries, previous: Entries, shapes: Shapes, dtypes: Dtypes, source: str
) -> dict[str, SparseChange]:
    return {
        name: SparseChange(indices=entries[name + INDICES_SUFFIX], values=entries[name + VALUES_SUFFIX])
        for name in shapes
    }


# -- compact ----------------------------------------------------------------------------------


def _compact_entry_names(name: str, dtype: torch.dtype) -> tuple[str, ...]:
    return compact.entry_names(name) if dtype == torch.bfloat16 else _raw_entry_names(name)


def _encode_compact(
    changes: Mapping[str, SparseChange], shapes: Shapes, previous: Entries | None, old_values: Entries | None
) -> dict[str, torch.Tensor]:
    if previous is None:
        raise ValueError("the compact encoding needs the tensors before the change")
    coded = {name: change for name, change in changes.items() if change.values.dtype == torch.bfloat16}
    raw = {name: change for name, change in changes.items() if name not in coded}
    return {
        **compact.encode_changes(coded, previous, old_values=old_values),
        **raw_delta_tensors(raw, shapes),
    }


def _check_compact(entries: Entries, shapes: Shapes, dtypes: Dtypes, source: str) -> None:
    raw = {name: shapes[name] for name in dtypes}
    _check_raw(entries, raw, dtypes, source)
    for name in shapes.keys() - raw.keys():
        (key,) = compact.entry_names(name)
        tensor = entries[key]
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise FormatError(f"{source}: {key} must be 1-D uint8, got {tensor.dim()}-D {tensor.dtype}")


def _decode_compact(
    entries: Entries, previous: Entries, shapes: Shapes, dtypes: Dtypes, source: str
) -> dict[str, SparseChange]:
    coded = {name: shape for name, shape in shapes.items() if name not in dtypes}
    changes = compact.decode_changes(
        {key: entries[key] for name in coded for key in compact.entry_names(name)}, previous, coded, source=source
    )
    changes.update(_decode_raw(entries, previous, {name: shapes[name] for name in dtypes}, dtypes, source))
    return changes


#: Every delta encoding's codec.
CODECS: Mapping[Encoding, Codec] = {
    Encoding.RAW: Codec(
        entry_names=_raw_entry_names,
        encode=lambda changes, shapes, previous, old_values: raw_delta_tensors(changes, shapes),
        check=_check_raw,
        decode=_decode_raw,
        coded=False,
    ),
    compact.ENCODING: Codec(
        entry_names=_compact_entry_names,
        encode=_encode_compact,
        check=_check_compact,
        decode=_decode_compact,
        coded=True,
    ),
}

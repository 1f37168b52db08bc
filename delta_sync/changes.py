"""What a delta carries, below every module that stores it: the changed elements of one
parameter ([`SparseChange`]), the dtype of their positions ([`index_dtype`]), the dtypes
values travel in ([`WIRE_DTYPES`]) and the names of the encodings a file stores them in
([`Encoding`]).

`delta_sync.format` (the files), `delta_sync.compact` (one encoding) and
`delta_sync.encodings` (the table of every encoding's codec) all build on this module;
it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["WIRE_DTYPES", "Encoding", "SparseChange", "index_dtype", "wire_name"]

#: The dtypes a parameter travels in, by their safetensors names: bf16, that of every tensor
#: a model holds in bf16 (or that a trainer keeps float32 masters of), and float32, that of
#: a tensor the model itself keeps in float32 (a MoE router, say), which travels unrounded.
WIRE_DTYPES: dict[str, torch.dtype] = {"BF16": torch.bfloat16, "F32": torch.float32}
_WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def wire_name(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype parameters travel in (`"BF16"`, `"F32"`).

    Raises:
        TypeError: No parameter travels in `dtype`.
    """
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        raise TypeError(f"parameters travel as bfloat16 or float32, not {dtype}")
    return name


class Encoding(str, Enum):
    """How a file stores its tensors: the value of its metadata `encoding`.

    A `str`, so that it compares equal to the metadata string and is written as it: `"raw"`.
    """

    #: Anchors: one full bf16 tensor per parameter.
    DENSE = "dense"
    #: Deltas in the published TRL format: `{name}.indices` and `{name}.values`.
    RAW = "raw"
    #: Deltas entropy-coded against the weights before them (`delta_sync.compact`).
    COMPACT = "compact"

    # The value, not `Encoding.RAW`, wherever a string is made of it (as `enum.StrEnum` does).
    __str__ = str.__str__
    __format__ = str.__format__


def index_dtype(numel: int) -> torch.dtype:
    """Index dtype for a tensor of `numel` elements: int32 below 2^31 elements, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass(frozen=True)
class SparseChange:
    """The changed elements of one parameter.

    Args:
        indices: Flat row-major positions, 1-D, strictly ascending.
        values: New values at `indices`, 1-D, same length: bf16, or float32 for a
            parameter that travels in float32 ([`WIRE_DTYPES`]).
    """

    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.indices.numel()

"""What a delta carries, below every module that stores it: the changed elements of one
parameter ([`SparseChange`]), the dtype of their positions ([`index_dtype`]) and the names
of the encodings a file stores them in ([`Encoding`]).

`delta_sync.format` (the files), `delta_sync.compact` (one encoding) and
`delta_sync.encodings` (the table of every encoding's codec) all build on this module;
it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["Encoding", "SparseChange", "index_dtype"]


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
        values: New bf16 values at `indices`, 1-D, same length.
    """

    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.indices.numel()

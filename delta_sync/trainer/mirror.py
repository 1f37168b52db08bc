"""[`HostMirror`]: a host copy of a device snapshot, kept current from the changes.

The detector's snapshot lives with the parameters: on a GPU trainer, in device memory.
Two things need it on the host: an anchor (the whole model, written to a file) and the
compact encoding (which codes each change against the previous value, reading the whole
tensor to group its elements). Copying the snapshot to the host for them moves 2 bytes
per parameter across the bus on every such version, on the stream the training kernels
use. But every change already crosses to the host once, when the detector extracts it:
positions and new values. A host mirror applies them to a host copy of the snapshot
(O(changed elements) of host memory traffic, no device work), so anchors and compact
deltas read host memory the device never has to send again.

The price is host memory: one bf16 copy of every element this rank publishes (2 bytes per
parameter: 16 GB for an 8B model on one rank, 16 GB / world size per rank when sharded),
and one device-to-host copy of the snapshot when the mirror is made.

Example:
    ```python
    >>> mirror = HostMirror(detector.snapshot)
    >>> change_set = detector.changes()
    >>> mirror.apply(change_set)
    >>> mirror.tensors["model.norm.weight"]  # equals detector.snapshot[...] bit for bit
    ```
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..changes import SparseChange
from ..sparse import scatter_many_

__all__ = ["HostMirror"]


class HostMirror:
    """Host bf16 copies of a snapshot's tensors, advanced with each set of changes.

    Args:
        snapshot: Name -> the bf16 tensor to mirror (this rank's block of each parameter),
            on any device; copied once, here.
    """

    def __init__(self, snapshot: Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = {
            name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in snapshot.items()
        }

    @property
    def nbytes(self) -> int:
        """Host memory the mirror holds."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    def apply(self, changes: Mapping[str, SparseChange], local_indices: Mapping[str, torch.Tensor]) -> None:
        """Write the new values of `changes` (host tensors) into the mirror.

        Args:
            changes: Name -> changed elements (positions in the full tensor).
            local_indices: Name -> the same elements' positions in this rank's block,
                for the parameters held as blocks; a whole parameter's positions are
                those of `changes`.
        """
        # One compiled call for all of them: this runs on the training thread, and a torch
        # call per tensor would let go of the interpreter lock and wait for it back.
        scatter_many_(
            (self.tensors[name], local_indices.get(name, change.indices), change.values)
            for name, change in changes.items()
        )

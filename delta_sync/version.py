"""What identifies a version of a run's weights, in one place.

Every file header, manifest, `latest.json`, node snapshot state, receiver and replica
status says which version it describes with a [`VersionId`]; what a replica holds is a
[`HeldVersion`]: that identity with the per-parameter checksums of its weights.

Example:
    ```python
    >>> v7 = VersionId(version=7, anchor_version=1, run_id="run-a", epoch="e1")
    >>> v7.same_start(VersionId(9, 1, "run-a", "e1"))
    True
    >>> HeldVersion(v7, {"w": 12345}).model_checksum
    '...'
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .integrity import model_checksum

__all__ = ["HeldVersion", "Identified", "VersionId", "sparsity"]


@dataclass(frozen=True)
class VersionId:
    """Which version of which run a set of weights is.

    Args:
        version: The version number (the trainer's count of published versions).
        anchor_version: The anchor the version descends from (an anchor's own version).
        run_id: The training run.
        epoch: The start of the run's publisher that wrote it: a run resumed in place gets
            a new epoch, so its rewritten versions are never mistaken for the abandoned
            ones ("" in files written before epochs existed).
    """

    version: int
    anchor_version: int
    run_id: str
    epoch: str = ""

    def same_start(self, other: VersionId | None) -> bool:
        """Whether `other` was written by the same start of the same run."""
        return other is not None and (self.run_id, self.epoch) == (other.run_id, other.epoch)

    def __str__(self) -> str:
        return f"v{self.version} of run {self.run_id} (epoch {self.epoch or '-'})"


class Identified:
    """Reads a record's version facts through its `id` (a [`VersionId`])."""

    id: VersionId

    @property
    def version(self) -> int:
        return self.id.version

    @property
    def anchor_version(self) -> int:
        return self.id.anchor_version

    @property
    def run_id(self) -> str:
        return self.id.run_id

    @property
    def epoch(self) -> str:
        return self.id.epoch


@dataclass(frozen=True)
class HeldVersion:
    """A version as a replica holds it: its identity and the state checksum of every
    parameter (see `delta_sync.integrity`).

    Args:
        id: The version.
        checksums: Parameter name -> state checksum of its weights at that version.
    """

    id: VersionId
    checksums: Mapping[str, int] = field(default_factory=dict)

    @property
    def model_checksum(self) -> str:
        """Digest of the whole model, comparable with `latest.json`'s and the trainer's."""
        return model_checksum(self.checksums)

    @property
    def version(self) -> int:
        return self.id.version


def sparsity(changed_elements: int, total_elements: int) -> float:
    """Fraction of a model's elements a version left unchanged (1.0 for an empty model)."""
    return 1.0 - changed_elements / total_elements if total_elements else 1.0

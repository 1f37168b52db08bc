"""What a file must be before a [`Receiver`] applies it: checks of its header against the
version held, the model's shapes and the bucket's pointer. Each raises a `DeltaSyncError`
naming the file and what is wrong, and changes nothing.

`Receiver` is `delta_sync.replica.receiver.Receiver`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ApplyError, BaseVersionError, FormatError
from ..format import FileHeader
from ..layout import Latest
from ..version import HeldVersion

__all__ = ["check_against_latest", "check_anchor", "check_delta_base", "check_held", "reached"]


def check_delta_base(header: FileHeader, held: HeldVersion | None, anchor_needed: str | None) -> HeldVersion:
    """The delta continues the held weights: same run, trusted (`anchor_needed`, a store's
    reason to want an anchor first, is None), made against the held version; returns
    that version."""
    source = header.source
    if held is None:
        raise BaseVersionError(
            f"{source}: {anchor_needed or 'holds no weights yet'}; load an anchor before a delta",
            held=None,
            base=header.base_version,
        )
    if header.run_id != held.id.run_id:
        raise ApplyError(
            f"{source}: belongs to run {header.run_id}, but the held weights are from run {held.id.run_id}"
        )
    if header.epoch != held.id.epoch:
        raise BaseVersionError(
            f"{source}: written by another start of the run (epoch {header.epoch or '-'}, held: "
            f"{held.id.epoch or '-'}); load an anchor of it first",
            held=held.version,
            base=header.base_version,
        )
    if anchor_needed:
        raise BaseVersionError(
            f"{source}: {anchor_needed}; load an anchor first",
            held=held.version,
            base=header.base_version,
        )
    if header.base_version != held.version:
        raise BaseVersionError(
            f"{source}: applies on top of version {header.base_version}, but version {held.version} is held",
            held=held.version,
            base=header.base_version,
        )
    return held


def check_held(header: FileHeader, weights: Mapping[str, torch.Tensor]) -> None:
    """Every parameter the delta changes is held, with its shape and the dtype it travels in
    (a delta's values are bit patterns of that dtype: written into another, they would be
    other numbers)."""
    for name in header.shapes:
        tensor = weights.get(name)
        if tensor is None:
            raise ApplyError(f"{header.source}: unknown parameter {name!r}")
        if tuple(tensor.shape) != header.shapes[name]:
            raise ApplyError(
                f"{header.source}: parameter {name!r} has shape {list(header.shapes[name])}, "
                f"held shape is {list(tensor.shape)}"
            )
        if tensor.dtype != header.dtype(name):
            raise ApplyError(
                f"{header.source}: parameter {name!r} travels as {header.dtype(name)}, but is held as "
                f"{tensor.dtype}; load an anchor of this run first"
            )


def check_anchor(header: FileHeader, expected: Mapping[str, tuple[int, ...]] | None) -> None:
    """The anchor holds exactly the `expected` parameters, with their shapes (anything,
    while they are unknown)."""
    if not expected:
        return
    unknown = sorted(set(header.shapes) - set(expected))
    missing = sorted(set(expected) - set(header.shapes))
    if unknown:
        raise ApplyError(f"{header.source}: unknown parameter(s) {unknown[:5]}")
    if missing:
        raise ApplyError(f"{header.source}: lacks parameter(s) {missing[:5]}")
    for name, shape in header.shapes.items():
        if shape != expected[name]:
            raise ApplyError(
                f"{header.source}: parameter {name!r} has shape {list(shape)}, expected {list(expected[name])}"
            )


def check_against_latest(header: FileHeader, latest: Latest) -> None:
    """A file is never ahead of the bucket's pointer, nor of another trajectory than it, nor
    of its version with other weights."""
    if header.version > latest.version:
        raise FormatError(
            f"{header.source}: claims version {header.version}, past the bucket's latest.json ({latest.version})"
        )
    if header.run_id != latest.run_id or not latest.owns(header.version, header.epoch):
        raise ApplyError(
            f"{header.source}: belongs to run {header.run_id} (epoch {header.epoch or '-'}), but the bucket's "
            f"latest.json is from run {latest.run_id} (epoch {latest.epoch or '-'})"
        )
    if header.part is None and header.version == latest.version and header.model_checksum != latest.model_checksum:
        raise FormatError(
            f"{header.source}: model_checksum {header.model_checksum}, but the bucket's latest.json names "
            f"model_checksum {latest.model_checksum} for version {latest.version}: one of the two is not the "
            "trainer's; refused"
        )


def reached(held: HeldVersion | None, latest: Latest, *, weights: bool) -> bool:
    """Whether `held` is `latest.json`'s version (with `weights`: of its run, with its weights)."""
    if held is None or held.version != latest.version:
        return False
    return not weights or (held.id.run_id, held.model_checksum) == (latest.run_id, latest.model_checksum)

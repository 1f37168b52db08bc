"""Staging one update's sparse patches for a device: every tensor's changed positions and
new values cross in two buffers, not two copies per tensor.

On a GPU server a delta touches most parameters a little: one host-to-device copy per
tensor would pay a copy's fixed cost (and, from pageable memory, a synchronisation) for
each of them. [`stage_patches`] packs the positions of all of an update's patches into one
host buffer and their values into another, pinned when the device is CUDA so that each
crosses in a single asynchronous copy, and hands back per-tensor views of the device
buffers. It synchronises nothing: the caller does that once, after it has used them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["StagedPatch", "stage_patches"]

#: Positions below this fit an int32 index, half the bytes of an int64 one.
_INT32_LIMIT = 2**31


@dataclass(frozen=True)
class StagedPatch:
    """One tensor's patch on the device.

    Args:
        positions: Flat positions of the changed elements (int32 when every position of
            the update fits, else int64), a view of the update's positions buffer.
        values: The new values at those positions, a view of the update's values buffer.
    """

    positions: torch.Tensor
    values: torch.Tensor


def stage_patches(
    patches: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str,
    *,
    pin_memory: bool | None = None,
) -> dict[str, StagedPatch]:
    """Move the positions and values of one update's patches to `device` in two copies.

    Args:
        patches: Checkpoint name -> (flat positions, new values at them), both 1-D host
            tensors of the same length; every patch's values have one dtype.
        device: Where the patches are used (a CUDA device; on the CPU the buffers stay
            where they are and the views are of them).
        pin_memory: Stage in page-locked host memory, so that the copies are asynchronous;
            default: when `device` is a CUDA device.

    Returns:
        Name -> its [`StagedPatch`], in the order of `patches`. The copies are queued
        (`non_blocking`) on the device's current stream; synchronise once before reading
        the results on the host.

    Raises:
        ValueError: A patch whose positions are not 1-D integers, whose values are not
            1-D, whose positions and values differ in length, or whose values have
            another dtype than the first patch's; the message names the tensor.
    """
    device = torch.device(device)
    if pin_memory is None:
        pin_memory = device.type == "cuda"
    if not patches:
        return {}
    value_dtype = next(iter(patches.values()))[1].dtype
    widest = 0
    for name, (positions, values) in patches.items():
        if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"cannot stage the patch of {name!r}: its positions must be a 1-D int32 or int64 tensor, "
                f"got {positions.dtype} of shape {list(positions.shape)}"
            )
        if values.dim() != 1 or values.numel() != positions.numel():
            raise ValueError(
                f"cannot stage the patch of {name!r}: {positions.numel()} position(s) but values of shape "
                f"{list(values.shape)}"
            )
        if values.dtype != value_dtype:
            raise ValueError(
                f"cannot stage the patch of {name!r}: its values are {values.dtype}, the other patches' {value_dtype}"
            )
        if positions.numel():
            widest = max(widest, int(positions.max()))
    index_dtype = torch.int32 if widest < _INT32_LIMIT else torch.int64
    names = list(patches)
    sizes = [patches[name][0].numel() for name in names]
    positions = _to_device([patches[name][0] for name in names], index_dtype, device, pin_memory)
    values = _to_device([patches[name][1] for name in names], value_dtype, device, pin_memory)
    return {
        name: StagedPatch(position_view, value_view)
        for name, position_view, value_view in zip(names, positions.split(sizes), values.split(sizes), strict=True)
    }


def _to_device(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """`parts` concatenated into one host buffer of `dtype`, queued for `device`."""
    buffer = torch.empty(sum(part.numel() for part in parts), dtype=dtype, pin_memory=pin_memory)
    offset = 0
    for part in parts:
        buffer[offset : offset + part.numel()].copy_(part)  # converts int64 positions to int32 on the way
        offset += part.numel()
    return buffer.to(device, non_blocking=True)

"""`Block`: the part of a parameter that one trainer rank holds and publishes; `ParamShard`
and `ModelLayout`: a rank's share of each parameter.

Both ends use it: the trainer maps the positions of changed elements in its block to
positions in the full checkpoint tensor, and a replica puts the blocks of an anchor's parts
back together. A block is either a hyper-rectangle of the full tensor (FSDP2's shards:
one offset and extent per dimension) or, written with a single dimension for a tensor of
any other number of dimensions, a contiguous range of the flattened tensor
(`full.view(-1)`, DeepSpeed ZeRO-3's partitions). A 1-D tensor's blocks are both at once.
Either way a block's row-major order is the full tensor's order restricted to the block,
so ascending positions stay ascending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Block", "ModelLayout", "ParamShard"]


@dataclass(frozen=True)
class Block:
    """Where a block sits in the full tensor.

    Args:
        offset: Start of the block in each dimension of the full tensor; for a flat block
            (one dimension, full tensor of another number), its start in the flattened tensor.
        shape: Extent of the block in each dimension (a 0 means the block is empty).

    Example:
        ```python
        >>> block = Block(offset=(2, 0), shape=(2, 5))  # rows 2-3 of a (7, 5) tensor
        >>> block.full_positions((7, 5), torch.tensor([0, 6])).tolist()
        [10, 16]
        >>> flat = Block(offset=(8,), shape=(4,))  # elements 8-11 of the same tensor, row-major
        >>> flat.full_positions((7, 5), torch.tensor([0, 3])).tolist()
        [8, 11]
        ```
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_flat(self, full_shape: tuple[int, ...]) -> bool:
        """Whether the block is a range of the flattened tensor of `full_shape` (one dimension
        for a tensor of another number of dimensions)."""
        return len(self.shape) == 1 and len(full_shape) != 1

    def slices(self) -> tuple[slice, ...]:
        """Index of a hyper-rectangular block in the full tensor: `full[block.slices()]`.
        [`region`] also takes flat blocks."""
        return tuple(slice(start, start + size) for start, size in zip(self.offset, self.shape))

    def region(self, full: torch.Tensor) -> torch.Tensor:
        """The elements of `full` the block covers, as a view to read or assign through.

        Args:
            full: The full tensor (contiguous, for a flat block).

        Returns:
            `full[block.slices()]`, or for a flat block the range of `full.view(-1)`.
        """
        if self.is_flat(tuple(full.shape)):
            # view, not reshape: a copy would silently drop writes.
            return full.view(-1)[self.offset[0] : self.offset[0] + self.shape[0]]
        return full[self.slices()]

    def fits(self, full_shape: tuple[int, ...]) -> bool:
        """Whether the block lies inside a tensor of `full_shape`."""
        if self.is_flat(full_shape):
            return (
                len(self.offset) == 1
                and 0 <= self.offset[0]
                and self.offset[0] + self.shape[0] <= math.prod(full_shape)
            )
        return len(self.offset) == len(self.shape) == len(full_shape) and all(
            0 <= start and 0 <= size and start + size <= dim
            for start, size, dim in zip(self.offset, self.shape, full_shape)
        )

    def overlaps(self, other: Block) -> bool:
        """Whether two non-empty blocks of one tensor share an element.

        A flat block and a hyper-rectangle of more than one dimension count as overlapping:
        a tensor's blocks are all of one kind, and mixing them is refused rather than
        compared element by element.
        """
        if not self.numel or not other.numel:
            return False
        if len(self.shape) != len(other.shape):
            return True
        return all(a < b + n and b < a + m for a, m, b, n in zip(self.offset, self.shape, other.offset, other.shape))

    def full_positions(self, full_shape: tuple[int, ...], local: torch.Tensor) -> torch.Tensor:
        """Flat row-major positions in the full tensor of flat positions inside the block.

        Args:
            full_shape: Shape of the full tensor.
            local: 1-D integer positions inside the block (CPU).

        Returns:
            1-D int64 positions inside the full tensor, in the same order.
        """
        positions = local.numpy().astype(np.int64, copy=True)
        if self.shape == full_shape:
            return torch.from_numpy(positions)
        if self.is_flat(full_shape):
            return torch.from_numpy(positions + self.offset[0])
        strides = _row_major_strides(full_shape)
        # A block spanning every trailing dimension is one contiguous run of the full tensor.
        if self.shape[1:] == full_shape[1:]:
            return torch.from_numpy(positions + self.offset[0] * strides[0])
        result = np.zeros_like(positions)
        for dim in reversed(range(len(full_shape))):
            size = self.shape[dim]
            result += (positions % size + self.offset[dim]) * strides[dim]
            positions //= size
        return torch.from_numpy(result)

    def position_of(self, full_shape: tuple[int, ...]):
        """`positions(start, stop)` for [`delta_sync.integrity.tensor_checksum`] of the block's
        share of a parameter; None when the block is the whole tensor."""
        if self.shape == full_shape:
            return None
        return lambda start, stop: self.full_positions(full_shape, torch.arange(start, stop)).numpy()


@dataclass(frozen=True)
class ParamShard:
    """This rank's share of one parameter.

    Args:
        name: Checkpoint name of the parameter.
        global_shape: Shape of the full parameter, as in the checkpoint.
        block: The part this rank holds and publishes.
    """

    name: str
    global_shape: tuple[int, ...]
    block: Block

    @property
    def whole(self) -> bool:
        return self.block.shape == self.global_shape

    def global_indices(self, local: torch.Tensor) -> torch.Tensor:
        """Flat row-major positions in the full tensor of flat positions in the block
        (ascending stays ascending; see [`Block.full_positions`])."""
        return self.block.full_positions(self.global_shape, local)


@dataclass(frozen=True)
class ModelLayout:
    """How a model's parameters are spread over the ranks of a training job.

    Args:
        rank: This process's global rank (0 without torch.distributed).
        world_size: Number of ranks.
        shapes: Checkpoint name -> full shape, for every parameter of the model.
        shards: Checkpoint name -> this rank's block, for the parameters whose elements this
            rank publishes (a subset of `shapes`; empty on ranks that publish nothing).
        sharded: Whether parameters are spread over ranks, as FSDP2 `DTensor`s or ZeRO-3
            partitions (each rank then writes its own part of every version); False when
            rank 0 holds and publishes whole tensors, as in a single process, DDP or
            DeepSpeed ZeRO-1/2.
    """

    rank: int
    world_size: int
    shapes: dict[str, tuple[int, ...]]
    shards: dict[str, ParamShard]
    sharded: bool

    @property
    def total_elements(self) -> int:
        """Elements of the full model."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    @property
    def publishes(self) -> bool:
        """Whether this rank writes anything."""
        return bool(self.shards) or (not self.sharded and self.rank == 0)


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)

"""Where each rank's parameters sit in the model's checkpoint tensors, and which layouts can
be published at all.

A bucket must hold every parameter at its real checkpoint shape with every element written
exactly once, or replicas load garbage that still passes every checksum the trainer wrote.
So the layout is decided once, at train begin, from what the parameters say about
themselves, and anything not understood is refused:

| trainer | parameters | published by |
| --- | --- | --- |
| one process, DDP, DeepSpeed ZeRO-1/2 | whole tensors, identical on every rank | rank 0, single files |
| FSDP2 / HSDP (`fully_shard`) | `DTensor`s with `Shard` / `Replicate` placements | every rank, its own block |
| DeepSpeed ZeRO-3 | empty tensors; `ds_tensor` holds this rank's partition | every rank, its own block |
| FSDP1, `Partial` or strided shards, ZeRO-3 with NVMe offload or MiCS | flattened or partial views | refused |

A rank's *block* of a `DTensor` parameter is a hyper-rectangle of the full tensor: its
offset and shape per dimension (`torch.chunk` semantics, so the last blocks may be short or
empty). On a replicated mesh dimension only coordinate 0 publishes, so each element has
exactly one writer. A ZeRO-3 partition is a contiguous range of the flattened parameter
(`ds_tensor` minus its padding; empty on ranks past the end), so its block is a flat one
(see [`Block`]). Weights are never gathered: each rank reads its own partition.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch
from torch import nn

from ..blocks import Block, ModelLayout, ParamShard
from ..errors import UnsupportedLayoutError

__all__ = ["Block", "ModelLayout", "ParamShard", "describe_model", "full_shape", "local_tensor", "verify_across_ranks"]

SUPPORTED = (
    "supported: a single process, DDP, DeepSpeed ZeRO-1/2 (whole parameters on every rank), "
    "FSDP2/HSDP (torch.distributed.fsdp.fully_shard, DTensor parameters with Shard/Replicate placements) "
    "and DeepSpeed ZeRO-3 partitioned over all ranks (parameters on the accelerator or offloaded to the CPU)"
)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The data of a parameter held by this rank: a `DTensor`'s local shard, a ZeRO-3
    parameter's partition without its padding (1-D), else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.to_local()
    if _is_zero3(param):
        _, size = _zero3_range(param)
        return param.ds_tensor.view(-1).narrow(0, 0, size)
    return param


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint shape of a parameter, also when this rank holds only part of it."""
    return tuple(int(d) for d in (param.ds_shape if _is_zero3(param) else param.shape))


def describe_model(named_parameters: Iterable[tuple[str, nn.Parameter]], model: nn.Module | None = None) -> ModelLayout:
    """Classify a model's parameter layout, refusing any that cannot be published exactly.

    Args:
        named_parameters: `(checkpoint name, parameter)` pairs (wrapper prefixes removed).
        model: The model, to look for wrappers that flatten parameters (FSDP1) and for
            modules whose declared shapes the parameters must have.

    Returns:
        The [`ModelLayout`] of this rank.

    Raises:
        UnsupportedLayoutError: FSDP1, a `DTensor` placement other than `Shard`/`Replicate`,
            ZeRO-3 partitions offloaded to NVMe or spread over a subgroup of the ranks, a
            parameter whose shape is not its module's declared shape, or several processes
            of one job without a process group. The message says what is supported.
    """
    if model is not None:
        _refuse_flattening_wrappers(model)
        declared = _declared_shapes(model)
    else:
        declared = {}
    rank, world_size = _rank_and_world()
    shapes: dict[str, tuple[int, ...]] = {}
    shards: dict[str, ParamShard] = {}
    sharded = False
    for name, param in named_parameters:
        _refuse_partitioned(name, param)
        shape = full_shape(param)
        expected = declared.get(id(param))
        if expected is not None and shape != expected:
            raise UnsupportedLayoutError(
                f"parameter {name!r} has shape {list(shape)} but its module declares {list(expected)}: "
                f"it is a flattened or partial view, which would publish a wrong checkpoint; {SUPPORTED}"
            )
        shapes[name] = shape
        block = _dtensor_block(name, param)
        if block is None:
            block = _zero3_block(name, param, world_size)
        if block is None:
            if rank == 0:
                shards[name] = ParamShard(name, shape, Block((0,) * len(shape), shape))
            continue
        sharded = True
        if block is not _NOT_MINE:
            shards[name] = ParamShard(name, shape, block)
    return ModelLayout(rank=rank, world_size=world_size, shapes=shapes, shards=shards, sharded=sharded)


# A DTensor block held by another coordinate of a replicated mesh dimension.
_NOT_MINE = Block((), ())


def _dtensor_block(name: str, param: torch.Tensor) -> Block | None:
    """The block a `DTensor` parameter holds here; None for a plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    mesh, placements = param.device_mesh, param.placements
    for dim, placement in enumerate(placements):
        # Exact types: subclasses such as _StridedShard interleave elements differently.
        if type(placement) not in (Shard, Replicate):
            raise UnsupportedLayoutError(
                f"parameter {name!r} has placement {placement} on mesh dimension {dim}, which delta-sync "
                f"cannot map to checkpoint positions yet; {SUPPORTED}"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return _NOT_MINE
    if any(type(p) is Replicate and coordinate[dim] != 0 for dim, p in enumerate(placements)):
        return _NOT_MINE
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(tuple(param.shape), mesh, placements)
    local_shape = tuple(int(d) for d in local_shape)
    if local_shape != tuple(param.to_local().shape):
        raise UnsupportedLayoutError(
            f"parameter {name!r}: its local shard has shape {list(param.to_local().shape)}, but its placements "
            f"{placements} give {list(local_shape)}; {SUPPORTED}"
        )
    return Block(tuple(int(o) for o in offset), local_shape)


def _is_zero3(param: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned the parameter (it then has a `ds_id`)."""
    return hasattr(param, "ds_id")


def _zero3_range(param: torch.Tensor) -> tuple[int, int]:
    """Start and length, in the flattened parameter, of the elements this rank's partition holds.

    Every rank's `ds_tensor` has the same length, rank r's starting at r times it; the last
    partitions are padded past the end of the tensor, or hold nothing but padding.
    """
    partition = param.ds_tensor.numel()
    rank, _ = _zero3_group(param)
    start = min(partition * rank, param.ds_numel)
    return start, min(partition, param.ds_numel - start)


def _zero3_group(param: torch.Tensor) -> tuple[int, int]:
    """This rank's position in, and the size of, the group a ZeRO-3 parameter is partitioned over."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    group = getattr(param, "ds_process_group", None)
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _zero3_block(name: str, param: torch.Tensor, world_size: int) -> Block | None:
    """The flat block a ZeRO-3 parameter's partition holds here; None for another parameter."""
    if not _is_zero3(param):
        return None
    partition = getattr(param, "ds_tensor", None)
    location = getattr(partition, "final_location", None)
    if partition is None or getattr(location, "value", location) == "nvme":
        raise UnsupportedLayoutError(
            f"parameter {name!r} is partitioned by DeepSpeed ZeRO-3 but its partition is not in memory (NVMe "
            f"offload?); delta-sync reads each rank's partition where it lies. Offload parameters to the CPU or "
            f"not at all; {SUPPORTED}"
        )
    _, group_size = _zero3_group(param)
    if group_size != world_size:
        raise UnsupportedLayoutError(
            f"parameter {name!r} is partitioned by DeepSpeed ZeRO-3 over {group_size} of the {world_size} ranks "
            f"(MiCS), so each element has several holders; {SUPPORTED}"
        )
    if math.prod(full_shape(param)) != param.ds_numel:
        raise UnsupportedLayoutError(
            f"parameter {name!r}: ZeRO-3 says it has {param.ds_numel} elements but shape {list(param.ds_shape)}; "
            f"{SUPPORTED}"
        )
    start, size = _zero3_range(param)
    if not size:
        return _NOT_MINE
    return Block((start,), (size,))


def _refuse_flattening_wrappers(model: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module_name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            raise UnsupportedLayoutError(
                f"the model is wrapped in FSDP1 (FullyShardedDataParallel at {module_name or 'the root'}): its "
                "parameters are flattened slices, not checkpoint tensors, so a rank cannot publish them. "
                f"Use FSDP2 instead (fully_shard; Accelerate: fsdp_version: 2); {SUPPORTED}"
            )


def _refuse_partitioned(name: str, param: torch.Tensor) -> None:
    from torch.distributed.fsdp import FlatParameter

    if isinstance(param, FlatParameter) or name.endswith("_flat_param"):
        raise UnsupportedLayoutError(f"parameter {name!r} is an FSDP1 flat parameter; {SUPPORTED}")


def _declared_shapes(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Shapes that standard modules promise for their parameters, by parameter id."""
    declared: dict[int, tuple[int, ...]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        if isinstance(module, nn.Linear):
            _declare(declared, weight, (module.out_features, module.in_features))
            _declare(declared, bias, (module.out_features,))
        elif isinstance(module, nn.Embedding):
            _declare(declared, weight, (module.num_embeddings, module.embedding_dim))
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.elementwise_affine:
            _declare(declared, weight, tuple(module.normalized_shape))
            _declare(declared, bias, tuple(module.normalized_shape))
    return declared


def _declare(declared: dict[int, tuple[int, ...]], param: object, shape: tuple[int, ...]) -> None:
    if isinstance(param, torch.Tensor):
        declared[id(param)] = tuple(int(d) for d in shape)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1:
        raise UnsupportedLayoutError(
            f"this process was launched as one of {launched} (WORLD_SIZE={launched}), but torch.distributed is "
            "not initialized: the ranks would train and publish independently to the same bucket. Initialize "
            "the process group (accelerate launch with a multi-process configuration, or "
            "torch.distributed.init_process_group) before training"
        )
    return 0, 1


def verify_across_ranks(
    layout: ModelLayout, named_parameters: Iterable[tuple[str, torch.Tensor]], group: object | None = None
) -> None:
    """Check, on every rank together, that the ranks agree on what will be published.

    Every rank must see the same parameter names and full shapes; each parameter's
    elements must be published exactly once over all ranks; and a parameter held whole (not
    a `DTensor` nor partitioned by ZeRO-3) must be bit-identical on every rank, as DDP and
    ZeRO-1/2 keep it. A sharding this module does not recognise (e.g. hand-made tensor parallelism with plain
    tensors) fails one of these before anything is written. Exchanges only shapes, counts
    and 64-bit checksums, never weights.

    Args:
        layout: This rank's [`ModelLayout`].
        named_parameters: `(checkpoint name, parameter)` pairs, as given to [`describe_model`].
        group: The process group to use (default: the global one).

    Raises:
        UnsupportedLayoutError: On every rank alike, naming the parameter and the rank.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ..integrity import tensor_checksum

    if layout.world_size == 1:
        return
    whole = {
        name: tensor_checksum(param.detach().to(torch.bfloat16))
        for name, param in named_parameters
        if not (isinstance(param, DTensor) or _is_zero3(param))
    }
    mine = {
        "shapes": layout.shapes,
        "published": {name: shard.block.numel for name, shard in layout.shards.items()},
        "whole": whole,
    }
    everyone: list[dict] = [{} for _ in range(layout.world_size)]
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, seen in enumerate(everyone):
        if seen["shapes"] != reference["shapes"]:
            differing = sorted(
                name
                for name in set(seen["shapes"]) | set(reference["shapes"])
                if seen["shapes"].get(name) != reference["shapes"].get(name)
            )
            raise UnsupportedLayoutError(
                f"rank {rank} sees parameters {differing[:5]} with other names or shapes than rank 0: the model is "
                f"split across ranks in a way delta-sync does not recognise; {SUPPORTED}"
            )
        for name, checksum in seen["whole"].items():
            if reference["whole"].get(name) != checksum:
                raise UnsupportedLayoutError(
                    f"parameter {name!r} is a plain tensor but differs between rank 0 and rank {rank}: it is not "
                    f"replicated (a hand-made shard?), so no single rank can publish it; {SUPPORTED}"
                )
    for name, shape in reference["shapes"].items():
        published = sum(seen["published"].get(name, 0) for seen in everyone)
        if published != math.prod(shape):
            raise UnsupportedLayoutError(
                f"parameter {name!r}: the ranks together publish {published} of its {math.prod(shape)} elements; "
                f"{SUPPORTED}"
            )

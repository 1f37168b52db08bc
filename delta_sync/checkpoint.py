"""Checkpoint naming: what a model's weights are called, shaped and laid out in its checkpoint.

A bucket holds the checkpoint that `save_pretrained` writes for the model: its names,
shapes and layout. At run time transformers may keep another layout: MoE experts fused
into one tensor per layer (`mlp.experts.gate_up_proj` of shape `[E, 2I, H]` where the
checkpoint has `mlp.experts.{e}.gate_proj.weight` and `...up_proj.weight`), prefixes
renamed (Mixtral's `mlp.` is `block_sparse_moe.` in its checkpoint). transformers' own
conversion mapping (`transformers.conversion_mapping`, reverted by
`transformers.core_model_loading.revert_weight_conversion` when it saves) is the one
source of truth for that, so [`CheckpointLayout`] derives the map from it, once per
model, by probing: each run-time tensor goes through the reverted conversion holding its
own flat positions, and every checkpoint tensor that comes out must be a *box* of one
run-time tensor (a corner and a size per run-time dimension, and an order of dimensions:
what chunking, splitting, unstacking and transposing give), the boxes of a run-time tensor
covering it exactly once. Anything else (interleaving, concatenating several run-time
tensors into one checkpoint tensor, ...) is refused when the layout is made, before
anything is written. The run-time tensors that one converter reverts together (a layer's
fused experts) are probed together, and each distinct conversion once: the same converter in
the next layer takes the same boxes, its names and shapes checked against transformers' own
conversion on the meta device, so that making the layout of a large MoE costs about one
layer's probes. Per step, changed positions are then mapped in O(changed elements), and a
checkpoint tensor's value is a view of its box. A rank of a sharded model (FSDP2) publishes,
of each checkpoint tensor, the part its block of the parameter holds: the intersection of
two boxes, itself a block of the checkpoint tensor.

Only this module knows about transformers' conversion API, and only when a model asks.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import Block, ModelLayout, ParamShard
from .errors import UnservableModelError
from .format import SparseChange, index_dtype

__all__ = [
    "CheckpointBox",
    "CheckpointLayout",
    "canonical_name",
    "check_checkpoint_names",
    "kept_in_float32",
    "pretrained_model",
]

logger = logging.getLogger(__name__)

# Segments that wrappers insert into parameter names: DDP / Accelerate (`module`),
# torch.compile (`_orig_mod`), FSDP1 and activation checkpointing. The names we publish
# are the checkpoint names vLLM's `load_weights` expects, so these must go.
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def canonical_name(name: str) -> str:
    """Name of a parameter without wrapper segments such as `module.`.

    Example:
        ```python
        >>> canonical_name("module._orig_mod.model.layers.0.mlp.up_proj.weight")
        'model.layers.0.mlp.up_proj.weight'
        ```
    """
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def pretrained_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost transformers `PreTrainedModel` in `model` and its path (wrapper
    segments dropped), or None when it holds none (or transformers is not installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return canonical_name(path), module
    return None


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model`'s checkpoint holds, by checkpoint name: its persistent ones (as
    `state_dict` has them), but those transformers does not save (`_keys_to_ignore_on_save`).

    They are weights a replica serves that no optimizer steps: DeepSeek-V3's and GLM-4.5's
    MoE routers keep their score correction bias (`mlp.gate.e_score_correction_bias`) as
    one, and vLLM loads it from the checkpoint like any weight.
    """
    ignored = set()
    found = pretrained_model(model)
    if found is not None:
        path, pretrained = found
        prefix = f"{path}." if path else ""
        ignored = {prefix + key for key in getattr(pretrained, "_keys_to_ignore_on_save", None) or ()}
    buffers: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is None or key in module._non_persistent_buffers_set:
                continue
            name = canonical_name(f"{path}.{key}" if path else key)
            if name not in ignored:
                buffers.setdefault(name, buffer)
    return buffers


def kept_in_float32(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The tensors among `names` (`model`'s, by their names in it) that its transformers
    model keeps in float32 when loaded in bf16, such as DeepSeek-V3's and GLM-4.5's MoE
    routers: those transformers' own dtype plan for bf16 matches (the model's
    `_keep_in_fp32_modules_strict`), matched as `from_pretrained` matches them. None for a
    model that is not a transformers model, or whose transformers has no such plan.

    Example:
        ```python
        >>> sorted(kept_in_float32(model, dict(model.named_parameters())))[:1]
        ['model.layers.1.mlp.gate.weight']
        ```
    """
    found = pretrained_model(model)
    plan = None if found is None else getattr(found[1], "_get_dtype_plan", None)
    patterns = [] if plan is None else list(plan(torch.bfloat16))
    if not patterns:
        return set()
    from transformers.core_model_loading import build_glob_alternation

    alternation, _, _ = build_glob_alternation(patterns)
    prefix = f"{found[0]}." if found[0] else ""
    return {name for name in names if name.startswith(prefix) and alternation.search(name.removeprefix(prefix))}


def check_checkpoint_names(names: Iterable[str], model: nn.Module) -> None:
    """Refuse a transformers model whose parameter names are not its model class's own.

    Those are the names of the model's class built afresh from its config (on the meta
    device: nothing is allocated), the names [`CheckpointLayout.of`] maps to the
    checkpoint's. A model that is no `transformers` `PreTrainedModel` and holds none is not
    checked: nothing says what its checkpoint names are.

    Args:
        names: The parameter names that would be tracked (wrapper segments such as
            `module.` already dropped, PEFT names already mapped).
        model: The module those names are relative to.

    Raises:
        UnservableModelError: A name is not the checkpoint's; the message names it and
            the options.
    """
    found = pretrained_model(model)
    if found is None:
        return
    _, pretrained = found
    try:
        with torch.device("meta"):
            # A copy: building a model may adjust its config (e.g. the attention implementation).
            fresh = type(pretrained)(copy.deepcopy(pretrained.config))
    except Exception as error:  # a model class that cannot be rebuilt from its config alone
        logger.warning(
            "delta-sync: cannot rebuild %s from its config to check parameter names (%s); publishing them as they are",
            type(pretrained).__name__,
            error,
        )
        return
    # The checkpoint's names are the transformers model's own: whatever holds it may add
    # only the wrapper segments `canonical_name` drops (`module.`, `_orig_mod.`, ...).
    expected = {name for name, _ in fresh.named_parameters()} | set(persistent_buffers(fresh))
    unknown = sorted(name for name in names if name not in expected)
    if unknown:
        example = sorted(expected)[0] if expected else "(none)"
        raise UnservableModelError(
            f"parameter {unknown[0]!r} (and {len(unknown) - 1} more) is not a parameter of the "
            f"{type(pretrained).__name__} checkpoint a replica serves (whose names are like {example!r}): a wrapper "
            "around the model changed its parameter names, and replicas could not load what would be published. "
            "Publish the unwrapped transformers model (the wrappers delta-sync knows are DDP, Accelerate, "
            "torch.compile, FSDP2, DeepSpeed, activation checkpointing and PEFT LoRA), or publish with a "
            "BF16ChangeDetector over a module named like the checkpoint"
        )


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class CheckpointBox:
    """Where one checkpoint tensor lies in the run-time tensor it is cut from.

    Args:
        name: The checkpoint name.
        source: The run-time (parameter) name it is cut from.
        shape: Its checkpoint shape.
        corner: Its lowest index in the run-time tensor, per run-time dimension.
        sizes: Its extent per run-time dimension.
        dims: Per checkpoint dimension, the run-time dimension it runs along, or None for
            a dimension of size 1 that the run-time tensor does not have.
    """

    name: str
    source: str
    shape: tuple[int, ...]
    corner: tuple[int, ...]
    sizes: tuple[int, ...]
    dims: tuple[int | None, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def order(self) -> tuple[int, ...]:
        """The run-time dimensions in checkpoint order, those of size 1 the checkpoint drops last."""
        kept = [d for d in self.dims if d is not None]
        return (*kept, *(d for d in range(len(self.sizes)) if d not in kept))

    @property
    def permuted(self) -> bool:
        """Whether the checkpoint tensor runs through its box in another order than row-major
        (then positions need sorting and its value a copy)."""
        kept = [d for d in self.dims if d is not None]
        return kept != sorted(kept)

    @property
    def whole(self) -> bool:
        """Whether it is the whole run-time tensor, unpermuted and unreshaped: a rename at most."""
        return (
            not self.permuted
            and all(c == 0 for c in self.corner)
            and tuple(self.sizes) == tuple(self.shape)
            and all(d == j for j, d in enumerate(self.dims))
        )

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The box of a run-time tensor as a tensor of the checkpoint shape: a view (possibly
        not contiguous) that writes through to `tensor`."""
        if self.whole:
            return tensor
        box = tensor[tuple(slice(c, c + s) for c, s in zip(self.corner, self.sizes))]
        # Only dimensions of size 1 come or go: always a view (`view`, so that a copy, which
        # would silently drop writes, fails instead).
        return box.permute(self.order).view(self.shape)

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor's value from its run-time tensor: a view of the box, copied
        only where the box is not contiguous (a permuted one, above all)."""
        view = self.view(tensor)
        return view if view.is_contiguous() else view.contiguous()


class _SourceMap:
    """How one run-time tensor's flat positions map to positions in its checkpoint tensors."""

    def __init__(self, shape: tuple[int, ...], boxes: list[CheckpointBox]) -> None:
        self.boxes = boxes
        self.shape = shape
        self.strides = _row_major_strides(shape)
        # Per run-time dimension, the boundaries between boxes: an element's interval in
        # each dimension picks its cell, and a small table its box.
        self.bounds: list[torch.Tensor | None] = []
        cells = []
        for d, size in enumerate(shape):
            edges = sorted({0, size} | {b.corner[d] for b in boxes} | {b.corner[d] + b.sizes[d] for b in boxes})
            self.bounds.append(torch.tensor(edges[1:-1], dtype=torch.int64) if len(edges) > 2 else None)
            cells.append(len(edges) - 1)
        self.cell_strides = _row_major_strides(tuple(cells))
        self.table = torch.full((math.prod(cells),), -1, dtype=torch.int64)
        for number, box in enumerate(boxes):
            ranges = []
            for d in range(len(shape)):
                edges = [0, *(self.bounds[d].tolist() if self.bounds[d] is not None else []), shape[d]]
                first = edges.index(box.corner[d])
                last = edges.index(box.corner[d] + box.sizes[d])
                ranges.append(torch.arange(first, last) * self.cell_strides[d])
            cell_ids = (
                sum(torch.meshgrid(*ranges, indexing="ij")).reshape(-1) if ranges else torch.zeros(1, dtype=torch.int64)
            )
            if (self.table[cell_ids] != -1).any():
                raise ValueError(f"{box.name!r} overlaps another checkpoint tensor cut from {box.source!r}")
            self.table[cell_ids] = number
        if (self.table == -1).any():
            raise ValueError(f"part of {boxes[0].source!r} is in no checkpoint tensor")
        # Checkpoint position = sum over run-time dims of coordinate * weight - offset.
        weights = torch.zeros((len(boxes), len(shape)), dtype=torch.int64)
        offsets = torch.zeros(len(boxes), dtype=torch.int64)
        for number, box in enumerate(boxes):
            strides = _row_major_strides(box.shape)
            for j, d in enumerate(box.dims):
                if d is not None:
                    weights[number, d] = strides[j]
                    offsets[number] += box.corner[d] * strides[j]
        self.weights, self.offsets = weights, offsets
        self.renamed = boxes[0] if len(boxes) == 1 and boxes[0].whole else None
        # The common case (stacked experts, chunks of leading dimensions): every box is a run
        # of consecutive run-time positions, in the same order. Ascending positions then split
        # into boxes at a binary search per box, and a checkpoint position is the run-time
        # one less the box's start: no per-element lookup, no sort.
        self.starts: list[int] | None = None
        if all(self._is_run(box) for box in boxes):
            self.starts = [sum(c * st for c, st in zip(box.corner, self.strides)) for box in boxes]
            self.by_start = sorted(range(len(boxes)), key=lambda number: self.starts[number])

    def _is_run(self, box: CheckpointBox) -> bool:
        """Whether a box is a run of consecutive run-time positions in checkpoint order."""
        if box.permuted:
            return False
        wide = [d for d, size in enumerate(box.sizes) if size > 1]
        return not wide or all(
            box.corner[d] == 0 and box.sizes[d] == self.shape[d] for d in range(wide[0] + 1, len(self.shape))
        )

    def map(self, positions: torch.Tensor) -> list[tuple[CheckpointBox, torch.Tensor, torch.Tensor | slice | None]]:
        """`(box, checkpoint positions ascending, selection)` for each box holding any of
        `positions` (ascending run-time positions); the selection (an index or a slice)
        picks, from anything aligned with `positions`, what is aligned with the checkpoint
        positions (None: everything, in order)."""
        if self.renamed is not None:
            return [(self.renamed, positions, None)]
        if self.starts is not None:
            starts = torch.tensor([self.starts[number] for number in self.by_start], dtype=positions.dtype)
            cuts = [*torch.searchsorted(positions, starts).tolist(), len(positions)]
            found = []
            for k, number in enumerate(self.by_start):
                if cuts[k] == cuts[k + 1]:
                    continue
                box, selection = self.boxes[number], slice(cuts[k], cuts[k + 1])
                local = (positions[selection] - self.starts[number]).to(index_dtype(box.numel))
                found.append((box, local, selection))
            return found
        flat = positions.long()
        if len(self.boxes) == 1:  # one permuted box (a transposed tensor): no lookup
            box = self.boxes[0]
            mapped = torch.zeros_like(flat)
            for d, (stride, size) in enumerate(zip(self.strides, self.shape)):
                weight = int(self.weights[0, d])
                if weight:
                    mapped += (flat // stride if d == 0 else (flat // stride) % size) * weight
            local, order = torch.sort(mapped)
            return [(box, local.to(index_dtype(box.numel)), order)]
        cell = torch.zeros_like(flat)
        coordinates = []
        for d, (stride, size) in enumerate(zip(self.strides, self.shape)):
            coordinate = flat // stride if d == 0 else (flat // stride) % size
            coordinates.append(coordinate)
            if self.bounds[d] is not None:
                cell += torch.bucketize(coordinate, self.bounds[d], right=True) * self.cell_strides[d]
        box_of = self.table[cell]
        mapped = -self.offsets[box_of]
        for d, coordinate in enumerate(coordinates):
            mapped += coordinate * self.weights[box_of, d]
        # One sort by (box, checkpoint position): grouped by box, ascending within each
        # (a permuted box visits its checkpoint positions out of order).
        span = max(box.numel for box in self.boxes)
        keys, order = torch.sort(box_of * span + mapped)
        counts = torch.bincount(box_of, minlength=len(self.boxes)).tolist()
        found, start = [], 0
        for number, count in enumerate(counts):
            if not count:
                continue
            box = self.boxes[number]
            selection = order[start : start + count]
            local = keys[start : start + count] - number * span
            start += count
            found.append((box, local.to(index_dtype(box.numel)), selection))
        return found


class CheckpointLayout:
    """Where each checkpoint tensor of a model lies in its run-time parameters.

    Made with [`CheckpointLayout.of`]; an identity layout (every checkpoint tensor is a
    parameter under the same name) costs nothing per step.

    Args:
        boxes: Run-time name -> the checkpoint tensors cut from it (one for a parameter the
            checkpoint holds as it is, renamed or not).
        shapes: Run-time name -> shape.
        model_type: The model's `config.model_type` (for messages), or None.

    Example:
        ```python
        >>> layout = CheckpointLayout.of(model)  # a Qwen3-MoE model
        >>> layout.shapes["model.layers.0.mlp.experts.3.up_proj.weight"]
        (16, 32)
        >>> layout.map_positions("model.layers.0.mlp.experts.gate_up_proj", torch.tensor([3 * 1024 + 600]))
        {'model.layers.0.mlp.experts.3.up_proj.weight': tensor([88], dtype=torch.int32)}
        ```
    """

    def __init__(
        self,
        boxes: Mapping[str, list[CheckpointBox]],
        shapes: Mapping[str, tuple[int, ...]],
        *,
        model_type: str | None = None,
    ) -> None:
        self.model_type = model_type
        self._maps = {source: _SourceMap(tuple(shapes[source]), list(found)) for source, found in boxes.items()}
        #: Checkpoint name -> its box.
        self.boxes: dict[str, CheckpointBox] = {}
        for found in boxes.values():
            for box in found:
                if box.name in self.boxes:
                    raise UnservableModelError(
                        f"{model_type or 'the model'}: two run-time tensors ({self.boxes[box.name].source!r} and "
                        f"{box.source!r}) give the checkpoint tensor {box.name!r}"
                    )
                self.boxes[box.name] = box
        #: Checkpoint name -> checkpoint shape, in the order of the run-time parameters.
        self.shapes: dict[str, tuple[int, ...]] = {name: box.shape for name, box in self.boxes.items()}
        #: Whether every checkpoint tensor is a run-time parameter under the same name.
        self.identity: bool = all(m.renamed is not None and m.renamed.name == s for s, m in self._maps.items())
        #: Whether every checkpoint tensor is a whole run-time parameter (renamed or not).
        self.renames_only: bool = all(m.renamed is not None for m in self._maps.values())

    @classmethod
    def identity_of(cls, shapes: Mapping[str, tuple[int, ...]], *, model_type: str | None = None) -> CheckpointLayout:
        """The layout of a model whose checkpoint is its parameters as they are."""
        return cls(
            {name: [_whole(name, name, tuple(shape))] for name, shape in shapes.items()}, shapes, model_type=model_type
        )

    @classmethod
    def of(cls, model: nn.Module, shapes: Mapping[str, tuple[int, ...]] | None = None) -> CheckpointLayout:
        """Derive a model's checkpoint layout from transformers' conversion mapping.

        Args:
            model: The model (any wrapper: DDP, torch.compile, ...). One holding no
                transformers `PreTrainedModel`, or under a transformers release without
                weight conversions (4.x), has the identity layout.
            shapes: Published (run-time) name -> full shape of every parameter; default:
                the model's parameters and persistent buffers, wrapper segments dropped. Names are relative to the
                outermost `PreTrainedModel`.

        Raises:
            UnservableModelError: A checkpoint tensor is not a box of one run-time tensor
                (the message names the model type, the tensor and transformers' operations),
                or the boxes do not cover a run-time tensor exactly once.
        """
        if shapes is None:
            shapes = {}
            for name, param in model.named_parameters():
                shapes.setdefault(canonical_name(name), tuple(param.shape))
            for name, buffer in persistent_buffers(model).items():
                shapes.setdefault(name, tuple(buffer.shape))
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        found = pretrained_model(model)
        if found is None:
            return cls.identity_of(shapes)
        path, pretrained = found
        model_type = getattr(pretrained.config, "model_type", None) or type(pretrained).__name__
        prefix = f"{path}." if path else ""
        inside = {name.removeprefix(prefix): name for name in shapes if name.startswith(prefix)}
        revert = _revert_function()
        if revert is None or not inside:
            return cls.identity_of(shapes, model_type=model_type)
        boxes = _probe(pretrained, revert, {local: shapes[name] for local, name in inside.items()}, model_type)
        result = {name: [_whole(name, name, shapes[name])] for name in shapes if name not in inside.values()}
        for local, found_boxes in boxes.items():
            source = inside[local]
            result[source] = [
                CheckpointBox(prefix + b.name, source, b.shape, b.corner, b.sizes, b.dims) for b in found_boxes
            ]
        ordered = {name: result[name] for name in shapes}
        try:
            return cls(ordered, shapes, model_type=model_type)
        except ValueError as error:
            raise UnservableModelError(f"{model_type}: {error}; delta-sync cannot publish its checkpoint") from None

    # -- what is published ------------------------------------------------------------------

    def checkpoint_names(self, source: str) -> list[str]:
        """The checkpoint tensors cut from run-time tensor `source`."""
        return [box.name for box in self._maps[source].boxes]

    def sources(self, names: Iterable[str]) -> list[str]:
        """The run-time tensors that checkpoint tensors `names` are cut from (each once)."""
        return list(dict.fromkeys(self.boxes[name].source for name in names))

    def values(
        self, tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Checkpoint name -> value, from run-time tensors (views of their boxes).

        Args:
            tensors: Run-time name -> tensor (e.g. the detector's snapshot).
            names: The checkpoint tensors wanted; default: all cut from `tensors`.
        """
        if names is None:
            names = [box.name for source in tensors for box in self._maps[source].boxes]
        return {name: self.boxes[name].value(tensors[self.boxes[name].source]) for name in names}

    def map_positions(self, source: str, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Checkpoint name -> ascending checkpoint positions, of ascending flat positions in
        run-time tensor `source` (checkpoint tensors holding none of them are absent)."""
        return {box.name: mapped for box, mapped, _ in self._maps[source].map(positions)}

    def map_changes(
        self, changes: Mapping[str, SparseChange], old_values: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, SparseChange], dict[str, torch.Tensor]]:
        """Changes of run-time tensors as changes of checkpoint tensors.

        Args:
            changes: Run-time name -> changed elements (ascending positions).
            old_values: Run-time name -> old values aligned with `changes[name].indices`.

        Returns:
            Checkpoint name -> changed elements, and -> old values aligned with them;
            checkpoint tensors with no changed element are absent. O(changed elements).
        """
        mapped: dict[str, SparseChange] = {}
        mapped_old: dict[str, torch.Tensor] = {}
        for source, change in changes.items():
            old = None if old_values is None else old_values.get(source)
            for box, positions, selection in self._maps[source].map(change.indices):
                if selection is None:
                    mapped[box.name] = SparseChange(positions, change.values)
                    if old is not None:
                        mapped_old[box.name] = old
                else:
                    mapped[box.name] = SparseChange(positions, change.values[selection])
                    if old is not None:
                        mapped_old[box.name] = old[selection]
        return mapped, mapped_old

    def published_layout(self, layout: ModelLayout) -> ModelLayout:
        """A trainer's [`ModelLayout`] (of run-time parameters) as the layout of the checkpoint
        tensors it publishes: with a sharded model (FSDP2), each rank publishes the part of
        each checkpoint tensor that its block of the parameter holds, a block of the
        checkpoint tensor (in the checkpoint's order of dimensions).

        Raises:
            UnservableModelError: A checkpoint tensor is part of a parameter that DeepSpeed
                ZeRO-3 partitions (a range of the flattened parameter, which is no block of
                the checkpoint tensor).
        """
        if self.identity:
            return layout
        shards = {}
        for source, shard in layout.shards.items():
            for box in self._maps[source].boxes:
                if box.whole:  # renamed: this rank's block of it is the same
                    shards[box.name] = ParamShard(box.name, shard.global_shape, shard.block)
                elif shard.whole:  # a whole parameter, cut
                    shards[box.name] = ParamShard(box.name, box.shape, Block((0,) * len(box.shape), box.shape))
                elif shard.block.is_flat(shard.global_shape):
                    raise UnservableModelError(
                        f"{self.model_type}: DeepSpeed ZeRO-3 partitions {source!r} as a range of the flattened "
                        f"parameter, which is no block of its checkpoint tensors ({box.name!r}, ...), so a rank "
                        "cannot publish its part of them: train it with FSDP2, DDP or DeepSpeed ZeRO-1/2"
                    )
                elif (block := _block_of_box(box, shard.block)) is not None:
                    shards[box.name] = ParamShard(box.name, box.shape, block)
        shapes = {box.name: box.shape for source in layout.shapes for box in self._maps[source].boxes}
        return ModelLayout(
            rank=layout.rank, world_size=layout.world_size, shapes=shapes, shards=shards, sharded=layout.sharded
        )

    def block_values(
        self, tensors: Mapping[str, torch.Tensor], runtime: ModelLayout, published: ModelLayout, names: Iterable[str]
    ) -> dict[str, torch.Tensor]:
        """Checkpoint name -> this rank's block of it, from this rank's blocks of the
        parameters (views, copied only where permuted).

        Args:
            tensors: Run-time name -> this rank's block of the parameter.
            runtime: This rank's [`ModelLayout`] of the parameters.
            published: [`published_layout`] of it.
            names: Checkpoint tensors this rank publishes a block of.
        """
        values = {}
        for name in names:
            box, held, block = self.boxes[name], runtime.shards[self.boxes[name].source], published.shards[name].block
            local = tensors[box.source]
            if box.whole or held.whole:
                values[name] = local if box.whole else box.value(local)
                continue
            # The block's corner and extent in the parameter, then in this rank's block of it.
            corner, sizes = list(box.corner), list(box.sizes)
            for j, d in enumerate(box.dims):
                if d is not None:
                    corner[d], sizes[d] = box.corner[d] + block.offset[j], block.shape[j]
            inside = tuple(c - o for c, o in zip(corner, held.block.offset))
            values[name] = CheckpointBox(name, box.source, block.shape, inside, tuple(sizes), box.dims).value(local)
        return values

    def block_positions(self, name: str, positions: torch.Tensor, published: ModelLayout) -> torch.Tensor:
        """Positions in this rank's block of checkpoint tensor `name` of (ascending) positions
        in the whole checkpoint tensor that the block holds (int64, ascending)."""
        shape, block = published.shapes[name], published.shards[name].block
        flat = positions.long()
        if block.shape == shape:
            return flat
        local = torch.zeros_like(flat)
        for stride, size, offset, block_stride in zip(
            _row_major_strides(shape), shape, block.offset, _row_major_strides(block.shape)
        ):
            local += ((flat // stride) % size - offset) * block_stride
        return local


def _block_of_box(box: CheckpointBox, block: Block) -> Block | None:
    """The part of checkpoint tensor `box` inside a rank's hyper-rectangular `block` of its
    parameter, as a block of the checkpoint tensor; None if it holds none of it."""
    low = [max(o, c) for o, c in zip(block.offset, box.corner)]
    high = [min(o + s, c + z) for o, s, c, z in zip(block.offset, block.shape, box.corner, box.sizes)]
    if any(h <= lo for lo, h in zip(low, high)):
        return None
    offset = tuple(0 if d is None else low[d] - box.corner[d] for d in box.dims)
    shape = tuple(1 if d is None else high[d] - low[d] for d in box.dims)
    return Block(offset, shape)


def _whole(name: str, source: str, shape: tuple[int, ...]) -> CheckpointBox:
    return CheckpointBox(name, source, shape, (0,) * len(shape), shape, tuple(range(len(shape))))


# -- transformers ----------------------------------------------------------------------------


def _revert_function():
    """transformers' `revert_weight_conversion` (what `save_pretrained` applies), or None
    for releases without weight conversions (4.x: the checkpoint is the run-time layout)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion


def _converter_groups(model: nn.Module, names: list[str]) -> tuple[list[list[str]], dict[str, str]] | None:
    """The run-time tensors that transformers reverts together (one converter call each),
    and for each its forward operations' names; None where this release's API differs
    (then every converted tensor is probed in one call)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

        # What `revert_weight_conversion` does: the model's own conversions, else the mapping's.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            conversions = [
                c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
            ]
        forward = conversions[::-1]
        reverse = [conversion.reverse_transform() for conversion in forward]
        renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
        converters = [r for r in reverse if isinstance(r, WeightConverter)]
        operations = {
            id(r): ", ".join(type(op).__name__ for op in getattr(f, "operations", ())) for f, r in zip(forward, reverse)
        }
        owner = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        groups: dict[str, list[str]] = defaultdict(list)
        ops: dict[str, str] = {}
        for name in names:
            key, pattern = rename_source_key(name, renamings, converters, reverse=True)
            groups[key].append(name)
            if pattern is not None:
                ops[name] = operations.get(id(owner[pattern]), "")
        return list(groups.values()), ops
    except (ImportError, TypeError, ValueError, AttributeError, KeyError) as error:
        logger.debug("delta-sync: cannot group converted tensors (%s); probing them together", error)
        return None


def _all_operations(model: nn.Module) -> str:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(
            model, add_legacy=False
        )
    except Exception:  # only for a message
        return "transformers' weight conversions"
    return ", ".join(sorted({type(op).__name__ for c in conversions for op in getattr(c, "operations", ())}))


def _probe(
    model: nn.Module, revert, shapes: dict[str, tuple[int, ...]], model_type: str
) -> dict[str, list[CheckpointBox]]:
    """Run-time name -> its checkpoint boxes, found by reverting transformers' conversion on
    tensors that hold their own flat positions."""

    def refuse(what: str, operations: str) -> UnservableModelError:
        return UnservableModelError(
            f"{model_type}: {what} (transformers converts it with {operations or 'a rename'}); delta-sync publishes "
            "every checkpoint tensor as a box of one run-time tensor (chunks, splits, stacks and transposes), and "
            "cannot map positions through this conversion. Train a model whose checkpoint layout is its run-time "
            "layout, or convert the model's weights to its run-time layout before training"
        )

    # First on the meta device (no memory): names and shapes, and which tensors are only renamed
    # (transformers hands those back as they are).
    metas = {name: torch.empty(shape, dtype=torch.int64, device="meta") for name, shape in shapes.items()}
    try:
        reverted = revert(model, dict(metas))
    except Exception as error:
        raise refuse(
            f"reverting its weight conversion failed ({type(error).__name__}: {error})", _all_operations(model)
        ) from None
    by_id = {id(tensor): name for name, tensor in metas.items()}
    boxes: dict[str, list[CheckpointBox]] = defaultdict(list)
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in reverted.items():
        source = by_id.get(id(tensor))
        if source is not None:
            boxes[source].append(_whole(name, source, shapes[source]))
        else:
            expected[name] = tuple(tensor.shape)
    converted = [name for name in shapes if name not in boxes]
    if not converted:
        return dict(boxes)
    grouping = _converter_groups(model, converted)
    groups, operations = grouping if grouping is not None else ([converted], {})
    everything = _all_operations(model)
    # Then each group of tensors reverted together, holding positions, one group's probes at a
    # time. Groups alike but for their prefix (the same converter in every layer) are probed
    # once: the others take the same boxes, their names and shapes checked against the
    # meta-device conversion above, so that making the layout of a large MoE costs one layer.
    templates: list[_Template] = []
    for group in groups:
        ops = ", ".join(dict.fromkeys(operations[name] for name in group if operations.get(name))) or everything
        reused = next((found for t in templates if (found := t.apply(group, shapes, ops, expected)) is not None), None)
        if reused is None:
            reused = _probe_group(model, revert, group, shapes, expected, refuse, ops)
            templates.append(_Template.of(group, shapes, ops, reused))
        for box in reused:
            boxes[box.source].append(box)
            del expected[box.name]
        for name in group:
            covered = sum(box.numel for box in boxes.get(name, ()))
            if covered != math.prod(shapes[name]):
                raise refuse(
                    f"its checkpoint tensors hold {covered} of the {math.prod(shapes[name])} elements of {name!r}", ops
                )
    if expected:
        raise refuse(f"the checkpoint tensor {sorted(expected)[0]!r} comes from no run-time tensor alone", everything)
    return dict(boxes)


def _probe_group(
    model: nn.Module,
    revert,
    group: list[str],
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    refuse,
    ops: str,
) -> list[CheckpointBox]:
    """The checkpoint boxes of run-time tensors that transformers converts together, found by
    reverting the conversion on tensors holding their own flat positions."""
    offsets, start, probes = {}, 0, {}
    for name in group:
        numel = math.prod(shapes[name])
        offsets[name] = start
        probes[name] = torch.arange(start, start + numel, dtype=torch.int64).view(shapes[name])
        start += numel
    try:
        outputs = revert(model, dict(probes))
    except Exception as error:
        raise refuse(
            f"reverting the conversion of {group[0]!r} failed ({type(error).__name__}: {error})", ops
        ) from None
    found = []
    for name, tensor in outputs.items():
        if name not in expected or tuple(tensor.shape) != expected[name]:
            raise refuse(f"the checkpoint tensor {name!r} comes out otherwise when converted alone", ops)
        if tensor.dtype != torch.int64 or tensor.numel() == 0:
            raise refuse(f"the checkpoint tensor {name!r} does not hold run-time elements as they are", ops)
        # A box's first element is its corner; the exact check proves the rest.
        first = int(tensor.reshape(-1)[0])
        source = next((s for s in group if offsets[s] <= first < offsets[s] + math.prod(shapes[s])), None)
        if source is None:
            raise refuse(f"the checkpoint tensor {name!r} is not cut from one run-time tensor", ops)
        box = _fit_box(name, source, probes[source], tensor, offsets[source])
        if box is None:
            raise refuse(f"the checkpoint tensor {name!r} is not a box of the run-time tensor {source!r}", ops)
        found.append(box)
    return found


def _common_prefix(names: Iterable[str]) -> str:
    """The dotted prefix all `names` share (ending in a dot, or empty)."""
    split = [name.split(".")[:-1] for name in names]
    common = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return "".join(f"{part}." for part in common)


@dataclass(frozen=True)
class _Template:
    """The boxes of one probed group, relative to the prefix its names share."""

    sources: tuple[tuple[str, tuple[int, ...]], ...]
    ops: str
    boxes: tuple[CheckpointBox, ...]

    @classmethod
    def of(
        cls, group: list[str], shapes: dict[str, tuple[int, ...]], ops: str, boxes: list[CheckpointBox]
    ) -> _Template:
        prefix = _common_prefix([*group, *(box.name for box in boxes)])
        cut = len(prefix)
        return cls(
            tuple((name[cut:], shapes[name]) for name in group),
            ops,
            tuple(CheckpointBox(b.name[cut:], b.source[cut:], b.shape, b.corner, b.sizes, b.dims) for b in boxes),
        )

    def apply(
        self, group: list[str], shapes: dict[str, tuple[int, ...]], ops: str, expected: dict[str, tuple[int, ...]]
    ) -> list[CheckpointBox] | None:
        """This template's boxes for `group`, if it is the same conversion under another
        prefix and the meta-device conversion gave exactly these names and shapes."""
        if ops != self.ops or len(group) != len(self.sources):
            return None
        first, shape = self.sources[0]
        if not group[0].endswith(first):
            return None
        prefix = group[0][: len(group[0]) - len(first)]
        if prefix and not prefix.endswith("."):
            return None
        if [(prefix + name, shape) for name, shape in self.sources] != [(name, shapes[name]) for name in group]:
            return None
        boxes = [
            CheckpointBox(prefix + b.name, prefix + b.source, b.shape, b.corner, b.sizes, b.dims) for b in self.boxes
        ]
        if any(expected.get(box.name) != box.shape for box in boxes):
            return None
        return boxes


def _fit_box(name: str, source: str, probe: torch.Tensor, positions: torch.Tensor, offset: int) -> CheckpointBox | None:
    """The box of `source` whose elements `positions` (run-time flat positions plus `offset`,
    in checkpoint shape) are, checked exactly against `probe` (`source`'s positions plus
    `offset`, in its shape); None if they are no box."""
    source_shape = tuple(probe.shape)
    shape = tuple(positions.shape)
    strides = _row_major_strides(source_shape)

    def unravel(flat: int) -> list[int]:
        return [(flat // stride) % size for stride, size in zip(strides, source_shape)]

    # The first and last elements of a box, in any order of its dimensions, are its corners.
    flat = positions.reshape(-1)
    first, final = int(flat[0]) - offset, int(flat[-1]) - offset
    if not (0 <= first < math.prod(source_shape) and 0 <= final < math.prod(source_shape)):
        return None
    corner = unravel(first)
    last = unravel(final)
    sizes = [hi - lo + 1 for lo, hi in zip(corner, last)]
    if any(s <= 0 for s in sizes) or math.prod(sizes) != positions.numel():
        return None
    origin = int(flat[0])
    dims: list[int | None] = []
    for j, size in enumerate(shape):
        if size == 1:
            dims.append(None)
            continue
        step = [0] * len(shape)
        step[j] = 1
        delta = int(positions[tuple(step)]) - origin
        match = next(
            (d for d in range(len(source_shape)) if strides[d] == delta and sizes[d] == size and d not in dims), None
        )
        if match is None:
            return None
        dims.append(match)
    if any(sizes[d] > 1 and d not in dims for d in range(len(source_shape))):
        return None
    box = CheckpointBox(name, source, shape, tuple(corner), tuple(sizes), tuple(dims))
    # Exact: the probe read through the box (a view) must be what transformers made of it.
    if not torch.equal(box.view(probe), positions):
        return None
    return box

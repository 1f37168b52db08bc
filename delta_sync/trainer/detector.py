"""`BF16ChangeDetector`: exactly which bf16 elements an optimizer changed."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..addresses import on_host
from ..checkpoint import CheckpointLayout, canonical_name, check_checkpoint_names, kept_in_float32, persistent_buffers
from ..errors import UnservableModelError
from ..format import SparseChange, index_dtype
from ..parallel import parallel_map, shares
from ..sparse import extract_changes_batched_, extract_changes_many_, extract_float32_changes_
from ..staging import HostBuffers
from ..streams import caller_streams, on_streams
from ..version import sparsity
from .merged import MergedWeights, merged_weights
from .mirror import HostMirror
from .sharding import ModelLayout, describe_model, local_tensor

__all__ = ["BF16ChangeDetector", "ChangeSet", "canonical_name", "inner_optimizer"]


def inner_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The real `torch.optim.Optimizer` behind wrappers such as Accelerate's `AcceleratedOptimizer`.

    Step hooks must go on the real optimizer: Accelerate's wrapper subclasses
    `torch.optim.Optimizer` but never initialises its hook tables.

    Returns:
        The innermost optimizer, or None for DeepSpeed: its ZeRO optimizer steps flattened
        partitions, not the model's parameters, so its steps cannot be hooked per parameter
        and changes are found by comparing every parameter at sync time instead.
    """
    chain = [optimizer]
    while len(chain) < 8 and getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    if any(type(link).__module__.split(".")[0] == "deepspeed" for link in chain):
        return None
    optimizers = [link for link in chain if isinstance(link, torch.optim.Optimizer)]
    if not optimizers:
        raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none")
    return optimizers[-1]


def checkpoint_tensors(model: nn.Module, merged: MergedWeights | None) -> dict[str, torch.Tensor]:
    """The tensors a detector of `model` tracks, by checkpoint name: `model`'s parameters and
    the buffers its checkpoint holds ([`persistent_buffers`]), wrapper segments dropped from
    their names; or, for a PEFT model (`merged`, from [`merged_weights`]), its served weights.

    Raises:
        ValueError: Two tensors map to one checkpoint name.
    """
    if merged is not None:
        return dict(merged.parameters)
    tensors: dict[str, torch.Tensor] = {}
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        if tensors.setdefault(name, param) is not param:
            raise ValueError(f"two parameters map to the checkpoint name {name!r}")
    for name, buffer in persistent_buffers(model).items():
        if tensors.setdefault(name, buffer) is not buffer:
            raise ValueError(f"a buffer and a parameter map to the checkpoint name {name!r}")
    return tensors


#: What extracting one parameter's changes gives: positions, new values, old values.
_Found = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
#: The weights the batched path compares: read, or computed when it comes to them.
_Current = torch.Tensor | Callable[[], torch.Tensor]

#: Merged weights of a PEFT model alive at once while the compiled pass runs, over all
#: pool threads (each a full copy of its base weight).
MERGES_IN_FLIGHT = 2
_MERGING = threading.BoundedSemaphore(MERGES_IN_FLIGHT)


@dataclass
class ChangeSet:
    """The bf16 elements that changed since the previous `BF16ChangeDetector.changes()` call.

    Names, shapes and positions are the parameters' (wrapper segments dropped): where the
    checkpoint lays a model out otherwise (fused MoE experts), the publisher maps them
    through the detector's [`CheckpointLayout`] (`BF16ChangeDetector.checkpoint`).

    Args:
        changes: Parameter name -> changed elements (CPU tensors). Parameters with no
            changed element are absent.
        old_values: Parameter name -> the bf16 values the changed elements had before
            (CPU), aligned with `changes[name].indices`.
        steps: Optimizer steps taken since the previous call.
        total_elements: Elements in all tracked parameters.
        shapes: Parameter name -> shape of the full parameter (all ranks together).
        local_indices: For parameters this rank holds a block of (sharded models), the
            changed elements' flat positions inside the block, aligned with
            `changes[name].indices` (which are positions in the full tensor).
    """

    changes: dict[str, SparseChange]
    old_values: dict[str, torch.Tensor]
    steps: int
    total_elements: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    local_indices: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def changed_elements(self) -> int:
        return sum(len(change) for change in self.changes.values())

    @property
    def sparsity(self) -> float:
        """Fraction of elements unchanged."""
        return sparsity(self.changed_elements, self.total_elements)


class BF16ChangeDetector:
    """Tracks the bf16 bit patterns of a model's parameters across optimizer steps.

    The detector keeps one bf16 snapshot of every parameter this rank publishes: the state
    last handed out by [`changes`] (or the state at construction). A pre-step hook on the
    optimizer records which parameters the step may touch (those with a gradient), a
    post-step hook counts real steps. [`changes`] then compares the current bf16 bit
    patterns of the touched parameters with the snapshot, so changes accumulate over any
    number of steps between two calls (gradient accumulation, syncing every k steps),
    skipped steps (no hook fires) cost nothing, and nothing is missed. Parameters stored in
    fp32 are compared through their bf16 rounding (`param.to(torch.bfloat16)`), but those
    the model itself keeps in float32 (a transformers model's `_keep_in_fp32_modules_strict`:
    DeepSeek-V3's and GLM-4.5's MoE routers), which are compared and published in float32,
    unrounded ([`float32`]).

    Sharded parameters (FSDP2 `DTensor`s, DeepSpeed ZeRO-3 partitions) are compared on this
    rank's shard only, and the positions reported are those of the full checkpoint tensor
    (see `delta_sync.trainer.sharding`); nothing is ever gathered. DeepSpeed's optimizers
    cannot be hooked per parameter: with them every parameter is compared at each
    [`changes`] call and the caller counts steps with [`record_step`].

    A PEFT model is tracked as it is served (see `delta_sync.trainer.merged`): under the
    base checkpoint's names, each LoRA-adapted weight as `peft`'s `merge_and_unload()`
    would leave it, and a step that touches an adapter marks its merged weight. A
    transformers model whose names are not its checkpoint's is refused.

    What is published is the model's checkpoint, as `save_pretrained` writes it: the
    detector tracks parameters as they are at run time, and [`checkpoint`] (a
    [`CheckpointLayout`], derived once from transformers' conversion mapping) says where
    each checkpoint tensor lies in them, e.g. each expert's `gate_proj.weight` in a fused
    `mlp.experts.gate_up_proj`.

    Memory: the snapshot (2 bytes per element this rank holds) plus, while [`changes`]
    runs, the changed elements (CPU tensors are compared in one compiled pass with no
    full-size temporary; others one parameter at a time, its mask, bf16 copy and changes
    on the device, each change copied at once into one host buffer per call: 6 bytes per
    changed element with a host mirror, 8 without, see
    `delta_sync.sparse.extract_changes_batched_`); a PEFT model's merged weights, at most
    `MERGES_IN_FLIGHT` at once; with a snapshot on a GPU, by default, a host mirror of it
    (2 bytes per element of host memory, see `host_mirror`).

    Args:
        model: The model being trained (any wrapper: DDP, Accelerate, torch.compile, FSDP2,
            a DeepSpeed engine).
        optimizer: Its optimizer, or a wrapper of it (e.g. Accelerate's `AcceleratedOptimizer`).
        snapshot_device: Where to keep the snapshot; defaults to each parameter's device.
        host_mirror: Keep a host copy of the snapshot, advanced from the changes each
            [`changes`] call brings back anyway ([`HostMirror`]), so that anchors and compact
            deltas never copy the snapshot from the device; costs 2 bytes of host memory per
            element this rank publishes. Default: when the snapshot is not on the CPU.
        layout: How the parameters are spread over ranks; by default
            [`describe_model`] of `model` (which refuses layouts that cannot be published).
        change_sets_alive: Change sets the caller keeps at once (a publisher: its
            `max_pending` + 2): the pinned host buffers kept for changes from a GPU, one
            per change set, reused once it is gone.

    Raises:
        UnsupportedLayoutError: The model's layout cannot be published exactly (FSDP1,
            unsupported `DTensor` placements, ZeRO-3 offloaded to NVMe, ...).
        UnservableModelError: Its parameter names are not its checkpoint's (an unknown
            wrapper), or it is a PEFT model merged mode cannot publish exactly (see
            `delta_sync.trainer.merged.MergedWeights`), or a sharded PEFT model, or
            transformers converts its checkpoint in a way that is no box of one parameter
            (see [`CheckpointLayout.of`]), or DeepSpeed ZeRO-3 partitions a parameter that
            is cut into several checkpoint tensors (fused MoE experts).

    Example:
        ```python
        >>> detector = BF16ChangeDetector(model, optimizer)
        >>> loss.backward(); optimizer.step()
        >>> change_set = detector.changes()
        >>> change_set.sparsity
        0.991
        >>> detector.close()
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: object,
        *,
        snapshot_device: torch.device | str | None = None,
        host_mirror: bool | None = None,
        layout: ModelLayout | None = None,
        change_sets_alive: int = 4,
    ) -> None:
        self.model = model
        self.optimizer = inner_optimizer(optimizer)
        self._snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self._params: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        #: The served view of a PEFT model (None for any other model).
        self.merged: MergedWeights | None = merged_weights(model)
        self._index_names(strict=self.optimizer is not None)
        check_checkpoint_names(self._params, model if self.merged is None else self.merged.root)
        self.layout = layout or describe_model(self._params.items(), model)
        if self.merged is not None and self.layout.sharded:
            # Each rank would need the whole adapter and base block to merge its block.
            raise UnservableModelError(
                "a sharded PEFT model (FSDP2, DeepSpeed ZeRO-3) cannot be published in merged mode yet: "
                "train it with DDP or ZeRO-1/2, or merge the adapter before training"
            )
        #: Where each checkpoint tensor lies in the parameters (see `delta_sync.checkpoint`):
        #: what is published is named, shaped and laid out as `save_pretrained` writes it.
        self.checkpoint: CheckpointLayout = CheckpointLayout.of(
            model if self.merged is None else self.merged.root, self.layout.shapes
        )
        self.checkpoint.published_layout(self.layout)  # refuses what cannot be published, before any step
        self._shards = self.layout.shards
        #: The parameters published in float32: those the model keeps in float32 (and holds so).
        self.float32: frozenset[str] = frozenset(
            name
            for name in kept_in_float32(model if self.merged is None else self.merged.root, self._shards)
            if self._value(name).dtype == torch.float32
        )
        self._snapshot = {name: self._snapshot_copy(name) for name in self._shards}
        if host_mirror is None:
            host_mirror = any(tensor.device.type != "cpu" for tensor in self._snapshot.values())
        #: The host copy of the snapshot, if kept (see `host_mirror`).
        self.mirror: HostMirror | None = HostMirror(self._snapshot) if host_mirror else None
        #: The pinned host memory changes cross into from a GPU, reused (see `delta_sync.staging`).
        self._host_buffers = HostBuffers(change_sets_alive, pinned=True)
        self._touched: set[str] = set()
        self._steps = 0
        #: Held while the snapshot is read or written; a background anchor writer holds it
        #: so the next `changes()` waits instead of mutating tensors being serialized.
        self.snapshot_lock = threading.Lock()
        self._hooks = []
        if self.optimizer is not None:
            self._hooks = [
                self.optimizer.register_step_pre_hook(self._before_step),
                self.optimizer.register_step_post_hook(self._after_step),
            ]

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """`(checkpoint name, parameter)` for every parameter of the model (of a PEFT model:
        every served weight, an adapted one as its base layer's weight, whose shape it has)."""
        return self._params.items()

    @property
    def hooked(self) -> bool:
        """Whether optimizer steps are hooked (False for DeepSpeed: see [`record_step`])."""
        return self.optimizer is not None

    # -- names -------------------------------------------------------------------------

    def _index_names(self, *, strict: bool) -> None:
        self._params = checkpoint_tensors(self.model, self.merged)
        # What no optimizer hook sees changes outside optimizer steps, if at all (buffers;
        # parameters the optimizer does not hold, or holds frozen, never stepping them: a
        # frozen router bias that auxiliary-loss-free balancing moves): compared whole at
        # every `changes()`. A PEFT model's frozen base weights change through the adapter
        # parameters that own them.
        held = None
        if self.optimizer is not None and self.merged is None:
            held = {id(param) for param in self._optimizer_params()}
        self._unhooked_names = {
            name
            for name, tensor in self._params.items()
            if not isinstance(tensor, nn.Parameter)
            or (held is not None and (id(tensor) not in held or not tensor.requires_grad))
        }
        if self.merged is not None:
            # LoRA parameters map to the served weight they change; base weights to theirs.
            self._names = dict(self.merged.owners)
        else:
            self._names = {id(param): name for name, param in self._params.items()}
        if strict:
            unknown = [p for p in self._optimizer_params() if id(p) not in self._names]
            if unknown:
                raise ValueError(
                    f"the optimizer holds {len(unknown)} parameter(s) that are not parameters of the model "
                    f"(first has shape {tuple(unknown[0].shape)}); pass the model the optimizer was built for"
                )

    def _optimizer_params(self) -> Iterable[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def _name_of(self, param: torch.Tensor) -> str | None:
        """Checkpoint name of a parameter this rank tracks, None for one another rank publishes."""
        name = self._names.get(id(param))
        if name is None:
            # A parameter group added after construction: look the model up again.
            self._index_names(strict=True)
            name = self._names[id(param)]
        return name if name in self._snapshot else None

    # -- hooks -------------------------------------------------------------------------

    def _before_step(self, optimizer, args, kwargs) -> None:
        for param in self._optimizer_params():
            if param.grad is not None and (name := self._name_of(param)) is not None:
                self._touched.add(name)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1

    def record_step(self) -> None:
        """Count an optimizer step taken by an optimizer that cannot be hooked (DeepSpeed).

        Every tracked parameter is then compared at the next [`changes`] call.
        """
        if self.hooked:
            raise RuntimeError("record_step is for optimizers without hooks; this detector counts steps itself")
        self._touched.update(self._snapshot)
        self._steps += 1

    # -- snapshot ----------------------------------------------------------------------

    def _snapshot_copy(self, name: str) -> torch.Tensor:
        """A copy of what `name` publishes now, in the dtype it is published in."""
        data = local_tensor(self._value(name)).detach()
        # Row-major whatever the parameter's strides: positions are those of the checkpoint tensor.
        return data.to(
            device=self._snapshot_device or data.device,
            dtype=torch.float32 if name in self.float32 else torch.bfloat16,
            memory_format=torch.contiguous_format,
            copy=True,
        )

    def _value(self, name: str) -> torch.Tensor:
        """What is published under `name` now: the parameter, or a PEFT model's merged weight."""
        return self._params[name] if self.merged is None else self.merged.value(name)

    def _current_bits(self, name: str) -> torch.Tensor:
        """What `name` publishes now, as the bit patterns of the dtype it is published in."""
        snap = self._snapshot[name]
        current = local_tensor(self._value(name)).detach().to(device=snap.device, dtype=snap.dtype)
        return current.view(torch.int32 if snap.dtype == torch.float32 else torch.int16)

    @property
    def steps_pending(self) -> int:
        """Optimizer steps taken since the last [`changes`] call."""
        return self._steps

    @property
    def snapshot(self) -> Mapping[str, torch.Tensor]:
        """The bf16 state as of the last [`changes`] call: this rank's block of each parameter
        it publishes (the whole tensor unless sharded). Read-only by convention.

        Hold [`snapshot_lock`] while reading it from another thread.
        """
        return self._snapshot

    def host_snapshot(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The snapshot's tensors `names` (default: all) on the host: the mirror's, or the
        snapshot's own where it lives on the CPU; without a mirror, a device's are copied
        (2 bytes per element across the bus). Read-only by convention; hold
        [`snapshot_lock`] while reading them from another thread."""
        names = self._snapshot if names is None else names
        if self.mirror is not None:
            return {name: self.mirror.tensors[name] for name in names}
        return {name: on_host(self._snapshot[name]) for name in names}

    @property
    def total_elements(self) -> int:
        """Elements of the whole model, all ranks together."""
        return self.layout.total_elements

    def mark_changed(self, names: Iterable[str] | None = None) -> None:
        """Compare these parameters (default: all) at the next [`changes`] call even if no
        optimizer step touched them, e.g. after editing weights by hand."""
        self._touched.update(self._snapshot if names is None else (n for n in names if n in self._snapshot))

    def masks(self) -> dict[str, torch.Tensor]:
        """Boolean masks `bf16(now) != snapshot`, bitwise, for the parameters steps touched
        (`now != snapshot` in float32 bits for those published in float32).

        Does not advance the snapshot. Parameters no step touched are absent (their mask is
        all false). Masks have the shape of this rank's block.
        """
        with self.snapshot_lock:
            return {
                name: self._current_bits(name)
                != self._snapshot[name].view(torch.int32 if name in self.float32 else torch.int16)
                for name in sorted(self._touched)
            }

    def changes(self) -> ChangeSet:
        """Extract every bf16 element that changed since the last call and advance the snapshot.

        Returns:
            A [`ChangeSet`] with CPU indices into the full checkpoint tensors (int32, or
            int64 for parameters of 2^31 or more elements), new values and old values.
        """
        with self.snapshot_lock:
            touched = sorted(self._touched | (self._unhooked_names & self._snapshot.keys()))
            names = [name for name in touched if name not in self.float32]
            found, declined = {}, {}
            # The pool threads queue their device work on the caller's streams: a loop that
            # trains under `torch.cuda.stream(s)` has its weights written on `s`.
            streams = caller_streams(self._snapshot[name].device for name in names)
            by_size = shares(names, lambda name: self._snapshot[name].numel())
            work = [(share, streams) for share in by_size]
            for share, results in zip(by_size, parallel_map(self._extract_compiled, work)):
                for name, (result, current) in zip(share, results):
                    found[name] = result
                    if current is not None:
                        declined[name] = current
            # What the compiled pass does not take (tensors on a GPU, above all) goes through
            # torch together, with a fixed number of host synchronisations for all of them.
            batch = [(current, self._snapshot[n], self._index_dtype(n)) for n, current in declined.items()]
            # With a host mirror, old values are read there (before it moves on below).
            found.update(
                zip(
                    declined,
                    extract_changes_batched_(batch, old_values=self.mirror is None, host_buffers=self._host_buffers),
                )
            )
            for name in touched:
                if name in self.float32:
                    current = local_tensor(self._value(name))
                    found[name] = extract_float32_changes_(current, self._snapshot[name], self._index_dtype(name))
            names = touched
            extracted = [self._change(name, found[name]) for name in names]
            changes, old_values, local_indices = {}, {}, {}
            for name, (change, old, local) in zip(names, extracted):
                if change is None:
                    continue
                changes[name], old_values[name] = change, old
                if local is not None:
                    local_indices[name] = local
            change_set = ChangeSet(
                changes=changes,
                old_values=old_values,
                steps=self._steps,
                total_elements=self.total_elements,
                shapes=dict(self.layout.shapes),
                local_indices=local_indices,
            )
            if self.mirror is not None:
                self.mirror.apply(changes, local_indices)
            self._touched.clear()
            self._steps = 0
            return change_set

    def _index_dtype(self, name: str) -> torch.dtype:
        """The positions' dtype while extracting: the checkpoint's for a whole parameter,
        int64 for a block (mapped to checkpoint positions afterwards)."""
        shard = self._shards[name]
        return index_dtype(math.prod(shard.global_shape)) if shard.whole else torch.int64

    def _extract_compiled(
        self, work: tuple[list[str], Mapping[torch.device, torch.cuda.Stream]]
    ) -> list[tuple[_Found | None, _Current | None]]:
        """Changed elements of CPU parameters through the compiled pass, which advances their
        snapshots at the changes only: per name, `((positions, new, old), None)`; or
        `(None, current)` where the pass does not apply, with the weights it read or, for a
        PEFT model's merged weight, what computes them again.

        Runs on a pool thread, its device work on the caller's `streams` (device -> stream).
        Parameters go to the pass in one call; merged weights one at a time, each made just
        before its pass and dropped after it, at most `MERGES_IN_FLIGHT` at once over all
        threads: each is a full-size copy of its base weight (a model with LoRA on every
        linear layer would otherwise hold a second copy of most of itself).
        """
        names, streams = work
        adapted = {} if self.merged is None else self.merged.adapted
        with on_streams(streams):
            plain = [name for name in names if name not in adapted]
            results = dict(zip(plain, self._extract_read(plain)))
            for name in names:
                if name not in adapted:
                    continue
                if self._snapshot[name].device.type != "cpu":
                    # Merged on the device, one at a time, when the batch comes to it: once to
                    # count, once to list, each time from the same weights on the same stream,
                    # which cuBLAS computes to the same bits (its reproducibility guarantee
                    # holds for one architecture and one stream); never held between.
                    results[name] = (None, functools.partial(self._value, name))
                    continue
                with _MERGING:
                    found, current = self._extract_read([name])[0]
                results[name] = (found, None if current is None else functools.partial(self._value, name))
                del current
        return [results[name] for name in names]

    def _extract_read(self, names: list[str]) -> list[tuple[_Found | None, torch.Tensor | None]]:
        """The compiled pass over `names` in one call: per name, `(found, None)` or
        `(None, the weights read)` where the pass does not apply."""
        currents = []
        for name in names:
            current = local_tensor(self._value(name))  # read by address: no `detach()` call, which drops the GIL
            if current.device.type != "cpu" and self._snapshot[name].device.type == "cpu":
                # A host snapshot of device weights (`snapshot_device="cpu"`): rounded where
                # they live and copied once (2 bytes an element), then compared by the pass.
                current = current.detach().to(torch.bfloat16).to("cpu", memory_format=torch.contiguous_format)
            currents.append(current)
        found = extract_changes_many_(
            [(current, self._snapshot[name], self._index_dtype(name)) for name, current in zip(names, currents)]
        )
        return [
            (result, None) if result is not None else (None, current.detach())
            for result, current in zip(found, currents)
        ]

    def _change(
        self, name: str, found: _Found | None
    ) -> tuple[SparseChange | None, torch.Tensor | None, torch.Tensor | None]:
        """One parameter's change in checkpoint positions, its old values and (for a block of a
        sharded parameter) its positions in the block."""
        if found is None or found[0].numel() == 0:
            return None, None, None
        local, values, old = found
        if old is None:  # not brought from the device: the host mirror still holds them
            old = self.mirror.tensors[name].view(-1)[local.long()]
        shard = self._shards[name]
        dtype = index_dtype(math.prod(shard.global_shape))
        # No torch call where the tensor is already what is needed (most drop the GIL).
        local, values, old = on_host(local), on_host(values), on_host(old)
        if shard.whole:
            return SparseChange(indices=local if local.dtype == dtype else local.to(dtype), values=values), old, None
        return SparseChange(indices=shard.global_indices(local).to(dtype), values=values), old, local

    def close(self) -> None:
        """Remove the optimizer hooks and drop the snapshot."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._snapshot = {}
        self.mirror = None
        self._touched.clear()

    def __enter__(self) -> BF16ChangeDetector:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

"""How a replica's weights reach its model: the loader protocols a [`Receiver`] hands
tensors to, and the loader of a plain `torch.nn.Module`.

A `load_weights` callable takes `[(checkpoint name, full tensor), ...]` (vLLM's
`model.load_weights` is one), each tensor bf16, or float32 for a parameter that travels in
float32. A loader may say more about itself:

* a [`ShapedWeightLoader`] knows the shapes it loads, which a receiver given no
  `expected_shapes` checks anchors against;
* a [`PatchingWeightLoader`] also takes [`WeightPatch`]es, each naming the positions that
  changed, and writes only those (`vllm_ext.loader.ModelLoader` is one, for vLLM).

[`module_weight_loader`] is both, for a plain module (a transformers model included: it
loads checkpoint-named tensors into the model's run-time layout), and
[`expected_shapes_of`] gives a module's checkpoint shapes.

`Receiver` is `delta_sync.replica.receiver.Receiver`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..checkpoint import CheckpointLayout, persistent_buffers
from ..errors import ApplyError

__all__ = [
    "LoadWeights",
    "ModuleWeightLoader",
    "PatchingWeightLoader",
    "ShapedWeightLoader",
    "WeightPatch",
    "expected_shapes_of",
    "module_weight_loader",
]

#: What a receiver hands the changed tensors to.
LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]


@runtime_checkable
class ShapedWeightLoader(Protocol):
    """A `load_weights` callable that also knows the shapes of the parameters it loads;
    a [`Receiver`] given no `expected_shapes` checks anchors against them."""

    expected_shapes: Mapping[str, tuple[int, ...]]

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> object: ...


@dataclass(frozen=True)
class WeightPatch:
    """One parameter for the model to load.

    Args:
        name: The checkpoint name.
        tensor: Its full tensor at the version loaded (bf16, or float32 where it travels so).
        positions: The flat positions (int64, ascending) whose values differ from the
            version the model holds, or None when they are not known (load it whole).
    """

    name: str
    tensor: torch.Tensor
    positions: torch.Tensor | None


@runtime_checkable
class PatchingWeightLoader(Protocol):
    """A `load_weights` callable that can also write only the changed elements of a
    parameter ([`WeightPatch`]); a [`Receiver`] then hands it the positions that changed."""

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> object: ...

    def load_patches(self, patches: list[WeightPatch]) -> object: ...


class ModuleWeightLoader:
    """Copies tensors into a module's parameters by name: whole, or only the elements that
    changed (a [`ShapedWeightLoader`] and a [`PatchingWeightLoader`]).

    Names are the checkpoint's: for a transformers model that keeps another layout at run
    time (fused MoE experts, renamed prefixes), each checkpoint tensor is copied into its
    part of the run-time parameter, as transformers' own conversion mapping places it (see
    `delta_sync.checkpoint.CheckpointLayout`).

    Args:
        module: The module to load into.
    """

    def __init__(self, module: nn.Module) -> None:
        self._params = _weights_of(module)
        self._layout = _checkpoint_layout(module)
        self.expected_shapes = (
            {name: tuple(p.shape) for name, p in self._params.items()}
            if self._layout is None
            else dict(self._layout.shapes)
        )

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.load_patches([WeightPatch(name, tensor, None) for name, tensor in weights])

    def _target(self, name: str) -> torch.Tensor | None:
        """The tensor a checkpoint tensor is copied into: its parameter, or its part of one."""
        if self._layout is None:
            return self._params.get(name)
        box = self._layout.boxes.get(name)
        return None if box is None else box.view(self._params[box.source].detach())

    def load_patches(self, patches: list[WeightPatch]) -> None:
        # Check every tensor before copying any, so a mismatch never half-loads the module.
        for patch in patches:
            param = self._target(patch.name)
            if param is None or param.shape != patch.tensor.shape:
                shape = None if param is None else list(param.shape)
                raise ApplyError(
                    f"cannot load {patch.name!r} of shape {list(patch.tensor.shape)} into the module ({shape})"
                )
            if param.is_floating_point() and torch.finfo(param.dtype).bits < torch.finfo(patch.tensor.dtype).bits:
                raise ApplyError(
                    f"{patch.name!r} travels as {patch.tensor.dtype} (the trainer's model keeps it so), but the "
                    f"module holds it as {param.dtype}, which would round it: keep it in {patch.tensor.dtype} "
                    "(transformers' from_pretrained does, for the modules a model keeps in float32)"
                )
        with torch.no_grad():
            for patch in patches:
                param = self._target(patch.name)
                if patch.positions is None or not param.is_contiguous():
                    param.copy_(patch.tensor)
                else:
                    # Only the changed values cross to the parameter's device (a replica on a GPU
                    # gets host tensors from the bucket), each operand moved to where it is written.
                    flat = patch.tensor.reshape(-1)
                    values = flat[patch.positions.to(flat.device)]
                    positions = patch.positions.to(param.device)
                    param.view(-1)[positions] = values.to(param.device, param.dtype)


def _weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a module's checkpoint holds, by name: its parameters and persistent buffers
    (those a trainer publishes too, see `delta_sync.checkpoint.persistent_buffers`)."""
    return {**dict(module.named_parameters()), **persistent_buffers(module)}


def _checkpoint_layout(module: nn.Module):
    """The checkpoint layout of a transformers model whose checkpoint is not its parameters
    as they are, else None (with no transformers imported, nothing can be a transformers model)."""
    if "transformers" not in sys.modules:
        return None
    layout = CheckpointLayout.of(module)
    return None if layout.identity else layout


def module_weight_loader(module: nn.Module) -> ModuleWeightLoader:
    """A `load_weights` callable that copies tensors into a module's parameters by name.

    It knows the module's parameter shapes, which a [`Receiver`] given no
    `expected_shapes` of its own checks anchors against.

    Example:
        ```python
        >>> replica = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        >>> receiver = Receiver(load_weights=module_weight_loader(replica))
        ```
    """
    return ModuleWeightLoader(module)


def expected_shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of a module's weights, the `expected_shapes` of a [`Receiver`]
    feeding it: its parameters, or for a transformers model with another run-time layout
    (fused MoE experts), the tensors its checkpoint holds."""
    layout = _checkpoint_layout(module)
    if layout is not None:
        return dict(layout.shapes)
    return {name: tuple(t.shape) for name, t in _weights_of(module).items()}

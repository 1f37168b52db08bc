"""`ModelLoader`: writes a version into the model vLLM serves, touching only what changed.

Where a checkpoint weight lives in the served model decides how it is written:

| runtime tensor | written |
| --- | --- |
| plain, and holds the checkpoint tensor as a contiguous range (same shape; or a fused qkv / gate_up shard on one worker) | the changed elements, straight into the tensor (`index_copy_`): O(changed) |
| plain, otherwise (a tensor-parallel slice, a padded vocabulary) | the changed elements, through vLLM's checkpoint patch loader (`load_checkpoint_weight_patches`: checkpoint coordinates, the model's own `load_weights`, so slices and padding are vLLM's) |
| none: `weight` is empty (the CPU backend prepacked the layer), or quantized | the whole layer, through vLLM's layerwise reload, with its fused siblings |

A direct write skips the model's `load_weights`, so it is used only for weights that
load as themselves: a weight becomes directly written after a write through vLLM's own
loader left the runtime range holding exactly the checkpoint's bits (checked once per
weight, at its first write); a model whose loader transforms a weight keeps it on vLLM's
path. The patch loader reads NaN as "unchanged", so a patch whose new values hold a NaN
that cannot be written directly is copied whole through `load_weights`.

A layer the CPU backend computes with a packed copy of a `weight` it keeps (`lm_head`,
or a tied `lm_head` with the embedding's weight: its `cpu_linear` holds the packed
handle) is packed again after a write, or it would compute with the old values.

Example:
    ```python
    >>> loader = ModelLoader(model, model_config, shapes=checkpoint_shapes(model_dir))
    >>> receiver.commit(pending, loader)  # hands it WeightPatch objects
    ```
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger

from delta_sync.replica.receiver import WeightPatch
from delta_sync.replica.staging import stage_patches

__all__ = ["ModelLoader", "packed_modules"]

logger = init_logger("vllm.delta_sync")

#: Dtypes of parameters that are not quantized: written element-wise.
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The integer view of each plain dtype: bit patterns compare exactly (NaN, -0.0).
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """vLLM's fused module name -> the checkpoint modules it fuses, in order (`qkv_proj`
    -> q, k, v)."""
    return getattr(type(model), "packed_modules_mapping", None) or getattr(model, "packed_modules_mapping", {})


@dataclass(frozen=True)
class _Range:
    """Where a checkpoint tensor's elements lie in a runtime tensor: `numel` elements from
    flat position `offset` of `runtime`, in row-major order."""

    runtime: str
    offset: int
    numel: int


class ModelLoader:
    """Loads versions into the served model (the receiver's `load_weights`, a
    `PatchingWeightLoader`); see the module's docstring for what goes where.

    Args:
        model: The served model.
        model_config: vLLM's model config (for the layerwise reload).
        shapes: The checkpoint's weight shapes (to find each weight's range in its runtime
            tensor); without them nothing is written directly (vLLM's loaders do it all).
    """

    def __init__(
        self, model: torch.nn.Module, model_config: Any, shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.shapes = dict(shapes or {})
        self._writable: dict[str, str] | None = None
        self._ranges: dict[str, _Range] = {}
        self._direct: set[str] = set()
        self._transformed: set[str] = set()
        self._patch_device: torch.device | None = None
        self._repacked: dict[str, list[torch.nn.Module]] = {}

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Reload `weights` whole (fused shards already completed by `load_together`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(weights))
        finally:
            # Always leave the model runnable: a half-finished reload crashes the next request.
            finalize_layerwise_reload(self.model, self.model_config)

    def load_patches(self, patches: list[WeightPatch]) -> None:
        """Write what changed where it lives; reload whole only what has no plain tensor."""
        writable = self.writable()
        direct: list[WeightPatch] = []
        sparse: dict[str, tuple[WeightPatch, torch.Tensor]] = {}
        rewritten: list[WeightPatch] = []
        reloaded: list[WeightPatch] = []
        for patch in patches:
            if patch.name not in writable:
                reloaded.append(patch)
            elif patch.name in self._direct:
                direct.append(patch)
            elif patch.positions is not None and not bool(torch.isnan(values := _at(patch)).any()):
                sparse[patch.name] = (patch, values)
            else:
                rewritten.append(patch)
        if reloaded:
            self([(patch.name, patch.tensor) for patch in reloaded])
        if rewritten:
            # Into plain tensors: nothing about these layers is processed after loading.
            self.model.load_weights(iter([(patch.name, patch.tensor) for patch in rewritten]))
        staged = self._stage({**{p.name: (p, _at(p)) for p in direct if p.positions is not None}, **sparse})
        if sparse:
            self._write_through_vllm({name: staged[name] for name in sparse}, sparse)
        if direct:
            self._write_direct([(patch, staged.get(patch.name)) for patch in direct])
        self._learn_direct(rewritten, sparse)
        self._repack({writable[name] for name in [*(p.name for p in direct), *sparse, *(p.name for p in rewritten)]})
        if self._patch_device is not None and (direct or sparse or rewritten):
            # One synchronisation, so that a failed write fails this call, which rolls back.
            torch.cuda.current_stream(self._patch_device).synchronize()
        logger.info(
            "delta-sync: wrote %d tensor(s) in place (%d changed elements), %d rewritten whole, reloaded %d whole",
            len(sparse) + sum(patch.positions is not None for patch in direct),
            sum(values.numel() for _, values in sparse.values())
            + sum(patch.positions.numel() for patch in direct if patch.positions is not None),
            len(rewritten) + sum(patch.positions is None for patch in direct),
            len(reloaded),
        )

    # -- the three ways in ---------------------------------------------------------------------

    def _stage(
        self, changes: dict[str, tuple[WeightPatch, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Name -> (positions, values) where the model is: on a CUDA model every patch's
        positions and values cross in two pinned buffers; elsewhere they stay as they are."""
        device = self.patch_device()
        if device is None or not changes:
            return {name: (patch.positions, values) for name, (patch, values) in changes.items()}
        staged = stage_patches({name: (patch.positions, values) for name, (patch, values) in changes.items()}, device)
        return {name: (patch.positions, patch.values) for name, patch in staged.items()}

    def _write_through_vllm(
        self, staged: dict[str, tuple[torch.Tensor, torch.Tensor]], sparse: dict[str, tuple[WeightPatch, torch.Tensor]]
    ) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        load_checkpoint_weight_patches(
            self.model,
            [
                CheckpointWeightPatch(
                    name=name,
                    shape=tuple(patch.tensor.shape),
                    dtype=patch.tensor.dtype,
                    values=staged[name][1],
                    indices=staged[name][0],
                )
                for name, (patch, _) in sparse.items()
            ],
            validate_unique_indices=False,  # positions are unique and sorted by construction
        )

    def _write_direct(self, writes: list[tuple[WeightPatch, tuple[torch.Tensor, torch.Tensor] | None]]) -> None:
        """Write each patch into its runtime range: the changed elements (`staged`: positions
        and values on the model's device), or the whole tensor where they are not known."""
        runtime = dict(self.model.named_parameters())
        for patch, staged in writes:
            where = self._ranges[patch.name]
            flat = runtime[where.runtime].data.view(-1)
            if staged is None:
                flat[where.offset : where.offset + where.numel].copy_(patch.tensor.reshape(-1))
            else:
                positions, values = staged
                flat.index_copy_(0, positions.long() + where.offset, values.to(flat.dtype))

    def _learn_direct(self, rewritten: list[WeightPatch], sparse: dict[str, tuple[WeightPatch, torch.Tensor]]) -> None:
        """Weights vLLM's loader has just written that may be written directly from now on:
        those whose runtime range now holds exactly the checkpoint's bits."""
        runtime = dict(self.model.named_parameters())
        checked = [(p, None) for p in rewritten] + [(p, v) for p, v in sparse.values()]
        for patch, values in checked:
            where = self._ranges.get(patch.name)
            if where is None or patch.name in self._direct or patch.name in self._transformed:
                continue
            flat = runtime[where.runtime].data.view(-1)
            if values is None:
                held, expected = flat[where.offset : where.offset + where.numel], patch.tensor.reshape(-1)
            else:
                held, expected = flat[patch.positions.to(flat.device).long() + where.offset], values
            bits = _BITS[flat.dtype]
            if torch.equal(held.view(bits), expected.to(device=flat.device, dtype=flat.dtype).view(bits)):
                self._direct.add(patch.name)
            else:
                self._transformed.add(patch.name)
                logger.info(
                    "delta-sync: %s is not what vLLM's loader stores for it (the model transforms it): "
                    "it keeps going through vLLM's loader",
                    patch.name,
                )

    def _repack(self, runtime_names: set[str]) -> None:
        """Pack again the layers that compute with a packed copy of a weight just written."""
        modules = [module for name in sorted(runtime_names) for module in self._repacked.get(name, ())]
        if modules:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            for module in modules:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def _modules_packed_from(
        self, runtime: dict[str, torch.nn.Parameter], plain: set[str]
    ) -> dict[str, list[torch.nn.Module]]:
        """Runtime parameter -> the modules that compute with a packed copy of it: found by
        the parameter itself, not its name, since a tied `lm_head` computes with a copy of
        the embedding's weight. An embedding's own copy is never computed with (it looks
        rows up in `weight`), so it is not packed again."""
        try:
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        except ImportError:  # another layout of vLLM: pack every such module again
            ParallelLMHead = VocabParallelEmbedding = ()  # noqa: N806
        names = {id(runtime[name]): name for name in plain}
        packed: dict[str, list[torch.nn.Module]] = {}
        for module in self.model.modules():
            name = names.get(id(getattr(module, "weight", None)))
            if name is None or not _computes_with_a_packed_copy(module):
                continue
            if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
                continue
            packed.setdefault(name, []).append(module)
        return packed

    # -- what the model keeps where ------------------------------------------------------------

    def patch_device(self) -> torch.device | None:
        """The CUDA device the plain parameters live on, or None on any other (the CPU:
        the patches are used where they are)."""
        self.writable()
        return self._patch_device

    def writable(self) -> dict[str, str]:
        """Checkpoint name -> the runtime tensor it is written into, for every checkpoint
        weight whose runtime tensor is a plain, non-empty floating-point tensor: its own
        (same name) or the fused tensor it is a shard of (`q_proj` into `qkv_proj`)."""
        if self._writable is None:
            self._writable = self._find_writable()
        return self._writable

    def _find_writable(self) -> dict[str, str]:
        try:
            import vllm.model_executor.model_loader.checkpoint_weight_patch  # noqa: F401
        except ImportError:  # vLLM before 0.29: no patch loader
            logger.info("delta-sync: this vLLM has no checkpoint patch loader: every tensor is reloaded whole")
            return {}
        runtime = dict(self.model.named_parameters())
        plain = {name for name, param in runtime.items() if param.numel() > 0 and param.dtype in _PLAIN_DTYPES}
        writable = {name: name for name in plain}
        packed = packed_modules(self.model)
        for name in sorted(plain):
            param = runtime[name]
            if param.is_contiguous() and self.shapes.get(name) == tuple(param.shape):
                self._ranges[name] = _Range(name, 0, param.numel())
            parts = name.split(".")
            for i, part in enumerate(parts):
                shards = [".".join([*parts[:i], shard, *parts[i + 1 :]]) for shard in packed.get(part, ())]
                writable.update((shard, name) for shard in shards)
                self._ranges.update(self._fused_ranges(name, param, shards))
        logger.info(
            "delta-sync: %d checkpoint weight(s) are written where they live when they change (%s), %d of "
            "them straight into their range once vLLM's loader has shown it stores them as they are; "
            "%d runtime parameter(s) with no plain tensor are reloaded whole",
            len(writable),
            ", ".join(sorted(writable)[:4]) + (", ..." if len(writable) > 4 else ""),
            len(self._ranges),
            sum(1 for name in runtime if name not in plain),
        )
        self._repacked = self._modules_packed_from(runtime, plain)
        if self._repacked:
            logger.info(
                "delta-sync: %d of them are packed again after a write (the CPU backend computes with a "
                "packed copy): %s",
                len(self._repacked),
                ", ".join(sorted(self._repacked)[:4]) + (", ..." if len(self._repacked) > 4 else ""),
            )
        devices = {runtime[name].device for name in plain}
        if len(devices) == 1 and (device := devices.pop()).type == "cuda":
            self._patch_device = device
            logger.info("delta-sync: patches cross to %s in pinned buffers, one copy each per update", device)
        return writable

    def _fused_ranges(self, runtime: str, param: torch.Tensor, shards: list[str]) -> dict[str, _Range]:
        """The ranges of a fused tensor's shards, where it is exactly its shards stacked
        along the first dimension (one worker: no tensor-parallel slicing)."""
        shapes = [self.shapes.get(shard) for shard in shards]
        if not shards or not param.is_contiguous() or any(shape is None or not shape for shape in shapes):
            return {}
        if any(shape[1:] != tuple(param.shape[1:]) for shape in shapes):
            return {}
        if sum(shape[0] for shape in shapes) != param.shape[0]:
            return {}
        ranges, offset = {}, 0
        for shard, shape in zip(shards, shapes):
            numel = math.prod(shape)
            ranges[shard] = _Range(runtime, offset, numel)
            offset += numel
        return ranges


def _at(patch: WeightPatch) -> torch.Tensor:
    """The new values at a patch's changed positions."""
    return patch.tensor.reshape(-1)[patch.positions]


def _computes_with_a_packed_copy(module: torch.nn.Module) -> bool:
    """Whether the CPU backend computes `module` with a copy of its weight packed at load
    time: vLLM 0.32's `dispatch_cpu_unquantized_gemm` makes `cpu_linear` a closure over
    the packed handle or copy (oneDNN, sgl-kernel, zentorch); its fallback,
    `torch.nn.functional.linear` on the live weight, holds nothing."""
    cpu_linear = getattr(module, "cpu_linear", None)
    return cpu_linear is not None and bool(getattr(cpu_linear, "__closure__", None))

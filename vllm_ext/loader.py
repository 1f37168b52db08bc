"""`ModelLoader`: writes a version into the model vLLM serves, touching only what changed.

Where a checkpoint weight lives in the served model decides how it is written:

| runtime tensor | written |
| --- | --- |
| plain, and holds the checkpoint tensor as a contiguous range (same shape; or a fused qkv / gate_up shard on one worker) | the changed elements, straight into the tensor (`index_copy_`): O(changed) |
| plain, otherwise (a tensor-parallel slice, a padded vocabulary) | the changed elements, through vLLM's checkpoint patch loader (`load_checkpoint_weight_patches`: checkpoint coordinates, the model's own `load_weights`, so slices and padding are vLLM's) |
| none: `weight` is empty (the CPU backend prepacked the layer), held in a kernel's packed layout (the CPU backend's causal-conv weights of linear attention: Qwen3-Next's gated delta net), or quantized | the whole layer, through vLLM's layerwise reload, with its fused siblings |
| a fused MoE layer's experts (`w13_weight`, `w2_weight`: every expert stacked, in the kernel's layout) | the whole layer, through vLLM's layerwise reload, with every expert's tensors from the snapshot (the engine completes the group) and the kernel's own processing run again (the CPU backend's prepack) |
| a layer vLLM's loader writes past its weight loaders (gpt-oss's experts, their biases and the attention sinks: `param.copy_`), which a layerwise reload cannot see | the whole layer, in place, outside the layerwise reload (learned at the first load that finds one), then its own post-load processing (the CPU backend's prepack), its results copied into the tensors the kernel holds |
| `kv_b_proj` of a multi-head latent attention layer (DeepSeek-V2/V3, Kimi K2), from which the attention derives its absorbed matrices after loading (and which the CPU kernels may then free) | the whole tensor (this worker's rows of it), then the attention layer's own post-load processing, which derives those matrices again (in place where it copies into them) |

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger

from delta_sync.errors import ApplyError
from delta_sync.replica.loaders import WeightPatch
from delta_sync.replica.staging import stage_patches

from .compat import (
    free_device_bytes,
    layer_bytes,
    patch_chunk_bytes,
    reload_headroom,
    staging_groups,
    synchronize_devices,
    tied_aliases,
    unconsumed,
    write_positions,
)

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
        self._runtime_of: dict[str, str] = {}
        self._aliases: dict[str, str] = {}
        self._latent = _latent_attention_layers(model, self.shapes)
        #: Layers vLLM's loader writes past their weight loaders (gpt-oss's experts and
        #: attention sinks: `param.copy_`), by name: left out of the layerwise reload, loaded
        #: in place and processed again here.
        self._live: dict[str, torch.nn.Module] = {}
        #: Whether the last load ran to its end: after a failed load, the receiver's reload
        #: of the version served puts it back to True, and only then is the model whole.
        self.intact = True

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Reload `weights` whole (fused shards and expert groups already completed by
        `load_together`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self.intact = False
        self.writable()
        weights = self._canonical(weights)
        self._load_latent([(name, tensor) for name, tensor in weights if name in self._latent])
        weights = [(name, tensor) for name, tensor in weights if name not in self._latent]
        if not weights:
            self.intact = True
            return
        self._check_reload_headroom(weights)
        # Both signatures: vLLM 0.34 added keyword-only options to these, with defaults that
        # keep 0.32's behaviour; its finalize also runs every module's post-load hook.
        initialize_layerwise_reload(self.model)
        _left_out_of_the_reload(self._live.values())
        # Latent attention was processed when its projection was loaded (`_load_latent`);
        # vLLM's finalize would process every attention layer again, from a freed tensor.
        with _latent_attention_kept(self._latent.values()):
            try:
                with _experts_processed_as_at_load(self.model):
                    loaded = self.model.load_weights(iter(weights))
                unseen = _written_past_the_reload(self.model, loaded)
            finally:
                # Always leave the model runnable: a half-finished reload crashes the next request.
                finalize_layerwise_reload(self.model, self.model_config)
                _unwrap_reload_loaders(self.model.modules())
        if unseen:
            # The reload put those layers' old tensors back. From now on they stay out of it
            # and are written in place; this load runs again so that they are.
            layers = sorted({name.rpartition(".")[0] for name in unseen})
            if self._live.keys() >= set(layers):  # left out, and still unseen: nothing more to try
                raise ApplyError(
                    f"vLLM's loader of {type(self.model).__name__} wrote {', '.join(unseen[:4])}"
                    f"{', ...' if len(unseen) > 4 else ''} past its weight loaders, and loading those layers "
                    "in place did not reach them either: vLLM would keep serving the old values"
                )
            self._live |= {name: self.model.get_submodule(name) for name in layers}
            logger.info(
                "delta-sync: vLLM's loader writes %s past its weight loaders: %d layer(s) are loaded in place "
                "and processed again, outside vLLM's layerwise reload",
                ", ".join(unseen[:4]) + (", ..." if len(unseen) > 4 else ""),
                len(layers),
            )
            self(weights)
            return
        self._process_live(loaded)
        self._check_consumed([name for name, _ in weights], loaded)
        self.intact = True

    def _process_live(self, loaded: Iterable[str] | None) -> None:
        """Run the post-load processing of the live layers `loaded` wrote into (in place,
        in the checkpoint's layout), as vLLM runs it once a model is loaded: the layer's
        method's (a MoE layer's experts prepacked again), an attention layer's own.

        Every tensor of such a layer must have been written: the engine completes a MoE
        layer's group, and a layer processed from half-processed tensors would be wrong."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload.layerwise import (
            _copy_and_restore_kernel_tensors,
            get_layerwise_info,
        )
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        written = {name.rpartition(".")[0] for name in loaded or ()} & self._live.keys()
        for name in sorted(written):
            layer = self._live[name]
            info = get_layerwise_info(layer)
            # Processing may put new tensors in the layer: their values go back into the
            # tensors the kernel holds, as vLLM's reload copies them.
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            method = getattr(layer, "quant_method", None)
            with torch.no_grad():
                if isinstance(method, QuantizeMethodBase):
                    with _experts_processed_as_at_load(layer):
                        method.process_weights_after_loading(layer)
                if is_deferred_attention_layer(layer):
                    layer.process_weights_after_loading(self.model_config.dtype)
                _copy_and_restore_kernel_tensors(layer, info)
            info.reset()
        if written:
            logger.info("delta-sync: loaded %d layer(s) in place and processed them again", len(written))

    def load_patches(self, patches: list[WeightPatch]) -> None:
        """Write what changed where it lives; reload whole only what has no plain tensor."""
        self.intact = False
        writable = self.writable()
        renamed = self._canonical_names([patch.name for patch in patches])
        patches = [WeightPatch(renamed[p.name], p.tensor, p.positions) for p in patches if p.name in renamed]
        self._load_latent([(p.name, p.tensor) for p in patches if p.name in self._latent])
        patches = [p for p in patches if p.name not in self._latent]
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
            loaded = self.model.load_weights(iter([(patch.name, patch.tensor) for patch in rewritten]))
            self._check_consumed([patch.name for patch in rewritten], loaded)
        changes = {**{p.name: (p, _at(p)) for p in direct if p.positions is not None}, **sparse}
        groups = self._staging_groups(changes)
        for i, group in enumerate(groups):
            staged = self._stage({name: changes[name] for name in group})
            in_sparse = {name: sparse[name] for name in group if name in sparse}
            if in_sparse:
                self._write_through_vllm({name: staged[name] for name in in_sparse}, in_sparse)
            # Whole tensors (positions unknown) are written with the last group.
            last = i == len(groups) - 1
            writes = [(p, staged.get(p.name)) for p in direct if p.name in staged or (last and p.positions is None)]
            if writes:
                self._write_direct(writes)
        self._learn_direct(rewritten, sparse)
        self._repack({writable[name] for name in [*(p.name for p in direct), *sparse, *(p.name for p in rewritten)]})
        if direct or sparse or rewritten:
            # One synchronisation per device written, so that a failed write fails this call,
            # which rolls back (with --cpu-offload-gb a model's tensors are on several).
            runtime = dict(self.model.named_parameters())
            names = [*(p.name for p in direct), *sparse, *(p.name for p in rewritten)]
            synchronize_devices({runtime[writable[name]].device for name in names})
        logger.info(
            "delta-sync: wrote %d tensor(s) in place (%d changed elements), %d rewritten whole, reloaded %d whole",
            len(sparse) + sum(patch.positions is not None for patch in direct),
            sum(values.numel() for _, values in sparse.values())
            + sum(patch.positions.numel() for patch in direct if patch.positions is not None),
            len(rewritten) + sum(patch.positions is None for patch in direct),
            len(reloaded),
        )
        self.intact = True

    # -- the ways in ---------------------------------------------------------------------------

    def _load_latent(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load latent attention's `kv_b_proj` tensors whole and let each attention layer
        derive its absorbed matrices from them again, as it did at load.

        An in-place write would leave those matrices as they were, and vLLM's layerwise
        reload cannot reload the tensor once the CPU kernel has freed it (it copies the new
        tensor into the freed, empty one)."""
        for name, tensor in weights:
            layer = self._latent[name]
            linear = layer.kv_b_proj
            # This worker's rows: the projection is column-parallel (its outputs are split).
            rows = linear.output_size_per_partition
            value = tensor.narrow(0, linear.tp_rank * rows, rows)
            weight = linear.weight
            if tuple(weight.shape) == tuple(value.shape):
                with torch.no_grad():
                    weight.copy_(value)  # in place: whatever captured its address keeps it
            else:
                linear.weight = torch.nn.Parameter(
                    value.to(device=weight.device, dtype=self.model_config.dtype, copy=True), requires_grad=False
                )
            layer.process_weights_after_loading(self.model_config.dtype)
        if weights:
            logger.info(
                "delta-sync: loaded %d latent attention projection(s) whole and derived the attention's matrices again",
                len(weights),
            )

    def _stage(
        self, changes: dict[str, tuple[WeightPatch, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Name -> (positions, values) where the model is: on a CUDA model the patches'
        positions and values cross in two pinned buffers per dtype of values (bf16, and
        float32 for the tensors that travel so); elsewhere they stay as they are."""
        device = self.patch_device()
        if device is None or not changes:
            return {name: (patch.positions, values) for name, (patch, values) in changes.items()}
        staged = {}
        for dtype in {values.dtype for _, values in changes.values()}:
            of_dtype = {
                name: (patch.positions, values) for name, (patch, values) in changes.items() if values.dtype == dtype
            }
            staged |= {name: (patch.positions, patch.values) for name, patch in stage_patches(of_dtype, device).items()}
        return staged

    def _staging_groups(self, changes: dict[str, tuple[WeightPatch, torch.Tensor]]) -> list[list[str]]:
        """The patches of one load in groups, each staged on the device and written before
        the next is staged: one group where nothing says how much is free (the CPU), else
        groups bounded by the memory free on the device (vLLM 0.34 lends the KV cache's
        memory to the update, and a large delta's positions and values alone may exceed
        what is left beside it)."""
        device = self.patch_device()
        free = free_device_bytes(device)
        sizes = {
            name: patch.positions.numel() * (patch.positions.element_size() + values.element_size())
            for name, (patch, values) in changes.items()
        }
        groups = staging_groups(sizes, free)
        if free is not None:
            logger.info(
                "delta-sync: %.2f GiB free on %s: %d MiB of positions and values staged in %d group(s)",
                free / 2**30,
                device,
                sum(sizes.values()) >> 20,
                len(groups),
            )
        return groups

    def _write_through_vllm(
        self, staged: dict[str, tuple[torch.Tensor, torch.Tensor]], sparse: dict[str, tuple[WeightPatch, torch.Tensor]]
    ) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        device = self.patch_device()
        free = free_device_bytes(device)
        chunk = patch_chunk_bytes(free)
        if free is not None:
            logger.info(
                "delta-sync: %.2f GiB free on %s: vLLM's patch loader stages up to %d MiB per call",
                free / 2**30,
                device,
                chunk >> 20,
            )
        loaded = load_checkpoint_weight_patches(
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
            max_chunk_bytes=chunk,
            validate_unique_indices=False,  # positions are unique and sorted by construction
        )
        self._check_consumed(list(sparse), loaded)

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
                write_positions(flat, *staged, where.offset)

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

    def _canonical(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`weights` under the names vLLM's loaders load (see [`_canonical_names`])."""
        renamed = self._canonical_names([name for name, _ in weights])
        return [(renamed[name], tensor) for name, tensor in weights if name in renamed]

    def _canonical_names(self, names: list[str]) -> dict[str, str]:
        """Name sent -> name to load: a tied alias (`lm_head.weight`) as the tensor it is tied
        to, which vLLM's loaders load (they skip the alias). An alias sent together with its
        canonical name is the same tensor, so it has no entry."""
        sent = set(names)
        return {
            name: self._aliases.get(name, name)
            for name in names
            if name not in self._aliases or self._aliases[name] not in sent
        }

    def _check_consumed(self, sent: list[str], loaded: Any) -> None:
        """Fail the load (the receiver then rolls back) when vLLM's loader reports that it
        did not load a tensor sent to it: vLLM 0.34 skips some names silently, where 0.32
        raised, and a change would otherwise be lost without a word."""
        missed = unconsumed(sent, loaded, self._runtime_of)
        if missed:
            raise ApplyError(
                f"vLLM's loader did not load {len(missed)} changed tensor(s) sent to it: "
                f"{', '.join(missed[:4])}{', ...' if len(missed) > 4 else ''} "
                f"(into {', '.join(sorted({self._runtime_of[name] for name in missed})[:4])})"
            )

    def _check_reload_headroom(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Say, before a whole-layer reload, how much device memory is free for it and when
        it may not fit (vLLM 0.34 lends the KV cache's memory to the update; vLLM
        materialises each layer on the device)."""
        free = free_device_bytes(self._patch_device)
        if free is None:
            return
        largest = layer_bytes(weights)
        logger.info(
            "delta-sync: reloading %d tensor(s) whole; %.2f GiB free on %s, largest layer %.2f GiB",
            len(weights),
            free / 2**30,
            self._patch_device,
            largest / 2**30,
        )
        if (short := reload_headroom(free, largest)) is not None:
            logger.warning("delta-sync: %s", short)

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
        experts = _parameters_of(self.model, _is_fused_experts)
        kernel_layout = experts | _parameters_of(self.model, _holds_a_packed_conv_weight)
        plain = {
            name
            for name, param in runtime.items()
            if param.numel() > 0 and param.dtype in _PLAIN_DTYPES and name not in kernel_layout
        }
        writable = {name: name for name in plain}
        packed = packed_modules(self.model)
        self._aliases = {alias: name for alias, name in tied_aliases(self.model).items() if name in runtime}
        # Where each checkpoint name lands, plain or not: to check what vLLM's loader reports.
        self._runtime_of = {name: name for name in runtime if name not in experts}
        for name in sorted(self._runtime_of):
            parts = name.split(".")
            for i, part in enumerate(parts):
                for shard in packed.get(part, ()):
                    self._runtime_of[".".join([*parts[:i], shard, *parts[i + 1 :]])] = name
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


def _is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is vLLM's fused MoE layer (its method builds a MoE kernel): its
    tensors stack every expert, in the layout the kernel computes with, so a changed expert
    reloads the layer, all experts together."""
    return hasattr(getattr(module, "quant_method", None), "moe_kernel")


def _written_past_the_reload(model: torch.nn.Module, loaded: Any) -> list[str]:
    """The runtime tensors vLLM's loader reports loaded whose layer the layerwise reload saw
    nothing of: written straight into the tensor (gpt-oss's experts: `param.copy_`), not
    through the weight loader the reload wraps to count what arrives. Finalizing the reload
    then puts the layer's old tensors back. Read before the finalize, which forgets it."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    unseen = []
    for name in sorted(loaded or ()):
        try:
            layer = model.get_submodule(name.rpartition(".")[0])
        except AttributeError:
            continue
        info = LAYERWISE_INFO.get(layer)
        # Processed layers have been reset (no kernel tensors kept); a layer still holding its
        # kernel tensors with nothing counted has received nothing the reload could use.
        if info is not None and info.kernel_tensors is not None and info.load_numel == 0:
            unseen.append(name)
    return unseen


def _left_out_of_the_reload(layers: Iterable[torch.nn.Module]) -> None:
    """Put `layers` back as they were before `initialize_layerwise_reload` (their tensors, with
    the loaders vLLM's reload wrapped on their stand-ins only), so that a load writes into them
    in place and the reload's finalize leaves them be."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    layers = list(layers)
    for layer in layers:
        info = get_layerwise_info(layer)
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    _unwrap_reload_loaders(layers)


def _unwrap_reload_loaders(modules: Iterable[torch.nn.Module]) -> None:
    """Give every tensor of `modules` back the weight loader vLLM's layerwise reload wrapped.

    The reload wraps the loaders of the tensors it leaves in place (a layer's `bias`, never
    moved to the meta device) and unwraps only those of the layers it loaded. A wrapper left
    on a layer it did not load drops what is loaded into it afterwards ("excessive loading")
    while `load_weights` reports it loaded: vLLM 0.32 kept PhiMoE's biases and layer norms'
    biases at their old values after any reload of its MoE layers."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

    for module in modules:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            loader = getattr(tensor, "weight_loader", None)
            if loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                tensor.weight_loader = _get_original_loader(tensor)


def _parameters_of(model: torch.nn.Module, kind: Callable[[torch.nn.Module], bool]) -> set[str]:
    """The names of the parameters held by the modules of `model` that are of `kind`."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if kind(module)
        for name, _ in module.named_parameters(recurse=False)
    }


def _holds_a_packed_conv_weight(module: torch.nn.Module) -> bool:
    """Whether the CPU backend replaced `module`'s causal-conv `weight` by its kernel's
    packed layout at load time (vLLM 0.32's `dispatch_cpu_unquantized_gemm`, for the
    convolution of linear attention layers, keeps the unpacked weight beside it as
    `_cpu_unpacked_conv_weight`). Its values are no longer the checkpoint's in any order a
    write could follow: only the layer's own processing after a reload packs new ones."""
    return getattr(module, "_cpu_unpacked_conv_weight", None) is not None


def _latent_attention_layers(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Checkpoint name of each multi-head latent attention layer's `kv_b_proj` weight -> the
    layer (vLLM's `MLAAttention`: it holds the projection and derives matrices from it in
    `process_weights_after_loading`). Only unquantized projections: a quantized one is the
    layerwise reload's."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    layers = {}
    for module in model.modules():
        linear = getattr(module, "kv_b_proj", None)
        if linear is None or getattr(module, "impl", None) is None or getattr(linear, "quant_config", None) is not None:
            continue
        for path in paths.get(id(linear), []):
            if not shapes or f"{path}.weight" in shapes:
                layers[f"{path}.weight"] = module
    return layers


@contextmanager
def _latent_attention_kept(layers: Iterable[Any]) -> Iterator[None]:
    """Keep latent attention layers as they are through a layerwise reload of other layers.

    vLLM's reload finalizes by processing every attention layer again. A latent attention
    layer derives its matrices from `kv_b_proj`, which the CPU kernels free once they are
    derived: processing it again would fail (or, where the tensor is kept, redo work for a
    projection that did not change). A changed projection is processed where it is loaded.
    """
    kept = list(dict.fromkeys(layers))
    for layer in kept:
        layer.process_weights_after_loading = _unchanged
    try:
        yield
    finally:
        for layer in kept:
            del layer.process_weights_after_loading


def _unchanged(act_dtype: torch.dtype) -> None:
    """A latent attention layer's processing while it is kept: nothing to derive."""


@contextmanager
def _experts_processed_as_at_load(model: torch.nn.Module) -> Iterator[None]:
    """Make a reload process fused MoE layers as their first load did.

    At load, vLLM's unquantized MoE method converts the experts' tensors to the kernel's
    format and then lets the kernel's experts process them (the CPU backend prepacks them
    there, into another layout of the same shape). On a reload (`moe_kernel` already built)
    it converts the new tensors but skips the experts' step, so the CPU kernel would compute
    with checkpoint-layout values as if prepacked: wrong outputs (vLLM 0.32, read in
    `UnquantizedFusedMoEMethod._setup_kernel`). Here each MoE method's processing runs that
    step after its own, on the layer vLLM just loaded, before vLLM copies it into the tensors
    the kernel holds. Experts that process nothing (the default) are unaffected.
    """
    wrapped = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not _is_fused_experts(module) or "process_weights_after_loading" in vars(method):
            continue
        process = method.process_weights_after_loading

        def processed(layer: torch.nn.Module, method: Any = method, process: Any = process) -> None:
            reloading = method.moe_kernel is not None
            process(layer)
            if reloading and method.moe_kernel is not None:
                method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = processed
        wrapped.append(method)
    try:
        yield
    finally:
        for method in wrapped:
            del method.process_weights_after_loading


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

"""What a replica serves of a PEFT model: the base checkpoint with the adapter merged.

A PEFT model's parameters are named after PEFT's wrappers
(`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`,
`...q_proj.lora_A.default.weight`), which no checkpoint has and vLLM cannot load.
[`MergedWeights`] names every weight as the base checkpoint does
(`model.layers.0.self_attn.q_proj.weight`) and gives, for a module a LoRA adapter
adapts, the weight `peft`'s `merge_and_unload()` would leave there: the base weight plus
each active adapter's `get_delta_weight`, added in the base weight's dtype exactly as
`peft`'s `merge()` adds it, so the bits are `peft`'s own. The base weights never change
during LoRA training, so only adapted modules' merged weights can.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..checkpoint import canonical_name, check_checkpoint_names
from ..errors import UnservableModelError

# `check_checkpoint_names` lives in `delta_sync.checkpoint`; named here too, where it used to be.
__all__ = ["MergedWeights", "check_checkpoint_names", "merged_weights"]

logger = logging.getLogger(__name__)

#: What a model with PEFT modules can be published as; named in every refusal.
_PEFT_OPTIONS = (
    "delta-sync publishes a PEFT model in merged mode: LoRA adapters (peft's lora.Linear layers, "
    "without DoRA or other variants, lora_bias or modules_to_save) merged into the base checkpoint's weights. "
    "Merge the adapter before training (model.merge_and_unload()), train without this PEFT feature, "
    "or publish a model whose parameter names are its checkpoint's"
)


def _peft_classes() -> tuple[type, type, type, type] | None:
    """peft's `PeftModel`, `BaseTunerLayer`, `AuxiliaryTrainingWrapper` and LoRA `Linear`,
    or None when peft is not installed (then no model has PEFT modules)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import Linear
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return None
    return PeftModel, BaseTunerLayer, AuxiliaryTrainingWrapper, Linear


class MergedWeights:
    """A PEFT LoRA model's weights as the base checkpoint names them, adapters merged.

    Args:
        model: The model being trained: a `peft.PeftModel` (as TRL's trainers build it
            from `peft_config`), or a model `peft.inject_adapter_in_model` adapted, under
            any wrapper the detector strips (DDP, Accelerate, torch.compile).

    Raises:
        UnservableModelError: The model holds a PEFT module whose merge is not exactly
            `base weight + get_delta_weight` (DoRA and other LoRA variants, `lora_bias`,
            LoRA on embeddings or convolutions, stacked adapters, other PEFT methods,
            `modules_to_save`), or a parameter outside the adapted transformers model.

    Example:
        ```python
        >>> model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        >>> weights = MergedWeights(model)
        >>> sorted(weights.adapted)[:1]
        ['model.layers.0.self_attn.q_proj.weight']
        >>> weights.value("model.layers.0.self_attn.q_proj.weight").shape
        torch.Size([128, 128])
        ```
    """

    def __init__(self, model: nn.Module) -> None:
        classes = _peft_classes()
        if classes is None:
            raise UnservableModelError("MergedWeights needs peft installed (pip install peft)")
        peft_model_class, tuner_class, auxiliary_class, lora_linear = classes
        peft_models = [module for module in model.modules() if isinstance(module, peft_model_class)]
        if len(peft_models) > 1:
            raise UnservableModelError(f"the model holds {len(peft_models)} PeftModels; publish one at a time")
        #: The adapted model whose names (with each LoRA layer's `base_layer.` dropped) are the checkpoint's.
        self.root: nn.Module = peft_models[0].get_base_model() if peft_models else model
        #: Served name -> the parameter that gives its shape and dtype (for an adapted
        #: module, its base weight).
        self.parameters: dict[str, nn.Parameter] = {}
        #: Served name -> the LoRA layer whose merged weight it is.
        self.adapted: dict[str, nn.Module] = {}
        #: `id(parameter)` -> the served name whose value the parameter sets: a LoRA
        #: parameter sets its layer's merged weight.
        self.owners: dict[int, str] = {}
        layers: dict[str, nn.Module] = {}
        for path, module in self.root.named_modules():
            if isinstance(module, auxiliary_class):
                raise UnservableModelError(
                    f"{path!r} is a PEFT {type(module).__name__} (modules_to_save or trainable tokens), "
                    f"which merged mode does not publish yet. {_PEFT_OPTIONS}"
                )
            if isinstance(module, tuner_class):
                _check_lora_layer(path, module, tuner_class, lora_linear)
                layers[path] = module
        for raw_name, param in self.root.named_parameters():
            layer_path, rest = _owning_layer(raw_name, layers)
            if layer_path is None:
                self._add(canonical_name(raw_name), param)
                continue
            layer = layers[layer_path]
            weight_name = canonical_name(f"{layer_path}.weight")
            if rest.startswith("base_layer."):
                name = canonical_name(f"{layer_path}.{rest.removeprefix('base_layer.')}")
                self._add(name, param)
                if name == weight_name:
                    self.adapted[name] = layer
            elif rest.split(".")[0] in ("lora_A", "lora_B"):
                self.owners[id(param)] = weight_name
            else:
                raise UnservableModelError(
                    f"parameter {raw_name!r} of the LoRA layer {layer_path!r} is neither its base layer's "
                    f"nor a lora_A / lora_B weight. {_PEFT_OPTIONS}"
                )
        outside = [name for name, param in model.named_parameters() if id(param) not in self.owners]
        if outside:
            raise UnservableModelError(
                f"parameter {outside[0]!r} (and {len(outside) - 1} more) is not part of the PEFT model's base "
                f"model, so no checkpoint name serves it. {_PEFT_OPTIONS}"
            )

    def _add(self, name: str, param: nn.Parameter) -> None:
        if name in self.parameters and self.parameters[name] is not param:
            raise ValueError(f"two parameters map to the checkpoint name {name!r}")
        self.parameters[name] = param
        self.owners[id(param)] = name

    def value(self, name: str) -> torch.Tensor:
        """The weight a replica serves under `name`, in the base weight's dtype.

        For an adapted module: what `peft`'s `merge()` leaves in the base weight (each
        active adapter not merged yet adds its `get_delta_weight` in place, in order);
        computed on a copy, the model is left as it is. Otherwise the parameter itself.
        """
        layer = self.adapted.get(name)
        if layer is None:
            return self.parameters[name]
        with torch.no_grad():
            merged = layer.get_base_layer().weight.detach().clone()
            already = set(layer.merged_adapters) if layer.merged else set()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A and adapter not in already:
                    merged += layer.get_delta_weight(adapter)
        return merged


def _check_lora_layer(path: str, layer: nn.Module, tuner_class: type, lora_linear: type) -> None:
    """Refuse a PEFT layer whose merge is not `weight += get_delta_weight(adapter)`."""
    if type(layer) is not lora_linear:
        raise UnservableModelError(
            f"{path!r} is a PEFT {type(layer).__module__}.{type(layer).__name__} layer. {_PEFT_OPTIONS}"
        )
    if isinstance(layer.base_layer, tuner_class):
        raise UnservableModelError(f"{path!r} stacks PEFT layers. {_PEFT_OPTIONS}")
    for adapter in layer.lora_A:
        if adapter in layer.lora_variant:
            variant = type(layer.lora_variant[adapter]).__name__
            raise UnservableModelError(
                f"{path!r} uses the LoRA variant {variant} (adapter {adapter!r}). {_PEFT_OPTIONS}"
            )
        if layer.lora_bias.get(adapter):
            raise UnservableModelError(f"{path!r} trains a LoRA bias (adapter {adapter!r}). {_PEFT_OPTIONS}")


def _owning_layer(name: str, layers: dict[str, nn.Module]) -> tuple[str | None, str]:
    """The LoRA layer path a parameter name lies under, and the rest of the name."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:cut])
        if path in layers:
            return path, ".".join(parts[cut:])
    return None, name


def merged_weights(model: nn.Module) -> MergedWeights | None:
    """The [`MergedWeights`] of a model with PEFT modules; None for one without.

    Raises:
        UnservableModelError: See [`MergedWeights`].
    """
    classes = _peft_classes()
    if classes is None:
        return None
    if not any(isinstance(module, classes[:3]) for module in model.modules()):
        return None
    return MergedWeights(model)

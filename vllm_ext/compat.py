"""What differs between the vLLM releases `vllm_ext` supports, decided in one place.

vLLM 0.32 (the CPU wheel, run for real in the tests) through 0.34 (the CUDA wheel) are
supported; [`check_vllm_version`] refuses any other at start-up. The differences handled:

| vLLM | what changed | handled by |
| --- | --- | --- |
| 0.34 | `Worker.finish_weight_update` keeps an `_incomplete_weight_updates` mark, cleared only by a successful finish | [`end_failed_session`] |
| 0.34 | a weight-update session lends the KV cache's memory to the update, so less is free beside it | [`patch_chunk_bytes`], [`staging_groups`], [`reload_headroom`] |
| 0.34 | `AutoWeightsLoader` skips a tied alias (`lm_head.weight`) silently instead of raising | [`tied_aliases`], [`unconsumed`] |

This module imports nothing from vLLM, so the tests read it without a vLLM install.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from delta_sync.errors import DeltaSyncError

__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "cuda_devices",
    "end_failed_session",
    "ending_session_on_failure",
    "free_device_bytes",
    "layer_bytes",
    "patch_chunk_bytes",
    "reload_headroom",
    "staging_groups",
    "synchronize_devices",
    "tied_aliases",
    "unconsumed",
    "write_positions",
]

#: The vLLM releases `vllm_ext` is checked against: 0.32 run for real (CPU), 0.34 by its API (CUDA).
SUPPORTED_VLLM = ">=0.32,<0.35"

#: vLLM's own default for one call of its checkpoint patch loader (`max_chunk_bytes`).
DEFAULT_PATCH_CHUNK_BYTES = 512 << 20
#: The smallest chunk asked for: below it the loader's per-call overhead dominates, and a
#: tensor larger than the chunk still loads alone.
MIN_PATCH_CHUNK_BYTES = 16 << 20
#: The share of free device memory one patch chunk may take: the loader holds the NaN-masked
#: chunk, its NaN mask and a converted copy of each tensor at once (about 2.5x the chunk in bf16).
PATCH_CHUNK_SHARE = 0.25
#: vLLM 0.34's own estimate of a layerwise reload's peak, in multiples of its largest layer
#: (`WEIGHT_UPDATE_PEAK_LAYER_FACTOR`).
RELOAD_PEAK_LAYER_FACTOR = 3


class UnsupportedVLLMError(DeltaSyncError):
    """The installed vLLM is outside the range `vllm_ext` supports ([`SUPPORTED_VLLM`])."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release outside [`SUPPORTED_VLLM`], before the server loads anything:
    the extension reaches into vLLM's worker, loaders and routes, which change between
    releases, so an untested one could load weights wrongly without an error.

    Raises:
        UnsupportedVLLMError: The version is outside the range, or not a version at all;
            the message names both.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        raise UnsupportedVLLMError(
            f"delta-sync's vLLM extension cannot read the installed vLLM's version {version!r}; "
            f"it supports vLLM {SUPPORTED_VLLM}"
        ) from None
    # A development build of a supported release (0.34.1.dev3) is that release.
    if not SpecifierSet(SUPPORTED_VLLM).contains(Version(parsed.base_version), prereleases=True):
        raise UnsupportedVLLMError(
            f"delta-sync's vLLM extension supports vLLM {SUPPORTED_VLLM}, but vLLM {version} is installed; "
            f"install a vLLM in that range (pip install 'vllm{SUPPORTED_VLLM}') or a delta-sync release "
            "that supports this one"
        )


# -- the weight-update session -------------------------------------------------------------------


def end_failed_session(worker: Any, *, model_intact: bool) -> None:
    """End a vLLM worker's weight-update session after its `finish_weight_update` raised.

    The receiver has rolled the model back to the version it served (`model_intact`), so the
    session must not stay open: every later `/start_weight_update` would be refused with "a
    weight update is already active". vLLM 0.32 leaves it open; vLLM 0.34 ends it itself only
    in its direct reload mode, and keeps the worker marked as holding incomplete weights
    (`has_incomplete_weight_update()`) until a finish succeeds. Here the session ends as vLLM
    ends it when `update_weights` raises (0.34: `_end_weight_update`, which also returns the
    KV cache lent to the update), and the mark is cleared only when the model is intact: a
    rollback that failed leaves the weights incomplete, and vLLM should say so.
    """
    if getattr(worker, "_weight_update_active", False):
        end = getattr(worker, "_end_weight_update", None)
        if end is not None:  # vLLM 0.34
            end(refresh=False)
        else:  # vLLM 0.32
            worker._weight_update_active = False
            engine = getattr(worker, "weight_transfer_engine", None)
            if engine is not None:
                engine.reset_weight_update_target()
    incomplete = getattr(worker, "_incomplete_weight_updates", None)
    if model_intact and incomplete is not None:
        incomplete.discard(getattr(worker, "_weight_update_is_draft", False))


def ending_session_on_failure(finish: Callable[..., None]) -> Callable[..., None]:
    """`finish` (a worker class's `finish_weight_update`) that ends the session with
    [`end_failed_session`] when it raises, the model intact when the engine's loader says
    its last load ran to its end (the receiver's rollback reload)."""

    @functools.wraps(finish)
    def finish_weight_update(worker: Any, *args: Any, **kwargs: Any) -> None:
        try:
            finish(worker, *args, **kwargs)
        except BaseException:
            loader = getattr(getattr(worker, "weight_transfer_engine", None), "loader", None)
            end_failed_session(worker, model_intact=bool(getattr(loader, "intact", False)))
            raise

    finish_weight_update._ends_session_on_failure = True  # type: ignore[attr-defined]
    return finish_weight_update


# -- device memory -------------------------------------------------------------------------------


def free_device_bytes(device: torch.device | None) -> int | None:
    """Bytes an allocation on `device` can take now: what the driver reports free plus what
    torch's allocator holds unused; None on a device without such a figure (the CPU)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def patch_chunk_bytes(free: int | None) -> int:
    """The `max_chunk_bytes` to give vLLM's checkpoint patch loader, which stages each chunk
    as full checkpoint-shaped NaN-masked tensors on the device: vLLM's default where nothing
    says how much is free (the CPU), else a share of what is free (vLLM 0.34 lends the KV
    cache to the update, and what is left beside it may be far below the default)."""
    if free is None:
        return DEFAULT_PATCH_CHUNK_BYTES
    return max(MIN_PATCH_CHUNK_BYTES, min(DEFAULT_PATCH_CHUNK_BYTES, int(free * PATCH_CHUNK_SHARE)))


def staging_groups(sizes: Mapping[str, int], free: int | None) -> list[list[str]]:
    """Names in `sizes` (bytes each patch stages on the device) in groups of consecutive
    names, each of at most [`PATCH_CHUNK_SHARE`] of `free` bytes (a larger patch alone):
    one group, always at least one, where nothing says how much is free."""
    if free is None:
        return [list(sizes)]
    budget = max(MIN_PATCH_CHUNK_BYTES, int(free * PATCH_CHUNK_SHARE))
    groups: list[list[str]] = [[]]
    held = 0
    for name, size in sizes.items():
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return groups


def reload_headroom(free: int | None, layer_bytes: int) -> str | None:
    """Why a whole-layer reload of layers up to `layer_bytes` may not fit in `free` bytes
    (vLLM materialises each layer on the device before processing it), or None when it
    fits or nothing says how much is free."""
    needed = RELOAD_PEAK_LAYER_FACTOR * layer_bytes
    if free is None or free >= needed:
        return None
    return (
        f"reloading whole layers needs about {needed / 2**30:.2f} GiB of free device memory "
        f"({layer_bytes / 2**30:.2f} GiB for the largest layer reloaded), but {free / 2**30:.2f} GiB "
        "is free; pause generation with the cache cleared, or leave headroom with --gpu-memory-utilization"
    )


def layer_bytes(weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The bytes of the largest layer among `weights` (grouped by the module holding them,
    a decoder layer's index included)."""
    sizes: dict[str, int] = {}
    for name, tensor in weights:
        layer = name.rsplit(".", 2)[0]
        sizes[layer] = sizes.get(layer, 0) + tensor.nbytes
    return max(sizes.values(), default=0)


# -- what a load wrote ---------------------------------------------------------------------------


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the name it is tied to, for every parameter registered under more
    than one name (a tied `lm_head.weight` -> `model.embed_tokens.weight`): vLLM's loaders
    skip the alias (0.32 raised when its canonical name was not loaded with it, 0.34 skips
    silently), so a change sent under the alias must be sent under the canonical name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def unconsumed(sent: Iterable[str], loaded: Iterable[str] | None, runtime_of: Mapping[str, str]) -> list[str]:
    """The checkpoint names sent to `load_weights` whose runtime tensor is not among those it
    reports loaded: vLLM 0.34 skips some names without raising (a tied alias), so a change
    would be lost silently. Names whose runtime tensor is not known (`runtime_of`), and
    loaders that report nothing (`loaded` None), are not judged."""
    if loaded is None:
        return []
    loaded = set(loaded)
    return sorted(name for name in sent if (runtime := runtime_of.get(name)) is not None and runtime not in loaded)


# -- writing on mixed devices --------------------------------------------------------------------


def write_positions(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, offset: int = 0) -> None:
    """Write `values` at `positions` (+ `offset`) of the flat runtime tensor `flat`, each
    operand taken to `flat`'s device first: with `--cpu-offload-gb` a model's plain
    parameters live on the host and on the GPU at once, so the operands staged for one may
    be on the other (CUDA refuses to mix them)."""
    device = flat.device
    index = positions.to(device=device, non_blocking=True).long() + offset
    flat.index_copy_(0, index, values.to(device=device, dtype=flat.dtype, non_blocking=True))


def cuda_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    """The CUDA devices among `devices`, once each, in index order."""
    return sorted({device for device in devices if device.type == "cuda"}, key=lambda d: d.index or 0)


def synchronize_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    """Wait for the queued writes on every CUDA device among `devices` (so that a failed
    write fails the load, which then rolls back); returns those devices."""
    cuda = cuda_devices(devices)
    for device in cuda:
        torch.cuda.current_stream(device).synchronize()
    return cuda

"""Route TRL's vLLM server-mode weight sync through [`DeltaSyncCallback`].

TRL's `GRPOTrainer` (and `RLOOTrainer`) with `use_vllm=True, vllm_mode="server"` build a
`VLLMGeneration` right after `Trainer.__init__` has fired `on_init_end`. Its
`_init_vllm` opens an NCCL communicator to the server (CUDA only), and its
`sync_weights` broadcasts every tensor before each generation. Neither is wanted when
weights travel through a bucket.

A `DeltaSyncCallback` claims its trainer's model in `on_init_end`. The wrapper installed
here on `VLLMGeneration._init_vllm` then, for a claimed model only, connects the HTTP
client without the communicator and replaces that generator's `sync_weights` with the
callback's, so TRL's own gating still decides when to sync (just before a generation,
once per optimizer step) and the callback decides how. Other trainers in the process
are untouched.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from torch import nn

__all__ = ["claim", "claimed_by"]

_claims: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()
_installed = False


def claim(model: nn.Module, owner: object) -> bool:
    """Route the weight sync of the `VLLMGeneration` built for `model` to `owner`.

    `owner` must have `attach_vllm_generation(generation)` and `sync_vllm_weights(generation)`.

    Returns:
        False when TRL's vLLM generation backend is not importable (nothing to route).
    """
    if not _install():
        return False
    _claims[model] = owner
    return True


def claimed_by(model: nn.Module) -> object | None:
    return _claims.get(model)


def _install() -> bool:
    global _installed
    try:
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError:
        return False
    with _install_lock:
        if not _installed:
            VLLMGeneration._init_vllm = _wrap(VLLMGeneration._init_vllm)
            _installed = True
    return True


def _wrap(original: Callable) -> Callable:
    def _init_vllm(generation) -> None:
        owner = _claims.get(generation.model)
        if owner is None or generation.mode != "server":
            return original(generation)
        _connect_without_communicator(generation)
        generation.sync_weights = lambda: owner.sync_vllm_weights(generation)
        owner.attach_vllm_generation(generation)

    _init_vllm.__wrapped__ = original  # type: ignore[attr-defined]
    return _init_vllm


def _connect_without_communicator(generation) -> None:
    """TRL's server-mode setup minus `init_communicator`: the HTTP client that generates."""
    from trl.generation.vllm_client import VLLMClient

    if generation.accelerator.is_main_process:
        base_url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"
        generation.vllm_client = VLLMClient(
            base_url=base_url, group_port=generation.group_port, connection_timeout=generation.server_timeout
        )

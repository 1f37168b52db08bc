"""The one patch of TRL: route its vLLM server-mode weight sync through [`DeltaSyncCallback`].

TRL's `GRPOTrainer` (and `RLOOTrainer`) with `use_vllm=True, vllm_mode="server"` build a
`trl.generation.vllm_generation.VLLMGeneration` right after `Trainer.__init__` has fired
`on_init_end`. Its constructor calls `VLLMGeneration._init_vllm`, which in server mode
opens an NCCL communicator to the server (`VLLMClient.init_communicator`: CUDA only, and a
rendezvous a server following a bucket never joins); its public `sync_weights` then
broadcasts every tensor before each generation. Neither is wanted when weights travel
through a bucket, and TRL has no option to skip the communicator.

What this module touches in TRL, and nothing else:

* `VLLMGeneration._init_vllm`, a private method, is wrapped once per process. For a model
  claimed with [`claim`] in server mode the wrapper does TRL's server-mode set-up minus the
  communicator (it builds the public `VLLMClient` from the generator's public `server_*`
  and `group_port` attributes and stores it as `vllm_client`, as TRL does); for every other
  model, mode or trainer it calls TRL's own method unchanged.
* That client is TRL's own `VLLMClient`, so generation requests and their parsing are
  TRL's. Its constructor refuses to run unless `vllm` is importable, only because
  `init_communicator` needs it; a claimed generator never opens a communicator (nor calls
  `update_named_params`), so the module-level `is_vllm_available` of
  `trl.generation.vllm_client` answers True for the duration of that one constructor call.
  The trainer's environment then needs `requests` (TRL's HTTP client) but not vLLM.
* The claimed generator's public `sync_weights` is replaced by the owner's
  `sync_vllm_weights`, so TRL's own gating still decides when to sync (just before a
  generation, once per optimizer step) and the owner decides how.
* The client's public `session` (the `requests.Session` every call but its `/health` probe
  goes through) gets the owner's `vllm_request_headers()`: the weight-route token of a
  server guarded by `vllm_ext.auth`, which TRL's own calls then carry too (`/server_info`,
  which `GRPOTrainer` reads at construction, is guarded). The constructor's two calls,
  `/health` and `/v1/models`, go out before the headers are set; `vllm_ext.auth` leaves
  both open.

It was written against TRL 1.16 ([`SUPPORTED_TRL`]); [`claim`] refuses any other version
rather than patch a method whose body it has not been checked against. That refusal is the
version check: the `trainer` extra accepts a range of TRL releases (so that installing it
downgrades nobody), and only a trainer that generates through a vLLM server needs the patch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from torch import nn

if TYPE_CHECKING:
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

__all__ = ["SUPPORTED_TRL", "VLLMSyncOwner", "claim"]

#: The TRL releases whose `VLLMGeneration._init_vllm` this patch was checked against.
SUPPORTED_TRL = "==1.16.*"

_claims: weakref.WeakKeyDictionary[nn.Module, VLLMSyncOwner] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()
_installed = False
# Serialises the constructor calls that see TRL's vLLM check answered for them.
_client_lock = threading.Lock()


class VLLMSyncOwner(Protocol):
    """What takes over a claimed `VLLMGeneration`'s weight sync ([`DeltaSyncCallback`] does)."""

    def attach_vllm_generation(self, generation: VLLMGeneration) -> None:
        """Receive the generator once its HTTP client is connected."""

    def sync_vllm_weights(self) -> None:
        """Run by TRL in place of `VLLMGeneration.sync_weights`, right before a generation."""

    def vllm_request_headers(self) -> Mapping[str, str]:
        """Headers for every request of TRL's client to the server (e.g. the token)."""


def claim(model: nn.Module, owner: VLLMSyncOwner) -> None:
    """Route the weight sync of the `VLLMGeneration` that TRL builds for `model` to `owner`.

    Call it before TRL builds its generator (a callback's `on_init_end` is). Other models'
    generators are left to TRL.

    Args:
        model: The trainer's model (the object TRL passes to `VLLMGeneration(model=...)`).
        owner: Gets `attach_vllm_generation(generation)` once connected, replaces the
            generator's `sync_weights` with its `sync_vllm_weights()`, and gives the
            headers of TRL's requests (`vllm_request_headers()`).

    Raises:
        ImportError: The installed TRL is not a release this patch supports.
    """
    _check_trl_version()
    _install()
    _claims[model] = owner


def _check_trl_version() -> None:
    """Refuse a TRL release other than the ones the patch was checked against."""
    import trl

    installed = trl.__version__
    try:
        supported = SpecifierSet(SUPPORTED_TRL).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise ImportError(
            f"delta-sync's vLLM server-mode integration patches TRL's private "
            f"`VLLMGeneration._init_vllm` and supports trl{SUPPORTED_TRL}, but trl {installed} is installed. "
            f"Install a supported release (pip install 'trl{SUPPORTED_TRL}') or a delta-sync release made "
            f"for trl {installed}."
        )


def _install() -> None:
    global _installed
    from trl.generation.vllm_generation import VLLMGeneration

    with _install_lock:
        if not _installed:
            VLLMGeneration._init_vllm = _wrap(VLLMGeneration._init_vllm)
            _installed = True


def _wrap(original: Callable[[VLLMGeneration], None]) -> Callable[[VLLMGeneration], None]:
    def _init_vllm(generation: VLLMGeneration) -> None:
        owner = _claims.get(generation.model)
        if owner is None or generation.mode != "server":
            return original(generation)
        _connect_without_communicator(generation, owner)
        generation.sync_weights = owner.sync_vllm_weights
        owner.attach_vllm_generation(generation)

    _init_vllm.__wrapped__ = original  # type: ignore[attr-defined]
    return _init_vllm


def _connect_without_communicator(generation: VLLMGeneration, owner: VLLMSyncOwner) -> None:
    """TRL's server-mode set-up minus `init_communicator`: the HTTP client that generates,
    sending the owner's headers with every request after its constructor's."""
    if generation.accelerator.is_main_process:
        base_url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"
        client = _generation_client(base_url, generation.group_port, generation.server_timeout)
        client.session.headers.update(owner.vllm_request_headers())
        generation.vllm_client = client


def _generation_client(base_url: str, group_port: int, connection_timeout: float) -> VLLMClient:
    """TRL's `VLLMClient`, built whether or not vLLM is installed in this environment.

    Args:
        base_url: The server's URL.
        group_port: Passed on as TRL does (unused: no communicator is opened).
        connection_timeout: Seconds to wait for the server's `/health`.
    """
    from trl.generation import vllm_client

    with _client_lock, _vllm_reported_available(vllm_client):
        return vllm_client.VLLMClient(base_url=base_url, group_port=group_port, connection_timeout=connection_timeout)


@contextmanager
def _vllm_reported_available(module: ModuleType) -> Iterator[None]:
    """`module.is_vllm_available()` answers True inside the block; the constructor's check only
    guards the NCCL communicator, which a claimed generator never opens."""
    original = module.is_vllm_available
    module.is_vllm_available = lambda min_version=None: True
    try:
        yield
    finally:
        module.is_vllm_available = original

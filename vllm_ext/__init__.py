"""vLLM side of delta-sync.

Start a server that follows a delta-sync bucket:

```bash
VLLM_SERVER_DEV_MODE=1 DELTA_SYNC_ALLOWED_BUCKETS=file:///data/deltas vllm serve MODEL \\
    --worker-extension-cls vllm_ext.DeltaWorkerExtension \\
    --weight-transfer-config '{"backend": "delta"}'
```

Importing this package registers [`DeltaWeightTransferEngine`] with vLLM's
`WeightTransferEngineFactory` by module path (vLLM imports `vllm_ext.engine` only when it
creates the engine), under two backend names: `delta_sync` ([`BACKEND_ALIAS`]), which is
always ours, and `delta` ([`BACKEND`]) unless another extension registered that name
first; then select `{"backend": "delta_sync"}`.

| module | what it holds |
| --- | --- |
| `engine` | [`DeltaWeightTransferEngine`]: the weight-transfer engine, a `Receiver` inside each worker |
| `loader` | `ModelLoader`: writes a version into the served model, in place where it can |
| `worker` | [`DeltaWorkerExtension`]: the worker's `delta_sync_*` RPC methods |
| `compat` | what differs between the supported vLLM releases, decided in one place |
| `auth` | the bearer token on every route but status, health and inference |
| `logs` | where delta-sync's log records go inside a vLLM process |

One import circle is deliberate: `worker` imports `engine` (its RPCs reach the engine),
and the engine, once vLLM has created it inside a worker, imports `worker` to wrap the
worker classes vLLM mixed the extension into (`worker.end_sessions_whose_finish_fails`).
vLLM appends the extension to a worker class's bases at run time, so only then do those
classes exist, and only the engine runs then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.logger import init_logger

from delta_sync.control import ALLOWED_BUCKETS_ENV

if TYPE_CHECKING:
    from .engine import DeltaUpdateInfo, DeltaWeightTransferEngine
    from .worker import DeltaWorkerExtension

__all__ = [
    "ALLOWED_BUCKETS_ENV",
    "BACKEND",
    "BACKEND_ALIAS",
    "DeltaUpdateInfo",
    "DeltaWeightTransferEngine",
    "DeltaWorkerExtension",
]

#: The backend name to select with `--weight-transfer-config '{"backend": "delta"}'`.
BACKEND = "delta"
#: A name no other engine uses: select it when another extension already registered `delta`.
BACKEND_ALIAS = "delta_sync"

_ENGINE = ("vllm_ext.engine", "DeltaWeightTransferEngine")
# Names this package exports from submodules, imported on first access.
_LAZY = {
    "DeltaUpdateInfo": ".engine",
    "DeltaWeightTransferEngine": ".engine",
    "DeltaWorkerExtension": ".worker",
}

logger = init_logger("vllm.delta_sync")


def _register_engine() -> None:
    """Register the engine under both names; vLLM refuses a name twice with a `ValueError`."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_ALIAS, *_ENGINE)
    except ValueError as error:
        raise RuntimeError(
            f"another weight-transfer engine is already registered with vLLM as {BACKEND_ALIAS!r}, "
            f"the name reserved for delta-sync's {_ENGINE[0]}.{_ENGINE[1]}; remove the extension "
            "that registers it"
        ) from error
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, *_ENGINE)
    except ValueError:
        logger.warning(
            "delta-sync: another weight-transfer engine is already registered as %r; select delta-sync's "
            'with --weight-transfer-config \'{"backend": "%s"}\'',
            BACKEND,
            BACKEND_ALIAS,
        )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


_register_engine()

"""vLLM side of delta-sync.

Start a server that follows a delta-sync bucket:

```bash
VLLM_SERVER_DEV_MODE=1 DELTA_SYNC_ALLOWED_BUCKETS=file:///data/deltas vllm serve MODEL \\
    --worker-extension-cls vllm_ext.DeltaWorkerExtension \\
    --weight-transfer-config '{"backend": "delta"}'
```

Importing this package registers [`DeltaWeightTransferEngine`] with vLLM's
`WeightTransferEngineFactory` under the name `delta`.
"""

from __future__ import annotations

import logging

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from .engine import ALLOWED_BUCKETS_ENV, DeltaUpdateInfo, DeltaWeightTransferEngine
from .worker import DeltaWorkerExtension

__all__ = ["ALLOWED_BUCKETS_ENV", "BACKEND", "DeltaUpdateInfo", "DeltaWeightTransferEngine", "DeltaWorkerExtension"]

BACKEND = "delta"

if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, DeltaWeightTransferEngine)
elif WeightTransferEngineFactory._registry[BACKEND]() is not DeltaWeightTransferEngine:
    raise RuntimeError(f"another weight-transfer engine is already registered as {BACKEND!r}")

# delta_sync logs through the standard logging module; inside a vLLM process only
# vLLM's own logger tree has handlers, so route ours through it.
_library_logger = logging.getLogger("delta_sync")
if not _library_logger.handlers:
    _library_logger.handlers = list(logging.getLogger("vllm").handlers)
    _library_logger.setLevel(logging.INFO)
    _library_logger.propagate = False

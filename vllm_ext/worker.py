"""`DeltaWorkerExtension`: the class named by `vllm serve --worker-extension-cls`."""

from __future__ import annotations

import dataclasses
from typing import Any

from delta_sync.control import ReplicaStatus

from .engine import DeltaWeightTransferEngine

__all__ = ["DeltaWorkerExtension"]


class DeltaWorkerExtension:
    """Mixed into every vLLM worker. Importing it registers the `delta` weight-transfer engine.

    Its methods are reachable through `POST /collective_rpc` (server started with
    `VLLM_SERVER_DEV_MODE=1`); their names carry a `delta_sync_` prefix so they never
    shadow a `Worker` attribute.

    Example:
        ```bash
        curl -X POST localhost:8000/collective_rpc -d '{"method": "delta_sync_status"}'
        # {"results": [{"version": 12, "model_checksum": "3f0c...", ...}]}
        ```
    """

    def delta_sync_snapshot(self) -> dict[str, Any]:
        """Where this worker's bf16 snapshot lives: `shared_path` and `shared_bytes` of the
        machine's node snapshot (one per machine, mapped by every worker), and
        `private_bytes`, what this worker holds on its own (0 when it shares the node's).
        """
        return dataclasses.asdict(self._delta_engine().receiver.memory())

    def delta_sync_status(self) -> dict[str, Any]:
        """The version this worker serves and a checksum of its weights
        (`delta_sync.control.STATUS_METHOD`).

        Returns:
            A `delta_sync.control.ReplicaStatus` as a dict: `version`, `anchor_version`,
            `run_id`, `model_checksum` (digest of the held bf16 weights, comparable with the
            trainer's `PublishReport.model_checksum` and `latest.json`), `pending`
            (parameters applied but not yet loaded, which `/finish_weight_update` loads) and
            `updating` (a weight-update session is open).
        """
        engine = self._delta_engine()
        receiver = engine.receiver
        pending = receiver.pending
        # What the model serves: while an update is prepared, the snapshot is ahead of it.
        served = receiver.serving
        return ReplicaStatus.of(
            served,
            pending=len(pending.names) if pending is not None else 0,
            updating=engine.updating,
            prepared_version=receiver.prepared_version,
        ).to_dict()

    def delta_sync_prefetch(self, bucket: str | None = None) -> dict[str, Any]:
        """Prepare the newest version of `bucket` (and of every bucket watched) in the
        snapshot now, on the engine's prefetch thread, while the server keeps generating.
        Returns at once: the worker's status (`prepared_version` moves once the version is
        ready: poll `delta_sync_status`) and `prefetching`, whether this worker prepares
        versions ahead at all (not with `DELTA_SYNC_PREFETCH=off` or a private snapshot).

        Args:
            bucket: A bucket URL to watch from now on; it must be on the allow list.
        """
        engine = self._delta_engine()
        engine.hint(bucket)
        return {"prefetching": engine.prefetcher is not None, **self.delta_sync_status()}

    def _delta_engine(self) -> DeltaWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltaWeightTransferEngine):
            raise RuntimeError(
                "the delta weight-transfer engine is not active; start vLLM with "
                '--weight-transfer-config \'{"backend": "delta"}\''
            )
        return engine

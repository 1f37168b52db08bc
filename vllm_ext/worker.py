"""`DeltaWorkerExtension`: the class named by `vllm serve --worker-extension-cls`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from delta_sync.control import ReplicaStatus

from .compat import ending_session_on_failure
from .engine import DeltaWeightTransferEngine

__all__ = ["DeltaWorkerExtension", "end_sessions_whose_finish_fails"]


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
            (parameters applied but not yet loaded, which `/finish_weight_update` loads),
            `updating` (a weight-update session is open), `prepared_version`,
            `pointer_age_s` (how old the bucket's newest `latest.json` it accepted is) and
            `stale` (older than `DELTA_SYNC_MAX_STALENESS`).
        """
        engine = self._delta_engine()
        receiver = engine.receiver
        pending = receiver.pending
        # What the model serves: while an update is prepared, the snapshot is ahead of it.
        served = receiver.serving
        freshness = receiver.freshness()
        return ReplicaStatus.of(
            served,
            pending=len(pending.names) if pending is not None else 0,
            updating=engine.updating,
            prepared_version=receiver.prepared_version,
            pointer_age_s=None if freshness.age is None else round(freshness.age, 3),
            stale=freshness.stale,
        ).to_dict()

    def delta_sync_prefetch(self, bucket: str | None = None) -> dict[str, Any]:
        """Prepare the newest version of `bucket` (and of every bucket watched) in the
        snapshot now, on the engine's prefetch thread, while the server keeps generating.
        Returns at once: the worker's status (`prepared_version` moves once the version is
        ready: poll `delta_sync_status`); `prefetching`, whether this worker prepares
        versions ahead at all (not with `DELTA_SYNC_PREFETCH=off` or a private snapshot);
        and the CPUs the prefetch thread and this worker's compute thread run on
        (`prefetch_cpus`, `compute_cpus`; None where unknown).

        Args:
            bucket: A bucket URL to watch from now on; it must be on the allow list.
        """
        engine = self._delta_engine()
        engine.hint(bucket)
        prefetcher = engine.prefetcher
        return {
            "prefetching": prefetcher is not None,
            "prefetch_cpus": None if prefetcher is None else prefetcher.running_on,
            # RPCs run on the worker's main thread, which computes the model.
            "compute_cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            **self.delta_sync_status(),
        }

    def delta_sync_fetch_adapter(self, bucket: str, version: int | None = None) -> dict[str, Any]:
        """Fetch an adapter version (adapter mode) of `bucket` into this worker's download
        cache (`delta_sync.control.FETCH_ADAPTER_METHOD`), checked like every version.

        Args:
            bucket: A bucket URL on the allow list.
            version: The version; None: the one its `latest.json` names.

        Returns:
            A `delta_sync.control.AdapterStatus` as a dict: `version`, `run_id`, `epoch`,
            `path` (the directory to pass to `/v1/load_lora_adapter`) and `model_checksum`.
        """
        return self._delta_engine().fetch_adapter(bucket, version)

    def _delta_engine(self) -> DeltaWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltaWeightTransferEngine):
            raise RuntimeError(
                "the delta weight-transfer engine is not active; start vLLM with "
                '--weight-transfer-config \'{"backend": "delta"}\''
            )
        return engine


def end_sessions_whose_finish_fails() -> None:
    """Make the vLLM worker classes that mix in [`DeltaWorkerExtension`] end their
    weight-update session when `finish_weight_update` raises, as they do when
    `update_weights` raises.

    When the engine's finish raises, the receiver has rolled the model back to what it
    served; but vLLM 0.32's `Worker.finish_weight_update` leaves the session open, so every
    later `/start_weight_update` would be refused with "a weight update is already active"
    until someone posted `/finish_weight_update` again, and vLLM 0.34's also keeps the worker
    marked as holding incomplete weights (see `vllm_ext.compat.end_failed_session`).
    Called by the engine once vLLM has mixed the extension in; wraps each class once.
    """
    for worker_class in _subclasses(DeltaWorkerExtension):
        finish = getattr(worker_class, "finish_weight_update", None)
        if finish is None or getattr(finish, "_ends_session_on_failure", False):
            continue
        worker_class.finish_weight_update = ending_session_on_failure(finish)


def _subclasses(cls: type) -> Iterator[type]:
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)

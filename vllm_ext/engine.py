"""`DeltaWeightTransferEngine`: vLLM's weight-transfer engine for delta-sync buckets.

Registered with vLLM under the backend name `delta`. Select it with
`--weight-transfer-config '{"backend": "delta"}'`; the trainer then drives
`/start_weight_update`, `/update_weights` with
`{"update_info": {"bucket": URL, "filename": PATH}}` and `/finish_weight_update`.

The engine is thin: a `delta_sync.Receiver` downloads, verifies and applies each file to
a local bf16 snapshot while the server keeps generating; only `finish_weight_update`
touches the model, loading every changed tensor through vLLM's layerwise-reload
lifecycle (the CPU backend repacks linear layers after loading, so a plain
`load_weights` into them fails). A file that fails any check leaves both the snapshot
and the served weights untouched.

This module imports nothing from TRL or transformers' training stack: the server runs in
its own environment with vLLM's pins.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from delta_sync import Receiver
from delta_sync.errors import DeltaSyncError

__all__ = ["ALLOWED_BUCKETS_ENV", "DeltaInitInfo", "DeltaUpdateInfo", "DeltaWeightTransferEngine"]

logger = init_logger("vllm.delta_sync")

#: Comma-separated bucket URLs (or local directories) the server may load weights from;
#: `*` trusts any bucket. Unset, every update is refused.
ALLOWED_BUCKETS_ENV = "DELTA_SYNC_ALLOWED_BUCKETS"


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: replicas pull files from the bucket themselves."""


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    """The `update_info` of `/update_weights`.

    Args:
        bucket: Bucket URL (`file://...`, an absolute path, `hf://buckets/...`, `s3://...`),
            or a Hugging Face bucket id `namespace/name`.
        filename: Path of an anchor or delta inside the bucket; None catches up to the
            bucket's `latest.json`.
        repo_id: Alias of `bucket`, as the published TRL client sends it.
    """

    bucket: str | None = None
    filename: str | None = None
    repo_id: str | None = None

    def __post_init__(self) -> None:
        if self.bucket is None:
            self.bucket = self.repo_id
        elif self.repo_id is not None and self.repo_id != self.bucket:
            raise ValueError(f"update_info names two buckets: bucket={self.bucket!r}, repo_id={self.repo_id!r}")
        if not self.bucket:
            raise ValueError("update_info needs 'bucket' (or its alias 'repo_id')")
        if _HF_BUCKET_ID.fullmatch(self.bucket):
            # A bare `namespace/name`, as the published TRL client sends: a Hugging Face bucket.
            self.bucket = f"hf://buckets/{self.bucket}"


_HF_BUCKET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """Applies delta-sync anchors and deltas inside a vLLM worker."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = Receiver(
            load_weights=self._stage,
            expected_shapes=checkpoint_shapes(str(self.model_config.model)),
            allowed_buckets=allowed_buckets_from_env(),
        )
        # Parameters whose new values sit in the snapshot but not yet in the model.
        self._staged: set[str] = set()
        self._fused = fused_shards(model)

    # -- WeightTransferEngine ---------------------------------------------------------------

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        # Downloads and checks run while the server keeps generating; the model is only
        # touched in finish_weight_update.
        return None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator, which fails on CPU; nothing here is async.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        try:
            result = self.receiver.update(update_info.bucket, update_info.filename)
        except DeltaSyncError as exc:
            raise RuntimeError(f"delta-sync refused the update: {type(exc).__name__}: {exc}") from exc
        if result.noop:
            logger.info("delta-sync: already at version %s", result.version)
        else:
            logger.info(
                "delta-sync: now at version %s after %d file(s), %d changed elements, %.3f s",
                result.version,
                len(result.applied),
                result.changed_elements,
                result.seconds,
            )

    def finish_weight_update(self) -> None:
        if not self._staged:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        names = self._with_fused_shards(self._staged)
        weights = self.receiver.weights
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights((name, weights[name]) for name in sorted(names))
        except BaseException as exc:
            self.receiver.invalidate(f"loading {len(names)} tensor(s) into the model failed: {exc}")
            raise
        finally:
            # Always leave the model runnable: a half-finished reload crashes the next request.
            finalize_layerwise_reload(self.model, self.model_config)
        self._staged.clear()
        logger.info("delta-sync: loaded %d tensor(s); serving version %s", len(names), self.receiver.version)

    def shutdown(self) -> None:
        return None

    # -- helpers ----------------------------------------------------------------------------

    def _stage(self, weights: list[tuple[str, Any]]) -> None:
        self._staged.update(name for name, _ in weights)

    def _with_fused_shards(self, names: set[str]) -> set[str]:
        """Add the sibling shards of fused modules: vLLM rebuilds a fused layer (qkv,
        gate_up) from all its shards, and fills absent ones with uninitialised memory."""
        complete = set(names)
        held = self.receiver.weights
        for name in names:
            parts = name.split(".")
            for i, part in enumerate(parts):
                for sibling in self._fused.get(part, ()):
                    candidate = ".".join([*parts[:i], sibling, *parts[i + 1 :]])
                    if candidate in held:
                        complete.add(candidate)
        return complete

    @property
    def staged(self) -> frozenset[str]:
        """Parameters applied to the snapshot but not yet loaded into the model."""
        return frozenset(self._staged)


def allowed_buckets_from_env() -> list[str] | None:
    """The allow list from `DELTA_SYNC_ALLOWED_BUCKETS`: None for `*`, empty when unset."""
    raw = os.environ.get(ALLOWED_BUCKETS_ENV, "").strip()
    if raw == "*":
        logger.warning("delta-sync: %s='*': weights will be loaded from any bucket", ALLOWED_BUCKETS_ENV)
        return None
    buckets = [item.strip() for item in raw.split(",") if item.strip()]
    if not buckets:
        logger.warning("delta-sync: %s is not set; every weight update will be refused", ALLOWED_BUCKETS_ENV)
    return buckets


def fused_shards(model) -> dict[str, tuple[str, ...]]:
    """Checkpoint module name -> all shards of the fused vLLM module it belongs to."""
    mapping = getattr(type(model), "packed_modules_mapping", None) or getattr(model, "packed_modules_mapping", {})
    return {shard: tuple(shards) for shards in mapping.values() for shard in shards}


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape, read from the served checkpoint's safetensors headers.

    These are exactly the names `load_weights` accepts. Returns None when the checkpoint
    is not a local directory (the first anchor then defines the parameter set).
    """
    directory = Path(model)
    if not directory.is_dir():
        directory = _cached_snapshot(model)
        if directory is None:
            logger.warning("delta-sync: cannot read %s's checkpoint; anchors are not checked against it", model)
            return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(glob.glob(str(directory / "*.safetensors"))):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes or None


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.safetensors"]))
    except Exception:  # not a Hub id, or not in the local cache
        return None

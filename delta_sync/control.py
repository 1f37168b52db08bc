"""The control plane: everything the trainer and a vLLM replica say to each other.

Weights travel through the bucket; the only messages are small HTTP requests to vLLM's
dev-mode routes (`VLLM_SERVER_DEV_MODE=1`). Both sides import this module, and nothing
else spells a route, a field, an RPC method or an environment variable of the contract.

| step | route | body |
| --- | --- | --- |
| 1 | [`Route.START`] | none |
| 2 | [`Route.UPDATE`] | `{"update_info": UpdateInfo.to_dict()}`: the replica downloads and verifies |
| 3 | [`Route.PAUSE`] `?mode=keep` | none (optional: hold requests while tensors load) |
| 4 | [`Route.FINISH`] | none: the replica loads the new tensors |
| 5 | [`Route.RESET_PREFIX_CACHE`], [`Route.RESUME`] | none |
| 6 | [`Route.COLLECTIVE_RPC`] | `{"method": STATUS_METHOD}`: each worker's [`ReplicaStatus`] |

Example:
    ```python
    >>> info = UpdateInfo.from_dict({"repo_id": "me/deltas", "filename": "deltas/step_00000002.safetensors"})
    >>> info.bucket
    'hf://buckets/me/deltas'
    ```
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["ALLOWED_BUCKETS_ENV", "STATUS_METHOD", "ReplicaStatus", "Route", "UpdateInfo"]

#: Comma-separated bucket URLs (or local directories) a vLLM server may load weights from;
#: `*` trusts any bucket. Unset, every update is refused.
ALLOWED_BUCKETS_ENV = "DELTA_SYNC_ALLOWED_BUCKETS"

#: The worker-extension method `/collective_rpc` calls for a [`ReplicaStatus`].
STATUS_METHOD = "delta_sync_status"

# A bare `namespace/name`, as the published TRL client sends in `repo_id`: a Hugging Face bucket.
_HF_BUCKET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class Route:
    """vLLM's weight-update routes, as the trainer calls them."""

    START = "/start_weight_update"
    UPDATE = "/update_weights"
    FINISH = "/finish_weight_update"
    PAUSE = "/pause"
    RESUME = "/resume"
    RESET_PREFIX_CACHE = "/reset_prefix_cache"
    COLLECTIVE_RPC = "/collective_rpc"


@dataclass(frozen=True)
class UpdateInfo:
    """The `update_info` of `/update_weights`: which file of which bucket to apply.

    Args:
        bucket: Bucket URL (`file://...`, an absolute path, `hf://buckets/...`, `s3://...`).
            A bare `namespace/name` is read as the Hugging Face bucket `hf://buckets/namespace/name`.
        filename: Path of an anchor or delta inside the bucket; None catches up to the
            bucket's `latest.json`.
    """

    bucket: str
    filename: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ValueError(f"update_info 'bucket' must be a non-empty string, got {self.bucket!r}")
        if self.filename is not None and not isinstance(self.filename, str):
            raise ValueError(f"update_info 'filename' must be a string, got {self.filename!r}")
        if _HF_BUCKET_ID.fullmatch(self.bucket):
            object.__setattr__(self, "bucket", f"hf://buckets/{self.bucket}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UpdateInfo:
        """Parse a request's `update_info`, accepting `repo_id` as an alias of `bucket`.

        Raises:
            ValueError: An unknown key, a missing or conflicting bucket, or a value of the
                wrong type; the message names the field.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"update_info must be a JSON object, got {type(data).__name__}")
        known = {"bucket", "repo_id", "filename"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"update_info has unknown key(s) {unknown}; known: {sorted(known)}")
        bucket, repo_id = data.get("bucket"), data.get("repo_id")
        if bucket is not None and repo_id is not None and bucket != repo_id:
            raise ValueError(f"update_info names two buckets: bucket={bucket!r}, repo_id={repo_id!r}")
        if bucket is None and repo_id is None:
            raise ValueError("update_info needs 'bucket' (or its alias 'repo_id')")
        return cls(bucket=bucket if bucket is not None else repo_id, filename=data.get("filename"))

    def to_dict(self) -> dict[str, str]:
        """The JSON body's `update_info`; `filename` only when set."""
        return {"bucket": self.bucket} if self.filename is None else {"bucket": self.bucket, "filename": self.filename}


@dataclass(frozen=True)
class ReplicaStatus:
    """What one vLLM worker reports through `/collective_rpc` [`STATUS_METHOD`].

    Args:
        version: The version the worker serves, or None before its first update.
        anchor_version: The anchor that version descends from.
        run_id: The training run the weights belong to.
        model_checksum: Digest of the served bf16 weights; equal to the trainer's
            `PublishReport.model_checksum` and `latest.json`'s when the weights are identical.
        pending: Parameters applied to the snapshot but not yet loaded into the model
            (what `/finish_weight_update` loads).
        updating: A weight-update session is open (started, not yet finished or failed).
    """

    version: int | None = None
    anchor_version: int | None = None
    run_id: str | None = None
    model_checksum: str | None = None
    pending: int = 0
    updating: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ReplicaStatus:
        """Parse one worker's answer.

        Raises:
            ValueError: Not an object, or a field is missing or of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a replica status must be a JSON object, got {data!r}")
        types = {
            "version": (int, type(None)),
            "anchor_version": (int, type(None)),
            "run_id": (str, type(None)),
            "model_checksum": (str, type(None)),
            "pending": (int,),
            "updating": (bool,),
        }
        values = {}
        for spec in fields(cls):
            if spec.name not in data:
                raise ValueError(f"replica status lacks {spec.name!r}: {dict(data)!r}")
            value = data[spec.name]
            if not isinstance(value, types[spec.name]) or (isinstance(value, bool) and bool not in types[spec.name]):
                raise ValueError(f"replica status field {spec.name!r} has the wrong type: {value!r}")
            values[spec.name] = value
        return cls(**values)

    @property
    def served(self) -> tuple[int | None, str | None, str | None]:
        """`(version, run_id, model_checksum)`: what must agree across a server's workers."""
        return self.version, self.run_id, self.model_checksum

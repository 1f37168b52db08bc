"""The control plane: everything the trainer and a vLLM replica say to each other.

Weights travel through the bucket; the only messages are small HTTP requests to vLLM's
dev-mode routes (`VLLM_SERVER_DEV_MODE=1`). Both sides import this package, and nothing
else spells a route, a field, an RPC method or an environment variable of the contract.
Its `client` module holds [`Replica`], the HTTP client that drives one server through
these routes (the trainer's `ReplicaSet` and `delta-sync follow` both use it).

| step | route | body |
| --- | --- | --- |
| 1 | [`Route.START`] | none |
| 2 | [`Route.UPDATE`] | `{"update_info": UpdateInfo.to_dict()}`: the replica downloads and verifies |
| 3 | [`Route.PAUSE`] `?mode=keep` | none (optional: hold requests while tensors load) |
| 4 | [`Route.FINISH`] | none: the replica loads the new tensors |
| 5 | [`Route.RESET_PREFIX_CACHE`], [`Route.RESUME`] | none |
| 6 | [`Route.COLLECTIVE_RPC`] | `{"method": STATUS_METHOD}`: each worker's [`ReplicaStatus`] |

TRL's delta clients are accepted as they send: `repo_id` for the bucket, and
`update_kind` / `is_checkpoint_format` describing the file (see [`UpdateInfo.from_dict`]).

Example:
    ```python
    >>> info = UpdateInfo.from_dict({"repo_id": "me/deltas", "filename": "deltas/step_00000002.safetensors"})
    >>> info.bucket
    'hf://buckets/me/deltas'
    >>> anchor = {"repo_id": "me/deltas", "filename": "anchors/step_00000001.safetensors", "update_kind": "dense"}
    >>> UpdateInfo.from_dict(anchor).kind
    'anchor'
    ```
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..errors import ApplyError
from ..version import HeldVersion, VersionId

__all__ = [
    "ALLOWED_BUCKETS_ENV",
    "API_TOKEN_ENV",
    "FETCH_ADAPTER_METHOD",
    "LOAD_LORA_ROUTE",
    "MODELS_ROUTE",
    "AdapterStatus",
    "PREFETCH_ENV",
    "PREFETCH_METHOD",
    "STATUS_METHOD",
    "TOKEN_HEADER",
    "ReplicaStatus",
    "Route",
    "UpdateInfo",
]

#: Comma-separated bucket URLs (or local directories) a vLLM server may load weights from;
#: `*` trusts any bucket. Unset, every update is refused.
ALLOWED_BUCKETS_ENV = "DELTA_SYNC_ALLOWED_BUCKETS"

#: Directory of the node snapshots every vLLM worker of a machine shares (one bf16 copy of
#: the model per machine); default `snapshots` in the download cache, `none` for a private
#: snapshot per worker.
SNAPSHOT_DIR_ENV = "DELTA_SYNC_SNAPSHOT_DIR"

#: The token a server's `vllm_ext.auth` middleware requires on the weight routes; the
#: trainer's client and `delta-sync follow` read it from the same variable by default.
API_TOKEN_ENV = "DELTA_SYNC_API_TOKEN"

#: The header that carries it (`Authorization` stays free for a proxy in front of vLLM,
#: e.g. a private Space's Hugging Face token).
TOKEN_HEADER = "X-Delta-Sync-Token"

#: The worker-extension method `/collective_rpc` calls for a [`ReplicaStatus`].
STATUS_METHOD = "delta_sync_status"

#: The worker-extension method that hints a replica to prepare a bucket's newest version
#: now (`{"method": PREFETCH_METHOD, "kwargs": {"bucket": URL}}`); it returns at once.
PREFETCH_METHOD = "delta_sync_prefetch"

#: Seconds between a vLLM worker's polls of the buckets it prefetches from (default 2);
#: `off` (or 0) prepares versions only when an update asks for them.
PREFETCH_ENV = "DELTA_SYNC_PREFETCH"

# A bare `namespace/name`, as the published TRL client sends in `repo_id`: a Hugging Face bucket.
_HF_BUCKET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# TRL's later delta branches say what they upload in `update_kind` (vLLM's own names): a
# full checkpoint ("dense") is our anchor, a sparse patch ("sparse_flat") our delta.
_UPDATE_KINDS: dict[str, Literal["anchor", "delta"]] = {"dense": "anchor", "sparse_flat": "delta"}
_WIRE_KINDS = {kind: wire for wire, kind in _UPDATE_KINDS.items()}
_KEYS = ("bucket", "repo_id", "filename", "update_kind", "is_checkpoint_format")


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
        kind: What the sender says `filename` is (`"anchor"` or `"delta"`), as TRL's clients
            tell it in `update_kind`; None when it does not say. Our files say what they are
            in their metadata, and a replica refuses a file that contradicts the sender
            ([`check_kind`]).
    """

    bucket: str
    filename: str | None = None
    kind: Literal["anchor", "delta"] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ValueError(f"update_info 'bucket' must be a non-empty string, got {self.bucket!r}")
        if self.filename is not None and not isinstance(self.filename, str):
            raise ValueError(f"update_info 'filename' must be a string, got {self.filename!r}")
        if self.kind not in (None, *_WIRE_KINDS):
            raise ValueError(f"UpdateInfo kind must be 'anchor', 'delta' or None, got {self.kind!r}")
        if self.kind is not None and self.filename is None:
            # A catch-up applies whatever latest.json needs: anchors and deltas alike.
            raise ValueError(
                f"update_info 'update_kind' ({_WIRE_KINDS[self.kind]!r}) describes the file named by 'filename', "
                "but there is no 'filename' (a catch-up to latest.json)"
            )
        if _HF_BUCKET_ID.fullmatch(self.bucket):
            object.__setattr__(self, "bucket", f"hf://buckets/{self.bucket}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UpdateInfo:
        """Parse a request's `update_info` as delta-sync's trainer and TRL's clients send it.

        Keys (a JSON null is the same as an absent key):

        - `bucket`, or its alias `repo_id` (TRL's name for it).
        - `filename`.
        - `update_kind` (TRL's later delta branches): `"dense"` says the file is an anchor,
          `"sparse_flat"` a delta; kept as [`kind`].
        - `is_checkpoint_format` (TRL's first delta branch, from vLLM's update info): `true`,
          weights keyed and shaped as in the checkpoint, is what every anchor and delta is.
          `false` announces weights already in vLLM's kernel layout, which no delta-sync file
          holds, and is refused.

        Raises:
            ValueError: An unknown key, a missing or conflicting bucket, or a value of the
                wrong type or not understood; the message names the key (and the value).

        Example:
            ```python
            >>> UpdateInfo.from_dict({"bucket": "s3://b/run", "filename": "deltas/step_00000003.safetensors"})
            UpdateInfo(bucket='s3://b/run', filename='deltas/step_00000003.safetensors', kind=None)
            ```
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"update_info must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise ValueError(f"update_info has unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        bucket, repo_id = data.get("bucket"), data.get("repo_id")
        if bucket is not None and repo_id is not None and bucket != repo_id:
            raise ValueError(f"update_info names two buckets: bucket={bucket!r}, repo_id={repo_id!r}")
        if bucket is None and repo_id is None:
            raise ValueError("update_info needs 'bucket' (or its alias 'repo_id')")
        _check_checkpoint_format(data.get("is_checkpoint_format"))
        return cls(
            bucket=bucket if bucket is not None else repo_id,
            filename=data.get("filename"),
            kind=_parse_update_kind(data.get("update_kind")),
        )

    def to_dict(self) -> dict[str, str]:
        """The JSON body's `update_info`; `filename` and `update_kind` only when set."""
        data = {"bucket": self.bucket}
        if self.filename is not None:
            data["filename"] = self.filename
        if self.kind is not None:
            data["update_kind"] = _WIRE_KINDS[self.kind]
        return data

    def check_kind(self, kind: str, *, source: str) -> None:
        """Refuse a file whose own kind (its metadata's) is not the one the sender announced.

        Args:
            kind: The file's kind, `"anchor"` or `"delta"` (`FileHeader.kind`).
            source: The file, for the message.

        Raises:
            ApplyError: The sender said `update_kind` was the other kind.
        """
        if self.kind is not None and kind != self.kind:
            raise ApplyError(
                f"{source} is {_a(kind)}, but update_info 'update_kind' is {_WIRE_KINDS[self.kind]!r} ({_a(self.kind)})"
            )


def _parse_update_kind(value: Any) -> Literal["anchor", "delta"] | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in _UPDATE_KINDS:
        understood = ", ".join(f"{wire!r} ({_a(kind)})" for wire, kind in _UPDATE_KINDS.items())
        raise ValueError(f"update_info 'update_kind' is {value!r}; understood: {understood}")
    return _UPDATE_KINDS[value]


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "anchor" else f"a {kind}"


def _check_checkpoint_format(value: Any) -> None:
    if value is None or value is True:
        return
    if value is False:
        raise ValueError(
            "update_info 'is_checkpoint_format' is False (weights already in vLLM's kernel layout), but "
            "delta-sync files always hold checkpoint-format tensors, loaded through vLLM's layerwise reload; "
            "send True or leave it out"
        )
    raise ValueError(f"update_info 'is_checkpoint_format' must be a boolean, got {value!r}")


@dataclass(frozen=True)
class ReplicaStatus:
    """What one vLLM worker reports through `/collective_rpc` [`STATUS_METHOD`].

    On the wire it is a flat JSON object: `version`, `anchor_version`, `run_id` (null
    before the first update), `epoch` (only when the version has one), `model_checksum`,
    `pending`, `updating`, `prepared_version`, `pointer_age_s`, `stale`.

    Args:
        held: The version the worker serves, or None before its first update.
        model_checksum: Digest of the served bf16 weights; equal to the trainer's
            `PublishReport.model_checksum` and `latest.json`'s when the weights are identical.
        pending: Parameters applied to the snapshot but not yet loaded into the model
            (what `/finish_weight_update` loads).
        updating: A weight-update session is open (started, not yet finished or failed).
        prepared_version: The newest version the worker's snapshot holds, ready to load
            without a download (ahead of `version` once a prefetch prepared the next one);
            None before it holds any (or from a server that does not say).
        pointer_age_s: Seconds since the trainer wrote the newest `latest.json` the worker
            accepted (None before it read one, or from a server that does not say).
        stale: The pointer is older than the worker's `DELTA_SYNC_MAX_STALENESS`: the
            trainer stopped, or the pointer is held back; the worker is not healthy.
    """

    held: VersionId | None = None
    model_checksum: str | None = None
    pending: int = 0
    updating: bool = False
    prepared_version: int | None = None
    pointer_age_s: float | None = None
    stale: bool = False

    @classmethod
    def of(
        cls,
        served: HeldVersion | None,
        *,
        pending: int = 0,
        updating: bool = False,
        prepared_version: int | None = None,
        pointer_age_s: float | None = None,
        stale: bool = False,
    ) -> ReplicaStatus:
        """The status of a worker whose model serves `served`."""
        held, checksum = (None, None) if served is None else (served.id, served.model_checksum)
        return cls(held, checksum, pending, updating, prepared_version, pointer_age_s, stale)

    @property
    def version(self) -> int | None:
        return None if self.held is None else self.held.version

    @property
    def anchor_version(self) -> int | None:
        return None if self.held is None else self.held.anchor_version

    @property
    def run_id(self) -> str | None:
        return None if self.held is None else self.held.run_id

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": None, "anchor_version": None, "run_id": None}
        if self.held is not None:
            data.update(asdict(self.held))
            if not self.held.epoch:
                del data["epoch"]
        data.update(model_checksum=self.model_checksum, pending=self.pending, updating=self.updating)
        data.update(prepared_version=self.prepared_version, pointer_age_s=self.pointer_age_s, stale=self.stale)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ReplicaStatus:
        """Parse one worker's answer.

        Raises:
            ValueError: Not an object, or a field is missing or of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a replica status must be a JSON object, got {data!r}")
        values = {key: _status_field(data, key, kinds) for key, kinds in _STATUS_FIELDS.items()}
        epoch = _status_field(data, "epoch", (str,)) if "epoch" in data else ""
        # Servers before prefetching did not report it.
        prepared = _status_field(data, "prepared_version", (int, type(None))) if "prepared_version" in data else None
        # Servers before signed freshness did not report these.
        age = _status_field(data, "pointer_age_s", (int, float, type(None))) if "pointer_age_s" in data else None
        stale = _status_field(data, "stale", (bool,)) if "stale" in data else False
        held = None
        if values["version"] is not None:
            if values["anchor_version"] is None or values["run_id"] is None:
                raise ValueError(f"replica status has a version but no anchor_version or run_id: {dict(data)!r}")
            held = VersionId(values["version"], values["anchor_version"], values["run_id"], epoch)
        return cls(held, values["model_checksum"], values["pending"], values["updating"], prepared, age, stale)

    @property
    def served(self) -> tuple[int | None, str | None, str | None]:
        """`(version, run_id, model_checksum)`: what must agree across a server's workers."""
        return self.version, self.run_id, self.model_checksum


_STATUS_FIELDS: dict[str, tuple[type, ...]] = {
    "version": (int, type(None)),
    "anchor_version": (int, type(None)),
    "run_id": (str, type(None)),
    "model_checksum": (str, type(None)),
    "pending": (int,),
    "updating": (bool,),
}


def _status_field(data: Mapping[str, Any], key: str, kinds: tuple[type, ...]) -> Any:
    if key not in data:
        raise ValueError(f"replica status lacks {key!r}: {dict(data)!r}")
    value = data[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"replica status field {key!r} has the wrong type: {value!r}")
    return value


# -- adapter mode: a PEFT LoRA adapter per version, loaded through vLLM's LoRA support ----------

#: The worker-extension method that fetches an adapter version into the download cache
#: (`{"method": FETCH_ADAPTER_METHOD, "kwargs": {"bucket": URL, "version": N or None}}`):
#: each worker answers an [`AdapterStatus`] of the local directory.
FETCH_ADAPTER_METHOD = "delta_sync_fetch_adapter"

#: vLLM's routes that load an adapter under a name (`{"lora_name", "lora_path",
#: "load_inplace"}`, needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) and list what it serves.
LOAD_LORA_ROUTE = "/v1/load_lora_adapter"
MODELS_ROUTE = "/v1/models"

# A fetched adapter version's directory ends `<run_id>/<epoch>/step_<version>` (see
# [`AdapterStatus.local_name`]), so the path vLLM reports for a loaded adapter (`/v1/models`'
# `root`) says which version of which run it is.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class AdapterStatus:
    """An adapter version on a replica: fetched into `path`, or loaded from it.

    Args:
        version: The version.
        run_id: Its run.
        epoch: Its run's start ("" for none).
        path: The local directory vLLM loads it from.
        model_checksum: SHA-256 of its `adapter_model.safetensors` (what `latest.json`
            records for an adapter version); None when only the path is known.
    """

    version: int
    run_id: str
    epoch: str
    path: str
    model_checksum: str | None = None

    @staticmethod
    def local_name(run_id: str, epoch: str, version: int) -> str:
        """The last three components of the directory a version of a run is fetched into."""
        return f"{_UNSAFE.sub('_', run_id) or '_'}/{_UNSAFE.sub('_', epoch) or '_'}/step_{version:08d}"

    @staticmethod
    def is_version(path: str, run_id: str, epoch: str, version: int) -> bool:
        """Whether `path` (a loaded adapter's, from `/v1/models`) is the directory of that version."""
        return path.rstrip("/").endswith("/" + AdapterStatus.local_name(run_id, epoch, version))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> AdapterStatus:
        """Parse a worker's answer, strictly.

        Raises:
            ValueError: Not an adapter status (the message names the field).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an adapter status object, got {data!r}")
        kinds = {"version": int, "run_id": str, "epoch": str, "path": str, "model_checksum": str}
        for key, kind in kinds.items():
            if type(data.get(key)) is not kind:
                raise ValueError(f"adapter status field {key!r} must be {kind.__name__}, got {data.get(key)!r}")
        return cls(**{key: data[key] for key in kinds})

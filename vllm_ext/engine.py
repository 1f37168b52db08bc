"""`DeltaWeightTransferEngine`: vLLM's weight-transfer engine for delta-sync buckets.

Registered with vLLM under the backend name `delta`. Select it with
`--weight-transfer-config '{"backend": "delta"}'`; the trainer then drives
`/start_weight_update`, `/update_weights` with
`{"update_info": {"bucket": URL, "filename": PATH}}` and `/finish_weight_update`
(see `delta_sync.control`; TRL's delta clients' `repo_id` and `update_kind` are accepted).

The engine only maps vLLM's session onto a `delta_sync.Receiver`'s lifecycle:

| vLLM | receiver |
| --- | --- |
| `start_weight_update` | open a session |
| `update_weights` (one or more) | `receiver.prepare(bucket, filename, kind=update_kind)`: download, verify, apply to the snapshot |
| `finish_weight_update` | `receiver.commit(pending, load)`: load the changed tensors into the model |

vLLM runs all three inside its engine loop, so nothing generates while they run: the
engine's prefetch thread ([`make_prefetcher`]) downloads, checks and applies new versions
to the node snapshot beforehand, while the server generates, and `update_weights` then
finds them prepared. Only `finish_weight_update` touches the model, through
[`vllm_ext.loader.ModelLoader`]: the changed elements where vLLM keeps plain tensors,
whole layers through vLLM's layerwise-reload lifecycle where it does not (the CPU backend
repacks linear layers after loading, so a plain `load_weights` into them fails). A session is all
or nothing: if any `update_weights` fails, the files of the whole session are undone
and the model keeps serving what it served.

This module imports nothing from TRL or transformers' training stack: the server runs in
its own environment with vLLM's pins.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from delta_sync.control import ALLOWED_BUCKETS_ENV, PREFETCH_ENV, SNAPSHOT_DIR_ENV, UpdateInfo
from delta_sync.errors import DeltaSyncError
from delta_sync.replica.compiled import load_compiled_passes
from delta_sync.replica.prefetch import Prefetcher
from delta_sync.replica.receiver import Receiver
from delta_sync.replica.shared import NodeStore
from delta_sync.storage.cache import default_cache_dir

from .compat import check_vllm_version
from .loader import ModelLoader, packed_modules
from .logs import route_delta_sync_logs

__all__ = ["DeltaInitInfo", "DeltaUpdateInfo", "DeltaWeightTransferEngine"]

logger = init_logger("vllm.delta_sync")


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: replicas pull files from the bucket themselves."""


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    """The `update_info` of `/update_weights`, as vLLM's typed update info.

    Parsed and checked by `delta_sync.control.UpdateInfo`, the contract the trainer side
    shares: `repo_id` is an alias of `bucket`, a bare `namespace/name` is a Hugging
    Face bucket, and TRL's `update_kind` becomes `kind`.

    Args:
        bucket: Bucket URL (`file://...`, an absolute path, `hf://buckets/...`, `s3://...`),
            or a Hugging Face bucket id `namespace/name`.
        filename: Path of an anchor or delta inside the bucket; None catches up to the
            bucket's `latest.json`.
        repo_id: Alias of `bucket`, as the published TRL client sends it.
        kind: What the sender says `filename` is (`"anchor"` or `"delta"`), or None.
    """

    bucket: str | None = None
    filename: str | None = None
    repo_id: InitVar[str | None] = None
    kind: str | None = None

    def __post_init__(self, repo_id: str | None) -> None:
        info = UpdateInfo.from_dict({"bucket": self.bucket, "repo_id": repo_id, "filename": self.filename})
        info = dataclasses.replace(info, kind=self.kind)
        self.bucket, self.filename = info.bucket, info.filename

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeltaUpdateInfo:
        """Parse a request's `update_info` (see `delta_sync.control.UpdateInfo.from_dict`).

        Raises:
            ValueError: An unknown key, a missing or conflicting bucket, or a value of the
                wrong type or not understood; the message names the key.
        """
        info = UpdateInfo.from_dict(data)
        return cls(bucket=info.bucket, filename=info.filename, kind=info.kind)


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """Applies delta-sync anchors and deltas inside a vLLM worker.

    The receiver trusts only the buckets listed in `DELTA_SYNC_ALLOWED_BUCKETS` and checks
    anchors against the served checkpoint's parameter names and shapes.
    """

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        import vllm

        # Before anything is loaded: an untested vLLM could load weights wrongly, silently.
        check_vllm_version(vllm.__version__)
        super().__init__(config, vllm_config, device, model)
        route_delta_sync_logs()
        self._fused = fused_shards(model)
        self._updating = False
        allowed = allowed_buckets_from_env()
        self.receiver = make_receiver(
            checkpoint_shapes(str(self.model_config.model)),
            allowed_buckets=allowed,
            load_together=self._with_fused_shards,
        )
        # Before the server serves: loading them later would stall generation (see the module).
        logger.info("delta-sync: compiled passes ready in %.2f s", load_compiled_passes())
        self.prefetcher = make_prefetcher(self.receiver, allowed or [])
        self.loader = ModelLoader(model, self.model_config, shapes=self.receiver.expected_shapes)
        shapes = self.receiver.expected_shapes
        self._experts = expert_groups(shapes) if shapes is not None else None
        from .worker import end_sessions_whose_finish_fails  # a circle, why: vllm_ext's docstring

        end_sessions_whose_finish_fails()

    @property
    def updating(self) -> bool:
        """A weight-update session is open (started, not yet finished or failed)."""
        return self._updating

    # -- WeightTransferEngine ---------------------------------------------------------------

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        if self.receiver.pending is not None:
            # Only if vLLM dropped a session without telling the engine: start clean.
            logger.warning("delta-sync: discarding an update left open by an earlier session")
            self.receiver.pending.abort()
        self._updating = True

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaUpdateInfo:
        return DeltaUpdateInfo.from_dict(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: it synchronizes an accelerator, which fails on CPU, and
        # nothing here is asynchronous.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM ends the session when update_weights raises and never calls
            # finish_weight_update for it, so the session's files are undone here.
            self._abort_session()
            raise

    def hint(self, bucket: str | None) -> None:
        """Prepare `bucket`'s newest version (and the watched buckets') now, off the engine
        loop; returns at once. Without a prefetcher (`DELTA_SYNC_PREFETCH=off`, or a private
        snapshot) the next update prepares inline."""
        opened = None if bucket is None else self.receiver.check_bucket(bucket)
        if self.prefetcher is not None:
            self.prefetcher.hint(opened)

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        try:
            # Opened once per request: an S3 or Hub bucket opens a client of its own.
            bucket = self.receiver.check_bucket(update_info.bucket)
            if self.prefetcher is not None:
                self.prefetcher.watch(bucket)
            pending = self.receiver.prepare(bucket, update_info.filename, kind=update_info.kind)
        except DeltaSyncError as exc:
            raise RuntimeError(f"delta-sync refused the update: {type(exc).__name__}: {exc}") from exc
        step = pending.last
        if not pending.names:
            logger.info("delta-sync: already at version %s", step.version)
        elif step.applied:
            # Inside vLLM's engine loop, so nothing generated meanwhile: a prefetch would
            # have prepared it while the server kept generating.
            logger.info(
                "delta-sync: prepared version %s inline from %d file(s) (not prefetched); %d tensor(s) to load",
                step.version,
                len(step.applied),
                len(pending.names),
            )
        else:
            logger.info(
                "delta-sync: version %s is prepared in the node snapshot; %d tensor(s) to load",
                step.version,
                len(pending.names),
            )

    def finish_weight_update(self) -> None:
        pending, self._updating = self.receiver.pending, False
        if pending is None:
            return
        result = pending.commit(self.loader)
        if not result.noop:
            logger.info(
                "delta-sync: loaded %d tensor(s) in %.3f s; serving version %s",
                result.loaded_tensors,
                result.seconds,
                result.version,
            )

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()

    # -- LoRA adapters (adapter mode) -------------------------------------------------------

    def fetch_adapter(self, bucket: str, version: int | None = None) -> dict[str, Any]:
        """Fetch an adapter version of `bucket` into the download cache, checked as the
        receiver checks versions (`delta_sync.replica.adapter.AdapterFetcher`); returns an
        `AdapterStatus` dict whose `path` vLLM's `/v1/load_lora_adapter` then loads."""
        from delta_sync.replica.adapter import AdapterFetcher

        fetcher = self.__dict__.get("_adapter_fetcher")
        if fetcher is None:
            fetcher = self._adapter_fetcher = AdapterFetcher(self.receiver)
        try:
            return fetcher.fetch(bucket, version).to_dict()
        except DeltaSyncError as exc:
            raise RuntimeError(f"delta-sync refused the adapter: {type(exc).__name__}: {exc}") from exc

    # -- helpers ----------------------------------------------------------------------------

    def _abort_session(self) -> None:
        pending, self._updating = self.receiver.pending, False
        if pending is not None:
            pending.abort()
            logger.warning("delta-sync: update session aborted; still serving version %s", self.receiver.version)

    def _with_fused_shards(self, names: set[str]) -> set[str]:
        """Add the sibling shards of fused modules reloaded whole: vLLM rebuilds such a
        layer (qkv, gate_up; a MoE layer from every expert's tensors) from all its shards,
        and fills absent ones with uninitialised memory. A shard written where it lives
        needs none."""
        complete = set(names)
        held = self.receiver.expected_shapes or self.receiver.weights
        writable = self.loader.writable()
        experts = None  # MoE layer -> its experts' tensors, found once per call
        for name in names - writable.keys():
            parts = name.split(".")
            for i, part in enumerate(parts):
                for sibling in self._fused.get(part, ()):
                    candidate = ".".join([*parts[:i], sibling, *parts[i + 1 :]])
                    if candidate in held:
                        complete.add(candidate)
            if (group := expert_group(name)) is not None:
                if experts is None:  # without checkpoint shapes: the experts held now
                    experts = self._experts if self._experts is not None else expert_groups(held)
                complete.update(experts.get(group, ()))
        return complete


def make_receiver(shapes: dict[str, tuple[int, ...]] | None, **kwargs) -> Receiver:
    """The worker's receiver: sharing the node snapshot under `DELTA_SYNC_SNAPSHOT_DIR`
    (default: `snapshots` in the download cache) with every worker of the machine, or a
    private snapshot when that is `none` or the checkpoint's shapes are unknown."""
    root = snapshot_root_from_env()
    if root is None or shapes is None:
        if root is not None:
            logger.warning("delta-sync: the checkpoint's shapes are unknown; this worker keeps a private snapshot")
        return Receiver(expected_shapes=shapes, **kwargs)
    return Receiver(store=NodeStore(root), expected_shapes=shapes, **kwargs)


def make_prefetcher(receiver: Receiver, buckets: list[str]) -> Prefetcher | None:
    """The worker's prefetcher (`DELTA_SYNC_PREFETCH`: seconds between polls, default 2;
    `off` or 0 for none), watching the allow list's buckets; None for a private snapshot,
    which is the model's own copy and cannot run ahead of it."""
    raw = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if raw in ("off", "0", "none", "false"):
        logger.info("delta-sync: %s=%s: versions are prepared when an update asks for them", PREFETCH_ENV, raw)
        return None
    if not receiver.store.shared:
        logger.info("delta-sync: a private snapshot cannot be prepared ahead of the model: no prefetching")
        return None
    try:
        interval = float(raw) if raw else 2.0
    except ValueError:
        raise ValueError(f"{PREFETCH_ENV} must be a number of seconds or 'off', got {raw!r}") from None
    spare = spare_cpus()
    prefetcher = Prefetcher(receiver, interval=interval, cpus=spare)
    if spare is not None:
        logger.info(
            "delta-sync: the prefetch thread runs on CPU(s) %s, which this worker's compute threads leave free",
            ",".join(map(str, sorted(spare))),
        )
    for bucket in buckets:
        try:
            prefetcher.watch(bucket)
        except DeltaSyncError as exc:  # a prefix of many buckets, or a store this server cannot open
            logger.info("delta-sync: not prefetching from %s: %s", bucket, exc)
    prefetcher.start()
    return prefetcher


def spare_cpus() -> set[int] | None:
    """The CPUs this server may use that no worker computes on, for the prefetch thread;
    None where there are none, or no way to tell. Call it on the worker's main thread.

    vLLM's CPU backend binds each worker's OpenMP threads to cores of their own
    (`VLLM_CPU_OMP_THREADS_BIND`: `auto` by default) and leaves the rest to its scheduler
    and API server. A thread inherits its creator's cores, so a prefetch thread started by
    the worker would share the cores every token is computed on: measured on two cores,
    preparing a version then stalled generation for 22-26 times the median gap between
    tokens, 4-8 times in most runs on the spare core (docs/benchmarks.md).
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        computing = os.sched_getaffinity(0)
        # What the server was started with: the worker's parent (vLLM's engine process) is
        # not bound, while the worker binds itself as it starts.
        available = os.sched_getaffinity(os.getppid())
    except OSError:
        return None
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    for part in bound.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            computing |= set(range(int(first), int(last or first) + 1))  # every worker's
    return (available - computing) or None


def snapshot_root_from_env() -> Path | None:
    """Where node snapshots live (`DELTA_SYNC_SNAPSHOT_DIR`), or None for private ones."""
    raw = os.environ.get(SNAPSHOT_DIR_ENV, "").strip()
    if raw.lower() == "none":
        return None
    return Path(raw) if raw else default_cache_dir() / "snapshots"


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


#: A checkpoint tensor of a MoE layer's experts: one expert's, `<layer>.experts.<index>.<rest>`
#: (Qwen3-MoE's `mlp.experts.3.up_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`),
#: or every expert's at once, `<layer>.experts.<tensor>` (gpt-oss's `mlp.experts.gate_up_proj`
#: and `mlp.experts.gate_up_proj_bias`) or GraniteMoE's `block_sparse_moe.input_linear.weight`
#: and `output_linear.weight`.
_EXPERT = re.compile(r"(.+\.experts)\.(?:\d+\.|[A-Za-z_]+$)|(.+\.block_sparse_moe)\.(?:input|output)_linear\.weight$")


def expert_group(name: str) -> str | None:
    """The MoE layer a checkpoint tensor of its experts belongs to (`...mlp.experts`), or None."""
    match = _EXPERT.match(name)
    return (match.group(1) or match.group(2)) if match else None


def expert_groups(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """MoE layer -> the checkpoint tensors of all its experts, among `names`."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if (group := expert_group(name)) is not None:
            groups.setdefault(group, []).append(name)
    return {group: tuple(members) for group, members in groups.items()}


def fused_shards(model) -> dict[str, tuple[str, ...]]:
    """Checkpoint module name -> all shards of the fused vLLM module it belongs to."""
    return {shard: tuple(shards) for shards in packed_modules(model).values() for shard in shards}


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
        with safe_open(path, framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    return shapes or None


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.safetensors"]))
    except Exception:  # not a Hub id, or not in the local cache
        return None

"""`Receiver`: the replica side. Holds a bf16 snapshot and applies anchors and deltas to it.

An update has the lifecycle of vLLM's weight-transfer engines (start, update, finish):

1. [`Receiver.prepare`] downloads a file (or catches up to `latest.json`), checks it and
   applies it to the snapshot, returning the open [`PendingUpdate`]; the model is not
   touched, and further `prepare` calls extend the same update.
2. [`PendingUpdate.commit`] hands every changed tensor to `load_weights` once, rolling the
   snapshot back if that fails; [`PendingUpdate.abort`] undoes the snapshot changes instead.

[`Receiver.update`] does both. The receiver is framework-free: `load_weights` takes
`list[tuple[name, tensor]]` and can be vLLM's `model.load_weights`, or
[`module_weight_loader`] for a plain `torch.nn.Module`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..control import ALLOWED_BUCKETS_ENV
from ..errors import (
    ApplyError,
    BaseVersionError,
    BucketFileNotFoundError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    SignatureError,
    UntrustedBucketError,
)
from ..format import Anchor, Delta, FileHeader, read_file
from ..integrity import model_checksum, updated_checksum
from ..layout import LATEST, Latest, is_manifest, is_part, parse_step_path, version_files
from ..manifest import MAX_MANIFEST_BYTES, Manifest, PartRecord, read_version
from ..parallel import parallel_map
from ..signing import SIGNATURE_SUFFIX, VERIFY_KEY_ENV, FileSignature, VerifyKey, file_sha256
from ..sparse import gather, scatter_
from ..storage import Bucket, clean_path, open_bucket
from ..storage.cache import DownloadCache

__all__ = [
    "ApplyResult",
    "Held",
    "LoadWeights",
    "PendingUpdate",
    "Receiver",
    "SnapshotMemory",
    "expected_shapes_of",
    "module_weight_loader",
]

logger = logging.getLogger("delta_sync")

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]


def module_weight_loader(module: nn.Module) -> LoadWeights:
    """A `load_weights` callable that copies tensors into a module's parameters by name.

    The callable also carries the module's parameter shapes (`expected_shapes`), which a
    [`Receiver`] given no `expected_shapes` of its own checks anchors against.

    Example:
        ```python
        >>> replica = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        >>> receiver = Receiver(load_weights=module_weight_loader(replica))
        ```
    """
    params = dict(module.named_parameters())

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        # Check every tensor before copying any, so a mismatch never half-loads the module.
        for name, tensor in weights:
            if name not in params or params[name].shape != tensor.shape:
                shape = None if name not in params else list(params[name].shape)
                raise ApplyError(f"cannot load {name!r} of shape {list(tensor.shape)} into the module ({shape})")
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    load_weights.expected_shapes = expected_shapes_of(module)  # type: ignore[attr-defined]
    return load_weights


@dataclass(frozen=True)
class Held:
    """A version as a receiver holds it.

    Args:
        version: The version, or None.
        anchor_version: The anchor it descends from.
        run_id: The run it belongs to.
        model_checksum: Digest of its bf16 weights.
    """

    version: int | None
    anchor_version: int | None
    run_id: str | None
    model_checksum: str | None


@dataclass(frozen=True)
class SnapshotMemory:
    """Where a receiver's snapshot lives, and what this process holds of it.

    Args:
        shared_path: The node snapshot's file, or None for a private snapshot.
        shared_bytes: Size of that file (one copy per machine, however many map it).
        private_bytes: Bytes of the snapshot this process holds as its own copy: a private
            snapshot's tensors, or copy-on-write pages of the shared file (none while it is
            mapped shared, as it is).
        resident_bytes: Pages of the shared file resident in this process's mapping.
        proportional_bytes: This process's share of them (the kernel's PSS: pages mapped by
            `n` processes count `1/n`), so the shares of a machine's workers add up to
            what the machine holds.
    """

    shared_path: str | None
    shared_bytes: int
    private_bytes: int
    resident_bytes: int = 0
    proportional_bytes: int = 0


@dataclass(frozen=True)
class ApplyResult:
    """What a receiver did for one request.

    Args:
        version: The version held afterwards.
        applied: Sources of the files applied, in order (empty for a no-op).
        changed_elements: Elements changed in total.
        loaded_tensors: Tensors handed to `load_weights`.
        seconds: Wall time, download included.
    """

    version: int | None
    applied: tuple[str, ...]
    changed_elements: int
    loaded_tensors: int
    seconds: float

    @property
    def noop(self) -> bool:
        return not self.applied


@dataclass
class _DeltaUndo:
    """What undoes one delta on the snapshot: O(changed elements).

    Args:
        previous: Parameter name -> (indices, values there before the delta).
        checksums: Checksums of those parameters before the delta.
        version: The version held before the delta.
        anchor_version: The anchor version held before the delta.
    """

    previous: dict[str, tuple[torch.Tensor, torch.Tensor]]
    checksums: dict[str, int]
    version: int | None
    anchor_version: int | None


class PendingUpdate:
    """Files applied to a [`Receiver`]'s snapshot but not yet loaded into the model.

    [`Receiver.prepare`] returns it; end it with exactly one call of [`commit`] (load the
    changed tensors) or [`abort`] (undo the snapshot changes). While it is open the
    receiver's `version`, `weights` and `checksums` already describe the prepared version,
    and further `prepare` calls on the receiver extend this same update.

    Undoing a delta costs O(changed elements): its old values are kept. An anchor replaces
    every tensor and is not undone (that would take a second full copy of the model), so
    aborting an update that holds an anchor leaves the receiver with no trustworthy
    version: its next update loads an anchor.

    Example:
        ```python
        >>> pending = receiver.prepare("./deltas", "deltas/step_00000007.safetensors")
        >>> pending.version, len(pending.names)
        (7, 12)
        >>> pending.commit()  # or pending.abort()
        ```
    """

    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver
        self._names: set[str] = set()
        self._applied: list[str] = []
        self._changed_elements = 0
        self._undo: list[_DeltaUndo] = []
        self._anchored = False
        self._state = "open"
        self._started = time.perf_counter()

    @property
    def names(self) -> frozenset[str]:
        """Parameters changed so far: what [`commit`] loads."""
        return frozenset(self._names)

    @property
    def applied(self) -> tuple[str, ...]:
        """Sources of the files applied so far, in order."""
        return tuple(self._applied)

    @property
    def version(self) -> int | None:
        """The version the snapshot holds now."""
        return self._receiver.version

    @property
    def is_open(self) -> bool:
        """Neither committed nor aborted yet."""
        return self._state == "open"

    def commit(self, load_weights: LoadWeights | None = None) -> ApplyResult:
        """Hand every changed tensor to `load_weights`, in one call.

        If loading fails, the snapshot goes back to where it was before the first
        `prepare` and the old tensors are loaded again; if that fails too, or the update
        held an anchor, the receiver's next update loads an anchor.

        Args:
            load_weights: Receives `[(name, full bf16 tensor), ...]`; the receiver's own
                `load_weights` when None.

        Returns:
            What was applied; `seconds` counts from the first `prepare`.

        Raises:
            RuntimeError: The update was already committed or aborted.
        """
        receiver = self._receiver
        with receiver._lock:
            self._close("committed")
            load = load_weights if load_weights is not None else receiver.load_weights
            names = sorted(self._names)
            try:
                receiver._load(load, names)
            except BaseException:
                receiver._roll_back_pending(self, load, names)
                raise
            seconds = time.perf_counter() - self._started
            return ApplyResult(receiver.version, self.applied, self._changed_elements, len(names), seconds)

    def abort(self) -> None:
        """Undo every change to the snapshot; the model is not touched.

        Raises:
            RuntimeError: The update was already committed or aborted.
        """
        receiver = self._receiver
        with receiver._lock:
            self._close("aborted")
            receiver._abort_pending(self)

    # -- used by the receiver -----------------------------------------------------------

    def _record(self, source: str, names: Iterable[str], changed_elements: int, undo: _DeltaUndo | None) -> None:
        """Note one file about to be applied; `undo` is None for an anchor."""
        if undo is None:
            # Nothing before an anchor can be restored once it overwrote every tensor.
            self._anchored = True
            self._undo.clear()
        else:
            self._undo.append(undo)
        self._names.update(names)
        self._applied.append(source)
        self._changed_elements += changed_elements

    def _close(self, state: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"this pending update was already {self._state}")
        self._state = state
        self._receiver._pending = None

    def _undo_deltas(self) -> None:
        while self._undo:
            self._receiver._restore(self._undo.pop())


class Receiver:
    """Applies anchors and deltas to a local bf16 snapshot, all or nothing.

    An update follows the lifecycle of vLLM's weight-transfer engines: [`prepare`]
    downloads files, checks them and applies them to the snapshot, returning a
    [`PendingUpdate`]; its `commit` hands the changed tensors to `load_weights` (rolling the
    snapshot back if that fails) and its `abort` undoes the snapshot changes. [`update`]
    does both.

    Before anything changes, every file is checked: [`read_file`] and `Anchor.verify`
    decide that the file is intact; the receiver checks that its parameters and shapes are
    the held ones, that a delta's base version and base checksums are those held, and that
    the result reproduces the trainer's per-parameter and model checksums (O(changed
    elements) for a delta). A file that fails any check raises a [`DeltaSyncError`] subclass
    and changes nothing; after a checksum mismatch the next catch-up starts from an anchor.

    Args:
        load_weights: Receives `[(name, full bf16 tensor), ...]` for every parameter an
            update changed. None to keep the snapshot only.
        expected_shapes: Parameter name -> shape the model expects. When given, anchors must
            hold exactly these parameters; otherwise the first anchor defines them.
        allowed_buckets: Bucket URL prefixes this receiver may load from; None allows any.
        cache: Where downloads go; a default [`DownloadCache`] when None.
        verify_key: Apply only versions signed by the trainer's key (a
            `delta_sync.signing.VerifyKey`, or the path or PEM text of its public key);
            default: the key `DELTA_SYNC_VERIFY_KEY` names, else the bucket is trusted as is
            (said once in the log).
        load_together: Maps the names an update changed to every name `load_weights`
            must receive with them (vLLM rebuilds a fused qkv or gate_up layer from all its
            shards); None loads exactly the changed ones.

    Example:
        ```python
        >>> receiver = Receiver(load_weights=module_weight_loader(replica))
        >>> receiver.update("./deltas")  # catch up to latest.json
        >>> receiver.update("./deltas", "deltas/step_00000007.safetensors")
        >>> receiver.version, receiver.model_checksum
        (7, '3f0c...')
        ```
    """

    def __init__(
        self,
        *,
        load_weights: LoadWeights | None = None,
        expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
        allowed_buckets: Iterable[str] | None = None,
        cache: DownloadCache | None = None,
        verify_key: VerifyKey | str | os.PathLike | None = None,
        load_together: Callable[[set[str]], set[str]] | None = None,
    ) -> None:
        self.load_weights = load_weights
        self.load_together = load_together
        if expected_shapes is None:
            expected_shapes = getattr(load_weights, "expected_shapes", None)
        self.expected_shapes = None if expected_shapes is None else {k: tuple(v) for k, v in expected_shapes.items()}
        if verify_key is None:
            verify_key = VerifyKey.from_env()
        elif not isinstance(verify_key, VerifyKey):
            verify_key = VerifyKey.load(verify_key)
        self.verify_key: VerifyKey | None = verify_key
        if verify_key is None:
            _warn_unsigned_once()
        self.allowed_buckets = None if allowed_buckets is None else [_normalise_url(u) for u in allowed_buckets]
        self.cache = cache or DownloadCache()
        self.weights: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, int] = {}
        self.version: int | None = None
        self.anchor_version: int | None = None
        self.run_id: str | None = None
        self.epoch: str | None = None
        # Why the next update must load an anchor (the model and the snapshot may differ), or None.
        self._anchor_needed: str | None = None
        self._pending: PendingUpdate | None = None
        self._serving = Held(None, None, None, None)
        self._lock = threading.RLock()

    @property
    def model_checksum(self) -> str | None:
        """Digest of the held weights (see `delta_sync.integrity.model_checksum`), or None."""
        return model_checksum(self.checksums) if self.checksums else None

    def memory(self) -> SnapshotMemory:
        """Where the snapshot lives: here, all in this process."""
        return SnapshotMemory(None, 0, sum(t.numel() * t.element_size() for t in self.weights.values()))

    @property
    def pending(self) -> PendingUpdate | None:
        """The update prepared and not yet committed or aborted, if any."""
        return self._pending

    def invalidate(self, reason: str) -> None:
        """Declare the model out of step with the snapshot: deltas are refused until the
        next catch-up loads an anchor (a `SharedReceiver` reloads every tensor instead).

        Args:
            reason: What happened, for the log and for the error a refused delta raises.
        """
        with self._lock:
            logger.warning("delta-sync: %s", reason)
            self._model_diverged(reason)

    # -- the lifecycle ----------------------------------------------------------------------

    def prepare(self, bucket: Bucket | str | os.PathLike, filename: str | None = None) -> PendingUpdate:
        """Download, check and apply to the snapshot one file from `bucket`, or catch up to
        its `latest.json` when `filename` is None; load nothing into the model.

        A catch-up applies the deltas from the held version when they chain, else the
        newest anchor at or before `latest.json`'s version and the deltas after it. While
        the returned update is open, further calls extend it (a vLLM session may send
        several `/update_weights`); its `commit` loads the union of what they changed.

        Args:
            bucket: The bucket (or its URL) the trainer publishes to.
            filename: Path of an anchor or delta inside the bucket.

        Returns:
            The open [`PendingUpdate`] (the same object until it is committed or aborted).

        Raises:
            DeltaSyncError: The bucket is not allowed, the path escapes it, a file is
                missing, malformed, unsigned (with a verify key) or newer than the bucket's
                `latest.json`, or it cannot be applied. A call that opened the update
                aborts it (all or nothing); files applied by earlier calls stay in
                [`pending`] for the caller to commit or abort.

        Example:
            ```python
            >>> pending = receiver.prepare("./deltas", "deltas/step_00000007.safetensors")
            >>> pending = receiver.prepare("./deltas", "deltas/step_00000008.safetensors")
            >>> [path.rsplit("/", 1)[-1] for path in pending.commit().applied]
            ['step_00000007.safetensors', 'step_00000008.safetensors']
            ```
        """
        opened = self.check_bucket(bucket)
        path = None if filename is None else clean_path(filename)
        with self._lock:
            opened_here = self._pending is None
            pending = self._open_pending() if opened_here else self._pending
            try:
                latest = self._advance(opened, path, pending)
            except BaseException:
                if opened_here:
                    pending.abort()  # all or nothing: a failed catch-up leaves the replica where it was
                raise
            self._prune_cache(opened, latest)
            return pending

    def update(self, bucket: Bucket | str | os.PathLike, filename: str | None = None) -> ApplyResult:
        """Apply and load one file from `bucket`, or catch up to its `latest.json` when
        `filename` is None: [`prepare`], then `commit`.

        Args:
            bucket: The bucket (or its URL) the trainer publishes to.
            filename: Path of an anchor or delta inside the bucket.

        Raises:
            DeltaSyncError: The bucket is not allowed, the path escapes it, a file is
                missing or malformed, or it cannot be applied. Nothing was applied: the
                model and, unless an anchor had already replaced it, the snapshot are as
                they were.
            RuntimeError: An update prepared earlier is still open.
        """
        started = time.perf_counter()
        with self._lock:
            self._refuse_if_pending("update")
            pending = self.prepare(bucket, filename)
            result = pending.commit()
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    def apply(self, file: Anchor | Delta) -> ApplyResult:
        """Apply and load an already read anchor or delta (see [`read_file`]).

        Re-applying the version held, or an older one of the same run, is a no-op.

        Raises:
            DeltaSyncError: The file cannot be applied; nothing changed.
            RuntimeError: An update prepared earlier is still open.
        """
        with self._lock:
            self._refuse_if_pending("apply")
            pending = self._open_pending()
            try:
                self._prepare_file(file, pending)
            except BaseException:
                pending.abort()
                raise
            return pending.commit()

    def check_bucket(self, bucket: Bucket | str | os.PathLike) -> Bucket:
        """Open `bucket`, refusing it unless it is on the allow list."""
        opened = open_bucket(bucket)
        if self.allowed_buckets is not None:
            url = _normalise_url(opened.url)
            if not self.allowed_buckets:
                raise UntrustedBucketError(
                    f"bucket {opened.url} refused: this receiver trusts no bucket yet "
                    f"(for a vLLM server, set {ALLOWED_BUCKETS_ENV})"
                )
            if not any(url == allowed or url.startswith(allowed + "/") for allowed in self.allowed_buckets):
                raise UntrustedBucketError(
                    f"bucket {opened.url} is not on this receiver's allow list {self.allowed_buckets}"
                )
        return opened

    def _advance(self, bucket: Bucket, path: str | None, pending: PendingUpdate) -> Latest:
        """Apply `path`, or catch up to `latest.json`, to the snapshot; returns `latest.json`."""
        latest = self._read_latest(bucket)
        self._follow(latest)
        if path is None:
            self._catch_up(bucket, pending, latest)
        else:
            self._prepare_path(bucket, path, pending, latest)
        return latest

    def _open_pending(self) -> PendingUpdate:
        self._serving = self._held()
        self._pending = PendingUpdate(self)
        return self._pending

    def _held(self) -> Held:
        return Held(self.version, self.anchor_version, self.run_id, self.model_checksum)

    @property
    def serving(self) -> Held:
        """What the model holds: the version last committed. While an update is prepared
        and not yet committed, the snapshot is ahead of the model, and this still names
        what the model serves (what a replica reports)."""
        with self._lock:
            return self._serving if self._pending is not None else self._held()

    def _refuse_if_pending(self, method: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"an update prepared earlier is still open; commit or abort it before {method}()")

    def _read_latest(self, bucket: Bucket) -> Latest:
        source = f"{bucket.url}/{LATEST}"
        return Latest.from_json(bucket.read_bytes(LATEST), source=source, verify_key=self.verify_key)

    def _follow(self, latest: Latest) -> None:
        """Notice when what is held is not on the bucket's trajectory: another run, an
        abandoned start of this one, a version past the bucket's pointer, or the pointer's
        version with other weights. Only an anchor of the bucket's may then replace it."""
        if self.version is None:
            return
        if latest.run_id != self.run_id:
            problem = f"the bucket moved on to another run ({latest.run_id})"
        elif not latest.owns(self.version, self.epoch or ""):
            problem = f"the bucket moved on to a restart of the run (epoch {latest.epoch or '-'})"
        elif self.version > latest.version:
            problem = f"version {self.version} is held, but the bucket's latest.json names {latest.version}"
        elif self.version == latest.version and self.model_checksum != latest.model_checksum:
            problem = f"version {self.version} is held with other weights than the bucket's latest.json names"
        else:
            return
        logger.warning("delta-sync: %s; the next update loads an anchor", problem)
        self._distrust(problem)

    # -- finding the files --------------------------------------------------------------------

    def _catch_up(self, bucket: Bucket, pending: PendingUpdate, latest: Latest) -> None:
        """Reach the version `latest.json` names; starts over once if a file disappears
        under it (retention)."""
        try:
            self._catch_up_once(bucket, pending, latest)
        except BucketFileNotFoundError as exc:
            # What was applied so far was checked; go on from there with the newer pointer.
            logger.warning("delta-sync: %s; continuing the catch-up from latest.json", exc)
            self._catch_up_once(bucket, pending, self._read_latest(bucket))

    def _catch_up_once(self, bucket: Bucket, pending: PendingUpdate, latest: Latest) -> None:
        if self._is_stale(latest.version, latest.run_id, latest.epoch):
            return
        deltas = {v: path for v, path in version_files(bucket.list("deltas"), "delta").items() if v <= latest.version}
        if self.version is not None and self.run_id == latest.run_id and not self._anchor_needed:
            try:
                self._prepare_chain(bucket, deltas, self.version, pending, latest)
            except (BaseVersionError, IntegrityError, FormatError, SignatureError) as exc:
                logger.info("delta-sync: deltas do not lead from v%s to v%d (%s)", self.version, latest.version, exc)
        if self.version != latest.version or self.run_id != latest.run_id:
            anchors = version_files(bucket.list("anchors"), "anchor")
            usable = sorted(v for v in anchors if v <= latest.version)
            if not usable:
                raise BucketFileNotFoundError(f"{bucket.url}: no anchor at or before version {latest.version}")
            logger.info("delta-sync: catching up from anchor v%d", usable[-1])
            self._prepare_path(bucket, anchors[usable[-1]], pending, latest)
            self._prepare_chain(bucket, deltas, usable[-1], pending, latest)
        if self.version != latest.version:
            raise ApplyError(
                f"{bucket.url}: catch-up reached version {self.version}, but latest.json names {latest.version}"
            )

    def _prepare_chain(
        self, bucket: Bucket, deltas: dict[int, str], after: int, pending: PendingUpdate, latest: Latest
    ) -> None:
        for version in sorted(v for v in deltas if v > after):
            self._prepare_path(bucket, deltas[version], pending, latest)

    def _prepare_path(self, bucket: Bucket, path: str, pending: PendingUpdate, latest: Latest) -> None:
        with self.open_version(bucket, path, namespace=_namespace(latest)) as file:
            _check_against_latest(file.header, latest)
            self._prepare_file(file, pending)

    def open_version(self, bucket: Bucket, path: str, namespace: str = "") -> Anchor | Delta:
        """Fetch (through the download cache) and read one version of `bucket`: a single file,
        or a manifest and all its parts, checked by the format gate but not applied.

        Use it as a context manager. Raises what [`read_file`] and
        `delta_sync.manifest.read_version` raise, and `BucketFileNotFoundError`.

        Args:
            bucket: The bucket.
            path: A single file's or a manifest's path in it.
            namespace: The download cache's namespace (see `DownloadCache.fetch`).
        """
        source = f"{bucket.url}/{path}"
        if not (path.endswith(".safetensors") or is_manifest(path)):
            raise FormatError(f"{source}: not an anchor, delta or manifest (expected .safetensors or .manifest.json)")
        step = None if is_part(path) else parse_step_path(path)
        local = self.cache.fetch(bucket, path, namespace)
        self._check_signature(bucket, path, local)
        if is_manifest(path):
            if local.stat().st_size > MAX_MANIFEST_BYTES:
                raise FormatError(f"{source}: {local.stat().st_size} bytes is too large for a manifest")
            manifest = Manifest.from_json(local.read_bytes(), source=source)
            parts = [(record, self.cache.fetch(bucket, record.path, namespace)) for record in manifest.parts]
            self._check_parts_signed(manifest, parts, source)
            file = read_version(manifest, parts, source=source, base_url=bucket.url)
        else:
            file = read_file(local, source=source)
        if step is not None and (file.header.kind, file.header.version) != step:
            file.close()
            raise FormatError(
                f"{source}: holds {file.header.kind} v{file.header.version}, but its path names {step[0]} v{step[1]}"
            )
        return file

    def _check_signature(self, bucket: Bucket, path: str, local: Path) -> None:
        if self.verify_key is None:
            return
        source = f"{bucket.url}/{path}{SIGNATURE_SUFFIX}"
        try:
            data = bucket.read_bytes(path + SIGNATURE_SUFFIX)
        except BucketFileNotFoundError:
            raise SignatureError(
                f"{bucket.url}/{path}: not signed, but this replica only trusts signed versions"
            ) from None
        self.verify_key.verify_file(path, file_sha256(local), FileSignature.from_json(data, source=source))

    def _check_parts_signed(self, manifest: Manifest, parts: list[tuple[PartRecord, Path]], source: str) -> None:
        if self.verify_key is None:
            return
        for record, local in parts:
            if record.sha256 is None or file_sha256(local) != record.sha256:
                raise SignatureError(f"{source}: part {record.path} is not the one the signed manifest names")

    def _prune_cache(self, bucket: Bucket, latest: Latest | None) -> None:
        """Drop downloads no catch-up from the held version can use: anchors older than the
        held one, deltas more than one version old (a sibling worker may still be applying
        the previous one), and everything of a trajectory the bucket has left."""
        if self.version is None or self.anchor_version is None or latest is None:
            self.cache.release()
            return

        def keep(path: str) -> bool:
            parsed = parse_step_path(path)
            if parsed is None:
                return True
            kind, version = parsed
            return version >= (self.anchor_version if kind == "anchor" else self.version - 1)

        self.cache.prune(bucket, keep, namespace=_namespace(latest))

    # -- one file: check, verify, apply to the snapshot ---------------------------------------

    def _prepare_file(self, file: Anchor | Delta, pending: PendingUpdate) -> None:
        try:
            if isinstance(file, Delta):
                self._prepare_delta(file, pending)
            else:
                self._prepare_anchor(file, pending)
        except DeltaSyncError as exc:
            logger.warning(
                "delta-sync: refused %s: %s; still holding version %s", file.header.source, exc, self.version
            )
            raise

    def _is_stale(self, version: int, run_id: str, epoch: str) -> bool:
        """Whether a version is one the receiver already holds or has passed, on the same
        trajectory (the same start of the run, or that start's history)."""
        if self.version is None or run_id != self.run_id or self._anchor_needed or version > self.version:
            return False
        return epoch == self.epoch or version < self.version

    def _prepare_delta(self, delta: Delta, pending: PendingUpdate) -> None:
        header = delta.header
        if self._is_stale(header.version, header.run_id, header.epoch):
            return
        self._check_delta_base(header)
        self._check_held(header)
        delta = delta.decoded(self.weights)
        self._check_delta_tensors(delta)
        old_values, new_checksums = self._verify_delta(delta)
        self._apply_delta(delta, old_values, new_checksums, pending)

    def _check_delta_base(self, header: FileHeader) -> None:
        """The delta continues the held weights: same run, trusted, made against the held version."""
        source = header.source
        if self.version is None:
            raise BaseVersionError(
                f"{source}: {self._anchor_needed or 'holds no weights yet'}; load an anchor before a delta",
                held=None,
                base=header.base_version,
            )
        if header.run_id != self.run_id:
            raise ApplyError(
                f"{source}: belongs to run {header.run_id}, but the held weights are from run {self.run_id}"
            )
        if header.epoch != self.epoch:
            raise BaseVersionError(
                f"{source}: written by another start of the run (epoch {header.epoch or '-'}, held: "
                f"{self.epoch or '-'}); load an anchor of it first",
                held=self.version,
                base=header.base_version,
            )
        if self._anchor_needed:
            raise BaseVersionError(
                f"{source}: {self._anchor_needed}; load an anchor first", held=self.version, base=header.base_version
            )
        if header.base_version != self.version:
            raise BaseVersionError(
                f"{source}: applies on top of version {header.base_version}, but version {self.version} is held",
                held=self.version,
                base=header.base_version,
            )

    def _check_held(self, header: FileHeader) -> None:
        """Every parameter the delta changes is held, with its shape."""
        for name in header.shapes:
            held = self.weights.get(name)
            if held is None:
                raise ApplyError(f"{header.source}: unknown parameter {name!r}")
            if tuple(held.shape) != header.shapes[name]:
                raise ApplyError(
                    f"{header.source}: parameter {name!r} has shape {list(header.shapes[name])}, "
                    f"held shape is {list(held.shape)}"
                )

    def _check_delta_tensors(self, delta: Delta) -> None:
        """Every parameter the delta changes has the base checksum the trainer had."""
        header = delta.header
        for name in delta.changes:
            if header.base_checksums[name] != self.checksums[name]:
                self._distrust(_INTEGRITY_FAILED)
                raise IntegrityError(
                    f"{header.source}: the held weights of {name!r} differ from those the delta was made against"
                )

    def _verify_delta(self, delta: Delta) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Checksums after the delta, in O(changed elements), against the trainer's.

        Returns:
            The values the delta overwrites and the new checksums, per parameter.
        """
        header = delta.header

        def verify(name: str) -> tuple[torch.Tensor, int]:
            change = delta.changes[name]
            old_values = gather(self.weights[name], change.indices)
            return old_values, updated_checksum(self.checksums[name], change.indices, old_values, change.values)

        names = sorted(delta.changes)
        verified = dict(zip(names, parallel_map(verify, names)))
        old_values = {name: old for name, (old, _) in verified.items()}
        new_checksums = {name: checksum for name, (_, checksum) in verified.items()}
        for name in names:
            if new_checksums[name] != header.checksums[name]:
                # The file passed its payload digest, so the held weights are what differ.
                self._distrust(_INTEGRITY_FAILED)
                raise IntegrityError(f"{header.source}: applying {name!r} would not reproduce the trainer's weights")
        if model_checksum({**self.checksums, **new_checksums}) != header.model_checksum:
            self._distrust(_INTEGRITY_FAILED)
            raise IntegrityError(f"{header.source}: the resulting model checksum differs from the trainer's")
        return old_values, new_checksums

    def _apply_delta(
        self,
        delta: Delta,
        old_values: dict[str, torch.Tensor],
        new_checksums: dict[str, int],
        pending: PendingUpdate,
    ) -> None:
        header = delta.header
        undo = _DeltaUndo(
            previous={name: (change.indices, old_values[name]) for name, change in delta.changes.items()},
            checksums={name: self.checksums[name] for name in delta.changes},
            version=self.version,
            anchor_version=self.anchor_version,
        )
        pending._record(header.source, delta.changes, header.changed_elements, undo)
        self._before_write(header, undo.previous)
        for name, change in delta.changes.items():
            scatter_(self.weights[name], change.indices, change.values)
        self.checksums.update(new_checksums)
        self.version, self.anchor_version = header.version, header.anchor_version
        self._after_write(header, delta.changes)

    def _prepare_anchor(self, anchor: Anchor, pending: PendingUpdate) -> None:
        if self._is_stale(anchor.header.version, anchor.header.run_id, anchor.header.epoch):
            return
        self._check_anchor(anchor.header)
        anchor.verify()
        self._apply_anchor(anchor, pending)

    def _check_anchor(self, header: FileHeader) -> None:
        """The anchor holds exactly the expected parameters, with the expected shapes."""
        held = {n: tuple(t.shape) for n, t in self.weights.items()} if self.version is not None else {}
        expected = self.expected_shapes or held or None
        if expected is None:
            return
        unknown = sorted(set(header.shapes) - set(expected))
        missing = sorted(set(expected) - set(header.shapes))
        if unknown:
            raise ApplyError(f"{header.source}: unknown parameter(s) {unknown[:5]}")
        if missing:
            raise ApplyError(f"{header.source}: lacks parameter(s) {missing[:5]}")
        for name, shape in header.shapes.items():
            if shape != expected[name]:
                raise ApplyError(
                    f"{header.source}: parameter {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                )

    def _apply_anchor(self, anchor: Anchor, pending: PendingUpdate) -> None:
        header = anchor.header
        pending._record(header.source, header.names, header.changed_elements, None)
        self._before_write(header, None)
        if set(self.weights) != set(header.shapes) or any(
            tuple(t.shape) != header.shapes[n] for n, t in self.weights.items()
        ):
            self.weights = {}  # another parameter set (the first anchor, or after an anchor of another model)
        # Copy into the held tensors so memory stays at one snapshot.
        for name, tensor in anchor.items():
            held = self.weights.get(name)
            if held is None:
                self.weights[name] = tensor.clone() if not tensor.is_contiguous() else tensor
            else:
                held.copy_(tensor)
        self.checksums = dict(header.checksums)
        self.version, self.anchor_version, self.run_id = header.version, header.version, header.run_id
        self.epoch = header.epoch
        self._anchor_needed = None
        self._after_write(header, header.shapes)

    def _before_write(
        self, header: FileHeader, previous: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Called before a checked file changes the snapshot: `previous` holds the values a
        delta overwrites (None for an anchor). A shared snapshot makes the write crash-safe here."""

    def _after_write(self, header: FileHeader, names: Iterable[str]) -> None:
        """Called once the snapshot and the receiver's fields hold `header`'s version."""

    # -- loading and undoing (for PendingUpdate) ----------------------------------------------

    def _load(self, load: LoadWeights | None, names: list[str]) -> None:
        if load is not None and names:
            load(sorted(self._tensors_for_load(self._with_companions(names)).items()))

    def _with_companions(self, names: Iterable[str]) -> set[str]:
        names = set(names)
        return names | self.load_together(names) if self.load_together is not None else names

    def _tensors_for_load(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The held version's tensors `names`."""
        return {name: self.weights[name] for name in names}

    def _abort_pending(self, pending: PendingUpdate) -> None:
        """Undo what `pending` did to the snapshot; the model was not touched."""
        if pending._anchored:
            self._forget("an update holding an anchor was aborted before it was loaded")
        else:
            pending._undo_deltas()

    def _roll_back_pending(self, pending: PendingUpdate, load: LoadWeights | None, names: list[str]) -> None:
        """Loading `pending` failed: go back to the version served and reload it."""
        if pending._anchored:
            # The snapshot is right but the model may be half loaded: demand a fresh anchor.
            self._model_diverged("loading an anchor into the model failed")
            return
        pending._undo_deltas()
        self._reload(load, names)

    def _model_diverged(self, reason: str) -> None:
        """The model may hold other weights than any version: the next update must reload all."""
        self._distrust(reason)

    def _reload(self, load: LoadWeights | None, names: list[str]) -> None:
        """Load the restored tensors after a failed load."""
        try:
            self._load(load, names)
        except BaseException as exc:  # the model is now in an unknown state
            self._model_diverged("restoring the model after a failed load failed")
            logger.error("delta-sync: restoring the model after a failed load also failed: %s", exc)

    def _restore(self, undo: _DeltaUndo) -> None:  # deltas never change run or epoch
        for name, (indices, values) in undo.previous.items():
            scatter_(self.weights[name], indices, values)
        self.checksums.update(undo.checksums)
        self.version, self.anchor_version = undo.version, undo.anchor_version

    def _forget(self, reason: str) -> None:
        """Hold no version: the snapshot no longer matches the model nor any version."""
        self.checksums = {}
        self.version = self.anchor_version = self.run_id = self.epoch = None
        self._distrust(reason)

    def _distrust(self, reason: str) -> None:
        self._anchor_needed = reason


_INTEGRITY_FAILED = "the held weights failed an integrity check"


def _namespace(latest: Latest) -> str:
    """Cached files are kept per run and start: a resumed run rewrites paths."""
    return f"{latest.run_id}/{latest.epoch}"


def _check_against_latest(header: FileHeader, latest: Latest) -> None:
    """A file is never ahead of the bucket's pointer, nor of another trajectory than it."""
    if header.version > latest.version:
        raise FormatError(
            f"{header.source}: claims version {header.version}, past the bucket's latest.json ({latest.version})"
        )
    if header.run_id != latest.run_id or not latest.owns(header.version, header.epoch):
        raise ApplyError(
            f"{header.source}: belongs to run {header.run_id} (epoch {header.epoch or '-'}), but the bucket's "
            f"latest.json is from run {latest.run_id} (epoch {latest.epoch or '-'})"
        )


_warned_unsigned = False


def _warn_unsigned_once() -> None:
    global _warned_unsigned
    if not _warned_unsigned:
        _warned_unsigned = True
        logger.info(
            "delta-sync: no verify key (%s): files are trusted as the bucket serves them; set it to accept "
            "only versions the trainer signed",
            VERIFY_KEY_ENV,
        )


def _normalise_url(url: str) -> str:
    url = str(url).rstrip("/")
    if "://" not in url:
        return open_bucket(url).url.rstrip("/")
    return url


def expected_shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a module, the `expected_shapes` of a [`Receiver`] feeding it."""
    return {name: tuple(p.shape) for name, p in module.named_parameters()}

"""`Receiver`: the replica side. Checks anchors and deltas and applies them to a snapshot.

An update has the lifecycle of vLLM's weight-transfer engines (start, update, finish):

1. [`Receiver.prepare`] downloads a file (or catches up to `latest.json`), checks it and
   applies it to the snapshot, returning the open [`PendingUpdate`]; the model is not
   touched, and further `prepare` calls extend the same update.
2. [`Receiver.commit`] hands every changed tensor to `load_weights` once, rolling the
   snapshot back if that fails; [`Receiver.abort`] undoes the snapshot changes instead
   (`PendingUpdate.commit` and `.abort` say the same).

[`Receiver.update`] does both. The receiver is framework-free: `load_weights` takes
`list[tuple[name, tensor]]` and can be vLLM's `model.load_weights`, or
[`module_weight_loader`] for a plain `torch.nn.Module`. Where the snapshot lives is its
store's business (`delta_sync.replica.store`): this process's memory by default, or the
machine's node snapshot (`delta_sync.replica.shared.NodeStore`).

Four versions meet here, and one word means one thing:

* *held* (`Receiver.held`, `_held`): what this receiver's model holds, or will once the
  open update commits; *served* (`Receiver.serving`, `PendingUpdate.served`): what the
  model serves now (the held version's predecessor while an update is open);
* the *snapshot's* (`SnapshotStore.held`): what the snapshot holds, which a node snapshot
  shared with other workers may have moved past the held one; `prepared_version` is the
  newest this process saw there, ready for a commit to load;
* the *pointer's* (`latest.json`): what the trainer published last.

A version *already held* (`_already_held`) is one the snapshot holds or has passed on the
same trajectory: nothing to read again. A *stale* pointer (`Freshness.stale`) is one the
trainer wrote longer ago than `DELTA_SYNC_MAX_STALENESS` allows.

Which bucket is read, and what is trusted of it, is the [`BucketReader`]'s
(`delta_sync.replica.trust`); the checks of a file's header, `delta_sync.replica.checks`;
the loader protocols, `delta_sync.replica.loaders`; the update records,
`delta_sync.replica.update`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch

from ..control import UpdateInfo
from ..errors import (
    ApplyError,
    BaseVersionError,
    BucketFileNotFoundError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    SignatureError,
)
from ..format import Anchor, Delta, DeltaFile
from ..integrity import apply_checksums, model_checksum
from ..layout import (
    LATEST,
    Latest,
    anchor_path,
    delta_path,
    is_part,
    manifest_path,
    parse_step_path,
    version_files,
)
from ..signing import VerifyKey
from ..storage import Bucket, clean_path
from ..storage.cache import DownloadCache
from ..version import HeldVersion
from .checks import check_against_latest, check_anchor, check_delta_base, check_held, reached
from .loaders import (
    LoadWeights,
    ModuleWeightLoader,
    PatchingWeightLoader,
    ShapedWeightLoader,
    WeightPatch,
    expected_shapes_of,
    module_weight_loader,
)
from .pointer import PointerLedger
from .store import DeltaUndo, PrivateSnapshot, SnapshotMemory, SnapshotStore, changed_between
from .trust import BucketReader
from .update import MAX_STALENESS_ENV, ApplyResult, Freshness, PendingUpdate, Prepared, max_staleness_from_env

__all__ = [
    "MAX_STALENESS_ENV",
    "ApplyResult",
    "Freshness",
    "LoadWeights",
    "ModuleWeightLoader",
    "PatchingWeightLoader",
    "PendingUpdate",
    "Prepared",
    "Receiver",
    "ShapedWeightLoader",
    "SnapshotMemory",
    "WeightPatch",
    "expected_shapes_of",
    "module_weight_loader",
]

logger = logging.getLogger(__name__)


class Receiver:
    """Applies anchors and deltas to a bf16 snapshot, all or nothing.

    An update follows the lifecycle of vLLM's weight-transfer engines: [`prepare`]
    downloads files, checks them and applies them to the snapshot, returning a
    [`PendingUpdate`]; [`commit`] hands the changed tensors to `load_weights` (rolling the
    snapshot back if that fails) and [`abort`] undoes the snapshot changes. [`update`]
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
            hold exactly these parameters; otherwise those of a [`ShapedWeightLoader`], else
            the first anchor defines them.
        allowed_buckets: Bucket URL prefixes this receiver may load from; None allows any.
        cache: Where downloads go; a default [`DownloadCache`] when None.
        verify_key: Apply only versions signed by the trainer's key (a
            `delta_sync.signing.VerifyKey`, or the path or PEM text of its public key);
            default: the key `DELTA_SYNC_VERIFY_KEY` names, else the bucket is trusted as is
            (said once in the log).
        load_together: Maps the names an update changed to every name `load_weights`
            must receive with them (vLLM rebuilds a fused qkv or gate_up layer from all its
            shards); None loads exactly the changed ones.
        store: Where the snapshot lives: a [`PrivateSnapshot`] in this process (the
            default), or the machine's node snapshot (`delta_sync.replica.shared.NodeStore`,
            which needs `expected_shapes`).
        bucket_id: The name the trainer's signatures give the bucket; default
            `DELTA_SYNC_BUCKET_ID`, else the bucket's URL (see
            `delta_sync.signing.bucket_identity`).
        max_staleness: Seconds after which [`freshness`] calls a pointer no newer than
            that stale; default `DELTA_SYNC_MAX_STALENESS`, else never.
        pointers: Where the newest pointer accepted from each bucket is remembered (with
            a verify key, an older one is refused); default: next to the download cache.

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
        store: SnapshotStore | None = None,
        bucket_id: str | None = None,
        max_staleness: float | None = None,
        pointers: PointerLedger | None = None,
    ) -> None:
        self.load_weights = load_weights
        self.load_together = load_together
        if expected_shapes is None and isinstance(load_weights, ShapedWeightLoader):
            expected_shapes = load_weights.expected_shapes
        self.expected_shapes = None if expected_shapes is None else {k: tuple(v) for k, v in expected_shapes.items()}
        self._store: SnapshotStore = store if store is not None else PrivateSnapshot()
        if self._store.shared and self.expected_shapes is None:
            raise ValueError("a shared snapshot needs the model's parameter shapes (expected_shapes)")
        if verify_key is None:
            verify_key = VerifyKey.from_env()
        elif not isinstance(verify_key, VerifyKey):
            verify_key = VerifyKey.load(verify_key)
        cache = cache or DownloadCache()
        #: What this receiver reads from buckets, and what it trusts of them.
        self.reader = BucketReader(
            allowed_buckets=allowed_buckets,
            verify_key=verify_key,
            cache=cache,
            bucket_id=bucket_id,
            pointers=pointers if pointers is not None else PointerLedger(cache.root),
            shapes=self._known_shapes,
        )
        self.max_staleness = max_staleness if max_staleness is not None else max_staleness_from_env()
        # The newest `latest.json` accepted, for its age.
        self._pointer: Latest | None = None
        self._warned_stale: int | None = None
        # The version this receiver's model holds, or will once the open update is committed.
        self._held: HeldVersion | None = None
        self._pending: PendingUpdate | None = None
        # The model may hold weights of no version (a load failed): load every tensor next time.
        self._reload_all = False
        self._lock = threading.RLock()

    # -- trust (the reader's) -------------------------------------------------------------------

    @property
    def verify_key(self) -> VerifyKey | None:
        """The trainer's key this receiver checks signatures with, or None."""
        return self.reader.verify_key

    @property
    def cache(self) -> DownloadCache:
        """Where downloads go."""
        return self.reader.cache

    def _known_shapes(self) -> Mapping[str, tuple[int, ...]]:
        if self.expected_shapes is not None:
            return self.expected_shapes
        return {name: tuple(tensor.shape) for name, tensor in self._store.weights.items()}

    # -- what is held -------------------------------------------------------------------------

    @property
    def held(self) -> HeldVersion | None:
        """The version held (prepared, while an update is open), with its checksums."""
        return self._held

    @property
    def version(self) -> int | None:
        return None if self._held is None else self._held.version

    @property
    def anchor_version(self) -> int | None:
        return None if self._held is None else self._held.id.anchor_version

    @property
    def run_id(self) -> str | None:
        return None if self._held is None else self._held.id.run_id

    @property
    def epoch(self) -> str | None:
        return None if self._held is None else self._held.id.epoch

    @property
    def checksums(self) -> Mapping[str, int]:
        """State checksum of every parameter held (see `delta_sync.integrity`)."""
        return {} if self._held is None else self._held.checksums

    @property
    def model_checksum(self) -> str | None:
        """Digest of the held weights (see `delta_sync.integrity.model_checksum`), or None."""
        return self._held.model_checksum if self._held is not None and self._held.checksums else None

    @property
    def store(self) -> SnapshotStore:
        """Where the snapshot lives (see `delta_sync.replica.store`)."""
        return self._store

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        """The snapshot's tensors, at the version the snapshot holds."""
        return self._store.weights

    @property
    def serving(self) -> HeldVersion | None:
        """What the model holds: the version last committed. While an update is prepared
        and not yet committed, the snapshot is ahead of the model, and this still names
        what the model serves (what a replica reports)."""
        # No lock: a status request must not wait for a prefetch or a load in progress.
        pending = self._pending
        return pending.served if pending is not None else self._held

    @property
    def pending(self) -> PendingUpdate | None:
        """The update prepared and not yet committed or aborted, if any."""
        return self._pending

    def memory(self) -> SnapshotMemory:
        """Where the snapshot lives, and what this process holds of it."""
        return self._store.memory()

    def invalidate(self, reason: str) -> None:
        """Declare the model out of step with the snapshot: with a private snapshot, deltas
        are refused until the next catch-up loads an anchor; with a shared one, the next
        update reloads every tensor.

        Args:
            reason: What happened, for the log and for the error a refused delta raises.
        """
        with self._lock:
            logger.warning("delta-sync: %s", reason)
            self._model_diverged(reason)

    # -- the lifecycle ----------------------------------------------------------------------

    def prepare(
        self,
        bucket: Bucket | str | os.PathLike,
        filename: str | None = None,
        *,
        kind: Literal["anchor", "delta"] | None = None,
    ) -> PendingUpdate:
        """Download, check and apply to the snapshot one file from `bucket`, or catch up to
        its `latest.json` when `filename` is None; load nothing into the model.

        A catch-up applies the deltas from the held version when they chain, else the
        newest anchor at or before `latest.json`'s version and the deltas after it. While
        the returned update is open, further calls extend it (a vLLM session may send
        several `/update_weights`); its commit loads the union of what they changed.
        What this call did is the update's [`PendingUpdate.last`].

        Args:
            bucket: The bucket (or its URL) the trainer publishes to.
            filename: Path of an anchor or delta inside the bucket.
            kind: What the sender says `filename` is (TRL's `update_kind`); a file of the
                other kind is refused before anything is applied.

        Returns:
            The open [`PendingUpdate`] (the same object until it is committed or aborted).

        Raises:
            DeltaSyncError: The bucket is not allowed, the path escapes it, a file is
                missing, malformed, unsigned (with a verify key), newer than the bucket's
                `latest.json` or not of `kind`, or it cannot be applied. A call that
                opened the update aborts it (all or nothing); files applied by earlier
                calls stay in [`pending`] for the caller to commit or abort.

        Example:
            ```python
            >>> pending = receiver.prepare("./deltas", "deltas/step_00000007.safetensors")
            >>> pending = receiver.prepare("./deltas", "deltas/step_00000008.safetensors")
            >>> [path.rsplit("/", 1)[-1] for path in receiver.commit(pending).applied]
            ['step_00000007.safetensors', 'step_00000008.safetensors']
            ```
        """
        if kind is not None and filename is None:
            raise ValueError("a kind describes the file named by filename; a catch-up has none")
        opened = self.check_bucket(bucket)
        path = None if filename is None else clean_path(filename)
        with self._lock:
            opened_here = self._pending is None
            pending = self._open_pending() if opened_here else self._pending
            try:
                latest = self._advance(opened, path, kind, pending)
            except BaseException:
                if opened_here:
                    self.abort(pending)  # all or nothing: a failed catch-up leaves the replica where it was
                raise
            self._prune_cache(opened, latest)
            return pending

    def update(self, bucket: Bucket | str | os.PathLike, filename: str | None = None) -> ApplyResult:
        """Apply and load one file from `bucket`, or catch up to its `latest.json` when
        `filename` is None: [`prepare`], then [`commit`].

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
            result = self.commit(self.prepare(bucket, filename))
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    def apply(self, file: Anchor | DeltaFile, *, bucket: Bucket | str | os.PathLike | None = None) -> ApplyResult:
        """Apply and load an already read anchor or delta (see [`read_file`]).

        Re-applying the version held, or an older one of the same run, is a no-op.

        Args:
            file: The file.
            bucket: The bucket it came from: needed by a store kept per bucket (the node
                snapshot), not by a private one.

        Raises:
            DeltaSyncError: The file cannot be applied; nothing changed.
            RuntimeError: An update prepared earlier is still open.
        """
        url = None if bucket is None else self.check_bucket(bucket).url
        with self._lock:
            self._refuse_if_pending("apply")
            pending = self._open_pending()
            try:
                with self._store.session(url, self.expected_shapes):
                    applied = self._prepare_file(file, pending)
                    self._settle(pending, file.header.version, applied)
            except BaseException:
                self.abort(pending)
                raise
            return self.commit(pending)

    def commit(self, pending: PendingUpdate, load_weights: LoadWeights | None = None) -> ApplyResult:
        """Hand every changed tensor of `pending` to `load_weights`, in one call.

        If loading fails, the receiver goes back to the version the model served and loads
        the old tensors again; if that fails too, or (with a private snapshot) the update
        held an anchor, the next update loads an anchor or every tensor.

        Args:
            pending: The open update [`prepare`] returned.
            load_weights: Receives `[(name, full bf16 tensor), ...]`; the receiver's own
                `load_weights` when None.

        Returns:
            What was applied; `seconds` counts from the first `prepare`.

        Raises:
            RuntimeError: The update was already committed or aborted.
        """
        with self._lock:
            self._close(pending, "committed")
            load = load_weights if load_weights is not None else self.load_weights
            names = sorted(pending.names)
            touched: list[bool] = []
            try:
                # After an anchor the model may hold anything (a failed load before it): whole tensors.
                self._load(load, self._held, names, touched, base=None if pending.anchored else pending.served)
            except BaseException:
                self._roll_back(pending, load, names, bool(touched))
                raise
            seconds = time.perf_counter() - pending.started
            return ApplyResult(self.version, pending.applied, pending.changed_elements, len(names), seconds)

    def abort(self, pending: PendingUpdate) -> None:
        """Undo every change `pending` made to the snapshot; the model is not touched. (A
        shared snapshot keeps the versions it checked: only this receiver goes back.)

        Raises:
            RuntimeError: The update was already committed or aborted.
        """
        with self._lock:
            self._close(pending, "aborted")
            self._revert(pending)

    def prefetch(self, bucket: Bucket | str | os.PathLike) -> int | None:
        """Bring a shared snapshot to the bucket's `latest.json` while the model keeps
        serving what it serves: download, verify, decode and apply, but load nothing. The
        next [`prepare`] of those versions then finds them in the snapshot and only works
        out what the model must load.

        Args:
            bucket: The bucket (or its URL) the trainer publishes to.

        Returns:
            The version the snapshot holds afterwards; None when the snapshot holds
            another bucket's versions (an update for this bucket moves it here first).

        Raises:
            DeltaSyncError: As a catch-up [`prepare`]; the snapshot keeps every version
                checked before the failure, and what the model serves is unchanged.
            ValueError: The snapshot is private: ahead of its model it could not give the
                model's own version any more.
        """
        if not self._store.shared:
            raise ValueError("prefetching needs a shared snapshot (a NodeStore): a private one is the model's own copy")
        opened = self.check_bucket(bucket)
        with self._lock:
            if not self._store.is_for(opened.url):
                # The model's version lives in another bucket's snapshot: stay there until
                # an update asks for this bucket.
                return None
            # Records what the catch-up applied, for its checks only: nothing here is loaded.
            scratch = PendingUpdate(self, served=self._held)
            with self._store.session(opened.url, self.expected_shapes):
                latest = self._read_latest(opened)
                self._follow(opened, latest)
                self._catch_up(opened, scratch, latest)
                held = self._store.held
            if scratch.applied:
                logger.info(
                    "delta-sync: prefetched v%s into the snapshot (%d file(s))", held.version, len(scratch.applied)
                )
            return None if held is None else held.version

    @property
    def prepared_version(self) -> int | None:
        """The newest version the snapshot held when this process last looked, ready for a
        commit to load (with a shared snapshot it may be ahead of [`version`]); None before
        anything is held. Takes no lock: a status request never waits for a writer."""
        seen = self._store.last_seen
        return None if seen is None else seen.version

    def check_bucket(self, bucket: Bucket | str | os.PathLike) -> Bucket:
        """Open `bucket`, refusing it unless it is on the allow list (see [`BucketReader.open`])."""
        return self.reader.open(bucket)

    def _advance(
        self, bucket: Bucket, path: str | None, kind: Literal["anchor", "delta"] | None, pending: PendingUpdate
    ) -> Latest:
        """Bring the snapshot to the version asked for (unless another process sharing it
        already has), then make that version this receiver's; returns `latest.json`."""
        applied = len(pending.applied)
        with self._store.session(bucket.url, self.expected_shapes):
            latest = self._read_latest(bucket)
            self._follow(bucket, latest)
            if path is None:
                self._catch_up(bucket, pending, latest)
                version = None
            else:
                self._prepare_path(bucket, path, pending, latest, kind)
                step = parse_step_path(path)
                version = None if step is None else step[1]
            self._settle(pending, version, tuple(pending.applied[applied:]))
        return latest

    def _settle(self, pending: PendingUpdate, version: int | None, applied: tuple[str, ...]) -> None:
        """Make `version` of the snapshot (its newest when None) the one this receiver holds,
        with what its model must load to reach it from what it serves."""
        snapshot = self._store.held
        target = self._target(version, applied=bool(applied))
        names = None if self._reload_all else changed_between(self._store, pending.served, target)
        pending.need(self._everything() if names is None else names)
        self._held = target
        pending.steps.append(Prepared(target.version, applied, None if snapshot is None else snapshot.version))
        if snapshot is not None and target.version != snapshot.version:
            logger.info(
                "delta-sync: the node snapshot is at v%s; loading v%s from it", snapshot.version, target.version
            )

    def _target(self, version: int | None, *, applied: bool) -> HeldVersion:
        """The version this receiver was asked for, now that the snapshot holds it or more
        (`applied`: this call changed the snapshot)."""
        snapshot = self._store.held
        if snapshot is None:
            raise ApplyError("the snapshot holds no version after the update")
        if version is None:
            version = snapshot.version
        held = self._held
        if not applied and held is not None and held.id.same_start(snapshot.id) and version <= held.version:
            return held  # asked for what it holds, or older: nothing to do
        target = self._store.version(version)
        if target is None:
            raise self._store.moved_past(version)  # before anything is loaded
        return target

    def _open_pending(self) -> PendingUpdate:
        self._pending = PendingUpdate(self, served=self._held)
        return self._pending

    def _close(self, pending: PendingUpdate, state: Literal["committed", "aborted"]) -> None:
        if pending.receiver is not self:
            raise ValueError("that pending update belongs to another receiver")
        pending.close(state)
        self._pending = None

    def _refuse_if_pending(self, method: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"an update prepared earlier is still open; commit or abort it before {method}()")

    def _read_latest(self, bucket: Bucket) -> Latest:
        """Read the bucket's pointer as the reader trusts it, and keep it for its age."""
        try:
            latest = self.reader.read_latest(bucket)
        except DeltaSyncError as exc:
            if self.verify_key is not None:
                held = self._held
                logger.error("delta-sync: %s (serving %s)", exc, "nothing" if held is None else held.id)
            raise
        self._pointer = latest
        return latest

    def freshness(self) -> Freshness:
        """How old the pointer this receiver follows is, and whether that is too old
        (logged once per pointer when it is). Takes no lock: a status request never waits."""
        pointer = self._pointer
        result = Freshness(None if pointer is None else pointer.age(), self.max_staleness)
        if result.stale and pointer is not None and self._warned_stale != pointer.sequence:
            self._warned_stale = pointer.sequence
            logger.warning(
                "delta-sync: the bucket's latest.json (v%d) was written %.0f s ago, more than the %.0f s "
                "%s allows: the trainer stopped refreshing it, or it is being held back",
                pointer.version,
                result.age,
                self.max_staleness,
                MAX_STALENESS_ENV,
            )
        return result

    def _follow(self, bucket: Bucket, latest: Latest) -> None:
        """Notice when what the snapshot holds is not on the bucket's trajectory: another
        run, an abandoned start of this one, a version past the bucket's pointer, or the
        pointer's version with other weights. Only an anchor of the bucket's may then replace it."""
        held = self._store.held
        if held is None:
            return
        if latest.run_id != held.id.run_id:
            problem = f"the bucket moved on to another run ({latest.run_id})"
        elif not latest.owns(held.version, held.id.epoch):
            problem = f"the bucket moved on to a restart of the run (epoch {latest.epoch or '-'})"
        elif held.version > latest.version:
            problem = f"version {held.version} is held, but the bucket's latest.json names {latest.version}"
        elif held.version == latest.version and held.model_checksum != latest.model_checksum:
            # The held weights were checked when they were applied: reload from an anchor (a
            # diverged replica recovers) only if the bucket's own file of that version agrees
            # with the pointer; a pointer it contradicts is refused with nothing changed.
            self._check_version_file(bucket, latest, version_files(bucket.list("deltas"), "delta"))
            problem = f"version {held.version} is held with other weights than the bucket's latest.json names"
        else:
            return
        logger.warning("delta-sync: %s; the next update loads an anchor", problem)
        self._store.distrust(problem)

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
        if self._already_held(latest.version, latest.run_id, latest.epoch):
            return
        deltas = {v: path for v, path in version_files(bucket.list("deltas"), "delta").items() if v <= latest.version}
        held = self._store.held
        if held is not None and held.id.run_id == latest.run_id and not self._store.anchor_needed:
            try:
                self._prepare_chain(bucket, deltas, held.version, pending, latest)
            except (BaseVersionError, IntegrityError, FormatError, SignatureError) as exc:
                logger.info("delta-sync: deltas do not lead from v%s to v%d (%s)", held.version, latest.version, exc)
        if not reached(self._store.held, latest, weights=True):
            anchors = version_files(bucket.list("anchors"), "anchor")
            usable = sorted(v for v in anchors if v <= latest.version)
            if not usable:
                raise BucketFileNotFoundError(f"{bucket.url}: no anchor at or before version {latest.version}")
            if self._store.held is not None and usable[-1] < latest.version:
                # A private snapshot cannot undo an anchor: a pointer that its version's file
                # contradicts is refused while the version held is still in place.
                self._check_version_file(bucket, latest, deltas)
            logger.info("delta-sync: catching up from anchor v%d", usable[-1])
            self._prepare_path(bucket, anchors[usable[-1]], pending, latest)
            self._prepare_chain(bucket, deltas, usable[-1], pending, latest)
        held = self._store.held
        if not reached(held, latest, weights=False):
            got = "no version" if held is None else f"version {held.version}"
            raise ApplyError(f"{bucket.url}: catch-up reached {got}, but latest.json names {latest.version}")
        if not reached(held, latest, weights=True):
            raise ApplyError(
                f"{bucket.url}: catch-up reached version {latest.version} with weights {held.model_checksum} of "
                f"run {held.id.run_id}, but latest.json names {latest.model_checksum} of run {latest.run_id}"
            )

    def _check_version_file(self, bucket: Bucket, latest: Latest, deltas: Mapping[int, str]) -> None:
        """Refuse `latest` unless the bucket holds a file of its version (a delta, else an
        anchor) that names its weights."""
        path = deltas.get(latest.version) or version_files(bucket.list("anchors"), "anchor").get(latest.version)
        if path is None:
            raise ApplyError(
                f"{bucket.url}/{LATEST}: names version {latest.version}, but the bucket holds no file of it"
            )
        with self.reader.open_version(bucket, path, namespace=_namespace(latest)) as file:
            check_against_latest(file.header, latest)

    def _prepare_chain(
        self, bucket: Bucket, deltas: dict[int, str], after: int, pending: PendingUpdate, latest: Latest
    ) -> None:
        for version in sorted(v for v in deltas if v > after):
            self._prepare_path(bucket, deltas[version], pending, latest)

    def _prepare_path(
        self,
        bucket: Bucket,
        path: str,
        pending: PendingUpdate,
        latest: Latest,
        kind: Literal["anchor", "delta"] | None = None,
    ) -> None:
        step = None if is_part(path) else parse_step_path(path)
        canonical = step is not None and path in (
            anchor_path(step[1]) if step[0] == "anchor" else delta_path(step[1]),
            manifest_path(*step),
        )
        if canonical and self._already_held(step[1], latest.run_id, latest.epoch):
            return  # the snapshot holds this version or has passed it: nothing to read again
        with self.reader.open_version(bucket, path, namespace=_namespace(latest)) as file:
            if kind is not None:
                UpdateInfo(bucket.url, path, kind).check_kind(file.header.kind, source=file.header.source)
            check_against_latest(file.header, latest)
            self._prepare_file(file, pending)

    def _prune_cache(self, bucket: Bucket, latest: Latest | None) -> None:
        """Drop downloads no catch-up from the held version can use: anchors older than the
        held one, deltas more than one version old (a sibling worker may still be applying
        the previous one), and everything of a trajectory the bucket has left."""
        held = self._held
        if held is None or latest is None:
            self.cache.release()
            return

        def keep(path: str) -> bool:
            parsed = parse_step_path(path)
            if parsed is None:
                return True
            kind, version = parsed
            return version >= (held.id.anchor_version if kind == "anchor" else held.version - 1)

        self.cache.prune(bucket, keep, namespace=_namespace(latest))

    # -- one file: check, verify, apply to the snapshot ---------------------------------------

    def _prepare_file(self, file: Anchor | DeltaFile, pending: PendingUpdate) -> tuple[str, ...]:
        """Check `file` against the snapshot and apply it; returns its source if it was
        applied (empty for a version already held or passed)."""
        applied = len(pending.applied)
        try:
            if isinstance(file, DeltaFile):
                self._prepare_delta(file, pending)
            else:
                self._prepare_anchor(file, pending)
        except DeltaSyncError as exc:
            self._report_refusal(file.header.source, exc)
            raise
        return tuple(pending.applied[applied:])

    def _report_refusal(self, source: str, exc: DeltaSyncError) -> None:
        """Log a refused file: a replica's log is where its operator sees it. (The error names
        the file, as this library's errors do, or is given its name here.)"""
        held = self._store.held
        message = str(exc) if str(exc).startswith(source) else f"{source}: {exc}"
        logger.warning(
            "delta-sync: refused %s; still holding version %s", message, None if held is None else held.version
        )

    def _already_held(self, version: int, run_id: str, epoch: str) -> bool:
        """Whether a version is one the snapshot already holds or has passed, on the same
        trajectory (the same start of the run, or that start's history)."""
        held = self._store.held
        if held is None or run_id != held.id.run_id or self._store.anchor_needed or version > held.version:
            return False
        return epoch == held.id.epoch or version < held.version

    def _prepare_delta(self, file: DeltaFile, pending: PendingUpdate) -> None:
        header = file.header
        if self._already_held(header.version, header.run_id, header.epoch):
            return
        held = check_delta_base(header, self._store.held, self._store.anchor_needed)
        check_held(header, self._store.weights)
        delta = file.decoded(self._store.weights)
        self._check_delta_tensors(delta, held)
        old_values, new_checksums = self._verify_delta(delta, held)
        undo = DeltaUndo(
            previous={name: (change.indices, old_values[name]) for name, change in delta.changes.items()},
            before=held,
        )
        pending.record(header.source, delta.changes, header.changed_elements, undo)
        after = HeldVersion(header.id, {**held.checksums, **new_checksums})
        self._store.write_delta(header, delta.changes, undo, after)

    def _check_delta_tensors(self, delta: Delta, held: HeldVersion) -> None:
        """Every parameter the delta changes has the base checksum the trainer had."""
        header = delta.header
        for name in delta.changes:
            if header.base_checksums[name] != held.checksums[name]:
                self._store.distrust(_INTEGRITY_FAILED)
                raise IntegrityError(
                    f"{header.source}: the held weights of {name!r} differ from those the delta was made against"
                )

    def _verify_delta(self, delta: Delta, held: HeldVersion) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Checksums after the delta, in O(changed elements), against the trainer's.

        Returns:
            The values the delta overwrites and the new checksums, per parameter.
        """
        header = delta.header
        weights = self._store.weights
        names = sorted(delta.changes)
        changes = [delta.changes[name] for name in names]
        # One compiled call for every tensor: per-tensor calls would each hand the GIL back
        # and forth with vLLM's thread while it generates.
        old, checksums = apply_checksums(
            [(held.checksums[name], weights[name], c.indices, c.values) for name, c in zip(names, changes)]
        )
        old_values, new_checksums = dict(zip(names, old)), dict(zip(names, checksums))
        for name in names:
            if new_checksums[name] != header.checksums[name]:
                # The file passed its payload digest, so the held weights are what differ.
                self._store.distrust(_INTEGRITY_FAILED)
                raise IntegrityError(f"{header.source}: applying {name!r} would not reproduce the trainer's weights")
        if model_checksum({**held.checksums, **new_checksums}) != header.model_checksum:
            self._store.distrust(_INTEGRITY_FAILED)
            raise IntegrityError(f"{header.source}: the resulting model checksum differs from the trainer's")
        return old_values, new_checksums

    def _prepare_anchor(self, anchor: Anchor, pending: PendingUpdate) -> None:
        header = anchor.header
        if self._already_held(header.version, header.run_id, header.epoch):
            return
        held_shapes = (
            {n: tuple(t.shape) for n, t in self._store.weights.items()} if self._store.held is not None else {}
        )
        check_anchor(header, self.expected_shapes or held_shapes)
        anchor.verify()
        pending.record(header.source, header.names, header.changed_elements, None)
        self._store.write_anchor(header, anchor, HeldVersion(header.id, dict(header.checksums)))

    # -- loading and undoing -----------------------------------------------------------------

    def _everything(self) -> set[str]:
        return set(self.expected_shapes) if self.expected_shapes else set(self._store.weights)

    def _load(
        self,
        load: LoadWeights | None,
        held: HeldVersion | None,
        names: list[str],
        touched: list[bool],
        *,
        base: HeldVersion | None = None,
    ) -> None:
        """Hand the tensors `names` at `held` (with their companions) to `load`; `touched`
        gains an entry once `load` is called. A [`PatchingWeightLoader`] also gets the
        positions that changed since `base` (what the model holds), where the store can tell."""
        if load is None or not names or held is None:
            return
        wanted = set(names)
        if self.load_together is not None:
            wanted |= self.load_together(wanted)
        patching = isinstance(load, PatchingWeightLoader)
        positions = self._store.changed_positions(base, held, names) if patching and not self._reload_all else None
        with self._store.tensors(held, wanted) as tensors:
            touched.append(True)
            if patching:
                known = positions or {}
                load.load_patches([WeightPatch(name, tensors[name], known.get(name)) for name in sorted(tensors)])
            else:
                load(sorted(tensors.items()))
        if wanted >= self._everything():
            self._reload_all = False

    def _revert(self, pending: PendingUpdate) -> None:
        """Go back to the version the model serves; the model was not touched. A private
        snapshot undoes the deltas (an anchor it cannot undo: it then holds nothing)."""
        if self._store.shared:
            self._held = pending.served  # the node keeps the versions it checked
        elif pending.anchored:
            self._store.forget("an update holding an anchor was aborted before it was loaded")
            self._held = None
        else:
            for undo in reversed(pending.undo):
                self._store.restore(undo)
            pending.undo.clear()
            self._held = pending.served

    def _roll_back(self, pending: PendingUpdate, load: LoadWeights | None, names: list[str], touched: bool) -> None:
        """Loading `pending` failed: go back to the version served and load it again."""
        if pending.anchored and not self._store.shared:
            # The snapshot is right but the model may be half loaded: demand a fresh anchor.
            self._model_diverged("loading an anchor into the model failed")
            return
        self._revert(pending)
        if not touched:  # the version could not even be read: the model is as it was
            return
        try:
            self._load(load, self._held, names, [])
        except BaseException as exc:  # the model is now in an unknown state
            self._model_diverged("restoring the model after a failed load failed")
            logger.error("delta-sync: restoring the model after a failed load also failed: %s", exc)

    def _model_diverged(self, reason: str) -> None:
        """The model may hold other weights than any version: a shared snapshot reloads
        every tensor next time; a private one demands an anchor."""
        if self._store.shared:
            logger.warning("delta-sync: %s; the next update reloads every tensor", reason)
            self._reload_all = True
        else:
            self._store.distrust(reason)


_INTEGRITY_FAILED = "the held weights failed an integrity check"


def _namespace(latest: Latest) -> str:
    """Cached files are kept per run and start: a resumed run rewrites paths."""
    return f"{latest.run_id}/{latest.epoch}"

"""`Receiver`: the replica side. Holds a bf16 snapshot and applies anchors and deltas to it.

The receiver is framework-free: it hands the full tensors of every parameter a file
changed to a `load_weights(list[tuple[name, tensor]])` callable, which can be vLLM's
`model.load_weights`, or [`module_weight_loader`] for a plain `torch.nn.Module`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import (
    ApplyError,
    BaseVersionError,
    BucketFileNotFoundError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    UntrustedBucketError,
)
from ..format import Anchor, Delta, read_file
from ..integrity import PayloadHasher, model_checksum, tensor_checksum, updated_checksum
from ..layout import LATEST, Latest, anchor_path, delta_path, parse_step_path, step_versions
from ..parallel import parallel_map
from ..sparse import gather, scatter_
from ..storage import Bucket, clean_path, open_bucket
from ..storage.cache import DownloadCache

__all__ = ["ApplyResult", "LoadWeights", "Receiver", "expected_shapes_of", "module_weight_loader"]

logger = logging.getLogger("delta_sync")

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]


def module_weight_loader(module: nn.Module) -> LoadWeights:
    """A `load_weights` callable that copies tensors into a module's parameters by name.

    Example:
        ```python
        >>> replica = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        >>> receiver = Receiver(load_weights=module_weight_loader(replica))
        ```
    """
    params = dict(module.named_parameters())

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    return load_weights


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


class Receiver:
    """Applies anchors and deltas to a local bf16 snapshot, all or nothing.

    Before anything changes, every file is checked: its structure and payload digest,
    that its parameters and shapes are the held ones, that a delta's base version and
    base checksums are those held, and that the result reproduces the trainer's
    per-parameter and model checksums (O(changed elements) for a delta). A file that fails
    any check raises a [`DeltaSyncError`] subclass and leaves the snapshot and the model
    untouched; after a base-checksum mismatch the next catch-up starts from an anchor.

    Args:
        load_weights: Receives `[(name, full bf16 tensor), ...]` for every parameter a file
            changed. None to keep the snapshot only.
        expected_shapes: Parameter name -> shape the model expects. When given, anchors must
            hold exactly these parameters; otherwise the first anchor defines them.
        allowed_buckets: Bucket URL prefixes this receiver may load from; None allows any.
        cache: Where downloads go; a default [`DownloadCache`] when None.

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
    ) -> None:
        self.load_weights = load_weights
        self.expected_shapes = None if expected_shapes is None else {k: tuple(v) for k, v in expected_shapes.items()}
        self.allowed_buckets = None if allowed_buckets is None else [_normalise_url(u) for u in allowed_buckets]
        self.cache = cache or DownloadCache()
        self.weights: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, int] = {}
        self.version: int | None = None
        self.anchor_version: int | None = None
        self.run_id: str | None = None
        self._needs_anchor = False
        self._lock = threading.RLock()

    def invalidate(self, reason: str) -> None:
        """Declare the model out of step with the snapshot (e.g. a load failed after a
        successful apply): deltas are refused until the next catch-up loads an anchor."""
        with self._lock:
            logger.warning("delta-sync: %s; the next catch-up reloads an anchor", reason)
            self._needs_anchor = True

    @property
    def model_checksum(self) -> str | None:
        """Digest of the held weights (see `delta_sync.integrity.model_checksum`), or None."""
        return model_checksum(self.checksums) if self.checksums else None

    # -- bucket-level entry points ------------------------------------------------------

    def check_bucket(self, bucket: Bucket | str | os.PathLike) -> Bucket:
        """Open `bucket`, refusing it unless it is on the allow list."""
        opened = open_bucket(bucket)
        if self.allowed_buckets is not None:
            url = _normalise_url(opened.url)
            if not self.allowed_buckets:
                raise UntrustedBucketError(
                    f"bucket {opened.url} refused: this receiver trusts no bucket yet "
                    "(for a vLLM server, set DELTA_SYNC_ALLOWED_BUCKETS)"
                )
            if not any(url == allowed or url.startswith(allowed + "/") for allowed in self.allowed_buckets):
                raise UntrustedBucketError(
                    f"bucket {opened.url} is not on this receiver's allow list {self.allowed_buckets}"
                )
        return opened

    def update(self, bucket: Bucket | str | os.PathLike, filename: str | None = None) -> ApplyResult:
        """Apply one file from `bucket`, or catch up to its `latest.json` when `filename` is None.

        Args:
            bucket: The bucket (or its URL) the trainer publishes to.
            filename: Path of an anchor or delta inside the bucket.

        Raises:
            DeltaSyncError: The bucket is not allowed, the path escapes it, the file is
                missing or malformed, or it cannot be applied. Nothing was applied.
        """
        started = time.perf_counter()
        opened = self.check_bucket(bucket)
        if filename is None:
            return self.catch_up(opened)
        result = self._apply_path(opened, clean_path(filename))
        self._prune_cache(opened)
        return self._timed(result, started)

    def catch_up(self, bucket: Bucket | str | os.PathLike) -> ApplyResult:
        """Reach the version `latest.json` names: deltas from the held version when they
        chain, else the newest anchor at or before it followed by the deltas after it.

        A re-run after a file disappears under it (retention) starts over once.
        """
        started = time.perf_counter()
        opened = self.check_bucket(bucket)
        try:
            result = self._catch_up(opened)
        except BucketFileNotFoundError as exc:
            logger.warning("delta-sync: %s; starting the catch-up over from latest.json", exc)
            result = self._catch_up(opened)
        self._prune_cache(opened)
        return self._timed(result, started)

    def _prune_cache(self, bucket: Bucket) -> None:
        """Drop downloads no catch-up from the held version can use: anchors older than the
        held one, deltas more than one version old (a sibling worker may still be applying
        the previous one)."""
        if self.version is None or self.anchor_version is None:
            return

        def keep(path: str) -> bool:
            parsed = parse_step_path(path)
            if parsed is None:
                return True
            kind, version = parsed
            return version >= (self.anchor_version if kind == "anchor" else self.version - 1)

        self.cache.prune(bucket, keep)

    def _catch_up(self, bucket: Bucket) -> ApplyResult:
        latest = Latest.from_json(bucket.read_bytes(LATEST), source=f"{bucket.url}/{LATEST}")
        with self._lock:
            if self._is_stale(latest.version, latest.run_id):
                return ApplyResult(self.version, (), 0, 0, 0.0)
            deltas = [v for v in step_versions(bucket.list("deltas"), "delta") if v <= latest.version]
            results: list[ApplyResult] = []
            if self.version is not None and self.run_id == latest.run_id and not self._needs_anchor:
                try:
                    results += self._apply_chain(bucket, [v for v in deltas if v > self.version])
                except (BaseVersionError, IntegrityError, FormatError) as exc:
                    logger.info(
                        "delta-sync: deltas do not lead from v%s to v%d (%s)", self.version, latest.version, exc
                    )
            if self.version != latest.version or self.run_id != latest.run_id:
                anchors = [v for v in step_versions(bucket.list("anchors"), "anchor") if v <= latest.version]
                if not anchors:
                    raise BucketFileNotFoundError(f"{bucket.url}: no anchor at or before version {latest.version}")
                logger.info("delta-sync: catching up from anchor v%d", anchors[-1])
                results.append(self._apply_path(bucket, anchor_path(anchors[-1])))
                results += self._apply_chain(bucket, [v for v in deltas if v > anchors[-1]])
            if self.version != latest.version:
                raise ApplyError(
                    f"{bucket.url}: catch-up reached version {self.version}, but latest.json names {latest.version}"
                )
            return ApplyResult(
                version=self.version,
                applied=tuple(source for r in results for source in r.applied),
                changed_elements=sum(r.changed_elements for r in results),
                loaded_tensors=sum(r.loaded_tensors for r in results),
                seconds=0.0,
            )

    def _apply_chain(self, bucket: Bucket, versions: list[int]) -> list[ApplyResult]:
        return [self._apply_path(bucket, delta_path(v)) for v in versions]

    def _apply_path(self, bucket: Bucket, path: str) -> ApplyResult:
        local = self.cache.fetch(bucket, path)
        return self.apply(read_file(local, source=f"{bucket.url}/{path}"))

    # -- file-level entry points --------------------------------------------------------

    def apply_file(self, path: str | os.PathLike) -> ApplyResult:
        """Read and apply a local anchor or delta file."""
        started = time.perf_counter()
        return self._timed(self.apply(read_file(path)), started)

    def apply(self, file: Anchor | Delta) -> ApplyResult:
        """Apply an already read anchor or delta (see [`read_file`]).

        Re-applying the version held, or an older one of the same run, is a no-op.
        """
        with self._lock:
            try:
                if isinstance(file, Delta):
                    return self._apply_delta(file)
                return self._apply_anchor(file)
            except DeltaSyncError as exc:
                logger.warning(
                    "delta-sync: refused %s: %s; still holding version %s", file.header.source, exc, self.version
                )
                raise

    def _timed(self, result: ApplyResult, started: float) -> ApplyResult:
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    def _is_stale(self, version: int, run_id: str) -> bool:
        return self.version is not None and run_id == self.run_id and version <= self.version and not self._needs_anchor

    def _apply_delta(self, delta: Delta) -> ApplyResult:
        header = delta.header
        source = header.source
        if self._is_stale(header.version, header.run_id):
            return ApplyResult(self.version, (), 0, 0, 0.0)
        if self.version is None:
            raise BaseVersionError(
                f"{source}: holds no weights yet; load an anchor before a delta", held=None, base=header.base_version
            )
        if header.run_id != self.run_id:
            raise ApplyError(
                f"{source}: belongs to run {header.run_id}, but the held weights are from run {self.run_id}"
            )
        if self._needs_anchor:
            raise BaseVersionError(
                f"{source}: the held weights failed an integrity check; load an anchor first",
                held=self.version,
                base=header.base_version,
            )
        if header.base_version != self.version:
            raise BaseVersionError(
                f"{source}: applies on top of version {header.base_version}, but version {self.version} is held",
                held=self.version,
                base=header.base_version,
            )
        for name in delta.changes:
            held = self.weights.get(name)
            if held is None:
                raise ApplyError(f"{source}: unknown parameter {name!r}")
            if tuple(held.shape) != header.shapes[name]:
                raise ApplyError(
                    f"{source}: parameter {name!r} has shape {list(header.shapes[name])}, held shape is {list(held.shape)}"
                )
            if header.base_checksums[name] != self.checksums[name]:
                self._needs_anchor = True
                raise IntegrityError(
                    f"{source}: the held weights of {name!r} differ from those the delta was made against"
                )

        def verify(name: str) -> tuple[torch.Tensor, int]:
            change = delta.changes[name]
            old_values = gather(self.weights[name], change.indices)
            return old_values, updated_checksum(self.checksums[name], change.indices, old_values, change.values)

        names = sorted(delta.changes)
        verified = dict(zip(names, parallel_map(verify, names)))
        previous = {name: old for name, (old, _) in verified.items()}
        new_checksums = {name: checksum for name, (_, checksum) in verified.items()}
        for name in names:
            if new_checksums[name] != header.checksums[name]:
                # The file passed its payload digest, so the held weights are what differ.
                self._needs_anchor = True
                raise IntegrityError(f"{source}: applying {name!r} would not reproduce the trainer's weights")
        if model_checksum({**self.checksums, **new_checksums}) != header.model_checksum:
            self._needs_anchor = True
            raise IntegrityError(f"{source}: the resulting model checksum differs from the trainer's")

        for name, change in delta.changes.items():
            scatter_(self.weights[name], change.indices, change.values)
        old_state = (dict(self.checksums), self.version, self.anchor_version)
        self.checksums.update(new_checksums)
        self.version, self.anchor_version = header.version, header.anchor_version
        try:
            self._load(sorted(delta.changes))
        except BaseException:
            for name, change in delta.changes.items():
                scatter_(self.weights[name], change.indices, previous[name])
            self.checksums, self.version, self.anchor_version = old_state
            self._reload_after_failure(sorted(delta.changes))
            raise
        return ApplyResult(self.version, (source,), header.changed_elements, len(delta.changes), 0.0)

    def _apply_anchor(self, anchor: Anchor) -> ApplyResult:
        header = anchor.header
        source = header.source
        if self._is_stale(header.version, header.run_id):
            return ApplyResult(self.version, (), 0, 0, 0.0)
        expected = self.expected_shapes or ({n: tuple(t.shape) for n, t in self.weights.items()} or None)
        if expected is not None:
            unknown = sorted(set(header.shapes) - set(expected))
            missing = sorted(set(expected) - set(header.shapes))
            if unknown:
                raise ApplyError(f"{source}: unknown parameter(s) {unknown[:5]}")
            if missing:
                raise ApplyError(f"{source}: lacks parameter(s) {missing[:5]}")
            for name, shape in header.shapes.items():
                if shape != expected[name]:
                    raise ApplyError(
                        f"{source}: parameter {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                    )
        # Verify before touching anything, reading one tensor per core at a time.
        names = header.names
        for name, checksum in zip(names, parallel_map(lambda n: tensor_checksum(anchor.tensor(n)), names)):
            if checksum != header.checksums[name]:
                raise IntegrityError(f"{source}: parameter {name!r} does not match its recorded checksum")
        hasher = PayloadHasher()
        for name, tensor in anchor.items():
            hasher.update(name, tensor)
        if hasher.hexdigest() != header.payload_digest:
            raise IntegrityError(f"{source}: payload digest does not match; the file is damaged")
        if model_checksum(header.checksums) != header.model_checksum:
            raise IntegrityError(f"{source}: model checksum does not match the per-parameter checksums")
        # Commit, copying into the held tensors so memory stays at one snapshot.
        for name, tensor in anchor.items():
            held = self.weights.get(name)
            if held is None:
                self.weights[name] = tensor.clone() if not tensor.is_contiguous() else tensor
            else:
                held.copy_(tensor)
        self.checksums = dict(header.checksums)
        self.version, self.anchor_version, self.run_id = header.version, header.version, header.run_id
        self._needs_anchor = False
        try:
            self._load(sorted(self.weights))
        except BaseException:
            # The snapshot is right but the model may be half loaded: demand a fresh anchor.
            self._needs_anchor = True
            raise
        return ApplyResult(self.version, (source,), header.changed_elements, len(self.weights), 0.0)

    def _load(self, names: list[str]) -> None:
        if self.load_weights is not None and names:
            self.load_weights([(name, self.weights[name]) for name in names])

    def _reload_after_failure(self, names: list[str]) -> None:
        try:
            self._load(names)
        except BaseException as exc:  # the model is now in an unknown state
            self._needs_anchor = True
            logger.error("delta-sync: restoring the model after a failed load also failed: %s", exc)


def _normalise_url(url: str) -> str:
    url = str(url).rstrip("/")
    if "://" not in url:
        return open_bucket(url).url.rstrip("/")
    return url


def expected_shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a module, the `expected_shapes` of a [`Receiver`] feeding it."""
    return {name: tuple(p.shape) for name, p in module.named_parameters()}

"""`verify_bucket`: replay a bucket's chain of anchors and deltas and check every file."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..errors import BucketFileNotFoundError, DeltaSyncError
from ..format import Anchor, DeltaFile
from ..layout import ADAPTER_DIR, LATEST, Latest, adapter_dir, parse_adapter_path, version_files
from ..signing import VerifyKey
from ..storage import Bucket, open_bucket
from ..storage.cache import DownloadCache
from .adapter import AdapterFetcher
from .receiver import Receiver

__all__ = ["VerifyReport", "VerifyStep", "verify_bucket"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyStep:
    """One check: `path` is the file (or `latest.json`), `ok` whether it passed."""

    path: str
    ok: bool
    message: str


@dataclass
class VerifyReport:
    """The result of [`verify_bucket`]."""

    bucket: str
    steps: list[VerifyStep] = field(default_factory=list)
    latest_version: int | None = None
    replayed_version: int | None = None

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    def add(self, path: str, ok: bool, message: str) -> None:
        self.steps.append(VerifyStep(path, ok, message))

    def to_dict(self) -> dict:
        return {
            "bucket": self.bucket,
            "ok": self.ok,
            "latest_version": self.latest_version,
            "replayed_version": self.replayed_version,
            "steps": [step.__dict__ for step in self.steps],
        }


def verify_bucket(
    bucket: Bucket | str, *, progress: bool | None = None, verify_key: VerifyKey | str | None = None
) -> VerifyReport:
    """Replay the chain from the oldest kept anchor and check every file on the way.

    Every delta must apply on top of the version before it with matching checksums; every
    later anchor must equal the replayed state bit for bit; `latest.json` must name the
    last version reached and its checksum. A file that fails is reported and the replay
    goes on: the deltas after it fail against the version held, and the next anchor
    restarts the chain. Nothing a bucket holds stops the verification early, except a
    listing that fails and a `latest.json` that cannot be read (reported once: a replica
    reads it before it applies any file, so none is replayed). Files of versions past
    `latest.json` (stored, not yet published, e.g. by a trainer that crashed in between) are
    listed and ignored. A check never passes on nothing: a path without `latest.json` (a
    typo, an empty directory, a run that has published nothing yet) fails. A bucket
    published in adapter mode (`latest.json` names an adapter) has no chain: each stored
    adapter version is fetched as a replica fetches it, and the newest must be the one
    `latest.json` records.

    Args:
        bucket: The bucket or its URL.
        progress: Show a progress bar; by default only on a terminal.
        verify_key: Check every file's signature with this public key (or its path); by
            default the key `DELTA_SYNC_VERIFY_KEY` names, if any.

    Returns:
        A [`VerifyReport`]; `report.ok` is False if any check failed.
    """
    opened = open_bucket(bucket)
    report = VerifyReport(bucket=opened.url)
    try:
        anchors = version_files(opened.list("anchors"), "anchor")
        deltas = version_files(opened.list("deltas"), "delta")
    except Exception as exc:
        report.add("anchors/, deltas/", False, f"cannot list the versions: {_problem(exc)}")
        return report
    try:
        latest = Latest.from_json(opened.read_bytes(LATEST), source=f"{opened.url}/{LATEST}")
        report.latest_version = latest.version
    except BucketFileNotFoundError:
        stored = len(anchors) + len(deltas)
        if stored:
            problem = f"absent: no version is published yet ({stored} version file(s) stored, none published)"
        else:
            problem = f"absent, and no anchor or delta either: {opened.url} holds no bucket"
        report.add(LATEST, False, problem)
        return report
    except Exception as exc:
        # Said once: a replica reads the pointer before it applies any file, so every file
        # would fail on it again.
        report.add(LATEST, False, _problem(exc))
        report.add("anchors/, deltas/", False, "not replayed: a replica reads latest.json before it applies any file")
        return report
    if latest.adapter is not None:
        _verify_adapters(report, opened, latest, verify_key, progress)
        return report
    ahead = sorted(v for v in {*anchors, *deltas} if v > latest.version)
    if ahead:
        report.add("anchors/, deltas/", True, f"versions {ahead} are stored but not published yet: ignored")
    anchors = {v: path for v, path in anchors.items() if v <= latest.version}
    deltas = {v: path for v, path in deltas.items() if v <= latest.version}
    if not anchors:
        report.add("anchors/", False, "no anchor in the bucket")
        return report
    with tempfile.TemporaryDirectory(prefix="delta-sync-verify-") as cache_dir:
        receiver = _Replay(cache=DownloadCache(cache_dir), verify_key=verify_key)
        first = min(anchors)
        versions = sorted(v for v in {*anchors, *deltas} if v >= first)
        for version in tqdm(versions, desc="verify", unit="version", disable=_progress_off(progress)):
            if version == first:
                _check(report, receiver, opened, anchors[version], "anchor loads and matches its checksums")
                continue
            if version in deltas:
                _check(report, receiver, opened, deltas[version], "delta applies with matching checksums")
            if version in anchors:
                _compare_anchor(report, receiver, opened, version, anchors[version])
        report.replayed_version = receiver.version
        ok = receiver.version == latest.version and receiver.model_checksum == latest.model_checksum
        if receiver.version is None:
            reached = "no version (no anchor could be loaded)"
        else:
            reached = f"version {receiver.version} with checksum {receiver.model_checksum}"
        report.add(
            LATEST, ok, f"names version {latest.version}" + ("" if ok else f", but the replay reached {reached}")
        )
    return report


class _Replay(Receiver):
    """A receiver whose refusals are the report's to say (once), not its log's."""

    def _report_refusal(self, source: str, exc: DeltaSyncError) -> None:
        pass


def _verify_adapters(
    report: VerifyReport, bucket: Bucket, latest: Latest, verify_key: VerifyKey | str | None, progress: bool | None
) -> None:
    """A bucket published in adapter mode: every adapter version stored up to `latest.json`'s
    is fetched as a replica would fetch it (signatures, signed sizes, both files a LoRA
    adapter, and the newest one's weights the ones `latest.json` records)."""
    try:
        stored = sorted({v for v in map(parse_adapter_path, bucket.list(ADAPTER_DIR)) if v is not None})
    except Exception as exc:
        report.add(f"{ADAPTER_DIR}/", False, f"cannot list the adapter versions: {_problem(exc)}")
        return
    ahead = [v for v in stored if v > latest.version]
    if ahead:
        report.add(f"{ADAPTER_DIR}/", True, f"versions {ahead} are stored but not published yet: ignored")
    published = [v for v in stored if v <= latest.version]
    fetched = set()
    with tempfile.TemporaryDirectory(prefix="delta-sync-verify-") as cache_dir:
        fetcher = AdapterFetcher(Receiver(cache=DownloadCache(cache_dir), verify_key=verify_key), keep=1)
        for version in tqdm(published, desc="verify", unit="version", disable=_progress_off(progress)):
            path = adapter_dir(version)
            try:
                fetcher.fetch(bucket, version)
            except Exception as exc:
                report.add(path, False, _problem(exc))
                continue
            fetched.add(version)
            signed = ", signed for this run" if fetcher.receiver.verify_key is not None else ""
            report.add(path, True, f"a LoRA adapter vLLM can load{signed}")
    report.replayed_version = max(fetched, default=None)
    if latest.version in fetched:
        report.add(LATEST, True, f"names adapter version {latest.version}, with its weights' SHA-256")
    else:
        why = "which failed its checks" if latest.version in published else "which is not stored"
        report.add(LATEST, False, f"names adapter version {latest.version}, {why}")


def _check(report: VerifyReport, receiver: Receiver, bucket: Bucket, path: str, message: str) -> bool:
    try:
        receiver.update(bucket, path)
    except Exception as exc:
        report.add(path, False, _problem(exc))
        return False
    report.add(path, True, message)
    return True


def _compare_anchor(report: VerifyReport, receiver: Receiver, bucket: Bucket, version: int, path: str) -> None:
    try:
        anchor = receiver.reader.open_version(bucket, path)
    except Exception as exc:
        report.add(path, False, _problem(exc))
        return
    try:
        _compare_open_anchor(report, receiver, bucket, version, path, anchor)
    except Exception as exc:
        report.add(path, False, _problem(exc))


def _compare_open_anchor(
    report: VerifyReport, receiver: Receiver, bucket: Bucket, version: int, path: str, anchor: Anchor | DeltaFile
) -> None:
    with anchor:
        if receiver.version != version or receiver.run_id != anchor.header.run_id:
            # The chain broke before this anchor (e.g. a failed upload); it restarts here.
            _check(report, receiver, bucket, path, "anchor restarts the chain")
            return
        differing = [
            name
            for name, tensor in anchor.items()
            if name not in receiver.weights
            or tensor.dtype != receiver.weights[name].dtype
            or not torch.equal(_bits(tensor), _bits(receiver.weights[name]))
        ]
    if differing or set(anchor.header.names) != set(receiver.weights):
        report.add(path, False, f"differs from the replayed state in {differing[:5] or 'its parameter set'}")
    else:
        report.add(path, True, "equals the replayed state bit for bit")


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaNs compare equal to themselves), as integers of its width."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _problem(exc: Exception) -> str:
    """What a failed check reports: this library's errors as they are; anything else (a
    file that breaks a parser in an unforeseen way) with its type, so that the
    verification goes on and names it."""
    if isinstance(exc, DeltaSyncError):
        return str(exc)
    logger.debug("delta-sync: verify: unexpected error", exc_info=True)
    detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc) or repr(exc)
    return f"unexpected {type(exc).__name__}: {detail}"


def _progress_off(progress: bool | None) -> bool | None:
    return None if progress is None else not progress

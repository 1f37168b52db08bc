"""The download cache shared by processes: a reader never loses a file another process prunes."""

from __future__ import annotations

import multiprocessing
import re
import traceback

import pytest

from delta_sync.errors import BucketFileNotFoundError
from delta_sync.layout import anchor_path, delta_path
from delta_sync.storage import open_bucket
from delta_sync.storage.cache import DownloadCache

from two_tower import PublishedRun

PROCESSES = 3
ROUNDS = 20
VERSIONS = 10


def test_a_fetched_file_survives_a_siblings_prune_until_released(s3_target, tmp_path):
    run = PublishedRun(s3_target.url, versions=2)
    run.close()
    bucket = open_bucket(s3_target.url)
    reader, sibling = DownloadCache(tmp_path / "cache"), DownloadCache(tmp_path / "cache")
    local = reader.fetch(bucket, delta_path(2))
    # Another cache on the same directory (as in another process) prunes everything.
    assert sibling.prune(bucket, keep=lambda path: False) == 0
    assert local.read_bytes() == bucket.read_bytes(delta_path(2))
    assert sibling.fetch(bucket, delta_path(2)) == local  # and shares it meanwhile
    reader.release()
    assert sibling.prune(bucket, keep=lambda path: False) == 1  # releases its own pin first
    assert not local.exists() and not local.with_name(local.name + ".lock").exists()
    # Fetched again after the prune: downloaded again.
    assert reader.fetch(bucket, delta_path(2)).read_bytes() == bucket.read_bytes(delta_path(2))
    # A file the bucket lacks leaves no lock file behind; neither does a download that died.
    with pytest.raises(BucketFileNotFoundError, match=re.escape(f"no file '{delta_path(9)}'")):
        reader.fetch(bucket, delta_path(9))
    left_by_a_crash = local.with_name("step_00000003.safetensors.lock")
    left_by_a_crash.touch()
    reader.prune(bucket, keep=lambda path: True)
    assert sorted(p.name for p in local.parent.iterdir()) == [local.name, local.name + ".lock"]


def _replay(bucket: str, cache_dir: str, rounds: int, results) -> None:
    """Replay anchor 1 and every delta after it, `rounds` times, each time with a fresh
    Receiver on `cache_dir`; put (failures, checksums reached) on `results`."""
    from delta_sync import Receiver

    failures: list[str] = []
    checksums: set[str | None] = set()
    for _ in range(rounds):
        receiver = Receiver(cache=DownloadCache(cache_dir))
        try:
            receiver.update(bucket, anchor_path(1))
            for version in range(2, VERSIONS + 1):
                receiver.update(bucket, delta_path(version))
        except Exception:
            failures.append(traceback.format_exc(limit=3))
        checksums.add(receiver.model_checksum)
    results.put((failures, checksums))


def test_three_processes_replay_one_chain_through_one_cache(s3_target, tmp_path):
    """Each replica prunes, after every version, the deltas it no longer needs: exactly
    what a sibling that has drifted a few versions behind is about to read."""
    run = PublishedRun(s3_target.url, versions=VERSIONS, anchor_every=100, keep_anchors=1)
    run.close()
    expected = run.publisher.reports[-1].model_checksum
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_replay, args=(s3_target.url, str(tmp_path / "cache"), ROUNDS, results))
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    try:
        outcomes = [results.get(timeout=300) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    failures = [failure for failed, _ in outcomes for failure in failed]
    assert not failures, f"{len(failures)} of {PROCESSES * ROUNDS} replays failed:\n" + "\n".join(failures[:3])
    assert all(checksums == {expected} for _, checksums in outcomes)
    # Pruning went on all along: what the last version needs is all that is left.
    left = sorted(p.name for p in (tmp_path / "cache").rglob("step_*") if not p.name.endswith(".lock"))
    assert left == ["step_00000001.safetensors", "step_00000009.safetensors", "step_00000010.safetensors"], left

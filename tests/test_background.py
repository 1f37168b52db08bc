"""The background writer both publishers store through: versions in order, a failure kept
for the training thread, and `latest.json` refreshed while idle, adapter mode included, so
that a replica with a staleness bound sees an idle adapter-mode trainer as live."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import peft
import pytest
import torch

from delta_sync import Receiver, open_bucket
from delta_sync.replica.adapter import AdapterFetcher
from delta_sync.replica.pointer import PointerLedger
from delta_sync.signing import SigningKey, bucket_identity
from delta_sync.storage.cache import DownloadCache
from delta_sync.trainer.adapter import AdapterPublisher
from delta_sync.trainer.background import BackgroundWriter
from delta_sync.trainer.options import PublisherOptions
from delta_sync.trainer.writer import PublishReport

from helpers import wait_for
from tiny_model import build_tiny_model

KEY = SigningKey.generate()


# -- adapter mode refreshes its pointer ---------------------------------------------------------


def test_an_idle_adapter_mode_trainer_stays_fresh_to_a_replica_with_a_staleness_bound(tmp_path):
    refresh = 0.1
    bound = 2.0  # the replica's DELTA_SYNC_MAX_STALENESS: a few times the refresh, as documented
    base, _ = build_tiny_model(dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    bucket = tmp_path / "bucket"
    publisher = AdapterPublisher(
        bucket, model, PublisherOptions(signing_key=KEY, pointer_refresh=refresh, background=True)
    )
    pointers = PointerLedger(None)  # the replica's record of the newest pointer it accepted
    receiver = Receiver(
        cache=DownloadCache(tmp_path / "replica-cache"),
        verify_key=KEY.verify_key,
        max_staleness=bound,
        pointers=pointers,
    )
    fetcher = AdapterFetcher(receiver)
    identity = bucket_identity(open_bucket(bucket).url)

    def age(pointer) -> float:
        """Seconds since the trainer wrote a pointer the replica accepted (what its freshness is)."""
        return time.time() - pointer.written_at

    try:
        publisher.publish(1)
        publisher.flush()
        first = fetcher.fetch(bucket)
        accepted = pointers.newest(identity)
        assert accepted is not None and accepted.version == 1
        # Nothing more is published. By the time the pointer first fetched has grown older
        # than the replica's bound, a live trainer has written it again.
        wait_for(lambda: age(accepted) > receiver.max_staleness, "the first pointer to outgrow the bound", timeout=60)
        again = fetcher.fetch(bucket)  # signature checked, and accepted as newer by the replica's ledger
        refreshed = pointers.newest(identity)
        assert (again.version, again.path, again.model_checksum) == (1, first.path, first.model_checksum)
        assert refreshed.sequence > accepted.sequence and refreshed.version == 1
        assert age(refreshed) <= receiver.max_staleness, "an idle adapter-mode trainer's pointer went stale"
        assert [report.version for report in publisher.reports] == [1]  # refreshing stores no version
    finally:
        publisher.close()


# -- the worker itself, with a stand-in writer ---------------------------------------------------


@dataclass
class Job:
    version: int
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class StandInWriter:
    """Stores jobs by recording them; fails the versions in `failing`; counts refreshes."""

    rank = 0

    def __init__(self, failing: set[int] = frozenset()) -> None:
        self.failing = failing
        self.stored: list[tuple[int, BaseException | None]] = []
        self.refreshes = 0
        self.pointer_written: float | None = None
        self.closed = False

    def store(self, job: Job, earlier_failure: BaseException | None) -> PublishReport:
        if job.version in self.failing:
            raise OSError(f"version {job.version} failed")
        self.stored.append((job.version, earlier_failure))
        self.pointer_written = time.monotonic()
        return PublishReport(job.version, (), None, None, 0, 0, 0, 0, 1, 0.0, 0.0, "")

    def refresh_pointer(self) -> bool:
        self.refreshes += 1
        self.pointer_written = time.monotonic()
        return True

    def close(self) -> None:
        self.closed = True


def background(writer: StandInWriter, **options) -> BackgroundWriter[Job]:
    defaults = dict(background=True, max_pending=2, pointer_refresh=None, describe=str, bucket_url="stand-in://")
    return BackgroundWriter(writer, **{**defaults, **options})


@pytest.mark.parametrize("in_background", [True, False], ids=["worker", "inline"])
def test_a_failure_is_kept_for_the_training_thread_and_later_jobs_are_dropped_and_released(in_background):
    writer = StandInWriter(failing={2})
    published: list[int] = []
    jobs = background(writer, background=in_background, on_published=[lambda report: published.append(report.version)])
    submitted = [Job(version) for version in (1, 2, 3)]
    for job in submitted:
        jobs.submit(job)
    jobs.flush()
    assert [version for version, _ in writer.stored] == [1] and published == [1]
    assert [report.version for report in jobs.reports] == [1]
    assert all(job.released.is_set() for job in submitted)  # dropped and failed jobs too
    assert isinstance(jobs.pending_failure, OSError)
    failure = jobs.take_failure()
    assert str(failure) == "version 2 failed" and jobs.take_failure() is None
    jobs.submit(Job(4))  # the training thread took the failure: storing goes on
    jobs.close()
    assert [version for version, _ in writer.stored] == [1, 4] and writer.closed


def test_ranks_kept_in_step_hand_later_jobs_to_the_writer_with_the_failure():
    writer = StandInWriter(failing={1})
    jobs = background(writer, keep_in_step=True)
    jobs.submit(Job(1))
    jobs.submit(Job(2))
    jobs.close()
    [(version, earlier)] = writer.stored
    assert version == 2 and str(earlier) == "version 1 failed"


def test_the_idle_worker_refreshes_the_pointer_once_there_is_one():
    writer = StandInWriter()
    jobs = background(writer, pointer_refresh=0.05)
    try:
        assert writer.refreshes == 0  # no pointer yet: nothing to refresh
        jobs.submit(Job(1))
        wait_for(lambda: writer.refreshes >= 2, "the idle worker to refresh the pointer", timeout=60)
        assert [version for version, _ in writer.stored] == [1]
    finally:
        jobs.close()


def test_a_pending_failure_holds_refreshing_back_without_spinning():
    writer = StandInWriter(failing={2})
    jobs = background(writer, background=False, pointer_refresh=60.0)
    jobs.submit(Job(1))
    writer.pointer_written = time.monotonic() - 120  # long due
    assert jobs._refresh_due() == 0.0
    jobs.submit(Job(2))
    # The failure waits for the training thread: no refresh may pretend the trainer is
    # fine, and the worker looks again a period later, not at once.
    assert jobs._refresh_due() == 60.0
    jobs._refresh_pointer()
    assert writer.refreshes == 0
    assert str(jobs.take_failure()) == "version 2 failed"
    jobs._refresh_pointer()
    assert writer.refreshes == 1
    jobs.close()

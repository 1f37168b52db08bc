"""Publisher: anchor/delta schedule, latest.json, retention, background failures, the snapshot
lease, options."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from delta_sync import BF16ChangeDetector, LocalBucket, Publisher, read_file
from delta_sync.changes import Encoding
from delta_sync.errors import PublishError
from delta_sync.layout import Latest, step_versions
from delta_sync.trainer.lease import SnapshotLease
from delta_sync.trainer.publisher import PublisherOptions
from delta_sync.trainer.schedule import AnchorSchedule, Plan

from helpers import WAIT_SECONDS, assert_bit_exact, wait_for
from two_tower import PublishedRun, TwoTower, bf16_state, replica_receiver, train_step


def listing(root) -> tuple[list[int], list[int]]:
    files = [p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")]
    return step_versions(files, "anchor"), step_versions(files, "delta")


def test_schedule_first_anchor_then_deltas_with_periodic_anchors(tmp_path):
    run = PublishedRun(tmp_path, versions=7, anchor_every=3, keep_anchors=10)
    anchors, deltas = listing(tmp_path)
    assert anchors == [1, 4, 7]
    assert deltas == [2, 3, 4, 5, 6, 7]  # every version after the first has a delta
    kinds = [report.kind for report in run.publisher.reports]
    assert kinds == ["anchor", "delta", "delta", "delta+anchor", "delta", "delta", "delta+anchor"]
    latest = Latest.from_json((tmp_path / "latest.json").read_bytes())
    assert (latest.version, latest.anchor_version) == (7, 7)
    assert latest.delta == "deltas/step_00000007.safetensors"
    header = read_file(tmp_path / latest.delta).header
    assert (header.base_version, header.version, header.run_id) == (6, 7, run.publisher.run_id)
    assert latest.model_checksum == header.model_checksum
    run.close()


def test_anchor_equals_the_trainer_state_and_deltas_chain_to_it(tmp_path):
    run = PublishedRun(tmp_path, versions=4, anchor_every=3, keep_anchors=10)
    anchor = read_file(tmp_path / "anchors/step_00000004.safetensors")
    assert_bit_exact(run.states[4], dict(anchor.items()))
    delta = read_file(tmp_path / "deltas/step_00000004.safetensors")
    assert delta.header.model_checksum == anchor.header.model_checksum
    run.close()


def test_retention_keeps_newest_anchors_and_what_follows_them(tmp_path):
    run = PublishedRun(tmp_path, versions=10, anchor_every=3, keep_anchors=2)
    anchors, deltas = listing(tmp_path)
    assert anchors == [7, 10]
    assert deltas == [8, 9, 10]
    # Everything a replica needs is still there: a late joiner and one at v7 both converge.
    late, late_replica = replica_receiver()
    assert late.update(tmp_path).version == 10
    assert_bit_exact(run.states[10], bf16_state(late_replica))
    run.close()


def test_empty_delta_when_nothing_changed(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with BF16ChangeDetector(model, optimizer) as detector:
        publisher = Publisher(tmp_path, detector, background=False)
        train_step(model, optimizer, seed=0)
        publisher.publish(1)
        publisher.publish(2)  # no optimizer step in between
        publisher.close()
    delta = read_file(tmp_path / "deltas/step_00000002.safetensors")
    assert delta.changes == {} and delta.header.sparsity == 1.0
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 2


def test_versions_must_increase(tmp_path):
    run = PublishedRun(tmp_path, versions=2)
    with pytest.raises(ValueError, match="must be greater than the last published 2"):
        run.publisher.publish(2)
    run.close()


def test_background_publishing_stores_every_version_in_order(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    seen = []
    publisher = Publisher(tmp_path, detector, anchor_every=4, on_published=[lambda r: seen.append(r.version)])
    states = {}
    for version in range(1, 10):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
        states[version] = bf16_state(model)
    publisher.close()
    assert seen == list(range(1, 10))
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 9
    assert_bit_exact(states[9], bf16_state(replica))


def test_failure_is_raised_at_the_next_publish_and_the_next_version_is_an_anchor(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    publisher = Publisher(tmp_path, detector, anchor_every=100)
    train_step(model, optimizer, seed=1)
    publisher.publish(1)
    publisher.flush()
    # A real storage fault: a plain file sits where the deltas directory should be.
    (tmp_path / "deltas").write_text("not a directory")
    train_step(model, optimizer, seed=2)
    publisher.publish(2)
    wait_for(lambda: publisher.pending_error is not None, "the background upload of v2 to fail", timeout=30.0)
    train_step(model, optimizer, seed=3)
    with pytest.raises(PublishError, match="publishing to .* failed"):
        publisher.publish(3)
    (tmp_path / "deltas").unlink()
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 1  # never moved past the gap
    publisher.publish(3)
    publisher.close()
    assert publisher.reports[-1].kind == "anchor" and publisher.reports[-1].version == 3
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 3
    assert_bit_exact(bf16_state(model), bf16_state(replica))


def test_failure_is_raised_on_close(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    publisher = Publisher(tmp_path / "bucket", detector)
    (tmp_path / "bucket").write_text("a file, not a directory")
    train_step(model, optimizer, seed=1)
    publisher.publish(1)
    with pytest.raises(PublishError, match=r"publishing to .*/bucket failed: .*Not a directory: .*/bucket/anchors"):
        publisher.close()


def test_a_prefix_holding_another_run_is_refused_unless_overwritten(tmp_path):
    first = PublishedRun(tmp_path, versions=3)
    first.close()
    torch.manual_seed(1)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    with pytest.raises(PublishError, match=f"already holds .* of run {first.publisher.run_id}"):
        Publisher(tmp_path, detector)
    # Resuming the same run is fine; overwrite deletes the old run's files.
    Publisher(tmp_path, detector, run_id=first.publisher.run_id).close()
    publisher = Publisher(tmp_path, detector, overwrite=True, background=False)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []
    train_step(model, optimizer, seed=0)
    publisher.publish(1)
    publisher.close()
    assert Latest.from_json((tmp_path / "latest.json").read_bytes()).run_id == publisher.run_id


def test_a_second_trainer_cannot_overwrite_a_stored_version(tmp_path):
    run = PublishedRun(tmp_path, versions=2)
    from delta_sync import LocalBucket
    from delta_sync.errors import BucketConflictError

    with pytest.raises(BucketConflictError, match="already exists"):
        LocalBucket(tmp_path).upload("deltas/step_00000002.safetensors", b"impostor", overwrite=False)
    assert read_file(tmp_path / "deltas/step_00000002.safetensors").header.run_id == run.publisher.run_id
    run.close()


def test_resuming_a_run_replaces_its_abandoned_later_versions(tmp_path):
    first = PublishedRun(tmp_path, versions=6, anchor_every=3)
    first.close()
    torch.manual_seed(5)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    # Resumed from a checkpoint taken at step 4: versions 5 and 6 are rewritten.
    publisher = Publisher(tmp_path, detector, run_id=first.publisher.run_id, background=False)
    train_step(model, optimizer, seed=50)
    publisher.publish(5)
    publisher.close()
    anchors, deltas = listing(tmp_path)
    assert 5 in anchors and 6 not in deltas and 6 not in anchors
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 5
    assert_bit_exact(bf16_state(model), bf16_state(replica))


def test_a_version_where_most_elements_changed_is_an_anchor_alone(tmp_path):
    # At lr 1e-2 nearly every element changes: a raw delta (6 bytes per changed element)
    # would be larger than the anchor (2 bytes per element), and costlier to apply.
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    publisher = Publisher(tmp_path, BF16ChangeDetector(model, optimizer), anchor_every=100, background=False)
    for version in (1, 2):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
    publisher.close()
    report = publisher.reports[-1]
    assert report.kind == "anchor" and report.delta is None and report.changed_elements * 3 > report.total_elements
    assert json.loads((tmp_path / "latest.json").read_text())["delta"] is None
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 2
    assert_bit_exact(bf16_state(model), bf16_state(replica))


def test_an_anchor_is_written_once_the_deltas_outweigh_the_last_one(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = Publisher(
        tmp_path, BF16ChangeDetector(model, optimizer), anchor_every=1000, anchor_bytes_ratio=0.5, background=False
    )
    for version in range(1, 13):
        train_step(model, optimizer, seed=version)
        publisher.publish(version)
    publisher.close()
    reports = publisher.reports
    anchors = [r for r in reports if r.anchor]
    assert len(anchors) >= 2, "deltas of ~10% of the model should outweigh half an anchor within a few versions"
    anchor_size = reports[0].bytes_written
    for report in reports:
        # A replica joining at any version downloads at most one anchor plus half an anchor
        # of deltas, plus the one delta that crossed the line.
        assert report.catch_up_bytes <= anchor_size * 1.5 + report.delta_bytes + 1024


# -- the anchor schedule, on its own ------------------------------------------------------------

DELTA, ANCHOR, BOTH = Plan(delta=True, anchor=False), Plan(delta=False, anchor=True), Plan(delta=True, anchor=True)


def test_schedule_by_count_starts_with_an_anchor_alone_and_adds_one_every_n_versions():
    schedule = AnchorSchedule(every=3, bytes_ratio=None)
    plans = [schedule.plan(changed=1, total=100) for _ in range(7)]
    assert plans == [ANCHOR, DELTA, DELTA, BOTH, DELTA, DELTA, BOTH]


def test_schedule_by_bytes_adds_an_anchor_once_the_deltas_outweigh_the_fraction():
    schedule = AnchorSchedule(every=1000, bytes_ratio=0.5)
    assert schedule.plan(changed=1, total=100) == ANCHOR
    schedule.stored_anchor(100)
    assert schedule.plan(changed=1, total=100) == DELTA
    schedule.stored_delta(30)
    assert not schedule.catch_up_heavy and schedule.catch_up_bytes == 130
    assert schedule.plan(changed=1, total=100) == DELTA
    schedule.stored_delta(30)  # 60 bytes of deltas > 0.5 * 100
    assert schedule.catch_up_heavy
    assert schedule.plan(changed=1, total=100) == BOTH
    schedule.stored_anchor(120)  # the deltas before it no longer count
    assert not schedule.catch_up_heavy and schedule.catch_up_bytes == 120
    # Another rank's verdict (rank 0's, with parts) overrides the schedule's own.
    assert schedule.plan(changed=1, total=100, catch_up_heavy=True) == BOTH
    assert schedule.plan(changed=1, total=100, catch_up_heavy=False) == DELTA


def test_schedule_stores_a_mostly_changed_version_and_one_after_a_failure_as_an_anchor_alone():
    schedule = AnchorSchedule(every=1000, bytes_ratio=None)
    assert schedule.plan(changed=0, total=99) == ANCHOR
    assert schedule.plan(changed=33, total=99) == DELTA  # a third is not more than a third
    assert schedule.plan(changed=34, total=99) == ANCHOR
    schedule.restart()
    assert schedule.plan(changed=1, total=99) == ANCHOR
    assert schedule.plan(changed=1, total=99) == DELTA


# -- the snapshot lease ---------------------------------------------------------------------


def test_a_snapshot_lease_releases_its_lock_exactly_once():
    lock = threading.Lock()
    lease = SnapshotLease.take(lock)
    assert lease.held and lock.locked()
    lease.release()
    assert not lease.held and not lock.locked()
    lock.acquire()  # someone else's hold now: a second release must not end it
    lease.release()
    assert lock.locked()
    lock.release()
    empty = SnapshotLease.none()
    assert not empty.held
    empty.release()


class GatedBucket(LocalBucket):
    """A test double for a slow bucket: a `LocalBucket` whose every upload of a version file
    waits on `gate`, an event the test sets, after recording whether the detector's snapshot
    lock was held as the upload began."""

    def __init__(self, root, snapshot_lock: threading.Lock) -> None:
        super().__init__(root)
        self.snapshot_lock = snapshot_lock
        self.gate = threading.Event()
        self.uploading = threading.Event()
        self.lock_held_at_upload: list[bool] = []

    def upload(self, path, source, *, overwrite=True):
        if path.endswith(".safetensors"):
            self.lock_held_at_upload.append(self.snapshot_lock.locked())
            self.uploading.set()
            assert self.gate.wait(WAIT_SECONDS), "the test never opened the gate"
        super().upload(path, source, overwrite=overwrite)


def test_the_next_version_is_detected_while_the_previous_upload_runs(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    detector = BF16ChangeDetector(model, optimizer)
    bucket = GatedBucket(tmp_path, detector.snapshot_lock)
    # v1 is an anchor and v2 a compact delta plus an anchor: both are encoded from the snapshot.
    publisher = Publisher(bucket, detector, anchor_every=1, encoding="compact")
    try:
        train_step(model, optimizer, seed=1)
        publisher.publish(1)
        assert bucket.uploading.wait(WAIT_SECONDS), "v1's upload never began"
        train_step(model, optimizer, seed=2)
        detected = threading.Event()
        second = threading.Thread(target=lambda: (publisher.publish(2), detected.set()), daemon=True)
        second.start()
        assert detected.wait(WAIT_SECONDS), "publishing v2 waited for v1's upload to end"
        assert not (tmp_path / "latest.json").exists(), "v1's upload was still to end"
    finally:
        bucket.gate.set()
    second.join(WAIT_SECONDS)
    publisher.close()
    assert [report.kind for report in publisher.reports] == ["anchor", "delta+anchor"]
    assert bucket.lock_held_at_upload == [False, False, False], "an upload began while the snapshot was held"
    receiver, replica = replica_receiver()
    assert receiver.update(tmp_path).version == 2
    assert_bit_exact(bf16_state(model), bf16_state(replica))
    detector.close()


# -- options ----------------------------------------------------------------------------------


def test_publisher_options_take_the_encodings_value_and_name_a_bad_field(tmp_path):
    assert PublisherOptions(encoding="compact").encoding is Encoding.COMPACT
    assert PublisherOptions().encoding is Encoding.RAW
    with pytest.raises(ValueError, match="encoding must be 'raw' or 'compact', got 'dense'"):
        PublisherOptions(encoding="dense")
    with pytest.raises(ValueError, match="keep_anchors must be >= 1, got 0"):
        PublisherOptions(keep_anchors=0)
    with pytest.raises(ValueError, match="anchor_every must be >= 1, got 0"):
        PublisherOptions(anchor_every=0)


def test_publisher_takes_options_and_keywords_on_top_of_them(tmp_path):
    torch.manual_seed(0)
    model = TwoTower()
    detector = BF16ChangeDetector(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    options = PublisherOptions(anchor_every=4, background=False, run_id="run-a")
    publisher = Publisher(tmp_path, detector, options, anchor_every=2)
    assert publisher.options == PublisherOptions(anchor_every=2, background=False, run_id="run-a")
    assert publisher.run_id == "run-a"
    publisher.close()
    with pytest.raises(TypeError, match="anchor_evry"):
        Publisher(tmp_path, detector, anchor_evry=2)
    detector.close()


def test_anchors_and_compact_deltas_read_from_a_host_mirror_are_the_same_files(tmp_path):
    """A detector with a host mirror hands the writer the mirror, not the snapshot: every
    anchor and compact delta holds the same tensors as without one, and a replica replays
    each version bit for bit."""
    stored = {}
    for mirrored in (False, True):
        torch.manual_seed(0)
        model = TwoTower(torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        detector = BF16ChangeDetector(model, optimizer, host_mirror=mirrored)
        assert (detector.mirror is not None) == mirrored
        root = tmp_path / f"mirrored-{mirrored}"
        publisher = Publisher(
            root, detector, anchor_every=3, keep_anchors=10, background=False, encoding="compact", run_id="run"
        )
        replica, replica_model = replica_receiver()
        for version in range(1, 6):
            train_step(model, optimizer, seed=version)
            publisher.publish(version)
            assert replica.update(root).version == version
            assert_bit_exact(bf16_state(model), bf16_state(replica_model))
        publisher.close()
        detector.close()
        stored[mirrored] = {path.relative_to(root): load_file(path) for path in sorted(root.glob("*/*.safetensors"))}
    assert sorted(stored[True]) == sorted(stored[False])
    assert {path.parts[0] for path in stored[True]} == {"anchors", "deltas"} and len(stored[True]) >= 5
    for path, tensors in stored[True].items():
        assert sorted(tensors) == sorted(stored[False][path]), path
        for name, tensor in tensors.items():  # the bytes of every tensor: bf16 weights, compact streams
            assert torch.equal(tensor.view(torch.uint8), stored[False][path][name].view(torch.uint8)), (path, name)

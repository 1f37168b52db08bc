"""Versions prepared ahead of the update: `Receiver.prefetch` and the `Prefetcher` thread,
over a real node snapshot and a local bucket."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from delta_sync import Receiver, expected_shapes_of, module_weight_loader
from delta_sync.layout import LATEST, delta_path
from delta_sync.replica.prefetch import Prefetcher
from delta_sync.replica.shared import NodeStore

from helpers import assert_bit_exact, wait_for
from two_tower import TwoTower, bf16_state, replica_receiver


def node_worker(snapshot_dir) -> tuple[Receiver, TwoTower]:
    replica = TwoTower()
    receiver = Receiver(
        store=NodeStore(snapshot_dir),
        load_weights=module_weight_loader(replica),
        expected_shapes=expected_shapes_of(replica),
    )
    return receiver, replica


def test_a_prefetched_version_is_loaded_without_reading_its_file_again(stepwise, tmp_path):
    receiver, model = node_worker(tmp_path / "snapshots")
    receiver.update(stepwise.root)
    for _ in range(3):
        stepwise.step()
    assert receiver.prefetch(stepwise.root) == 4
    # Prepared, not served: the model still holds v1 and says so.
    assert receiver.version == receiver.serving.version == 1 and receiver.prepared_version == 4
    assert_bit_exact(stepwise.states[1], bf16_state(model))

    (stepwise.root / delta_path(3)).write_bytes(b"gone")  # never read again: the snapshot holds it
    pending = receiver.prepare(stepwise.root, delta_path(3))
    assert pending.last.applied == () and pending.last.snapshot_version == 4
    receiver.commit(pending)
    assert_bit_exact(stepwise.states[3], bf16_state(model))
    result = receiver.update(stepwise.root)
    assert result.applied == () and result.version == 4
    assert_bit_exact(stepwise.states[4], bf16_state(model))


def test_the_prefetcher_prepares_each_new_version_while_the_model_serves_the_old_one(stepwise, tmp_path):
    receiver, model = node_worker(tmp_path / "snapshots")
    receiver.update(stepwise.root)
    prefetcher = Prefetcher(receiver, interval=0.05)
    prefetcher.watch(stepwise.root)
    prefetcher.start()
    try:
        for _ in range(2):
            version = stepwise.step()
            wait_for(lambda v=version: receiver.prepared_version == v, f"v{version} prepared")
            assert receiver.serving.version == 1
        assert_bit_exact(stepwise.states[1], bf16_state(model))
        assert receiver.update(stepwise.root).applied == ()
        assert_bit_exact(stepwise.states[3], bf16_state(model))
    finally:
        prefetcher.stop()


def test_a_hint_prepares_at_once_and_a_failure_is_retried(stepwise, tmp_path, caplog):
    receiver, _ = node_worker(tmp_path / "snapshots")
    prefetcher = Prefetcher(receiver, interval=3600)  # only hints wake it
    prefetcher.start()
    try:
        pointer = (stepwise.root / LATEST).read_bytes()
        (stepwise.root / LATEST).write_bytes(b"{not json")
        with caplog.at_level(logging.WARNING, logger="delta_sync"):
            prefetcher.hint(str(stepwise.root))
            wait_for(lambda: "prefetching" in caplog.text and "failed (retrying)" in caplog.text, "the failure logged")
        assert receiver.prepared_version is None
        (stepwise.root / LATEST).write_bytes(pointer)
        prefetcher.hint()
        wait_for(lambda: receiver.prepared_version == 1, "v1 prepared after the pointer was repaired")
        assert prefetcher.watched == [receiver.check_bucket(stepwise.root).url]
    finally:
        prefetcher.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux gives a thread a nice value of its own")
def test_the_prefetch_thread_yields_the_cores_to_the_server(stepwise, tmp_path):
    receiver, _ = node_worker(tmp_path / "snapshots")
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    prefetcher = Prefetcher(receiver, interval=3600, niceness=5)
    prefetcher.start()
    try:
        wait_for(
            lambda: (
                prefetcher.native_id is not None
                and os.getpriority(os.PRIO_PROCESS, prefetcher.native_id) == min(19, caller + 5)
            ),
            "the prefetch thread's nice value raised by 5",
        )
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # the rest keep theirs
    finally:
        prefetcher.stop()
    with pytest.raises(ValueError, match="niceness must be in 0-19"):
        Prefetcher(receiver, niceness=20)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="only Linux moves a thread to given CPUs")
def test_the_prefetch_thread_runs_on_the_cpus_it_is_given(stepwise, tmp_path):
    receiver, _ = node_worker(tmp_path / "snapshots")
    mine = os.sched_getaffinity(0)
    chosen = max(mine)
    prefetcher = Prefetcher(receiver, interval=3600, cpus={chosen})
    assert prefetcher.running_on is None  # not started
    prefetcher.start()
    try:
        wait_for(lambda: prefetcher.running_on == [chosen], f"the prefetch thread moved to CPU {chosen}")
        assert os.sched_getaffinity(0) == mine  # the caller keeps its own
    finally:
        prefetcher.stop()
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        Prefetcher(receiver, cpus=())


def test_a_private_snapshot_is_not_prefetched(stepwise):
    receiver, _ = replica_receiver()
    with pytest.raises(ValueError, match="needs a shared snapshot"):
        receiver.prefetch(stepwise.root)
    with pytest.raises(ValueError, match="interval must be > 0"):
        Prefetcher(receiver, interval=0)


def test_another_buckets_versions_wait_until_an_update_asks_for_that_bucket(stepwise, tmp_path):
    from two_tower import PublishedRun

    other = PublishedRun(tmp_path / "other", versions=2)
    try:
        receiver, model = node_worker(tmp_path / "snapshots")
        receiver.update(stepwise.root)
        assert receiver.prefetch(other.root) is None  # the model's version is in this bucket's snapshot
        stepwise.step()
        assert receiver.prefetch(stepwise.root) == 2
        receiver.update(stepwise.root)
        assert_bit_exact(stepwise.states[2], bf16_state(model))
        assert receiver.update(other.root).version == 2  # an update moves it
        assert_bit_exact(other.states[2], bf16_state(model))
    finally:
        other.close()

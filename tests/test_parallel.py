"""`parallel_map`: results in order, work on more than one thread, failures, nesting."""

from __future__ import annotations

import os
import threading

import pytest

from delta_sync import parallel
from delta_sync.parallel import parallel_map

pytestmark = pytest.mark.timeout(60)


def test_results_come_in_the_order_of_the_items():
    assert parallel_map(lambda x: x * x, range(200)) == [x * x for x in range(200)]
    assert parallel_map(str, []) == []
    assert parallel_map(str, [7]) == ["7"]


def test_items_run_on_several_threads_at_once(monkeypatch):
    monkeypatch.setattr(parallel, "_WORKERS", max(2, parallel._WORKERS))  # also on a one-core machine
    # Each item waits until the other has started: this passes only if two threads run
    # items concurrently (a Barrier with a deadline, not a sleep).
    together = threading.Barrier(2, timeout=20)

    def work(item):
        together.wait()
        return threading.get_ident()

    assert len(set(parallel_map(work, range(2)))) == 2


def test_the_first_failure_propagates_and_stops_the_work():
    started = []

    def work(item):
        started.append(item)
        if item in (3, 5):
            raise ValueError(f"item {item}")
        return item

    with pytest.raises(ValueError, match="item 3"):
        parallel_map(work, range(1000))
    assert len(started) < 1000


def test_nested_calls_finish_when_every_pool_thread_is_busy(monkeypatch):
    monkeypatch.setattr(parallel, "_WORKERS", max(2, parallel._WORKERS))

    # More nesting than pool threads: an inner call must not wait for a pool thread that
    # its own caller occupies.
    def inner(outer):
        return parallel_map(lambda x: parallel_map(lambda y: outer * x * y, range(3)), range(3))

    assert parallel_map(inner, range(4)) == [[[o * x * y for y in range(3)] for x in range(3)] for o in range(4)]


def test_the_thread_count_follows_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("DELTA_SYNC_THREADS", raising=False)
    assert parallel.thread_count() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("DELTA_SYNC_THREADS", "3")
    assert parallel.thread_count() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("DELTA_SYNC_THREADS", bad)
        with pytest.raises(ValueError, match="DELTA_SYNC_THREADS must be a positive integer"):
            parallel.thread_count()

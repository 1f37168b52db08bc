"""Follow mode (`delta_sync.replica.follow.Follower`) against the fake vLLM server, and the
conditional reads it polls `latest.json` with on every backend.

The fake server applies the bucket's files with a real `Receiver`; a recorder on it lists
every file actually applied, so "each version exactly once" is checked on what happened.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading

import pytest

from delta_sync.control import Route
from delta_sync.errors import BucketFileNotFoundError, BucketUnavailableError
from delta_sync.layout import LATEST
from delta_sync.replica.follow import Follower
from delta_sync.storage import Bucket, LocalBucket, open_bucket
from delta_sync.trainer.replicas import ReplicaSet

from fake_vllm import FakeVLLM
from helpers import WAIT_SECONDS, assert_bit_exact, cli, wait_for
from two_tower import PublishedRun, bf16_state, resume_in_place


def record_applied(server: FakeVLLM) -> list[str]:
    """Every file the server's receiver applies from now on, in order (no-ops add nothing)."""
    applied: list[str] = []
    update = server.receiver.update

    def recording(bucket, filename=None):
        result = update(bucket, filename)
        applied.extend(result.applied)
        return result

    server.receiver.update = recording
    return applied


def paths(applied: list[str], bucket: str) -> list[str]:
    """The bucket paths of the files applied."""
    return [source.removeprefix(bucket + "/") for source in applied]


class CountedStop(threading.Event):
    """A stop event for [`Follower.run`] that records each wait it is asked for, returns at
    once, and is set after `polls` of them: the loop runs deterministically, with no sleeping."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if len(self.waits) >= self.polls:
            self.set()
        return self.is_set()


# -- the follower ---------------------------------------------------------------------------


def test_follower_applies_each_new_version_exactly_once(stepwise, server, caplog):
    applied = record_applied(server)
    bucket = stepwise.root.as_uri()
    with Follower(stepwise.root, server.url, retry_seconds=1.0) as follower, caplog.at_level(logging.INFO):
        first = follower.poll_once()
        assert first.version == 1 and first.model_checksum == stepwise.publisher.reports[-1].model_checksum
        assert follower.poll_once() is None  # in step: nothing sent
        stepwise.step()
        assert follower.poll_once().version == 2
        stepwise.step()
        stepwise.step()
        assert follower.poll_once().version == 4  # two versions missed: one catch-up
        assert follower.poll_once() is None
    assert server.update_infos() == [{"bucket": bucket}] * 3  # always a catch-up: the server picks the files
    assert paths(applied, bucket) == [
        "anchors/step_00000001.safetensors",
        "deltas/step_00000002.safetensors",
        "deltas/step_00000003.safetensors",
        "deltas/step_00000004.safetensors",
    ]
    assert_bit_exact(stepwise.states[4], server.receiver.weights)
    served = [record.getMessage() for record in caplog.records if "serves version" in record.getMessage()]
    assert len(served) == 3 and "serves version 4" in served[-1] and "was version 2" in served[-1]


def test_follower_waits_for_the_first_publish(tmp_path, server):
    with Follower(tmp_path / "empty", server.url) as follower:
        assert follower.poll_once() is None
    assert Route.START not in server.routes()


def test_follower_survives_a_server_that_is_down_then_recovers(stepwise, server, caplog):
    """Polls that fail wait longer each time (bounded); a good poll returns to the interval."""
    down = server.add_fault(Route.COLLECTIVE_RPC, 503, count=3)
    stop = CountedStop(polls=5)
    with Follower(stepwise.root, server.url, interval=1.0, max_backoff=4.0, retry_seconds=0) as follower:
        with caplog.at_level(logging.WARNING, logger="delta_sync"):
            follower.run(stop)
    assert down.hits == 3
    assert stop.waits == [2.0, 4.0, 4.0, 1.0, 1.0]  # three failures, the catch-up, in step
    assert server.receiver.version == 1
    assert caplog.text.count("next try in") == 3 and "unreachable" in caplog.text


def test_follower_survives_a_dead_server_with_bounded_waits(stepwise):
    dead = FakeVLLM().start()
    dead.stop()
    stop = CountedStop(polls=6)
    with Follower(stepwise.root, dead.url, interval=0.5, max_backoff=3.0, retry_seconds=0) as follower:
        follower.run(stop)
    assert stop.waits == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


class FlakyBucket(LocalBucket):
    """A local bucket whose first `failures` conditional reads fail as an unreachable store would."""

    def __init__(self, root, failures: int) -> None:
        super().__init__(root)
        self.failures = failures
        self.reads = 0

    def read_if_changed(self, path: str, tag: str | None) -> tuple[bytes | None, str]:
        self.reads += 1
        if self.reads <= self.failures:
            raise BucketUnavailableError(f"{self.url}: read {path!r}: injected outage")
        return super().read_if_changed(path, tag)


def test_follower_survives_a_bucket_read_failure(stepwise, server, caplog):
    bucket = FlakyBucket(stepwise.root, failures=2)
    stop = CountedStop(polls=4)
    with Follower(bucket, server.url, interval=1.0, max_backoff=10.0) as follower:
        with caplog.at_level(logging.WARNING, logger="delta_sync"):
            follower.run(stop)
    assert stop.waits == [2.0, 4.0, 1.0, 1.0]
    assert "injected outage" in caplog.text and server.receiver.version == 1


def test_follower_stops_on_request(stepwise, server):
    stop = threading.Event()
    follower = Follower(stepwise.root, server.url, interval=0.05, retry_seconds=1.0)
    thread = threading.Thread(target=follower.run, args=(stop,), name="follower")
    thread.start()
    try:
        wait_for(lambda: server.receiver.version == 1, "the server to hold v1")
        stepwise.step()
        wait_for(lambda: server.receiver.version == 2, "the server to hold v2")
    finally:
        stop.set()
        thread.join(timeout=WAIT_SECONDS)
        follower.close()
    assert not thread.is_alive()
    assert_bit_exact(stepwise.states[2], server.receiver.weights)


def test_follower_leaves_a_newer_pushed_version_alone(stepwise, server):
    """The server serves a newer version of the run than the pointer read (a push got there
    first): the follower sends nothing, and never moves a server back."""
    pointer = stepwise.root / LATEST
    with Follower(stepwise.root, server.url) as follower:
        follower.poll_once()
        first = pointer.read_bytes()
        stepwise.step()
        follower.replica.update(stepwise.root.as_uri(), stepwise.publisher.reports[-1].delta)
        pointer.write_bytes(first)  # the pointer as a poll racing the publish could have read it
        calls = len(server.calls)
        assert follower.poll_once() is None
    assert [call.route for call in server.calls[calls:]] == [Route.COLLECTIVE_RPC]
    assert server.receiver.version == 2


# -- push and follow at once ------------------------------------------------------------------


def test_push_and_follow_at_once_apply_each_version_once(stepwise, server):
    """A trainer's ReplicaSet and a follower drive one server together: every version is
    applied once, no client ends another's session, and both see the newest weights."""
    applied = record_applied(server)
    bucket = stepwise.root.as_uri()
    stop = threading.Event()
    follower = Follower(stepwise.root, server.url, interval=0.01, retry_seconds=5.0)
    thread = threading.Thread(target=follower.run, args=(stop,), name="follower")
    replicas = ReplicaSet([server.url], bucket, retry_seconds=5.0)
    thread.start()
    try:
        for _ in range(6):
            report = stepwise.publisher.reports[-1]
            replicas.announce(report.version, report.delta, report.model_checksum)
            assert replicas.wait(report.version, timeout=WAIT_SECONDS) == []
            stepwise.step()
        wait_for(lambda: server.receiver.version == stepwise.version, f"the server to hold v{stepwise.version}")
    finally:
        stop.set()
        thread.join(timeout=WAIT_SECONDS)
        follower.close()
        replicas.close()
    assert not thread.is_alive()
    files = paths(applied, bucket)
    assert len(files) == len(set(files)) == stepwise.version  # the anchor of v1, then one delta per version
    # Every session was finished by the client that opened it: no FINISH was ever refused.
    assert set(call.status for call in server.calls if call.route == Route.FINISH) == {200}
    assert_bit_exact(stepwise.states[stepwise.version], server.receiver.weights)


# -- conditional reads of latest.json ----------------------------------------------------------


def conditional_read_changes(bucket: Bucket) -> None:
    bucket.upload(LATEST, b'{"v": 1}')
    content, tag = bucket.read_if_changed(LATEST, None)
    assert content == b'{"v": 1}' and tag
    assert bucket.read_if_changed(LATEST, tag) == (None, tag)
    bucket.upload(LATEST, b'{"v": 22}')
    content, newer = bucket.read_if_changed(LATEST, tag)
    assert content == b'{"v": 22}' and newer != tag
    assert bucket.read_if_changed(LATEST, newer) == (None, newer)
    with pytest.raises(BucketFileNotFoundError, match="no file 'nothing.json'"):
        bucket.read_if_changed("nothing.json", None)


def test_conditional_read_on_every_backend(bucket_target):
    conditional_read_changes(open_bucket(bucket_target.url))


class MemoryBucket(Bucket):
    """The smallest Bucket: the default `read_if_changed` (read, compare digests) applies."""

    url = "memory://test"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def upload(self, path, source, *, overwrite=True):
        self.files[path] = bytes(source)

    def download(self, path, dest, *, max_bytes=None):
        raise NotImplementedError

    def read_bytes(self, path):
        if path not in self.files:
            raise self._not_found(path)
        return self.files[path]

    def list(self, prefix=""):
        return sorted(self.files)

    def delete(self, paths):
        for path in paths:
            self.files.pop(path, None)


def test_default_conditional_read_compares_digests():
    conditional_read_changes(MemoryBucket())


def s3_requests(bucket) -> list[tuple[str, int]]:
    """(operation, HTTP status) of every request the bucket's S3 client sends from now on."""
    seen: list[tuple[str, int]] = []

    def record(http_response, model, **_):
        seen.append((model.name, http_response.status_code))

    bucket._client.meta.events.register("after-call.s3", record)
    return seen


def test_s3_poll_with_no_change_costs_one_request_answered_304(s3_target, server, tmp_path):
    run = PublishedRun(s3_target.url, versions=2)
    try:
        with Follower(s3_target.url, server.url) as follower:
            assert follower.poll_once().version == 2
            requests = s3_requests(follower.bucket)
            assert follower.poll_once() is None
            assert requests == [("GetObject", 304)]
            run.step()
            assert follower.poll_once().version == 3
            assert requests[1:] == [("GetObject", 200)]
            assert_bit_exact(run.states[3], server.receiver.weights)
    finally:
        run.close()


def test_hf_poll_with_no_change_costs_one_paths_info_request(hf_target, server):
    run = PublishedRun(hf_target.url, versions=1)
    try:
        with Follower(hf_target.url, server.url) as follower:
            assert follower.poll_once().version == 1
            mark = len(hf_target.hub.requests)
            assert follower.poll_once() is None
            requests = hf_target.hub.requests_since(mark)
            assert [(r.method, r.path.rsplit("/", 1)[-1]) for r in requests] == [("POST", "paths-info")]
    finally:
        run.close()


# -- the command line ---------------------------------------------------------------------------


def test_cli_follows_until_terminated(stepwise, server):
    process = subprocess.Popen(
        [sys.executable, "-m", "delta_sync.cli", "follow", str(stepwise.root), "--vllm-url", server.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(
            lambda: server.receiver.version == 1 or process.poll() is not None, "the follower to apply v1 (or exit)"
        )
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=WAIT_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert f"following {stepwise.root.as_uri()} for {server.url}" in output
    assert "serves version 1" in output


def test_cli_refuses_a_bad_interval(tmp_path):
    result = cli("follow", str(tmp_path), "--vllm-url", "http://x", "--interval", "0", timeout=120)
    assert result.returncode == 2 and "--interval" in result.stderr


def test_follower_converges_when_a_resumed_run_reaches_the_held_version_number(tmp_path, server):
    """A run resumed in place from step 4 reaches v6 again: the server holds the abandoned
    v6 (the pointer's number, other weights). One poll moves it to the new v6; the next
    finds it in step and sends nothing."""
    first = PublishedRun(tmp_path, versions=6, anchor_every=3, keep_anchors=10)
    first.close()
    with Follower(tmp_path, server.url) as follower:
        assert follower.poll_once().version == 6
        model, publisher = resume_in_place(tmp_path, first.publisher.run_id, (5, 6))
        status = follower.poll_once()
        assert status.version == 6 and status.model_checksum == publisher.reports[-1].model_checksum
        assert follower.poll_once() is None
    assert_bit_exact(bf16_state(model), dict(server.receiver.weights))

"""The trainer's control plane (`Replica`, `ReplicaSet`) against a fake vLLM server.

The fake server applies the bucket's files with a real `Receiver`, so versions and
checksums are genuine; faults are injected per route.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from delta_sync.control import STATUS_METHOD, Route
from delta_sync.control.client import Replica
from delta_sync.errors import ReplicaError
from delta_sync.trainer.replicas import ReplicaSet

from fake_vllm import FakeVLLM
from helpers import WAIT_SECONDS, assert_bit_exact, wait_for
from two_tower import PublishedRun

#: One update, in order: START, UPDATE, then FINISH with generation paused, then the status.
UPDATE_ROUTES = [
    Route.START,
    Route.UPDATE,
    Route.PAUSE,
    Route.FINISH,
    Route.RESET_PREFIX_CACHE,
    Route.RESUME,
    Route.COLLECTIVE_RPC,
]


@pytest.fixture
def replica(server):
    client = Replica(server.url, retry_seconds=10.0, timeout=30.0)
    yield client
    client.close()


def bucket_of(run: PublishedRun) -> str:
    return run.root.as_uri()


def statuses_of(server: FakeVLLM, route: str) -> list[int]:
    return [call.status for call in server.calls if call.route == route]


# -- the fake itself answers like vLLM ------------------------------------------------------------


def test_fake_server_answers_like_vllm(run, server):
    with httpx.Client(base_url=server.url) as http:
        refused = http.post(Route.UPDATE, json={"update_info": {"bucket": bucket_of(run)}})
        assert refused.status_code == 500
        assert refused.json()["error"]["message"] == "start_weight_update must be called before update_weights."
        assert http.post(Route.START).json() == {"message": "Weight update started"}
        again = http.post(Route.START)
        assert again.status_code == 500 and again.json()["error"]["type"] == "InternalServerError"
        assert "already active" in again.json()["error"]["message"]
        bad = http.post(Route.UPDATE, json={"update_info": {"bucket": bucket_of(run), "version": 3}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
        results = http.post(Route.COLLECTIVE_RPC, json={"method": STATUS_METHOD}).json()["results"]
        assert results == [
            {
                "version": None,
                "anchor_version": None,
                "run_id": None,
                "model_checksum": None,
                "pending": 0,
                "updating": False,
                "prepared_version": None,
                "pointer_age_s": None,
                "stale": False,
            }
        ]


# -- Replica ------------------------------------------------------------------------------------


def test_update_catches_up_then_applies_a_delta_and_confirms(run, server, replica):
    status = replica.update(bucket_of(run))  # no filename: catch up to latest.json
    assert status.version == 5 and status.run_id == run.publisher.run_id
    assert status.model_checksum == run.publisher.reports[-1].model_checksum
    assert not status.updating
    assert server.routes() == UPDATE_ROUTES
    assert server.calls[2].params == {"mode": "keep"} and not server.paused

    version = run.step()
    delta = run.publisher.reports[-1].delta
    status = replica.update(bucket_of(run), delta)
    assert status.version == version and status.model_checksum == run.publisher.reports[-1].model_checksum
    assert server.update_infos()[-1] == {"bucket": bucket_of(run), "filename": delta}
    assert_bit_exact(run.states[version], server.receiver.weights)


def test_no_pause_mode_sends_no_pause(run, server):
    client = Replica(server.url, pause_mode=None)
    try:
        client.update(bucket_of(run))
    finally:
        client.close()
    assert Route.PAUSE not in server.routes() and Route.RESUME not in server.routes()


def test_transient_503s_are_retried(run, server, replica):
    server.add_fault(Route.UPDATE, 503, count=2)
    assert replica.update(bucket_of(run)).version == 5
    assert statuses_of(server, Route.UPDATE) == [503, 503, 200]


def test_refusal_is_a_replica_error_with_fields(run, server, replica):
    with pytest.raises(ReplicaError, match="/update_weights: HTTP 500: delta-sync refused the update") as refused:
        replica.update(bucket_of(run), "deltas/step_00000099.safetensors")
    error = refused.value
    assert (error.url, error.route, error.status) == (server.url, Route.UPDATE, 500)
    assert error.server_message.startswith("delta-sync refused the update: BucketFileNotFoundError")
    assert statuses_of(server, Route.UPDATE) == [500]  # a refusal is not retried
    assert not replica.status().updating  # vLLM closes the session of a failed update

    server.add_fault(Route.FINISH, 500, message="engine exploded")
    with pytest.raises(ReplicaError, match="/finish_weight_update: HTTP 500: engine exploded") as failed:
        replica.update(bucket_of(run))
    assert (failed.value.route, failed.value.status) == (Route.FINISH, 500)
    assert failed.value.server_message == "engine exploded"
    assert server.routes()[-1] == Route.RESUME and not server.paused  # resumed anyway


def test_open_session_is_finished_then_started_again(run, server, caplog):
    server.open_session()  # a trainer died between START and FINISH
    replica = Replica(server.url, retry_seconds=10.0, timeout=30.0, stale_session_seconds=0)
    with caplog.at_level(logging.WARNING, logger="delta_sync"):
        try:
            status = replica.update(bucket_of(run))
        finally:
            replica.close()
    assert status.version == 5 and not status.updating
    assert server.routes() == [Route.START, Route.COLLECTIVE_RPC, *UPDATE_ROUTES[2:-1], *UPDATE_ROUTES]
    assert statuses_of(server, Route.START) == [500, 200]
    assert "open weight update" in caplog.text


def test_start_refused_without_open_session_is_raised(run, server, replica):
    server.add_fault(Route.START, 500, count=None, message="no weight transfer engine")
    with pytest.raises(ReplicaError, match="/start_weight_update: HTTP 500: no weight transfer engine") as refused:
        replica.update(bucket_of(run))
    assert (refused.value.route, refused.value.server_message) == (Route.START, "no weight transfer engine")
    # Asked, tried once more (another client's session may have just closed), nothing finished.
    assert server.routes() == [Route.START, Route.COLLECTIVE_RPC] * 2


def test_start_refused_once_by_a_session_that_just_closed_is_tried_again(run, server, replica):
    server.add_fault(Route.START, 500, count=1, message="a weight update is already active")
    assert replica.update(bucket_of(run)).version == 5
    assert server.routes() == [Route.START, Route.COLLECTIVE_RPC, *UPDATE_ROUTES]


# -- two clients on one server ------------------------------------------------------------------


def update_in_thread(replica: Replica, bucket: str) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def update() -> None:
        try:
            outcome["status"] = replica.update(bucket)
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=update, name="second-client")
    thread.start()
    return thread, outcome


def test_a_client_waits_for_another_clients_session_instead_of_ending_it(run, server, replica):
    """A trainer pushes while a follower catches up: the second waits, then finds the
    version held (a no-op); the first finishes its own session."""
    bucket = bucket_of(run)
    with httpx.Client(base_url=server.url) as first:
        assert first.post(Route.START).status_code == 200
        thread, outcome = update_in_thread(replica, bucket)
        # Refused, then watching the open session: two looks at it, and nothing finished.
        wait_for(
            lambda: server.routes().count(Route.COLLECTIVE_RPC) >= 2, "the second client to look at the session twice"
        )
        assert Route.FINISH not in server.routes()
        assert first.post(Route.UPDATE, json={"update_info": {"bucket": bucket}}).status_code == 200
        assert first.post(Route.FINISH).status_code == 200  # its session was still its own
        thread.join(timeout=WAIT_SECONDS)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert outcome["status"].version == 5 and not outcome["status"].updating
    assert statuses_of(server, Route.START)[0] == 200 and statuses_of(server, Route.START)[-1] == 200
    assert set(statuses_of(server, Route.FINISH)) == {200}
    assert_bit_exact(run.states[5], server.receiver.weights)


def test_a_session_that_makes_no_progress_is_finished_after_the_grace(run, server, caplog):
    server.open_session()  # its client died between START and FINISH
    replica = Replica(server.url, retry_seconds=5.0, stale_session_seconds=0.3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="delta_sync"):
        try:
            status = replica.update(bucket_of(run))
        finally:
            replica.close()
    assert time.monotonic() - started >= 0.3
    assert status.version == 5 and not status.updating
    routes = server.routes()
    before_finish = routes[: routes.index(Route.FINISH)]
    assert before_finish.count(Route.COLLECTIVE_RPC) >= 2  # looked more than once before ending it
    assert "no progress" in caplog.text


def test_a_session_that_stays_open_past_the_wait_is_an_error(run, server):
    server.open_session()  # another client's, which this one must not end
    replica = Replica(server.url, retry_seconds=5.0, timeout=0.5, stale_session_seconds=60)
    try:
        with pytest.raises(ReplicaError, match="another client's weight update is still open") as busy:
            replica.update(bucket_of(run))
    finally:
        replica.close()
    assert (busy.value.route, busy.value.status) == (Route.START, 500)
    assert "still open" in str(busy.value)
    assert Route.FINISH not in server.routes() and server.updating


def test_workers_that_disagree_are_an_error(run):
    with FakeVLLM(workers=2) as server:
        client = Replica(server.url)
        try:
            assert client.update(bucket_of(run)).version == 5
            server.set_worker_status(1, model_checksum="0" * 32)
            with pytest.raises(
                ReplicaError, match=r"workers disagree on \(version, run_id, model_checksum\)"
            ) as disagree:
                client.status()
            assert disagree.value.route == Route.COLLECTIVE_RPC and "disagree" in str(disagree.value)
            server.set_worker_status(1, updating="no")
            with pytest.raises(ReplicaError, match="vllm_ext"):
                client.status()
        finally:
            client.close()


def test_dead_replica_is_unavailable_after_retries():
    server = FakeVLLM().start()
    server.stop()
    client = Replica(server.url, retry_seconds=0.5)
    try:
        with pytest.raises(ReplicaError, match="replica unreachable: .*/start_weight_update") as dead:
            client.update("file:///nowhere")
    finally:
        client.close()
    assert (dead.value.url, dead.value.route, dead.value.status) == (server.url, Route.START, None)
    assert "unreachable" in str(dead.value)


# -- ReplicaSet ---------------------------------------------------------------------------------


def announce(replicas: ReplicaSet, run: PublishedRun) -> int:
    report = run.publisher.reports[-1]
    replicas.announce(report.version, report.delta, report.model_checksum)
    return report.version


def test_replica_set_reports_a_dead_replica_and_updates_the_live_one(stepwise, server):
    dead = FakeVLLM().start()
    dead.stop()
    replicas = ReplicaSet([server.url, dead.url], bucket_of(stepwise), retry_seconds=0.5, timeout=30)
    try:
        for _ in range(2):
            version = announce(replicas, stepwise)
            behind = replicas.wait(version, timeout=WAIT_SECONDS)
            assert [state.url for state in behind] == [dead.url]
            assert behind[0].error and behind[0].version is None
            live = replicas.states[server.url]
            assert live.version == version and live.model_checksum == stepwise.publisher.reports[-1].model_checksum
            stepwise.step()
    finally:
        replicas.close()


def test_replica_that_missed_a_version_catches_up(stepwise):
    with FakeVLLM() as steady, FakeVLLM() as flaky:
        replicas = ReplicaSet([steady.url, flaky.url], bucket_of(stepwise), retry_seconds=1.0)
        try:
            assert replicas.wait(announce(replicas, stepwise), timeout=WAIT_SECONDS) == []
            flaky.add_fault(Route.START, 500, count=2, message="engine busy")  # refused, and again
            stepwise.step()
            behind = replicas.wait(announce(replicas, stepwise), timeout=WAIT_SECONDS)
            assert [state.url for state in behind] == [flaky.url] and "engine busy" in behind[0].error
            stepwise.step()
            version = announce(replicas, stepwise)
            assert replicas.wait(version, timeout=WAIT_SECONDS) == []
        finally:
            replicas.close()
        bucket = bucket_of(stepwise)
        deltas = [report.delta for report in stepwise.publisher.reports]
        assert steady.update_infos() == [
            {"bucket": bucket},
            {"bucket": bucket, "filename": deltas[1]},
            {"bucket": bucket, "filename": deltas[2]},
        ]
        assert flaky.update_infos() == [{"bucket": bucket}, {"bucket": bucket}]  # the second catches up
        for server in (steady, flaky):
            assert_bit_exact(stepwise.states[version], server.receiver.weights)


def test_checksum_mismatch_is_detected_and_retried_next_version(stepwise, server):
    replicas = ReplicaSet([server.url], bucket_of(stepwise), retry_seconds=1.0)
    try:
        report = stepwise.publisher.reports[-1]
        replicas.announce(report.version, report.delta, "0" * len(report.model_checksum))
        behind = replicas.wait(report.version, timeout=WAIT_SECONDS)
        assert [state.url for state in behind] == [server.url]
        assert report.model_checksum in behind[0].error and behind[0].version is None
        stepwise.step()
        version = announce(replicas, stepwise)
        assert replicas.wait(version, timeout=WAIT_SECONDS) == []
        assert replicas.states[server.url].model_checksum == stepwise.publisher.reports[-1].model_checksum
    finally:
        replicas.close()

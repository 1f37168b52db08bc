"""What the remote backends do when the store fails: clear errors for permanent failures,
bounded retries for transient ones, and nothing lost or half-written either way.

HF failures are injected by the Hub test double (real HTTP status codes seen by the real
huggingface_hub + hf_xet client). S3 failures come from the real SeaweedFS server (bad
credentials, a missing bucket, a port with nothing listening); where SeaweedFS cannot be
made to fail on demand (a 503, a response lost after the write) a botocore event hook on
the real client stands in for the network, and the test says so.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from delta_sync import Receiver, open_bucket
from delta_sync.errors import (
    BucketConflictError,
    BucketNotFoundError,
    BucketPermissionError,
    BucketUnavailableError,
    PublishError,
)
from delta_sync.layout import LATEST, anchor_path, delta_path
from delta_sync.replica.verify import verify_bucket

from helpers import bf16_bits, free_port
from two_tower import PublishedRun, replica_receiver

#: Generous upper bound for an operation that exhausts the tests' 4-second retry budget.
GIVE_UP_SECONDS = 30


def assert_state(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(weights)
    assert all(torch.equal(bf16_bits(expected[n]), weights[n].view(torch.int16)) for n in expected)


# -- Hugging Face ------------------------------------------------------------------------------


def test_hf_missing_bucket_is_named(hf_target):
    bucket = open_bucket("hf://buckets/user/never-created/run")
    for call in (bucket.list, lambda: bucket.read_bytes(LATEST), lambda: bucket.upload(LATEST, b"{}")):
        with pytest.raises(BucketNotFoundError, match="user/never-created"):
            call()
    with pytest.raises(BucketNotFoundError, match="bucket user/never-created not found"):
        Receiver().update("hf://buckets/user/never-created/run")


def test_hf_bad_token_and_forbidden_writes_are_permission_errors(hf_target):
    with pytest.raises(BucketPermissionError, match=r"HTTP 401.*" + hf_target.url.split("/")[4]):
        open_bucket(hf_target.url, token="hf_wrong").list()
    bucket = open_bucket(hf_target.url)
    hf_target.hub.add_fault(403, count=None, path="/batch$")
    with pytest.raises(BucketPermissionError, match=r"upload 'latest.json'.*HTTP 403.*write access"):
        bucket.upload(LATEST, b"{}")
    hf_target.hub.clear_faults()
    hf_target.hub.add_fault(401, count=None, path="xet-write-token")
    with pytest.raises(BucketPermissionError, match="HTTP 401"):
        bucket.upload(LATEST, b"{}")
    hf_target.hub.clear_faults()
    assert bucket.list() == []  # nothing half-written


def test_hf_rate_limits_and_server_errors_are_retried(hf_target):
    hub = hf_target.hub
    bucket = open_bucket(hf_target.url)
    mark = len(hub.requests)
    hub.add_fault(429, count=2, path="/batch$", retry_after=0)
    hub.add_fault(500, count=2, path="xet-write-token")
    bucket.upload(LATEST, b'{"version": 1}')
    batch = [r.status for r in hub.requests_since(mark) if r.path.endswith("/batch")]
    assert batch == [429, 429, 200]
    assert [r.status for r in hub.requests_since(mark) if "xet-write-token" in r.path][:3] == [500, 500, 200]

    mark = len(hub.requests)
    hub.add_fault(500, count=2, path="/paths-info$", retry_after=0)
    hub.add_fault(503, count=1, path="xet-read-token")
    assert bucket.read_bytes(LATEST) == b'{"version": 1}'
    assert [r.status for r in hub.requests_since(mark) if r.path.endswith("/paths-info")][:3] == [500, 500, 200]


def test_hf_persistent_failure_is_bounded_and_the_next_version_recovers(hf_target):
    hub = hf_target.hub
    run = PublishedRun(hf_target.url, versions=2, anchor_every=10)
    hub.add_fault(503, count=None, path="/batch$", retry_after=0)
    started = time.monotonic()
    with pytest.raises(PublishError, match=re.escape(delta_path(3)) + "'?: still failing after") as caught:
        run.step()
    assert time.monotonic() - started < GIVE_UP_SECONDS
    assert isinstance(caught.value.__cause__, BucketUnavailableError)
    assert delta_path(3) in str(caught.value)
    hub.clear_faults()
    # The publisher lost its place, so the next version is written as an anchor.
    version = run.step()
    assert anchor_path(version) in run.publisher.reports[-1].files
    receiver, _ = replica_receiver()
    assert receiver.update(hf_target.url).version == version
    assert_state(run.states[version], receiver.weights)
    run.close()
    assert verify_bucket(hf_target.url).ok


def test_hf_connection_refused_is_bounded(hf_target, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    bucket = open_bucket(hf_target.url)
    started = time.monotonic()
    with pytest.raises(BucketUnavailableError, match="upload 'latest.json'"):
        bucket.upload(LATEST, b"{}")
    assert time.monotonic() - started < GIVE_UP_SECONDS
    # Reads go through huggingface_hub's own backoff (about 23 s) before ours gives up.
    started = time.monotonic()
    with pytest.raises(BucketUnavailableError, match="latest.json"):
        Receiver().update(bucket)
    assert time.monotonic() - started < GIVE_UP_SECONDS + 25


# -- S3 ------------------------------------------------------------------------------------------


def test_s3_bad_credentials_are_permission_errors(s3_target, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(BucketPermissionError, match="SignatureDoesNotMatch"):
        open_bucket(s3_target.url).list()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(BucketPermissionError, match="InvalidAccessKeyId"):
        open_bucket(s3_target.url).upload(LATEST, b"{}")


def test_s3_missing_bucket_is_named(s3_target, tmp_path):
    # Writes are not checked here: SeaweedFS creates a missing bucket on an admin's first
    # write, where AWS answers NoSuchBucket (the error code the reads below map).
    bucket = open_bucket("s3://no-such-bucket/run")
    for call in (bucket.list, lambda: bucket.read_bytes(LATEST), lambda: bucket.download(LATEST, tmp_path / "x")):
        with pytest.raises(BucketNotFoundError, match="'no-such-bucket' does not exist"):
            call()
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        Receiver().update("s3://no-such-bucket/run")


def test_s3_create_option_creates_the_bucket(s3_target):
    name = "created-" + s3_target.url.rsplit("/", 1)[1]
    bucket = open_bucket(f"s3://{name}/run", create=True)
    bucket.upload(LATEST, b"{}")
    assert open_bucket(f"s3://{name}/run", create=True).list() == [LATEST]  # exists already: fine


def test_s3_connection_refused_is_bounded(s3_target, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    bucket = open_bucket(s3_target.url)
    for call in (lambda: bucket.upload(LATEST, b"{}"), lambda: Receiver().update(bucket)):
        started = time.monotonic()
        with pytest.raises(BucketUnavailableError, match=LATEST):
            call()
        assert time.monotonic() - started < GIVE_UP_SECONDS


def test_s3_server_errors_are_retried(s3_target):
    # SeaweedFS cannot be told to fail; a botocore hook answers the first two requests with
    # 503 SlowDown before they leave the client, as an overloaded S3 would.
    from botocore.awsrequest import AWSResponse

    bucket = open_bucket(s3_target.url)
    failures = {"left": 2}

    class Raw:
        def stream(self, **kwargs):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def overloaded(request, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            return AWSResponse(request.url, 503, {}, Raw())
        return None

    bucket._client.meta.events.register_first("before-send.s3", overloaded)
    bucket.upload(LATEST, b'{"version": 1}')
    assert failures["left"] == 0 and bucket.read_bytes(LATEST) == b'{"version": 1}'


def test_s3_retried_conditional_write_recognises_its_own_earlier_success(s3_target):
    # The PUT reaches the server and succeeds, but its answer is lost on the way back (a
    # botocore hook raises the connection error a dropped response would). The retry meets
    # 412 Precondition Failed and must see from the stored digest that the object is its own.
    from botocore.exceptions import ConnectionClosedError

    bucket = open_bucket(s3_target.url)
    dropped = []

    def drop_answer(http_response, **kwargs):
        if not dropped:
            dropped.append(http_response.status_code)
            raise ConnectionClosedError(endpoint_url=s3_target.env["AWS_ENDPOINT_URL"])

    bucket._client.meta.events.register("after-call.s3.PutObject", drop_answer)
    bucket.upload(delta_path(2), b"version two", overwrite=False)
    assert dropped == [200] and bucket.read_bytes(delta_path(2)) == b"version two"
    with pytest.raises(BucketConflictError, match=re.escape(f"'{delta_path(2)}' already exists")):
        bucket.upload(delta_path(2), b"someone else's version two", overwrite=False)


def test_s3_concurrent_conditional_writes_have_exactly_one_winner(s3_target, tmp_path):
    bucket = open_bucket(s3_target.url)
    path = anchor_path(1)
    start = threading.Barrier(8)

    def write(i: int) -> str:
        start.wait()
        try:
            bucket.upload(path, f"trainer {i}".encode() * 1000, overwrite=False)
            return f"won {i}"
        except BucketConflictError:
            return "lost"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(write, range(8)))
    winners = [o for o in outcomes if o != "lost"]
    assert len(winners) == 1, outcomes
    winner = int(winners[0].split()[1])
    assert bucket.read_bytes(path) == f"trainer {winner}".encode() * 1000


def test_s3_multipart_conditional_write(s3_target, tmp_path):
    bucket = open_bucket(s3_target.url, multipart_bytes=5 << 20)
    source = tmp_path / "anchor.bin"
    source.write_bytes(torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes())
    bucket.upload(anchor_path(1), source, overwrite=False)
    bucket.upload(anchor_path(1), source, overwrite=False)  # its own: accepted
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * (6 << 20))
    with pytest.raises(BucketConflictError, match=re.escape(f"'{anchor_path(1)}' already exists")):
        bucket.upload(anchor_path(1), other, overwrite=False)
    bucket.download(anchor_path(1), tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    # No multipart upload is left behind to cost storage.
    listing = bucket._client.list_multipart_uploads(Bucket=bucket.name, Prefix=bucket.prefix)
    assert not listing.get("Uploads")

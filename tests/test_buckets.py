"""One suite for every bucket backend: local directory, Hugging Face Bucket, S3.

The HF tests run the real huggingface_hub + hf_xet client against the Hub test double
(tests/hub_server.py); the S3 tests run boto3 against a real SeaweedFS server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
import torch

from delta_sync import BF16ChangeDetector, Publisher, open_bucket
from delta_sync.errors import (
    BucketConflictError,
    BucketFileNotFoundError,
    BucketPathError,
    OversizedFileError,
    PublishError,
)
from delta_sync.layout import LATEST, anchor_path, delta_path, step_versions
from delta_sync.replica.verify import verify_bucket
from delta_sync.storage.cache import DownloadCache

import helpers
from helpers import bf16_bits
from two_tower import PublishedRun, TwoTower, bf16_state, replica_receiver, train_step


def cli(target, *args: str) -> subprocess.CompletedProcess:
    """The command line, run with the environment that reaches the target's bucket."""
    return helpers.cli(*args, env=target.subprocess_env())


def assert_state(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(weights)
    for name, tensor in expected.items():
        assert torch.equal(bf16_bits(tensor), weights[name].view(torch.int16)), f"{name} differs"


def test_round_trip(bucket_target, tmp_path):
    bucket = open_bucket(bucket_target.url)
    assert bucket.url == bucket_target.url and bucket.list() == []
    source = tmp_path / "anchor.bin"
    payload = torch.randint(0, 256, (3_000_000,), dtype=torch.uint8).numpy().tobytes()
    source.write_bytes(payload)
    bucket.upload("anchors/step_00000001.safetensors", source, overwrite=False)
    bucket.upload("deltas/step_00000002.safetensors", b"delta two")
    bucket.upload(LATEST, b'{"version": 1}')
    bucket.upload(LATEST, b'{"version": 2}')  # overwrite=True replaces
    assert bucket.list() == ["anchors/step_00000001.safetensors", "deltas/step_00000002.safetensors", LATEST]
    assert bucket.list("anchors") == ["anchors/step_00000001.safetensors"]
    assert bucket.list("anchor") == []  # a directory, not a string prefix
    assert bucket.read_bytes(LATEST) == b'{"version": 2}'
    dest = tmp_path / "down" / "anchor.bin"
    bucket.download("anchors/step_00000001.safetensors", dest)
    assert dest.read_bytes() == payload
    assert sorted(p.name for p in dest.parent.iterdir()) == ["anchor.bin"]  # no temporary files left
    bucket.delete(["deltas/step_00000002.safetensors", "deltas/step_00000099.safetensors"])  # missing: ignored
    assert bucket.list("deltas") == []
    with pytest.raises(BucketFileNotFoundError, match=re.escape("no file 'deltas/step_00000002.safetensors'")):
        bucket.read_bytes("deltas/step_00000002.safetensors")


def test_overwrite_false_refuses_other_content_but_accepts_its_own(bucket_target):
    bucket = open_bucket(bucket_target.url)
    path = delta_path(3)
    bucket.upload(path, b"first writer", overwrite=False)
    bucket.upload(path, b"first writer", overwrite=False)  # a retry meeting its own earlier write
    with pytest.raises(BucketConflictError, match=re.escape(f"'{path}' already exists")) as caught:
        bucket.upload(path, b"second writer", overwrite=False)
    assert bucket_target.url in str(caught.value) and path in str(caught.value)
    assert bucket.read_bytes(path) == b"first writer"


def test_two_publishers_on_one_prefix_cannot_overwrite_each_other(bucket_target):
    torch.manual_seed(0)
    publishers = []
    for _ in (1, 2):
        model = TwoTower()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        detector = BF16ChangeDetector(model, optimizer)
        # Both start before either has written anything, so both claim the empty prefix.
        publishers.append((Publisher(bucket_target.url, detector, background=False), model, optimizer, detector))
    (first, model_a, opt_a, det_a), (second, model_b, opt_b, det_b) = publishers
    train_step(model_a, opt_a, seed=1)
    first.publish(1)
    train_step(model_b, opt_b, seed=2)
    with pytest.raises(PublishError, match=re.escape(f"'{anchor_path(1)}' already exists")) as caught:
        second.publish(1)
    assert isinstance(caught.value.__cause__, BucketConflictError)
    assert anchor_path(1) in str(caught.value)
    for publisher, detector in ((first, det_a), (second, det_b)):
        publisher.close()
        detector.close()
    receiver, replica = replica_receiver()
    assert receiver.update(bucket_target.url).version == 1
    assert receiver.run_id == first.run_id
    assert_state(bf16_state(model_a), receiver.weights)


def test_a_reader_never_sees_a_partial_file(bucket_target, tmp_path):
    bucket = open_bucket(bucket_target.url)
    if bucket_target.kind == "s3":
        bucket.multipart_bytes = 5 << 20  # exercise the multipart path too
    source = tmp_path / "big.bin"
    payload = torch.randint(0, 256, (11 << 20,), dtype=torch.uint8).numpy().tobytes()
    source.write_bytes(payload)
    path = anchor_path(7)
    writer = threading.Thread(target=bucket.upload, args=(path, source), kwargs={"overwrite": False})
    writer.start()
    seen = []
    while writer.is_alive():
        if path in bucket.list("anchors"):
            seen.append(bucket.read_bytes(path))
    writer.join()
    seen.append(bucket.read_bytes(path))
    assert all(content == payload for content in seen)


def test_paths_that_escape_the_prefix_are_refused(bucket_target, tmp_path):
    bucket = open_bucket(bucket_target.url)
    for bad in ("../escape.bin", "/etc/passwd", "anchors/../../x", "a//b", "", "a\\b"):
        named = re.escape(repr(bad))  # every refusal names the path it refuses
        with pytest.raises(BucketPathError, match=named):
            bucket.upload(bad, b"x")
        with pytest.raises(BucketPathError, match=named):
            bucket.read_bytes(bad)
        with pytest.raises(BucketPathError, match=named):
            bucket.download(bad, tmp_path / "x")
    with pytest.raises(BucketPathError, match=re.escape("path '../x' must not contain '..'")):
        bucket.delete(["../x"])
    with pytest.raises(BucketPathError, match=re.escape("path '../' must not contain '..'")):
        bucket.list("../")
    if bucket_target.kind != "local":
        with pytest.raises(BucketPathError, match=re.escape("/../other-run' must not contain '..'")):
            open_bucket(bucket_target.url + "/../other-run")


def test_a_missing_file_error_names_bucket_and_path(bucket_target, tmp_path):
    bucket = open_bucket(bucket_target.url)
    path = delta_path(42)
    for call in (
        lambda: bucket.read_bytes(path),
        lambda: bucket.download(path, tmp_path / "dest" / "file"),
        lambda: DownloadCache(tmp_path / "cache").fetch(bucket, path),
    ):
        with pytest.raises(BucketFileNotFoundError, match=re.escape(f"no file '{path}'")) as caught:
            call()
        assert bucket_target.url in str(caught.value) and path in str(caught.value)
    # Nothing partial is left behind, neither at the destination nor in the cache.
    assert not (tmp_path / "dest" / "file").exists()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


def test_a_file_larger_than_allowed_is_refused_before_it_is_copied(bucket_target, tmp_path):
    """`max_bytes` on every backend: the store's own size is checked before the bytes move."""
    bucket = open_bucket(bucket_target.url)
    bucket.upload(delta_path(2), b"x" * 1000)
    cache = DownloadCache(tmp_path / "cache")
    for call in (
        lambda: bucket.download(delta_path(2), tmp_path / "dest" / "file", max_bytes=999),
        lambda: cache.fetch(bucket, delta_path(2), max_bytes=999),
    ):
        with pytest.raises(OversizedFileError, match=re.escape(f"{delta_path(2)}: 1,000 bytes, more than the 999")):
            call()
    assert not (tmp_path / "dest" / "file").exists()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []
    bucket.download(delta_path(2), tmp_path / "dest" / "file", max_bytes=1000)  # at the limit: fine
    assert (tmp_path / "dest" / "file").stat().st_size == 1000
    # A copy already cached under a looser bound is refused under a tighter one.
    cache.fetch(bucket, delta_path(2))
    with pytest.raises(OversizedFileError):
        cache.fetch(bucket, delta_path(2), max_bytes=10)


def test_publish_and_replay_bit_exactly(bucket_target):
    run = PublishedRun(bucket_target.url, versions=1, anchor_every=3, keep_anchors=2)
    receiver, replica = replica_receiver()
    receiver.update(bucket_target.url)
    for _ in range(5):
        version = run.step()
        result = receiver.update(bucket_target.url)
        assert result.version == version and [p.rsplit("/", 2)[-2] for p in result.applied] == ["deltas"]
        assert_state(run.states[version], receiver.weights)
        assert_state(run.states[version], {n: p.detach() for n, p in replica.named_parameters()})
    # A replica joining late starts from the newest anchor.
    late, _ = replica_receiver()
    applied = late.update(bucket_target.url).applied
    assert applied[0].endswith(anchor_path(4)) and applied[1:] == (
        f"{bucket_target.url}/{delta_path(5)}",
        f"{bucket_target.url}/{delta_path(6)}",
    )
    assert_state(run.states[6], late.weights)
    run.close()
    # Retention kept two anchors and the deltas after the oldest.
    files = open_bucket(bucket_target.url).list()
    assert step_versions(files, "anchor") == [1, 4] and step_versions(files, "delta") == [2, 3, 4, 5, 6]

    result = cli(bucket_target, "verify", bucket_target.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verification passed (latest v6, replayed v6)" in result.stdout
    summary = json.loads(cli(bucket_target, "inspect", f"{bucket_target.url}/{delta_path(6)}", "--json").stdout)
    assert summary["kind"] == "delta" and summary["version"] == 6 and summary["base_version"] == 5


def test_catch_up_starts_over_when_a_file_disappears_under_it(bucket_target):
    run = PublishedRun(bucket_target.url, versions=1, anchor_every=3, keep_anchors=2)
    receiver, _ = replica_receiver()
    receiver.update(bucket_target.url)
    for _ in range(4):
        run.step()
    bucket = open_bucket(bucket_target.url)
    listed = bucket.list

    def list_then_lose_a_delta(prefix: str = "") -> list[str]:
        # The publisher's retention (or an operator) removes delta 2 right after the replica listed it.
        files = listed(prefix)
        if prefix == "deltas" and delta_path(2) in files:
            bucket.delete([delta_path(2)])
        return files

    bucket.list = list_then_lose_a_delta
    result = receiver.update(bucket)
    assert result.version == 5
    assert result.applied[0].endswith(anchor_path(4)) and result.applied[-1].endswith(delta_path(5))
    assert_state(run.states[5], receiver.weights)
    run.close()


@pytest.mark.slow
def test_grpo_trainer_publishes_and_a_replica_follows_bit_exactly(bucket_target, tmp_path):
    from delta_sync import DeltaSyncCallback, Receiver

    from trainers import FollowingReplica, grpo_trainer, same_bits, trainer_bits

    sync = DeltaSyncCallback(bucket=bucket_target.url, anchor_every=3, anchor_bytes_ratio=None)
    replica = FollowingReplica(sync, bucket_target.url)
    trainer = grpo_trainer(tmp_path, [sync, replica], steps=4)
    trainer.train()
    assert [step for step, _, _ in replica.results] == [1, 2, 3, 4]
    assert all(exact for _, exact, _ in replica.results), replica.results
    assert [report.kind for report in sync.reports] == ["anchor", "delta", "delta", "delta+anchor"]
    assert verify_bucket(bucket_target.url).ok
    late = Receiver()
    assert late.update(bucket_target.url).version == 4
    assert same_bits(trainer_bits(trainer.model), late.weights)


def route(path: str) -> str:
    """The Hub API route of a request path, without bucket and file names."""
    for name in ("resolve", "tree", "paths-info", "batch", "xet-read-token", "xet-write-token"):
        if f"/{name}" in path:
            return name
    return path


class RequestCounter:
    """Counts the HTTP requests a remote bucket sends: from the Hub test double's log for
    HF, from the botocore client's send events (each one an HTTP request) for S3."""

    def __init__(self, target, *buckets) -> None:
        self.target = target
        self.s3_requests: list[str] = []
        for bucket in buckets:
            if target.kind == "s3":
                bucket._client.meta.events.register(
                    "before-send.s3", lambda request, **kw: self.s3_requests.append(kw["event_name"].rsplit(".", 1)[1])
                )
        self.mark()

    def mark(self) -> None:
        self._hf_mark = len(self.target.hub.requests) if self.target.kind == "hf" else 0
        self._s3_mark = len(self.s3_requests)

    def take(self) -> list[str]:
        if self.target.kind == "hf":
            names = [f"{r.method} {route(r.path)}" for r in self.target.hub.requests_since(self._hf_mark)]
        else:
            names = self.s3_requests[self._s3_mark :]
        self.mark()
        return names


@pytest.mark.parametrize("bucket_target", ["hf", "s3"], indirect=True)
def test_requests_and_bytes_per_step(bucket_target, capsys):
    """What one training step costs in requests and bytes (the numbers in docs/buckets.md)."""
    publisher_bucket, replica_bucket = open_bucket(bucket_target.url), open_bucket(bucket_target.url)
    counter = RequestCounter(bucket_target, publisher_bucket, replica_bucket)
    run = PublishedRun(publisher_bucket, versions=1, anchor_every=3, keep_anchors=1)
    receiver, _ = replica_receiver()
    receiver.update(replica_bucket)
    counter.take()
    rows = {}
    run.step()  # v2: a delta
    rows["trainer, delta step"] = counter.take()
    receiver.update(replica_bucket)
    rows["replica, catch-up by latest.json"] = counter.take()
    run.step()  # v3: a delta, announced to the replica by name
    counter.take()
    receiver.update(replica_bucket, delta_path(3))
    rows["replica, told the file name"] = counter.take()
    run.step()  # v4: delta + anchor, then retention deletes anchor 1 and deltas 2-4
    rows["trainer, delta+anchor step with retention"] = counter.take()
    report = run.publisher.reports[1]
    run.close()
    with capsys.disabled():
        print(
            f"\n{bucket_target.kind}: delta file {report.delta_bytes:,} B, all files {report.bytes_written:,} B "
            f"per delta step (model {sum(t.numel() * 2 for t in run.states[1].values()):,} B)"
        )
        for label, names in rows.items():
            print(f"  {label}: {len(names)} requests: {', '.join(names)}")
    if bucket_target.kind == "s3":
        assert rows["trainer, delta step"] == ["PutObject", "PutObject"]
        assert rows["replica, catch-up by latest.json"] == ["GetObject", "ListObjectsV2", "GetObject"]
        # latest.json first (a file is never applied past it, nor from another start of the run).
        assert rows["replica, told the file name"] == ["GetObject", "GetObject"]
    else:
        assert len(rows["trainer, delta step"]) <= 8
        assert len(rows["replica, catch-up by latest.json"]) <= 10


@pytest.mark.slow
@pytest.mark.parametrize("bucket_target", ["hf", "s3"], indirect=True)
def test_the_example_takes_a_bucket_url(bucket_target):
    env = {**bucket_target.subprocess_env(), "PYTHONPATH": str(helpers.REPO)}
    result = subprocess.run(
        [
            sys.executable,
            "examples/grpo_delta_sync.py",
            "--bucket",
            bucket_target.url,
            "--steps",
            "3",
            "--anchor-every",
            "2",
        ],
        cwd=helpers.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"replica bit-exact\s+yes", result.stdout)
    assert f"delta-sync verify {bucket_target.url}" in result.stdout
    verify = cli(bucket_target, "verify", bucket_target.url)
    assert verify.returncode == 0 and "verification passed (latest v3, replayed v3)" in verify.stdout, verify.stdout

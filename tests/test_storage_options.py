"""Bucket URLs, options, retry policy and progress bars, without any server."""

from __future__ import annotations

import io
import re

import pytest

from delta_sync import LocalBucket, open_bucket
from delta_sync.errors import BucketError, BucketPathError, BucketUnavailableError
from delta_sync.storage import RetryPolicy
from delta_sync.storage.hf import parse_hf_url
from delta_sync.storage.progress import show_progress, transfer_progress
from delta_sync.storage.s3 import parse_s3_url


def test_urls_parse_into_bucket_and_prefix():
    assert parse_hf_url("hf://buckets/me/deltas") == ("me/deltas", "")
    assert parse_hf_url("hf://buckets/org/deltas/runs/run1/") == ("org/deltas", "runs/run1")
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    assert parse_s3_url("s3://bucket/runs/run1") == ("bucket", "runs/run1")
    # Each refusal names the URL, or the part of its prefix at fault.
    for parse, bad, named in [
        (parse_hf_url, "hf://buckets/me", "'hf://buckets/me' lacks a namespace and a bucket name"),
        (parse_hf_url, "hf://me/deltas", "not a Hugging Face bucket URL: 'hf://me/deltas'"),
        (parse_hf_url, "hf://buckets//x", "'hf://buckets//x' lacks a namespace and a bucket name"),
        (parse_hf_url, "hf://buckets/me/deltas/../x", "path '../x' must not contain '..'"),
        (parse_s3_url, "s3://", "'s3://' lacks a bucket name"),
        (parse_s3_url, "s3:///prefix", "'s3:///prefix' lacks a bucket name"),
        (parse_s3_url, "s3://bucket/../x", "path '../x' must not contain '..'"),
        (parse_s3_url, "gs://bucket", "not an S3 URL: 'gs://bucket'"),
    ]:
        with pytest.raises(BucketPathError, match=re.escape(named)):
            parse(bad)


def test_open_bucket_picks_the_backend_by_scheme(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert isinstance(open_bucket(tmp_path), LocalBucket)
    assert type(open_bucket("s3://bucket/run1")).__name__ == "S3Bucket"
    assert type(open_bucket("hf://buckets/me/deltas/run1")).__name__ == "HFBucket"
    assert open_bucket("hf://buckets/me/deltas/run1/").url == "hf://buckets/me/deltas/run1"
    with pytest.raises(BucketError, match="unsupported bucket URL 'gs://b'"):
        open_bucket("gs://b")
    with pytest.raises(TypeError, match="takes no options"):
        open_bucket(tmp_path, create=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        open_bucket("s3://bucket", no_such_option=1)


def test_retry_policy_retries_transient_errors_only_and_gives_up_in_time(monkeypatch):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "done"

    policy = RetryPolicy(max_seconds=5, initial_wait=0.01, max_wait=0.02)
    assert policy.call(flaky, transient=lambda e: isinstance(e, ConnectionError), what="op") == "done"
    assert len(calls) == 3

    def permanent():
        raise PermissionError("no")

    with pytest.raises(PermissionError, match="^no$"):  # the error itself, not retried or wrapped
        policy.call(permanent, transient=lambda e: isinstance(e, ConnectionError), what="op")

    def down():
        raise ConnectionError("refused")

    with pytest.raises(BucketUnavailableError, match=r"s3://b: read 'x': still failing after 4 attempt\(s\)"):
        RetryPolicy(max_seconds=5, max_attempts=4, initial_wait=0.01, max_wait=0.01).call(
            down, transient=lambda e: True, what="s3://b: read 'x'"
        )
    monkeypatch.setenv("DELTA_SYNC_RETRY_SECONDS", "7.5")
    monkeypatch.setenv("DELTA_SYNC_RETRY_ATTEMPTS", "3")
    assert RetryPolicy.from_env() == RetryPolicy(max_seconds=7.5, max_attempts=3)
    monkeypatch.setenv("DELTA_SYNC_RETRY_SECONDS", "soon")
    with pytest.raises(ValueError, match="DELTA_SYNC_RETRY_SECONDS"):
        RetryPolicy.from_env()
    with pytest.raises(ValueError, match="max_attempts must be >= 1, got 0"):
        RetryPolicy(max_attempts=0)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_for_large_files_on_a_terminal(monkeypatch):
    monkeypatch.setenv("DELTA_SYNC_PROGRESS_MIN_BYTES", "1000")
    assert show_progress(1000, Terminal())
    assert not show_progress(999, Terminal())
    assert not show_progress(10**9, io.StringIO())  # not a terminal: no bar
    screen = Terminal()
    with transfer_progress("upload anchors/step_00000001.safetensors", 4096, screen) as update:
        update(4096)
    assert "anchors/step_00000001.safetensors" in screen.getvalue()
    quiet = io.StringIO()
    with transfer_progress("upload", 4096, quiet) as update:
        update(4096)
    assert quiet.getvalue() == ""


def test_local_bucket_shows_progress_for_large_files_on_a_terminal(tmp_path, monkeypatch):
    from delta_sync.storage import progress

    screen = Terminal()
    monkeypatch.setattr(progress.sys, "stderr", screen)
    monkeypatch.setenv("DELTA_SYNC_PROGRESS_MIN_BYTES", "1000")
    source = tmp_path / "anchor.bin"
    source.write_bytes(b"x" * 5000)
    bucket = LocalBucket(tmp_path / "bucket")
    bucket.upload("anchors/step_00000001.safetensors", source)
    bucket.download("anchors/step_00000001.safetensors", tmp_path / "back.bin")
    shown = screen.getvalue()
    assert "upload anchors/step_00000001.safetensors" in shown and "download anchors/step_00000001" in shown
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
